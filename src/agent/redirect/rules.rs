//! The in-pod rule set as data: tables, chains and rules in istio-cni's order (spec §4.9). Both
//! outputs come from here: the `nft` script text ([`render`]) and the netlink commands
//! ([`commands`]), so the two cannot drift apart.

use std::net::IpAddr;

use crate::nft::{Chain, ChainHook, ChainType, Command, Hook, Rule, Table};

use super::rule_spec::{Action, Dir, IfDir, Match, Proto, RuleSpec, jump, port, rule};
use super::{DNS_CT_ZONE, MANGLE_TABLE, NAT_TABLE, RAW_TABLE, RedirectPlan};
use crate::mesh::{
    CONNMARK, DNS_PORT as DNS_CAPTURE_PORT, HBONE_PORT as INBOUND_HBONE_PORT,
    INBOUND_PLAINTEXT_PORT, MARK_MASK, OUTBOUND_PORT,
};

/// Names of the chains in every table.
const PREROUTING: &str = "prerouting";
const OUTPUT: &str = "output";
const ISTIO_PREROUTING: &str = "istio-prerouting";
const ISTIO_OUTPUT: &str = "istio-output";

const LOOPBACK: &str = "lo";
/// Priority of the nat base chains: one before `dstnat` (-100, istio-cni's choice), so the redirect
/// runs before any nat chain a pod registers at the standard priority, whatever the order of
/// registration (the kernel runs same-priority chains newest first, and only the first nat
/// verdict of a connection counts). Still after mangle (-150), as in istio-cni.
pub(crate) const NAT_PRIORITY: i32 = -101;
/// The port DNS servers answer on (what DNS capture redirects).
const DNS_SERVICE_PORT: u16 = 53;

#[derive(Debug, Clone, PartialEq, Eq)]
struct TableSpec {
    name: &'static str,
    /// Base chains (`prerouting`, `output`) with their type and priority.
    base: [(&'static str, ChainHook); 2],
    rules: Vec<RuleSpec>,
}

/// The nft script for `plan`, in the form istio-cni feeds to `nft -f` (add + flush per table).
pub(super) fn render(plan: &RedirectPlan) -> String {
    let mut out = String::new();
    for t in tables(plan) {
        let table = format!("inet {}", t.name);
        out.push_str(&format!("add table {table}\nflush table {table}\n"));
        for (name, h) in &t.base {
            out.push_str(&format!(
                "add chain {table} {name} {{ type {} hook {} priority {} ; }}\n",
                h.chain_type.name(),
                h.hook.name(),
                h.priority
            ));
        }
        for name in [ISTIO_PREROUTING, ISTIO_OUTPUT] {
            out.push_str(&format!("add chain {table} {name}\n"));
        }
        for r in &t.rules {
            out.push_str(&format!("add rule {table} {} {}\n", r.chain, r.script()));
        }
    }
    out
}

/// The commands installing `plan`: per table add + delete + add (replacing whatever was there),
/// then its chains and rules.
pub(super) fn commands(plan: &RedirectPlan) -> Vec<Command> {
    let mut out = Vec::new();
    for t in tables(plan) {
        let table = Table::inet(t.name);
        out.push(Command::AddTable(table.clone()));
        out.push(Command::DelTable(table.clone()));
        out.push(Command::AddTable(table.clone()));
        for (name, h) in t.base {
            out.push(Command::AddChain(Chain {
                table: table.clone(),
                name: name.into(),
                hook: Some(h),
            }));
        }
        for name in [ISTIO_PREROUTING, ISTIO_OUTPUT] {
            out.push(Command::AddChain(Chain {
                table: table.clone(),
                name: name.into(),
                hook: None,
            }));
        }
        for r in &t.rules {
            out.push(Command::AddRule(Rule {
                table: table.clone(),
                chain: r.chain.into(),
                exprs: r.exprs(),
            }));
        }
    }
    out
}

/// The names of every table this module may create (for removal and checks).
pub(super) fn all_table_names() -> [&'static str; 3] {
    [NAT_TABLE, MANGLE_TABLE, RAW_TABLE]
}

fn hook(chain_type: ChainType, hook: Hook, priority: i32) -> ChainHook {
    ChainHook {
        chain_type,
        hook,
        priority,
    }
}

/// The rule set of istio-cni's nftables backend (spec §4.9), in its emission order.
fn tables(plan: &RedirectPlan) -> Vec<TableSpec> {
    let mut v = vec![nat_table(plan), mangle_table(plan)];
    if plan.dns_capture {
        v.push(raw_table(plan));
    }
    v
}

/// Per-family values: (probe address, loopback address, loopback prefix length).
fn families(plan: &RedirectPlan) -> Vec<(IpAddr, IpAddr, u8)> {
    let mut v = vec![(
        IpAddr::V4(plan.probe_v4),
        IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        32,
    )];
    if plan.ipv6 {
        v.push((
            IpAddr::V6(plan.probe_v6),
            IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            128,
        ));
    }
    v
}

fn not_ztunnel(plan: &RedirectPlan) -> Match {
    Match::MetaMark {
        mask: MARK_MASK,
        value: plan.proxy_mark.get(),
        negate: true,
    }
}

/// `oifname lo` / `oifname != lo`, bare as in istio-cni's script.
fn oif_loopback(negate: bool) -> Match {
    Match::IfName {
        dir: IfDir::Out,
        name: LOOPBACK.into(),
        quote: false,
        negate,
    }
}

fn not_loopback(addr: IpAddr, prefix: u8) -> Match {
    Match::Addr {
        dir: Dir::Dst,
        addr,
        prefix: Some(prefix),
        negate: true,
    }
}

fn nat_table(plan: &RedirectPlan) -> TableSpec {
    use Match::*;
    let fams = families(plan);
    let mut rules = vec![
        jump(OUTPUT, ISTIO_OUTPUT),
        jump(PREROUTING, ISTIO_PREROUTING),
    ];
    // TCP arriving on a virtual interface (VMs, KubeVirt, DinD) is the pod's own outbound traffic:
    // straight to ztunnel's outbound port, and nothing else in this chain applies (spec §4.5).
    for name in &plan.virtual_interfaces {
        for action in [Action::Redirect(OUTBOUND_PORT), Action::Return] {
            let iif = IfName {
                dir: IfDir::In,
                name: name.as_str().into(),
                quote: true,
                negate: false,
            };
            rules.push(rule(
                ISTIO_PREROUTING,
                vec![iif, L4Proto(Proto::Tcp)],
                action,
            ));
        }
    }
    // Kubelet probes arrive SNATed to the probe address: never capture them. In ingress mode the
    // prerouting accept has no inbound redirect to bypass and is left out, as istio-cni does.
    let inbound = !plan.bypass_inbound_capture;
    for (dir, chain) in [(Dir::Src, ISTIO_PREROUTING), (Dir::Dst, ISTIO_OUTPUT)] {
        if chain == ISTIO_PREROUTING && !inbound {
            continue;
        }
        for &(probe, _, _) in &fams {
            let addr = Addr {
                dir,
                addr: probe,
                prefix: None,
                negate: false,
            };
            rules.push(rule(chain, vec![L4Proto(Proto::Tcp), addr], Action::Accept));
        }
    }
    // Inbound TCP (not to localhost, not HBONE, not from ztunnel) goes to ztunnel's plaintext port;
    // not in ingress mode (`ambient.istio.io/bypass-inbound-capture`, spec §4.5).
    if inbound {
        for &(_, lo, len) in &fams {
            let m = vec![
                not_loopback(lo, len),
                port(Proto::Tcp, Dir::Dst, INBOUND_HBONE_PORT, true),
                not_ztunnel(plan),
            ];
            rules.push(rule(
                ISTIO_PREROUTING,
                m,
                Action::Redirect(INBOUND_PLAINTEXT_PORT),
            ));
        }
    }
    if plan.dns_capture {
        let udp = vec![
            oif_loopback(true),
            not_ztunnel(plan),
            port(Proto::Udp, Dir::Dst, DNS_SERVICE_PORT, false),
        ];
        rules.push(rule(ISTIO_OUTPUT, udp, Action::Redirect(DNS_CAPTURE_PORT)));
        for &(_, lo, len) in &fams {
            let tcp = vec![
                not_loopback(lo, len),
                port(Proto::Tcp, Dir::Dst, DNS_SERVICE_PORT, false),
                not_ztunnel(plan),
            ];
            rules.push(rule(ISTIO_OUTPUT, tcp, Action::Redirect(DNS_CAPTURE_PORT)));
        }
    }
    // Replies of connections ztunnel accepted in-pod (connmark restored into the mark).
    let connmarked = MetaMark {
        mask: MARK_MASK,
        value: CONNMARK,
        negate: false,
    };
    rules.push(rule(
        ISTIO_OUTPUT,
        vec![L4Proto(Proto::Tcp), connmarked],
        Action::Accept,
    ));
    // App to its own non-loopback address via lo: no hairpin through ztunnel.
    for &(_, lo, len) in &fams {
        let m = vec![oif_loopback(false), not_loopback(lo, len)];
        rules.push(rule(ISTIO_OUTPUT, m, Action::Accept));
    }
    // Outbound TCP from the app goes to ztunnel's outbound port.
    for &(_, lo, len) in &fams {
        let m = vec![
            L4Proto(Proto::Tcp),
            not_loopback(lo, len),
            not_ztunnel(plan),
        ];
        rules.push(rule(ISTIO_OUTPUT, m, Action::Redirect(OUTBOUND_PORT)));
    }
    TableSpec {
        name: NAT_TABLE,
        base: [
            (
                PREROUTING,
                hook(ChainType::Nat, Hook::Prerouting, NAT_PRIORITY),
            ),
            (OUTPUT, hook(ChainType::Nat, Hook::Output, NAT_PRIORITY)),
        ],
        rules,
    }
}

fn mangle_table(plan: &RedirectPlan) -> TableSpec {
    let from_ztunnel = Match::MetaMark {
        mask: MARK_MASK,
        value: plan.proxy_mark.get(),
        negate: false,
    };
    let connmarked = Match::CtMark {
        mask: MARK_MASK,
        value: CONNMARK,
    };
    TableSpec {
        name: MANGLE_TABLE,
        base: [
            (PREROUTING, hook(ChainType::Filter, Hook::Prerouting, -150)),
            (OUTPUT, hook(ChainType::Route, Hook::Output, -150)),
        ],
        rules: vec![
            jump(PREROUTING, ISTIO_PREROUTING),
            jump(OUTPUT, ISTIO_OUTPUT),
            rule(
                ISTIO_PREROUTING,
                vec![from_ztunnel],
                Action::CtMarkSet {
                    keep: !MARK_MASK,
                    set: CONNMARK,
                },
            ),
            rule(ISTIO_OUTPUT, vec![connmarked], Action::MetaMarkFromCt),
        ],
    }
}

fn raw_table(plan: &RedirectPlan) -> TableSpec {
    let mark = |negate| Match::MetaMark {
        mask: MARK_MASK,
        value: plan.proxy_mark.get(),
        negate,
    };
    TableSpec {
        name: RAW_TABLE,
        base: [
            (PREROUTING, hook(ChainType::Filter, Hook::Prerouting, -300)),
            (OUTPUT, hook(ChainType::Filter, Hook::Output, -300)),
        ],
        rules: vec![
            jump(PREROUTING, ISTIO_PREROUTING),
            jump(OUTPUT, ISTIO_OUTPUT),
            // ztunnel's upstream DNS queries and their answers live in their own conntrack zone,
            // so they do not clash with the app's redirected DNS flows (istio#33469).
            rule(
                ISTIO_OUTPUT,
                vec![
                    port(Proto::Udp, Dir::Dst, DNS_SERVICE_PORT, false),
                    mark(false),
                ],
                Action::CtZoneSet(DNS_CT_ZONE),
            ),
            rule(
                ISTIO_PREROUTING,
                vec![
                    port(Proto::Udp, Dir::Src, DNS_SERVICE_PORT, false),
                    mark(true),
                ],
                Action::CtZoneSet(DNS_CT_ZONE),
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_replace_each_table() {
        let plan = RedirectPlan {
            dns_capture: true,
            ..RedirectPlan::default()
        };
        let cmds = commands(&plan);
        let heads: Vec<String> = cmds
            .iter()
            .filter(|c| !matches!(c, Command::AddRule(_) | Command::AddChain(_)))
            .map(ToString::to_string)
            .collect();
        let expected: Vec<String> = all_table_names()
            .iter()
            .flat_map(|t| {
                [
                    format!("add table inet {t}"),
                    format!("delete table inet {t}"),
                    format!("add table inet {t}"),
                ]
            })
            .collect();
        assert_eq!(heads, expected);
    }
}
