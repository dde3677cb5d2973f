//! Composition of the roles: `ztnode node` (agent and proxy in one process, the DaemonSet entrypoint
//! in standalone mode), `ztnode agent` and `ztnode proxy` (the two halves as separate processes
//! over the ZDS socket, like istio-cni and ztunnel). Each role starts through its own front door
//! ([`crate::agent::start`], [`crate::proxy::start`]); this module only wires them together.
//!
//! Wiring, in a pod's order: local config → workload state; the proxy ([`proxy::start`]) behind a
//! ZDS link; the agent ([`agent::start`], enrollment = HBONE workload of that namespace/name in the
//! local config) behind the plugin socket; in the proxy's process the admin
//! (`127.0.0.1:15000/config_dump`), readiness (`:15021/healthz/ready`) and metrics
//! (`:15020/metrics`) endpoints. [`run`] joins both halves with the in-process channel;
//! [`run_agent`] serves ZDS on a unix socket and [`run_proxy`] connects to it. Each ends cleanly
//! when `shutdown` resolves (SIGTERM/SIGINT in `main`).

pub mod admin;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::agent::enroll::EnrollmentPolicy;
use crate::agent::pods::PodManager;
use crate::agent::{self, AgentConfig, EnrollmentSource, KubeMode};
use crate::proxy::manager::ProxyManager;
use crate::proxy::state::{self, Protocol, StateHandle};
use crate::proxy::{self, ProxyConfig};
use crate::ready::Readiness;
use crate::runtime::stopped;
use crate::zds::server::ZdsServer;
use crate::zds::{self, WorkloadInfo};

/// How often the local config file is re-read.
const CONFIG_POLL: Duration = Duration::from_secs(1);

/// Readiness task of the local config (pending until it was read once).
pub const LOCAL_CONFIG_TASK: &str = "local config";

/// Readiness task of a separate proxy: pending while it is not connected to the agent's ZDS
/// socket (ztunnel goes unready on disconnect).
pub const ZDS_CONNECTION_TASK: &str = "ZDS connection";

/// Settings of `ztnode node`: both halves.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Local config file (ztunnel LOCAL_XDS_PATH format), read by both halves; required in
    /// standalone mode, optional in Kubernetes mode (workloads and policies then start empty).
    pub config: Option<PathBuf>,
    /// Kubernetes mode (`None`: standalone, pods enrolled by the local config).
    pub kube: Option<KubeMode>,
    /// The agent half.
    pub agent: AgentConfig,
    /// The proxy half.
    pub proxy: ProxyConfig,
}

/// Runs agent and proxy in one process, joined by the in-process ZDS channel, until `shutdown`.
pub async fn run(
    cfg: NodeConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, "starting ztnode node");
    anyhow::ensure!(
        cfg.agent.redirect.proxy_mark == cfg.proxy.packet_mark,
        "the in-pod rules must exclude the proxy's packet mark: rules {}, proxy {}",
        cfg.agent.redirect.proxy_mark,
        cfg.proxy.packet_mark
    );
    let ready = Readiness::new();
    let state = load_state(cfg.config.as_deref(), &ready)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let proxy = proxy::start(&cfg.proxy, state.clone(), &ready)?;
    let agent = agent::start(
        cfg.agent,
        enrollment_source(cfg.kube, &state),
        proxy.link.into(),
        &ready,
        stopped(stop_rx.clone()),
    )
    .await?;
    serve_admin(
        &cfg.proxy,
        state,
        proxy.manager.clone(),
        Some(agent.pods.clone()),
        ready,
        stop_rx,
    )
    .await?;

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    agent.join().await;
    proxy.manager.stop_all();
    Ok(())
}

/// Runs the agent alone until `shutdown`: plugin socket, install, and the ZDS server on `zds_socket`
/// for separate proxies. Enrollment follows Kubernetes (`kube`) or else the local config at
/// `config`.
pub async fn run_agent(
    config: Option<PathBuf>,
    kube: Option<KubeMode>,
    cfg: AgentConfig,
    zds_socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, ?config, ?kube, zds_socket = %zds_socket.display(), "starting ztnode agent");
    let ready = Readiness::new();
    let state = load_state(config.as_deref(), &ready)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let zds_server = ZdsServer::new();
    let listener = zds::server::bind(&zds_socket)?;
    let zds_task = tokio::spawn(zds_server.clone().serve(listener, stopped(stop_rx.clone())));
    tracing::info!(socket = %zds_socket.display(), "ZDS socket ready");
    let agent = agent::start(
        cfg,
        enrollment_source(kube, &state),
        zds_server.into(),
        &ready,
        stopped(stop_rx),
    )
    .await?;

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    agent.join().await;
    let _ = zds_task.await;
    let _ = std::fs::remove_file(&zds_socket);
    Ok(())
}

/// Runs the proxy alone until `shutdown`, taking pods from the agent's ZDS socket at `zds_socket`
/// (reconnecting while it is absent). Errors: startup failures, and a ZDS protocol error from the
/// agent (ztunnel exits then too).
pub async fn run_proxy(
    config: Option<PathBuf>,
    cfg: ProxyConfig,
    zds_socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, ?config, zds_socket = %zds_socket.display(), "starting ztnode proxy");
    let config =
        config.context("--config (LOCAL_XDS_PATH) is required without istiod (XDS_ADDRESS)")?;
    let ready = Readiness::new();
    let state = load_state(Some(&config), &ready)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let proxy = proxy::start(&cfg, state.clone(), &ready)?;
    let connection = ready.register(ZDS_CONNECTION_TASK);
    serve_admin(&cfg, state, proxy.manager.clone(), None, ready, stop_rx).await?;
    let res = tokio::select! {
        _ = shutdown => Ok(()),
        r = zds::client::run(zds_socket, proxy.link, std::future::pending(), move |up| connection.set_ready(up)) => {
            r.context("ZDS connection to the node agent")
        }
    };
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    proxy.manager.stop_all();
    res
}

/// Kubernetes mode when configured, else the local config's policy.
fn enrollment_source(kube: Option<KubeMode>, state: &StateHandle) -> EnrollmentSource {
    match kube {
        Some(mode) => EnrollmentSource::Kubernetes(mode),
        None => EnrollmentSource::Policy(local_config_policy(state.clone())),
    }
}

/// Standalone enrollment: a pod is in the mesh when the local config has an HBONE workload with
/// its namespace and name, with that workload's service account.
fn local_config_policy(state: StateHandle) -> Arc<dyn EnrollmentPolicy> {
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

/// Loads the local config and keeps it fresh (`None`: an empty state).
fn load_state(config: Option<&Path>, ready: &Readiness) -> anyhow::Result<StateHandle> {
    let Some(config) = config else {
        return Ok(StateHandle::new(state::ProxyState::default()));
    };
    let loaded = ready.register(LOCAL_CONFIG_TASK);
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
    ready: Readiness,
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
