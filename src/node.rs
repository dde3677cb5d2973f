//! Role wiring: `ztnode node` (agent and proxy in one process, the DaemonSet entrypoint in standalone
//! mode), `ztnode agent` and `ztnode proxy` (the two halves as separate processes over the ZDS socket,
//! like istio-cni and ztunnel).
//!
//! Wiring, in a pod's order: local config → workload state; built-in CA → certificates; proxy manager
//! behind a ZDS link ([`start_proxy`]); pod manager (enrollment = HBONE workload of that
//! namespace/name in the local config) behind the plugin socket, self-install onto the host CNI dirs
//! with repair ([`start_agent`]); in the proxy's process the admin (`127.0.0.1:15000/config_dump`),
//! readiness (`:15021/healthz/ready`) and metrics (`:15020/metrics`) endpoints. [`run`] joins both
//! halves with the in-process channel; [`run_agent`] serves ZDS on a unix socket and [`run_proxy`]
//! connects to it. Each ends cleanly when `shutdown` resolves (SIGTERM/SIGINT in `main`).

pub mod admin;
pub mod ready;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::enroll::EnrollmentPolicy;
use crate::agent::install::{self, InstallConfig};
use crate::agent::pods::PodManager;
use crate::agent::redirect::RedirectPlan;
use crate::agent::server;
use crate::podevent::plugin_socket_path;
use crate::proxy::identity::{Ca, CertManager};
use crate::proxy::manager::ProxyManager;
use crate::proxy::metrics::Metrics;
use crate::proxy::pod::ProxyContext;
use crate::proxy::state::{self, Protocol, StateHandle};
use crate::zds::server::ZdsServer;
use crate::zds::{self, WorkloadInfo, WorkloadSink, ZdsClient};

/// How often the local config file is re-read.
const CONFIG_POLL: Duration = Duration::from_secs(1);

/// Settings of `ztnode node`: both halves.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Local config file (ztunnel LOCAL_XDS_PATH format), read by both halves.
    pub config: PathBuf,
    /// The agent half.
    pub agent: AgentConfig,
    /// The proxy half.
    pub proxy: ProxyConfig,
}

/// Settings of the node agent half.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Agent run dir (plugin socket `pluginevent.sock`).
    pub run_dir: PathBuf,
    /// Host CNI bin dir.
    pub cni_bin_dir: PathBuf,
    /// Host CNI conf dir.
    pub cni_conf_dir: PathBuf,
    /// Whether to install the plugin onto the host dirs.
    pub install: bool,
    /// Redirection options.
    pub redirect: RedirectPlan,
}

/// Settings of the proxy half.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// CA dir (root-cert.pem, ca-key.pem; generated when absent).
    pub ca_dir: PathBuf,
    /// Workload certificate lifetime.
    pub cert_lifetime: Duration,
    /// SO_MARK of proxy sockets.
    pub packet_mark: u32,
    /// Admin listener (`/config_dump`).
    pub admin_addr: SocketAddr,
    /// Readiness listener (`/healthz/ready`).
    pub readiness_addr: SocketAddr,
    /// Metrics listener (`/metrics`).
    pub metrics_addr: SocketAddr,
}

/// A started agent half (see [`start_agent`]).
pub struct Agent {
    /// The pod table.
    pub pods: Arc<PodManager>,
    server_task: JoinHandle<()>,
    sock_path: PathBuf,
}

/// Runs agent and proxy in one process, joined by the in-process ZDS channel, until `shutdown`.
pub async fn run(
    cfg: NodeConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, "starting ztnode node");
    let ready = ready::Readiness::new();
    let state = load_state(&cfg.config, &ready)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (proxies, link) = start_proxy(&cfg.proxy, state.clone(), &ready)?;
    let agent = start_agent(
        &cfg.agent,
        state.clone(),
        link.into(),
        &ready,
        stop_rx.clone(),
    )
    .await?;
    serve_admin(
        &cfg.proxy,
        state,
        proxies.clone(),
        Some(agent.pods.clone()),
        ready,
        stop_rx,
    )
    .await?;

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    agent.stop().await;
    proxies.stop_all();
    Ok(())
}

/// Runs the agent alone until `shutdown`: plugin socket, install, and the ZDS server on `zds_socket`
/// for separate proxies. Enrollment reads the local config at `config`.
pub async fn run_agent(
    config: PathBuf,
    cfg: AgentConfig,
    zds_socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, config = %config.display(), zds_socket = %zds_socket.display(), "starting ztnode agent");
    let ready = ready::Readiness::new();
    let state = load_state(&config, &ready)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let zds_server = ZdsServer::new();
    let listener = zds::server::bind(&zds_socket)?;
    let zds_task = tokio::spawn(zds_server.clone().serve(listener, stopped(stop_rx.clone())));
    tracing::info!(socket = %zds_socket.display(), "ZDS socket ready");
    let agent = start_agent(&cfg, state, zds_server.into(), &ready, stop_rx).await?;

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    agent.stop().await;
    let _ = zds_task.await;
    let _ = std::fs::remove_file(&zds_socket);
    Ok(())
}

/// Runs the proxy alone until `shutdown`, taking pods from the agent's ZDS socket at `zds_socket`
/// (reconnecting while it is absent). Errors: startup failures, and a ZDS protocol error from the
/// agent (ztunnel exits then too).
pub async fn run_proxy(
    config: PathBuf,
    cfg: ProxyConfig,
    zds_socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, config = %config.display(), zds_socket = %zds_socket.display(), "starting ztnode proxy");
    let ready = ready::Readiness::new();
    let state = load_state(&config, &ready)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (proxies, link) = start_proxy(&cfg, state.clone(), &ready)?;
    let connection = ready.register(ZDS_CONNECTION_TASK);
    serve_admin(&cfg, state, proxies.clone(), None, ready, stop_rx).await?;
    let res = tokio::select! {
        _ = shutdown => Ok(()),
        r = zds::client::run(zds_socket, link, std::future::pending(), move |up| connection.set_ready(up)) => {
            r.context("ZDS connection to the node agent")
        }
    };
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    proxies.stop_all();
    res
}

/// Readiness task of the proxy half (ztunnel's name): pending until the first ZDS snapshot has been
/// applied with every workload in it started, and again while a workload's start has failed
/// ([`ProxyManager::run`]).
pub const PROXY_MANAGER_TASK: &str = "workload proxy manager";

/// Readiness task of a separate proxy: pending while it is not connected to the agent's ZDS
/// socket (ztunnel goes unready on disconnect).
pub const ZDS_CONNECTION_TASK: &str = "ZDS connection";

/// Starts the proxy half: built-in CA from `cfg.ca_dir`, certificates, and the proxy manager serving
/// the returned in-process ZDS channel (a socket client or the agent feeds it). Registers
/// [`PROXY_MANAGER_TASK`] in `ready`.
pub fn start_proxy(
    cfg: &ProxyConfig,
    state: StateHandle,
    ready: &ready::Readiness,
) -> anyhow::Result<(Arc<ProxyManager>, ZdsClient)> {
    let ca = Ca::load_or_generate(Some(&cfg.ca_dir)).context("built-in CA")?;
    let certs = CertManager::new(ca, cfg.cert_lifetime);
    tracing::info!(dir = %cfg.ca_dir.display(), "built-in CA ready (root-cert.pem)");
    let ctx = Arc::new(ProxyContext {
        state,
        certs,
        metrics: Metrics::default(),
        mark: cfg.packet_mark,
    });
    let proxies = ProxyManager::new(ctx);
    let (link, rx) = zds::channel();
    let manager = ready.register(PROXY_MANAGER_TASK);
    tokio::spawn(proxies.clone().run(rx, move |ready| {
        manager.set_ready(ready);
        if ready {
            tracing::info!("workload proxy manager ready (snapshot applied)");
        } else {
            tracing::warn!("workload proxy manager not ready (a workload failed to start)");
        }
    }));
    Ok((proxies, link))
}

/// Starts the agent half: pod manager handing pods to `proxy`, the plugin event socket, and the
/// installer with its repair loop when `cfg.install`. Background tasks end when `stop` turns true.
pub async fn start_agent(
    cfg: &AgentConfig,
    state: StateHandle,
    proxy: WorkloadSink,
    ready: &ready::Readiness,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Agent> {
    let socket_ready = ready.register("plugin socket");
    let pods = Arc::new(PodManager::new(
        enrollment_policy(state),
        proxy,
        cfg.redirect.clone(),
    ));
    // Pods enrolled before a restart get their rules and proxy back before new events arrive.
    pods.restore(&cfg.run_dir)
        .await
        .context("restore enrolled pods")?;
    let sock_path = plugin_socket_path(&cfg.run_dir);
    let listener = server::bind(&sock_path)?;
    let server_task = tokio::spawn(server::serve(listener, pods.clone(), stopped(stop.clone())));
    tracing::info!(socket = %sock_path.display(), "plugin event socket ready");
    socket_ready.done();

    if cfg.install {
        let icfg = InstallConfig {
            cni_bin_dir: cfg.cni_bin_dir.clone(),
            cni_conf_dir: cfg.cni_conf_dir.clone(),
            source_binary: std::env::current_exe().context("current exe")?,
            run_dir: cfg.run_dir.clone(),
            exclude_namespaces: vec!["kube-system".into()],
            log_level: None,
        };
        match install::install(&icfg) {
            Ok(outcome) => tracing::info!(?outcome, "CNI plugin installed"),
            Err(e) => tracing::warn!(error = %e, "CNI install not done yet; the watcher retries"),
        }
        let probe = icfg.clone();
        tokio::spawn(ready::track(
            ready.register("cni plugin install"),
            move || install::is_installed(&probe),
            stopped(stop.clone()),
        ));
        tokio::spawn(install::watch_and_repair(icfg, stopped(stop)));
    }
    Ok(Agent {
        pods,
        server_task,
        sock_path,
    })
}

impl Agent {
    /// Waits for the plugin server to stop (after `stop` turned true) and removes its socket.
    pub async fn stop(self) {
        let _ = self.server_task.await;
        let _ = std::fs::remove_file(&self.sock_path);
    }
}

/// Enrolls a pod when the local config has an HBONE workload with its namespace and name.
fn enrollment_policy(state: StateHandle) -> Arc<dyn EnrollmentPolicy> {
    Arc::new(move |ns: &str, name: &str| {
        state
            .load()
            .workload_by_name(ns, name)
            .filter(|w| w.protocol == Protocol::Hbone)
            .map(|w| WorkloadInfo {
                name: w.name.clone(),
                namespace: w.namespace.clone(),
                service_account: w.service_account.clone(),
            })
    })
}

/// Loads the local config and keeps it fresh.
fn load_state(config: &Path, ready: &ready::Readiness) -> anyhow::Result<StateHandle> {
    let loaded = ready.register("local config");
    let state = StateHandle::new(state::load_config_file(config).context("local config")?);
    loaded.done();
    tokio::spawn(state::watch_config_file(
        config.to_owned(),
        state.clone(),
        CONFIG_POLL,
    ));
    Ok(state)
}

async fn serve_admin(
    cfg: &ProxyConfig,
    state: StateHandle,
    proxies: Arc<ProxyManager>,
    pods: Option<Arc<PodManager>>,
    ready: ready::Readiness,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let admin = admin::Admin {
        state,
        proxies,
        pods,
        ready,
    };
    admin::spawn(
        admin,
        cfg.admin_addr,
        cfg.readiness_addr,
        cfg.metrics_addr,
        stop,
    )
    .await
}

/// Resolves once `rx` turns true (or its sender is gone).
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zds::WorkloadRequest;

    fn proxy_config(ca_dir: &Path) -> ProxyConfig {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        ProxyConfig {
            ca_dir: ca_dir.to_owned(),
            cert_lifetime: Duration::from_secs(3600),
            packet_mark: 0x539,
            admin_addr: any,
            readiness_addr: any,
            metrics_addr: any,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_proxy_is_ready_once_the_snapshot_is_applied_and_no_workload_failed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ready = ready::Readiness::new();
        let state = StateHandle::new(state::ProxyState::default());
        let (_proxies, link) =
            start_proxy(&proxy_config(dir.path()), state, &ready).expect("proxy");
        assert_eq!(ready.pending_tasks(), [PROXY_MANAGER_TASK]);
        // a workload the state does not know fails to start (after the 5 s wait, paused time)
        let add = WorkloadRequest::Add {
            uid: "unknown".into(),
            info: WorkloadInfo {
                name: "nobody".into(),
                namespace: "default".into(),
                service_account: "x".into(),
            },
            netns: crate::netns::Netns::current().expect("netns"),
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
        let ready = ready::Readiness::new();
        let state = StateHandle::new(state::ProxyState::default());
        let (_proxies, link) =
            start_proxy(&proxy_config(dir.path()), state, &ready).expect("proxy");
        link.send(WorkloadRequest::Del { uid: "gone".into() })
            .await
            .expect("ack");
        assert_eq!(ready.pending_tasks(), [PROXY_MANAGER_TASK]);
    }
}
