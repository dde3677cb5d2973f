//! The Kubernetes reconciler (`../shared/spec/istio-cni.md` §3.2 step 3, §3.3, §3.5–3.7): one worker
//! that brings each pod of the node to what the rules say, whatever happened before.
//!
//! Input: the watches' [`Change`]s (a pod or namespace changed, a list completed) and the pod
//! manager's own changes (an ADD from the plugin, a failed proxy hand-over). For each pod:
//! - should be enrolled, is not: wait for its IPs, find its netns from procfs
//!   ([`NetnsFinder`]), enroll it ([`PodManager::enroll_found`]);
//! - should be enrolled, is pending: hand it to the proxy again;
//! - should not be (labels changed, excluded, terminated): un-enroll it (rules removed unless
//!   the pod is terminating) and tell the proxy;
//! - gone from the API: forget it (checked against the API server first, so a watch that lags
//!   behind a fresh ADD does not undo it);
//!
//! and the status annotation follows: `enabled`, `pending` or none. A failed step is retried with
//! exponential backoff per pod ([`RECONCILE_RETRY`]: 5 ms doubling to 5 s, unlimited, as Istio's
//! work queue); every step is idempotent. After each complete list of the pods, every pod of the
//! store and of the pod table is looked at (pods deleted while the agent was down or the watch was
//! broken are cleaned up).
//! The readiness task completes once both lists are in and no pod is failing (so every pod that
//! should be in the mesh is captured before the node reports ready), or [`READY_GRACE`] after the
//! lists if some pod keeps failing.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::status::{self, Redirection};
use super::watch::{Change, Watches};
use crate::agent::enroll::PodUid;
use crate::agent::enroll::{
    Decision, Enrollment, EnrollmentRules, NamespaceFacts, PodFacts, PodOptions, SkipReason,
};
use crate::agent::netns_finder::{
    FindError, FoundNetns, HostNetns, InterfaceAddrCheck, NetnsFinder, PodQuery,
};
use crate::agent::pods::{FoundPod, PodError, PodManager};
use crate::backoff::{Backoff, RECONCILE_RETRY};
use crate::netns::Netns;
use crate::ready::Task;
use crate::zds::WorkloadInfo;

/// How long pods that keep failing after the first complete list hold readiness back; after it
/// the node turns ready with a warning naming them (so one broken pod cannot stall a rollout).
pub const READY_GRACE: Duration = Duration::from_secs(60);

/// How many pods are reconciled at once (a burst at start: every running pod of the node).
const RECONCILE_CONCURRENCY: usize = 8;

/// A pod's `(namespace, name)`.
type PodKey = (String, String);

/// Why one pod's reconcile failed (retried).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Enrolling or removing failed.
    #[error(transparent)]
    Pod(#[from] PodError),
    /// The pod's netns was not found in procfs.
    #[error("pod {pod}: netns: {source}")]
    Netns {
        /// `namespace/name`.
        pod: String,
        /// Why.
        #[source]
        source: FindError,
    },
    /// Writing the status annotation or reading the pod failed.
    #[error("pod {pod}: API server: {source}")]
    Api {
        /// `namespace/name`.
        pod: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// An API call took longer than [`API_TIMEOUT`].
    #[error("pod {0}: the API server did not answer within {API_TIMEOUT:?}")]
    ApiTimeout(String),
    /// A blocking task died.
    #[error("pod {0}: worker task failed")]
    Task(String),
}

/// The reconciler's inputs and tools.
pub struct Reconciler {
    pods: Arc<PodManager>,
    watches: Watches,
    client: kube::Client,
    rules: Arc<EnrollmentRules>,
    finder: Arc<NetnsFinder<InterfaceAddrCheck>>,
    /// The last procfs scan, for the pods that wanted a netns then: one scan serves a burst of
    /// pods (a namespace labelled, the first pass after a restart) instead of one per pod.
    scan: std::sync::Mutex<Option<(Instant, ScanResults)>>,
    /// Held while a scan runs: pods reconciled at the same time wait for it and take their
    /// result from it rather than each scanning procfs.
    scanning: tokio::sync::Mutex<()>,
}

/// Results of one [`NetnsFinder::find_all`].
type ScanResults = BTreeMap<PodUid, Result<FoundNetns, FindError>>;

/// How long a scan's results are used.
const SCAN_REUSE: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Queue {
    order: VecDeque<PodKey>,
    queued: HashSet<PodKey>,
    /// Failing pods: their backoff and when they are retried next.
    retries: HashMap<PodKey, (Backoff, Instant)>,
}

impl Queue {
    fn push(&mut self, key: PodKey) {
        if self.queued.insert(key.clone()) {
            self.order.push_back(key);
        }
    }

    fn pop(&mut self) -> Option<PodKey> {
        let key = self.order.pop_front()?;
        self.queued.remove(&key);
        Some(key)
    }

    fn next_retry(&self) -> Option<Instant> {
        self.retries.values().map(|(_, at)| *at).min()
    }

    fn due(&mut self, now: Instant) {
        let due: Vec<PodKey> = self
            .retries
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            self.push(key);
        }
    }

    fn failed(&mut self, key: PodKey) {
        let now = Instant::now();
        let (backoff, at) = self
            .retries
            .entry(key)
            .or_insert_with(|| (Backoff::new(RECONCILE_RETRY), now));
        *at = now + backoff.next_delay();
    }

    fn succeeded(&mut self, key: &PodKey) {
        self.retries.remove(key);
    }
}

impl Reconciler {
    /// A reconciler finding netns under `proc_root` (`/proc`, or the host's `/host/proc`). The
    /// agent's own netns is the host netns (the agent runs with `hostNetwork`).
    pub fn new(
        pods: Arc<PodManager>,
        watches: Watches,
        client: kube::Client,
        rules: Arc<EnrollmentRules>,
        proc_root: PathBuf,
    ) -> Result<Reconciler, crate::netns::NetnsError> {
        let host = Netns::current()?.id();
        Ok(Reconciler {
            pods,
            watches,
            client,
            rules,
            finder: Arc::new(NetnsFinder::with_check(
                proc_root,
                HostNetns::Id(host),
                InterfaceAddrCheck,
            )),
            scan: std::sync::Mutex::new(None),
            scanning: tokio::sync::Mutex::new(()),
        })
    }

    /// Runs until `shutdown` resolves or both inputs close. `synced` is done once the first lists
    /// are in and no pod is failing, or [`READY_GRACE`] after the lists.
    pub async fn run(
        self,
        mut changes: mpsc::UnboundedReceiver<Change>,
        mut local: mpsc::UnboundedReceiver<(String, String)>,
        synced: Task,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut queue = Queue::default();
        let (mut pods_listed, mut namespaces_listed) = (false, false);
        let mut synced = Some(synced);
        let mut listed_at: Option<Instant> = None;
        loop {
            let next = queue.next_retry();
            tokio::select! {
                biased;
                _ = &mut shutdown => return,
                change = changes.recv() => match change {
                    None => return,
                    Some(Change::Pod { namespace, name }) => {
                        self.pods.metrics.reconcile_event("pod");
                        queue.push((namespace, name));
                    }
                    Some(Change::Namespace(ns)) => {
                        self.pods.metrics.reconcile_event("namespace");
                        for p in self.watches.pods_in(&ns) {
                            queue.push(key_of(&p));
                        }
                    }
                    Some(Change::PodsSynced) => {
                        pods_listed = true;
                        self.queue_everything(&mut queue);
                    }
                    Some(Change::NamespacesSynced) => {
                        namespaces_listed = true;
                        self.queue_everything(&mut queue);
                    }
                },
                Some(key) = local.recv() => queue.push(key),
                _ = sleep_until(next), if next.is_some() => {}
            }
            if !(pods_listed && namespaces_listed) {
                // Until both lists are in, a pod's namespace may be missing: decide nothing yet.
                continue;
            }
            queue.due(Instant::now());
            // Up to RECONCILE_CONCURRENCY pods at once (each waits on netlink, the proxy and the
            // API server); a key is in the queue at most once, so no pod runs twice at a time.
            let mut running = FuturesUnordered::new();
            let this = &self;
            loop {
                while running.len() < RECONCILE_CONCURRENCY
                    && let Some(key) = queue.pop()
                {
                    running.push(async move {
                        let res = this.reconcile(&key.0, &key.1).await;
                        (key, res)
                    });
                }
                let Some((key, res)) = running.next().await else {
                    break;
                };
                match res {
                    Ok(()) => queue.succeeded(&key),
                    Err(e) => {
                        tracing::warn!(pod = %format!("{}/{}", key.0, key.1), error = %e, "reconcile failed; retrying with backoff");
                        queue.failed(key);
                    }
                }
            }
            if pods_listed && namespaces_listed && synced.is_some() {
                let since = *listed_at.get_or_insert_with(Instant::now);
                let failing: Vec<String> = queue
                    .retries
                    .keys()
                    .map(|(ns, name)| format!("{ns}/{name}"))
                    .collect();
                if failing.is_empty() || since.elapsed() >= READY_GRACE {
                    if !failing.is_empty() {
                        tracing::warn!(
                            ?failing,
                            "ready although these pods still fail to reconcile"
                        );
                    }
                    tracing::info!(
                        enrolled = self.pods.enrolled().len(),
                        "first Kubernetes reconcile done"
                    );
                    if let Some(task) = synced.take() {
                        task.done();
                    }
                }
            }
        }
    }

    /// Every pod of the store and every pod the table holds.
    fn queue_everything(&self, queue: &mut Queue) {
        for p in self.watches.pods.state() {
            queue.push(key_of(&p));
        }
        for p in self.pods.enrolled() {
            queue.push((p.info.namespace, p.info.name));
        }
    }

    /// Brings pod `namespace/name` to what the rules say (see the module docs).
    pub async fn reconcile(&self, namespace: &str, name: &str) -> Result<(), ReconcileError> {
        let label = format!("{namespace}/{name}");
        let mut held = self.pods.find(namespace, name);
        let Some(pod) = self.watches.pod(namespace, name) else {
            if let Some(h) = held
                && self.api_uid(namespace, name, &label).await?.as_deref() != Some(h.uid.as_str())
            {
                self.pods.unenroll(&h.uid, false).await?;
            }
            return Ok(());
        };
        let facts = PodFacts::from_pod(&pod);
        if let Some(h) = &held
            && !facts.uid.as_str().is_empty()
            && h.uid != facts.uid.as_str()
        {
            if self.api_uid(namespace, name, &label).await?.as_deref() == Some(h.uid.as_str()) {
                // The store lags behind a pod the plugin just enrolled: wait for the watch.
                return Ok(());
            }
            // The pod was recreated under the same name: the old sandbox is gone.
            self.pods.unenroll(&h.uid, false).await?;
            held = None;
        }
        let ns = self.namespace(namespace, &label).await?;
        let decision = self.rules.decide(
            &facts,
            &NamespaceFacts::from_namespace(ns.as_deref(), namespace),
        );
        let current = Redirection::of(&pod);
        let want = match (decision, held) {
            (Decision::Enroll { options, .. }, None) => {
                if facts.ips.is_empty() {
                    // No IP yet: the pod's next update brings it (spec §3.3).
                    tracing::info!(pod = %label, "in the mesh but no IP in its status yet; waiting for it");
                    return Ok(());
                }
                let query = PodQuery {
                    uid: facts.uid.clone(),
                    ips: facts.ips.clone(),
                };
                let found = self.find_netns(query, &label).await?;
                let enrollment = Enrollment {
                    info: WorkloadInfo {
                        name: facts.name.clone(),
                        namespace: facts.namespace.clone(),
                        service_account: facts.service_account.clone(),
                    },
                    options,
                };
                let res = self
                    .pods
                    .enroll_found(FoundPod {
                        uid: facts.uid.as_str().to_owned(),
                        enrollment,
                        netns_path: found.1.display().to_string(),
                        netns: found.0,
                        container_id: String::new(),
                        ips: facts.ips.clone(),
                    })
                    .await;
                self.after_proxy(res.map(|_| ()), namespace, name, current)
                    .await?
            }
            (Decision::Enroll { .. }, Some(h)) if h.pending => {
                let res = self.pods.retry_proxy(&h.uid).await;
                self.after_proxy(res, namespace, name, current).await?
            }
            (Decision::Enroll { options, .. }, Some(h)) if !same_rules(&options, &h.options) => {
                // The pod's annotations changed its redirection options: new rules, same proxy.
                self.pods.update_options(&h.uid, options).await?;
                Some(Redirection::Enabled)
            }
            (Decision::Enroll { .. }, Some(_)) => Some(Redirection::Enabled),
            (Decision::Skip(reason), Some(h)) => {
                tracing::info!(pod = %label, %reason, "leaving the mesh");
                self.pods
                    .unenroll(&h.uid, reason != SkipReason::Terminated)
                    .await?;
                None
            }
            (Decision::Skip(_), None) => None,
        };
        if current != want {
            self.write_status(namespace, name, want).await?;
        }
        Ok(())
    }

    /// The annotation after a proxy hand-over: `enabled`, or `pending` written at once and the
    /// error returned (retried).
    async fn after_proxy(
        &self,
        res: Result<(), PodError>,
        namespace: &str,
        name: &str,
        current: Option<Redirection>,
    ) -> Result<Option<Redirection>, ReconcileError> {
        match res {
            Ok(()) => Ok(Some(Redirection::Enabled)),
            Err(e @ PodError::Proxy { .. }) => {
                if current != Some(Redirection::Pending) {
                    self.write_status(namespace, name, Some(Redirection::Pending))
                        .await?;
                }
                Err(e.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn find_netns(
        &self,
        query: PodQuery,
        label: &str,
    ) -> Result<(Netns, PathBuf), ReconcileError> {
        let netns_err = |source| ReconcileError::Netns {
            pod: label.to_owned(),
            source,
        };
        if let Some(hit) = self.take_scanned(&query.uid) {
            let found = hit.map_err(netns_err)?;
            return Ok((found.netns, found.path));
        }
        let _scanning = self.scanning.lock().await;
        // a scan that ran while this pod waited may have found it
        if let Some(hit) = self.take_scanned(&query.uid) {
            let found = hit.map_err(netns_err)?;
            return Ok((found.netns, found.path));
        }
        let mut queries = self.wanting_netns();
        if !queries.iter().any(|q| q.uid == query.uid) {
            queries.push(query.clone());
        }
        let finder = self.finder.clone();
        let results = tokio::task::spawn_blocking(move || finder.find_all(&queries))
            .await
            .map_err(|_| ReconcileError::Task(label.to_owned()))?
            .map_err(|e| netns_err(FindError::Scan(e)))?;
        *self.scan.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), results));
        let found = self
            .take_scanned(&query.uid)
            .unwrap_or(Err(FindError::NotFound {
                uid: query.uid.clone(),
                in_host_netns: 0,
            }))
            .map_err(netns_err)?;
        Ok((found.netns, found.path))
    }

    /// Takes `uid`'s result out of a recent scan.
    fn take_scanned(&self, uid: &PodUid) -> Option<Result<FoundNetns, FindError>> {
        let mut scan = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        let (at, results) = scan.as_mut()?;
        if at.elapsed() > SCAN_REUSE {
            *scan = None;
            return None;
        }
        results.remove(uid)
    }

    /// Every pod of the store the rules put in the mesh that is not enrolled yet and has IPs.
    fn wanting_netns(&self) -> Vec<PodQuery> {
        self.watches
            .pods
            .state()
            .iter()
            .map(|p| PodFacts::from_pod(p))
            .filter(|f| !f.ips.is_empty() && self.pods.find(&f.namespace, &f.name).is_none())
            .filter(|f| {
                let ns = self.watches.namespace(&f.namespace);
                self.rules
                    .decide(
                        f,
                        &NamespaceFacts::from_namespace(ns.as_deref(), &f.namespace),
                    )
                    .is_enrolled()
            })
            .map(|f| PodQuery {
                uid: f.uid,
                ips: f.ips,
            })
            .collect()
    }

    /// Namespace `name`: from the store, else from the API server (a namespace the watch has not
    /// delivered yet must not read as "no labels").
    async fn namespace(
        &self,
        name: &str,
        label: &str,
    ) -> Result<Option<Arc<Namespace>>, ReconcileError> {
        if let Some(ns) = self.watches.namespace(name) {
            return Ok(Some(ns));
        }
        let api: Api<Namespace> = Api::all(self.client.clone());
        api_call(label, api.get_opt(name))
            .await
            .map(|n| n.map(Arc::new))
    }

    /// The uid the API server has for pod `namespace/name` now (`None`: no such pod); the store
    /// may lag behind a fresh ADD or a recreation.
    async fn api_uid(
        &self,
        namespace: &str,
        name: &str,
        label: &str,
    ) -> Result<Option<String>, ReconcileError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        api_call(label, api.get_opt(name))
            .await
            .map(|p| p.and_then(|p| p.metadata.uid))
    }

    async fn write_status(
        &self,
        namespace: &str,
        name: &str,
        value: Option<Redirection>,
    ) -> Result<(), ReconcileError> {
        api_call(
            &format!("{namespace}/{name}"),
            status::write(&self.client, namespace, name, value),
        )
        .await
    }
}

/// How long one API call of the reconciler may take (the watches have their own timeouts).
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs one API call for pod `label` within [`API_TIMEOUT`].
async fn api_call<T>(
    label: &str,
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, ReconcileError> {
    match tokio::time::timeout(API_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(ReconcileError::Api {
            pod: label.to_owned(),
            source,
        }),
        Err(_) => Err(ReconcileError::ApiTimeout(label.to_owned())),
    }
}

/// Whether two option sets program the same rules (warnings aside).
fn same_rules(a: &PodOptions, b: &PodOptions) -> bool {
    a.bypass_inbound_capture == b.bypass_inbound_capture
        && a.dns_capture_override == b.dns_capture_override
        && a.reroute_virtual_interfaces == b.reroute_virtual_interfaces
}

fn key_of(p: &Pod) -> PodKey {
    (
        p.metadata.namespace.clone().unwrap_or_default(),
        p.metadata.name.clone().unwrap_or_default(),
    )
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn retries_back_off_from_5_ms_to_5_s_and_success_clears_them() {
        let mut q = Queue::default();
        let key: PodKey = ("ns".into(), "p".into());
        let start = Instant::now();
        let mut delays = Vec::new();
        for _ in 0..12 {
            q.failed(key.clone());
            delays.push(q.next_retry().expect("retry") - start);
        }
        assert_eq!(delays[0], Duration::from_millis(5));
        assert_eq!(delays[1], Duration::from_millis(10));
        assert_eq!(delays[10], RECONCILE_RETRY.max());
        assert_eq!(delays[11], RECONCILE_RETRY.max());
        q.due(start + Duration::from_millis(1));
        assert_eq!(q.pop(), None, "not due yet");
        q.due(start + RECONCILE_RETRY.max());
        assert_eq!(q.pop(), Some(key.clone()));
        q.succeeded(&key);
        assert_eq!(q.next_retry(), None);
    }

    #[test]
    fn a_queued_pod_is_queued_once() {
        let mut q = Queue::default();
        q.push(("a".into(), "1".into()));
        q.push(("a".into(), "1".into()));
        q.push(("a".into(), "2".into()));
        assert_eq!(q.pop(), Some(("a".into(), "1".into())));
        assert_eq!(q.pop(), Some(("a".into(), "2".into())));
        assert_eq!(q.pop(), None);
    }
}
