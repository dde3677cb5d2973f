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

/// How often and how long the store is asked before the API server is (Istio: 10 × 10 ms).
const STORE_RETRIES: u32 = 10;
const STORE_RETRY_DELAY: Duration = Duration::from_millis(10);

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
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ev.pod_namespace);
        match api.get_opt(&ev.pod_name).await {
            Ok(Some(p)) => Ok(Arc::new(p)),
            Ok(None) => Err(LookupError::NoPod),
            Err(e) => Err(LookupError::Api(e)),
        }
    }

    async fn namespace(&self, name: &str) -> Result<Option<Arc<Namespace>>, LookupError> {
        if let Some(ns) = self.watches.namespace(name) {
            return Ok(Some(ns));
        }
        let api: Api<Namespace> = Api::all(self.client.clone());
        api.get_opt(name)
            .await
            .map(|n| n.map(Arc::new))
            .map_err(LookupError::Api)
    }

    async fn decide_event(&self, ev: &PodAddEvent) -> Result<Option<Enrollment>, PolicyError> {
        let name = format!("{}/{}", ev.pod_namespace, ev.pod_name);
        let err = |e: LookupError| PolicyError {
            pod: name.clone(),
            source: Box::new(e),
        };
        let pod = self.pod(ev).await.map_err(err)?;
        let ns = self.namespace(&ev.pod_namespace).await.map_err(err)?;
        let mut facts = PodFacts::from_pod(&pod);
        if facts.ips.is_empty() {
            // At CNI ADD time the API has no IPs yet: the plugin's are the pod's (spec §3.4).
            facts.ips = ev.ips.iter().map(|i| i.address.ip).collect();
        }
        let decision = self.rules.decide(
            &facts,
            &NamespaceFacts::from_namespace(ns.as_deref(), &ev.pod_namespace),
        );
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
