//! Named sets and their elements: the objects, their netlink encoding as nft 1.0.6 sends them, and
//! the decoding of elements the kernel lists.
//!
//! Comments (of a set, of an element) are not kernel objects: nft keeps them in the object's
//! `NFTA_*_USERDATA` as libnftnl TLVs (`u8` type, `u8` length, value with its NUL), which `nft list`
//! prints. We write and read them the same way, so both tools see the same comments.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::wire::{self, Attr, expr as e, rule, set as s};
use super::{NftError, Table};

/// Longest comment nft accepts (`NFTNL_UDATA_COMMENT_MAXLEN`), in bytes without the NUL.
pub const MAX_COMMENT_LEN: usize = 128;

/// Key type of a set (an nft datatype; it also fixes the key length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetKeyType {
    /// `ipv4_addr` (nft `TYPE_IPADDR` = 7, 4 bytes, network order).
    Ipv4Addr,
    /// `ipv6_addr` (nft `TYPE_IP6ADDR` = 8, 16 bytes, network order).
    Ipv6Addr,
}

/// A named set of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Set {
    /// Owning table.
    pub table: Table,
    /// Set name (at most 255 bytes).
    pub name: String,
    /// Key type.
    pub key_type: SetKeyType,
    /// Comment shown by `nft list` (at most [`MAX_COMMENT_LEN`] bytes).
    pub comment: Option<String>,
}

/// One element of a set: its key and an optional comment.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SetElem {
    /// Key bytes, as long as the set's key (an address in network order for address sets).
    pub key: Vec<u8>,
    /// Comment shown by `nft list` (at most [`MAX_COMMENT_LEN`] bytes).
    pub comment: Option<String>,
}

/// Elements of one set, the payload of an add or delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetElems {
    /// Owning table.
    pub table: Table,
    /// Set name.
    pub set: String,
    /// The elements.
    pub elems: Vec<SetElem>,
}

// === impl SetKeyType ===

impl SetKeyType {
    /// nft's datatype number (`NFTA_SET_KEY_TYPE`).
    pub fn type_id(self) -> u32 {
        match self {
            SetKeyType::Ipv4Addr => 7,
            SetKeyType::Ipv6Addr => 8,
        }
    }

    /// Key length in bytes (`NFTA_SET_KEY_LEN`).
    pub fn key_len(self) -> u32 {
        match self {
            SetKeyType::Ipv4Addr => 4,
            SetKeyType::Ipv6Addr => 16,
        }
    }

    /// The nft keyword.
    pub fn name(self) -> &'static str {
        match self {
            SetKeyType::Ipv4Addr => "ipv4_addr",
            SetKeyType::Ipv6Addr => "ipv6_addr",
        }
    }

    /// The key type holding `addr`.
    pub fn of(addr: &IpAddr) -> SetKeyType {
        match addr {
            IpAddr::V4(_) => SetKeyType::Ipv4Addr,
            IpAddr::V6(_) => SetKeyType::Ipv6Addr,
        }
    }
}

// === impl SetElem ===

impl SetElem {
    /// An address element (key = the address in network order).
    pub fn addr(addr: IpAddr, comment: Option<String>) -> SetElem {
        let key = match addr {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        };
        SetElem { key, comment }
    }

    /// The key read as an address: 4 bytes are IPv4, 16 bytes IPv6, other lengths `None`.
    pub fn key_addr(&self) -> Option<IpAddr> {
        if let Ok(b) = <[u8; 4]>::try_from(self.key.as_slice()) {
            Some(IpAddr::V4(Ipv4Addr::from(b)))
        } else if let Ok(b) = <[u8; 16]>::try_from(self.key.as_slice()) {
            Some(IpAddr::V6(Ipv6Addr::from(b)))
        } else {
            None
        }
    }

    /// `NFTA_LIST_ELEM` { `NFTA_SET_ELEM_KEY` { value }, [`NFTA_SET_ELEM_USERDATA`] }.
    fn attr(&self, with_comment: bool) -> Result<Attr, NftError> {
        let mut v = vec![Attr::Nested(
            s::ELEM_KEY,
            vec![Attr::Bytes(e::DATA_VALUE, self.key.clone())],
        )];
        if let (true, Some(c)) = (with_comment, &self.comment) {
            v.push(Attr::Bytes(
                s::ELEM_USERDATA,
                udata_comment(s::UDATA_SET_ELEM_COMMENT, c)?,
            ));
        }
        Ok(Attr::Nested(rule::LIST_ELEM, v))
    }

    /// Decodes one `NFTA_LIST_ELEM` of a listed set.
    fn parse(payload: &[u8]) -> Result<SetElem, NftError> {
        let attrs = wire::parse_attrs(payload)?;
        let key_attr = wire::find_attr(&attrs, s::ELEM_KEY).ok_or(NftError::MalformedReply {
            what: "set element without key",
        })?;
        let key = wire::find_attr(&wire::parse_attrs(key_attr)?, e::DATA_VALUE)
            .ok_or(NftError::MalformedReply {
                what: "set element key without value",
            })?
            .to_vec();
        let comment = match wire::find_attr(&attrs, s::ELEM_USERDATA) {
            Some(udata) => udata_find(udata, s::UDATA_SET_ELEM_COMMENT).map(wire::attr_str),
            None => None,
        };
        Ok(SetElem { key, comment })
    }
}

impl fmt::Display for SetElem {
    /// The key (as an address when it has an address's length, else hex), then `comment "..."`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.key_addr() {
            Some(a) => write!(f, "{a}")?,
            None => {
                f.write_str("0x")?;
                for b in &self.key {
                    write!(f, "{b:02x}")?;
                }
            }
        }
        if let Some(c) = &self.comment {
            write!(f, " comment {c:?}")?;
        }
        Ok(())
    }
}

// === encoding ===

/// A libnftnl comment TLV: type, length (with the NUL), the string and its NUL.
fn udata_comment(ty: u8, comment: &str) -> Result<Vec<u8>, NftError> {
    if comment.len() > MAX_COMMENT_LEN {
        return Err(NftError::TooLarge {
            what: "nft comment",
            len: comment.len(),
        });
    }
    // MAX_COMMENT_LEN + 1 fits the u8 length field.
    let len = u8::try_from(comment.len() + 1).unwrap_or(u8::MAX);
    let mut v = vec![ty, len];
    v.extend_from_slice(comment.as_bytes());
    v.push(0);
    Ok(v)
}

/// The value of the first TLV of type `ty` in a user data blob.
fn udata_find(mut udata: &[u8], ty: u8) -> Option<&[u8]> {
    while let [t, len, rest @ ..] = udata {
        let len = usize::from(*len);
        let value = rest.get(..len)?;
        if *t == ty {
            return Some(value);
        }
        udata = &rest[len..];
    }
    None
}

/// Attributes of `NFT_MSG_NEWSET` in nft's order; `id` is the batch-local `NFTA_SET_ID` (the
/// kernel requires it; only anonymous sets are referred to by it).
pub(crate) fn new_set_attrs(set: &Set, id: u32) -> Result<Vec<Attr>, NftError> {
    let mut udata = vec![s::UDATA_SET_KEYBYTEORDER, 4];
    udata.extend_from_slice(&s::BYTEORDER_BIG_ENDIAN.to_ne_bytes());
    if let Some(c) = &set.comment {
        udata.extend(udata_comment(s::UDATA_SET_COMMENT, c)?);
    }
    Ok(vec![
        Attr::strz(s::TABLE, &set.table.name),
        Attr::strz(s::NAME, &set.name),
        Attr::be32(s::FLAGS, 0),
        Attr::be32(s::KEY_TYPE, set.key_type.type_id()),
        Attr::be32(s::KEY_LEN, set.key_type.key_len()),
        Attr::be32(s::ID, id),
        Attr::Bytes(s::USERDATA, udata),
    ])
}

/// Attributes of `NFT_MSG_DELSET`.
pub(crate) fn del_set_attrs(table: &Table, name: &str) -> Vec<Attr> {
    vec![Attr::strz(s::TABLE, &table.name), Attr::strz(s::NAME, name)]
}

/// Attributes of `NFT_MSG_NEWSETELEM` (comments included) or `NFT_MSG_DELSETELEM` (keys only), in
/// nft's order. nft also sends `NFTA_SET_ELEM_LIST_SET_ID`, which the kernel only consults for a set
/// it cannot find by name; it is left out.
pub(crate) fn elems_attrs(elems: &SetElems, with_comments: bool) -> Result<Vec<Attr>, NftError> {
    let list = elems
        .elems
        .iter()
        .map(|el| el.attr(with_comments))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(vec![
        Attr::strz(s::ELEM_LIST_TABLE, &elems.table.name),
        Attr::strz(s::ELEM_LIST_SET, &elems.set),
        Attr::Nested(s::ELEM_LIST_ELEMENTS, list),
    ])
}

/// Attributes of `NFT_MSG_DELSETELEM` without elements (`flush set`), in nft's order (set first).
pub(crate) fn flush_set_attrs(table: &Table, name: &str) -> Vec<Attr> {
    vec![
        Attr::strz(s::ELEM_LIST_SET, name),
        Attr::strz(s::ELEM_LIST_TABLE, &table.name),
    ]
}

/// The elements of one `NFT_MSG_NEWSETELEM` message of a set listing.
pub(crate) fn parse_elems(attrs: &[(u16, &[u8])]) -> Result<Vec<SetElem>, NftError> {
    let Some(list) = wire::find_attr(attrs, s::ELEM_LIST_ELEMENTS) else {
        return Ok(Vec::new());
    };
    wire::parse_attrs(list)?
        .into_iter()
        .filter(|(ty, _)| *ty == rule::LIST_ELEM)
        .map(|(_, payload)| SetElem::parse(payload))
        .collect()
}
