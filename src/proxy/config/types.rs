//! Value types shared by workloads and services in the local config: tunnel protocol, addresses,
//! gateways, locality and load balancing. They mirror ztunnel's `src/state/workload.rs` and
//! `src/state/service.rs` serde shapes (camelCase keys, enum variants spelled as in ztunnel).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::ConfigError;

/// How a workload receives traffic (`protocol` in the local config, `tunnel_protocol` in XDS).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Protocol {
    /// The workload is in the mesh: connect to it through HBONE (port 15008, mTLS + HTTP/2 CONNECT).
    #[serde(rename = "HBONE")]
    Hbone,
    /// Plain TCP straight to the workload (not in the mesh). ztunnel's default.
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
}

/// Whether the workload shares the node's network namespace (`networkMode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NetworkMode {
    /// A pod network namespace of its own.
    #[default]
    Standard,
    /// Host network: its IPs are the node's, so they are not indexed for lookups.
    HostNetwork,
}

/// Health of a workload (`status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HealthStatus {
    /// Ready to receive traffic.
    #[default]
    Healthy,
    /// Not ready; skipped as a service endpoint unless the service allows all.
    Unhealthy,
}

/// Where a workload runs (`locality: {region, zone, subzone}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Locality {
    /// Cloud region.
    #[serde(default)]
    pub region: String,
    /// Zone inside the region.
    #[serde(default)]
    pub zone: String,
    /// Sub-zone inside the zone.
    #[serde(default)]
    pub subzone: String,
}

/// Protocol an application-level tunnel in front of the workload speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AppTunnelProtocol {
    /// No application tunnel.
    #[serde(rename = "NONE")]
    None,
    /// PROXY protocol v2 in front of the payload.
    #[serde(rename = "PROXY")]
    Proxy,
}

/// `applicationTunnel: {protocol: NONE|PROXY, port}`: the workload accepts tunnelled traffic itself.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApplicationTunnel {
    /// Tunnel protocol.
    pub protocol: AppTunnelProtocol,
    /// Port the tunnel listens on; `None` means the HBONE port.
    #[serde(default)]
    pub port: Option<u16>,
}

/// An IP address on a named network, written `network/ip` (`/10.0.0.1` = default network).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NetworkAddress {
    /// Network name; empty for the default network.
    pub network: String,
    /// The address.
    pub address: IpAddr,
}

/// A service key, written `namespace/hostname` (the XDS resource name of a service).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamespacedHostname {
    /// Service namespace (non-empty).
    pub namespace: String,
    /// Service hostname (non-empty).
    pub hostname: String,
}

/// Where a gateway (waypoint or network gateway) is: an address or a service.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(untagged)]
pub enum GatewayDestination {
    /// `network/ip` of the gateway itself.
    Address(NetworkAddress),
    /// `namespace/hostname` of the gateway's service.
    Hostname(NamespacedHostname),
}

/// `waypoint` / `networkGateway`: `{destination: "network/ip" | "ns/hostname", hboneMtlsPort}`.
///
/// As in ztunnel, the destination is an address when the part after the first `/` is an IP,
/// and a `namespace/hostname` otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayAddress {
    /// The gateway.
    pub destination: GatewayDestination,
    /// HBONE port of the gateway (usually 15008).
    #[serde(default = "default_hbone_port")]
    pub hbone_mtls_port: u16,
}

/// Load-balancing scope a service prefers (`loadBalancer.routingPreferences`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum LoadBalancerScope {
    Region,
    Zone,
    Subzone,
    Node,
    Cluster,
    Network,
}

/// How routing preferences apply (`loadBalancer.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LoadBalancerMode {
    /// Preferences are ignored.
    #[default]
    Standard,
    /// Only endpoints matching all scopes.
    Strict,
    /// Prefer matching endpoints, fall back to others.
    Failover,
    /// No endpoint selection: traffic goes to the original destination.
    Passthrough,
}

/// Which endpoints are eligible (`loadBalancer.healthPolicy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LoadBalancerHealthPolicy {
    /// Healthy endpoints only.
    #[default]
    OnlyHealthy,
    /// Unhealthy endpoints too.
    AllowAll,
}

/// `loadBalancer: {routingPreferences, mode, healthPolicy}` of a service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancer {
    /// Scopes, most important first.
    #[serde(default)]
    pub routing_preferences: Vec<LoadBalancerScope>,
    /// How the scopes apply.
    #[serde(default)]
    pub mode: LoadBalancerMode,
    /// Endpoint health filter.
    #[serde(default)]
    pub health_policy: LoadBalancerHealthPolicy,
}

/// IP families a service serves (`ipFamilies`); absent = automatic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IpFamily {
    /// IPv4 and IPv6.
    Dual,
    /// IPv4 only.
    IPv4,
    /// IPv6 only.
    IPv6,
}

/// Who may see a service (`visibility`, workload.proto `Service.visibility`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Visibility {
    /// Visible mesh-wide.
    #[default]
    #[serde(alias = "PUBLIC")]
    Public,
    /// Visible only inside its namespace.
    #[serde(alias = "NAMESPACE")]
    Namespace,
}

/// One explicit service endpoint (`services[].endpoints.<uid>`), as in ztunnel's `Endpoint`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Endpoint {
    /// UID of the workload behind this endpoint.
    pub workload_uid: String,
    /// Service port -> target port overrides for this endpoint.
    #[serde(default)]
    pub port: std::collections::BTreeMap<u16, u16>,
    /// Endpoint health.
    #[serde(default)]
    pub status: HealthStatus,
}

fn default_hbone_port() -> u16 {
    crate::mesh::HBONE_PORT
}

// === impl NetworkAddress ===

impl fmt::Display for NetworkAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.address)
    }
}

impl FromStr for NetworkAddress {
    type Err = ConfigError;

    /// Parses `network/ip`; the network may be empty, the IP may not.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (network, ip) = s
            .split_once('/')
            .ok_or_else(|| ConfigError::NetworkAddressFormat {
                value: s.to_owned(),
            })?;
        let address = ip
            .parse::<IpAddr>()
            .map_err(|source| ConfigError::NetworkAddressIp {
                value: s.to_owned(),
                source,
            })?;
        Ok(NetworkAddress {
            network: network.to_owned(),
            address: address.to_canonical(),
        })
    }
}

impl Serialize for NetworkAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NetworkAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(FromStrVisitor::new("a `network/ip` string"))
    }
}

// === impl NamespacedHostname ===

impl fmt::Display for NamespacedHostname {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.hostname)
    }
}

impl FromStr for NamespacedHostname {
    type Err = ConfigError;

    /// Parses `namespace/hostname`; both parts must be non-empty.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((ns, host)) if !ns.is_empty() && !host.is_empty() => Ok(NamespacedHostname {
                namespace: ns.to_owned(),
                hostname: host.to_owned(),
            }),
            _ => Err(ConfigError::NamespacedHostnameFormat {
                value: s.to_owned(),
            }),
        }
    }
}

impl Serialize for NamespacedHostname {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NamespacedHostname {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(FromStrVisitor::new("a `namespace/hostname` string"))
    }
}

// === impl GatewayDestination ===

impl FromStr for GatewayDestination {
    type Err = ConfigError;

    /// `network/ip` when the part after the first `/` is an IP, else `namespace/hostname`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let looks_like_address = s
            .split_once('/')
            .is_some_and(|(_, rest)| rest.parse::<IpAddr>().is_ok());
        if looks_like_address {
            s.parse().map(GatewayDestination::Address)
        } else {
            s.parse().map(GatewayDestination::Hostname)
        }
    }
}

impl<'de> Deserialize<'de> for GatewayDestination {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(FromStrVisitor::new(
            "a `network/ip` or `namespace/hostname` string",
        ))
    }
}

/// Deserializes a string through `FromStr`, raising the error inside the deserializer so
/// serde_yaml_ng attaches the exact path (e.g. `services[0].vips[1]`).
pub(super) struct FromStrVisitor<T> {
    expecting: &'static str,
    _out: std::marker::PhantomData<T>,
}

impl<T> FromStrVisitor<T> {
    pub(super) fn new(expecting: &'static str) -> Self {
        FromStrVisitor {
            expecting,
            _out: std::marker::PhantomData,
        }
    }
}

impl<T> serde::de::Visitor<'_> for FromStrVisitor<T>
where
    T: FromStr,
    T::Err: fmt::Display,
{
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        v.parse().map_err(E::custom)
    }
}
