//! The pod lifecycle on the node: enroll (open netns → redirect → hand to the proxy) and remove.
//!
//! Order follows istio-cni (`../shared/spec/istio-cni.md` §3.5, §3.7): rules first, then the proxy.
//! If the proxy refuses or is absent, the rules stay and the ADD fails, so the pod's traffic is
//! redirected to a port nobody serves (fail closed) until the runtime retries; the pod stays in the
//! table as `pending` (Istio's partial add), so its DEL still removes the rules and tells the proxy
//! side to forget it. Every step is idempotent: the same ADD twice is harmless, DEL of an unknown pod
//! succeeds.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::agent::enroll::EnrollmentPolicy;
use crate::agent::redirect::{self, RedirectPlan};
use crate::netns::{Netns, NetnsError};
use crate::podevent::{PodAddEvent, PodDelEvent};
use crate::zds::{WorkloadInfo, WorkloadRequest, WorkloadSink, ZdsError};

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
    /// Pod name.
    pub name: String,
    /// Pod namespace.
    pub namespace: String,
    /// Service account.
    pub service_account: String,
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

/// The agent's pod table and the flows over it.
pub struct PodManager {
    policy: Arc<dyn EnrollmentPolicy>,
    zds: WorkloadSink,
    plan: RedirectPlan,
    pods: Mutex<HashMap<String, EnrolledPod>>,
}

impl PodManager {
    /// A manager that enrolls by `policy`, redirects with `plan` and hands pods to the proxy via `zds`
    /// (the in-process channel or the ZDS socket server).
    pub fn new(
        policy: Arc<dyn EnrollmentPolicy>,
        zds: impl Into<WorkloadSink>,
        plan: RedirectPlan,
    ) -> PodManager {
        PodManager {
            policy,
            zds: zds.into(),
            plan,
            pods: Mutex::new(HashMap::new()),
        }
    }

    /// The enrolled pods, sorted by namespace/name.
    pub fn enrolled(&self) -> Vec<EnrolledPod> {
        let mut v: Vec<_> = self
            .pods
            .lock()
            .map(|p| p.values().cloned().collect())
            .unwrap_or_default();
        v.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        v
    }

    /// CNI ADD: enroll the pod if the policy says so.
    pub async fn add(&self, ev: PodAddEvent) -> Result<AddOutcome, PodError> {
        let pod = format!("{}/{}", ev.pod_namespace, ev.pod_name);
        let Some(info) = self.policy.decide(&ev.pod_namespace, &ev.pod_name) else {
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
        tracing::Instrument::instrument(self.enroll(pod, uid, info, netns, ev), span).await
    }

    async fn enroll(
        &self,
        pod: String,
        uid: String,
        info: WorkloadInfo,
        netns: Netns,
        ev: PodAddEvent,
    ) -> Result<AddOutcome, PodError> {
        let plan = self.plan.clone();
        let ns = netns.clone();
        tokio::task::spawn_blocking(move || redirect::apply(&ns, &plan))
            .await
            .map_err(|_| PodError::Task(pod.clone()))?
            .map_err(|source| PodError::Redirect {
                pod: pod.clone(),
                source,
            })?;
        tracing::info!("redirection rules installed");
        let mut entry = EnrolledPod {
            uid: uid.clone(),
            name: info.name.clone(),
            namespace: info.namespace.clone(),
            service_account: info.service_account.clone(),
            netns: ev.netns,
            container_id: ev.container_id,
            ips: ev.ips.iter().map(|i| i.address.ip).collect(),
            pending: true,
            handle: netns.clone(),
        };
        self.remember(entry.clone());
        self.zds
            .send(WorkloadRequest::Add {
                uid,
                info: info.clone(),
                netns,
            })
            .await
            .map_err(|source| PodError::Proxy {
                pod: pod.clone(),
                source,
            })?;
        tracing::info!(identity.sa = %info.service_account, "pod enrolled, proxy serving it");
        entry.pending = false;
        self.remember(entry);
        Ok(AddOutcome::Enrolled)
    }

    fn remember(&self, entry: EnrolledPod) {
        if let Ok(mut pods) = self.pods.lock() {
            pods.insert(entry.uid.clone(), entry);
        }
    }

    /// CNI DEL: remove the pod's rules (if its netns still exists) and stop its proxy. Unknown pods
    /// succeed.
    pub async fn del(&self, ev: PodDelEvent) -> Result<(), PodError> {
        let found = self.pods.lock().ok().and_then(|mut pods| {
            let key = pods
                .iter()
                .find(|(uid, p)| {
                    // A container id names one sandbox: a late DEL of an old sandbox must not
                    // remove the pod's new one, so it alone decides when present.
                    if !ev.container_id.is_empty() {
                        p.container_id == ev.container_id
                    } else if !ev.pod_uid.is_empty() {
                        **uid == ev.pod_uid
                    } else {
                        p.name == ev.pod_name && p.namespace == ev.pod_namespace
                    }
                })
                .map(|(k, _)| k.clone());
            key.and_then(|k| pods.remove(&k))
        });
        let Some(pod) = found else {
            tracing::debug!(pod = %format!("{}/{}", ev.pod_namespace, ev.pod_name), "DEL for a pod we do not hold");
            return Ok(());
        };
        let name = format!("{}/{}", pod.namespace, pod.name);
        if Path::new(&pod.netns).exists() {
            let ns = pod.handle.clone();
            let res = tokio::task::spawn_blocking(move || redirect::remove(&ns))
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
        Ok(())
    }

    /// Identity info of an enrolled pod by uid.
    pub fn info(&self, uid: &str) -> Option<WorkloadInfo> {
        self.pods.lock().ok()?.get(uid).map(|p| WorkloadInfo {
            name: p.name.clone(),
            namespace: p.namespace.clone(),
            service_account: p.service_account.clone(),
        })
    }
}
