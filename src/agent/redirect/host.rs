//! Host probe SNAT in the node's own (host) network namespace, as istio-cni's nftables backend
//! programs it (spec §4.7, `cni/pkg/nftables/testdata/hostprobe.golden`).
//!
//! Kubelet probes to an enrolled pod must reach the pod from the probe address (169.254.7.127, v6
//! [`crate::mesh::DEFAULT_PROBE_V6`]): the in-pod rules let TCP from that address past the proxy.
//! So in the host netns one `inet` table [`HOST_NAT_TABLE`] holds
//! - the sets [`PROBE_SET_V4`] (`ipv4_addr`) and, with IPv6, [`PROBE_SET_V6`] (`ipv6_addr`) of
//!   enrolled pod addresses, each element commented with its pod's UID;
//! - chain `postrouting { type nat hook postrouting priority 100 ; }` with
//!   `meta l4proto tcp skuid <kubelet uid> ip daddr @istio-inpod-probes-v4 counter snat to
//!   169.254.7.127` (and the `ip6` twin with IPv6).
//!
//! The table has the same name as the in-pod nat table ([`super::NAT_TABLE`]) but lives in another
//! namespace and holds other things: [`HostProbe`] and [`super::RedirectPlan`] are separate types and
//! never touch each other's table.
//!
//! Life cycle (spec §3.2 step 2b/2d, §3.5 step 5, §3.7 step 1, §3.10): at startup [`HostProbe::apply`]
//! (creates the sets, replaces the rules, keeps set elements) then [`HostProbe::sync`] with the
//! snapshot of enrolled pods; per pod [`HostProbe::add_pod`] after the proxy acked it and
//! [`HostProbe::remove_pod`] on removal; [`HostProbe::is_applied`] to repair rules someone flushed;
//! [`HostProbe::remove`] on uninstall. Every call is blocking and acts on the calling thread's
//! network namespace: the agent's own, which is the host's.
//!
//! The kubelet's UID comes from [`kubelet::find_kubelet_uid`] (or configuration).

pub mod kubelet;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::mesh::{DEFAULT_PROBE_V4, DEFAULT_PROBE_V6};
use crate::nft::{
    self, Batch, Chain, ChainHook, ChainType, Command, Hook, NftError, Rule, Set, SetElem,
    SetElems, SetKeyType, Table,
};

use super::rule_spec::{Action, Dir, Match, Proto, RuleSpec, rule};

pub use kubelet::{DEFAULT_PROC_ROOT, KubeletUidError, find_kubelet_uid, resolve_kubelet_uid};

/// The host table (`inet`). Same name as the in-pod nat table, in the host netns.
pub const HOST_NAT_TABLE: &str = "istio-ambient-nat";
/// The host table's base chain.
pub const POSTROUTING_CHAIN: &str = "postrouting";
/// Set of enrolled pods' IPv4 addresses (`ipv4_addr`; istio-cni's ipset name, kept for nft).
pub const PROBE_SET_V4: &str = "istio-inpod-probes-v4";
/// Set of enrolled pods' IPv6 addresses (`ipv6_addr`).
pub const PROBE_SET_V6: &str = "istio-inpod-probes-v6";
/// Comment of both sets, istio-cni's wording.
pub const PROBE_SET_COMMENT: &str = "UUID of the pods that are part of ambient mesh";
/// Priority of the postrouting nat chain (`srcnat`).
pub const POSTROUTING_PRIORITY: i32 = 100;

/// Elements per add command of [`HostProbe::sync_batch`] (~60 bytes each with a pod UID comment,
/// so a command stays well below the 64 KiB attribute limit).
const ELEMS_PER_COMMAND: usize = 256;

/// Serialises the read-then-write updates of the probe sets ([`HostProbe::add_pod`],
/// [`HostProbe::remove_pod`], [`HostProbe::remove_uid`], [`HostProbe::sync`]) within the process,
/// so one pod's update never works from a listing another one is changing.
static UPDATES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn updating() -> std::sync::MutexGuard<'static, ()> {
    UPDATES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The host probe rule set of one node: who the kubelet is and which addresses probes are SNATed
/// to. Pure data; the methods program it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostProbe {
    /// Real UID of the kubelet process ([`kubelet::find_kubelet_uid`]): only its sockets' TCP is
    /// SNATed.
    pub kubelet_uid: u32,
    /// Also SNAT IPv6 probes (the v6 set and rule exist only then).
    pub ipv6: bool,
    /// IPv4 probe SNAT address (istio-cni `HOST_PROBE_SNAT_IP`); must match the in-pod rules.
    pub probe_v4: Ipv4Addr,
    /// IPv6 probe SNAT address (istio-cni `HOST_PROBE_SNAT_IPV6`).
    pub probe_v6: Ipv6Addr,
}

/// One element of a probe set: a pod address and the pod UID in its comment.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProbeEntry {
    /// The pod's address.
    pub ip: IpAddr,
    /// The owning pod's UID (the element's comment; `None` when someone added it without one).
    pub uid: Option<String>,
}

/// Errors programming or reading the host probe rules.
#[derive(Debug, thiserror::Error)]
pub enum HostProbeError {
    /// An nf_tables transaction or listing in the host netns failed (a failed transaction is rolled
    /// back as a whole). ENOENT from the element operations ([`HostProbe::sync`],
    /// [`HostProbe::add_pod`], [`HostProbe::remove_pod`], [`HostProbe::remove_uid`],
    /// [`HostProbe::entries`]) means the sets are missing: [`HostProbe::apply`] first.
    #[error("host probe nftables: {0}")]
    Nft(#[from] NftError),
    /// The blocking task that programmed the rules died.
    #[error("host probe worker task failed")]
    Task,
}

impl HostProbe {
    /// IPv4 only, Istio's default probe addresses.
    pub fn new(kubelet_uid: u32) -> HostProbe {
        HostProbe {
            kubelet_uid,
            ipv6: false,
            probe_v4: DEFAULT_PROBE_V4,
            probe_v6: DEFAULT_PROBE_V6,
        }
    }

    /// The rules as istio-cni's nft script (`hostprobe.golden`, `hostprobe_ipv6.golden`): add +
    /// flush of the table, the chain, the rules. The sets are not in it (istio-cni creates them
    /// separately): see [`HostProbe::render_sets_script`]. Pure.
    pub fn render_script(&self) -> String {
        let table = format!("inet {HOST_NAT_TABLE}");
        let mut out = format!("add table {table}\nflush table {table}\n");
        out.push_str(&format!(
            "add chain {table} {POSTROUTING_CHAIN} {{ type nat hook postrouting priority {POSTROUTING_PRIORITY} ; }}\n"
        ));
        for r in self.rules() {
            out.push_str(&format!("add rule {table} {} {}\n", r.chain, r.script()));
        }
        out
    }

    /// The sets as an nft script (`add table`, then `add set ... { type ipv4_addr ; comment "..." ;
    /// }` per set), to run before [`HostProbe::render_script`] in a namespace without them. Pure.
    pub fn render_sets_script(&self) -> String {
        let mut out = format!("add table inet {HOST_NAT_TABLE}\n");
        for s in self.sets() {
            out.push_str(&format!(
                "add set inet {HOST_NAT_TABLE} {} {{ type {} ; comment \"{PROBE_SET_COMMENT}\" ; }}\n",
                s.name,
                s.key_type.name()
            ));
        }
        out
    }

    /// The batch [`HostProbe::apply`] sends: add table, flush table (rules only), add the sets
    /// (no-op when present, elements kept; without IPv6 the v6 set is added and deleted, so it
    /// goes), the chain and the rules.
    pub fn apply_batch(&self) -> Batch {
        let table = host_table();
        let mut b = Batch::new();
        b.push(Command::AddTable(table.clone()))
            .push(Command::FlushTable(table.clone()));
        for set in self.sets() {
            b.push(Command::AddSet(set));
        }
        if !self.ipv6 {
            b.push(Command::AddSet(probe_set(SetKeyType::Ipv6Addr)))
                .push(Command::DelSet {
                    table: table.clone(),
                    name: PROBE_SET_V6.into(),
                });
        }
        b.push(Command::AddChain(Chain {
            table: table.clone(),
            name: POSTROUTING_CHAIN.into(),
            hook: Some(ChainHook {
                chain_type: ChainType::Nat,
                hook: Hook::Postrouting,
                priority: POSTROUTING_PRIORITY,
            }),
        }));
        for r in self.rules() {
            b.push(Command::AddRule(Rule {
                table: table.clone(),
                chain: r.chain.into(),
                exprs: r.exprs(),
            }));
        }
        b
    }

    /// Installs or repairs the rules in one transaction ([`HostProbe::apply_batch`]): the table,
    /// the sets and the chain are created when missing, the table's rules are replaced by ours,
    /// existing set elements are kept. Idempotent; applying a changed `HostProbe` (other kubelet
    /// UID, IPv6 turned off) converges to it. Follows istio-cni's add + flush (spec §4.7, §4.9).
    pub fn apply(&self) -> Result<(), HostProbeError> {
        Ok(self.apply_batch().commit()?)
    }

    /// Whether the rules are in place as [`HostProbe::apply`] leaves them: the table and sets exist
    /// and the chain holds exactly our rules (expression types and constants in order, see
    /// [`nft::RuleSummary::matches`]). False after someone flushed or deleted the table, or when
    /// another configuration (kubelet UID, probe address, IPv6) is applied.
    pub fn is_applied(&self) -> Result<bool, HostProbeError> {
        let table = host_table();
        if !nft::table_exists(&table)? {
            return Ok(false);
        }
        for set in self.sets() {
            if !nft::set_exists(&table, &set.name)? {
                return Ok(false);
            }
        }
        let listed = nft::list_rules(&table, POSTROUTING_CHAIN)?;
        let ours = self.rules();
        Ok(listed.len() == ours.len()
            && listed.iter().zip(&ours).all(|(l, r)| l.matches(&r.exprs())))
    }

    /// Uninstall (spec §3.10): deletes the table with its rules, sets and elements, in one
    /// transaction (add + delete, so it succeeds when nothing is there).
    pub fn remove(&self) -> Result<(), HostProbeError> {
        let mut b = Batch::new();
        b.push(Command::AddTable(host_table()))
            .push(Command::DelTable(host_table()));
        Ok(b.commit()?)
    }

    /// Makes the sets hold exactly the addresses of `pods` (pod UID, its IPs), each commented with
    /// its UID, in one transaction ([`HostProbe::sync_batch`]): both sets are flushed and refilled.
    /// An address listed for two pods goes to the first. IPv4-mapped IPv6 addresses count as IPv4;
    /// IPv6 addresses are skipped when IPv6 is off (as istio-cni). The sets must exist
    /// ([`HostProbe::apply`]). istio-cni's startup sync (spec §4.7) skips pruning while some
    /// enrolled pod has no IP yet: a caller doing the same uses [`HostProbe::add_pod`] per pod
    /// instead.
    pub fn sync(&self, pods: &[(String, Vec<IpAddr>)]) -> Result<(), HostProbeError> {
        let _serial = updating();
        Ok(self.sync_batch(pods).commit()?)
    }

    /// The batch [`HostProbe::sync`] sends: per set a flush, then the elements in commands of at
    /// most 256 (the element list is one attribute with a 16-bit length). Pure.
    pub fn sync_batch(&self, pods: &[(String, Vec<IpAddr>)]) -> Batch {
        let mut wanted: BTreeMap<IpAddr, &str> = BTreeMap::new();
        for (uid, ips) in pods {
            for ip in self.usable(ips) {
                wanted.entry(ip).or_insert(uid);
            }
        }
        let mut b = Batch::new();
        for set in self.sets() {
            b.push(Command::FlushSet {
                table: host_table(),
                name: set.name.clone(),
            });
            let elems: Vec<SetElem> = wanted
                .iter()
                .filter(|(ip, _)| SetKeyType::of(ip) == set.key_type)
                .map(|(ip, uid)| SetElem::addr(*ip, Some((*uid).to_owned())))
                .collect();
            for chunk in elems.chunks(ELEMS_PER_COMMAND) {
                b.push(Command::AddSetElems(set_elems(&set.name, chunk.to_vec())));
            }
        }
        b
    }

    /// Adds (upserts) the pod's addresses with comment `uid`, in one transaction (spec §3.5 step 5):
    /// an address already present, even with another pod's UID, ends up with `uid`. Addresses are
    /// treated as in [`HostProbe::sync`]. Nothing to add sends nothing.
    ///
    /// Only an address the sets hold with another comment is replaced (add + delete + add: a
    /// delete makes the kernel wait for an RCU grace period, about 10 ms, and the leading add
    /// keeps the delete from failing if the address went away meanwhile); a new address is just
    /// added, one already held by `uid` is left as it is.
    pub fn add_pod(&self, uid: &str, ips: &[IpAddr]) -> Result<(), HostProbeError> {
        let usable: Vec<IpAddr> = self.usable(ips).collect();
        if usable.is_empty() {
            return Ok(());
        }
        let _serial = updating();
        let present = self.entries()?;
        let mut b = Batch::new();
        for ip in usable {
            let el = set_elems(set_name(&ip), vec![SetElem::addr(ip, Some(uid.to_owned()))]);
            match present.iter().find(|e| e.ip == ip) {
                None => {
                    b.push(Command::AddSetElems(el));
                }
                Some(e) if e.uid.as_deref() == Some(uid) => {}
                Some(_) => {
                    b.push(Command::AddSetElems(el.clone()))
                        .push(Command::DelSetElems(el.clone()))
                        .push(Command::AddSetElems(el));
                }
            }
        }
        if b.commands().is_empty() {
            return Ok(());
        }
        Ok(b.commit()?)
    }

    /// Removes the pod's addresses whose comment is `uid` (spec §3.7 step 1), in one transaction.
    /// An address held by another pod (or without comment) is left alone and returned, for the
    /// caller to warn about; an address not in the set is ignored.
    pub fn remove_pod(&self, uid: &str, ips: &[IpAddr]) -> Result<Vec<ProbeEntry>, HostProbeError> {
        let _serial = updating();
        let wanted: Vec<IpAddr> = self.usable(ips).collect();
        let (mine, foreign): (Vec<ProbeEntry>, Vec<ProbeEntry>) = self
            .entries()?
            .into_iter()
            .filter(|e| wanted.contains(&e.ip))
            .partition(|e| e.uid.as_deref() == Some(uid));
        self.delete(&mine)?;
        Ok(foreign)
    }

    /// Removes every address whose comment is `uid`, whatever the addresses (for a pod whose IPs are
    /// no longer known). Returns how many were removed.
    pub fn remove_uid(&self, uid: &str) -> Result<usize, HostProbeError> {
        let _serial = updating();
        let mine: Vec<ProbeEntry> = self
            .entries()?
            .into_iter()
            .filter(|e| e.uid.as_deref() == Some(uid))
            .collect();
        self.delete(&mine)?;
        Ok(mine.len())
    }

    /// The elements of the probe sets (v4, then v6 when IPv6 is on), sorted.
    pub fn entries(&self) -> Result<Vec<ProbeEntry>, HostProbeError> {
        let mut out = Vec::new();
        for set in self.sets() {
            for el in nft::list_set_elems(&host_table(), &set.name)? {
                if let Some(ip) = el.key_addr() {
                    out.push(ProbeEntry {
                        ip,
                        uid: el.comment,
                    });
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// The rule set as data: one rule per family.
    fn rules(&self) -> Vec<RuleSpec> {
        let mut fams = vec![(false, PROBE_SET_V4, IpAddr::V4(self.probe_v4))];
        if self.ipv6 {
            fams.push((true, PROBE_SET_V6, IpAddr::V6(self.probe_v6)));
        }
        fams.into_iter()
            .map(|(v6, set, probe)| {
                let matches = vec![
                    Match::L4Proto(Proto::Tcp),
                    Match::SkUid(self.kubelet_uid),
                    Match::AddrInSet {
                        dir: Dir::Dst,
                        v6,
                        set,
                    },
                ];
                rule(POSTROUTING_CHAIN, matches, Action::Snat(probe))
            })
            .collect()
    }

    fn sets(&self) -> Vec<Set> {
        let mut v = vec![probe_set(SetKeyType::Ipv4Addr)];
        if self.ipv6 {
            v.push(probe_set(SetKeyType::Ipv6Addr));
        }
        v
    }

    /// `ips` unmapped, without IPv6 when IPv6 is off.
    fn usable<'a>(&self, ips: &'a [IpAddr]) -> impl Iterator<Item = IpAddr> + 'a {
        let ipv6 = self.ipv6;
        ips.iter()
            .map(|ip| ip.to_canonical())
            .filter(move |ip| ipv6 || ip.is_ipv4())
    }

    fn delete(&self, entries: &[ProbeEntry]) -> Result<(), HostProbeError> {
        let mut b = Batch::new();
        for e in entries {
            b.push(Command::DelSetElems(set_elems(
                set_name(&e.ip),
                vec![SetElem::addr(e.ip, None)],
            )));
        }
        Ok(b.commit()?)
    }
}

fn host_table() -> Table {
    Table::inet(HOST_NAT_TABLE)
}

fn set_name(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() {
        PROBE_SET_V4
    } else {
        PROBE_SET_V6
    }
}

fn probe_set(key_type: SetKeyType) -> Set {
    let name = match key_type {
        SetKeyType::Ipv4Addr => PROBE_SET_V4,
        SetKeyType::Ipv6Addr => PROBE_SET_V6,
    };
    Set {
        table: host_table(),
        name: name.into(),
        key_type,
        comment: Some(PROBE_SET_COMMENT.into()),
    }
}

fn set_elems(set: &str, elems: Vec<SetElem>) -> SetElems {
    SetElems {
        table: host_table(),
        set: set.into(),
        elems,
    }
}
