//! A small nf_tables client over netlink, in pure Rust (no `nft` binary, no libnftnl).
//!
//! Scope is what the redirection needs: tables, base and regular chains, rules built from a
//! handful of [`Expr`]s, and named address sets with commented elements ([`Set`], [`SetElems`]).
//! Changes go through a [`Batch`], sent as ONE nfnetlink batch (`NFNL_MSG_BATCH_BEGIN` ..
//! `NFNL_MSG_BATCH_END`, `res_id` = `NFNL_SUBSYS_NFTABLES`), which the kernel applies atomically:
//! either every command takes effect or none does. Every command carries `NLM_F_ACK`; the first
//! failing command is reported as [`NftError::Kernel`] naming it.
//!
//! Sockets are created on the calling thread, so the commands act on that thread's network
//! namespace (use [`crate::netns::Netns::run`] to target a pod). Reading back ([`table_exists`],
//! [`set_exists`], [`list_set_elems`], [`list_rules`]) works the same way.

mod expr;
mod query;
mod set;
mod socket;
mod wire;

#[cfg(test)]
mod set_tests;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;

use nix::errno::Errno;

pub use expr::{
    CmpOp, CtKey, Expr, ImmediateData, MetaKey, NatKind, PayloadBase, Register, Verdict,
};
pub use query::{
    RuleSummary, base_chain_hook, list_rules, list_set_elems, set_exists, table_exists,
};
pub use set::{MAX_COMMENT_LEN, Set, SetElem, SetElems, SetKeyType};

use socket::{NfSocket, RECV_BUF_LEN};
use wire::{Attr, MsgHeader, Reply};

/// Errors from building, sending or committing nf_tables messages.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// Creating or configuring the netlink socket failed.
    #[error("NETLINK_NETFILTER {op}: {source}")]
    Socket {
        /// The failing call (`socket`, `bind`, ...).
        op: &'static str,
        /// Errno.
        #[source]
        source: Errno,
    },
    /// Sending the request failed.
    #[error("send nf_tables request: {source}")]
    Send {
        /// Errno.
        #[source]
        source: Errno,
    },
    /// Receiving a reply failed.
    #[error("receive nf_tables reply: {source}")]
    Recv {
        /// Errno.
        #[source]
        source: Errno,
    },
    /// The kernel rejected a command (the whole batch was rolled back).
    #[error("{command}: {source}")]
    Kernel {
        /// The rejected command in `nft` syntax, e.g. `add chain inet t c`.
        command: String,
        /// Errno returned by the kernel (ENOENT: missing table/chain; EOPNOTSUPP / ENOENT on an
        /// expression: kernel module missing; EPERM: no CAP_NET_ADMIN).
        #[source]
        source: Errno,
    },
    /// No reply arrived within the receive timeout.
    #[error("timed out waiting for nf_tables replies ({missing} outstanding)")]
    AckTimeout {
        /// Number of commands without an ack.
        missing: usize,
    },
    /// A reply could not be parsed.
    #[error("malformed netlink reply: {what}")]
    MalformedReply {
        /// What was wrong.
        what: &'static str,
    },
    /// A message or attribute exceeded the netlink length fields.
    #[error("{what} too large ({len} bytes)")]
    TooLarge {
        /// Which element.
        what: &'static str,
        /// Its length.
        len: usize,
    },
}

/// Address family of a table (`NFPROTO_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `inet`: IPv4 and IPv6 together (`NFPROTO_INET` = 1).
    Inet,
    /// `ip` (`NFPROTO_IPV4` = 2).
    Ip,
    /// `ip6` (`NFPROTO_IPV6` = 10).
    Ip6,
}

/// A table, identified by family and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Family.
    pub family: Family,
    /// Name (at most 255 bytes).
    pub name: String,
}

/// Type of a base chain; decides which expressions it may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainType {
    /// `filter`.
    Filter,
    /// `nat` (only the first packet of a connection is seen; `redir` allowed).
    Nat,
    /// `route` (output only; re-routes when mark/addresses change).
    Route,
}

/// Netfilter hook of a base chain (`enum nf_inet_hooks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// `NF_INET_PRE_ROUTING`.
    Prerouting,
    /// `NF_INET_LOCAL_IN`.
    Input,
    /// `NF_INET_FORWARD`.
    Forward,
    /// `NF_INET_LOCAL_OUT`.
    Output,
    /// `NF_INET_POST_ROUTING`.
    Postrouting,
}

/// What makes a chain a base chain: its type, hook and priority (lower runs first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainHook {
    /// Chain type.
    pub chain_type: ChainType,
    /// Hook.
    pub hook: Hook,
    /// Priority, e.g. -100 for `dstnat`, -150 for `mangle`, -300 for `raw`.
    pub priority: i32,
}

/// A chain: a base chain when `hook` is set, otherwise a jump target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Owning table.
    pub table: Table,
    /// Chain name.
    pub name: String,
    /// Hook for base chains.
    pub hook: Option<ChainHook>,
}

/// A rule appended to a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Owning table.
    pub table: Table,
    /// Chain name.
    pub chain: String,
    /// Expressions, evaluated in order.
    pub exprs: Vec<Expr>,
}

/// One command of a [`Batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `NFT_MSG_NEWTABLE` with `NLM_F_CREATE`: creates the table, no-op when it exists.
    AddTable(Table),
    /// `NFT_MSG_DELTABLE`: deletes the table with all its chains and rules (ENOENT if missing).
    DelTable(Table),
    /// `NFT_MSG_NEWCHAIN` with `NLM_F_CREATE`.
    AddChain(Chain),
    /// `NFT_MSG_NEWRULE` with `NLM_F_CREATE | NLM_F_APPEND`: appends at the end of the chain.
    AddRule(Rule),
    /// `NFT_MSG_DELRULE` naming only the table: deletes every rule of every chain of the table and
    /// keeps the chains and sets with their elements (`nft flush table`; ENOENT if the table is
    /// missing).
    FlushTable(Table),
    /// `NFT_MSG_NEWSET` with `NLM_F_CREATE`: creates the set; no-op when it exists (its elements
    /// stay).
    AddSet(Set),
    /// `NFT_MSG_DELSET`: deletes the set and its elements (ENOENT if missing, EBUSY while a rule
    /// refers to it).
    DelSet {
        /// Owning table.
        table: Table,
        /// Set name.
        name: String,
    },
    /// `NFT_MSG_NEWSETELEM` with `NLM_F_CREATE`: adds the elements with their comments. An element
    /// already in the set is left as it is, comment included (delete it first to change it).
    AddSetElems(SetElems),
    /// `NFT_MSG_DELSETELEM`: deletes the elements by key (comments are not sent; ENOENT if one is
    /// missing).
    DelSetElems(SetElems),
    /// `NFT_MSG_DELSETELEM` without elements: empties the set (`nft flush set`).
    FlushSet {
        /// Owning table.
        table: Table,
        /// Set name.
        name: String,
    },
}

/// An ordered list of commands applied in one nf_tables transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    commands: Vec<Command>,
}

// === impl Family / ChainType / Hook ===

impl Family {
    /// `NFPROTO_*` value (the `nfgenmsg` family byte).
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Inet => 1,
            Family::Ip => 2,
            Family::Ip6 => 10,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Inet => "inet",
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
        })
    }
}

impl ChainType {
    /// The name the kernel knows the type by (`NFTA_CHAIN_TYPE`).
    pub fn name(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
        }
    }
}

impl Hook {
    /// The `NF_INET_*` hook number.
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
        }
    }

    /// The `nft` keyword.
    pub fn name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

// === impl Table ===

impl Table {
    /// An `inet` table.
    pub fn inet(name: impl Into<String>) -> Table {
        Table {
            family: Family::Inet,
            name: name.into(),
        }
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.family, self.name)
    }
}

// === impl Command ===

impl Command {
    fn table(&self) -> &Table {
        match self {
            Command::AddTable(t) | Command::DelTable(t) | Command::FlushTable(t) => t,
            Command::AddChain(c) => &c.table,
            Command::AddRule(r) => &r.table,
            Command::AddSet(s) => &s.table,
            Command::DelSet { table, .. } | Command::FlushSet { table, .. } => table,
            Command::AddSetElems(e) | Command::DelSetElems(e) => &e.table,
        }
    }

    fn header(&self, seq: u32) -> MsgHeader {
        use wire::{NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, msg};
        let (m, flags) = match self {
            Command::AddTable(_) => (msg::NEWTABLE, NLM_F_CREATE),
            Command::DelTable(_) => (msg::DELTABLE, 0),
            Command::AddChain(_) => (msg::NEWCHAIN, NLM_F_CREATE),
            Command::AddRule(_) => (msg::NEWRULE, NLM_F_CREATE | NLM_F_APPEND),
            Command::FlushTable(_) => (msg::DELRULE, 0),
            Command::AddSet(_) => (msg::NEWSET, NLM_F_CREATE),
            Command::DelSet { .. } => (msg::DELSET, 0),
            Command::AddSetElems(_) => (msg::NEWSETELEM, NLM_F_CREATE),
            Command::DelSetElems(_) | Command::FlushSet { .. } => (msg::DELSETELEM, 0),
        };
        MsgHeader {
            ty: wire::nft_type(m),
            flags: NLM_F_REQUEST | NLM_F_ACK | flags,
            seq,
            family: self.table().family.nfproto(),
            res_id: 0,
        }
    }

    /// The message's attributes. `next_set_id` numbers the sets created in the batch
    /// (`NFTA_SET_ID`, which the kernel requires; 1, 2, .. like nft). Fails only on a comment longer
    /// than [`MAX_COMMENT_LEN`].
    pub(crate) fn attrs(&self, next_set_id: &mut u32) -> Result<Vec<Attr>, NftError> {
        use wire::{chain as c, rule as r, table as t};
        Ok(match self {
            Command::AddTable(table) | Command::DelTable(table) => {
                vec![Attr::strz(t::NAME, &table.name)]
            }
            Command::FlushTable(table) => vec![Attr::strz(r::TABLE, &table.name)],
            Command::AddSet(s) => {
                let id = *next_set_id;
                *next_set_id = id.wrapping_add(1);
                set::new_set_attrs(s, id)?
            }
            Command::DelSet { table, name } => set::del_set_attrs(table, name),
            Command::AddSetElems(e) => set::elems_attrs(e, true)?,
            Command::DelSetElems(e) => set::elems_attrs(e, false)?,
            Command::FlushSet { table, name } => set::flush_set_attrs(table, name),
            Command::AddChain(chain) => {
                let mut v = vec![
                    Attr::strz(c::TABLE, &chain.table.name),
                    Attr::strz(c::NAME, &chain.name),
                ];
                if let Some(h) = &chain.hook {
                    v.push(Attr::strz(c::TYPE, h.chain_type.name()));
                    v.push(Attr::Nested(
                        c::HOOK,
                        vec![
                            Attr::be32(c::HOOK_HOOKNUM, h.hook.number()),
                            Attr::Bytes(c::HOOK_PRIORITY, h.priority.to_be_bytes().to_vec()),
                        ],
                    ));
                }
                v
            }
            Command::AddRule(rule) => vec![
                Attr::strz(r::TABLE, &rule.table.name),
                Attr::strz(r::CHAIN, &rule.chain),
                Attr::Nested(r::EXPRESSIONS, rule.exprs.iter().map(Expr::attr).collect()),
            ],
        })
    }
}

impl fmt::Display for Command {
    /// `nft`-style description used in errors, e.g. `add rule inet t c (3 expressions)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::AddTable(t) => write!(f, "add table {t}"),
            Command::DelTable(t) => write!(f, "delete table {t}"),
            Command::AddChain(c) => {
                write!(f, "add chain {} {}", c.table, c.name)?;
                if let Some(h) = &c.hook {
                    write!(
                        f,
                        " {{ type {} hook {} priority {} ; }}",
                        h.chain_type.name(),
                        h.hook.name(),
                        h.priority
                    )?;
                }
                Ok(())
            }
            Command::AddRule(r) => {
                let kinds: Vec<&str> = r.exprs.iter().map(Expr::kind).collect();
                write!(f, "add rule {} {} [{}]", r.table, r.chain, kinds.join(" "))
            }
            Command::FlushTable(t) => write!(f, "flush table {t}"),
            Command::AddSet(s) => write!(
                f,
                "add set {} {} {{ type {} ; }}",
                s.table,
                s.name,
                s.key_type.name()
            ),
            Command::DelSet { table, name } => write!(f, "delete set {table} {name}"),
            Command::AddSetElems(e) => write!(f, "add element {}", ElemList(e)),
            Command::DelSetElems(e) => write!(f, "delete element {}", ElemList(e)),
            Command::FlushSet { table, name } => write!(f, "flush set {table} {name}"),
        }
    }
}

/// `inet t s { 10.0.0.1 comment "a", 10.0.0.2 }` for error messages.
struct ElemList<'a>(&'a SetElems);

impl fmt::Display for ElemList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = self.0;
        let elems: Vec<String> = e.elems.iter().map(ToString::to_string).collect();
        write!(f, "{} {} {{ {} }}", e.table, e.set, elems.join(", "))
    }
}

// === impl Batch ===

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch::default()
    }

    /// Appends a command.
    pub fn push(&mut self, command: Command) -> &mut Batch {
        self.commands.push(command);
        self
    }

    /// The commands in order.
    pub fn commands(&self) -> &[Command] {
        &self.commands
    }

    /// Encodes the batch: BEGIN with sequence `first_seq`, the commands with `first_seq + 1 ..`,
    /// then END. Returns the bytes of the single datagram to send.
    pub fn encode(&self, first_seq: u32) -> Result<Vec<u8>, NftError> {
        let delimiter = |ty, seq| MsgHeader {
            ty,
            flags: wire::NLM_F_REQUEST,
            seq,
            family: wire::AF_UNSPEC,
            res_id: wire::NFNL_SUBSYS_NFTABLES,
        };
        let mut out = Vec::new();
        wire::write_msg(
            &mut out,
            delimiter(wire::NFNL_MSG_BATCH_BEGIN, first_seq),
            &[],
        )?;
        let mut seq = first_seq;
        let mut set_id = 1;
        for command in &self.commands {
            seq = seq.wrapping_add(1);
            let attrs = command.attrs(&mut set_id)?;
            wire::write_msg(&mut out, command.header(seq), &attrs)?;
        }
        seq = seq.wrapping_add(1);
        wire::write_msg(&mut out, delimiter(wire::NFNL_MSG_BATCH_END, seq), &[])?;
        Ok(out)
    }

    /// Sends the batch as one transaction in the calling thread's network namespace and waits for
    /// every command's ack. On failure the kernel has rolled everything back and the error names
    /// the first rejected command. An empty batch sends nothing.
    pub fn commit(&self) -> Result<(), NftError> {
        if self.commands.is_empty() {
            return Ok(());
        }
        const FIRST_SEQ: u32 = 1;
        let sock = NfSocket::open()?;
        sock.send(&self.encode(FIRST_SEQ)?)?;
        // Sequence numbers as assigned by `encode`: command i has FIRST_SEQ + 1 + i.
        let mut pending: BTreeMap<u32, usize> =
            (FIRST_SEQ + 1..).zip(0..self.commands.len()).collect();
        let mut failures = ReplyCollector::default();
        let mut buf = vec![0u8; RECV_BUF_LEN];
        while !pending.is_empty() {
            let Some(n) = sock.recv(&mut buf)? else {
                if failures.first.is_some() {
                    break;
                }
                return Err(NftError::AckTimeout {
                    missing: pending.len(),
                });
            };
            for reply in wire::parse_replies(&buf[..n])? {
                failures.record(reply, FIRST_SEQ, &mut pending)?;
            }
        }
        match failures.first {
            Some((index, source)) => Err(NftError::Kernel {
                command: self
                    .commands
                    .get(index)
                    .map_or_else(String::new, ToString::to_string),
                source,
            }),
            None => Ok(()),
        }
    }
}

/// Tracks acks of a batch and remembers the earliest failing command.
#[derive(Debug, Default)]
struct ReplyCollector {
    first: Option<(usize, Errno)>,
}

impl ReplyCollector {
    fn record(
        &mut self,
        reply: Reply,
        begin_seq: u32,
        pending: &mut BTreeMap<u32, usize>,
    ) -> Result<(), NftError> {
        match reply {
            Reply::Ack { seq } => {
                pending.remove(&seq);
            }
            // An error on BEGIN rejects the batch as a whole (e.g. EPERM without CAP_NET_ADMIN).
            Reply::Error { seq, errno } if seq == begin_seq => {
                return Err(NftError::Kernel {
                    command: "begin nf_tables batch".into(),
                    source: Errno::from_raw(errno),
                });
            }
            Reply::Error { seq, errno } => {
                if let Some(index) = pending.remove(&seq)
                    && self.first.is_none_or(|(first, _)| index < first)
                {
                    self.first = Some((index, Errno::from_raw(errno)));
                }
            }
            Reply::Other { .. } => {}
        }
        Ok(())
    }
}
