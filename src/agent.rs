//! The node agent role: self-install onto the host ([`install`]), the plugin event server
//! ([`server`]), enrollment decisions ([`enroll`]), finding a pod's netns from procfs
//! ([`netns_finder`]), in-pod redirection ([`redirect`]), the pod lifecycle that ties them together
//! ([`pods`]) and the link that hands each enrolled pod's netns to the proxy ([`proxy_link`]).
//! [`coexist`] refuses to start beside Istio's own istio-cni or ztunnel.
//!
//! [`start`] is the role's front door: it takes the enrollment policy, the link to the proxy and
//! a shutdown future, and leaves the rest (which policy, which transport) to the caller.

pub mod coexist;
pub mod enroll;
pub mod install;
pub mod kube;
pub mod metrics;
pub mod netns_finder;
pub mod pods;
pub mod proxy_link;
pub mod redirect;
pub mod server;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::podevent::plugin_socket_path;
use crate::ready::{self, Readiness};
use crate::runtime::stopped;
use enroll::EnrollmentPolicy;
use enroll::EnrollmentRules;
use install::InstallConfig;
use kube::policy::KubePolicy;
use kube::reconcile::Reconciler;
use kube::watch::Watches;
use kube::{KubeError, KubeSettings};
use pods::{PodError, PodManager};
use proxy_link::WorkloadSink;
use redirect::RedirectPlan;

/// Readiness task of the plugin event socket.
pub const PLUGIN_SOCKET_TASK: &str = "plugin socket";
/// Readiness task of the CNI plugin install (pending while the plugin or its entry is missing).
pub const INSTALL_TASK: &str = "cni plugin install";
/// Readiness task of Kubernetes mode: pending until the first reconcile of the node's pods is done.
pub const KUBE_RECONCILE_TASK: &str = "kubernetes reconcile";

/// Where enrollment decisions come from.
pub enum EnrollmentSource {
    /// A fixed policy for the plugin's events (standalone mode: the local config).
    Policy(Arc<dyn EnrollmentPolicy>),
    /// Kubernetes mode: Istio's rules over the API's pods and namespaces, with a reconciler that
    /// follows label changes.
    Kubernetes(KubeMode),
}

/// The settings of Kubernetes mode.
#[derive(Debug, Clone)]
pub struct KubeMode {
    /// API access and node name.
    pub settings: KubeSettings,
    /// The enrollment rules (the plugin's are the same).
    pub rules: EnrollmentRules,
    /// Where the host's procfs is (`/proc`, or `/host/proc` in a container): running pods' netns
    /// are found there, and the kubelet.
    pub proc_root: PathBuf,
    /// The kubelet's UID, whose probes to enrolled pods are SNATed (`None`: found in
    /// `proc_root`).
    pub kubelet_uid: Option<u32>,
    /// The agent's own DaemonSet, looked up on shutdown: gone (or being deleted) means a real
    /// uninstall, so the plugin, its config entry and kubeconfig and the host rules are removed;
    /// there means an upgrade or a reboot, so they stay (new pods fail closed until the next
    /// agent is up). Default `(POD_NAMESPACE, "ztnode")`.
    pub daemonset: (String, String),
    /// Look the DaemonSet up on shutdown (default); `false` ([`ENV_DISABLE_SAFE_UPGRADE`]`=true`)
    /// uninstalls on every shutdown.
    pub safe_upgrade: bool,
}

/// Host probe rule attempts at start and the pause between them (istio-cni: 10 × 2 s, then the
/// agent does not start).
const HOST_PROBE_ATTEMPTS: u32 = 10;
const HOST_PROBE_RETRY: std::time::Duration = std::time::Duration::from_secs(2);
/// How often the host probe rules are checked and repaired.
const HOST_PROBE_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// Settings of the node agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Agent run dir (plugin socket `pluginevent.sock`, enrolled-pod state).
    pub run_dir: PathBuf,
    /// Install the plugin onto the host CNI dirs (and keep it there) with these settings; `None`
    /// leaves the host alone.
    pub install: Option<InstallConfig>,
    /// Redirection programmed in each enrolled pod.
    pub redirect: RedirectPlan,
    /// The agent's metrics (shared: register a clone to serve them before the agent starts).
    pub metrics: metrics::AgentMetrics,
}

/// Errors starting the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The pods enrolled before a restart could not be restored.
    #[error("restore enrolled pods: {0}")]
    Restore(#[source] PodError),
    /// The plugin event socket could not be bound.
    #[error(transparent)]
    Socket(#[from] server::ServerError),
    /// Kubernetes mode could not start.
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// The agent's own netns (the host's) could not be read.
    #[error("own netns: {0}")]
    Netns(#[from] crate::netns::NetnsError),
    /// The kubelet was not found (its UID selects the probes to SNAT).
    #[error(transparent)]
    Kubelet(#[from] redirect::host::KubeletUidError),
    /// The host probe rules could not be installed.
    #[error(transparent)]
    HostProbe(#[from] redirect::host::HostProbeError),
}

/// A started agent (see [`start`]).
pub struct Agent {
    /// The pod table.
    pub pods: Arc<PodManager>,
    server_task: JoinHandle<()>,
    sock_file: crate::runtime::socket_file::SocketFile,
    /// The installer's repair loop: joined before the uninstall check, so that a repair in
    /// progress cannot put the entry back after the uninstall removed it.
    install_task: Option<JoinHandle<Result<(), install::InstallError>>>,
    uninstall: Option<UninstallCheck>,
}

/// What [`Agent::join`] needs to tell an uninstall from an upgrade in Kubernetes mode, and to
/// clean up after a real uninstall (`../shared/spec/istio-cni.md` §2.6, §3.10).
struct UninstallCheck {
    client: ::kube::Client,
    /// The agent's own DaemonSet: `(namespace, name)`.
    daemonset: (String, String),
    /// This node (`NODE_NAME`): the DaemonSet must still select it.
    node_name: String,
    install: Option<install::InstallConfig>,
    probe: Arc<redirect::host::HostProbe>,
    /// `false`: every shutdown uninstalls ([`ENV_DISABLE_SAFE_UPGRADE`]).
    safe_upgrade: bool,
}

/// Starts the agent: the pod manager handing pods to `proxy` after `source` enrolled them (pods
/// enrolled before a restart get their rules and proxy back first), the plugin event socket in
/// `cfg.run_dir`, with `cfg.install` the installer and its repair loop, and in Kubernetes mode the
/// watches and the reconciler. Registers [`PLUGIN_SOCKET_TASK`] (and [`INSTALL_TASK`],
/// [`KUBE_RECONCILE_TASK`]) in `ready`. Every task ends when `shutdown` resolves; [`Agent::join`]
/// waits for that.
pub async fn start(
    cfg: AgentConfig,
    source: EnrollmentSource,
    proxy: WorkloadSink,
    ready: &Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Agent, AgentError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let socket_ready = ready.register(PLUGIN_SOCKET_TASK);
    let mut daemonset = (String::new(), String::new());
    let mut node_name = String::new();
    let mut safe_upgrade = true;
    let (policy, kube_mode): (Arc<dyn EnrollmentPolicy>, _) = match source {
        EnrollmentSource::Policy(p) => (p, None),
        EnrollmentSource::Kubernetes(mode) => {
            daemonset = mode.daemonset.clone();
            safe_upgrade = mode.safe_upgrade;
            node_name = mode.settings.node_name.clone();
            let client = kube::client(&mode.settings.access).await?;
            let (changes_tx, changes_rx) = tokio::sync::mpsc::unbounded_channel();
            let watches = Watches::start(client.clone(), &mode.settings.node_name, changes_tx);
            let rules = Arc::new(mode.rules);
            let policy = KubePolicy::new(watches.clone(), client.clone(), rules.clone());
            tracing::info!(node = %mode.settings.node_name, "Kubernetes mode: watching the node's pods and all namespaces");
            let uid = redirect::host::resolve_kubelet_uid(mode.kubelet_uid, &mode.proc_root)?;
            let probe = Arc::new(redirect::host::HostProbe {
                ipv6: cfg.redirect.ipv6,
                probe_v4: cfg.redirect.probe_v4,
                probe_v6: cfg.redirect.probe_v6,
                ..redirect::host::HostProbe::new(uid)
            });
            install_host_probe(&probe).await?;
            (
                Arc::new(policy),
                Some((client, watches, rules, changes_rx, mode.proc_root, probe)),
            )
        }
    };
    let pods = Arc::new(
        PodManager::new(policy, proxy, cfg.redirect.clone()).with_metrics(cfg.metrics.clone()),
    );
    // The socket is bound before the table is read, so that a plugin event from here on waits
    // in its backlog for this agent (served after the restore) instead of reaching an older
    // agent that is about to stop.
    let sock_path = plugin_socket_path(&cfg.run_dir);
    let listener = server::bind(&sock_path)?;
    let sock_file = crate::runtime::socket_file::SocketFile::claim(&sock_path);
    pods.set_owner(sock_file.clone());
    pods.restore(&cfg.run_dir)
        .await
        .map_err(AgentError::Restore)?;
    let mut uninstall = None;
    if kube_mode.is_none() {
        tokio::spawn(retry_pending(pods.clone(), stopped(stop_rx.clone())));
    }
    if let Some((client, watches, rules, changes, proc_root, probe)) = kube_mode {
        uninstall = Some(UninstallCheck {
            client: client.clone(),
            daemonset: daemonset.clone(),
            node_name,
            install: cfg.install.clone(),
            probe: probe.clone(),
            safe_upgrade,
        });
        pods.set_host_probe(probe.clone());
        pods.sync_host_probe().await?;
        tokio::spawn(repair_host_probe(
            probe,
            pods.clone(),
            stopped(stop_rx.clone()),
        ));
        let (local_tx, local_rx) = tokio::sync::mpsc::unbounded_channel();
        pods.set_change_hook(local_tx);
        let reconciler = Reconciler::new(pods.clone(), watches, client, rules, proc_root)?;
        tokio::spawn(reconciler.run(
            changes,
            local_rx,
            ready.register(KUBE_RECONCILE_TASK),
            stopped(stop_rx.clone()),
        ));
    }
    let server_task = tokio::spawn(server::serve(
        listener,
        pods.clone(),
        stopped(stop_rx.clone()),
    ));
    tracing::info!(socket = %sock_path.display(), "plugin event socket ready");
    socket_ready.done();

    let mut install_task = None;
    if let Some(icfg) = cfg.install {
        match install::install(&icfg) {
            Ok(outcome) => tracing::info!(?outcome, "CNI plugin installed"),
            Err(e) => tracing::warn!(error = %e, "CNI install not done yet; the watcher retries"),
        }
        let probe = icfg.clone();
        tokio::spawn(ready::track(
            ready.register(INSTALL_TASK),
            move || install::is_installed(&probe),
            stopped(stop_rx.clone()),
        ));
        install_task = Some(tokio::spawn(install::watch_and_repair(
            icfg,
            stopped(stop_rx),
        )));
    }
    Ok(Agent {
        pods,
        server_task,
        sock_file,
        install_task,
        uninstall,
    })
}

/// How often standalone mode retries the pods whose proxy start failed.
pub const PENDING_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// Standalone mode: every [`PENDING_RETRY`], hands the pods whose proxy start failed (restored
/// after a restart while the CA refused their certificate, or their workload was not in the
/// source yet) to the proxy again, until it takes them, as ztunnel retries its pending workloads;
/// their rules stay in meanwhile (fail closed). The reconciler does this in Kubernetes mode.
async fn retry_pending(pods: Arc<PodManager>, shutdown: impl Future<Output = ()>) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(PENDING_RETRY) => {}
        }
        for pod in pods.enrolled().into_iter().filter(|p| p.pending) {
            let name = format!("{}/{}", pod.info.namespace, pod.info.name);
            match pods.retry_proxy(&pod.uid).await {
                Ok(()) => {
                    tracing::info!(pod = %name, uid = %pod.uid, "pending pod handed to the proxy")
                }
                Err(e) => {
                    tracing::debug!(pod = %name, uid = %pod.uid, error = %e, "pending pod still refused by the proxy")
                }
            }
        }
    }
}

/// Installs the host probe rules in the agent's (host) netns, retrying as istio-cni does.
async fn install_host_probe(probe: &Arc<redirect::host::HostProbe>) -> Result<(), AgentError> {
    let mut attempt = 1;
    loop {
        let p = probe.clone();
        let res = tokio::task::spawn_blocking(move || p.apply())
            .await
            .unwrap_or(Err(redirect::host::HostProbeError::Task));
        match res {
            Ok(()) => {
                tracing::info!(
                    kubelet_uid = probe.kubelet_uid,
                    "host probe SNAT rules installed"
                );
                return Ok(());
            }
            Err(e) if attempt >= HOST_PROBE_ATTEMPTS => return Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, attempt, "host probe rules failed; retrying");
                attempt += 1;
                tokio::time::sleep(HOST_PROBE_RETRY).await;
            }
        }
    }
}

/// Puts the host probe rules and sets back when someone flushed or deleted them.
async fn repair_host_probe(
    probe: Arc<redirect::host::HostProbe>,
    pods: Arc<PodManager>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(HOST_PROBE_RECHECK) => {}
        }
        let p = probe.clone();
        let applied = tokio::task::spawn_blocking(move || p.is_applied()).await;
        if matches!(applied, Ok(Ok(true))) {
            continue;
        }
        tracing::warn!("host probe rules are missing or changed; repairing");
        let p = probe.clone();
        let res = match tokio::task::spawn_blocking(move || p.apply()).await {
            Ok(Ok(())) => pods.sync_host_probe().await,
            Ok(Err(e)) => Err(e),
            Err(_) => Err(redirect::host::HostProbeError::Task),
        };
        if let Err(e) = res {
            tracing::warn!(error = %e, "repairing the host probe rules failed");
        }
    }
}

impl Agent {
    /// Waits for the plugin server and the installer's repair loop to stop (after the shutdown
    /// future resolved), removes the plugin socket unless a newer agent has bound the path
    /// meanwhile (an upgrade: then the plugin's events already go there), then in Kubernetes mode
    /// tells an uninstall from an upgrade and cleans up after an uninstall.
    pub async fn join(self) {
        let _ = self.server_task.await;
        self.sock_file.remove();
        if let Some(task) = self.install_task {
            match task.await {
                Ok(Err(e)) => tracing::warn!(error = %e, "the CNI install watcher had stopped"),
                Err(_) => tracing::warn!("the CNI install watcher failed (task)"),
                Ok(Ok(())) => {}
            }
        }
        if let Some(check) = self.uninstall {
            check.run().await;
        }
    }
}

impl UninstallCheck {
    /// After the agent stopped: removes what it installed on the host on a real uninstall (see
    /// [`ShutdownLookup::is_uninstall`]; always when safe upgrade is off), keeps everything on an
    /// upgrade or reboot. In-pod rules are never removed here.
    async fn run(self) {
        let (ns, name) = &self.daemonset;
        let ds = format!("{ns}/{name}");
        if self.safe_upgrade {
            let lookup = self.lookup().await;
            if let ShutdownLookup::Failed(e) = &lookup {
                tracing::warn!(daemonset = %ds, error = %e, "cannot tell an uninstall from an upgrade; keeping the plugin and host rules");
            }
            if !lookup.is_uninstall() {
                tracing::info!(daemonset = %ds, ?lookup, "upgrade or reboot: the plugin and host rules stay");
                return;
            }
            tracing::info!(daemonset = %ds, ?lookup, "uninstall: removing the plugin and the host rules");
        } else {
            tracing::info!(
                "{ENV_DISABLE_SAFE_UPGRADE}=true: removing the plugin and the host rules"
            );
        }
        if let Some(icfg) = self.install {
            let res = tokio::task::spawn_blocking(move || install::uninstall(&icfg)).await;
            if let Ok(Err(e)) = res {
                tracing::warn!(error = %e, "removing the CNI plugin failed");
            }
        }
        let probe = self.probe;
        match tokio::task::spawn_blocking(move || probe.remove()).await {
            Ok(Ok(())) => tracing::info!("host probe rules removed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "removing the host probe rules failed"),
            Err(_) => tracing::warn!("removing the host probe rules failed (worker task)"),
        }
    }

    /// GETs the agent's DaemonSet (bounded by [`UNINSTALL_CHECK_TIMEOUT`]).
    async fn lookup(&self) -> ShutdownLookup {
        let (ns, name) = &self.daemonset;
        let api: ::kube::Api<k8s_openapi::api::apps::v1::DaemonSet> =
            ::kube::Api::namespaced(self.client.clone(), ns);
        match tokio::time::timeout(UNINSTALL_CHECK_TIMEOUT, api.get_opt(name)).await {
            Err(_) => ShutdownLookup::Failed("the API server did not answer".into()),
            Ok(Ok(None)) => ShutdownLookup::Gone,
            Ok(Ok(Some(ds))) if ds.metadata.deletion_timestamp.is_some() => {
                ShutdownLookup::Deleting
            }
            Ok(Ok(Some(ds))) if kube::placement::constrains_nodes(&ds) => self.placement(&ds).await,
            Ok(Ok(Some(_))) => ShutdownLookup::Present,
            // istio-cni counts only Unauthorized: a 403 (a grant trimmed, the agent's own
            // identity still valid) is no sign the DaemonSet went away
            Ok(Err(::kube::Error::Api(s))) if s.code == 401 => ShutdownLookup::Unauthorized,
            Ok(Err(e)) => ShutdownLookup::Failed(e.to_string()),
        }
    }

    /// The DaemonSet is there and constrains its nodes: does it still select this one? A node
    /// that cannot be read counts as selected (keep everything).
    async fn placement(&self, ds: &k8s_openapi::api::apps::v1::DaemonSet) -> ShutdownLookup {
        let api: ::kube::Api<k8s_openapi::api::core::v1::Node> =
            ::kube::Api::all(self.client.clone());
        match tokio::time::timeout(UNINSTALL_CHECK_TIMEOUT, api.get(&self.node_name)).await {
            Ok(Ok(node)) if !kube::placement::selects(ds, &node) => ShutdownLookup::NotThisNode,
            Ok(Ok(_)) => ShutdownLookup::Present,
            Ok(Err(e)) => {
                tracing::warn!(node = %self.node_name, error = %e, "cannot read this node to match the DaemonSet's node selection; taking it as selected");
                ShutdownLookup::Present
            }
            Err(_) => {
                tracing::warn!(node = %self.node_name, "reading this node timed out; taking it as selected by the DaemonSet");
                ShutdownLookup::Present
            }
        }
    }
}

/// Env of istio-cni: `true` makes every shutdown an uninstall (no DaemonSet lookup).
pub const ENV_DISABLE_SAFE_UPGRADE: &str = "AMBIENT_DISABLE_SAFE_UPGRADE";

/// What the shutdown's lookup of the agent's own DaemonSet found (istio-cni's
/// `ShouldStopCleanup`, `../shared/spec/istio-cni.md` §3.10).
#[derive(Debug, Clone, PartialEq, Eq)]
enum ShutdownLookup {
    /// There and not being deleted: an upgrade, or the node reboots.
    Present,
    /// Being deleted (`deletionTimestamp` set).
    Deleting,
    /// There, but its `nodeSelector` or required node affinity no longer selects this node: its
    /// pod leaves this node for good.
    NotThisNode,
    /// Not found.
    Gone,
    /// 401: the agent's token is no longer accepted, as `kubectl delete` of the manifests
    /// removes its ServiceAccount with the DaemonSet (istio-cni: Unauthorized).
    Unauthorized,
    /// Anything else (unreachable, timeout, 5xx, 403).
    Failed(String),
}

impl ShutdownLookup {
    /// Whether this is a real uninstall: gone, being deleted, no longer selecting this node, or
    /// the token refused (401). A failed lookup (403 included)
    /// says no: everything stays and new pods fail closed (istio-cni, outside its istio-owned
    /// config mode, cleans up after a failed lookup instead; ztnode prefers closed over open).
    fn is_uninstall(&self) -> bool {
        matches!(
            self,
            ShutdownLookup::Gone
                | ShutdownLookup::Deleting
                | ShutdownLookup::NotThisNode
                | ShutdownLookup::Unauthorized
        )
    }
}

/// How long the shutdown's DaemonSet lookup may take.
const UNINSTALL_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_deleted_deselected_or_unauthorized_means_uninstall() {
        assert!(ShutdownLookup::Gone.is_uninstall());
        assert!(ShutdownLookup::Deleting.is_uninstall());
        assert!(ShutdownLookup::NotThisNode.is_uninstall());
        assert!(ShutdownLookup::Unauthorized.is_uninstall());
        assert!(!ShutdownLookup::Present.is_uninstall());
        assert!(!ShutdownLookup::Failed("unreachable".into()).is_uninstall());
    }
}
