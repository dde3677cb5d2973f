//! The proxy role (`ztunnel`): per-pod listeners, HBONE client/server, identities, workload state.
//!
//! A pod's journey here: the agent hands its netns over ([`crate::zds`]) → [`manager`] binds the
//! listeners inside it and runs their accept loop with the pod's context ([`pod`]) → [`outbound`]
//! tunnels the app's connections over HBONE ([`pool`], [`tls`], [`identity`]) → the peer's
//! [`inbound`] checks and forwards them to its app; both log and count each connection
//! ([`accesslog`], [`metrics`]).
//!
//! The modules form a one-way stack: the manager sits on top; the connection code ([`inbound`],
//! [`outbound`], [`task`]) sees only the per-pod context, never the manager.
//!
//! [`start`] is the role's front door: the certificate source (the built-in CA, or Istio's CA),
//! the trust bundle, and the proxy manager, fed by the returned in-process ZDS link.

pub mod accesslog;
pub mod authz;
pub mod config;
pub mod control;
pub mod copy;
pub mod dns;
pub mod drain;
pub mod hbone;
pub mod identity;
pub mod inbound;
pub mod istio_env;
pub mod live;
pub mod manager;
pub mod metrics;
pub mod outbound;
pub mod pod;
pub mod pool;
pub mod route;
pub mod scope;
pub mod socket;
pub mod state;
pub mod task;
pub mod tls;
pub mod xds;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use identity::CertSource;

use crate::mesh::{self, PacketMark};
use crate::ready::Readiness;
use crate::zds::{self, InProcessSender};
use control::RootSource;
use identity::{CertManager, IdentityError};
use manager::ProxyManager;
use metrics::Metrics;
use pod::ProxyContext;
use state::StateHandle;

/// Readiness task of the proxy (ztunnel's name): pending until the first ZDS snapshot has been
/// applied with every workload in it started, and again while a workload's start has failed
/// ([`ProxyManager::run`]).
pub const PROXY_MANAGER_TASK: &str = "workload proxy manager";

/// Settings of the proxy.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where workload certificates come from: the built-in CA (default) or Istio's CA.
    pub cert_source: CertSource,
    /// Workload certificate lifetime (`SECRET_TTL`): the built-in CA's leaves, and the
    /// `validity_duration` asked of Istio's CA.
    pub cert_lifetime: Duration,
    /// More roots to trust for peers (e.g. `XDS_ROOT_CA`), besides the built-in CA's root file
    /// or `CA_ROOT_CA` and the CA's answers; files are re-read every second.
    pub trust_roots: Vec<RootSource>,
    /// SO_MARK of every socket the proxy opens in a pod (the in-pod rules must exclude the same).
    pub packet_mark: PacketMark,
    /// Admin listener (`/config_dump`), default [`mesh::DEFAULT_ADMIN_ADDR`].
    pub admin_addr: SocketAddr,
    /// Readiness listener (`/healthz/ready`), default [`mesh::DEFAULT_READINESS_ADDR`].
    pub readiness_addr: SocketAddr,
    /// Metrics listener (`/metrics`), default [`mesh::DEFAULT_METRICS_ADDR`].
    pub metrics_addr: SocketAddr,
    /// The outbound HBONE pool of every pod (ztunnel `POOL_MAX_STREAMS_PER_CONNECTION`,
    /// `POOL_UNUSED_RELEASE_TIMEOUT`).
    pub pool: pool::PoolConfig,
    /// The in-pod DNS proxy on 15053 (on by default, the node's `/etc/resolv.conf` upstreams).
    pub dns: dns::DnsOptions,
    /// Trust domain of the pods served from their handoff (ztunnel `TRUST_DOMAIN`, default
    /// `cluster.local`); workload records carry their own.
    pub trust_domain: String,
    /// How long a shutdown lets open connections finish before closing them (ztunnel
    /// `CONNECTION_TERMINATION_DEADLINE`, default 5 s; see
    /// [`istio_env::termination_deadline`]).
    pub termination_deadline: Duration,
    /// `SO_REUSEPORT` on the in-pod listeners and the node endpoints (ztunnel
    /// `INPOD_PORT_REUSE`, default on): a new proxy process takes them over while this one drains.
    pub port_reuse: bool,
}

impl ProxyConfig {
    /// Istio's defaults with the built-in CA in `ca_dir`: 24 h certificates, mark `0x539`, the
    /// node endpoints on 15000/15021/15020, ztunnel's pool settings (100 streams open at once
    /// per connection, unused connections released after 5 min), a 5 s drain, port reuse on.
    pub fn new(ca_dir: PathBuf) -> ProxyConfig {
        ProxyConfig {
            cert_source: CertSource::BuiltIn { ca_dir },
            cert_lifetime: identity::DEFAULT_CERT_LIFETIME,
            trust_roots: Vec::new(),
            packet_mark: PacketMark::DEFAULT,
            admin_addr: mesh::DEFAULT_ADMIN_ADDR,
            readiness_addr: mesh::DEFAULT_READINESS_ADDR,
            metrics_addr: mesh::DEFAULT_METRICS_ADDR,
            pool: pool::PoolConfig::default(),
            dns: dns::DnsOptions::default(),
            trust_domain: identity::DEFAULT_TRUST_DOMAIN.to_owned(),
            termination_deadline: istio_env::DEFAULT_TERMINATION_DEADLINE,
            port_reuse: true,
        }
    }
}

/// Errors starting the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The built-in CA could not be loaded or generated.
    #[error("built-in CA in {dir}: {source}")]
    Ca {
        /// The CA dir.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: IdentityError,
    },
    /// The DNS proxy's resolver config could not be read.
    #[error(transparent)]
    Dns(#[from] dns::ResolvConfError),
    /// The certificate manager could not be set up.
    #[error("certificates: {source}")]
    Certificates {
        /// What failed.
        #[source]
        source: IdentityError,
    },
}

/// A started proxy (see [`start`]).
pub struct Proxy {
    /// The per-pod proxies.
    pub manager: Arc<ProxyManager>,
    /// Where workload requests go in (from the in-process agent or a ZDS socket client).
    pub link: InProcessSender,
}

/// Starts the proxy: the certificate manager for `cfg.cert_source` (its root files watched), and
/// the proxy manager serving the returned link. Registers [`PROXY_MANAGER_TASK`] in `ready`; with
/// Istio's CA, each Add waits for its pod's certificate, so readiness does too. Must run inside a
/// tokio runtime (it spawns the manager and the root-file watcher).
pub fn start(
    cfg: &ProxyConfig,
    state: StateHandle,
    ready: &Readiness,
) -> Result<Proxy, ProxyError> {
    let certs = CertManager::from_source(&cfg.cert_source, cfg.cert_lifetime, &cfg.trust_roots)
        .map_err(|source| match &cfg.cert_source {
            CertSource::BuiltIn { ca_dir } => ProxyError::Ca {
                dir: ca_dir.clone(),
                source,
            },
            CertSource::Istio { .. } => ProxyError::Certificates { source },
        })?;
    certs.bundle().watch(identity::bundle::RELOAD_INTERVAL);
    match &cfg.cert_source {
        CertSource::BuiltIn { ca_dir } => {
            tracing::info!(dir = %ca_dir.display(), "built-in CA ready (root-cert.pem)");
        }
        CertSource::Istio { endpoint, .. } => tracing::info!(
            address = %endpoint.address,
            ttl = ?cfg.cert_lifetime,
            roots = certs.bundle().certificates().len(),
            "certificates from Istio's CA"
        ),
    }
    let dns = dns::DnsProxy::from_options(&cfg.dns)?;
    let ctx = Arc::new(ProxyContext {
        state,
        certs,
        metrics: Metrics::default(),
        mark: cfg.packet_mark,
        local: Default::default(),
        pool: cfg.pool,
        dns,
        trust_domain: cfg.trust_domain.clone(),
    });
    let manager = ProxyManager::with_port_reuse(ctx, cfg.port_reuse);
    let (link, rx) = zds::in_process();
    let task = ready.register(PROXY_MANAGER_TASK);
    tokio::spawn(manager.clone().run(rx, move |ready| {
        task.set_ready(ready);
        if ready {
            tracing::info!("workload proxy manager ready (snapshot applied)");
        } else {
            tracing::warn!("workload proxy manager not ready (a workload failed to start)");
        }
    }));
    Ok(Proxy { manager, link })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zds::{WorkloadInfo, WorkloadRequest};

    fn proxy_config(ca_dir: &std::path::Path) -> ProxyConfig {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        ProxyConfig {
            cert_lifetime: Duration::from_secs(3600),
            admin_addr: any,
            readiness_addr: any,
            metrics_addr: any,
            ..ProxyConfig::new(ca_dir.to_owned())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_proxy_is_ready_once_the_snapshot_is_applied_and_no_workload_failed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ready = Readiness::new();
        let state = StateHandle::new(state::ProxyState::default());
        let Proxy { link, .. } = start(&proxy_config(dir.path()), state, &ready).expect("proxy");
        assert_eq!(ready.pending_tasks(), [PROXY_MANAGER_TASK]);
        // a pod whose netns cannot be entered (here: not a netns at all) fails to start
        let not_a_netns = std::fs::File::open("/dev/null").expect("/dev/null");
        let add = WorkloadRequest::Add {
            uid: "unknown".into(),
            info: WorkloadInfo {
                name: "nobody".into(),
                namespace: "default".into(),
                service_account: "x".into(),
            },
            netns: crate::netns::Netns::from_file(not_a_netns).expect("fd"),
        };
        assert!(link.send(add).await.is_err(), "the Add is nacked");
        link.send(WorkloadRequest::SnapshotSent).await.expect("ack");
        assert_eq!(
            ready.pending_tasks(),
            [PROXY_MANAGER_TASK],
            "a failed workload keeps it pending"
        );
        link.send(WorkloadRequest::Del {
            uid: "unknown".into(),
        })
        .await
        .expect("ack");
        assert!(ready.is_ready(), "{:?}", ready.pending_tasks());
        // later snapshots (a reconnected agent) keep it ready
        link.send(WorkloadRequest::SnapshotSent).await.expect("ack");
        assert!(ready.is_ready());
    }

    #[tokio::test]
    async fn nothing_is_ready_before_the_snapshot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ready = Readiness::new();
        let state = StateHandle::new(state::ProxyState::default());
        let Proxy { link, .. } = start(&proxy_config(dir.path()), state, &ready).expect("proxy");
        link.send(WorkloadRequest::Del { uid: "gone".into() })
            .await
            .expect("ack");
        assert_eq!(ready.pending_tasks(), [PROXY_MANAGER_TASK]);
    }
}
