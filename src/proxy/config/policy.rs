//! Authorization policies of the local config (`policies:`), shaped like ztunnel's
//! `src/rbac.rs` `Authorization` (proto `istio.security.Authorization`, spec §6).
//!
//! They are parsed, validated and kept in the state; [`crate::proxy::authz`] enforces them.

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
/// `not*` fields must match none of their values).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicyMatch {
    /// Peer identity namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<StringMatch>,
    /// Peer identity namespace must match none of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<StringMatch>,
    /// Peer (namespace, service account).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<ServiceAccountMatch>,
    /// Peer (namespace, service account) must match none of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<ServiceAccountMatch>,
    /// Peer SPIFFE id without the `spiffe://` prefix.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<StringMatch>,
    /// Peer SPIFFE id must match none of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<StringMatch>,
    /// TCP source address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_ips: Vec<Cidr>,
    /// TCP source address must be in none of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_source_ips: Vec<Cidr>,
    /// Final upstream address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ips: Vec<Cidr>,
    /// Final upstream address must be in none of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ips: Vec<Cidr>,
    /// Final upstream (target) port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ports: Vec<u16>,
    /// Final upstream port must be none of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ports: Vec<u16>,
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
    /// Any non-empty string.
    Presence,
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
            StringMatch::Presence => !value.is_empty(),
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
            "Presence" => Ok(StringMatch::Presence),
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
                StringMatch::Presence
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
                StringMatch::Presence
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
