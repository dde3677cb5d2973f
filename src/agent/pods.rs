//! The pod lifecycle on the node: enroll (open netns → redirect → hand to the proxy) and remove.
//!
//! Order follows istio-cni (`../shared/spec/istio-cni.md` §3.5, §3.7): rules first, then the proxy.
//! If the proxy refuses or is absent, the rules stay and the ADD fails, so the pod's traffic is
//! redirected to a port nobody serves (fail closed) until the runtime retries; the pod stays in the
//! table as `pending` (Istio's partial add), so its DEL still removes the rules and tells the proxy
//! side to forget it. Every step is idempotent: the same ADD twice is harmless, DEL of an unknown pod
//! succeeds.
//!
//! Restart safety (spec §3.2, §5 "Agent restart"): once [`PodManager::restore`] attached the
//! manager to its run dir, the table is persisted to `<run_dir>/pods.json` on every change
//! ([`store`]); at the next start `restore` re-applies the rules of every pod whose netns still
//! exists and re-sends it to the proxy, the way istio-cni replays its snapshot over ZDS.

mod rules;
pub mod store;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::mpsc;

use serde::Serialize;

use crate::agent::enroll::{Enrollment, EnrollmentPolicy, PodOptions, PolicyError};
use crate::agent::metrics::AgentMetrics;
use crate::agent::proxy_link::WorkloadSink;
use crate::agent::redirect::host::HostProbe;
use crate::agent::redirect::{self, RedirectPlan};
use crate::netns::{Netns, NetnsError};
use crate::podevent::{PodAddEvent, PodDelEvent};
use crate::runtime::socket_file::SocketFile;
use crate::zds::{WorkloadInfo, WorkloadRequest, ZdsError};

pub use rules::{NftRules, RuleApplier};
pub use store::{Damage, PodRecord, Recovered, STATE_FILE, Store, StoreError};

/// Errors of the pod lifecycle (the plugin gets them as HTTP 500 text).
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// The event lacks the netns path.
    #[error("pod {0}: event has no netns")]
    NoNetns(String),
    /// The pod's netns could not be opened.
    #[error("pod {pod}: {source}")]
    Netns {
        /// `namespace/name`.
        pod: String,
        /// Cause.
        #[source]
        source: NetnsError,
    },
    /// Programming or removing the redirection failed.
    #[error("pod {pod}: redirection: {source}")]
    Redirect {
        /// `namespace/name`.
        pod: String,
        /// Cause.
        #[source]
        source: redirect::RedirectError,
    },
    /// The proxy did not take the pod.
    #[error("pod {pod}: proxy: {source}")]
    Proxy {
        /// `namespace/name`.
        pod: String,
        /// Cause.
        #[source]
        source: ZdsError,
    },
    /// A blocking task died.
    #[error("pod {0}: worker task failed")]
    Task(String),
    /// The persisted pod table could not be read or attached.
    #[error("pod table: {0}")]
    Store(#[from] StoreError),
    /// The pod table could not be written (disk full on the run dir): the ADD is not done.
    #[error("pod {pod}: cannot record the pod in the pod table: {source}")]
    Persist {
        /// `namespace/name`.
        pod: String,
        /// Cause.
        #[source]
        source: StoreError,
    },
    /// The enrollment policy could not decide (e.g. the API server does not know the pod yet).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The pod is not in the table.
    #[error("pod {0} is not enrolled")]
    NotEnrolled(String),
}

/// Result of an ADD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddOutcome {
    /// Rules in place and the proxy serves the pod.
    Enrolled,
    /// The pod is not in the mesh; nothing was done.
    NotInMesh,
}

/// An enrolled pod, as shown in `/config_dump`.
#[derive(Debug, Clone, Serialize)]
pub struct EnrolledPod {
    /// Pod UID (ZDS uid).
    pub uid: String,
    /// Name, namespace and service account (flattened into the pod's JSON).
    #[serde(flatten)]
    pub info: WorkloadInfo,
    /// Redirection options of the pod's rules.
    pub options: PodOptions,
    /// netns path given by the runtime.
    pub netns: String,
    /// Sandbox id.
    pub container_id: String,
    /// Pod IPs from the plugin.
    pub ips: Vec<IpAddr>,
    /// Rules are in place but the proxy has not taken the pod (its Add failed).
    pub pending: bool,
    #[serde(skip)]
    handle: Netns,
}

impl EnrolledPod {
    /// The pod as stored in `pods.json`.
    pub fn record(&self) -> PodRecord {
        PodRecord {
            uid: self.uid.clone(),
            info: self.info.clone(),
            options: self.options.clone(),
            netns: self.netns.clone(),
            container_id: self.container_id.clone(),
            ips: self.ips.clone(),
            netns_id: Some(self.handle.id().into()),
        }
    }
}

/// What [`PodManager::restore`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Pods whose rules were re-applied and whose proxy was re-added.
    pub restored: usize,
    /// Pods dropped because their netns is gone (or its path now names another namespace).
    pub dropped: usize,
    /// Pods kept in the table although re-applying their rules or re-adding them to the proxy
    /// failed (a later ADD retries, a DEL cleans up).
    pub failed: usize,
}

impl RestoreReport {
    fn count(&mut self, r: Restored) {
        match r {
            Restored::Yes => self.restored += 1,
            Restored::Dropped => self.dropped += 1,
            Restored::Failed => self.failed += 1,
        }
    }
}

/// Reads the table file on a blocking thread. Errors: the outer one when the task failed, the
/// inner one when the file could not be read or parsed.
async fn load(store: &Arc<Store>) -> Result<Result<Vec<PodRecord>, StoreError>, PodError> {
    let loader = store.clone();
    tokio::task::spawn_blocking(move || loader.load())
        .await
        .map_err(|_| PodError::Task(store.path().display().to_string()))
}

/// The pod table with the generation of its last change (orders the writes to disk).
#[derive(Default)]
struct Table {
    pods: HashMap<String, EnrolledPod>,
    generation: u64,
}

/// A table change to write: generation and content.
type Snapshot = (u64, Vec<PodRecord>);

/// The agent's pod table and the flows over it.
pub struct PodManager {
    policy: Arc<dyn EnrollmentPolicy>,
    zds: WorkloadSink,
    rules: Arc<dyn RuleApplier>,
    table: Mutex<Table>,
    store: OnceLock<Arc<Store>>,
    changes: OnceLock<mpsc::UnboundedSender<(String, String)>>,
    host_probe: OnceLock<Arc<HostProbe>>,
    /// The agent's metrics (plugin requests, reconcile events, pods enrolled and pending).
    pub metrics: AgentMetrics,
    /// The plugin socket this agent bound: once another agent took the path over (an upgrade)
    /// and wrote the table, the file is the new agent's and this one stops writing it.
    owner: OnceLock<SocketFile>,
    /// Set when a write was skipped because the socket was taken over (logged once).
    superseded: std::sync::atomic::AtomicBool,
}

/// A pod to enroll, found by the plugin's event or, in Kubernetes mode, by the reconciler.
#[derive(Debug, Clone)]
pub struct FoundPod {
    /// Pod UID (the ZDS uid).
    pub uid: String,
    /// What the policy decided.
    pub enrollment: Enrollment,
    /// The netns path (the runtime's, or `/proc/<pid>/ns/net` when found from procfs).
    pub netns_path: String,
    /// The opened netns.
    pub netns: Netns,
    /// Sandbox id, empty when unknown.
    pub container_id: String,
    /// The pod's IPs.
    pub ips: Vec<IpAddr>,
}

enum Restored {
    Yes,
    Dropped,
    Failed,
}

impl PodManager {
    /// A manager that enrolls by `policy`, redirects with `plan` and hands pods to the proxy via `zds`
    /// (the in-process channel or the ZDS socket server).
    /// This manager counting into `metrics` (a clone shares the counters).
    pub fn with_metrics(mut self, metrics: AgentMetrics) -> PodManager {
        self.metrics = metrics;
        self
    }

    pub fn new(
        policy: Arc<dyn EnrollmentPolicy>,
        zds: impl Into<WorkloadSink>,
        plan: RedirectPlan,
    ) -> PodManager {
        PodManager::with_rules(policy, zds, Arc::new(NftRules::new(plan)))
    }

    /// Like [`PodManager::new`] with the redirection done by `rules`.
    pub fn with_rules(
        policy: Arc<dyn EnrollmentPolicy>,
        zds: impl Into<WorkloadSink>,
        rules: Arc<dyn RuleApplier>,
    ) -> PodManager {
        PodManager {
            policy,
            zds: zds.into(),
            rules,
            table: Mutex::new(Table::default()),
            store: OnceLock::new(),
            changes: OnceLock::new(),
            host_probe: OnceLock::new(),
            metrics: AgentMetrics::default(),
            owner: OnceLock::new(),
            superseded: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Ties the table file to the plugin socket this agent bound (call before
    /// [`PodManager::restore`]): once another process bound the socket path and has written
    /// `pods.json` itself, this manager no longer writes it, so a draining old agent cannot
    /// overwrite the new agent's table (until the new agent writes, the old one's changes still
    /// go to the file, for the new agent's second read).
    pub fn set_owner(&self, socket: SocketFile) {
        let _ = self.owner.set(socket);
    }

    /// The enrolled pods, sorted by namespace/name.
    pub fn enrolled(&self) -> Vec<EnrolledPod> {
        let mut v: Vec<_> = self.table().pods.values().cloned().collect();
        v.sort_by(|a, b| (&a.info.namespace, &a.info.name).cmp(&(&b.info.namespace, &b.info.name)));
        v
    }

    /// Attaches the manager to `<run_dir>/pods.json` and brings back the pods a previous agent
    /// enrolled: for each record whose netns path still opens (and still names the same
    /// namespace) the rules are re-applied (idempotent) and the pod is re-added to the proxy, then
    /// `SnapshotSent` is sent; the others are dropped. The file is read a second time after that:
    /// an older agent still serving an event when this one took the plugin socket over may have
    /// added or removed a pod meanwhile, and this agent follows it. From then on every ADD and DEL
    /// rewrites the file. Call once at start, after binding the plugin socket (see
    /// [`PodManager::set_owner`]) and before serving it.
    ///
    /// Per-pod failures are logged and counted, not returned. An unreadable file is logged and
    /// treated as empty; a torn one gives its complete records ([`Store::recover`]). Errors: [`StoreError::AlreadyAttached`] on a second call.
    pub async fn restore(&self, run_dir: &Path) -> Result<RestoreReport, PodError> {
        let store = Arc::new(Store::new(run_dir));
        if let Err(other) = self.store.set(store.clone()) {
            return Err(StoreError::AlreadyAttached(other.path().to_owned()).into());
        }
        let recoverer = store.clone();
        let recovered = tokio::task::spawn_blocking(move || recoverer.recover())
            .await
            .map_err(|_| PodError::Task(store.path().display().to_string()))?;
        let records = match recovered {
            Ok(Recovered { pods, damage: None }) => pods,
            Ok(Recovered {
                pods,
                damage: Some(Damage { error, kept }),
            }) => {
                let kept = kept.map_or_else(|| "not kept".to_owned(), |k| k.display().to_string());
                tracing::error!(
                    %error,
                    recovered = pods.len(),
                    kept,
                    "the pod table is torn: the complete records are restored; a pod lost with the \
                     rest keeps its rules (its traffic fails closed) until its ADD is repeated or, \
                     in Kubernetes mode, the reconciler finds it"
                );
                pods
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot read the pod table, starting empty");
                Vec::new()
            }
        };
        let first: HashSet<String> = records.iter().map(|r| r.uid.clone()).collect();
        let mut report = RestoreReport::default();
        for rec in records {
            report.count(self.restore_one(rec).await);
        }
        // An older agent may have written the table while this one restored it (an event it
        // was serving when this agent bound the socket): pods it added are restored too, pods it
        // removed are removed here as well.
        // (a torn file fails this read and is left to the save below)
        if let Ok(again) = load(&store).await? {
            let now: HashSet<String> = again.iter().map(|r| r.uid.clone()).collect();
            for rec in again {
                if !first.contains(&rec.uid) {
                    tracing::info!(uid = %rec.uid, "pod added by the previous agent during the restore");
                    report.count(self.restore_one(rec).await);
                }
            }
            for uid in first.difference(&now) {
                tracing::info!(%uid, "pod removed by the previous agent during the restore");
                if let Err(e) = self.unenroll(uid, true).await {
                    tracing::warn!(%uid, error = %e, "removing the pod failed");
                }
            }
        }
        let snapshot = self.update(|_| ()).1;
        let _ = self.persist(snapshot).await;
        if let Err(e) = self.zds.send(WorkloadRequest::SnapshotSent).await {
            tracing::warn!(error = %e, "proxy did not take the end of the restored snapshot");
        }
        tracing::info!(
            restored = report.restored,
            dropped = report.dropped,
            failed = report.failed,
            file = %store.path().display(),
            "pod table restored"
        );
        Ok(report)
    }

    async fn restore_one(&self, rec: PodRecord) -> Restored {
        let pod = format!("{}/{}", rec.info.namespace, rec.info.name);
        let netns = match Netns::open(&rec.netns) {
            Ok(n) => n,
            Err(e) => {
                tracing::info!(%pod, uid = %rec.uid, error = %e, "netns gone, dropping the pod");
                return Restored::Dropped;
            }
        };
        if let Some(id) = rec.netns_id.map(crate::netns::NetnsId::from)
            && id != netns.id()
        {
            tracing::info!(%pod, uid = %rec.uid, was = %id, now = %netns.id(), "netns path names another namespace, dropping the pod");
            return Restored::Dropped;
        }
        let span = tracing::info_span!("pod", %pod, uid = %rec.uid, netns = %netns.id());
        let info = rec.info.clone();
        let step = async {
            self.apply_rules(&pod, &netns, &rec.options).await?;
            self.zds
                .send(WorkloadRequest::Add {
                    uid: rec.uid.clone(),
                    info,
                    netns: netns.clone(),
                })
                .await
                .map_err(|source| PodError::Proxy {
                    pod: pod.clone(),
                    source,
                })
        };
        let outcome = match tracing::Instrument::instrument(step, span.clone()).await {
            Ok(()) => {
                tracing::info!(parent: &span, "pod restored: rules re-applied, proxy serving it");
                Restored::Yes
            }
            Err(e) => {
                tracing::warn!(parent: &span, error = %e, "restoring the pod failed; keeping it for a later ADD or DEL");
                Restored::Failed
            }
        };
        let entry = EnrolledPod {
            uid: rec.uid.clone(),
            info: rec.info,
            options: rec.options,
            netns: rec.netns,
            container_id: rec.container_id,
            ips: rec.ips,
            pending: !matches!(outcome, Restored::Yes),
            handle: netns,
        };
        self.update(|pods| pods.insert(rec.uid, entry));
        outcome
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the pod table with `f`; returns its result and, when a store is attached, the
    /// snapshot to hand to [`PodManager::persist`].
    fn update<R>(
        &self,
        f: impl FnOnce(&mut HashMap<String, EnrolledPod>) -> R,
    ) -> (R, Option<Snapshot>) {
        let mut table = self.table();
        let r = f(&mut table.pods);
        table.generation += 1;
        let pending = table.pods.values().filter(|p| p.pending).count();
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics.pending.set(count(pending));
        self.metrics.enrolled.set(count(table.pods.len() - pending));
        let snapshot = self.store.get().map(|_| {
            let mut records: Vec<PodRecord> =
                table.pods.values().map(EnrolledPod::record).collect();
            records.sort_by(|a, b| a.uid.cmp(&b.uid));
            (table.generation, records)
        });
        (r, snapshot)
    }

    /// Writes a table snapshot to disk. A failure is logged and returned; only an ADD fails on it
    /// (an enrollment a restart could not rebuild must not be reported done): removals have
    /// already happened and are not undone because the file could not be written.
    async fn persist(&self, snapshot: Option<Snapshot>) -> Result<(), StoreError> {
        let (Some(store), Some((generation, records))) = (self.store.get().cloned(), snapshot)
        else {
            return Ok(());
        };
        let path = store.path().to_owned();
        let owner = self.owner.get().cloned();
        let write = move || {
            // Taken over: the file stays this agent's until the new agent wrote it (a pod this
            // one enrolls meanwhile reaches the new agent's second read, see `restore`).
            if owner.as_ref().is_some_and(|o| !o.is_ours()) && store.written_by_another() {
                return Ok(false);
            }
            store.save(generation, records).map(|()| true)
        };
        match tokio::task::spawn_blocking(write).await {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => {
                if !self
                    .superseded
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::info!(file = %path.display(), "plugin socket taken over by a newer agent: the pod table is its now, no longer written");
                }
                Ok(())
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "persisting the pod table failed");
                Err(e)
            }
            Err(_) => {
                tracing::error!(file = %path.display(), "pod table writer task failed");
                Err(StoreError::Io {
                    op: "write",
                    path,
                    source: std::io::Error::other("writer task failed"),
                })
            }
        }
    }

    async fn apply_rules(
        &self,
        pod: &str,
        netns: &Netns,
        options: &PodOptions,
    ) -> Result<(), PodError> {
        let rules = self.rules.clone();
        let ns = netns.clone();
        let options = options.clone();
        tokio::task::spawn_blocking(move || rules.apply_for_pod(&ns, &options))
            .await
            .map_err(|_| PodError::Task(pod.to_owned()))?
            .map_err(|source| PodError::Redirect {
                pod: pod.to_owned(),
                source,
            })
    }

    /// CNI ADD: enroll the pod if the policy says so.
    pub async fn add(&self, ev: PodAddEvent) -> Result<AddOutcome, PodError> {
        let pod = format!("{}/{}", ev.pod_namespace, ev.pod_name);
        let started = std::time::Instant::now();
        let decided = self.policy.decide(&ev).await;
        tracing::debug!(%pod, elapsed_us = started.elapsed().as_micros() as u64, "enrollment decided");
        let Some(enrollment) = decided? else {
            tracing::info!(%pod, "pod is not in the mesh");
            return Ok(AddOutcome::NotInMesh);
        };
        if ev.netns.is_empty() {
            return Err(PodError::NoNetns(pod));
        }
        let uid = if ev.pod_uid.is_empty() {
            pod.clone()
        } else {
            ev.pod_uid.clone()
        };
        let netns = Netns::open(&ev.netns).map_err(|source| PodError::Netns {
            pod: pod.clone(),
            source,
        })?;
        let span = tracing::info_span!("pod", %pod, %uid, netns = %netns.id());
        let found = FoundPod {
            uid,
            enrollment,
            netns_path: ev.netns,
            netns,
            container_id: ev.container_id,
            ips: ev.ips.iter().map(|i| i.address.ip).collect(),
        };
        tracing::Instrument::instrument(self.enroll(pod, found), span).await
    }

    /// Enrolls a pod found without a CNI event (Kubernetes mode: a running pod whose namespace or
    /// labels now put it in the mesh, or one found again after lost state): rules, then the proxy,
    /// as an ADD does. Idempotent.
    pub async fn enroll_found(&self, found: FoundPod) -> Result<AddOutcome, PodError> {
        let pod = format!(
            "{}/{}",
            found.enrollment.info.namespace, found.enrollment.info.name
        );
        let span = tracing::info_span!("pod", %pod, uid = %found.uid, netns = %found.netns.id());
        tracing::Instrument::instrument(self.enroll(pod, found), span).await
    }

    async fn enroll(&self, pod: String, found: FoundPod) -> Result<AddOutcome, PodError> {
        let FoundPod {
            uid,
            enrollment: Enrollment { info, options },
            netns_path,
            netns,
            container_id,
            ips,
        } = found;
        let start = std::time::Instant::now();
        self.apply_rules(&pod, &netns, &options).await?;
        tracing::info!(
            elapsed_us = start.elapsed().as_micros() as u64,
            "redirection rules installed"
        );
        let mut entry = EnrolledPod {
            uid: uid.clone(),
            info: info.clone(),
            options,
            netns: netns_path,
            container_id,
            ips,
            pending: true,
            handle: netns.clone(),
        };
        // Remembered before the proxy answers: a failed Add keeps the pod (pending) so its DEL
        // still finds the rules and the proxy side can forget it.
        let snapshot = self
            .update(|pods| pods.insert(uid.clone(), entry.clone()))
            .1;
        // Not recorded, not done: a restart could not bring the pod back. The rules stay (fail
        // closed) and the pod stays pending, so the runtime's DEL or retried ADD finds it.
        self.persist(snapshot)
            .await
            .map_err(|source| PodError::Persist {
                pod: pod.clone(),
                source,
            })?;
        let sent = self
            .zds
            .send(WorkloadRequest::Add {
                uid: uid.clone(),
                info: info.clone(),
                netns,
            })
            .await;
        if let Err(source) = sent {
            self.notify(&info);
            return Err(PodError::Proxy { pod, source });
        }
        tracing::info!(
            identity.sa = %info.service_account,
            elapsed_us = start.elapsed().as_micros() as u64,
            "pod enrolled, proxy serving it"
        );
        entry.pending = false;
        let ips = entry.ips.clone();
        let snapshot = self.update(|pods| pods.insert(uid.clone(), entry)).1;
        // A failure is logged: the pod is on disk as pending, which a restart restores as well.
        let _ = self.persist(snapshot).await;
        self.probe_set(&uid, ips, true).await;
        self.notify(&info);
        tracing::debug!(
            elapsed_us = start.elapsed().as_micros() as u64,
            "pod table saved, probe set updated"
        );
        Ok(AddOutcome::Enrolled)
    }

    /// CNI DEL: remove the pod's rules (if its netns still exists) and stop its proxy. Unknown pods
    /// succeed.
    pub async fn del(&self, ev: PodDelEvent) -> Result<(), PodError> {
        let (found, snapshot) = self.update(|pods| {
            let key = pods
                .iter()
                .find(|(uid, p)| {
                    // A container id names one sandbox: a late DEL of an old sandbox must not
                    // remove the pod's new one, so it alone decides when present.
                    if !ev.container_id.is_empty() && !p.container_id.is_empty() {
                        p.container_id == ev.container_id
                    } else if !ev.pod_uid.is_empty() {
                        **uid == ev.pod_uid
                    } else {
                        p.info.name == ev.pod_name && p.info.namespace == ev.pod_namespace
                    }
                })
                .map(|(k, _)| k.clone());
            key.and_then(|k| pods.remove(&k))
        });
        let Some(pod) = found else {
            tracing::debug!(pod = %format!("{}/{}", ev.pod_namespace, ev.pod_name), "DEL for a pod we do not hold");
            return Ok(());
        };
        let _ = self.persist(snapshot).await;
        self.release(pod, true).await
    }

    /// Takes pod `uid` out of the mesh while it keeps running (Kubernetes mode: its labels no
    /// longer select it): its rules are removed (`remove_rules`; false for a pod that is
    /// terminating, whose netns is going away) and the proxy forgets it. Unknown uids succeed.
    pub async fn unenroll(&self, uid: &str, remove_rules: bool) -> Result<(), PodError> {
        let (found, snapshot) = self.update(|pods| pods.remove(uid));
        let Some(pod) = found else {
            return Ok(());
        };
        let _ = self.persist(snapshot).await;
        self.release(pod, remove_rules).await
    }

    /// Sends the Add of a pending pod to the proxy again, once the table on disk holds it; on
    /// success the pod is no longer pending. Errors: [`PodError::NotEnrolled`],
    /// [`PodError::Persist`] (not sent), [`PodError::Proxy`].
    pub async fn retry_proxy(&self, uid: &str) -> Result<(), PodError> {
        let Some(pod) = self.table().pods.get(uid).cloned() else {
            return Err(PodError::NotEnrolled(uid.to_owned()));
        };
        let name = format!("{}/{}", pod.info.namespace, pod.info.name);
        // Never served unless recorded: a pod whose ADD failed on a full disk stays pending until
        // the table holds it.
        let snapshot = self.update(|_| ()).1;
        self.persist(snapshot)
            .await
            .map_err(|source| PodError::Persist {
                pod: name.clone(),
                source,
            })?;
        self.zds
            .send(WorkloadRequest::Add {
                uid: uid.to_owned(),
                info: pod.info.clone(),
                netns: pod.handle.clone(),
            })
            .await
            .map_err(|source| PodError::Proxy {
                pod: name.clone(),
                source,
            })?;
        let snapshot = self
            .update(|pods| {
                if let Some(p) = pods.get_mut(uid) {
                    p.pending = false;
                }
            })
            .1;
        let _ = self.persist(snapshot).await;
        tracing::info!(pod = %name, %uid, "proxy took the pending pod");
        self.probe_set(uid, pod.ips.clone(), true).await;
        self.notify(&pod.info);
        Ok(())
    }

    /// Re-applies the rules of enrolled pod `uid` with `options` (its annotations changed) and
    /// keeps them. Errors: [`PodError::NotEnrolled`], [`PodError::Redirect`].
    pub async fn update_options(&self, uid: &str, options: PodOptions) -> Result<(), PodError> {
        let Some(pod) = self.table().pods.get(uid).cloned() else {
            return Err(PodError::NotEnrolled(uid.to_owned()));
        };
        let name = format!("{}/{}", pod.info.namespace, pod.info.name);
        self.apply_rules(&name, &pod.handle, &options).await?;
        let snapshot = self
            .update(|pods| {
                if let Some(p) = pods.get_mut(uid) {
                    p.options = options;
                }
            })
            .1;
        let _ = self.persist(snapshot).await;
        tracing::info!(pod = %name, %uid, "redirection re-applied with the pod's new options");
        Ok(())
    }

    /// The enrolled pod `namespace/name`, if any.
    pub fn find(&self, namespace: &str, name: &str) -> Option<EnrolledPod> {
        self.table()
            .pods
            .values()
            .find(|p| p.info.namespace == namespace && p.info.name == name)
            .cloned()
    }

    /// Reports every later enrollment, failed proxy hand-over and removal as the pod's
    /// `(namespace, name)` on `tx` (the Kubernetes reconciler keeps the pods' status annotation
    /// from it). Only the first call takes effect.
    pub fn set_change_hook(&self, tx: mpsc::UnboundedSender<(String, String)>) {
        let _ = self.changes.set(tx);
    }

    fn notify(&self, info: &WorkloadInfo) {
        if let Some(tx) = self.changes.get() {
            let _ = tx.send((info.namespace.clone(), info.name.clone()));
        }
    }

    /// Programs kubelet probe SNAT for enrolled pods in the host netns (Kubernetes mode, spec
    /// §4.7): each enrolled pod's IPs join the probe sets and leave them with the pod. Only the
    /// first call takes effect.
    pub fn set_host_probe(&self, probe: Arc<HostProbe>) {
        let _ = self.host_probe.set(probe);
    }

    /// Makes the host probe sets hold exactly the enrolled pods' IPs (at start, and after the
    /// rules were repaired). Errors: the host rules are missing or nf_tables failed.
    pub async fn sync_host_probe(&self) -> Result<(), redirect::host::HostProbeError> {
        let Some(probe) = self.host_probe.get().cloned() else {
            return Ok(());
        };
        let pods: Vec<(String, Vec<IpAddr>)> = self
            .table()
            .pods
            .values()
            .map(|p| (p.uid.clone(), p.ips.clone()))
            .collect();
        tokio::task::spawn_blocking(move || probe.sync(&pods))
            .await
            .unwrap_or(Err(redirect::host::HostProbeError::Task))
    }

    /// Adds (or removes) a pod's IPs to (from) the host probe sets; a failure is logged (the
    /// repair loop re-syncs).
    async fn probe_set(&self, uid: &str, ips: Vec<IpAddr>, add: bool) {
        let Some(probe) = self.host_probe.get().cloned() else {
            return;
        };
        let owned = uid.to_owned();
        let res = tokio::task::spawn_blocking(move || {
            if add {
                probe.add_pod(&owned, &ips)
            } else {
                probe.remove_pod(&owned, &ips).map(|_| ())
            }
        })
        .await;
        if let Ok(Err(e)) = res {
            tracing::warn!(%uid, error = %e, "updating the host probe set failed");
        }
    }

    /// Removes a pod taken out of the table: its rules (when asked and its netns still exists),
    /// then the proxy's copy.
    async fn release(&self, pod: EnrolledPod, remove_rules: bool) -> Result<(), PodError> {
        self.probe_set(&pod.uid, pod.ips.clone(), false).await;
        let name = format!("{}/{}", pod.info.namespace, pod.info.name);
        // Through the held handle: the path may be gone (a `/proc/<pid>` of an exited process)
        // while the namespace still exists; removing rules from a dying one is harmless.
        if remove_rules {
            let ns = pod.handle.clone();
            let rules = self.rules.clone();
            let res = tokio::task::spawn_blocking(move || rules.remove(&ns))
                .await
                .map_err(|_| PodError::Task(name.clone()))?;
            if let Err(e) = res {
                tracing::warn!(pod = %name, error = %e, "removing redirection failed");
            }
        }
        self.zds
            .send(WorkloadRequest::Del {
                uid: pod.uid.clone(),
            })
            .await
            .map_err(|source| PodError::Proxy {
                pod: name.clone(),
                source,
            })?;
        tracing::info!(pod = %name, uid = %pod.uid, "pod removed from the mesh");
        self.notify(&pod.info);
        Ok(())
    }

    /// Identity info of an enrolled pod by uid.
    pub fn info(&self, uid: &str) -> Option<WorkloadInfo> {
        self.table().pods.get(uid).map(|p| p.info.clone())
    }
}
