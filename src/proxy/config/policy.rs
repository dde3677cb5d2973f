//! Authorization policies of the local config (`policies:`), shaped like ztunnel's
//! `src/rbac.rs` `Authorization` (proto `istio.security.Authorization`, spec §6).
//!
//! They are parsed, validated and kept in the state; [`crate::proxy::authz`] enforces them.
//!
//! Two additions to ztunnel's shape, both so that policies fail closed:
//! - A match may name the L7 (HTTP) attributes of Istio's `AuthorizationPolicy` that an L4 proxy
//!   cannot check ([`L7Attribute`]: `hosts`, `methods`, `paths`, `headers`, ...). ztunnel's
//!   `RbacMatch` silently drops unknown keys, which turns an HTTP-only DENY into an empty match
//!   that never matches (everything allowed); here they are kept as [`PolicyMatch::l7_attributes`]
//!   and enforced as istiod documents for ambient ("DENY policy with HTTP attributes is enforced
//!   without the HTTP rules"; "Within an ALLOW policy, rules matching HTTP attributes are
//!   omitted": `authorization.go` `httpDenyRuleBoilerplate` / `httpAllowRuleBoilerplate`).
//! - A policy that does not parse (an unknown or ill-typed key anywhere in its body) no longer
//!   rejects the whole config. As long as its head (`name`, `namespace`, `scope`, `action`,
//!   `dryRun`) parses, it is kept as a fail-closed stand-in ([`parse_policy`]): a DENY denies every
//!   connection in its scope, an ALLOW allows nothing (so its scope is limited to what other ALLOW
//!   policies allow). Dropping it instead would be unsafe either way: a dropped DENY lets through
//!   what it was written to stop, and a dropped ALLOW can leave a scope without ALLOW policies,
//!   which allows everything. A policy whose head does not parse cannot be scoped, so it still
//!   fails the whole config (the node keeps its last good state).

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::ConfigError;
use super::types::FromStrVisitor;

/// One authorization policy.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalPolicy {
    /// Policy name.
    pub name: String,
    /// Policy namespace; empty for global policies (which live in the root namespace in Istio).
    #[serde(default)]
    pub namespace: String,
    /// Which workloads the policy applies to.
    pub scope: PolicyScope,
    /// What a match means.
    pub action: PolicyAction,
    /// Rules (ORed) -> clauses (ANDed) -> matches (ORed). Empty rules never match.
    #[serde(default)]
    pub rules: Vec<Vec<Vec<PolicyMatch>>>,
    /// Evaluate and log only, never enforce.
    #[serde(default)]
    pub dry_run: bool,
    /// Why the policy as written did not parse, for a fail-closed stand-in built by
    /// [`parse_policy`] (its `rules` are then [`fail_closed_rules`]). Never read from the config.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
}

/// `scope` of a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PolicyScope {
    /// Every workload in the mesh.
    Global,
    /// Every workload of the policy's namespace.
    Namespace,
    /// Workloads that list the policy in `authorizationPolicies`.
    WorkloadSelector,
}

/// `action` of a policy. Istio has no AUDIT action here (spec §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PolicyAction {
    /// A match allows the connection.
    Allow,
    /// A match rejects the connection.
    Deny,
}

/// One match of a clause: every non-empty field must match (values of one field are ORed,
/// `not*` fields must match none of their values). See [`crate::proxy::authz`] for how a match
/// without L4 fields, or with L7 attributes, counts in a DENY and in an ALLOW.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", from = "MatchWire")]
pub struct PolicyMatch {
    /// Peer identity namespace.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<StringMatch>,
    /// Peer identity namespace must match none of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<StringMatch>,
    /// Peer (namespace, service account).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<ServiceAccountMatch>,
    /// Peer (namespace, service account) must match none of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<ServiceAccountMatch>,
    /// Peer SPIFFE id without the `spiffe://` prefix.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<StringMatch>,
    /// Peer SPIFFE id must match none of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<StringMatch>,
    /// TCP source address.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ips: Vec<Cidr>,
    /// TCP source address must be in none of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_source_ips: Vec<Cidr>,
    /// Final upstream address.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub destination_ips: Vec<Cidr>,
    /// Final upstream address must be in none of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ips: Vec<Cidr>,
    /// Final upstream (target) port.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub destination_ports: Vec<u16>,
    /// Final upstream port must be none of these.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ports: Vec<u16>,
    /// The L7 attributes the match names (non-empty in the config), in [`L7Attribute`] order.
    /// Their values are not kept: an L4 proxy never evaluates them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub l7_attributes: Vec<L7Attribute>,
}

/// An HTTP attribute of Istio's `AuthorizationPolicy` that ztunnel cannot check, as istiod names
/// them when it converts a policy for ambient (`authorization.go` `httpOperations`,
/// `httpSources`); `headers` stands for `when` conditions on `request.headers[...]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum L7Attribute {
    /// `hosts` (HTTP `Host` / `:authority`).
    Hosts,
    /// `notHosts`.
    NotHosts,
    /// `methods`.
    Methods,
    /// `notMethods`.
    NotMethods,
    /// `paths`.
    Paths,
    /// `notPaths`.
    NotPaths,
    /// `requestPrincipals` (JWT issuer/subject).
    RequestPrincipals,
    /// `notRequestPrincipals`.
    NotRequestPrincipals,
    /// `remoteIpBlocks` (from `X-Forwarded-For`).
    RemoteIpBlocks,
    /// `notRemoteIpBlocks`.
    NotRemoteIpBlocks,
    /// `headers`: header name -> values.
    Headers,
}

/// [`PolicyMatch`] as written: the L4 fields, plus the L7 attributes with their values (which
/// are checked for type and then reduced to their names). Rejects unknown keys.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MatchWire {
    #[serde(default)]
    namespaces: Vec<StringMatch>,
    #[serde(default)]
    not_namespaces: Vec<StringMatch>,
    #[serde(default)]
    service_accounts: Vec<ServiceAccountMatch>,
    #[serde(default)]
    not_service_accounts: Vec<ServiceAccountMatch>,
    #[serde(default)]
    principals: Vec<StringMatch>,
    #[serde(default)]
    not_principals: Vec<StringMatch>,
    #[serde(default)]
    source_ips: Vec<Cidr>,
    #[serde(default)]
    not_source_ips: Vec<Cidr>,
    #[serde(default)]
    destination_ips: Vec<Cidr>,
    #[serde(default)]
    not_destination_ips: Vec<Cidr>,
    #[serde(default)]
    destination_ports: Vec<u16>,
    #[serde(default)]
    not_destination_ports: Vec<u16>,
    #[serde(default)]
    hosts: Vec<String>,
    #[serde(default)]
    not_hosts: Vec<String>,
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    not_methods: Vec<String>,
    #[serde(default)]
    paths: Vec<String>,
    #[serde(default)]
    not_paths: Vec<String>,
    #[serde(default)]
    request_principals: Vec<String>,
    #[serde(default)]
    not_request_principals: Vec<String>,
    #[serde(default)]
    remote_ip_blocks: Vec<String>,
    #[serde(default)]
    not_remote_ip_blocks: Vec<String>,
    #[serde(default)]
    headers: BTreeMap<String, Vec<String>>,
}

impl From<MatchWire> for PolicyMatch {
    fn from(w: MatchWire) -> PolicyMatch {
        let l7_attributes = [
            (L7Attribute::Hosts, w.hosts.is_empty()),
            (L7Attribute::NotHosts, w.not_hosts.is_empty()),
            (L7Attribute::Methods, w.methods.is_empty()),
            (L7Attribute::NotMethods, w.not_methods.is_empty()),
            (L7Attribute::Paths, w.paths.is_empty()),
            (L7Attribute::NotPaths, w.not_paths.is_empty()),
            (
                L7Attribute::RequestPrincipals,
                w.request_principals.is_empty(),
            ),
            (
                L7Attribute::NotRequestPrincipals,
                w.not_request_principals.is_empty(),
            ),
            (L7Attribute::RemoteIpBlocks, w.remote_ip_blocks.is_empty()),
            (
                L7Attribute::NotRemoteIpBlocks,
                w.not_remote_ip_blocks.is_empty(),
            ),
            (L7Attribute::Headers, w.headers.is_empty()),
        ]
        .into_iter()
        .filter_map(|(a, empty)| (!empty).then_some(a))
        .collect();
        PolicyMatch {
            namespaces: w.namespaces,
            not_namespaces: w.not_namespaces,
            service_accounts: w.service_accounts,
            not_service_accounts: w.not_service_accounts,
            principals: w.principals,
            not_principals: w.not_principals,
            source_ips: w.source_ips,
            not_source_ips: w.not_source_ips,
            destination_ips: w.destination_ips,
            not_destination_ips: w.not_destination_ips,
            destination_ports: w.destination_ports,
            not_destination_ports: w.not_destination_ports,
            l7_attributes,
        }
    }
}

impl PolicyMatch {
    /// Whether no L4 field is set (L7 attributes aside): nothing an L4 proxy can check.
    pub fn is_l4_empty(&self) -> bool {
        self.namespaces.is_empty()
            && self.not_namespaces.is_empty()
            && self.service_accounts.is_empty()
            && self.not_service_accounts.is_empty()
            && self.principals.is_empty()
            && self.not_principals.is_empty()
            && self.source_ips.is_empty()
            && self.not_source_ips.is_empty()
            && self.destination_ips.is_empty()
            && self.not_destination_ips.is_empty()
            && self.destination_ports.is_empty()
            && self.not_destination_ports.is_empty()
    }
}

/// A string matcher: `{Exact: "x"}`, `{Prefix: "x"}`, `{Suffix: "x"}` or `Presence`
/// (also accepted: YAML tags `!Exact x`, and `{Presence: ~}` / `{Presence: {}}`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum StringMatch {
    /// Equal to the value.
    Exact(String),
    /// Starts with the value.
    Prefix(String),
    /// Ends with the value.
    Suffix(String),
    /// Any non-empty string. A variant with no fields, as ztunnel's, so it is written as
    /// `{"Presence":[]}` (what `istioctl ztunnel-config` decodes), not as a bare string.
    Presence(),
}

/// `{namespace, serviceAccount}` of a peer identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceAccountMatch {
    /// Identity namespace.
    pub namespace: String,
    /// Identity service account.
    pub service_account: String,
}

/// An address range written `ip/len`; a bare IP means a single host (/32 or /128).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    /// Network address (host bits may be set; they are ignored when matching).
    pub addr: IpAddr,
    /// Prefix length: 0..=32 for IPv4, 0..=128 for IPv6.
    pub prefix_len: u8,
}

// === impl StringMatch ===

impl StringMatch {
    /// Whether `value` matches (`Presence` = non-empty).
    pub fn matches(&self, value: &str) -> bool {
        match self {
            StringMatch::Exact(s) => value == s,
            StringMatch::Prefix(s) => value.starts_with(s.as_str()),
            StringMatch::Suffix(s) => value.ends_with(s.as_str()),
            StringMatch::Presence() => !value.is_empty(),
        }
    }
}

#[derive(Deserialize)]
enum StringMatchKind {
    Exact,
    Prefix,
    Suffix,
    Presence,
}

struct StringMatchVisitor;

impl<'de> serde::de::Visitor<'de> for StringMatchVisitor {
    type Value = StringMatch;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("`Presence` or a map with one key Exact, Prefix, Suffix or Presence")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<StringMatch, E> {
        match v {
            "Presence" => Ok(StringMatch::Presence()),
            other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<StringMatch, A::Error> {
        use serde::de::Error as _;
        let Some(kind) = map.next_key::<StringMatchKind>()? else {
            return Err(A::Error::invalid_length(0, &self));
        };
        let m = match kind {
            StringMatchKind::Exact => StringMatch::Exact(map.next_value()?),
            StringMatchKind::Prefix => StringMatch::Prefix(map.next_value()?),
            StringMatchKind::Suffix => StringMatch::Suffix(map.next_value()?),
            StringMatchKind::Presence => {
                map.next_value::<serde::de::IgnoredAny>()?;
                StringMatch::Presence()
            }
        };
        if map.next_key::<StringMatchKind>()?.is_some() {
            return Err(A::Error::custom("a string match has exactly one key"));
        }
        Ok(m)
    }

    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, data: A) -> Result<StringMatch, A::Error> {
        use serde::de::VariantAccess as _;
        let (kind, v) = data.variant::<StringMatchKind>()?;
        Ok(match kind {
            StringMatchKind::Exact => StringMatch::Exact(v.newtype_variant()?),
            StringMatchKind::Prefix => StringMatch::Prefix(v.newtype_variant()?),
            StringMatchKind::Suffix => StringMatch::Suffix(v.newtype_variant()?),
            StringMatchKind::Presence => {
                v.unit_variant()?;
                StringMatch::Presence()
            }
        })
    }
}

impl<'de> Deserialize<'de> for StringMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StringMatchVisitor)
    }
}

// === impl Cidr ===

impl Cidr {
    /// Whether `ip` lies in the range (v4-mapped IPv6 addresses are compared as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr.to_canonical(), ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix_len)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix_len)
            }
            _ => false,
        }
    }
}

fn prefix_eq(a: &[u8], b: &[u8], len: u8) -> bool {
    let full = usize::from(len / 8);
    let rest = len % 8;
    if a[..full] != b[..full] {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    (a[full] & mask) == (b[full] & mask)
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

impl FromStr for Cidr {
    type Err = ConfigError;

    /// Parses `ip/len` or a bare `ip`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (s, None),
        };
        let addr = ip.parse::<IpAddr>().map_err(|source| ConfigError::CidrIp {
            value: s.to_owned(),
            source,
        })?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_len = match len {
            None => max,
            Some(len) => match len.parse::<u8>() {
                Ok(n) if n <= max => n,
                _ => {
                    return Err(ConfigError::CidrPrefix {
                        value: s.to_owned(),
                        max,
                    });
                }
            },
        };
        Ok(Cidr { addr, prefix_len })
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(FromStrVisitor::new("an `ip/len` or `ip` string"))
    }
}

// === parsing policy by policy ===

/// The rules of a fail-closed stand-in for a policy with `action`: for a DENY one rule without
/// clauses (it matches every connection), for an ALLOW none (it never matches).
pub fn fail_closed_rules(action: PolicyAction) -> Vec<Vec<Vec<PolicyMatch>>> {
    match action {
        PolicyAction::Deny => vec![Vec::new()],
        PolicyAction::Allow => Vec::new(),
    }
}

/// What a policy that does not parse must still give to be scoped: its key, scope and action.
/// Other keys are ignored here.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PolicyHead {
    name: String,
    #[serde(default)]
    namespace: String,
    scope: PolicyScope,
    action: PolicyAction,
    #[serde(default)]
    dry_run: bool,
}

/// Parses `policies[index]` of the local config from its YAML value. A policy whose body does not
/// parse becomes its fail-closed stand-in (see the module docs), with the reason in
/// [`LocalPolicy::invalid`] and in a warning naming the policy.
///
/// # Errors
/// The policy's head (`name`, `namespace`, `scope`, `action`, `dryRun`) does not parse: the
/// policy cannot be scoped, the message names `policies[index]`.
pub fn parse_policy(index: usize, value: &serde_yaml_ng::Value) -> Result<LocalPolicy, String> {
    let err = match LocalPolicy::deserialize(value) {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    let head = PolicyHead::deserialize(value).map_err(|e| format!("policies[{index}]: {e}"))?;
    let reason = format!(
        "policies[{index}]{}",
        locate(value).unwrap_or_else(|| format!(": {err}"))
    );
    let key = format!("{}/{}", head.namespace, head.name);
    let enforced = match head.action {
        PolicyAction::Deny => "denies every connection in its scope",
        PolicyAction::Allow => "allows nothing",
    };
    tracing::warn!(policy = %key, error = %reason, "invalid authorization policy; enforced fail-closed: it {enforced}");
    Ok(LocalPolicy {
        rules: fail_closed_rules(head.action),
        name: head.name,
        namespace: head.namespace,
        scope: head.scope,
        action: head.action,
        dry_run: head.dry_run,
        invalid: Some(reason),
    })
}

/// `.rules[i][j][k]<place in the match>: <error>` for the first match of `policy` that does not
/// parse, if any (a value deserializer does not track the place of an error itself).
fn locate(policy: &serde_yaml_ng::Value) -> Option<String> {
    let rules = policy.get("rules")?.as_sequence()?;
    for (i, rule) in rules.iter().enumerate() {
        for (j, clause) in rule.as_sequence()?.iter().enumerate() {
            for (k, m) in clause.as_sequence()?.iter().enumerate() {
                if let Err(e) = PolicyMatch::deserialize(m) {
                    let (place, e) = locate_in_match(m).unwrap_or((String::new(), e));
                    return Some(format!(".rules[{i}][{j}][{k}]{place}: {e}"));
                }
            }
        }
    }
    None
}

/// The key (and list index) of match `m` that does not parse, `.key` or `.key[n]`, with its
/// error: each key is tried alone, then each element of its list alone.
fn locate_in_match(m: &serde_yaml_ng::Value) -> Option<(String, serde_yaml_ng::Error)> {
    use serde_yaml_ng::{Mapping, Value};
    for (key, value) in m.as_mapping()? {
        let alone = |v: Value| {
            let mut one = Mapping::new();
            one.insert(key.clone(), v);
            PolicyMatch::deserialize(&Value::Mapping(one)).err()
        };
        let Some(e) = alone(value.clone()) else {
            continue;
        };
        let name = key.as_str().unwrap_or("?");
        let element = value.as_sequence().and_then(|items| {
            items.iter().enumerate().find_map(|(n, item)| {
                alone(Value::Sequence(vec![item.clone()])).map(|e| (format!(".{name}[{n}]"), e))
            })
        });
        return Some(element.unwrap_or((format!(".{name}"), e)));
    }
    None
}
