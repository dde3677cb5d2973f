//! Netlink framing for nf_tables: kernel constants, an attribute tree with its serializer, message
//! headers, and the parser for the kernel's replies (acks and errors).
//!
//! Layouts follow `linux/netlink.h` (`nlmsghdr`, `nlattr`, `nlmsgerr`), `linux/netfilter/nfnetlink.h`
//! (`nfgenmsg`, batch messages) and `linux/netfilter/nf_tables.h` (attribute numbers). Integer
//! attributes of nf_tables are big-endian (`NLA_BE32`); header fields are host-endian.

use super::NftError;

/// `sizeof(struct nlmsghdr)`.
pub(crate) const NLMSG_HDRLEN: usize = 16;
/// `sizeof(struct nlattr)`.
pub(crate) const NLA_HDRLEN: usize = 4;
/// `NLMSG_ERROR`: ack (error 0) or error reply.
pub(crate) const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`: end of a dump.
pub(crate) const NLMSG_DONE: u16 = 3;

pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_CREATE: u16 = 0x400;
pub(crate) const NLM_F_APPEND: u16 = 0x800;
/// `NLM_F_ROOT | NLM_F_MATCH`: return every matching object.
pub(crate) const NLM_F_DUMP: u16 = 0x300;
/// Set on dump messages when the ruleset changed while the dump ran (the dump is inconsistent).
pub(crate) const NLM_F_DUMP_INTR: u16 = 0x10;
/// Marks an attribute whose payload is a list of attributes.
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
/// Marks an attribute whose payload is in network byte order (ignored when parsing).
pub(crate) const NLA_F_NET_BYTEORDER: u16 = 0x4000;

/// `NFNL_SUBSYS_NFTABLES`: high byte of every nf_tables message type and the batch `res_id`.
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `NFNL_MSG_BATCH_BEGIN` (`NLMSG_MIN_TYPE`).
pub(crate) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
/// `NFNL_MSG_BATCH_END`.
pub(crate) const NFNL_MSG_BATCH_END: u16 = 0x11;
/// `NFNETLINK_V0`, the only `nfgenmsg.version`.
pub(crate) const NFNETLINK_V0: u8 = 0;
/// `AF_UNSPEC`, the family of batch delimiters.
pub(crate) const AF_UNSPEC: u8 = 0;

/// `enum nf_tables_msg_types` (only the ones we send).
pub(crate) mod msg {
    pub(crate) const NEWTABLE: u16 = 0;
    pub(crate) const GETTABLE: u16 = 1;
    pub(crate) const DELTABLE: u16 = 2;
    pub(crate) const NEWCHAIN: u16 = 3;
    pub(crate) const GETCHAIN: u16 = 4;
    pub(crate) const NEWRULE: u16 = 6;
    pub(crate) const GETRULE: u16 = 7;
    pub(crate) const DELRULE: u16 = 8;
    pub(crate) const NEWSET: u16 = 9;
    pub(crate) const GETSET: u16 = 10;
    pub(crate) const DELSET: u16 = 11;
    pub(crate) const NEWSETELEM: u16 = 12;
    pub(crate) const GETSETELEM: u16 = 13;
    pub(crate) const DELSETELEM: u16 = 14;
}

/// `enum nft_table_attributes`.
pub(crate) mod table {
    pub(crate) const NAME: u16 = 1;
}

/// `enum nft_chain_attributes` and `enum nft_hook_attributes`.
pub(crate) mod chain {
    pub(crate) const TABLE: u16 = 1;
    pub(crate) const NAME: u16 = 3;
    pub(crate) const HOOK: u16 = 4;
    pub(crate) const TYPE: u16 = 7;
    pub(crate) const HOOK_HOOKNUM: u16 = 1;
    pub(crate) const HOOK_PRIORITY: u16 = 2;
}

/// `enum nft_rule_attributes`, `enum nft_list_attributes`, `enum nft_expr_attributes`.
pub(crate) mod rule {
    pub(crate) const TABLE: u16 = 1;
    pub(crate) const CHAIN: u16 = 2;
    pub(crate) const HANDLE: u16 = 3;
    pub(crate) const EXPRESSIONS: u16 = 4;
    pub(crate) const LIST_ELEM: u16 = 1;
    pub(crate) const EXPR_NAME: u16 = 1;
    pub(crate) const EXPR_DATA: u16 = 2;
}

/// `enum nft_set_attributes`, `enum nft_set_elem_list_attributes`, `enum nft_set_elem_attributes`
/// and the `libnftnl` user data (TLV) types nft stores in them.
pub(crate) mod set {
    pub(crate) const TABLE: u16 = 1;
    pub(crate) const NAME: u16 = 2;
    pub(crate) const FLAGS: u16 = 3;
    pub(crate) const KEY_TYPE: u16 = 4;
    pub(crate) const KEY_LEN: u16 = 5;
    pub(crate) const ID: u16 = 10;
    pub(crate) const USERDATA: u16 = 13;
    pub(crate) const ELEM_LIST_TABLE: u16 = 1;
    pub(crate) const ELEM_LIST_SET: u16 = 2;
    pub(crate) const ELEM_LIST_ELEMENTS: u16 = 3;
    pub(crate) const ELEM_KEY: u16 = 1;
    pub(crate) const ELEM_USERDATA: u16 = 6;
    /// `NFTNL_UDATA_SET_KEYBYTEORDER` (value: u32 host order, nft's `BYTEORDER_BIG_ENDIAN` = 2).
    pub(crate) const UDATA_SET_KEYBYTEORDER: u8 = 0;
    /// `NFTNL_UDATA_SET_COMMENT` (NUL-terminated).
    pub(crate) const UDATA_SET_COMMENT: u8 = 7;
    /// `NFTNL_UDATA_SET_ELEM_COMMENT` (NUL-terminated).
    pub(crate) const UDATA_SET_ELEM_COMMENT: u8 = 0;
    /// nft's `BYTEORDER_BIG_ENDIAN`.
    pub(crate) const BYTEORDER_BIG_ENDIAN: u32 = 2;
}

/// Per-expression attributes (`enum nft_*_attributes`) and value enums.
pub(crate) mod expr {
    /// `enum nft_data_attributes`.
    pub(crate) const DATA_VALUE: u16 = 1;
    pub(crate) const DATA_VERDICT: u16 = 2;
    /// `enum nft_verdict_attributes`.
    pub(crate) const VERDICT_CODE: u16 = 1;
    pub(crate) const VERDICT_CHAIN: u16 = 2;
    /// `enum nft_meta_attributes`.
    pub(crate) const META_DREG: u16 = 1;
    pub(crate) const META_KEY: u16 = 2;
    pub(crate) const META_SREG: u16 = 3;
    /// `enum nft_payload_attributes`.
    pub(crate) const PAYLOAD_DREG: u16 = 1;
    pub(crate) const PAYLOAD_BASE: u16 = 2;
    pub(crate) const PAYLOAD_OFFSET: u16 = 3;
    pub(crate) const PAYLOAD_LEN: u16 = 4;
    /// `enum nft_cmp_attributes`.
    pub(crate) const CMP_SREG: u16 = 1;
    pub(crate) const CMP_OP: u16 = 2;
    pub(crate) const CMP_DATA: u16 = 3;
    /// `enum nft_bitwise_attributes`.
    pub(crate) const BITWISE_SREG: u16 = 1;
    pub(crate) const BITWISE_DREG: u16 = 2;
    pub(crate) const BITWISE_LEN: u16 = 3;
    pub(crate) const BITWISE_MASK: u16 = 4;
    pub(crate) const BITWISE_XOR: u16 = 5;
    /// `enum nft_immediate_attributes`.
    pub(crate) const IMMEDIATE_DREG: u16 = 1;
    pub(crate) const IMMEDIATE_DATA: u16 = 2;
    /// `enum nft_ct_attributes`.
    pub(crate) const CT_DREG: u16 = 1;
    pub(crate) const CT_KEY: u16 = 2;
    pub(crate) const CT_SREG: u16 = 4;
    /// `enum nft_redir_attributes`.
    pub(crate) const REDIR_REG_PROTO_MIN: u16 = 1;
    pub(crate) const REDIR_FLAGS: u16 = 3;
    /// `enum nft_lookup_attributes`.
    pub(crate) const LOOKUP_SET: u16 = 1;
    pub(crate) const LOOKUP_SREG: u16 = 2;
    /// `enum nft_nat_attributes`.
    pub(crate) const NAT_TYPE: u16 = 1;
    pub(crate) const NAT_FAMILY: u16 = 2;
    pub(crate) const NAT_REG_ADDR_MIN: u16 = 3;
    /// `NF_NAT_RANGE_PROTO_SPECIFIED` (linux/netfilter/nf_nat.h).
    pub(crate) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 1 << 1;
}

/// One netlink attribute: raw bytes or a nested list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Attr {
    /// Attribute type and payload.
    Bytes(u16, Vec<u8>),
    /// Attribute type (sent with `NLA_F_NESTED`) and children.
    Nested(u16, Vec<Attr>),
}

impl Attr {
    /// A big-endian u32 (`NLA_BE32`), the nf_tables integer encoding.
    pub(crate) fn be32(ty: u16, v: u32) -> Attr {
        Attr::Bytes(ty, v.to_be_bytes().to_vec())
    }

    /// A NUL-terminated string (`NLA_STRING`, as libmnl's `attr_put_strz`).
    pub(crate) fn strz(ty: u16, s: &str) -> Attr {
        let mut b = Vec::with_capacity(s.len() + 1);
        b.extend_from_slice(s.as_bytes());
        b.push(0);
        Attr::Bytes(ty, b)
    }

    /// The attribute type without flags.
    #[cfg(test)]
    pub(crate) fn ty(&self) -> u16 {
        match self {
            Attr::Bytes(t, _) | Attr::Nested(t, _) => *t,
        }
    }

    /// Appends the attribute (header, payload, padding to 4 bytes) to `out`.
    pub(crate) fn write(&self, out: &mut Vec<u8>) -> Result<(), NftError> {
        let start = out.len();
        out.extend_from_slice(&[0; NLA_HDRLEN]);
        let ty = match self {
            Attr::Bytes(t, data) => {
                out.extend_from_slice(data);
                *t
            }
            Attr::Nested(t, children) => {
                for c in children {
                    c.write(out)?;
                }
                *t | NLA_F_NESTED
            }
        };
        let len = out.len() - start;
        let len16 = u16::try_from(len).map_err(|_| NftError::TooLarge {
            what: "netlink attribute",
            len,
        })?;
        out[start..start + 2].copy_from_slice(&len16.to_ne_bytes());
        out[start + 2..start + 4].copy_from_slice(&ty.to_ne_bytes());
        out.resize(align4(out.len()), 0);
        Ok(())
    }
}

/// Rounds `n` up to the netlink alignment (4).
pub(crate) fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Header fields of one nfnetlink message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MsgHeader {
    /// Full `nlmsg_type` (subsystem << 8 | message, or a batch delimiter).
    pub ty: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// `nfgenmsg.nfgen_family` (NFPROTO_*).
    pub family: u8,
    /// `nfgenmsg.res_id`, host value (sent big-endian).
    pub res_id: u16,
}

/// Appends one message (`nlmsghdr` + `nfgenmsg` + attributes) to `out`.
pub(crate) fn write_msg(out: &mut Vec<u8>, hdr: MsgHeader, attrs: &[Attr]) -> Result<(), NftError> {
    let start = out.len();
    out.extend_from_slice(&[0; NLMSG_HDRLEN]);
    out.extend_from_slice(&[hdr.family, NFNETLINK_V0]);
    out.extend_from_slice(&hdr.res_id.to_be_bytes());
    for a in attrs {
        a.write(out)?;
    }
    let len = out.len() - start;
    let len32 = u32::try_from(len).map_err(|_| NftError::TooLarge {
        what: "netlink message",
        len,
    })?;
    out[start..start + 4].copy_from_slice(&len32.to_ne_bytes());
    out[start + 4..start + 6].copy_from_slice(&hdr.ty.to_ne_bytes());
    out[start + 6..start + 8].copy_from_slice(&hdr.flags.to_ne_bytes());
    out[start + 8..start + 12].copy_from_slice(&hdr.seq.to_ne_bytes());
    // nlmsg_pid stays 0: the message is addressed to the kernel.
    Ok(())
}

/// The `nlmsg_type` of an nf_tables message.
pub(crate) fn nft_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

/// One message received from the kernel, reduced to what a sender needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `NLMSG_ERROR` with error 0 for request `seq`.
    Ack { seq: u32 },
    /// `NLMSG_ERROR` with a negative errno for request `seq` (stored positive).
    Error { seq: u32, errno: i32 },
    /// Any other message (for example the object a GET asked for).
    Other { seq: u32, ty: u16 },
}

/// One received netlink message, borrowed from the datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawMsg<'a> {
    /// `nlmsg_type`.
    pub ty: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// Everything after the `nlmsghdr` (for nf_tables objects: `nfgenmsg`, then attributes).
    pub payload: &'a [u8],
}

impl RawMsg<'_> {
    /// The message as a [`Reply`].
    pub(crate) fn reply(&self) -> Result<Reply, NftError> {
        let seq = self.seq;
        if self.ty != NLMSG_ERROR {
            return Ok(Reply::Other { seq, ty: self.ty });
        }
        let code = read_u32(self.payload, 0)? as i32;
        Ok(if code == 0 {
            Reply::Ack { seq }
        } else {
            Reply::Error {
                seq,
                errno: code.saturating_neg(),
            }
        })
    }
}

/// Splits a received datagram into its messages.
pub(crate) fn split_msgs(buf: &[u8]) -> Result<Vec<RawMsg<'_>>, NftError> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= NLMSG_HDRLEN {
        let len = read_u32(rest, 0)? as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(NftError::MalformedReply {
                what: "nlmsg_len out of range",
            });
        }
        out.push(RawMsg {
            ty: read_u16(rest, 4)?,
            flags: read_u16(rest, 6)?,
            seq: read_u32(rest, 8)?,
            payload: &rest[NLMSG_HDRLEN..len],
        });
        rest = &rest[align4(len).min(rest.len())..];
    }
    Ok(out)
}

/// Splits a received datagram into [`Reply`]s.
pub(crate) fn parse_replies(buf: &[u8]) -> Result<Vec<Reply>, NftError> {
    split_msgs(buf)?.iter().map(RawMsg::reply).collect()
}

/// Splits an attribute stream into (type without flags, payload) pairs.
pub(crate) fn parse_attrs(buf: &[u8]) -> Result<Vec<(u16, &[u8])>, NftError> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= NLA_HDRLEN {
        let len = usize::from(read_u16(rest, 0)?);
        if len < NLA_HDRLEN || len > rest.len() {
            return Err(NftError::MalformedReply {
                what: "nla_len out of range",
            });
        }
        let ty = read_u16(rest, 2)? & !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);
        out.push((ty, &rest[NLA_HDRLEN..len]));
        rest = &rest[align4(len).min(rest.len())..];
    }
    Ok(out)
}

/// The payload of the first attribute of type `ty`.
pub(crate) fn find_attr<'a>(attrs: &[(u16, &'a [u8])], ty: u16) -> Option<&'a [u8]> {
    attrs.iter().find(|(t, _)| *t == ty).map(|(_, p)| *p)
}

/// A NUL-terminated (or unterminated) string attribute payload.
pub(crate) fn attr_str(payload: &[u8]) -> String {
    let end = payload
        .iter()
        .position(|b| *b == 0)
        .unwrap_or(payload.len());
    String::from_utf8_lossy(&payload[..end]).into_owned()
}

fn read_u32(b: &[u8], at: usize) -> Result<u32, NftError> {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_ne_bytes)
        .ok_or(NftError::MalformedReply {
            what: "truncated message",
        })
}

fn read_u16(b: &[u8], at: usize) -> Result<u16, NftError> {
    b.get(at..at + 2)
        .and_then(|s| s.try_into().ok())
        .map(u16::from_ne_bytes)
        .ok_or(NftError::MalformedReply {
            what: "truncated message",
        })
}
