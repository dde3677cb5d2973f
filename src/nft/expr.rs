//! nf_tables rule expressions (the kernel's VM instructions) and their netlink encoding.
//!
//! Each [`Expr`] becomes one `NFTA_LIST_ELEM` holding `NFTA_EXPR_NAME` (the kernel expression type:
//! `meta`, `payload`, `cmp`, ...) and `NFTA_EXPR_DATA`. Data values are raw bytes in the byte order
//! the kernel compares them in: packet fields (addresses, ports) in network order, `meta mark` /
//! `ct mark` / `ct zone` in host order, interface names as 16 NUL-padded bytes (IFNAMSIZ).

use std::net::IpAddr;

use super::Family;
use super::wire::{Attr, expr as a, rule};

/// An nf_tables data register (`enum nft_registers`).
///
/// `Verdict` is register 0; `R1`..`R4` are the 16-byte registers `nft` itself uses (`reg 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Register {
    /// `NFT_REG_VERDICT`.
    Verdict,
    /// `NFT_REG_1`.
    R1,
    /// `NFT_REG_2`.
    R2,
    /// `NFT_REG_3`.
    R3,
    /// `NFT_REG_4`.
    R4,
}

/// Keys of the `meta` expression (`enum nft_meta_keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaKey {
    /// Packet mark (`meta mark`, u32 host order).
    Mark,
    /// Input interface name (16 bytes).
    IifName,
    /// Output interface name (16 bytes).
    OifName,
    /// Netfilter family of the packet (1 byte, `NFPROTO_IPV4` = 2, `NFPROTO_IPV6` = 10).
    NfProto,
    /// Layer 4 protocol number (1 byte, e.g. 6 = TCP, 17 = UDP).
    L4Proto,
    /// UID owning the packet's socket (`meta skuid`, u32 host order; locally generated packets
    /// only, a packet without a socket ends the rule).
    SkUid,
}

/// Keys of the `ct` expression (`enum nft_ct_keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtKey {
    /// Connection mark (u32 host order).
    Mark,
    /// Conntrack zone (u16 host order; settable before conntrack lookup, i.e. in raw priority).
    Zone,
}

/// Header a `payload` expression reads from (`enum nft_payload_bases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadBase {
    /// Network header (IPv4/IPv6).
    Network,
    /// Transport header (TCP/UDP).
    Transport,
}

/// Comparison of the `cmp` expression (`enum nft_cmp_ops`, the two we need).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    /// `NFT_CMP_EQ`.
    Eq,
    /// `NFT_CMP_NEQ`.
    Neq,
}

/// Kind of address translation of the `nat` expression (`enum nft_nat_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatKind {
    /// `NFT_NAT_SNAT`: rewrite the source (postrouting / input hooks).
    Snat,
    /// `NFT_NAT_DNAT`: rewrite the destination (prerouting / output hooks).
    Dnat,
}

/// A verdict stored in the verdict register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// `NF_ACCEPT`: stop evaluating this hook's chain.
    Accept,
    /// `NFT_RETURN`: return to the calling chain.
    Return,
    /// `NFT_JUMP` to the named chain of the same table.
    Jump(String),
}

/// What an `immediate` expression loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImmediateData {
    /// Raw bytes into a data register.
    Value(Vec<u8>),
    /// A verdict into [`Register::Verdict`].
    Verdict(Verdict),
}

/// One nf_tables expression. A rule is a sequence of these; a `cmp` that fails ends the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    /// `meta load <key> => dreg`.
    Meta {
        /// What to load.
        key: MetaKey,
        /// Destination register.
        dreg: Register,
    },
    /// `meta set <key> with sreg` (we use it for the packet mark).
    MetaSet {
        /// What to set.
        key: MetaKey,
        /// Source register.
        sreg: Register,
    },
    /// `payload load <len>b @ <base> + <offset> => dreg`.
    Payload {
        /// Header to read from.
        base: PayloadBase,
        /// Byte offset within that header.
        offset: u32,
        /// Number of bytes.
        len: u32,
        /// Destination register.
        dreg: Register,
    },
    /// `cmp <op> sreg <data>`; the rule stops when the comparison is false.
    Cmp {
        /// Register compared.
        sreg: Register,
        /// Comparison.
        op: CmpOp,
        /// Value compared against (its length is the compared width).
        data: Vec<u8>,
    },
    /// `bitwise dreg = (sreg & mask) ^ xor`; `mask` and `xor` must have the same length.
    Bitwise {
        /// Source register.
        sreg: Register,
        /// Destination register.
        dreg: Register,
        /// AND mask.
        mask: Vec<u8>,
        /// XOR value applied after the mask.
        xor: Vec<u8>,
    },
    /// `immediate`: load a constant or a verdict.
    Immediate {
        /// Destination register ([`Register::Verdict`] for verdicts).
        dreg: Register,
        /// The constant.
        data: ImmediateData,
    },
    /// `ct load <key> => dreg`.
    Ct {
        /// What to load.
        key: CtKey,
        /// Destination register.
        dreg: Register,
    },
    /// `ct set <key> with sreg`.
    CtSet {
        /// What to set.
        key: CtKey,
        /// Source register.
        sreg: Register,
    },
    /// `counter` (packets and bytes, starting at zero).
    Counter,
    /// `redir` to the local address, port taken from a register (2 bytes, network order).
    Redir {
        /// Register holding the port (`NFTA_REDIR_REG_PROTO_MIN`).
        proto_min: Register,
    },
    /// `lookup reg <sreg> set <set>`: the rule goes on only when the register's value is an
    /// element of the named set of the rule's table.
    Lookup {
        /// Register holding the key (its width is the set's key length).
        sreg: Register,
        /// Set name.
        set: String,
    },
    /// `nat <kind> <family> addr_min reg <addr_min>`: translate to the address in the register
    /// (4 bytes for [`Family::Ip`], 16 for [`Family::Ip6`], network order). Only in `nat` chains.
    Nat {
        /// Source or destination translation.
        kind: NatKind,
        /// Address family of the translation: [`Family::Ip`] or [`Family::Ip6`] (in an `inet`
        /// table each rule translates one family; with an address the kernel rejects
        /// [`Family::Inet`] with EAFNOSUPPORT).
        family: Family,
        /// Register holding the address.
        addr_min: Register,
    },
}

// === impl Register ===

impl Register {
    /// The `enum nft_registers` value.
    pub fn number(self) -> u32 {
        match self {
            Register::Verdict => 0,
            Register::R1 => 1,
            Register::R2 => 2,
            Register::R3 => 3,
            Register::R4 => 4,
        }
    }
}

// === impl MetaKey / CtKey / PayloadBase / CmpOp ===

impl MetaKey {
    /// The `enum nft_meta_keys` value.
    pub fn number(self) -> u32 {
        match self {
            MetaKey::Mark => 3,
            MetaKey::IifName => 6,
            MetaKey::OifName => 7,
            MetaKey::NfProto => 15,
            MetaKey::L4Proto => 16,
            MetaKey::SkUid => 10,
        }
    }
}

impl CtKey {
    /// The `enum nft_ct_keys` value.
    pub fn number(self) -> u32 {
        match self {
            CtKey::Mark => 3,
            CtKey::Zone => 17,
        }
    }
}

impl PayloadBase {
    /// The `enum nft_payload_bases` value.
    pub fn number(self) -> u32 {
        match self {
            PayloadBase::Network => 1,
            PayloadBase::Transport => 2,
        }
    }
}

impl CmpOp {
    /// The `enum nft_cmp_ops` value.
    pub fn number(self) -> u32 {
        match self {
            CmpOp::Eq => 0,
            CmpOp::Neq => 1,
        }
    }
}

impl NatKind {
    /// The `enum nft_nat_types` value.
    pub fn number(self) -> u32 {
        match self {
            NatKind::Snat => 0,
            NatKind::Dnat => 1,
        }
    }
}

// === impl Verdict ===

impl Verdict {
    /// The verdict code (`NF_ACCEPT` = 1, `NFT_RETURN` = -5, `NFT_JUMP` = -3).
    pub fn code(&self) -> i32 {
        match self {
            Verdict::Accept => 1,
            Verdict::Return => -5,
            Verdict::Jump(_) => -3,
        }
    }

    fn attr(&self) -> Attr {
        // The kernel reads the code as a big-endian u32 and reinterprets it as a signed verdict.
        let mut v = vec![Attr::Bytes(
            a::VERDICT_CODE,
            self.code().to_be_bytes().to_vec(),
        )];
        if let Verdict::Jump(chain) = self {
            v.push(Attr::strz(a::VERDICT_CHAIN, chain));
        }
        Attr::Nested(a::DATA_VERDICT, v)
    }
}

// === impl Expr ===

impl Expr {
    /// Convenience: `immediate` of a verdict into the verdict register.
    pub fn verdict(v: Verdict) -> Expr {
        Expr::Immediate {
            dreg: Register::Verdict,
            data: ImmediateData::Verdict(v),
        }
    }

    /// `snat to <addr>` as nft encodes it: the address into `reg` (`immediate`), then `nat snat`
    /// of the address's family from that register.
    pub fn snat_to(addr: IpAddr, reg: Register) -> [Expr; 2] {
        let (family, bytes) = match addr {
            IpAddr::V4(a) => (Family::Ip, a.octets().to_vec()),
            IpAddr::V6(a) => (Family::Ip6, a.octets().to_vec()),
        };
        [
            Expr::Immediate {
                dreg: reg,
                data: ImmediateData::Value(bytes),
            },
            Expr::Nat {
                kind: NatKind::Snat,
                family,
                addr_min: reg,
            },
        ]
    }

    /// The constant the expression carries, as a rule listing reports it
    /// ([`super::RuleSummary::constants`]): the data a `cmp` compares against, the value an
    /// `immediate` loads (not verdicts), the set name of a `lookup`. `None` for the others.
    pub fn constant(&self) -> Option<Vec<u8>> {
        match self {
            Expr::Cmp { data, .. } => Some(data.clone()),
            Expr::Immediate {
                data: ImmediateData::Value(v),
                ..
            } => Some(v.clone()),
            Expr::Lookup { set, .. } => Some(set.as_bytes().to_vec()),
            _ => None,
        }
    }

    /// The kernel expression type name (`NFTA_EXPR_NAME`).
    pub fn kind(&self) -> &'static str {
        match self {
            Expr::Meta { .. } | Expr::MetaSet { .. } => "meta",
            Expr::Payload { .. } => "payload",
            Expr::Cmp { .. } => "cmp",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Immediate { .. } => "immediate",
            Expr::Ct { .. } | Expr::CtSet { .. } => "ct",
            Expr::Counter => "counter",
            Expr::Redir { .. } => "redir",
            Expr::Lookup { .. } => "lookup",
            Expr::Nat { .. } => "nat",
        }
    }

    /// The `NFTA_LIST_ELEM` attribute for this expression.
    pub(crate) fn attr(&self) -> Attr {
        let mut elem = vec![Attr::strz(rule::EXPR_NAME, self.kind())];
        let data = self.data_attrs();
        if !data.is_empty() {
            elem.push(Attr::Nested(rule::EXPR_DATA, data));
        }
        Attr::Nested(rule::LIST_ELEM, elem)
    }

    fn data_attrs(&self) -> Vec<Attr> {
        let reg = |ty, r: &Register| Attr::be32(ty, r.number());
        let value =
            |ty, bytes: &[u8]| Attr::Nested(ty, vec![Attr::Bytes(a::DATA_VALUE, bytes.to_vec())]);
        match self {
            Expr::Meta { key, dreg } => vec![
                Attr::be32(a::META_KEY, key.number()),
                reg(a::META_DREG, dreg),
            ],
            Expr::MetaSet { key, sreg } => vec![
                Attr::be32(a::META_KEY, key.number()),
                reg(a::META_SREG, sreg),
            ],
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => vec![
                reg(a::PAYLOAD_DREG, dreg),
                Attr::be32(a::PAYLOAD_BASE, base.number()),
                Attr::be32(a::PAYLOAD_OFFSET, *offset),
                Attr::be32(a::PAYLOAD_LEN, *len),
            ],
            Expr::Cmp { sreg, op, data } => vec![
                reg(a::CMP_SREG, sreg),
                Attr::be32(a::CMP_OP, op.number()),
                value(a::CMP_DATA, data),
            ],
            Expr::Bitwise {
                sreg,
                dreg,
                mask,
                xor,
            } => vec![
                reg(a::BITWISE_SREG, sreg),
                reg(a::BITWISE_DREG, dreg),
                // Widths are tiny (<= 16 bytes); saturating keeps a bogus length visible to the kernel.
                Attr::be32(
                    a::BITWISE_LEN,
                    u32::try_from(mask.len()).unwrap_or(u32::MAX),
                ),
                value(a::BITWISE_MASK, mask),
                value(a::BITWISE_XOR, xor),
            ],
            Expr::Immediate { dreg, data } => {
                let data = match data {
                    ImmediateData::Value(bytes) => Attr::Bytes(a::DATA_VALUE, bytes.clone()),
                    ImmediateData::Verdict(v) => v.attr(),
                };
                vec![
                    reg(a::IMMEDIATE_DREG, dreg),
                    Attr::Nested(a::IMMEDIATE_DATA, vec![data]),
                ]
            }
            Expr::Ct { key, dreg } => {
                vec![Attr::be32(a::CT_KEY, key.number()), reg(a::CT_DREG, dreg)]
            }
            Expr::CtSet { key, sreg } => {
                vec![Attr::be32(a::CT_KEY, key.number()), reg(a::CT_SREG, sreg)]
            }
            Expr::Counter => Vec::new(),
            Expr::Redir { proto_min } => vec![
                reg(a::REDIR_REG_PROTO_MIN, proto_min),
                // The kernel overwrites its flags with this attribute, so the "port given" flag must
                // be sent explicitly (as nft does).
                Attr::be32(a::REDIR_FLAGS, a::NF_NAT_RANGE_PROTO_SPECIFIED),
            ],
            // nft also sends NFTA_LOOKUP_SET_ID, which the kernel only consults for a set it cannot
            // find by name (anonymous sets); a named set is always found by name, also when it is
            // created earlier in the same batch.
            Expr::Lookup { sreg, set } => {
                vec![reg(a::LOOKUP_SREG, sreg), Attr::strz(a::LOOKUP_SET, set)]
            }
            Expr::Nat {
                kind,
                family,
                addr_min,
            } => vec![
                Attr::be32(a::NAT_TYPE, kind.number()),
                Attr::be32(a::NAT_FAMILY, u32::from(family.nfproto())),
                reg(a::NAT_REG_ADDR_MIN, addr_min),
            ],
        }
    }
}
