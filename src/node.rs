//! Composition of the roles: `ztnode node` (agent and proxy in one process, the DaemonSet entrypoint
//! in standalone mode), `ztnode agent` and `ztnode proxy` (the two halves as separate processes
//! over the ZDS socket, like istio-cni and ztunnel). Each role starts through its own front door
//! ([`crate::agent::start`], [`crate::proxy::start`]); this module only wires them together.
//!
//! Wiring, in a pod's order: local config → workload state; the proxy ([`proxy::start`]) behind a
//! ZDS link; the agent ([`agent::start`], enrollment = HBONE workload of that namespace/name in the
//! local config) behind the plugin socket; in the proxy's process the admin
//! (`127.0.0.1:15000/config_dump`), readiness (`:15021/healthz/ready`) and metrics
//! (`:15020/metrics`) endpoints, bound before the agent restores its pods and not ready
//! ([`AGENT_START_TASK`]) until it serves them. [`run`] joins both halves with the in-process channel;
//! [`run_agent`] serves ZDS on a unix socket and [`run_proxy`] connects to it. Each ends cleanly
//! when `shutdown` resolves (SIGTERM/SIGINT in `main`) or on `POST /quitquitquit`.
//!
//! Shutdown is a drain (`../shared/spec/ztunnel.md` §3): readiness turns not-ready at once
//! ([`DRAINING_TASK`]), the proxy stops accepting in every pod and sends GOAWAY on its HBONE
//! connections, open connections get [`ProxyConfig::termination_deadline`] to finish and are
//! closed then ([`ProxyManager::start_drain`]); the admin, readiness and metrics endpoints answer
//! until the end. With port reuse a new process started beside this one (same run dir, or a new
//! `ztnode proxy` on the same agent) has bound the pods' ports already and takes every new
//! connection, so an upgrade has no gap; sockets that the new process took over (the plugin
//! socket) are left alone on the way out.

pub mod admin;
pub mod ca_init;
pub mod doctor;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::agent::enroll::EnrollmentPolicy;
use crate::agent::pods::PodManager;
use crate::agent::{self, AgentConfig, EnrollmentSource, KubeMode};
use crate::metrics::Exposition;
use crate::proxy::manager::ProxyManager;
use crate::proxy::state::{self, Protocol, StateHandle};
use crate::proxy::xds::{self, XdsConfig};
use crate::proxy::{self, ProxyConfig};
use crate::ready::Readiness;
use crate::runtime::image;
use crate::runtime::stopped;
use crate::zds::server::ZdsServer;
use crate::zds::{self, WorkloadInfo};

/// How often the local config file is re-read.
const CONFIG_POLL: Duration = Duration::from_secs(1);

/// How long `POST /quitquitquit` leaves the admin server before the process stops, so that its
/// answer is written first.
const QUIT_ANSWER_GRACE: Duration = Duration::from_millis(100);

/// Readiness task of the local config (pending until it was read once).
pub const LOCAL_CONFIG_TASK: &str = "local config";

/// Readiness task of `ztnode node`: pending until the agent has restored the enrolled pods
/// (rules re-applied, proxy serving them) and serves the plugin socket.
pub const AGENT_START_TASK: &str = "node agent start";

/// Readiness task that turns pending when the shutdown (drain) begins and stays so until the
/// process exits (ztunnel stops its readiness server on drain; here it answers 500 meanwhile).
pub const DRAINING_TASK: &str = "draining";

/// Readiness task of a separate proxy: pending while it is not connected to the agent's ZDS
/// socket (ztunnel goes unready on disconnect).
pub const ZDS_CONNECTION_TASK: &str = "ZDS connection";

/// Where the workloads, services and policies come from.
#[derive(Debug, Clone)]
pub enum WorkloadSource {
    /// A local config file (ztunnel `LOCAL_XDS_PATH` format), re-read when it changes.
    LocalConfig(PathBuf),
    /// istiod's delta xDS (`XDS_ADDRESS`).
    Xds(Box<XdsConfig>),
    /// Nothing (Kubernetes mode without either: pods are served with their handoff identity).
    Empty,
}

/// Settings of `ztnode node`: both halves.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The workload source of both halves: the proxy's state, and in standalone mode the
    /// agent's enrollment (an HBONE workload of the pod's namespace and name).
    pub source: WorkloadSource,
    /// This node's name (`NODE_NAME`): standalone enrollment then skips workloads the source
    /// places on another node.
    pub node_name: Option<String>,
    /// Kubernetes mode (`None`: standalone, pods enrolled by the local config).
    pub kube: Option<KubeMode>,
    /// The agent half.
    pub agent: AgentConfig,
    /// The proxy half.
    pub proxy: ProxyConfig,
}

/// Polls `shutdown` once, before start-up: the signal handlers it installs on its first poll
/// ([`crate::runtime::shutdown_signal`]) are then in place, so a SIGTERM during start-up ends in
/// the normal shutdown (with the agent's uninstall check) instead of killing the process. Returns
/// whether it already resolved.
async fn arm(shutdown: std::pin::Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
    let mut shutdown = shutdown;
    std::future::poll_fn(|cx| std::task::Poll::Ready(shutdown.as_mut().poll(cx).is_ready())).await
}

/// Runs agent and proxy in one process, joined by the in-process ZDS channel, until `shutdown`.
pub async fn run(
    cfg: NodeConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let run_config = run_config(
        "node",
        &cfg.source,
        &cfg.proxy,
        Some(&cfg.agent),
        cfg.node_name.clone(),
    );
    log_start("starting ztnode node", &run_config, cfg.kube.is_some());
    let mut shutdown = std::pin::pin!(shutdown);
    let stopped_early = arm(shutdown.as_mut()).await;
    anyhow::ensure!(
        cfg.agent.redirect.proxy_mark == cfg.proxy.packet_mark,
        "the in-pod rules must exclude the proxy's packet mark: rules {}, proxy {}",
        cfg.agent.redirect.proxy_mark,
        cfg.proxy.packet_mark
    );
    let ready = Readiness::new();
    let agent_started = ready.register(AGENT_START_TASK);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (admin_stop, admin_stop_rx) = watch::channel(false);
    let mut registry = Registry::default();
    let state = start_state(cfg.source, &ready, &stop_rx, &mut registry)?;
    let proxy = proxy::start(&cfg.proxy, state.clone(), &ready)?;
    // kept until the drain ended: the manager then still answers (refuses) late Adds
    let _link = proxy.link.clone();
    // Readiness is bound (and with port reuse takes the probes from an older process) before
    // the agent restores the pods, and answers not-ready until they are served: the kubelet
    // must not see the old process's "ready" while this one is still taking over.
    let pods = Arc::new(std::sync::OnceLock::new());
    cfg.agent.metrics.register(&mut registry);
    let mut quit = serve_admin(
        &cfg.proxy,
        proxy.manager.clone(),
        Some(pods.clone()),
        ready.clone(),
        registry,
        run_config,
        admin_stop_rx,
    )
    .await?;
    let agent = agent::start(
        cfg.agent,
        enrollment_source(cfg.kube, &state, cfg.node_name),
        proxy.link.into(),
        &ready,
        stopped(stop_rx.clone()),
    )
    .await?;
    let _ = pods.set(agent.pods.clone());
    agent_started.done();
    tokio::spawn(image::release_when_ready(ready.clone()));

    if !stopped_early {
        tokio::select! {
            _ = shutdown => {}
            _ = quitting(&mut quit) => {}
        }
    }
    let not_ready = ready.register(DRAINING_TASK);
    tracing::info!("shutting down: draining");
    let draining = proxy.manager.start_drain(cfg.proxy.termination_deadline);
    let _ = stop_tx.send(true);
    let ((), report) = tokio::join!(agent.join(), draining.finish());
    tracing::info!(?report, "shut down");
    let _ = admin_stop.send(true);
    drop(not_ready);
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
    tracing::info!(
        run_dir = %cfg.run_dir.display(),
        local_xds_config = config.as_ref().map(|c| c.display().to_string()),
        kubernetes = kube.is_some(),
        local_node = kube.as_ref().map(|k| k.settings.node_name.as_str()),
        cni_conf_dir = cfg.install.as_ref().map(|i| i.cni_conf_dir.display().to_string()),
        ipv6 = cfg.redirect.ipv6,
        dns_capture = cfg.redirect.dns_capture,
        packet_mark = cfg.redirect.proxy_mark.get(),
        zds_socket = %zds_socket.display(),
        "starting ztnode agent"
    );
    let mut shutdown = std::pin::pin!(shutdown);
    let stopped_early = arm(shutdown.as_mut()).await;
    let ready = Readiness::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    let source = config.map_or(WorkloadSource::Empty, WorkloadSource::LocalConfig);
    // the agent alone serves no metrics (its process has no stats listener)
    let state = start_state(source, &ready, &stop_rx, &mut Registry::default())?;
    let zds_server = ZdsServer::new();
    let listener = zds::server::bind(&zds_socket)?;
    let zds_socket_file = crate::runtime::socket_file::SocketFile::claim(&zds_socket);
    let zds_task = tokio::spawn(zds_server.clone().serve(listener, stopped(stop_rx.clone())));
    tracing::info!(socket = %zds_socket.display(), "ZDS socket ready");
    let agent = agent::start(
        cfg,
        enrollment_source(kube, &state, None),
        zds_server.into(),
        &ready,
        stopped(stop_rx),
    )
    .await?;
    tokio::spawn(image::release_when_ready(ready.clone()));

    if !stopped_early {
        shutdown.await;
    }
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    agent.join().await;
    let _ = zds_task.await;
    zds_socket_file.remove();
    Ok(())
}

/// Runs the proxy alone until `shutdown`, taking pods from the agent's ZDS socket at `zds_socket`
/// (reconnecting while it is absent). Errors: startup failures, and a ZDS protocol error from the
/// agent (ztunnel exits then too).
pub async fn run_proxy(
    source: WorkloadSource,
    cfg: ProxyConfig,
    zds_socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let run_config = run_config("proxy", &source, &cfg, None, None);
    log_start("starting ztnode proxy", &run_config, false);
    tracing::info!(zds_socket = %zds_socket.display(), "connecting to the node agent");
    let ready = Readiness::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    let (admin_stop, admin_stop_rx) = watch::channel(false);
    let mut registry = Registry::default();
    let state = start_state(source, &ready, &stop_rx, &mut registry)?;
    let proxy = proxy::start(&cfg, state.clone(), &ready)?;
    // kept until the drain ended, so closing the ZDS connection does not stop the pods at once
    let _link = proxy.link.clone();
    let connection = ready.register(ZDS_CONNECTION_TASK);
    let mut quit = serve_admin(
        &cfg,
        proxy.manager.clone(),
        None,
        ready.clone(),
        registry,
        run_config,
        admin_stop_rx,
    )
    .await?;
    tokio::spawn(image::release_when_ready(ready.clone()));
    // On shutdown the ZDS connection closes first (ztunnel stops reading on drain): the agent
    // sends new pods to the proxy that replaces this one.
    let res = tokio::select! {
        _ = shutdown => Ok(()),
        _ = quitting(&mut quit) => Ok(()),
        r = zds::client::run(zds_socket, proxy.link, std::future::pending(), move |up| connection.set_ready(up)) => {
            r.context("ZDS connection to the node agent")
        }
    };
    let not_ready = ready.register(DRAINING_TASK);
    tracing::info!("shutting down: draining");
    let draining = proxy.manager.start_drain(cfg.termination_deadline);
    let _ = stop_tx.send(true);
    let report = draining.finish().await;
    tracing::info!(?report, "shut down");
    let _ = admin_stop.send(true);
    drop(not_ready);
    res
}

/// Kubernetes mode when configured, else the workload source's policy.
fn enrollment_source(
    kube: Option<KubeMode>,
    state: &StateHandle,
    node_name: Option<String>,
) -> EnrollmentSource {
    match kube {
        Some(mode) => EnrollmentSource::Kubernetes(mode),
        None => EnrollmentSource::Policy(workload_policy(state.clone(), node_name)),
    }
}

/// Standalone enrollment: a pod is in the mesh when the workload source (local config or xDS)
/// has an HBONE workload with its namespace and name, on this node when both name one, with
/// that workload's service account.
fn workload_policy(state: StateHandle, node_name: Option<String>) -> Arc<dyn EnrollmentPolicy> {
    Arc::new(move |ns: &str, name: &str| {
        state
            .load()
            .workload_by_name(ns, name)
            .filter(|w| w.protocol == Protocol::Hbone)
            .filter(|w| match &node_name {
                Some(n) if !w.node.is_empty() => &w.node == n,
                _ => true,
            })
            .map(|w| WorkloadInfo {
                name: w.name.clone(),
                namespace: w.namespace.clone(),
                service_account: w.service_account.clone(),
            })
    })
}

/// The workload state of `source`, kept fresh until `stop`: the local config re-read when it
/// changes, or the xDS client (whose readiness tasks wait for the first response of each type,
/// and whose metrics go into `registry`).
fn start_state(
    source: WorkloadSource,
    ready: &Readiness,
    stop: &watch::Receiver<bool>,
    registry: &mut Registry,
) -> anyhow::Result<StateHandle> {
    match source {
        WorkloadSource::LocalConfig(path) => load_state(&path, ready),
        WorkloadSource::Empty => Ok(StateHandle::new(state::ProxyState::default())),
        WorkloadSource::Xds(cfg) => {
            let state = StateHandle::new(state::ProxyState::default());
            cfg.metrics
                .register(registry.sub_registry_with_prefix("istio"));
            tracing::info!(address = %cfg.endpoint.address, node = %cfg.node.id, "workloads from istiod (delta xDS)");
            tokio::spawn(xds::run(*cfg, state.clone(), ready, stopped(stop.clone())));
            Ok(state)
        }
    }
}

/// Loads the local config and keeps it fresh.
fn load_state(config: &Path, ready: &Readiness) -> anyhow::Result<StateHandle> {
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

/// Resolves [`QUIT_ANSWER_GRACE`] after `quit` turned true (never if its sender is gone).
async fn quitting(quit: &mut watch::Receiver<bool>) {
    match quit.wait_for(|q| *q).await {
        Ok(_) => tokio::time::sleep(QUIT_ANSWER_GRACE).await,
        Err(_) => std::future::pending().await,
    }
}

/// Serves the admin, readiness and metrics endpoints (of the proxy's workload state, and of the
/// metrics in `registry` with the proxy's and the agent's added) until `stop`; returns the
/// receiver that turns true on `POST /quitquitquit`.
async fn serve_admin(
    cfg: &ProxyConfig,
    proxies: Arc<ProxyManager>,
    pods: Option<Arc<std::sync::OnceLock<Arc<PodManager>>>>,
    ready: Readiness,
    mut registry: Registry,
    config: admin::dump::RunConfig,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<watch::Receiver<bool>> {
    proxies.ctx().metrics.register(&mut registry);
    crate::metrics::register_build(&mut registry, env!("CARGO_PKG_VERSION"));
    let (quit, quit_rx) = watch::channel(false);
    let admin = admin::Admin {
        state: proxies.ctx().state.clone(),
        proxies,
        pods,
        ready,
        metrics: Arc::new(Exposition::new(registry)),
        config: Arc::new(config),
        quit,
    };
    admin::spawn(
        admin,
        [cfg.admin_addr, cfg.readiness_addr, cfg.metrics_addr],
        cfg.port_reuse,
        stop,
    )
    .await?;
    Ok(quit_rx)
}

/// The settings a process runs with, as `/config_dump` shows them (`config`).
fn run_config(
    role: &'static str,
    source: &WorkloadSource,
    proxy: &ProxyConfig,
    agent: Option<&AgentConfig>,
    node_name: Option<String>,
) -> admin::dump::RunConfig {
    let (xds_address, local_xds_config) = match source {
        WorkloadSource::Xds(x) => (Some(x.endpoint.address.to_string()), None),
        WorkloadSource::LocalConfig(p) => (None, Some(p.clone())),
        WorkloadSource::Empty => (None, None),
    };
    let ca_address = match &proxy.cert_source {
        proxy::CertSource::Istio { endpoint, .. } => Some(endpoint.address.to_string()),
        proxy::CertSource::BuiltIn { .. } => None,
    };
    admin::dump::RunConfig {
        role,
        admin_addr: proxy.admin_addr.to_string(),
        stats_addr: proxy.metrics_addr.to_string(),
        readiness_addr: proxy.readiness_addr.to_string(),
        xds_address,
        ca_address,
        local_xds_config,
        secret_ttl_secs: proxy.cert_lifetime.as_secs(),
        packet_mark: proxy.packet_mark.get(),
        dns_proxy: proxy.dns.enabled,
        local_node: node_name,
        proxy_mode: "Shared",
        run_dir: agent.map(|a| a.run_dir.clone()),
        cni_conf_dir: agent.and_then(|a| a.install.as_ref().map(|i| i.cni_conf_dir.clone())),
        ipv6: agent.map(|a| a.redirect.ipv6),
        dns_capture: agent.map(|a| a.redirect.dns_capture),
    }
}

/// The start-up line: the settings as fields, one each.
fn log_start(message: &'static str, c: &admin::dump::RunConfig, kubernetes: bool) {
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        git = env!("ZTNODE_GIT_SHA"),
        kubernetes,
        xds_address = c.xds_address.as_deref(),
        ca_address = c.ca_address.as_deref().unwrap_or("built-in"),
        local_xds_config = path(&c.local_xds_config),
        local_node = c.local_node.as_deref(),
        run_dir = path(&c.run_dir),
        cni_conf_dir = path(&c.cni_conf_dir),
        ipv6 = c.ipv6,
        dns_capture = c.dns_capture,
        dns_proxy = c.dns_proxy,
        packet_mark = c.packet_mark,
        secret_ttl_secs = c.secret_ttl_secs,
        admin_addr = %c.admin_addr,
        readiness_addr = %c.readiness_addr,
        stats_addr = %c.stats_addr,
        "{message}"
    );
}
