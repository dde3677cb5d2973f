//! Which pods are in the mesh.
//!
//! The agent asks an [`EnrollmentPolicy`] for each pod the plugin reports. Standalone mode enrolls a
//! pod when the local config has an HBONE workload with that namespace and name (wired in
//! `crate::node`); Kubernetes mode (labels `istio.io/dataplane-mode=ambient`) plugs in here later.

use crate::zds::WorkloadInfo;

/// Decides whether a pod is enrolled, and with which identity.
pub trait EnrollmentPolicy: Send + Sync {
    /// `Some(info)` when the pod `namespace/name` belongs in the mesh.
    fn decide(&self, namespace: &str, name: &str) -> Option<WorkloadInfo>;
}

impl<F> EnrollmentPolicy for F
where
    F: Fn(&str, &str) -> Option<WorkloadInfo> + Send + Sync,
{
    fn decide(&self, namespace: &str, name: &str) -> Option<WorkloadInfo> {
        self(namespace, name)
    }
}
