//! L4 authorization of inbound connections, with ztunnel's semantics (`src/rbac.rs`,
//! `../shared/spec/ztunnel.md` §6).
//!
//! The policies that apply to a destination workload are, as ztunnel indexes them, the `Global`
//! ones (and `Namespace` ones of namespace ""), the `Namespace` ones of its namespace, and the
//! ones it names in `authorizationPolicies` (`namespace/name`). Dry-run policies are evaluated and logged, never enforced. Then: any
//! matching DENY rejects; without ALLOW policies the connection is allowed; otherwise one ALLOW
//! must match.
//!
//! A policy matches when any of its rules matches; a rule when all its clauses match; a clause
//! when it is empty or any of its matches matches. In a match each L4 field that is set must hold
//! (values of one field are ORed, `not*` fields must hold for none). Identity fields compare the
//! peer's mTLS identity: without one (plaintext) they never match, so `not*` identity fields hold.
//!
//! What L4 cannot see fails closed (issue 17; istiod's own reading for ambient, see
//! `config/policy.rs`): in a DENY, L7 attributes are taken as matching, so a match with only L7
//! attributes, or none at all (`{}`), matches every connection and the DENY rejects all that the
//! rest of its rule selects. In an ALLOW, a match with L7 attributes or without any L4 field
//! never matches, so an ALLOW made of such matches allows nothing. (ztunnel skips an empty match
//! in both, which lets an HTTP-only DENY allow everything.)

use std::net::{IpAddr, SocketAddr};

use crate::proxy::config::{LocalPolicy, PolicyAction, PolicyMatch, PolicyScope};
use crate::proxy::identity::Identity;
use crate::proxy::state::{ProxyState, Workload};

/// What authorization sees of an inbound connection.
#[derive(Debug, Clone, Copy)]
pub struct Connection<'a> {
    /// The peer's verified identity (HBONE), `None` for plaintext.
    pub src_identity: Option<&'a Identity>,
    /// TCP source address (the HBONE peer's, or the plaintext client's).
    pub src_ip: IpAddr,
    /// The final destination: the workload's IP and target port (not 15008).
    pub dst: SocketAddr,
}

/// Why a connection was rejected; the text is ztunnel's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// A DENY policy matched (`namespace/name`).
    #[error("explicitly denied by: {0}")]
    Explicit(String),
    /// ALLOW policies apply and none matched.
    #[error("allow policies exist, but none allowed")]
    NotAllowed,
    /// The destination pod is served from its handoff (its workload record has not arrived) and
    /// its namespace has `WorkloadSelector` policies, which only the record says whether they
    /// select it: fail closed until it arrives.
    #[error(
        "workload record of the destination not known yet, and namespace {0} has workload-selector policies"
    )]
    RecordPending(String),
}

/// [`check`] for a pod whose workload `dst` may not be in `state` yet (served from its handoff):
/// such a pod is refused while its namespace has `WorkloadSelector` policies
/// ([`Denied::RecordPending`]), since the missing record's `authorizationPolicies` decide whether
/// they apply; otherwise [`check`].
pub fn check_pod(state: &ProxyState, dst: &Workload, conn: &Connection<'_>) -> Result<(), Denied> {
    let known = state.workload_by_uid(&dst.uid).is_some()
        || state.workload_by_name(&dst.namespace, &dst.name).is_some();
    if !known
        && state
            .policies()
            .any(|p| p.scope == PolicyScope::WorkloadSelector && p.namespace == dst.namespace)
    {
        return Err(Denied::RecordPending(dst.namespace.clone()));
    }
    check(state, dst, conn)
}

/// Checks `conn` against the policies of `state` that apply to `dst`.
///
/// Errors: [`Denied`] when the connection must be rejected.
pub fn check(state: &ProxyState, dst: &Workload, conn: &Connection<'_>) -> Result<(), Denied> {
    let mut allow_policies = false;
    let mut allowed = false;
    for policy in state.policies().filter(|p| applies(p, dst)) {
        let matched = policy_matches(policy, conn);
        if policy.dry_run {
            tracing::debug!(
                policy = %key(policy),
                action = ?policy.action,
                matched,
                "dry-run authorization policy"
            );
            continue;
        }
        match policy.action {
            PolicyAction::Deny if matched => return Err(Denied::Explicit(key(policy))),
            PolicyAction::Deny => {}
            PolicyAction::Allow => {
                allow_policies = true;
                allowed |= matched;
            }
        }
    }
    if allow_policies && !allowed {
        return Err(Denied::NotAllowed);
    }
    Ok(())
}

/// `namespace/name`, as workloads reference selector policies.
fn key(p: &LocalPolicy) -> String {
    format!("{}/{}", p.namespace, p.name)
}

fn applies(p: &LocalPolicy, dst: &Workload) -> bool {
    let named = || {
        dst.authorization_policies
            .iter()
            .any(|k| k.split_once('/') == Some((p.namespace.as_str(), p.name.as_str())))
    };
    match p.scope {
        PolicyScope::Global => true,
        PolicyScope::Namespace => p.namespace.is_empty() || p.namespace == dst.namespace || named(),
        PolicyScope::WorkloadSelector => named(),
    }
}

fn policy_matches(p: &LocalPolicy, conn: &Connection<'_>) -> bool {
    p.rules.iter().any(|rule| {
        rule.iter().all(|clause| {
            clause.is_empty() || clause.iter().any(|m| match_matches(m, p.action, conn))
        })
    })
}

/// One match of a policy with `action`, failing closed on what L4 cannot check (module docs).
fn match_matches(m: &PolicyMatch, action: PolicyAction, conn: &Connection<'_>) -> bool {
    match action {
        // An empty match has no field that could fail: it holds.
        PolicyAction::Deny => l4_holds(m, conn),
        PolicyAction::Allow => m.l7_attributes.is_empty() && !m.is_l4_empty() && l4_holds(m, conn),
    }
}

/// Every L4 field of `m` that is set holds for `conn` (L7 attributes aside).
fn l4_holds(m: &PolicyMatch, conn: &Connection<'_>) -> bool {
    let id = conn.src_identity;
    let namespace = |f: &dyn Fn(&str) -> bool| id.is_some_and(|i| f(&i.namespace));
    // the SPIFFE id without `spiffe://`: `<td>/ns/<ns>/sa/<sa>`
    let principal = id.map(|i| {
        format!(
            "{}/ns/{}/sa/{}",
            i.trust_domain, i.namespace, i.service_account
        )
    });
    let principal_is = |f: &dyn Fn(&str) -> bool| principal.as_deref().is_some_and(f);
    let account =
        |ns: &str, sa: &str| id.is_some_and(|i| &*i.namespace == ns && &*i.service_account == sa);
    let dst_ip = conn.dst.ip();
    let dst_port = conn.dst.port();
    field(&m.namespaces, |s| namespace(&|ns| s.matches(ns)))
        && not_field(&m.not_namespaces, |s| namespace(&|ns| s.matches(ns)))
        && field(&m.service_accounts, |a| {
            account(&a.namespace, &a.service_account)
        })
        && not_field(&m.not_service_accounts, |a| {
            account(&a.namespace, &a.service_account)
        })
        && field(&m.principals, |s| principal_is(&|p| s.matches(p)))
        && not_field(&m.not_principals, |s| principal_is(&|p| s.matches(p)))
        && field(&m.source_ips, |c| c.contains(conn.src_ip))
        && not_field(&m.not_source_ips, |c| c.contains(conn.src_ip))
        && field(&m.destination_ips, |c| c.contains(dst_ip))
        && not_field(&m.not_destination_ips, |c| c.contains(dst_ip))
        && field(&m.destination_ports, |p| *p == dst_port)
        && not_field(&m.not_destination_ports, |p| *p == dst_port)
}

/// An unset field holds; a set one holds when any value matches.
fn field<T>(values: &[T], matches: impl Fn(&T) -> bool) -> bool {
    values.is_empty() || values.iter().any(matches)
}

/// A `not*` field holds when no value matches.
fn not_field<T>(values: &[T], matches: impl Fn(&T) -> bool) -> bool {
    !values.iter().any(matches)
}

#[cfg(test)]
mod tests;
