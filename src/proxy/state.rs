//! The proxy's view of the mesh: workloads, services and policies as an immutable, indexed
//! snapshot ([`ProxyState`]) behind a cheap shared handle ([`StateHandle`]) that publishes a
//! version number on every change.
//!
//! Snapshots are built from the local config (spec §5, ztunnel `LOCAL_XDS_PATH`); the file
//! watcher in `state/watch_file.rs` rebuilds and swaps them when the file changes.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashMapExt};
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};

use serde::Serialize;
use tokio::sync::watch;

use super::config::{ConfigError, LocalConfig, LocalService, LocalWorkload};
use super::identity::{DEFAULT_TRUST_DOMAIN, Identity};
use super::metrics::labels::{ServiceValues, WorkloadValues};

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
mod watch_file;

pub use super::config::{
    ApplicationTunnel, Endpoint, GatewayAddress, HealthStatus, IpFamily, LoadBalancer,
    LocalPolicy as Policy, Locality, NetworkMode, Protocol, Visibility,
};
pub use watch_file::{load_config_file, watch_config_file};

/// Service account used when a workload names none (as ztunnel's XDS conversion does).
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// A workload (pod) with defaults applied and IPs canonicalised. Built once per snapshot and
/// never changed after: its identity and metric label values are derived at construction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    /// Unique id (may be empty in hand-written configs).
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Service account (`default` when unset).
    pub service_account: String,
    /// Pod IPs; IPv4-mapped IPv6 addresses are stored as IPv4.
    pub workload_ips: Vec<IpAddr>,
    /// HBONE (in the mesh) or TCP.
    pub protocol: Protocol,
    /// Node name.
    pub node: String,
    /// Network name (empty = default network).
    pub network: String,
    /// Trust domain (`cluster.local` when unset).
    pub trust_domain: String,
    /// Services backed: `"namespace/hostname"` -> service port -> target port.
    pub services: BTreeMap<String, BTreeMap<u16, u16>>,
    /// DNS hostname of the workload, if any.
    pub hostname: String,
    /// Standard or host network.
    pub network_mode: NetworkMode,
    /// Waypoint in front of the workload.
    pub waypoint: Option<GatewayAddress>,
    /// Gateway to reach the workload from another network.
    pub network_gateway: Option<GatewayAddress>,
    /// The workload terminates HBONE itself.
    pub native_tunnel: bool,
    /// Application-level tunnel the workload accepts.
    pub application_tunnel: Option<ApplicationTunnel>,
    /// Selector policies that apply (`namespace/name`).
    pub authorization_policies: Vec<String>,
    /// Canonical service name.
    pub canonical_name: String,
    /// Canonical revision.
    pub canonical_revision: String,
    /// Owning workload name.
    pub workload_name: String,
    /// Owning workload kind.
    pub workload_type: String,
    /// Cluster id.
    pub cluster_id: String,
    /// Locality.
    pub locality: Locality,
    /// Health.
    pub status: HealthStatus,
    /// Load-balancing weight.
    pub capacity: u32,
    /// The SPIFFE identity of the fields above, built once (see [`Workload::identity`]).
    #[serde(skip)]
    spiffe: Identity,
    /// The metric label values of the fields above, built once (see [`Workload::label_values`]).
    #[serde(skip)]
    label_values: WorkloadValues,
}

/// A service with canonicalised VIPs. Built once per snapshot and never changed after: its key and
/// metric label values are derived at construction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Service {
    /// Service name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Hostname.
    pub hostname: String,
    /// Virtual IPs as (network, IP).
    pub vips: Vec<(String, IpAddr)>,
    /// Service port -> target port.
    pub ports: BTreeMap<u16, u16>,
    /// Extra identities allowed to serve the service (strings as configured).
    pub subject_alt_names: Vec<String>,
    /// Waypoint in front of the service.
    pub waypoint: Option<GatewayAddress>,
    /// Load balancing.
    pub load_balancer: Option<LoadBalancer>,
    /// IP families; `None` = automatic.
    pub ip_families: Option<IpFamily>,
    /// Preferred among services sharing the hostname.
    pub canonical: bool,
    /// Public or namespace-only.
    pub visibility: Visibility,
    /// Explicit endpoints keyed by workload uid.
    pub endpoints: BTreeMap<String, Endpoint>,
    /// `namespace/hostname`, built once (see [`Service::key`]).
    #[serde(skip)]
    key: String,
    /// The metric label values of the fields above, built once (see [`Service::label_values`]).
    #[serde(skip)]
    label_values: ServiceValues,
}

/// An immutable, indexed snapshot of workloads, services and policies.
#[derive(Clone, Debug, Default)]
pub struct ProxyState {
    workloads: Vec<Arc<Workload>>,
    services: Vec<Arc<Service>>,
    policies: Vec<Arc<Policy>>,
    by_ip: HashMap<IpAddr, Arc<Workload>>,
    by_name: HashMap<(String, String), Arc<Workload>>,
    by_uid: HashMap<String, Arc<Workload>>,
    by_vip: HashMap<IpAddr, Arc<Service>>,
    by_key: HashMap<String, Arc<Service>>,
    /// Workload uid → the services naming it in their explicit `endpoints`, by key.
    by_endpoint_uid: HashMap<String, Vec<Arc<Service>>>,
}

/// A shared, swappable [`ProxyState`]: readers take the current snapshot with
/// [`StateHandle::load`]; writers replace it with [`StateHandle::store`], which bumps the
/// version seen by [`StateHandle::subscribe`]rs. Clones share the same state.
#[derive(Clone)]
pub struct StateHandle {
    inner: Arc<HandleInner>,
}

struct HandleInner {
    current: RwLock<Arc<ProxyState>>,
    version: watch::Sender<u64>,
}

// === impl Workload ===

impl Workload {
    /// The workload's SPIFFE identity (trust domain, namespace, service account).
    pub fn identity(&self) -> Identity {
        self.spiffe.clone()
    }

    /// The workload's metric label values: each connection's label set shares their strings.
    pub fn label_values(&self) -> &WorkloadValues {
        &self.label_values
    }

    /// The workload of a pod known only from its handoff (Kubernetes mode without a workload
    /// source that lists it yet; ztnode's choice: ztunnel waits up to 5 s for the record): HBONE,
    /// the given trust domain (the node's `TRUST_DOMAIN`) and addresses.
    pub fn from_handoff(
        trust_domain: &str,
        uid: &str,
        name: &str,
        namespace: &str,
        service_account: &str,
        ips: Vec<IpAddr>,
    ) -> Workload {
        Workload::from_local(&LocalWorkload {
            uid: uid.to_owned(),
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            service_account: service_account.to_owned(),
            workload_ips: ips,
            trust_domain: trust_domain.to_owned(),
            protocol: Protocol::Hbone,
            capacity: 1,
            ..LocalWorkload::default()
        })
    }

    fn from_local(w: &LocalWorkload) -> Workload {
        let service_account = or_default(&w.service_account, DEFAULT_SERVICE_ACCOUNT);
        let trust_domain = or_default(&w.trust_domain, DEFAULT_TRUST_DOMAIN);
        let spiffe = Identity::new(
            trust_domain.as_str(),
            w.namespace.as_str(),
            service_account.as_str(),
        );
        Workload {
            spiffe,
            label_values: WorkloadValues::new(
                &w.workload_name,
                &w.canonical_name,
                &w.canonical_revision,
                &w.namespace,
                &w.cluster_id,
            ),
            uid: w.uid.clone(),
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            service_account,
            workload_ips: w.workload_ips.iter().map(IpAddr::to_canonical).collect(),
            protocol: w.protocol,
            node: w.node.clone(),
            network: w.network.clone(),
            trust_domain,
            services: w
                .services
                .iter()
                .map(|(k, ports)| (k.to_string(), ports.clone()))
                .collect(),
            hostname: w.hostname.clone(),
            network_mode: w.network_mode,
            waypoint: w.waypoint.clone(),
            network_gateway: w.network_gateway.clone(),
            native_tunnel: w.native_tunnel,
            application_tunnel: w.application_tunnel.clone(),
            authorization_policies: w.authorization_policies.clone(),
            canonical_name: w.canonical_name.clone(),
            canonical_revision: w.canonical_revision.clone(),
            workload_name: w.workload_name.clone(),
            workload_type: w.workload_type.clone(),
            cluster_id: w.cluster_id.clone(),
            locality: w.locality.clone(),
            status: w.status,
            capacity: w.capacity,
        }
    }

    fn label(&self, index: usize) -> String {
        format!("workloads[{index}] ({}/{})", self.namespace, self.name)
    }
}

fn or_default(value: &str, default: &str) -> String {
    if value.is_empty() { default } else { value }.to_owned()
}

// === impl Service ===

impl Service {
    /// The service key `namespace/hostname` (the key in workloads' `services` maps).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The `subjectAltNames` that parse as SPIFFE ids (others are skipped, as in ztunnel).
    pub fn san_identities(&self) -> Vec<Identity> {
        self.subject_alt_names
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect()
    }

    /// The service's metric label values: each connection's label set shares their strings.
    pub fn label_values(&self) -> &ServiceValues {
        &self.label_values
    }

    fn from_local(s: &LocalService) -> Service {
        Service {
            key: format!("{}/{}", s.namespace, s.hostname),
            label_values: ServiceValues::new(&s.hostname, &s.namespace, &s.name),
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            hostname: s.hostname.clone(),
            vips: s
                .vips
                .iter()
                .map(|v| (v.network.clone(), v.address.to_canonical()))
                .collect(),
            ports: s.ports.clone(),
            subject_alt_names: s.subject_alt_names.clone(),
            waypoint: s.waypoint.clone(),
            load_balancer: s.load_balancer.clone(),
            ip_families: s.ip_families,
            canonical: s.canonical,
            visibility: s.visibility,
            endpoints: s.endpoints.clone(),
        }
    }
}

// === impl ProxyState ===

impl ProxyState {
    /// Builds and indexes a snapshot from a parsed local config.
    ///
    /// # Errors
    /// Duplicates, each naming both records: workload IPs ([`ConfigError::DuplicateWorkloadIp`];
    /// host-network workloads are not indexed by IP), non-empty uids, non-empty
    /// `namespace/name` pairs, service `namespace/hostname` keys, service VIPs. IPs are
    /// compared across networks, since lookups are by IP alone.
    pub fn from_config(cfg: &LocalConfig) -> Result<ProxyState, ConfigError> {
        ProxyState::build(cfg, Err)
    }

    /// Builds a snapshot like [`ProxyState::from_config`], but a duplicate is no error: the later
    /// record wins the index (as ztunnel's stores do when xDS pushes overlap, e.g. a pod IP
    /// reused before the old pod's removal arrives). Returns the duplicates found, for logging.
    pub fn from_config_lenient(cfg: &LocalConfig) -> (ProxyState, Vec<ConfigError>) {
        let mut conflicts = Vec::new();
        let built = ProxyState::build(cfg, |e| {
            conflicts.push(e);
            Ok(())
        });
        // The callback never fails, so neither does the build.
        (built.unwrap_or_default(), conflicts)
    }

    /// Indexes `cfg`; every duplicate goes to `conflict`, which either stops the build (`Err`)
    /// or lets the later record win (`Ok`).
    fn build(
        cfg: &LocalConfig,
        mut conflict: impl FnMut(ConfigError) -> Result<(), ConfigError>,
    ) -> Result<ProxyState, ConfigError> {
        let mut st = ProxyState::default();
        let mut ip_owner: HashMap<IpAddr, usize> = HashMap::new();
        let mut uid_owner: HashMap<String, usize> = HashMap::new();
        let mut name_owner: HashMap<(String, String), usize> = HashMap::new();
        for (i, lw) in cfg.workloads.iter().enumerate() {
            let w = Arc::new(Workload::from_local(lw));
            let label = |j: usize| st.workloads[j].label(j);
            if w.network_mode != NetworkMode::HostNetwork {
                for ip in &w.workload_ips {
                    if let Some(&j) = ip_owner.get(ip) {
                        conflict(ConfigError::DuplicateWorkloadIp {
                            ip: *ip,
                            first: label(j),
                            second: w.label(i),
                        })?;
                    }
                    ip_owner.insert(*ip, i);
                    st.by_ip.insert(*ip, w.clone());
                }
            }
            if !w.uid.is_empty() {
                if let Some(&j) = uid_owner.get(&w.uid) {
                    conflict(ConfigError::DuplicateWorkloadUid {
                        uid: w.uid.clone(),
                        first: label(j),
                        second: w.label(i),
                    })?;
                }
                uid_owner.insert(w.uid.clone(), i);
                st.by_uid.insert(w.uid.clone(), w.clone());
            }
            if !w.name.is_empty() {
                let key = (w.namespace.clone(), w.name.clone());
                if let Some(&j) = name_owner.get(&key) {
                    conflict(ConfigError::DuplicateWorkloadName {
                        namespace: key.0.clone(),
                        name: key.1.clone(),
                        first: label(j),
                        second: w.label(i),
                    })?;
                }
                name_owner.insert(key.clone(), i);
                st.by_name.insert(key, w.clone());
            }
            st.workloads.push(w);
        }

        // the service holding each VIP: index and key (the index may be the service being read,
        // which is not in `st.services` yet, when one service lists a VIP twice)
        let mut vip_owner: HashMap<IpAddr, (usize, String)> = HashMap::new();
        let mut key_owner: HashMap<String, usize> = HashMap::new();
        for (i, ls) in cfg.services.iter().enumerate() {
            let s = Arc::new(Service::from_local(ls));
            let key = s.key().to_owned();
            if let Some(&j) = key_owner.get(&key) {
                conflict(ConfigError::DuplicateService {
                    key: key.clone(),
                    first: format!("services[{j}]"),
                    second: format!("services[{i}]"),
                })?;
            }
            for (_, vip) in &s.vips {
                if let Some((j, first)) = vip_owner.get(vip) {
                    conflict(ConfigError::DuplicateVip {
                        vip: *vip,
                        first: format!("services[{j}] ({first})"),
                        second: format!("services[{i}] ({key})"),
                    })?;
                }
                vip_owner.insert(*vip, (i, key.clone()));
                st.by_vip.insert(*vip, s.clone());
            }
            key_owner.insert(key.clone(), i);
            st.by_key.insert(key, s.clone());
            st.services.push(s);
        }
        let mut by_key: Vec<_> = st.by_key.iter().collect();
        by_key.sort_by(|a, b| a.0.cmp(b.0));
        for (_, s) in by_key {
            for uid in s.endpoints.keys() {
                st.by_endpoint_uid
                    .entry(uid.clone())
                    .or_default()
                    .push(s.clone());
            }
        }

        // (index in the config, index in `st.policies`): a duplicate replaces the earlier one in
        // place, so the two numberings differ after the first duplicate.
        let mut policy_owner: HashMap<(&str, &str), (usize, usize)> = HashMap::new();
        for (i, p) in cfg.policies.iter().enumerate() {
            let key = (p.namespace.as_str(), p.name.as_str());
            if let Some(&(j, at)) = policy_owner.get(&key) {
                conflict(ConfigError::DuplicatePolicy {
                    key: format!("{}/{}", p.namespace, p.name),
                    first: format!("policies[{j}]"),
                    second: format!("policies[{i}]"),
                })?;
                st.policies[at] = Arc::new(p.clone());
                continue;
            }
            policy_owner.insert(key, (i, st.policies.len()));
            st.policies.push(Arc::new(p.clone()));
        }
        Ok(st)
    }

    /// The workload owning `ip` (IPv4-mapped IPv6 is looked up as IPv4).
    pub fn workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>> {
        self.by_ip.get(&ip.to_canonical()).cloned()
    }

    /// The workload with this namespace and name.
    pub fn workload_by_name(&self, namespace: &str, name: &str) -> Option<Arc<Workload>> {
        self.by_name
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The workload with this uid.
    pub fn workload_by_uid(&self, uid: &str) -> Option<Arc<Workload>> {
        self.by_uid.get(uid).cloned()
    }

    /// `w` as this snapshot has it: by uid, else by namespace and name (a pod served from its
    /// handoff before its record arrived has the pod's uid, not istiod's
    /// `<cluster>//v1/Pod/<ns>/<name>`), else `w` itself. A running pod's workload may have
    /// changed since the pod started (e.g. its `authorizationPolicies`).
    pub fn current(&self, w: &Arc<Workload>) -> Arc<Workload> {
        self.workload_by_uid(&w.uid)
            .or_else(|| self.workload_by_name(&w.namespace, &w.name))
            .unwrap_or_else(|| w.clone())
    }

    /// The service owning VIP `ip` on any network (IPv4-mapped IPv6 is looked up as IPv4).
    pub fn service_by_vip(&self, ip: IpAddr) -> Option<Arc<Service>> {
        self.by_vip.get(&ip.to_canonical()).cloned()
    }

    /// The service with key `namespace/hostname`.
    pub fn service_by_key(&self, key: &str) -> Option<Arc<Service>> {
        self.by_key.get(key).cloned()
    }

    /// The services `w` backs, by `namespace/hostname`: those its `services` map names and those
    /// naming it (by uid) in their explicit `endpoints`.
    pub fn services_of(&self, w: &Workload) -> Vec<Arc<Service>> {
        let mut v: Vec<Arc<Service>> = w
            .services
            .keys()
            .filter_map(|k| self.service_by_key(k))
            .chain(
                self.by_endpoint_uid
                    .get(&w.uid)
                    .into_iter()
                    .flatten()
                    .cloned(),
            )
            .collect();
        v.sort_by(|a, b| (&a.namespace, &a.hostname).cmp(&(&b.namespace, &b.hostname)));
        v.dedup_by(|a, b| Arc::ptr_eq(a, b));
        v
    }

    /// The workloads behind `svc`, in config order: those whose `services` map has the
    /// service's key, plus those named by uid in its explicit `endpoints`.
    pub fn endpoints(&self, svc: &Service) -> Vec<Arc<Workload>> {
        let key = svc.key();
        self.workloads
            .iter()
            .filter(|w| w.services.contains_key(key) || svc.endpoints.contains_key(&w.uid))
            .cloned()
            .collect()
    }

    /// All workloads in config order.
    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.iter()
    }

    /// All services in config order.
    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services.iter()
    }

    /// All policies in config order.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.policies.iter()
    }
}

impl PartialEq for ProxyState {
    /// Same workloads, services and policies in the same order (the indexes follow from them).
    fn eq(&self, other: &Self) -> bool {
        self.workloads == other.workloads
            && self.services == other.services
            && self.policies == other.policies
    }
}

impl Eq for ProxyState {}

// === impl StateHandle ===

impl StateHandle {
    /// A handle holding `s` as version 0.
    pub fn new(s: ProxyState) -> StateHandle {
        StateHandle {
            inner: Arc::new(HandleInner {
                current: RwLock::new(Arc::new(s)),
                version: watch::Sender::new(0),
            }),
        }
    }

    /// The current snapshot.
    pub fn load(&self) -> Arc<ProxyState> {
        self.inner
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces the snapshot and bumps the version.
    pub fn store(&self, s: ProxyState) {
        *self
            .inner
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(s);
        self.inner.version.send_modify(|v| *v += 1);
    }

    /// A receiver of the version number, which changes after every [`StateHandle::store`].
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.version.subscribe()
    }

    /// The current version (number of stores so far).
    pub fn version(&self) -> u64 {
        *self.inner.version.borrow()
    }
}

impl std::fmt::Debug for StateHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateHandle")
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}
