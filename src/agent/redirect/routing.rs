//! Policy routing that accompanies the nftables rules (spec §4.2), over rtnetlink:
//!
//! - `ip rule add fwmark 0x111/0xfff lookup 100 pref 32764` (and `ip -6 rule ...`);
//! - `ip route replace local 0.0.0.0/0 dev lo table 100` (and `::/0` unless IPv6 is disabled on lo);
//! - `lo` brought up, since a fresh netns has it down and the local route needs it.
//!
//! Everything runs on the calling thread (inside `Netns::run`) with a current-thread tokio runtime,
//! so the rtnetlink socket lives in the pod's namespace.

use std::net::{Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::link::LinkFlags;
use netlink_packet_route::route::{RouteMessage, RouteProtocol, RouteScope, RouteType};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

use super::RedirectError;
use crate::mesh::{CONNMARK, MARK_MASK, ROUTE_TABLE, RULE_PRIORITY};

const EEXIST: i32 = libc::EEXIST;
const ENOENT: i32 = libc::ENOENT;
const ESRCH: i32 = libc::ESRCH;
const EAFNOSUPPORT: i32 = libc::EAFNOSUPPORT;

/// Upper bound on deleting duplicated rules left by other tools (each pass removes one).
const MAX_RULE_DELETES: usize = 16;

/// IP family of a rule or route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    fn name(self) -> &'static str {
        match self {
            IpFamily::V4 => "ipv4",
            IpFamily::V6 => "ipv6",
        }
    }
}

/// Brings `lo` up and installs the rule and local route for v4, and for v6 when `ipv6` (otherwise
/// removes v6 leftovers of an earlier dual-stack apply).
pub(super) fn apply(ipv6: bool) -> Result<(), RedirectError> {
    let v6_route = ipv6 && !ipv6_disabled_on_lo();
    with_handle(|handle| async move {
        let lo = loopback_up(&handle).await?;
        add_rule(&handle, IpFamily::V4).await?;
        replace_route(&handle, IpFamily::V4, lo).await?;
        if ipv6 {
            add_rule(&handle, IpFamily::V6).await?;
        } else {
            delete_rules(&handle, IpFamily::V6).await?;
        }
        if v6_route {
            replace_route(&handle, IpFamily::V6, lo).await?;
        } else {
            delete_route(&handle, IpFamily::V6).await?;
        }
        Ok(())
    })
}

/// Deletes the rules and routes of both families; missing ones are fine.
pub(super) fn remove() -> Result<(), RedirectError> {
    with_handle(|handle| async move {
        for family in [IpFamily::V4, IpFamily::V6] {
            delete_rules(&handle, family).await?;
            delete_route(&handle, family).await?;
        }
        Ok(())
    })
}

/// `/proc/sys/net/ipv6/conf/lo/disable_ipv6` is "1", or IPv6 is absent (read in this thread's netns).
fn ipv6_disabled_on_lo() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
        .map(|s| s.trim() == "1")
        .unwrap_or(true)
}

/// Runs `f` with an rtnetlink handle on a current-thread runtime of the calling thread.
fn with_handle<F, Fut>(f: F) -> Result<(), RedirectError>
where
    F: FnOnce(Handle) -> Fut,
    Fut: Future<Output = Result<(), RedirectError>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| RedirectError::Runtime { source })?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|source| RedirectError::RtnetlinkSocket { source })?;
        let conn = tokio::spawn(conn);
        let result = f(handle).await;
        conn.abort();
        result
    })
}

/// The errno of a netlink error reply, if that is what `e` is.
fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| c.get().saturating_neg()),
        _ => None,
    }
}

/// Sets `lo` up if it is down; returns its interface index.
async fn loopback_up(handle: &Handle) -> Result<u32, RedirectError> {
    let link = handle
        .link()
        .get()
        .match_name("lo".into())
        .execute()
        .try_next()
        .await
        .map_err(|source| RedirectError::Link {
            op: "get lo",
            source,
        })?
        .ok_or(RedirectError::NoLoopback)?;
    let index = link.header.index;
    if !link.header.flags.contains(LinkFlags::Up) {
        let msg = LinkUnspec::new_with_index(index).up().build();
        handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|source| RedirectError::Link {
                op: "set lo up",
                source,
            })?;
    }
    Ok(index)
}

/// `fwmark 0x111/0xfff lookup 100 pref 32764` for `family`.
fn rule_message(family: IpFamily) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = match family {
        IpFamily::V4 => AddressFamily::Inet,
        IpFamily::V6 => AddressFamily::Inet6,
    };
    msg.header.action = RuleAction::ToTable;
    // header.table stays RT_TABLE_UNSPEC; FRA_TABLE carries the table id.
    msg.attributes = vec![
        RuleAttribute::Table(ROUTE_TABLE),
        RuleAttribute::FwMark(CONNMARK),
        RuleAttribute::FwMask(MARK_MASK),
        RuleAttribute::Priority(RULE_PRIORITY),
    ];
    msg
}

async fn add_rule(handle: &Handle, family: IpFamily) -> Result<(), RedirectError> {
    let mut req = handle.rule().add();
    *req.message_mut() = rule_message(family);
    match req.execute().await {
        Ok(()) => Ok(()),
        Err(e) if errno(&e) == Some(EEXIST) => Ok(()),
        Err(source) => Err(RedirectError::Rule {
            op: "add",
            family: family.name(),
            source,
        }),
    }
}

async fn delete_rules(handle: &Handle, family: IpFamily) -> Result<(), RedirectError> {
    for _ in 0..MAX_RULE_DELETES {
        match handle.rule().del(rule_message(family)).execute().await {
            Ok(()) => continue,
            Err(e) if matches!(errno(&e), Some(ENOENT | EAFNOSUPPORT)) => return Ok(()),
            Err(source) => {
                return Err(RedirectError::Rule {
                    op: "delete",
                    family: family.name(),
                    source,
                });
            }
        }
    }
    Ok(())
}

/// `local 0.0.0.0/0 dev lo table 100` (or `::/0`), as `ip route` builds it (proto boot, scope host).
fn route_message(family: IpFamily, lo: Option<u32>) -> RouteMessage {
    match family {
        IpFamily::V4 => finish_route(
            RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(Ipv4Addr::UNSPECIFIED, 0),
            lo,
        ),
        IpFamily::V6 => finish_route(
            RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(Ipv6Addr::UNSPECIFIED, 0),
            lo,
        ),
    }
}

fn finish_route<T>(b: RouteMessageBuilder<T>, lo: Option<u32>) -> RouteMessage {
    let b = b
        .table_id(ROUTE_TABLE)
        .kind(RouteType::Local)
        .scope(RouteScope::Host)
        .protocol(RouteProtocol::Boot);
    match lo {
        Some(index) => b.output_interface(index).build(),
        None => b.build(),
    }
}

async fn replace_route(handle: &Handle, family: IpFamily, lo: u32) -> Result<(), RedirectError> {
    handle
        .route()
        .add(route_message(family, Some(lo)))
        .replace()
        .execute()
        .await
        .map_err(|source| RedirectError::Route {
            op: "replace",
            family: family.name(),
            source,
        })
}

async fn delete_route(handle: &Handle, family: IpFamily) -> Result<(), RedirectError> {
    match handle
        .route()
        .del(route_message(family, None))
        .execute()
        .await
    {
        Ok(()) => Ok(()),
        Err(e) if matches!(errno(&e), Some(ENOENT | ESRCH | EAFNOSUPPORT)) => Ok(()),
        Err(source) => Err(RedirectError::Route {
            op: "delete",
            family: family.name(),
            source,
        }),
    }
}
