//! The delta ADS client: one `DeltaAggregatedResources` stream to istiod (TLS gRPC through
//! [`control`]), subscribed to `Address` and `Authorization`, feeding a [`StateHandle`].
//!
//! Behaviour (ztunnel's, spec §5): each type's first request on a stream is a wildcard (no
//! names) carrying the versions held as `initial_resource_versions`; the node goes on the
//! stream's first request only. Each response is applied by [`Held::apply`], the proxy state is
//! rebuilt and stored when anything changed, then the ACK or NACK is sent. A failed or closed
//! stream is retried after a jittered exponential backoff ([`XDS_RECONNECT`]: 10 ms doubling to
//! 15 s, reset after a stream that got a response); what is held survives the reconnect, so the
//! proxy keeps serving the last good state meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;

use prost_types::value::Kind;

use super::held::{Held, Outcome, ResourceType};
use super::metrics::{TerminationReason, XdsMetrics};
use super::proto::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Node, Struct, Value};
use crate::backoff::{Backoff, Policy, XDS_RECONNECT};
use crate::proxy::control::{self, CallAuth, ControlEndpoint, ControlError};
use crate::proxy::istio_env::IstioEnv;
use crate::proxy::state::{ProxyState, StateHandle};
use crate::ready::{Readiness, Task};

/// gRPC path of the delta ADS stream.
pub const DELTA_ADS_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
/// Node id IP when no instance IP is known (ztunnel's `INSTANCE_IP` default).
pub const DEFAULT_INSTANCE_IP: &str = "1.1.1.1";
/// Cluster id when none is given (ztunnel's `CLUSTER_ID` default).
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

/// Settings of the xDS client.
#[derive(Clone, Debug)]
pub struct XdsConfig {
    /// istiod's address and TLS settings (`XDS_ADDRESS`, `XDS_ROOT_CA`, `ALT_XDS_HOSTNAME`).
    pub endpoint: ControlEndpoint,
    /// Token, `clusterid` and extra headers of every stream (`AUTH_TOKEN`, `XDS_HEADER_*`).
    pub auth: CallAuth,
    /// Who we are to istiod.
    pub node: NodeIdentity,
    /// Reconnect delays ([`XDS_RECONNECT`] unless changed).
    pub backoff: Policy,
    /// Where the client counts its messages and ended streams (register it to serve them).
    pub metrics: Arc<XdsMetrics>,
}

/// The `Node` sent on a stream's first request: id and string metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeIdentity {
    /// `ztunnel~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local`.
    pub id: String,
    /// Metadata (`NAME`, `NAMESPACE`, `INSTANCE_IPS`, `NODE_NAME`, `CLUSTER_ID`, ...), sent as a
    /// `google.protobuf.Struct` of strings.
    pub metadata: BTreeMap<String, String>,
}

/// What the node identity is made of (ztunnel's `INSTANCE_IP`, `POD_NAME`, `POD_NAMESPACE`,
/// `NODE_NAME`, `CLUSTER_ID`, `ISTIO_META_*`); [`NodeParams::from_env`] takes them from the
/// parsed env.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeParams {
    /// The proxy pod's IP (empty: `1.1.1.1`).
    pub instance_ip: String,
    /// The proxy pod's name.
    pub pod_name: String,
    /// The proxy pod's namespace.
    pub pod_namespace: String,
    /// The Kubernetes node name.
    pub node_name: String,
    /// The cluster id (empty: `Kubernetes`).
    pub cluster_id: String,
    /// Extra metadata (`ISTIO_META_*` with the prefix stripped); it wins over the keys above, as
    /// in ztunnel.
    pub proxy_metadata: BTreeMap<String, String>,
}

/// Errors of one stream; all lead to a reconnect.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// Connecting (roots, TLS, TCP) or building the call metadata failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The stream could not be opened.
    #[error("cannot open the delta ADS stream: {0}")]
    Open(#[source] tonic::Status),
    /// The stream ended with an error status.
    #[error("delta ADS stream failed: {0}")]
    Stream(#[source] tonic::Status),
    /// The server ended the stream without an error.
    #[error("delta ADS stream closed by the server")]
    Closed,
}

/// A client ready to run: what it holds survives reconnects. See the module docs.
#[derive(Debug)]
pub struct XdsClient {
    cfg: XdsConfig,
    state: StateHandle,
    held: Held,
    /// Readiness tasks not yet done, one per type.
    pending: HashMap<ResourceType, Task>,
}

/// The readiness task name of type `t`: `xds Address`, `xds Authorization`.
pub fn readiness_task_name(t: ResourceType) -> String {
    format!("xds {t}")
}

/// Registers the readiness tasks in `ready` now and returns the client's run future, which
/// syncs `state` from istiod until `shutdown` resolves (see [`XdsClient::run`]).
pub fn run(
    cfg: XdsConfig,
    state: StateHandle,
    ready: &Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = ()> + Send + 'static {
    XdsClient::new(cfg, state, ready).run(shutdown)
}

// === impl XdsConfig ===

impl XdsConfig {
    /// A config with the [`XDS_RECONNECT`] backoff.
    pub fn new(endpoint: ControlEndpoint, auth: CallAuth, node: NodeIdentity) -> XdsConfig {
        XdsConfig {
            endpoint,
            auth,
            node,
            backoff: XDS_RECONNECT,
            metrics: Arc::default(),
        }
    }

    /// The config of the parsed env: `None` when xDS is off (no `XDS_ADDRESS`, or a local config).
    pub fn from_env(env: &IstioEnv) -> Option<XdsConfig> {
        let xds = env.xds.as_ref()?;
        let node = NodeIdentity::ztunnel(&NodeParams::from_env(env));
        Some(XdsConfig::new(xds.endpoint.clone(), xds.auth.clone(), node))
    }
}

// === impl NodeParams ===

impl NodeParams {
    /// The node settings of the parsed env.
    pub fn from_env(env: &IstioEnv) -> NodeParams {
        NodeParams {
            instance_ip: env.instance_ip.clone(),
            pod_name: env.pod_name.clone(),
            pod_namespace: env.pod_namespace.clone(),
            node_name: env.node_name.clone(),
            cluster_id: env.cluster_id.clone(),
            proxy_metadata: env.proxy_metadata.clone(),
        }
    }
}

// === impl NodeIdentity ===

impl NodeIdentity {
    /// ztunnel's node: id `ztunnel~<INSTANCE_IP>~<POD_NAME>.<POD_NAMESPACE>~<POD_NAMESPACE>.svc.cluster.local`,
    /// metadata = the proxy metadata plus `NAME`, `NAMESPACE`, `INSTANCE_IPS`, `NODE_NAME`,
    /// `CLUSTER_ID`.
    pub fn ztunnel(p: &NodeParams) -> NodeIdentity {
        let ip = if p.instance_ip.is_empty() {
            DEFAULT_INSTANCE_IP
        } else {
            &p.instance_ip
        };
        let ns = &p.pod_namespace;
        let id = format!("ztunnel~{ip}~{}.{ns}~{ns}.svc.cluster.local", p.pod_name);
        let cluster_id = if p.cluster_id.is_empty() {
            DEFAULT_CLUSTER_ID
        } else {
            &p.cluster_id
        };
        let mut metadata: BTreeMap<String, String> = [
            ("NAME", p.pod_name.as_str()),
            ("NAMESPACE", ns.as_str()),
            ("INSTANCE_IPS", ip),
            ("NODE_NAME", p.node_name.as_str()),
            ("CLUSTER_ID", cluster_id),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        // ztunnel appends the proxy metadata last: an ISTIO_META_* entry wins over a fixed key.
        metadata.extend(p.proxy_metadata.clone());
        NodeIdentity { id, metadata }
    }

    /// Adds (or replaces) one metadata entry, e.g. proxy metadata.
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// The proto `Node` (metadata as a `Struct` of string values).
    pub fn to_proto(&self) -> Node {
        let fields = self
            .metadata
            .iter()
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.clone())),
                };
                (k.clone(), value)
            })
            .collect();
        Node {
            id: self.id.clone(),
            cluster: String::new(),
            metadata: Some(Struct { fields }),
        }
    }
}

// === impl XdsClient ===

impl XdsClient {
    /// A client holding nothing yet; registers one readiness task per type in `ready`
    /// ([`readiness_task_name`]), each done on the first ACKed response of its type.
    pub fn new(cfg: XdsConfig, state: StateHandle, ready: &Readiness) -> XdsClient {
        let pending = ResourceType::ALL
            .into_iter()
            .map(|t| (t, ready.register(readiness_task_name(t))))
            .collect();
        XdsClient {
            cfg,
            state,
            held: Held::new(),
            pending,
        }
    }

    /// Streams from istiod, reconnecting with backoff, until `shutdown` resolves.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut backoff = Backoff::new(self.cfg.backoff);
        loop {
            let mut got_response = false;
            let result = tokio::select! {
                () = &mut shutdown => return,
                r = self.session(&mut got_response) => r,
            };
            if got_response {
                backoff.reset();
            }
            let delay = backoff.next_delay();
            let address = self.cfg.endpoint.address.to_string();
            let reason = match &result {
                Err(XdsError::Closed) => TerminationReason::Complete,
                Err(XdsError::Open(_) | XdsError::Control(_)) => TerminationReason::ConnectionError,
                _ => TerminationReason::Error,
            };
            self.cfg.metrics.terminated(reason);
            match result {
                Err(XdsError::Closed) => {
                    tracing::info!(%address, ?delay, "xds stream closed by istiod; reconnecting");
                }
                Err(e) => {
                    let error = error_chain(&e);
                    tracing::warn!(%address, %error, ?delay, "xds stream failed; reconnecting");
                }
                Ok(()) => {}
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// One stream: connect, subscribe, then apply responses until the stream ends.
    async fn session(&mut self, got_response: &mut bool) -> Result<(), XdsError> {
        let channel = self.cfg.endpoint.connect().await?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
        for (i, t) in ResourceType::ALL.into_iter().enumerate() {
            let node = (i == 0).then(|| self.cfg.node.to_proto());
            // The receiver is alive here, so this cannot fail.
            let _ = tx.send(self.held.initial_request(t, node));
        }
        let requests =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        let mut req = tonic::Request::new(requests);
        self.cfg.auth.apply(&mut req)?;
        let mut responses =
            control::streaming::<_, DeltaDiscoveryResponse, _>(channel, DELTA_ADS_PATH, req)
                .await
                .map_err(XdsError::Open)?;
        tracing::info!(address = %self.cfg.endpoint.address, node = %self.cfg.node.id, "xds stream open");
        loop {
            let resp = match responses.message().await {
                Ok(Some(resp)) => resp,
                Ok(None) => return Err(XdsError::Closed),
                Err(status) => return Err(XdsError::Stream(status)),
            };
            *got_response = true;
            let bytes: usize = resp
                .resources
                .iter()
                .filter_map(|r| r.resource.as_ref())
                .map(|a| a.value.len())
                .sum();
            self.cfg
                .metrics
                .message(&resp.type_url, u64::try_from(bytes).unwrap_or(u64::MAX));
            let outcome = self.held.apply(&resp);
            log_outcome(&resp, &outcome);
            if outcome.changed() {
                self.publish();
            }
            let acked = outcome.is_ack().then_some(outcome.resource_type).flatten();
            if tx.send(outcome.reply).is_err() {
                return Err(XdsError::Closed);
            }
            if let Some(task) = acked.and_then(|t| self.pending.remove(&t)) {
                tracing::info!(resource = %acked.map_or("", ResourceType::name), "xds initial sync done");
                task.done();
            }
        }
    }

    /// Rebuilds the proxy state from what is held and stores it.
    fn publish(&self) {
        let (st, conflicts) = ProxyState::from_config_lenient(&self.held.local_config());
        for c in conflicts {
            tracing::warn!(error = %c, "xds state: duplicate, the later resource wins");
        }
        self.state.store(st);
    }
}

/// `e` and its sources, `: `-separated, skipping a source whose text is already in the message
/// (tonic's transport errors say only "transport error" at the top).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

fn log_outcome(resp: &DeltaDiscoveryResponse, out: &Outcome) {
    let t: &str = match out.resource_type {
        Some(t) => t.name(),
        None => &resp.type_url,
    };
    if let Some(nack) = &out.reply.error_detail {
        tracing::warn!(
            resource = t,
            nonce = %resp.nonce,
            rejected = out.rejected.len(),
            error = %nack.message,
            "xds NACK: rejected resources keep their last good version"
        );
    }
    if out.changed() {
        tracing::info!(
            resource = t,
            nonce = %resp.nonce,
            updated = out.updated.len(),
            removed = out.removed.len(),
            "xds push applied"
        );
    } else {
        tracing::debug!(resource = t, nonce = %resp.nonce, "xds response without changes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_id_and_metadata_are_ztunnels() {
        let node = NodeIdentity::ztunnel(&NodeParams {
            instance_ip: "10.0.0.5".into(),
            pod_name: "ztunnel-abc".into(),
            pod_namespace: "istio-system".into(),
            node_name: "node-1".into(),
            cluster_id: String::new(),
            // ztunnel appends ISTIO_META_* last: it wins over the fixed keys
            proxy_metadata: [("EXTRA", "x"), ("NODE_NAME", "from-istio-meta")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        })
        .with_metadata("MORE", "y");
        assert_eq!(
            node.id,
            "ztunnel~10.0.0.5~ztunnel-abc.istio-system~istio-system.svc.cluster.local"
        );
        let md: Vec<(&str, &str)> = node
            .metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            md,
            [
                ("CLUSTER_ID", "Kubernetes"),
                ("EXTRA", "x"),
                ("INSTANCE_IPS", "10.0.0.5"),
                ("MORE", "y"),
                ("NAME", "ztunnel-abc"),
                ("NAMESPACE", "istio-system"),
                ("NODE_NAME", "from-istio-meta"),
            ]
        );
        let proto = node.to_proto();
        let fields = proto.metadata.expect("metadata").fields;
        assert_eq!(
            fields["NODE_NAME"].kind,
            Some(Kind::StringValue("from-istio-meta".into()))
        );
        let bare = NodeIdentity::ztunnel(&NodeParams::default());
        assert_eq!(bare.id, "ztunnel~1.1.1.1~.~.svc.cluster.local");
        assert_eq!(bare.metadata["INSTANCE_IPS"], "1.1.1.1");
    }

    #[test]
    fn the_config_comes_from_the_charts_env() {
        let vars = [
            ("XDS_ADDRESS", "istiod.istio-system.svc:15012"),
            ("ISTIO_META_CLUSTER_ID", "c1"),
            ("NODE_NAME", "node-1"),
            ("POD_NAME", "ztunnel-abc"),
            ("POD_NAMESPACE", "istio-system"),
            ("INSTANCE_IP", "10.0.0.5"),
        ];
        let env = IstioEnv::from_vars(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .expect("env");
        let cfg = XdsConfig::from_env(&env).expect("xds on");
        assert_eq!(
            cfg.node.id,
            "ztunnel~10.0.0.5~ztunnel-abc.istio-system~istio-system.svc.cluster.local"
        );
        assert_eq!(cfg.node.metadata["CLUSTER_ID"], "c1");
        assert_eq!(cfg.auth.cluster_id, "c1");
        assert_eq!(cfg.backoff, XDS_RECONNECT);
        let off = IstioEnv::from_vars(std::iter::empty()).expect("env");
        assert!(XdsConfig::from_env(&off).is_none());
    }

    #[test]
    fn logged_errors_carry_their_sources_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = XdsError::Control(ControlError::ReadToken {
            path: "/t".into(),
            source: io,
        });
        assert_eq!(error_chain(&e), "cannot read the token /t: refused");
        let status = XdsError::Stream(tonic::Status::unavailable("bye"));
        assert!(error_chain(&status).starts_with("delta ADS stream failed: "));
    }

    #[test]
    fn readiness_tasks_are_registered_at_once() {
        let ready = Readiness::new();
        let endpoint = ControlEndpoint::new("127.0.0.1:1", control::RootSource::System, None)
            .expect("endpoint");
        let node = NodeIdentity::ztunnel(&NodeParams::default());
        let _fut = run(
            XdsConfig::new(endpoint, CallAuth::default(), node),
            StateHandle::new(ProxyState::default()),
            &ready,
            std::future::pending(),
        );
        assert_eq!(ready.pending_tasks(), ["xds Address", "xds Authorization"]);
    }
}
