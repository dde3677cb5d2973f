//! Vocabulary of the rule set: matches and actions. Each renders as `nft` script text and as
//! nf_tables expressions; the expressions mirror what `nft` 1.0.6 generates for the same text
//! (including its implicit `meta nfproto` / `meta l4proto` dependencies), so `nft list ruleset`
//! reads the same whether the rules came from us or from `nft -f`.

use std::net::IpAddr;

use crate::nft::{CmpOp, CtKey, Expr, ImmediateData, MetaKey, PayloadBase, Register, Verdict};

/// The data register every rule uses (`reg 1`, as nft does).
const REG: Register = Register::R1;

/// Transport protocols we match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Proto {
    Tcp,
    Udp,
}

/// Which address or port of the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    Src,
    Dst,
}

/// Which interface of the packet: the one it came in on or the one it leaves by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IfDir {
    In,
    Out,
}

/// One match of a rule; all must hold for the action to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Match {
    /// `meta l4proto tcp`.
    L4Proto(Proto),
    /// `ip saddr 1.2.3.4`, `ip6 daddr != ::1/128`; `prefix` None prints no length (exact address).
    Addr {
        dir: Dir,
        addr: IpAddr,
        prefix: Option<u8>,
        negate: bool,
    },
    /// `tcp dport != 15008`.
    Port {
        proto: Proto,
        dir: Dir,
        port: u16,
        negate: bool,
    },
    /// `oifname lo`, `oifname != lo`, `iifname "eth1"`. `quote` prints the name in double quotes
    /// (names from pod options, which might collide with nft keywords); istio-cni's own `lo` is
    /// printed bare, as in its scripts.
    IfName {
        dir: IfDir,
        name: String,
        quote: bool,
        negate: bool,
    },
    /// `meta mark and 0xfff != 0x539`.
    MetaMark { mask: u32, value: u32, negate: bool },
    /// `ct mark and 0xfff == 0x111`.
    CtMark { mask: u32, value: u32 },
    /// `skuid 1000`: the packet's socket belongs to this UID (bare, as in istio-cni's script).
    SkUid(u32),
    /// `ip daddr @set` / `ip6 saddr @set`: the address is an element of the named set.
    AddrInSet {
        dir: Dir,
        v6: bool,
        set: &'static str,
    },
}

/// What a matching rule does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
    Jump(&'static str),
    Accept,
    /// `return` to the calling chain.
    Return,
    /// `redirect to :<port>` (to the primary local address, keeping the original destination
    /// retrievable through SO_ORIGINAL_DST).
    Redirect(u16),
    /// `ct mark set ct mark & <keep> | <set>`.
    CtMarkSet {
        keep: u32,
        set: u32,
    },
    /// `meta mark set ct mark`.
    MetaMarkFromCt,
    /// `ct zone set <zone>`.
    CtZoneSet(u16),
    /// `snat to <addr>` (nat chains at postrouting / input only).
    Snat(IpAddr),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RuleSpec {
    pub(super) chain: &'static str,
    pub(super) matches: Vec<Match>,
    pub(super) counter: bool,
    pub(super) action: Action,
}

pub(super) fn rule(chain: &'static str, matches: Vec<Match>, action: Action) -> RuleSpec {
    RuleSpec {
        chain,
        matches,
        counter: true,
        action,
    }
}

pub(super) fn jump(chain: &'static str, target: &'static str) -> RuleSpec {
    RuleSpec {
        chain,
        matches: Vec::new(),
        counter: false,
        action: Action::Jump(target),
    }
}

pub(super) fn port(proto: Proto, dir: Dir, port: u16, negate: bool) -> Match {
    Match::Port {
        proto,
        dir,
        port,
        negate,
    }
}

// === impl Proto ===

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }

    fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
        }
    }
}

// === impl Match ===

fn op_str(negate: bool) -> &'static str {
    if negate { "!= " } else { "" }
}

fn cmp_op(negate: bool) -> CmpOp {
    if negate { CmpOp::Neq } else { CmpOp::Eq }
}

/// `meta load` / `ct load` of a u32 mark, masked, compared.
fn masked_mark(load: Expr, mask: u32, value: u32, negate: bool) -> Vec<Expr> {
    vec![
        load,
        Expr::Bitwise {
            sreg: REG,
            dreg: REG,
            mask: mask.to_ne_bytes().to_vec(),
            xor: 0u32.to_ne_bytes().to_vec(),
        },
        Expr::Cmp {
            sreg: REG,
            op: cmp_op(negate),
            data: value.to_ne_bytes().to_vec(),
        },
    ]
}

fn meta_eq(key: MetaKey, data: Vec<u8>) -> [Expr; 2] {
    [
        Expr::Meta { key, dreg: REG },
        Expr::Cmp {
            sreg: REG,
            op: CmpOp::Eq,
            data,
        },
    ]
}

/// Network-order bytes of `addr` masked to `prefix` bits.
fn prefix_mask(addr: &[u8], prefix: u8) -> Vec<u8> {
    let bits = usize::from(prefix);
    (0..addr.len())
        .map(|i| {
            let take = bits.saturating_sub(i * 8).min(8);
            if take == 0 { 0 } else { 0xffu8 << (8 - take) }
        })
        .collect()
}

impl Match {
    pub(super) fn script(&self) -> String {
        match self {
            Match::L4Proto(p) => format!("meta l4proto {}", p.name()),
            Match::Addr {
                dir,
                addr,
                prefix,
                negate,
            } => {
                let fam = if addr.is_ipv4() { "ip" } else { "ip6" };
                let d = if *dir == Dir::Src { "saddr" } else { "daddr" };
                let len = prefix.map(|p| format!("/{p}")).unwrap_or_default();
                format!("{fam} {d} {}{addr}{len}", op_str(*negate))
            }
            Match::Port {
                proto,
                dir,
                port,
                negate,
            } => {
                let d = if *dir == Dir::Src { "sport" } else { "dport" };
                format!("{} {d} {}{port}", proto.name(), op_str(*negate))
            }
            Match::IfName {
                dir,
                name,
                quote,
                negate,
            } => {
                let key = if *dir == IfDir::In {
                    "iifname"
                } else {
                    "oifname"
                };
                let q = if *quote { "\"" } else { "" };
                format!("{key} {}{q}{name}{q}", op_str(*negate))
            }
            Match::MetaMark {
                mask,
                value,
                negate,
            } => {
                let op = if *negate { "!=" } else { "==" };
                format!("meta mark and {mask:#x} {op} {value:#x}")
            }
            Match::CtMark { mask, value } => format!("ct mark and {mask:#x} == {value:#x}"),
            Match::SkUid(uid) => format!("skuid {uid}"),
            Match::AddrInSet { dir, v6, set } => {
                let fam = if *v6 { "ip6" } else { "ip" };
                let d = if *dir == Dir::Src { "saddr" } else { "daddr" };
                format!("{fam} {d} @{set}")
            }
        }
    }

    pub(super) fn exprs(&self) -> Vec<Expr> {
        match self {
            Match::L4Proto(p) => meta_eq(MetaKey::L4Proto, vec![p.number()]).to_vec(),
            Match::Addr {
                dir,
                addr,
                prefix,
                negate,
            } => {
                let (nfproto, bytes, src_off, dst_off) = match addr {
                    IpAddr::V4(a) => (2u8, a.octets().to_vec(), 12, 16),
                    IpAddr::V6(a) => (10u8, a.octets().to_vec(), 8, 24),
                };
                let full = u8::try_from(bytes.len() * 8).unwrap_or(u8::MAX);
                let offset = if *dir == Dir::Src { src_off } else { dst_off };
                let mut v = meta_eq(MetaKey::NfProto, vec![nfproto]).to_vec();
                v.push(Expr::Payload {
                    base: PayloadBase::Network,
                    offset,
                    len: u32::from(full / 8),
                    dreg: REG,
                });
                let mut data = bytes;
                if let Some(p) = prefix.filter(|p| *p < full) {
                    let mask = prefix_mask(&data, p);
                    data.iter_mut().zip(&mask).for_each(|(b, m)| *b &= m);
                    v.push(Expr::Bitwise {
                        sreg: REG,
                        dreg: REG,
                        xor: vec![0; mask.len()],
                        mask,
                    });
                }
                v.push(Expr::Cmp {
                    sreg: REG,
                    op: cmp_op(*negate),
                    data,
                });
                v
            }
            Match::Port {
                proto,
                dir,
                port,
                negate,
            } => {
                let mut v = meta_eq(MetaKey::L4Proto, vec![proto.number()]).to_vec();
                v.push(Expr::Payload {
                    base: PayloadBase::Transport,
                    offset: if *dir == Dir::Src { 0 } else { 2 },
                    len: 2,
                    dreg: REG,
                });
                v.push(Expr::Cmp {
                    sreg: REG,
                    op: cmp_op(*negate),
                    data: port.to_be_bytes().to_vec(),
                });
                v
            }
            Match::IfName {
                dir, name, negate, ..
            } => {
                // IFNAMSIZ bytes, NUL-padded: an exact match, as nft encodes a name without `*`.
                let mut data = [0u8; 16];
                let n = name.len().min(15);
                data[..n].copy_from_slice(&name.as_bytes()[..n]);
                let key = if *dir == IfDir::In {
                    MetaKey::IifName
                } else {
                    MetaKey::OifName
                };
                vec![
                    Expr::Meta { key, dreg: REG },
                    Expr::Cmp {
                        sreg: REG,
                        op: cmp_op(*negate),
                        data: data.to_vec(),
                    },
                ]
            }
            Match::MetaMark {
                mask,
                value,
                negate,
            } => {
                let load = Expr::Meta {
                    key: MetaKey::Mark,
                    dreg: REG,
                };
                masked_mark(load, *mask, *value, *negate)
            }
            Match::CtMark { mask, value } => {
                let load = Expr::Ct {
                    key: CtKey::Mark,
                    dreg: REG,
                };
                masked_mark(load, *mask, *value, false)
            }
            Match::SkUid(uid) => meta_eq(MetaKey::SkUid, uid.to_ne_bytes().to_vec()).to_vec(),
            Match::AddrInSet { dir, v6, set } => {
                let (nfproto, len, src_off, dst_off) = if *v6 {
                    (10u8, 16, 8, 24)
                } else {
                    (2u8, 4, 12, 16)
                };
                let mut v = meta_eq(MetaKey::NfProto, vec![nfproto]).to_vec();
                v.push(Expr::Payload {
                    base: PayloadBase::Network,
                    offset: if *dir == Dir::Src { src_off } else { dst_off },
                    len,
                    dreg: REG,
                });
                v.push(Expr::Lookup {
                    sreg: REG,
                    set: (*set).into(),
                });
                v
            }
        }
    }
}

// === impl Action ===

impl Action {
    pub(super) fn script(&self) -> String {
        match self {
            Action::Jump(c) => format!("jump {c}"),
            Action::Accept => "accept".into(),
            Action::Return => "return".into(),
            Action::Redirect(p) => format!("redirect to :{p}"),
            Action::CtMarkSet { keep, set } => {
                format!("ct mark set ct mark & {keep:#x} | {set:#x}")
            }
            Action::MetaMarkFromCt => "meta mark set ct mark".into(),
            Action::CtZoneSet(z) => format!("ct zone set {z}"),
            Action::Snat(addr) => format!("snat to {addr}"),
        }
    }

    pub(super) fn exprs(&self) -> Vec<Expr> {
        let ct_mark = Expr::Ct {
            key: CtKey::Mark,
            dreg: REG,
        };
        match self {
            Action::Jump(c) => vec![Expr::verdict(Verdict::Jump((*c).into()))],
            Action::Accept => vec![Expr::verdict(Verdict::Accept)],
            Action::Return => vec![Expr::verdict(Verdict::Return)],
            Action::Redirect(p) => vec![
                Expr::Immediate {
                    dreg: REG,
                    data: ImmediateData::Value(p.to_be_bytes().to_vec()),
                },
                Expr::Redir { proto_min: REG },
            ],
            Action::CtMarkSet { keep, set } => vec![
                ct_mark,
                Expr::Bitwise {
                    sreg: REG,
                    dreg: REG,
                    mask: keep.to_ne_bytes().to_vec(),
                    xor: set.to_ne_bytes().to_vec(),
                },
                Expr::CtSet {
                    key: CtKey::Mark,
                    sreg: REG,
                },
            ],
            Action::MetaMarkFromCt => vec![
                ct_mark,
                Expr::MetaSet {
                    key: MetaKey::Mark,
                    sreg: REG,
                },
            ],
            Action::CtZoneSet(z) => vec![
                Expr::Immediate {
                    dreg: REG,
                    data: ImmediateData::Value(z.to_ne_bytes().to_vec()),
                },
                Expr::CtSet {
                    key: CtKey::Zone,
                    sreg: REG,
                },
            ],
            Action::Snat(addr) => Expr::snat_to(*addr, REG).to_vec(),
        }
    }
}

// === impl RuleSpec ===

impl RuleSpec {
    pub(super) fn script(&self) -> String {
        let mut parts: Vec<String> = self.matches.iter().map(Match::script).collect();
        if self.counter {
            parts.push("counter".into());
        }
        parts.push(self.action.script());
        parts.join(" ")
    }

    pub(super) fn exprs(&self) -> Vec<Expr> {
        let mut v: Vec<Expr> = self.matches.iter().flat_map(Match::exprs).collect();
        if self.counter {
            v.push(Expr::Counter);
        }
        v.extend(self.action.exprs());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_mask_covers_partial_bytes() {
        assert_eq!(prefix_mask(&[0; 4], 32), [0xff; 4]);
        assert_eq!(prefix_mask(&[0; 4], 12), [0xff, 0xf0, 0, 0]);
        assert_eq!(prefix_mask(&[0; 4], 0), [0; 4]);
    }

    #[test]
    fn non_host_prefix_adds_mask_and_masks_the_network() {
        let m = Match::Addr {
            dir: Dir::Dst,
            addr: "10.1.2.3".parse().expect("addr"),
            prefix: Some(8),
            negate: false,
        };
        let e = m.exprs();
        assert_eq!(e.len(), 5, "{e:?}");
        assert!(matches!(&e[3], Expr::Bitwise { mask, .. } if mask == &[0xff, 0, 0, 0]));
        assert!(matches!(&e[4], Expr::Cmp { data, .. } if data == &[10, 0, 0, 0]));
        assert_eq!(m.script(), "ip daddr 10.1.2.3/8");
    }

    #[test]
    fn host_prefix_is_a_plain_compare() {
        let m = Match::Addr {
            dir: Dir::Dst,
            addr: IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            prefix: Some(128),
            negate: true,
        };
        let e = m.exprs();
        assert_eq!(
            e[2],
            Expr::Payload {
                base: PayloadBase::Network,
                offset: 24,
                len: 16,
                dreg: REG
            }
        );
        assert!(matches!(&e[3], Expr::Cmp { op: CmpOp::Neq, data, .. } if data.len() == 16));
        assert_eq!(m.script(), "ip6 daddr != ::1/128");
    }

    #[test]
    fn redirect_rule_expressions_follow_nft() {
        // nft --debug=netlink for `... tcp dport != 15008 ... redirect to :15006`.
        let r = rule(
            "istio-prerouting",
            vec![port(Proto::Tcp, Dir::Dst, 15008, true)],
            Action::Redirect(15006),
        );
        let kinds: Vec<&str> = r.exprs().iter().map(Expr::kind).collect();
        assert_eq!(
            kinds,
            [
                "meta",
                "cmp",
                "payload",
                "cmp",
                "counter",
                "immediate",
                "redir"
            ]
        );
        assert_eq!(r.script(), "tcp dport != 15008 counter redirect to :15006");
    }

    #[test]
    fn virtual_interface_rule_expressions_follow_nft() {
        // nft --debug=netlink for `iifname fake1s0f0 meta l4proto tcp counter return`.
        let iif = Match::IfName {
            dir: IfDir::In,
            name: "fake1s0f0".into(),
            quote: true,
            negate: false,
        };
        let r = rule(
            "istio-prerouting",
            vec![iif, Match::L4Proto(Proto::Tcp)],
            Action::Return,
        );
        let mut name = [0u8; 16];
        name[..9].copy_from_slice(b"fake1s0f0");
        assert_eq!(
            r.exprs(),
            [
                Expr::Meta {
                    key: MetaKey::IifName,
                    dreg: REG
                },
                Expr::Cmp {
                    sreg: REG,
                    op: CmpOp::Eq,
                    data: name.to_vec()
                },
                Expr::Meta {
                    key: MetaKey::L4Proto,
                    dreg: REG
                },
                Expr::Cmp {
                    sreg: REG,
                    op: CmpOp::Eq,
                    data: vec![6]
                },
                Expr::Counter,
                Expr::verdict(Verdict::Return),
            ]
        );
        assert_eq!(
            r.script(),
            "iifname \"fake1s0f0\" meta l4proto tcp counter return"
        );
        let lo = Match::IfName {
            dir: IfDir::Out,
            name: "lo".into(),
            quote: false,
            negate: true,
        };
        assert_eq!(lo.script(), "oifname != lo");
        assert!(matches!(
            lo.exprs()[..],
            [
                Expr::Meta {
                    key: MetaKey::OifName,
                    ..
                },
                Expr::Cmp { op: CmpOp::Neq, .. }
            ]
        ));
    }
}
