//! `ztnode node`: the agent and the proxy in one process (the DaemonSet entrypoint in standalone mode).
//!
//! Wiring, in a pod's order: local config → workload state; built-in CA → certificates; proxy manager
//! behind the in-process ZDS channel; pod manager (enrollment = HBONE workload of that namespace/name
//! in the local config) behind the plugin socket; self-install onto the host CNI dirs with repair;
//! admin (`127.0.0.1:15000/config_dump`), readiness (`:15021/healthz/ready`) and metrics
//! (`:15020/metrics`) endpoints. Ends cleanly when `shutdown` resolves (SIGTERM/SIGINT in `main`).

pub mod admin;
pub mod ready;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::agent::enroll::EnrollmentPolicy;
use crate::agent::install::{self, InstallConfig};
use crate::agent::pods::PodManager;
use crate::agent::redirect::RedirectPlan;
use crate::agent::server;
use crate::podevent::plugin_socket_path;
use crate::proxy::accesslog::Metrics;
use crate::proxy::identity::{Ca, CertManager};
use crate::proxy::pods::{ProxyContext, ProxyManager};
use crate::proxy::state::{self, Protocol, StateHandle};
use crate::zds::{self, WorkloadInfo};

/// Settings of `ztnode node`.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Local config file (ztunnel LOCAL_XDS_PATH format).
    pub config: PathBuf,
    /// Agent run dir (plugin socket, CA when `ca_dir` is unset).
    pub run_dir: PathBuf,
    /// Host CNI bin dir.
    pub cni_bin_dir: PathBuf,
    /// Host CNI conf dir.
    pub cni_conf_dir: PathBuf,
    /// Whether to install the plugin onto the host dirs.
    pub install: bool,
    /// CA dir (root-cert.pem, ca-key.pem); default `<run_dir>/ca`.
    pub ca_dir: Option<PathBuf>,
    /// Workload certificate lifetime.
    pub cert_lifetime: Duration,
    /// SO_MARK of proxy sockets.
    pub packet_mark: u32,
    /// Redirection options.
    pub redirect: RedirectPlan,
    /// Admin listener (`/config_dump`).
    pub admin_addr: SocketAddr,
    /// Readiness listener (`/healthz/ready`).
    pub readiness_addr: SocketAddr,
    /// Metrics listener (`/metrics`).
    pub metrics_addr: SocketAddr,
}

/// Runs the node until `shutdown` resolves.
pub async fn run(
    cfg: NodeConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tracing::info!(?cfg, "starting ztnode node");
    let ready = ready::Readiness::new();
    let (config_ready, socket_ready) = (
        ready.register("local config"),
        ready.register("plugin socket"),
    );
    let state = StateHandle::new(state::load_config_file(&cfg.config).context("local config")?);
    config_ready.done();
    tokio::spawn(state::watch_config_file(
        cfg.config.clone(),
        state.clone(),
        Duration::from_secs(1),
    ));

    let ca_dir = cfg.ca_dir.clone().unwrap_or_else(|| cfg.run_dir.join("ca"));
    let ca = Ca::load_or_generate(Some(&ca_dir)).context("built-in CA")?;
    let certs = CertManager::new(ca, cfg.cert_lifetime);
    tracing::info!(dir = %ca_dir.display(), "built-in CA ready (root-cert.pem)");

    let ctx = Arc::new(ProxyContext {
        state: state.clone(),
        certs,
        metrics: Metrics::default(),
        mark: cfg.packet_mark,
    });
    let proxies = ProxyManager::new(ctx);
    let (zds_client, zds_rx) = zds::channel();
    tokio::spawn(proxies.clone().run(zds_rx));

    let policy_state = state.clone();
    let policy: Arc<dyn EnrollmentPolicy> = Arc::new(move |ns: &str, name: &str| {
        policy_state
            .load()
            .workload_by_name(ns, name)
            .filter(|w| w.protocol == Protocol::Hbone)
            .map(|w| WorkloadInfo {
                name: w.name.clone(),
                namespace: w.namespace.clone(),
                service_account: w.service_account.clone(),
            })
    });
    let pods = Arc::new(PodManager::new(policy, zds_client, cfg.redirect.clone()));
    pods.restore(&cfg.run_dir)
        .await
        .context("restore enrolled pods")?;

    let sock_path = plugin_socket_path(&cfg.run_dir);
    let listener = server::bind(&sock_path)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let server_task = tokio::spawn(server::serve(
        listener,
        pods.clone(),
        stopped(stop_rx.clone()),
    ));
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
        let installed = move || install::is_installed(&probe);
        tokio::spawn(ready::track(
            ready.register("cni plugin install"),
            installed,
            stopped(stop_rx.clone()),
        ));
        tokio::spawn(install::watch_and_repair(icfg, stopped(stop_rx.clone())));
    }

    let admin = admin::Admin {
        state,
        proxies: proxies.clone(),
        pods: pods.clone(),
        ready,
    };
    admin::spawn(
        admin,
        cfg.admin_addr,
        cfg.readiness_addr,
        cfg.metrics_addr,
        stop_rx.clone(),
    )
    .await?;

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    let _ = server_task.await;
    proxies.stop_all();
    let _ = std::fs::remove_file(&sock_path);
    Ok(())
}
