//! The proxy's local workload config: ztunnel's `LOCAL_XDS_PATH` / `LOCAL_XDS` YAML
//! (spec §5 "Local config", ztunnel `src/xds.rs` `LocalConfig`, `examples/localhost.yaml`).
//!
//! This module holds the raw serde shapes. Every struct rejects unknown keys, and values are
//! typed as they are parsed (IPs, `network/ip` VIPs, ports, enums), so a parse error names the
//! offending key with its place, e.g. `workloads[0].protocol: unknown variant ...`. Cross-record
//! checks (duplicate IPs, names, VIPs, policy keys) happen when the state is built (`proxy::state`).

use std::collections::BTreeMap;
use std::net::{AddrParseError, IpAddr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

mod policy;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
mod types;

pub use policy::{
    Cidr, L7Attribute, LocalPolicy, PolicyAction, PolicyMatch, PolicyScope, ServiceAccountMatch,
    StringMatch, fail_closed_rules, parse_policy,
};
pub use types::{
    AppTunnelProtocol, ApplicationTunnel, Endpoint, GatewayAddress, GatewayDestination,
    HealthStatus, IpFamily, LoadBalancer, LoadBalancerHealthPolicy, LoadBalancerMode,
    LoadBalancerScope, Locality, NamespacedHostname, NetworkAddress, NetworkMode, Protocol,
    Visibility,
};

/// Errors from reading the local config or building the proxy state from it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML does not match the schema; the message starts with the place (`workloads[1]: ...`).
    #[error("invalid local config: {source}")]
    Yaml {
        /// The parser's error, carrying the path and line/column.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// The config file could not be read.
    #[error("cannot read local config {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A `network/ip` value without a `/`.
    #[error("invalid network address {value:?}: expected `network/ip`, e.g. `/10.0.0.1`")]
    NetworkAddressFormat {
        /// The value as written.
        value: String,
    },
    /// A `network/ip` value whose IP part does not parse.
    #[error("invalid network address {value:?}: bad IP: {source}")]
    NetworkAddressIp {
        /// The value as written.
        value: String,
        /// Why the IP did not parse.
        #[source]
        source: AddrParseError,
    },
    /// A `namespace/hostname` value with a missing part.
    #[error("invalid service key {value:?}: expected `namespace/hostname`")]
    NamespacedHostnameFormat {
        /// The value as written.
        value: String,
    },
    /// A CIDR whose address does not parse.
    #[error("invalid CIDR {value:?}: bad IP: {source}")]
    CidrIp {
        /// The value as written.
        value: String,
        /// Why the IP did not parse.
        #[source]
        source: AddrParseError,
    },
    /// A CIDR whose prefix length is not a number in range.
    #[error("invalid CIDR {value:?}: prefix length must be 0..={max}")]
    CidrPrefix {
        /// The value as written.
        value: String,
        /// The largest prefix for this address family.
        max: u8,
    },
    /// A required string field is empty.
    #[error("{place}: `{field}` must not be empty")]
    EmptyField {
        /// Where, e.g. `workloads[2]`.
        place: String,
        /// The camelCase key.
        field: &'static str,
    },
    /// Two workloads claim the same IP.
    #[error("{second}: workload IP {ip} is already used by {first}")]
    DuplicateWorkloadIp {
        /// The IP (canonical form).
        ip: IpAddr,
        /// The earlier workload, e.g. `workloads[0] (default/local)`.
        first: String,
        /// The later workload.
        second: String,
    },
    /// Two workloads share a uid.
    #[error("{second}: workload uid {uid:?} is already used by {first}")]
    DuplicateWorkloadUid {
        /// The uid.
        uid: String,
        /// The earlier workload.
        first: String,
        /// The later workload.
        second: String,
    },
    /// Two workloads share namespace and name.
    #[error("{second}: workload name {namespace}/{name} is already used by {first}")]
    DuplicateWorkloadName {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The earlier workload.
        first: String,
        /// The later workload.
        second: String,
    },
    /// Two services share `namespace/hostname`.
    #[error("{second}: service {key} is already defined by {first}")]
    DuplicateService {
        /// `namespace/hostname`.
        key: String,
        /// The earlier service, e.g. `services[0]`.
        first: String,
        /// The later service.
        second: String,
    },
    /// Two policies share `namespace/name` (workloads reference policies by that key).
    #[error("{second}: policy {key} is already defined by {first}")]
    DuplicatePolicy {
        /// `namespace/name`.
        key: String,
        /// The earlier policy, e.g. `policies[0]`.
        first: String,
        /// The later policy.
        second: String,
    },
    /// Two services share a VIP.
    #[error("{second}: service VIP {vip} is already used by {first}")]
    DuplicateVip {
        /// The VIP (canonical form).
        vip: IpAddr,
        /// The earlier service.
        first: String,
        /// The later service.
        second: String,
    },
}

/// The whole local config file: `workloads`, `services` and `policies` (all optional).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalConfig {
    /// Workloads (pods), in file order.
    #[serde(default)]
    pub workloads: Vec<LocalWorkload>,
    /// Services, in file order.
    #[serde(default)]
    pub services: Vec<LocalService>,
    /// Authorization policies, in file order.
    #[serde(default)]
    pub policies: Vec<LocalPolicy>,
}

/// One workload as written in the local config (proto `istio.workload.Workload` in camelCase,
/// plus `services`). Defaults: protocol TCP, status Healthy, capacity 1, everything else empty;
/// empty `trustDomain` / `serviceAccount` become `cluster.local` / `default` in the state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalWorkload {
    /// Unique id, e.g. `cluster1//v1/Pod/default/local`.
    #[serde(default)]
    pub uid: String,
    /// Pod name.
    #[serde(default)]
    pub name: String,
    /// Namespace (required, non-empty).
    pub namespace: String,
    /// Service account of the pod.
    #[serde(default)]
    pub service_account: String,
    /// Pod IPs.
    #[serde(default)]
    pub workload_ips: Vec<IpAddr>,
    /// `HBONE` or `TCP`.
    #[serde(default)]
    pub protocol: Protocol,
    /// `Standard` or `HostNetwork`.
    #[serde(default)]
    pub network_mode: NetworkMode,
    /// Node the pod runs on.
    #[serde(default)]
    pub node: String,
    /// Network name (empty = default network).
    #[serde(default)]
    pub network: String,
    /// Trust domain of the pod's identity.
    #[serde(default)]
    pub trust_domain: String,
    /// DNS hostname of the workload, if any.
    #[serde(default)]
    pub hostname: String,
    /// Waypoint in front of the workload.
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    /// Gateway to reach the workload from another network.
    #[serde(default)]
    pub network_gateway: Option<GatewayAddress>,
    /// The workload terminates HBONE itself.
    #[serde(default)]
    pub native_tunnel: bool,
    /// Application-level tunnel the workload accepts.
    #[serde(default)]
    pub application_tunnel: Option<ApplicationTunnel>,
    /// Selector policies that apply (`namespace/name` keys).
    #[serde(default)]
    pub authorization_policies: Vec<String>,
    /// `service.istio.io/canonical-name`.
    #[serde(default)]
    pub canonical_name: String,
    /// `service.istio.io/canonical-revision`.
    #[serde(default)]
    pub canonical_revision: String,
    /// Owning workload (e.g. deployment) name.
    #[serde(default)]
    pub workload_name: String,
    /// Owning workload kind (`deployment`, `pod`, ...).
    #[serde(default)]
    pub workload_type: String,
    /// Cluster id.
    #[serde(default)]
    pub cluster_id: String,
    /// Region / zone / subzone.
    #[serde(default)]
    pub locality: Locality,
    /// Health.
    #[serde(default)]
    pub status: HealthStatus,
    /// Load-balancing weight.
    #[serde(default = "default_capacity")]
    pub capacity: u32,
    /// Services this workload backs: `{"ns/hostname": {servicePort: targetPort}}`.
    #[serde(default)]
    pub services: BTreeMap<NamespacedHostname, BTreeMap<u16, u16>>,
}

/// One service as written in the local config (proto `istio.workload.Service`, camelCase).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalService {
    /// Service name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Hostname, e.g. `example.com` or `foo.ns.svc.cluster.local`.
    pub hostname: String,
    /// Virtual IPs as `network/ip`.
    #[serde(default)]
    pub vips: Vec<NetworkAddress>,
    /// Service port -> target port.
    #[serde(default)]
    pub ports: BTreeMap<u16, u16>,
    /// Identities (SPIFFE ids) that may serve this service, besides the endpoint's own.
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    /// Waypoint in front of the service.
    #[serde(default)]
    pub waypoint: Option<GatewayAddress>,
    /// Load-balancing settings.
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    /// IP families; absent = automatic.
    #[serde(default)]
    pub ip_families: Option<IpFamily>,
    /// Preferred service when several share the hostname.
    #[serde(default)]
    pub canonical: bool,
    /// `Public` (default) or `Namespace`.
    #[serde(default)]
    pub visibility: Visibility,
    /// Explicit endpoints keyed by workload uid (normally derived from workloads' `services`).
    #[serde(default)]
    pub endpoints: BTreeMap<String, Endpoint>,
}

fn default_capacity() -> u32 {
    1
}

/// Parses the local config YAML.
///
/// A policy whose body does not parse does not fail the config: it is kept as its fail-closed
/// stand-in and a warning names it ([`parse_policy`], the docs of `config/policy.rs`).
///
/// # Errors
/// [`ConfigError::Yaml`] for malformed YAML, unknown keys, wrong types, bad IPs / VIPs /
/// ports / enum values, missing required keys outside policies, or a policy whose `name`,
/// `scope` or `action` does not parse; the message names the place and key, e.g.
/// `workloads[1]: unknown field `fooBar`, expected one of ...`.
/// [`ConfigError::EmptyField`] for an empty workload `namespace` or service
/// `name`/`namespace`/`hostname`.
pub fn parse_local_config(yaml: &str) -> Result<LocalConfig, ConfigError> {
    // An empty file is an empty config (serde_yaml_ng would report EOF).
    if yaml.trim().is_empty() {
        return Ok(LocalConfig::default());
    }
    // Strict first, so a valid config parses as written and an error outside policies keeps the
    // parser's place (line and column); only then policy by policy.
    let cfg = match serde_yaml_ng::from_str::<LocalConfig>(yaml) {
        Ok(cfg) => cfg,
        Err(source) => policy_by_policy(yaml).ok_or(ConfigError::Yaml { source })?,
    };
    for (i, w) in cfg.workloads.iter().enumerate() {
        require(&format!("workloads[{i}]"), "namespace", &w.namespace)?;
    }
    for (i, s) in cfg.services.iter().enumerate() {
        let place = format!("services[{i}]");
        require(&place, "name", &s.name)?;
        require(&place, "namespace", &s.namespace)?;
        require(&place, "hostname", &s.hostname)?;
    }
    Ok(cfg)
}

/// The local config with `policies` as YAML values, to parse them one by one.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PolicyByPolicy {
    #[serde(default)]
    workloads: Vec<LocalWorkload>,
    #[serde(default)]
    services: Vec<LocalService>,
    #[serde(default)]
    policies: Vec<serde_yaml_ng::Value>,
}

/// `yaml` parsed with every policy on its own ([`parse_policy`]); `None` when something outside
/// the policies' bodies does not parse (the strict parser's error says what).
fn policy_by_policy(yaml: &str) -> Option<LocalConfig> {
    let raw: PolicyByPolicy = serde_yaml_ng::from_str(yaml).ok()?;
    let policies = raw
        .policies
        .iter()
        .enumerate()
        .map(|(i, v)| parse_policy(i, v).ok())
        .collect::<Option<Vec<_>>>()?;
    Some(LocalConfig {
        workloads: raw.workloads,
        services: raw.services,
        policies,
    })
}

fn require(place: &str, field: &'static str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Err(ConfigError::EmptyField {
            place: place.to_owned(),
            field,
        });
    }
    Ok(())
}
