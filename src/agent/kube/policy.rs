//! The enrollment policy of Kubernetes mode for the plugin's events (`../shared/spec/istio-cni.md`
//! §3.4): the pod and its namespace come from the watches' stores (retried briefly while the watch
//! catches up, then read from the API server), and Istio's rules decide.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;

use super::watch::Watches;
use crate::agent::enroll::{
    Decision, Enrollment, EnrollmentPolicy, EnrollmentRules, NamespaceFacts, PodFacts, PolicyError,
};
use crate::podevent::PodAddEvent;
use crate::zds::WorkloadInfo;

/// How often and how long the store is asked before the API server is: 100 ms in all, as Istio
/// (10 × 10 ms), in 1 ms steps so a watch event that lands a moment after the ADD costs ~1 ms.
const STORE_RETRIES: u32 = 100;
const STORE_RETRY_DELAY: Duration = Duration::from_millis(1);

/// Decides with [`EnrollmentRules`] over the pods and namespaces of the Kubernetes API.
pub struct KubePolicy {
    watches: Watches,
    client: kube::Client,
    rules: Arc<EnrollmentRules>,
}

/// Why the pod could not be classified.
#[derive(Debug, thiserror::Error)]
enum LookupError {
    #[error("the API server does not know the pod")]
    NoPod,
    #[error("reading it from the API server: {0}")]
    Api(#[source] kube::Error),
    #[error("the API server did not answer within {API_TIMEOUT:?}")]
    Timeout,
}

/// How long one API read of the policy may take.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs one API read within [`API_TIMEOUT`].
async fn read<T>(
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, LookupError> {
    tokio::time::timeout(API_TIMEOUT, call)
        .await
        .map_err(|_| LookupError::Timeout)?
        .map_err(LookupError::Api)
}

impl KubePolicy {
    /// A policy over `watches`, reading from `client` what they do not have yet.
    pub fn new(watches: Watches, client: kube::Client, rules: Arc<EnrollmentRules>) -> KubePolicy {
        KubePolicy {
            watches,
            client,
            rules,
        }
    }

    /// The pod of `ev` from the API server.
    async fn api_pod(&self, ev: &PodAddEvent) -> Result<Arc<Pod>, LookupError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ev.pod_namespace);
        read(api.get_opt(&ev.pod_name))
            .await?
            .map(Arc::new)
            .ok_or(LookupError::NoPod)
    }

    /// Namespace `name` from the API server.
    async fn api_namespace(&self, name: &str) -> Result<Option<Arc<Namespace>>, LookupError> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        Ok(read(api.get_opt(name)).await?.map(Arc::new))
    }

    /// The pod of `ev`: from the store when it is there with the event's uid, else from the API.
    async fn pod(&self, ev: &PodAddEvent) -> Result<Arc<Pod>, LookupError> {
        let fresh = |p: &Arc<Pod>| {
            ev.pod_uid.is_empty() || p.metadata.uid.as_deref() == Some(ev.pod_uid.as_str())
        };
        for _ in 0..STORE_RETRIES {
            if let Some(p) = self
                .watches
                .pod(&ev.pod_namespace, &ev.pod_name)
                .filter(fresh)
            {
                return Ok(p);
            }
            tokio::time::sleep(STORE_RETRY_DELAY).await;
        }
        self.api_pod(ev).await
    }

    async fn namespace(&self, name: &str) -> Result<Option<Arc<Namespace>>, LookupError> {
        if let Some(ns) = self.watches.namespace(name) {
            return Ok(Some(ns));
        }
        self.api_namespace(name).await
    }

    /// Decides over `pod` and `ns`, the plugin's IPs standing in for the API's missing ones.
    fn decide_with(
        &self,
        ev: &PodAddEvent,
        pod: &Pod,
        ns: Option<&Namespace>,
    ) -> (PodFacts, Decision) {
        let mut facts = PodFacts::from_pod(pod);
        if facts.ips.is_empty() {
            // At CNI ADD time the API has no IPs yet: the plugin's are the pod's (spec §3.4).
            facts.ips = ev.ips.iter().map(|i| i.address.ip).collect();
        }
        let decision = self.rules.decide(
            &facts,
            &NamespaceFacts::from_namespace(ns, &ev.pod_namespace),
        );
        (facts, decision)
    }

    async fn decide_event(&self, ev: &PodAddEvent) -> Result<Option<Enrollment>, PolicyError> {
        let name = format!("{}/{}", ev.pod_namespace, ev.pod_name);
        let err = |e: LookupError| PolicyError {
            pod: name.clone(),
            source: Box::new(e),
        };
        let pod = self.pod(ev).await.map_err(err)?;
        let ns = self.namespace(&ev.pod_namespace).await.map_err(err)?;
        let (mut facts, mut decision) = self.decide_with(ev, &pod, ns.as_deref());
        if !decision.is_enrolled() {
            // The plugin asked the API server and found the pod ambient; a store that lags behind
            // a label change must not let it start without rules: the API server decides.
            let pod = self.api_pod(ev).await.map_err(err)?;
            let ns = self.api_namespace(&ev.pod_namespace).await.map_err(err)?;
            (facts, decision) = self.decide_with(ev, &pod, ns.as_deref());
        }
        match decision {
            Decision::Enroll { options, .. } => {
                for w in &options.warnings {
                    tracing::warn!(pod = %name, annotation = w.annotation, value = %w.value, expected = w.expected, "annotation ignored");
                }
                Ok(Some(Enrollment {
                    info: WorkloadInfo {
                        name: facts.name,
                        namespace: facts.namespace,
                        service_account: facts.service_account,
                    },
                    options,
                }))
            }
            Decision::Skip(reason) => {
                tracing::info!(pod = %name, %reason, "not enrolled");
                Ok(None)
            }
        }
    }
}

impl EnrollmentPolicy for KubePolicy {
    fn decide<'a>(
        &'a self,
        event: &'a PodAddEvent,
    ) -> BoxFuture<'a, Result<Option<Enrollment>, PolicyError>> {
        Box::pin(self.decide_event(event))
    }
}
