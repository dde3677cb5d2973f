//! The label set of the TCP metrics, derived from the workload records as ztunnel derives its
//! `CommonTrafficLabels` (`src/proxy/metrics.rs`; spec ztunnel.md §7).
//!
//! - Source fields come from the source workload (`source_workload` = its owning workload name,
//!   `source_canonical_service` and `source_app` = its canonical name, `source_canonical_revision`
//!   and `source_version` = its canonical revision, namespace, cluster id). `source_principal` is
//!   only ever the identity the connection proves: the pod's own when it dials over mTLS
//!   (outbound), the peer certificate's (inbound).
//! - Destination fields come from the destination workload likewise, with `destination_principal`
//!   = its SPIFFE identity; without a record, the identity the HBONE peer must prove.
//! - `destination_service*` name the service: outbound the one whose VIP the app dialled; inbound
//!   the one of this pod's services whose target port is the HBONE request's target port (the
//!   `:authority`, never a header a client could forge), the first by `namespace/hostname`.
//! - `request_protocol` is `tcp`, `response_flags` `-` or the failure, `connection_security_policy`
//!   `mutual_tls` over HBONE, else `unknown`. Every value not known is `unknown`.

use std::hash::BuildHasher as _;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};

use crate::proxy::identity::Identity;
use crate::proxy::metrics::Direction;
use crate::proxy::route::Route;
use crate::proxy::state::{ProxyState, Service, Workload};

use std::fmt::Write as _;

/// A label value: `unknown` when absent or empty (ztunnel's `DefaultedUnknown`).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Value(Option<Arc<Text>>);

impl Value {
    /// `s`, or absent when empty.
    pub fn new(s: &str) -> Value {
        Value((!s.is_empty()).then(|| {
            Arc::new(Text {
                hash: TEXT_HASH.hash_one(s),
                text: Box::from(s),
            })
        }))
    }

    /// The value, `None` when unknown.
    pub fn get(&self) -> Option<&str> {
        self.0.as_deref().map(|t| &*t.text)
    }
}

/// The hasher of every label value's text: one per process (seeded at random), so equal texts
/// hash alike.
static TEXT_HASH: LazyLock<foldhash::fast::RandomState> =
    LazyLock::new(foldhash::fast::RandomState::default);

/// A label value's text and its hash, computed once with the text ([`TEXT_HASH`]): interning a
/// label set ([`crate::proxy::metrics::Metrics::intern`]) then hashes a word per value instead of
/// each string's bytes.
#[derive(Debug)]
struct Text {
    hash: u64,
    text: Box<str>,
}

impl PartialEq for Text {
    fn eq(&self, other: &Text) -> bool {
        self.hash == other.hash && self.text == other.text
    }
}

impl Eq for Text {}

impl std::hash::Hash for Text {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl EncodeLabelValue for Value {
    fn encode(&self, w: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        w.write_str(self.get().unwrap_or("unknown"))
    }
}

/// `request_protocol` of every connection, allocated once.
static TCP: LazyLock<Value> = LazyLock::new(|| Value::new("tcp"));

/// A workload's label values (`*_workload`, `*_canonical_service` and `*_app`,
/// `*_canonical_revision` and `*_version`, `*_workload_namespace`, `*_cluster`), built once with
/// its record ([`Workload::label_values`]): a connection's labels clone these (a reference count
/// each) instead of copying the strings, and compare with them by pointer first when interned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadValues {
    workload: Value,
    canonical_service: Value,
    canonical_revision: Value,
    namespace: Value,
    cluster: Value,
}

impl WorkloadValues {
    /// The values of a workload's fields of these names (empty: `unknown`).
    pub fn new(
        workload_name: &str,
        canonical_name: &str,
        canonical_revision: &str,
        namespace: &str,
        cluster_id: &str,
    ) -> WorkloadValues {
        WorkloadValues {
            workload: Value::new(workload_name),
            canonical_service: Value::new(canonical_name),
            canonical_revision: Value::new(canonical_revision),
            namespace: Value::new(namespace),
            cluster: Value::new(cluster_id),
        }
    }

    /// The values of one side's labels in [`TrafficLabels`]' order: workload, canonical service,
    /// canonical revision, namespace, app (= canonical service), version (= canonical revision),
    /// cluster.
    fn fields(&self) -> [Value; 7] {
        [
            self.workload.clone(),
            self.canonical_service.clone(),
            self.canonical_revision.clone(),
            self.namespace.clone(),
            self.canonical_service.clone(),
            self.canonical_revision.clone(),
            self.cluster.clone(),
        ]
    }
}

/// A service's label values (`destination_service`, `destination_service_namespace`,
/// `destination_service_name`), built once with its record ([`Service::label_values`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceValues {
    hostname: Value,
    namespace: Value,
    name: Value,
}

impl ServiceValues {
    /// The values of a service's fields of these names (empty: `unknown`).
    pub fn new(hostname: &str, namespace: &str, name: &str) -> ServiceValues {
        ServiceValues {
            hostname: Value::new(hostname),
            namespace: Value::new(namespace),
            name: Value::new(name),
        }
    }
}

/// A SPIFFE identity label value (`unknown` when absent).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct Principal(pub Option<Identity>);

impl EncodeLabelValue for Principal {
    fn encode(&self, w: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        match &self.0 {
            Some(id) => write!(w, "{id}"),
            None => w.write_str("unknown"),
        }
    }
}

impl EncodeLabelValue for Direction {
    fn encode(&self, w: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        w.write_str(self.reporter())
    }
}

/// Why a connection ended badly (`response_flags`, ztunnel's `ResponseFlags`).
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum ResponseFlags {
    /// `-`: no failure.
    #[default]
    None,
    /// `DENY`: an authorization policy refused it.
    Denied,
    /// `CONNECT`: no upstream connection (or the connection failed).
    Connect,
    /// `TLS_FAILURE`: the TLS handshake failed.
    Tls,
    /// `H2_HANDSHAKE_FAILURE`: HTTP/2 failed.
    H2,
    /// `IDENTITY_ERROR`: no certificate for the workload.
    Identity,
}

impl ResponseFlags {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ResponseFlags::None => "-",
            ResponseFlags::Denied => "DENY",
            ResponseFlags::Connect => "CONNECT",
            ResponseFlags::Tls => "TLS_FAILURE",
            ResponseFlags::H2 => "H2_HANDSHAKE_FAILURE",
            ResponseFlags::Identity => "IDENTITY_ERROR",
        }
    }
}

impl EncodeLabelValue for ResponseFlags {
    fn encode(&self, w: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        w.write_str(self.as_str())
    }
}

/// `connection_security_policy`.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum SecurityPolicy {
    /// `unknown`: plain TCP.
    #[default]
    Unknown,
    /// `mutual_tls`: HBONE.
    MutualTls,
}

impl EncodeLabelValue for SecurityPolicy {
    fn encode(&self, w: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        w.write_str(match self {
            SecurityPolicy::Unknown => "unknown",
            SecurityPolicy::MutualTls => "mutual_tls",
        })
    }
}

/// ztunnel's `CommonTrafficLabels`, in its order (the optional locality labels are not emitted).
#[allow(missing_docs)] // the label names are the documentation: see the module docs
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficLabels {
    pub reporter: Direction,
    pub source_workload: Value,
    pub source_canonical_service: Value,
    pub source_canonical_revision: Value,
    pub source_workload_namespace: Value,
    pub source_principal: Principal,
    pub source_app: Value,
    pub source_version: Value,
    pub source_cluster: Value,
    pub destination_service: Value,
    pub destination_service_namespace: Value,
    pub destination_service_name: Value,
    pub destination_workload: Value,
    pub destination_canonical_service: Value,
    pub destination_canonical_revision: Value,
    pub destination_workload_namespace: Value,
    pub destination_principal: Principal,
    pub destination_app: Value,
    pub destination_version: Value,
    pub destination_cluster: Value,
    pub request_protocol: Value,
    pub response_flags: ResponseFlags,
    pub connection_security_policy: SecurityPolicy,
}

impl TrafficLabels {
    /// Labels of a connection reported by `reporter`, `mutual_tls` when `mtls`.
    pub fn new(reporter: Direction, mtls: bool) -> TrafficLabels {
        TrafficLabels {
            reporter,
            request_protocol: TCP.clone(),
            connection_security_policy: if mtls {
                SecurityPolicy::MutualTls
            } else {
                SecurityPolicy::Unknown
            },
            ..TrafficLabels::default()
        }
    }

    /// The source workload's fields (not its principal: see the module docs).
    pub fn with_source(mut self, w: Option<&Workload>) -> TrafficLabels {
        let Some(w) = w else { return self };
        [
            self.source_workload,
            self.source_canonical_service,
            self.source_canonical_revision,
            self.source_workload_namespace,
            self.source_app,
            self.source_version,
            self.source_cluster,
        ] = w.label_values().fields();
        self
    }

    /// The identity the source proved (or, outbound, is about to prove over mTLS).
    pub fn with_source_principal(mut self, id: Option<Identity>) -> TrafficLabels {
        self.source_principal = Principal(id);
        self
    }

    /// The destination workload's fields; `proven` is the identity the HBONE peer must carry,
    /// the principal when there is no record.
    pub fn with_destination(
        mut self,
        w: Option<&Workload>,
        proven: Option<&Identity>,
    ) -> TrafficLabels {
        self.destination_principal = Principal(w.map(Workload::identity).or(proven.cloned()));
        let Some(w) = w else { return self };
        [
            self.destination_workload,
            self.destination_canonical_service,
            self.destination_canonical_revision,
            self.destination_workload_namespace,
            self.destination_app,
            self.destination_version,
            self.destination_cluster,
        ] = w.label_values().fields();
        self
    }

    /// The destination service's hostname, namespace and name.
    pub fn with_destination_service(mut self, s: Option<&Service>) -> TrafficLabels {
        let Some(s) = s else { return self };
        let v = s.label_values();
        self.destination_service = v.hostname.clone();
        self.destination_service_namespace = v.namespace.clone();
        self.destination_service_name = v.name.clone();
        self
    }
}

/// The service an inbound connection to `dest`'s `target` was for: among the services `dest`
/// backs ([`ProxyState::services_of`]), the first by `namespace/hostname` whose target port for
/// `dest` is `target`'s port (the workload's port map, the explicit endpoint's, or the service's).
pub fn inbound_service(
    state: &ProxyState,
    dest: &Workload,
    target: SocketAddr,
) -> Option<Arc<Service>> {
    let port = target.port();
    state.services_of(dest).into_iter().find(|svc| {
        let own = dest.services.get(svc.key());
        let explicit = svc.endpoints.get(&dest.uid).map(|e| &e.port);
        own.is_some_and(|m| m.values().any(|p| *p == port))
            || explicit.is_some_and(|m| m.values().any(|p| *p == port))
            || svc.ports.values().any(|p| *p == port)
    })
}

/// The labels of an outbound connection from the pod `src` (proving `src_identity` over mTLS)
/// to the original destination `original`, sent along `route`; and the destination workload
/// (the endpoint, or the waypoint that takes it).
pub fn outbound(
    state: &ProxyState,
    src: &Workload,
    src_identity: &Identity,
    original: SocketAddr,
    route: &Route,
) -> (TrafficLabels, Option<Arc<Workload>>) {
    let mtls = route.hbone.is_some();
    let connected = route.hbone.as_ref().map_or(route.target, |h| h.addr);
    let dest = state.workload_by_ip(connected.ip());
    let service = state.service_by_vip(original.ip());
    let labels = TrafficLabels::new(Direction::Outbound, mtls)
        .with_source(Some(src))
        .with_source_principal(mtls.then(|| src_identity.clone()))
        .with_destination(dest.as_deref(), route.hbone.as_ref().map(|h| &h.identity))
        .with_destination_service(service.as_deref());
    (labels, dest)
}

/// The labels of an inbound connection to the pod `dest` for `target` (the HBONE CONNECT target,
/// or the original destination of a plaintext connection) from `peer`, whose certificate proved
/// `peer_identity` (`None`: plaintext); and the source workload the state has at `peer`'s IP.
pub fn inbound(
    state: &ProxyState,
    dest: &Workload,
    peer: SocketAddr,
    peer_identity: Option<&Identity>,
    target: SocketAddr,
) -> (TrafficLabels, Option<Arc<Workload>>) {
    let mtls = peer_identity.is_some();
    let src = state.workload_by_ip(peer.ip());
    let service = inbound_service(state, dest, target);
    let labels = TrafficLabels::new(Direction::Inbound, mtls)
        .with_source(src.as_deref())
        .with_source_principal(peer_identity.cloned())
        .with_destination(Some(dest), None)
        .with_destination_service(service.as_deref());
    (labels, src)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::route::Hbone;

    /// client 10.0.0.2 (alice, canonical `client` v1, workload `client-deploy`, cluster `c1`) and
    /// server 10.0.0.3 (bob, canonical `server` v2, no workload name), behind service
    /// `default/svc` at 10.96.0.1 (80 -> 8080), and a second service `default/other` on another
    /// port of the server (81 -> 9090), and `prod/listed` (82 -> 7070) naming the
    /// server as an explicit endpoint.
    fn state() -> ProxyState {
        let yaml = r#"
workloads:
- uid: u-client
  name: client-pod
  namespace: default
  serviceAccount: alice
  workloadIps: ["10.0.0.2"]
  protocol: HBONE
  canonicalName: client
  canonicalRevision: v1
  workloadName: client-deploy
  clusterId: c1
- uid: u-server
  name: server-pod
  namespace: prod
  serviceAccount: bob
  workloadIps: ["10.0.0.3"]
  protocol: HBONE
  canonicalName: server
  canonicalRevision: v2
  services: {"prod/other.example": {81: 9090}, "prod/svc.example": {80: 8080}}
services:
- {name: svc, namespace: prod, hostname: svc.example, vips: ["/10.96.0.1"], ports: {80: 8080}}
- {name: other, namespace: prod, hostname: other.example, vips: ["/10.96.0.2"], ports: {81: 9090}}
- name: listed
  namespace: prod
  hostname: listed.example
  vips: ["/10.96.0.3"]
  ports: {82: 7070}
  endpoints: {u-server: {workloadUid: u-server}}
"#;
        let cfg = crate::proxy::config::parse_local_config(yaml).expect("config");
        ProxyState::from_config(&cfg).expect("state")
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    /// The workload the state has at `ip`.
    fn workload(st: &ProxyState, ip: &str) -> Arc<Workload> {
        st.workload_by_ip(ip.parse().expect("ip"))
            .expect("workload")
    }

    fn text(l: &TrafficLabels) -> String {
        use prometheus_client::metrics::counter::Counter;
        use prometheus_client::metrics::family::Family;
        let f: Family<TrafficLabels, Counter> = Family::default();
        f.get_or_create(l).inc();
        let mut r = prometheus_client::registry::Registry::default();
        r.register("t", "t", f);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("encode");
        out.lines()
            .find(|l| l.starts_with("t_total{"))
            .expect("series")
            .to_owned()
    }

    #[test]
    fn outbound_through_a_vip_names_both_workloads_the_service_and_mtls() {
        let st = state();
        let client = workload(&st, "10.0.0.2");
        let server = workload(&st, "10.0.0.3");
        let route = Route {
            target: addr("10.0.0.3:8080"),
            hbone: Some(Hbone {
                addr: addr("10.0.0.3:15008"),
                authority: addr("10.0.0.3:8080"),
                identity: server.identity(),
                service_host: Some("svc.example".into()),
            }),
        };
        let (l, dest) = outbound(
            &st,
            &client,
            &client.identity(),
            addr("10.96.0.1:80"),
            &route,
        );
        assert_eq!(dest.as_deref(), Some(&*server));
        assert_eq!(
            text(&l),
            "t_total{reporter=\"source\",source_workload=\"client-deploy\",\
             source_canonical_service=\"client\",source_canonical_revision=\"v1\",\
             source_workload_namespace=\"default\",\
             source_principal=\"spiffe://cluster.local/ns/default/sa/alice\",\
             source_app=\"client\",source_version=\"v1\",source_cluster=\"c1\",\
             destination_service=\"svc.example\",destination_service_namespace=\"prod\",\
             destination_service_name=\"svc\",destination_workload=\"unknown\",\
             destination_canonical_service=\"server\",destination_canonical_revision=\"v2\",\
             destination_workload_namespace=\"prod\",\
             destination_principal=\"spiffe://cluster.local/ns/prod/sa/bob\",\
             destination_app=\"server\",destination_version=\"v2\",\
             destination_cluster=\"unknown\",request_protocol=\"tcp\",response_flags=\"-\",\
             connection_security_policy=\"mutual_tls\"} 1"
        );
    }

    #[test]
    fn labels_share_the_strings_built_with_the_records() {
        let st = state();
        let client = workload(&st, "10.0.0.2");
        let server = workload(&st, "10.0.0.3");
        let peer = addr("10.0.0.2:40000");
        let (a, _) = inbound(&st, &server, peer, None, addr("10.0.0.3:8080"));
        let (b, _) = inbound(&st, &server, peer, None, addr("10.0.0.3:8080"));
        let same = |x: &Value, y: &Value| match (&x.0, &y.0) {
            (Some(x), Some(y)) => Arc::ptr_eq(x, y),
            _ => false,
        };
        assert!(same(&a.source_workload, &b.source_workload));
        assert!(same(&a.source_workload, &client.label_values().workload));
        assert!(same(&a.source_app, &a.source_canonical_service));
        assert!(same(
            &a.destination_canonical_revision,
            &server.label_values().canonical_revision
        ));
        assert!(same(
            &a.destination_service_name,
            &b.destination_service_name
        ));
        assert!(same(&a.request_protocol, &b.request_protocol));
        // a workload without a cluster id has no value to share: `unknown`
        assert_eq!(a.destination_cluster, Value::default());
        // outbound: the client's values and the dialled service's own
        let svc = st
            .service_by_vip("10.96.0.1".parse().expect("vip"))
            .expect("svc");
        let route = Route {
            target: addr("10.0.0.3:8080"),
            hbone: None,
        };
        let (o, _) = outbound(
            &st,
            &client,
            &client.identity(),
            addr("10.96.0.1:80"),
            &route,
        );
        assert!(same(&o.source_cluster, &client.label_values().cluster));
        assert!(same(
            &o.source_version,
            &client.label_values().canonical_revision
        ));
        assert!(same(&o.destination_service, &svc.label_values().hostname));
        assert!(same(
            &o.destination_service_namespace,
            &svc.label_values().namespace
        ));
        assert!(same(
            &o.destination_workload_namespace,
            &server.label_values().namespace
        ));
    }

    #[test]
    fn values_built_apart_are_equal_and_hash_alike_by_their_text() {
        use std::hash::BuildHasher;
        let h = foldhash::quality::RandomState::default();
        let (a, b, c) = (
            Value::new("reviews"),
            Value::new("reviews"),
            Value::new("ratings"),
        );
        assert_eq!(a, b);
        assert_eq!(h.hash_one(&a), h.hash_one(&b));
        assert_ne!(a, c);
        assert_ne!(h.hash_one(&a), h.hash_one(&c));
        assert_eq!(a.get(), Some("reviews"));
        assert_eq!(Value::new(""), Value::default());
        assert_eq!(Value::default().get(), None);
        // label sets of equal values built apart are one key
        let mut x = TrafficLabels::new(Direction::Inbound, true);
        let mut y = x.clone();
        x.source_workload = a;
        y.source_workload = b;
        assert_eq!(x, y);
        assert_eq!(h.hash_one(&x), h.hash_one(&y));
        y.source_workload = c;
        assert_ne!(x, y);
    }

    #[test]
    fn plain_tcp_to_an_unknown_address_has_no_principals_and_unknown_security() {
        let st = state();
        let client = workload(&st, "10.0.0.2");
        let route = Route {
            target: addr("192.0.2.1:443"),
            hbone: None,
        };
        let (l, dest) = outbound(&st, &client, &client.identity(), route.target, &route);
        assert!(dest.is_none());
        assert_eq!(l.source_principal, Principal(None));
        assert_eq!(l.destination_principal, Principal(None));
        assert_eq!(l.destination_service, Value::default());
        assert_eq!(l.connection_security_policy, SecurityPolicy::Unknown);
        let t = text(&l);
        assert!(t.contains("source_principal=\"unknown\""), "{t}");
        assert!(t.contains("connection_security_policy=\"unknown\""), "{t}");
    }

    #[test]
    fn a_local_pod_without_a_record_is_named_by_the_identity_it_must_prove() {
        let st = state();
        let client = workload(&st, "10.0.0.2");
        let carol = Identity::new("cluster.local", "x", "carol");
        let route = Route {
            target: addr("10.0.0.9:80"),
            hbone: Some(Hbone {
                addr: addr("10.0.0.9:15008"),
                authority: addr("10.0.0.9:80"),
                identity: carol.clone(),
                service_host: None,
            }),
        };
        let (l, _) = outbound(&st, &client, &client.identity(), route.target, &route);
        assert_eq!(l.destination_principal, Principal(Some(carol)));
        assert_eq!(l.destination_workload_namespace, Value::default());
    }

    #[test]
    fn inbound_takes_the_service_from_the_target_port_and_the_principal_from_the_peer() {
        let st = state();
        let server = workload(&st, "10.0.0.3");
        let alice = Identity::new("cluster.local", "default", "alice");
        let peer = addr("10.0.0.2:40000");
        let (l, src) = inbound(&st, &server, peer, Some(&alice), addr("10.0.0.3:8080"));
        assert_eq!(src.map(|w| w.name.clone()).as_deref(), Some("client-pod"));
        assert_eq!(l.reporter, Direction::Inbound);
        assert_eq!(l.destination_service.get(), Some("svc.example"));
        assert_eq!(l.destination_service_name.get(), Some("svc"));
        assert_eq!(l.source_principal, Principal(Some(alice)));
        assert_eq!(l.source_workload.get(), Some("client-deploy"));
        assert_eq!(l.destination_principal, Principal(Some(server.identity())));
        assert_eq!(l.connection_security_policy, SecurityPolicy::MutualTls);
        // the other port is the other service's
        let (l, _) = inbound(&st, &server, peer, None, addr("10.0.0.3:9090"));
        assert_eq!(l.destination_service_name.get(), Some("other"));
        assert_eq!(l.connection_security_policy, SecurityPolicy::Unknown);
        assert_eq!(l.source_principal, Principal(None));
        // a service listing the pod among its explicit endpoints counts too
        let (l, _) = inbound(&st, &server, peer, None, addr("10.0.0.3:7070"));
        assert_eq!(l.destination_service_name.get(), Some("listed"));
        // a port no service maps to names no service
        let (l, _) = inbound(&st, &server, peer, None, addr("10.0.0.3:7001"));
        assert_eq!(l.destination_service, Value::default());
    }

    #[test]
    fn a_source_unknown_to_the_state_is_unknown_but_keeps_its_proven_principal() {
        let st = state();
        let server = workload(&st, "10.0.0.3");
        let mallory = Identity::new("cluster.local", "evil", "mallory");
        let (l, src) = inbound(
            &st,
            &server,
            addr("10.9.9.9:1"),
            Some(&mallory),
            addr("10.0.0.3:8080"),
        );
        assert!(src.is_none());
        assert_eq!(l.source_workload, Value::default());
        assert_eq!(l.source_workload_namespace, Value::default());
        assert_eq!(l.source_principal, Principal(Some(mallory)));
    }
}
