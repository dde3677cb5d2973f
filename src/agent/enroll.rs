//! Which pods are in the mesh.
//!
//! The agent asks an [`EnrollmentPolicy`] for each pod the plugin reports. Standalone mode enrolls a
//! pod when the local config has an HBONE workload with that namespace and name (wired in
//! `crate::node`).
//!
//! Kubernetes mode decides as Istio does (spec §1.4, §3.1) with [`EnrollmentRules::decide`]: a pure
//! function of a pod's [`PodFacts`], its [`NamespaceFacts`] and the rules' configuration
//! (`AMBIENT_ENABLEMENT_SELECTOR`, `EXCLUDE_NAMESPACES`, ztnode's own namespace), returning a
//! [`Decision`] that says why and carries the pod's [`PodOptions`]. The plugin and the agent both
//! call it, so they cannot disagree. Its submodules depend only on `crate::mesh`, std, serde and
//! the Kubernetes object types (`k8s-openapi`), so the plugin can use them.
//!
//! | rule (first that applies wins) | result | spec |
//! |---|---|---|
//! | empty pod name or namespace | [`SkipReason::NotKubernetesPod`] | §1.4 step 6 |
//! | namespace = own namespace and (name `ztnode-*` or label `app=ztnode`) | [`SkipReason::OwnPod`] | §1.4 step 3, §3.1 |
//! | namespace in `EXCLUDE_NAMESPACES` | [`SkipReason::ExcludedNamespace`] | §1.4 step 7, §3.1 |
//! | phase `Succeeded`/`Failed` | [`SkipReason::Terminated`] | §3.2 step 3, §3.3 |
//! | `spec.hostNetwork` | [`SkipReason::HostNetwork`] | §3.1 |
//! | annotation `sidecar.istio.io/status` present | [`SkipReason::SidecarInjected`] | §3.1 |
//! | zero selector entries | [`SkipReason::NoSelectors`] | §3.1, §6 |
//! | first entry whose pod and namespace selectors both match | [`Decision::Enroll`] | §3.1 |
//! | otherwise | [`SkipReason::NotSelected`] | §3.1 |

mod facts;
mod options;
mod rules;
mod selector;

#[cfg(test)]
mod tests;

pub use facts::{
    BYPASS_INBOUND_CAPTURE_ANNOTATION, DATAPLANE_MODE_AMBIENT, DATAPLANE_MODE_LABEL,
    DATAPLANE_MODE_NONE, DNS_CAPTURE_ANNOTATION, NamespaceFacts, PodFacts, PodPhase, PodUid,
    REROUTE_VIRTUAL_INTERFACES_ANNOTATION, SIDECAR_STATUS_ANNOTATION,
};
pub use options::{
    AnnotationWarning, InterfaceName, InterfaceNameError, MAX_INTERFACE_NAME_LEN, PodOptions,
    parse_go_bool,
};
pub use rules::{
    DEFAULT_OWN_NAMESPACE, Decision, ENV_EXCLUDE_NAMESPACES, ENV_POD_NAMESPACE, EnrollmentRules,
    ExcludedNamespaces, OWN_APP_LABEL, OWN_NAME_PREFIX, OwnPods, SkipReason,
};
pub use selector::{
    ENV_AMBIENT_ENABLEMENT_SELECTOR, EnablementSelector, EnablementSelectors,
    ISTIO_DEFAULT_ENABLEMENT_SELECTOR, LabelSelector, Operator, Requirement, SelectorError,
    SelectorField, SelectorProblem,
};

use futures::future::BoxFuture;

use crate::podevent::PodAddEvent;
use crate::zds::WorkloadInfo;

/// A pod the policy put in the mesh: the identity the proxy serves it with and its redirection
/// options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrollment {
    /// Name, namespace and service account (the SPIFFE identity's parts).
    pub info: WorkloadInfo,
    /// Per-pod redirection options (from the pod's annotations in Kubernetes mode).
    pub options: PodOptions,
}

/// Why a policy could not decide about a pod (the CNI ADD then fails: fail closed).
#[derive(Debug, thiserror::Error)]
#[error("deciding about pod {pod}: {source}")]
pub struct PolicyError {
    /// `namespace/name`.
    pub pod: String,
    /// What failed (the pod unknown to the API server, the API server unreachable, ...).
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// Decides whether a pod the plugin reported is enrolled, and with which identity.
pub trait EnrollmentPolicy: Send + Sync {
    /// `Ok(Some(..))` when the pod of `event` belongs in the mesh, `Ok(None)` when it does not.
    fn decide<'a>(
        &'a self,
        event: &'a PodAddEvent,
    ) -> BoxFuture<'a, Result<Option<Enrollment>, PolicyError>>;
}

/// A closure `(namespace, name) -> Option<WorkloadInfo>` is a policy whose pods get no per-pod
/// options (standalone mode).
impl<F> EnrollmentPolicy for F
where
    F: Fn(&str, &str) -> Option<WorkloadInfo> + Send + Sync,
{
    fn decide<'a>(
        &'a self,
        event: &'a PodAddEvent,
    ) -> BoxFuture<'a, Result<Option<Enrollment>, PolicyError>> {
        let decided = self(&event.pod_namespace, &event.pod_name).map(|info| Enrollment {
            info,
            options: PodOptions::default(),
        });
        Box::pin(std::future::ready(Ok(decided)))
    }
}
