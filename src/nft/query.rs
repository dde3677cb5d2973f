//! Reading the ruleset back: whether an object exists (`NFT_MSG_GET*` with `NLM_F_ACK`) and
//! listings (`NLM_F_DUMP`, ended by `NLMSG_DONE`) of a set's elements and a chain's rules.
//!
//! Each call opens its own socket in the calling thread's network namespace. A dump the kernel
//! marks inconsistent (`NLM_F_DUMP_INTR`: the ruleset changed while it ran) is retried.

use nix::errno::Errno;

use super::set::{self, SetElem};
use super::socket::{NfSocket, RECV_BUF_LEN};
use super::wire::{self, Attr, MsgHeader, Reply};
use super::{ChainHook, ChainType, Expr, Hook, NftError, Table};

/// Sequence number of the single request of a query.
const SEQ: u32 = 1;
/// How often an interrupted dump is retried before giving up with EINTR.
const DUMP_ATTEMPTS: usize = 3;

/// One rule as listed by the kernel, reduced to what a consistency check needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSummary {
    /// The rule's handle (`NFTA_RULE_HANDLE`), unique within its table.
    pub handle: u64,
    /// The expression type names in order (`meta`, `cmp`, `lookup`, ...), as [`Expr::kind`].
    pub expr_kinds: Vec<String>,
    /// The constants of the expressions in order, as [`Expr::constant`]: compared data, loaded
    /// values, set names.
    pub constants: Vec<Vec<u8>>,
}

impl RuleSummary {
    /// Whether the listed rule is `exprs`: same expression types and constants, in order.
    /// Registers, offsets and the like are not compared.
    pub fn matches(&self, exprs: &[Expr]) -> bool {
        let kinds = exprs.iter().map(Expr::kind);
        let constants: Vec<Vec<u8>> = exprs.iter().filter_map(Expr::constant).collect();
        self.expr_kinds.iter().map(String::as_str).eq(kinds) && self.constants == constants
    }
}

/// Whether `table` exists in the calling thread's network namespace (`NFT_MSG_GETTABLE`).
pub fn table_exists(table: &Table) -> Result<bool, NftError> {
    exists(
        wire::msg::GETTABLE,
        table,
        &[Attr::strz(wire::table::NAME, &table.name)],
        || format!("get table {table}"),
    )
}

/// Whether set `name` exists in `table` (`NFT_MSG_GETSET`). A missing table counts as a missing set.
pub fn set_exists(table: &Table, name: &str) -> Result<bool, NftError> {
    exists(
        wire::msg::GETSET,
        table,
        &[
            Attr::strz(wire::set::TABLE, &table.name),
            Attr::strz(wire::set::NAME, name),
        ],
        || format!("get set {table} {name}"),
    )
}

/// The elements of set `name` of `table` (`NFT_MSG_GETSETELEM` dump), with their comments, in the
/// kernel's order. A missing table or set is [`NftError::Kernel`] with ENOENT.
pub fn list_set_elems(table: &Table, name: &str) -> Result<Vec<SetElem>, NftError> {
    let attrs = [
        Attr::strz(wire::set::ELEM_LIST_SET, name),
        Attr::strz(wire::set::ELEM_LIST_TABLE, &table.name),
    ];
    let describe = || format!("list set {table} {name}");
    let mut out = Vec::new();
    for msg in dump(wire::msg::GETSETELEM, table, &attrs, describe)? {
        out.extend(set::parse_elems(&wire::parse_attrs(&msg)?)?);
    }
    Ok(out)
}

/// The rules of `chain` in `table` in order (`NFT_MSG_GETRULE` dump filtered by table and chain).
/// A missing table or chain lists no rules.
pub fn list_rules(table: &Table, chain: &str) -> Result<Vec<RuleSummary>, NftError> {
    let attrs = [
        Attr::strz(wire::rule::TABLE, &table.name),
        Attr::strz(wire::rule::CHAIN, chain),
    ];
    let describe = || format!("list chain {table} {chain}");
    let msgs = match dump(wire::msg::GETRULE, table, &attrs, describe) {
        Err(NftError::Kernel {
            source: Errno::ENOENT,
            ..
        }) => return Ok(Vec::new()),
        other => other?,
    };
    msgs.iter().map(|m| parse_rule(m)).collect()
}

/// The type, hook and priority of base chain `chain` of `table` (`NFT_MSG_GETCHAIN` dump of the
/// table's family, filtered here). `Ok(None)` when the chain is missing, is not a base chain, or
/// has a hook or type this crate does not program (so it can never equal a [`ChainHook`] of ours).
pub fn base_chain_hook(table: &Table, chain: &str) -> Result<Option<ChainHook>, NftError> {
    let describe = || format!("list chains of {table}");
    let msgs = match dump(wire::msg::GETCHAIN, table, &[], describe) {
        Err(NftError::Kernel {
            source: Errno::ENOENT,
            ..
        }) => return Ok(None),
        other => other?,
    };
    for m in &msgs {
        let attrs = wire::parse_attrs(m)?;
        let named = |ty| wire::find_attr(&attrs, ty).map(wire::attr_str);
        if named(wire::chain::TABLE).as_deref() != Some(&table.name)
            || named(wire::chain::NAME).as_deref() != Some(chain)
        {
            continue;
        }
        return parse_chain_hook(&attrs);
    }
    Ok(None)
}

fn parse_chain_hook(attrs: &[(u16, &[u8])]) -> Result<Option<ChainHook>, NftError> {
    let Some(nested) = wire::find_attr(attrs, wire::chain::HOOK) else {
        return Ok(None);
    };
    let hook_attrs = wire::parse_attrs(nested)?;
    let be32 = |ty| {
        wire::find_attr(&hook_attrs, ty)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_be_bytes)
    };
    let (Some(hooknum), Some(priority)) = (
        be32(wire::chain::HOOK_HOOKNUM),
        be32(wire::chain::HOOK_PRIORITY),
    ) else {
        return Err(NftError::MalformedReply {
            what: "base chain without hook number or priority",
        });
    };
    let hook = [
        Hook::Prerouting,
        Hook::Input,
        Hook::Forward,
        Hook::Output,
        Hook::Postrouting,
    ]
    .into_iter()
    .find(|h| h.number() == hooknum);
    let chain_type = wire::find_attr(attrs, wire::chain::TYPE).map(wire::attr_str);
    let chain_type = [ChainType::Filter, ChainType::Nat, ChainType::Route]
        .into_iter()
        .find(|t| Some(t.name()) == chain_type.as_deref());
    Ok(hook.zip(chain_type).map(|(hook, chain_type)| ChainHook {
        chain_type,
        hook,
        priority: priority as i32,
    }))
}

fn parse_rule(payload: &[u8]) -> Result<RuleSummary, NftError> {
    let attrs = wire::parse_attrs(payload)?;
    let handle = wire::find_attr(&attrs, wire::rule::HANDLE)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_be_bytes)
        .ok_or(NftError::MalformedReply {
            what: "rule without handle",
        })?;
    let mut expr_kinds = Vec::new();
    let mut constants = Vec::new();
    if let Some(list) = wire::find_attr(&attrs, wire::rule::EXPRESSIONS) {
        for (_, elem) in wire::parse_attrs(list)? {
            let elem = wire::parse_attrs(elem)?;
            let name =
                wire::find_attr(&elem, wire::rule::EXPR_NAME).ok_or(NftError::MalformedReply {
                    what: "expression without name",
                })?;
            let kind = wire::attr_str(name);
            let data = match wire::find_attr(&elem, wire::rule::EXPR_DATA) {
                Some(d) => wire::parse_attrs(d)?,
                None => Vec::new(),
            };
            if let Some(c) = listed_constant(&kind, &data)? {
                constants.push(c);
            }
            expr_kinds.push(kind);
        }
    }
    Ok(RuleSummary {
        handle,
        expr_kinds,
        constants,
    })
}

/// The constant of a listed expression, mirroring [`Expr::constant`].
fn listed_constant(kind: &str, data: &[(u16, &[u8])]) -> Result<Option<Vec<u8>>, NftError> {
    use wire::expr as e;
    let value = |ty| -> Result<Option<Vec<u8>>, NftError> {
        let Some(nested) = wire::find_attr(data, ty) else {
            return Ok(None);
        };
        Ok(wire::find_attr(&wire::parse_attrs(nested)?, e::DATA_VALUE).map(<[u8]>::to_vec))
    };
    Ok(match kind {
        "cmp" => value(e::CMP_DATA)?,
        "immediate" => value(e::IMMEDIATE_DATA)?,
        "lookup" => wire::find_attr(data, e::LOOKUP_SET).map(|s| wire::attr_str(s).into_bytes()),
        _ => None,
    })
}

fn request(ty: u16, flags: u16, table: &Table, attrs: &[Attr]) -> Result<Vec<u8>, NftError> {
    let hdr = MsgHeader {
        ty: wire::nft_type(ty),
        flags: wire::NLM_F_REQUEST | flags,
        seq: SEQ,
        family: table.family.nfproto(),
        res_id: 0,
    };
    let mut out = Vec::new();
    wire::write_msg(&mut out, hdr, attrs)?;
    Ok(out)
}

/// Sends a GET for one object: `Ok(true)` when the kernel acks, `Ok(false)` on ENOENT.
fn exists(
    ty: u16,
    table: &Table,
    attrs: &[Attr],
    describe: impl Fn() -> String,
) -> Result<bool, NftError> {
    let sock = NfSocket::open()?;
    sock.send(&request(ty, wire::NLM_F_ACK, table, attrs)?)?;
    let mut buf = vec![0u8; RECV_BUF_LEN];
    loop {
        let Some(n) = sock.recv(&mut buf)? else {
            return Err(NftError::AckTimeout { missing: 1 });
        };
        for reply in wire::parse_replies(&buf[..n])? {
            match reply {
                Reply::Ack { seq: SEQ } => return Ok(true),
                Reply::Error { seq: SEQ, errno } if errno == Errno::ENOENT as i32 => {
                    return Ok(false);
                }
                Reply::Error { seq: SEQ, errno } => {
                    return Err(NftError::Kernel {
                        command: describe(),
                        source: Errno::from_raw(errno),
                    });
                }
                _ => {}
            }
        }
    }
}

/// Runs a dump and returns the attribute bytes (after `nfgenmsg`) of every object message.
fn dump(
    ty: u16,
    table: &Table,
    attrs: &[Attr],
    describe: impl Fn() -> String,
) -> Result<Vec<Vec<u8>>, NftError> {
    let req = request(ty, wire::NLM_F_DUMP, table, attrs)?;
    for _ in 0..DUMP_ATTEMPTS {
        let sock = NfSocket::open()?;
        sock.send(&req)?;
        if let Some(objects) = collect_dump(&sock, &describe)? {
            return Ok(objects);
        }
    }
    Err(NftError::Kernel {
        command: describe(),
        source: Errno::EINTR,
    })
}

/// Reads one dump to its end. `Ok(None)` when the kernel flagged it as interrupted.
fn collect_dump(
    sock: &NfSocket,
    describe: &impl Fn() -> String,
) -> Result<Option<Vec<Vec<u8>>>, NftError> {
    let mut objects = Vec::new();
    let mut interrupted = false;
    let mut buf = vec![0u8; RECV_BUF_LEN];
    loop {
        let Some(n) = sock.recv(&mut buf)? else {
            return Err(NftError::AckTimeout { missing: 1 });
        };
        for msg in wire::split_msgs(&buf[..n])? {
            if msg.seq != SEQ {
                continue;
            }
            interrupted |= msg.flags & wire::NLM_F_DUMP_INTR != 0;
            let failed = |errno: i32| NftError::Kernel {
                command: describe(),
                source: Errno::from_raw(errno),
            };
            match msg.ty {
                wire::NLMSG_DONE => {
                    // NLMSG_DONE carries the dump's final status (0 or a negative errno).
                    let status = msg
                        .payload
                        .get(..4)
                        .and_then(|b| <[u8; 4]>::try_from(b).ok())
                        .map_or(0, i32::from_ne_bytes);
                    if status < 0 {
                        return Err(failed(status.saturating_neg()));
                    }
                    return Ok((!interrupted).then_some(objects));
                }
                wire::NLMSG_ERROR => match msg.reply()? {
                    Reply::Error { errno, .. } => return Err(failed(errno)),
                    _ => return Ok((!interrupted).then_some(objects)),
                },
                _ => objects.push(
                    msg.payload
                        .get(4..)
                        .ok_or(NftError::MalformedReply {
                            what: "message shorter than nfgenmsg",
                        })?
                        .to_vec(),
                ),
            }
        }
    }
}
