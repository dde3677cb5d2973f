//! In-pod traffic redirection: the nftables rule set of istio-cni's native nftables backend
//! (spec §4.9, `cni/pkg/nftables/testdata/default.golden`) plus its policy routing (spec §4.2),
//! programmed in-process over netlink inside the pod's network namespace.
//!
//! Three `inet` tables are installed in one nf_tables transaction:
//! - `istio-ambient-nat`: outbound TCP -> `:15001`, inbound TCP (except to 15008) -> `:15006`,
//!   DNS (UDP/TCP 53) -> `:15053` when DNS capture is on; kubelet probes from the probe SNAT address,
//!   traffic to loopback and ztunnel-marked (0x539/0xfff) packets are left alone.
//! - `istio-ambient-mangle`: packets from ztunnel set connmark 0x111 (keeping the upper bits); on
//!   output the ct mark is copied into the packet mark, so `fwmark 0x111/0xfff lookup 100` routes
//!   the replies back to ztunnel through the local route in table 100.
//! - `istio-ambient-raw` (DNS capture only): ztunnel's upstream DNS flows get conntrack zone 1.
//!
//! Per-pod options (spec §3.1, §4.4, §4.5; [`PodOptions`](crate::agent::enroll::PodOptions), merged into the node-wide plan by
//! [`RedirectPlan::for_pod`]): ingress mode drops the inbound redirect and its probe accept,
//! virtual interfaces get their inbound TCP sent to `:15001` first thing in nat `istio-prerouting`,
//! and DNS capture can be turned on or off for the one pod.
//!
//! The host side of probe handling (SNAT of kubelet probes in the node's own netns, spec §4.7) is
//! [`host::HostProbe`].
//!
//! [`render_script`] prints the same rule set as an `nft -f` script (istio-cni's text, for docs and
//! debugging); [`apply`] installs it. Unlike the script's `add` + `flush`, [`apply`] replaces each
//! table with `add` + `delete` + `add`, so chains left by older versions disappear as well.

pub mod host;
mod pod_options;
mod routing;
mod rule_spec;
mod rules;

#[cfg(test)]
mod tests;

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::agent::enroll::InterfaceName;
use crate::mesh::{
    CONNMARK, DEFAULT_PROBE_V4, DEFAULT_PROBE_V6, MARK_MASK, PacketMark, ROUTE_TABLE,
};
use crate::netns::{Netns, NetnsError};
use crate::nft::{self, Batch, Command, NftError, Table};

/// Conntrack zone of ztunnel's upstream DNS traffic.
pub const DNS_CT_ZONE: u16 = 1;

/// The nat table (redirects).
pub const NAT_TABLE: &str = "istio-ambient-nat";
/// The mangle table (connmark save/restore).
pub const MANGLE_TABLE: &str = "istio-ambient-mangle";
/// The raw table (DNS conntrack zone; only with DNS capture).
pub const RAW_TABLE: &str = "istio-ambient-raw";

/// What to install in a pod. The agent holds one node-wide plan (no per-pod fields set);
/// [`RedirectPlan::for_pod`] turns it into the plan of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedirectPlan {
    /// Also capture IPv6 (v6 variants of the address rules, `ip -6` rule and route).
    pub ipv6: bool,
    /// Redirect DNS (UDP/TCP 53) to ztunnel and install the raw table. In the node-wide plan the
    /// global `AMBIENT_DNS_CAPTURE`; in a pod's plan the effective value, after the pod's
    /// `ambient.istio.io/dns-capture` override (spec §4.4).
    pub dns_capture: bool,
    /// Source address of kubelet probes after host SNAT; such traffic bypasses capture.
    pub probe_v4: Ipv4Addr,
    /// IPv6 probe SNAT address.
    pub probe_v6: Ipv6Addr,
    /// The proxy's packet mark: packets carrying it are never captured, and they set the
    /// connection mark. Must be the mark the proxy puts on its sockets.
    pub proxy_mark: PacketMark,
    /// Ingress mode (per pod, [`PodOptions::bypass_inbound_capture`](crate::agent::enroll::PodOptions::bypass_inbound_capture)): no inbound
    /// redirect to `:15006` and no prerouting probe accept (spec §4.5).
    pub bypass_inbound_capture: bool,
    /// Virtual interfaces (per pod, [`PodOptions::reroute_virtual_interfaces`](crate::agent::enroll::PodOptions::reroute_virtual_interfaces)): their inbound TCP
    /// is redirected to the outbound port `:15001`, ahead of every other inbound rule (spec §4.5).
    pub virtual_interfaces: Vec<InterfaceName>,
}

/// Errors installing, removing or checking the redirection.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    /// Entering the pod's network namespace failed.
    #[error("enter pod netns: {0}")]
    Netns(#[from] NetnsError),
    /// The nf_tables transaction failed (rolled back as a whole).
    #[error("nftables in pod netns: {0}")]
    Nft(#[from] NftError),
    /// The tokio runtime for rtnetlink could not be built.
    #[error("build runtime for rtnetlink: {source}")]
    Runtime {
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The rtnetlink socket could not be opened.
    #[error("open rtnetlink socket: {source}")]
    RtnetlinkSocket {
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The namespace has no loopback interface.
    #[error("no `lo` interface in pod netns")]
    NoLoopback,
    /// Reading or changing `lo` failed.
    #[error("{op}: {source}")]
    Link {
        /// What was done (`get lo`, `set lo up`).
        op: &'static str,
        /// rtnetlink error.
        #[source]
        source: rtnetlink::Error,
    },
    /// Adding or deleting `fwmark 0x111/0xfff lookup 100 pref 32764` failed.
    #[error(
        "{op} {family} rule fwmark {CONNMARK:#x}/{MARK_MASK:#x} lookup {ROUTE_TABLE}: {source}"
    )]
    Rule {
        /// `add` or `delete`.
        op: &'static str,
        /// `ipv4` or `ipv6`.
        family: &'static str,
        /// rtnetlink error.
        #[source]
        source: rtnetlink::Error,
    },
    /// Replacing or deleting the local default route in table 100 failed.
    #[error("{op} {family} local default route in table {ROUTE_TABLE}: {source}")]
    Route {
        /// `replace` or `delete`.
        op: &'static str,
        /// `ipv4` or `ipv6`.
        family: &'static str,
        /// rtnetlink error.
        #[source]
        source: rtnetlink::Error,
    },
}

impl Default for RedirectPlan {
    /// IPv4 only, no DNS capture, Istio's default probe SNAT addresses and packet mark, no per-pod
    /// options.
    fn default() -> Self {
        RedirectPlan {
            ipv6: false,
            dns_capture: false,
            probe_v4: DEFAULT_PROBE_V4,
            probe_v6: DEFAULT_PROBE_V6,
            proxy_mark: PacketMark::DEFAULT,
            bypass_inbound_capture: false,
            virtual_interfaces: Vec::new(),
        }
    }
}

/// The rule set as an nft script (`add table` / `flush table` / `add chain` / `add rule` lines,
/// istio-cni's order and wording), e.g. for `nft -f` or logs. Pure. One deliberate difference:
/// virtual interface names are double-quoted (`iifname "eth1"`; istio-cni prints them bare), so a
/// name that is also an nft keyword still parses.
pub fn render_script(plan: &RedirectPlan) -> String {
    rules::render(plan)
}

/// The nf_tables batch [`apply`] sends: per table add + delete + add, then chains and rules; with
/// DNS capture off, add + delete of the raw table (so turning DNS capture off removes it).
pub fn apply_batch(plan: &RedirectPlan) -> Batch {
    let mut b = Batch::new();
    for c in rules::commands(plan) {
        b.push(c);
    }
    if !plan.dns_capture {
        b.push(Command::AddTable(Table::inet(RAW_TABLE)));
        b.push(Command::DelTable(Table::inet(RAW_TABLE)));
    }
    b
}

/// The nf_tables batch [`remove`] sends: add + delete of every table (so it succeeds whether or not
/// they exist).
pub fn remove_batch() -> Batch {
    let mut b = Batch::new();
    for name in rules::all_table_names() {
        b.push(Command::AddTable(Table::inet(name)));
        b.push(Command::DelTable(Table::inet(name)));
    }
    b
}

/// Installs the redirection in `netns`: one nf_tables transaction replacing our tables (the raw
/// table is deleted when DNS capture is off), then `lo` up, the fwmark rule and the local route.
/// Idempotent: applying twice leaves the same state as applying once; applying another plan
/// (e.g. a pod's options changed) converges to that plan. For a pod with options pass
/// `node_plan.for_pod(&options)`. Blocking.
///
/// When the netns already holds exactly this plan's tables, chains and rules (an agent restart
/// re-applying a pod's rules), nothing is replaced, so there is no moment without rules. That the
/// redirect wins over a pod's own nat rules comes from the nat chains' priority (-101, before
/// `dstnat`), not from the order the chains were registered in.
pub fn apply(netns: &Netns, plan: &RedirectPlan) -> Result<(), RedirectError> {
    let plan = plan.clone();
    netns.run(move || -> Result<(), RedirectError> {
        let mut existing = Vec::new();
        for name in rules::all_table_names() {
            if nft::table_exists(&Table::inet(name))? {
                existing.push(name);
            }
        }
        // a listing that fails is no reason to keep what is there: replace
        if !is_current(&plan, &existing).unwrap_or(false) {
            apply_batch_for(&plan, &existing).commit()?;
        }
        routing::apply(plan.ipv6)
    })?
}

/// Whether the tables in `existing` (of the calling thread's netns) are exactly `plan`'s: the
/// same tables, base chains with the same type, hook and priority, and in every chain of the plan
/// the same rules in order (expression types and constants, [`nft::RuleSummary::matches`]). A plan chain without rules cannot be told from a
/// missing one, so such a plan is never current.
fn is_current(plan: &RedirectPlan, existing: &[&str]) -> Result<bool, NftError> {
    let mut tables: Vec<&str> = Vec::new();
    let mut chains: Vec<(Table, String, Vec<&[nft::Expr]>)> = Vec::new();
    let mut hooks: Vec<(&Table, &str, nft::ChainHook)> = Vec::new();
    let commands = rules::commands(plan);
    for c in &commands {
        match c {
            Command::AddTable(t) if !tables.contains(&t.name.as_str()) => tables.push(&t.name),
            Command::AddChain(ch) => {
                if let Some(h) = ch.hook {
                    hooks.push((&ch.table, &ch.name, h));
                }
                chains.push((ch.table.clone(), ch.name.clone(), Vec::new()));
            }
            Command::AddRule(r) => {
                if let Some(entry) = chains
                    .iter_mut()
                    .find(|(t, n, _)| *t == r.table && *n == r.chain)
                {
                    entry.2.push(&r.exprs);
                }
            }
            _ => {}
        }
    }
    let mut want = tables.clone();
    want.sort_unstable();
    let mut have = existing.to_vec();
    have.sort_unstable();
    if want != have {
        return Ok(false);
    }
    for (table, chain, hook) in hooks {
        if nft::base_chain_hook(table, chain)? != Some(hook) {
            return Ok(false);
        }
    }
    for (table, chain, rules) in &chains {
        if rules.is_empty() {
            return Ok(false);
        }
        let listed = nft::list_rules(table, chain)?;
        if listed.len() != rules.len() || !listed.iter().zip(rules).all(|(l, r)| l.matches(r)) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// [`apply_batch`] trimmed for a netns where only the tables named in `existing` are present: the
/// delete (which makes the kernel wait for an RCU grace period, several ms) is only sent for tables
/// that exist, so a fresh pod gets its rules in one cheap transaction.
pub fn apply_batch_for(plan: &RedirectPlan, existing: &[&str]) -> Batch {
    let full = apply_batch(plan);
    let cmds = full.commands();
    let mut b = Batch::new();
    let mut i = 0;
    while i < cmds.len() {
        if let (Command::AddTable(a), Some(Command::DelTable(d))) = (&cmds[i], cmds.get(i + 1))
            && a == d
            && !existing.contains(&a.name.as_str())
        {
            // nothing to replace: skip the add+delete pair
            i += 2;
            continue;
        }
        b.push(cmds[i].clone());
        i += 1;
    }
    b
}

/// Removes our tables, rules and routes (v4 and v6) from `netns`. Succeeds when nothing is there.
/// Blocking.
pub fn remove(netns: &Netns) -> Result<(), RedirectError> {
    netns.run(|| -> Result<(), RedirectError> {
        remove_batch().commit()?;
        routing::remove()
    })?
}

/// Whether `netns` holds exactly `plan`'s tables and rules (the check [`apply`] makes before
/// replacing anything): `false` when a table is missing or extra, or a chain's rules differ
/// (flushed, edited). For `ztnode doctor`'s drift check. Blocking.
pub fn matches_plan(netns: &Netns, plan: &RedirectPlan) -> Result<bool, RedirectError> {
    let plan = plan.clone();
    netns.run(move || -> Result<bool, RedirectError> {
        let mut existing = Vec::new();
        for name in rules::all_table_names() {
            if nft::table_exists(&Table::inet(name))? {
                existing.push(name);
            }
        }
        Ok(is_current(&plan, &existing)?)
    })?
}

/// Whether the redirection is installed in `netns`: both always-present tables (`istio-ambient-nat`
/// and `istio-ambient-mangle`) exist. For CNI CHECK and diagnostics. Blocking.
pub fn is_applied(netns: &Netns) -> Result<bool, RedirectError> {
    netns.run(|| -> Result<bool, RedirectError> {
        for name in [NAT_TABLE, MANGLE_TABLE] {
            if !nft::table_exists(&Table::inet(name))? {
                return Ok(false);
            }
        }
        Ok(true)
    })?
}
