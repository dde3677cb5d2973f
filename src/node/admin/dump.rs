//! `/config_dump` in ztunnel's shape (its `src/admin.rs` `ConfigDump`, `src/state.rs`
//! `ProxyStateSerialization`, `src/state/{workload,service}.rs`, `src/rbac.rs`), which
//! `istioctl ztunnel-config workloads|services|policies|certificates` reads:
//!
//! `{workloads, services, policies, stagedServices, staticConfig, version, config, certificates,
//! workloadState}` plus ztnode's `enrolledPods` (the agent's pods; null in a proxy-only process).
//!
//! - workloads: ztunnel's keys, empty optional ones left out as ztunnel leaves them out;
//!   `services` is the list of `namespace/hostname` the workload backs.
//! - services: `vips` as `network/ip`, `ports`, `endpoints` keyed by workload uid
//!   (`{workloadUid, port, status}`), built from the workloads that back the service as ztunnel
//!   builds them, plus the explicit endpoints.
//! - certificates: per identity `{identity, state, certChain, rootCerts}`, each certificate
//!   `{pem, serialNumber, validFrom, expirationTime}`: `pem` is the PEM text base64-encoded,
//!   the serial in decimal, times RFC 3339 in whole seconds (all as ztunnel writes them).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::SystemTime;

use base64::Engine as _;
use serde::Serialize;
use serde_json::{Value, json};

use crate::proxy::identity::{CertState, WorkloadCert};
use crate::proxy::state::{
    ApplicationTunnel, Endpoint, GatewayAddress, HealthStatus, IpFamily, LoadBalancer, Locality,
    NetworkMode, Policy, Protocol, ProxyState, Service, Visibility, Workload,
};

use super::Admin;

/// What `config` shows: the settings ztunnel's `Config` has that ztnode has too, under
/// ztunnel's (camelCase) names, and ztnode's own.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunConfig {
    /// Process kind: `node` (agent and proxy) or `proxy`.
    pub role: &'static str,
    /// Admin listener.
    pub admin_addr: String,
    /// Stats listener.
    pub stats_addr: String,
    /// Readiness listener.
    pub readiness_addr: String,
    /// istiod's xDS (`XDS_ADDRESS`), if any.
    pub xds_address: Option<String>,
    /// Istio CA (`CA_ADDRESS`), if any (else the built-in CA).
    pub ca_address: Option<String>,
    /// The local config (`LOCAL_XDS_PATH`), if any.
    pub local_xds_config: Option<PathBuf>,
    /// Certificate lifetime asked for, seconds.
    pub secret_ttl_secs: u64,
    /// `SO_MARK` of the proxy's sockets.
    pub packet_mark: u32,
    /// The in-pod DNS proxy is served.
    pub dns_proxy: bool,
    /// This node's name (`NODE_NAME`), if known.
    pub local_node: Option<String>,
    /// `Shared` (one proxy for the node's pods), as ztunnel's node proxy.
    pub proxy_mode: &'static str,
    /// The agent's run dir (node only).
    pub run_dir: Option<PathBuf>,
    /// The host CNI config dir the plugin is installed into (node only, when installing).
    pub cni_conf_dir: Option<PathBuf>,
    /// IPv6 redirection (node only).
    pub ipv6: Option<bool>,
    /// DNS capture in the pods' rules (node only).
    pub dns_capture: Option<bool>,
}

/// ztunnel's `BuildInfo`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
struct BuildInfo {
    version: &'static str,
    git_revision: &'static str,
    rust_version: &'static str,
    build_profile: &'static str,
    build_status: &'static str,
    istio_version: &'static str,
    crypto_provider: &'static str,
}

const BUILD: BuildInfo = BuildInfo {
    version: env!("CARGO_PKG_VERSION"),
    git_revision: env!("ZTNODE_GIT_SHA"),
    rust_version: env!("CARGO_PKG_RUST_VERSION"),
    build_profile: env!("ZTNODE_PROFILE"),
    build_status: "Clean",
    istio_version: "",
    crypto_provider: "ring",
};

/// A workload as ztunnel's `Workload` serialises.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DumpWorkload<'a> {
    workload_ips: &'a [IpAddr],
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<&'a GatewayAddress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    network_gateway: Option<&'a GatewayAddress>,
    protocol: Protocol,
    network_mode: NetworkMode,
    #[serde(skip_serializing_if = "str::is_empty")]
    uid: &'a str,
    name: &'a str,
    namespace: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    trust_domain: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    service_account: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    network: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    workload_name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    workload_type: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    canonical_name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    canonical_revision: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    hostname: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    node: &'a str,
    #[serde(skip_serializing_if = "is_false")]
    native_tunnel: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    application_tunnel: Option<&'a ApplicationTunnel>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    authorization_policies: &'a [String],
    status: HealthStatus,
    cluster_id: &'a str,
    #[serde(skip_serializing_if = "is_default_locality")]
    locality: &'a Locality,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    services: Vec<&'a str>,
    capacity: u32,
}

/// A service as ztunnel's `Service` serialises.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DumpService<'a> {
    name: &'a str,
    namespace: &'a str,
    hostname: &'a str,
    vips: Vec<String>,
    ports: &'a BTreeMap<u16, u16>,
    endpoints: BTreeMap<String, Endpoint>,
    subject_alt_names: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<&'a GatewayAddress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    load_balancer: Option<&'a LoadBalancer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip_families: Option<IpFamily>,
    canonical: bool,
    visibility: Visibility,
}

/// One certificate of a chain (ztunnel's `CertDump`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertDump {
    /// The PEM text, base64-encoded (as ztunnel).
    pub pem: String,
    /// Serial number in decimal.
    pub serial_number: String,
    /// Start of validity, RFC 3339 (seconds).
    pub valid_from: String,
    /// End of validity, RFC 3339 (seconds).
    pub expiration_time: String,
}

/// One identity's certificates (ztunnel's `CertsDump`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertsDump {
    /// SPIFFE id.
    pub identity: String,
    /// `Available`, `Initializing` or `Unavailable: <error>`.
    pub state: String,
    /// Leaf then intermediates.
    pub cert_chain: Vec<CertDump>,
    /// The roots peers are verified against.
    pub root_certs: Vec<CertDump>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_default_locality(l: &&Locality) -> bool {
    **l == Locality::default()
}

fn workload(w: &Workload) -> DumpWorkload<'_> {
    DumpWorkload {
        workload_ips: &w.workload_ips,
        waypoint: w.waypoint.as_ref(),
        network_gateway: w.network_gateway.as_ref(),
        protocol: w.protocol,
        network_mode: w.network_mode,
        uid: &w.uid,
        name: &w.name,
        namespace: &w.namespace,
        trust_domain: &w.trust_domain,
        service_account: &w.service_account,
        network: &w.network,
        workload_name: &w.workload_name,
        workload_type: &w.workload_type,
        canonical_name: &w.canonical_name,
        canonical_revision: &w.canonical_revision,
        hostname: &w.hostname,
        node: &w.node,
        native_tunnel: w.native_tunnel,
        application_tunnel: w.application_tunnel.as_ref(),
        authorization_policies: &w.authorization_policies,
        status: w.status,
        cluster_id: &w.cluster_id,
        locality: &w.locality,
        services: w.services.keys().map(String::as_str).collect(),
        capacity: w.capacity,
    }
}

fn service<'a>(state: &ProxyState, s: &'a Service) -> DumpService<'a> {
    let key = s.key();
    let mut endpoints: BTreeMap<String, Endpoint> = state
        .endpoints(s)
        .iter()
        .filter_map(|w| {
            w.services.get(key).map(|ports| {
                (
                    w.uid.clone(),
                    Endpoint {
                        workload_uid: w.uid.clone(),
                        port: ports.clone(),
                        status: w.status,
                    },
                )
            })
        })
        .collect();
    for (uid, e) in &s.endpoints {
        endpoints.insert(uid.clone(), e.clone());
    }
    DumpService {
        name: &s.name,
        namespace: &s.namespace,
        hostname: &s.hostname,
        vips: s.vips.iter().map(|(n, ip)| format!("{n}/{ip}")).collect(),
        ports: &s.ports,
        endpoints,
        subject_alt_names: &s.subject_alt_names,
        waypoint: s.waypoint.as_ref(),
        load_balancer: s.load_balancer.as_ref(),
        ip_families: s.ip_families,
        canonical: s.canonical,
        visibility: s.visibility,
    }
}

/// RFC 3339 in whole seconds, UTC (`2023-03-11T05:57:26Z`).
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    time::OffsetDateTime::from_unix_timestamp(secs as i64)
        .ok()
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| secs.to_string())
}

/// One DER certificate as ztunnel dumps it; `None` when it does not parse.
pub fn cert_dump(der: &[u8]) -> Option<CertDump> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let validity = cert.validity();
    let secs = |t: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(t.timestamp().max(0) as u64)
    };
    let pem_text = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
    Some(CertDump {
        pem: base64::engine::general_purpose::STANDARD.encode(pem_text),
        serial_number: cert.tbs_certificate.serial.to_string(),
        valid_from: rfc3339(secs(validity.not_before)),
        expiration_time: rfc3339(secs(validity.not_after)),
    })
}

/// The `certificates` list: every identity the proxy holds, `roots_pem` as each one's roots.
pub fn certs_dump(
    states: &[(crate::proxy::identity::Identity, CertState)],
    roots_pem: &str,
) -> Vec<CertsDump> {
    let roots: Vec<CertDump> = pem::parse_many(roots_pem)
        .unwrap_or_default()
        .iter()
        .filter_map(|p| cert_dump(p.contents()))
        .collect();
    states
        .iter()
        .map(|(id, st)| {
            let (state, chain) = match st {
                CertState::Available(c) => ("Available".to_owned(), chain_dump(c)),
                CertState::Initializing => ("Initializing".to_owned(), Vec::new()),
                CertState::Unavailable(e) => (format!("Unavailable: {e}"), Vec::new()),
            };
            let root_certs = if chain.is_empty() {
                Vec::new()
            } else {
                roots.clone()
            };
            CertsDump {
                identity: id.to_string(),
                state,
                cert_chain: chain,
                root_certs,
            }
        })
        .collect()
}

fn chain_dump(c: &WorkloadCert) -> Vec<CertDump> {
    c.chain.iter().filter_map(|d| cert_dump(d)).collect()
}

/// The local config as read from `path` (YAML to JSON, with ztunnel's three lists present), or
/// ztunnel's empty `staticConfig`.
fn static_config(path: Option<&PathBuf>) -> Value {
    let mut doc = path
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_yaml_ng::from_str::<Value>(&t).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    if let Some(obj) = doc.as_object_mut() {
        for k in ["workloads", "policies", "services"] {
            obj.entry(k).or_insert_with(|| json!([]));
        }
    }
    doc
}

/// The `/config_dump` document (see the module docs).
pub fn config_dump(admin: &Admin) -> Value {
    let state = admin.state.load();
    let certs = &admin.proxies.ctx().certs;
    let mut workloads: Vec<_> = state.workloads().map(|w| workload(w)).collect();
    workloads.sort_by_key(|w| (w.uid, w.namespace, w.name));
    let services: Vec<_> = state.services().map(|s| service(&state, s)).collect();
    let policies: Vec<&Policy> = state.policies().map(|p| &**p).collect();
    json!({
        "workloads": workloads,
        "services": services,
        "policies": policies,
        "stagedServices": {},
        "staticConfig": static_config(admin.config.local_xds_config.as_ref()),
        "version": BUILD,
        "config": &*admin.config,
        "certificates": certs_dump(&certs.certificate_states(), &certs.root_pem()),
        "workloadState": admin.proxies.status(),
        "enrolledPods": admin
            .pods
            .as_ref()
            .map(|p| p.get().map(|m| m.enrolled()).unwrap_or_default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::admin::tests::admin;
    use crate::proxy::identity::Identity;
    use crate::ready::Readiness;

    const CONFIG: &str = "workloads:
- uid: c1//Pod/ns/a
  name: a
  namespace: ns
  serviceAccount: sa
  workloadIps: [10.0.0.1]
  protocol: HBONE
  node: n1
  canonicalName: a
  canonicalRevision: v1
  services: {ns/svc.ns.svc.cluster.local: {80: 8080}}
- name: b
  namespace: ns
  workloadIps: [10.0.0.2]
services:
- name: svc
  namespace: ns
  hostname: svc.ns.svc.cluster.local
  vips: [/10.96.0.1]
  ports: {80: 8080}
policies:
- name: p
  namespace: ns
  scope: Namespace
  action: Deny
  rules: [[[{notNamespaces: [{Exact: ns}]}]]]
";

    #[tokio::test]
    async fn config_dump_has_ztunnels_shape() {
        let a = admin(Readiness::new());
        let cfg: crate::proxy::config::LocalConfig = serde_yaml_ng::from_str(CONFIG).expect("yaml");
        a.state.store(ProxyState::from_config(&cfg).expect("state"));
        let id = Identity::new("cluster.local", "ns", "sa");
        a.proxies.ctx().certs.get(&id).expect("issued");
        let dump = config_dump(&a);
        let fixture: Value = serde_json::from_str(include_str!(
            "../../../tests/fixtures/ztunnel_config_dump.json"
        ))
        .expect("fixture");
        let errs = crate::lab::dump_shape::shape_errors(&dump, &fixture);
        assert!(errs.is_empty(), "{errs:#?}\n{dump:#}");
        assert_eq!(
            dump["workloads"][1]["services"],
            json!(["ns/svc.ns.svc.cluster.local"])
        );
        assert_eq!(dump["services"][0]["vips"], json!(["/10.96.0.1"]));
        assert_eq!(
            dump["services"][0]["endpoints"]["c1//Pod/ns/a"],
            json!({"workloadUid": "c1//Pod/ns/a", "port": {"80": 8080}, "status": "Healthy"})
        );
        let cert = &dump["certificates"][0];
        assert_eq!(cert["identity"], "spiffe://cluster.local/ns/ns/sa/sa");
        assert_eq!(cert["state"], "Available");
        assert_eq!(cert["certChain"].as_array().map(Vec::len), Some(1));
        assert_eq!(cert["rootCerts"].as_array().map(Vec::len), Some(1));
        assert_eq!(
            dump["staticConfig"],
            json!({"workloads": [], "policies": [], "services": []})
        );
    }

    #[test]
    fn unavailable_and_initializing_certificates_have_no_chain() {
        let id = Identity::new("td", "ns", "sa");
        let d = certs_dump(
            &[
                (id.clone(), CertState::Initializing),
                (id, CertState::Unavailable("CA refused".into())),
            ],
            "",
        );
        assert_eq!(d[0].state, "Initializing");
        assert_eq!(d[1].state, "Unavailable: CA refused");
        assert!(
            d.iter()
                .all(|c| c.cert_chain.is_empty() && c.root_certs.is_empty())
        );
    }
}
