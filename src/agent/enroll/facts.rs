//! What the enrollment rules look at: the facts of one pod and of its namespace, as plain data
//! (filled from the Kubernetes API by the caller), and the label and annotation keys Istio reads.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Pod};

/// Pod label that opts a pod in (`ambient`) or out (`none`) of ambient (spec §3.1).
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// [`DATAPLANE_MODE_LABEL`] value that enrolls.
pub const DATAPLANE_MODE_AMBIENT: &str = "ambient";
/// [`DATAPLANE_MODE_LABEL`] value that opts a pod out.
pub const DATAPLANE_MODE_NONE: &str = "none";
/// Annotation the sidecar injector puts on injected pods; such pods are never enrolled (spec §3.1).
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";
/// Boolean annotation: no inbound redirection ("ingress mode", spec §3.1).
pub const BYPASS_INBOUND_CAPTURE_ANNOTATION: &str = "ambient.istio.io/bypass-inbound-capture";
/// Boolean annotation overriding the global DNS capture for one pod (spec §3.1).
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";
/// Comma list of extra in-pod interfaces whose traffic is captured like the pod's own (spec §3.1,
/// §4.5).
pub const REROUTE_VIRTUAL_INTERFACES_ANNOTATION: &str = "istio.io/reroute-virtual-interfaces";

/// A pod's `metadata.uid`, as the API spells it (`8-4-4-4-12` lowercase hex for ordinary pods, 32
/// hex digits for static pods). Opaque to the rules; the netns finder matches it against cgroup
/// paths.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PodUid(String);

/// `status.phase` of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PodPhase {
    /// Accepted, not all containers running yet (the phase at CNI ADD time).
    #[default]
    Pending,
    /// Bound to a node, containers started.
    Running,
    /// All containers exited with success and will not restart (terminal).
    Succeeded,
    /// All containers exited, at least one failed, none restart (terminal).
    Failed,
    /// The phase could not be obtained (also an empty or unrecognised phase string).
    Unknown,
}

/// The facts about one pod the rules need.
///
/// A pod being deleted (`metadata.deletionTimestamp` set) is not a fact here on purpose: it keeps
/// running through its grace period and needs the mesh until its phase turns terminal, as in
/// Istio (spec §3.3, which removes on terminal phase or on the delete event).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodFacts {
    /// `metadata.name` (`K8S_POD_NAME` in the plugin).
    pub name: String,
    /// `metadata.namespace` (`K8S_POD_NAMESPACE`).
    pub namespace: String,
    /// `metadata.uid` (`K8S_POD_UID`).
    pub uid: PodUid,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `spec.serviceAccountName`.
    pub service_account: String,
    /// `spec.nodeName`.
    pub node_name: String,
    /// `status.podIPs` (or `status.podIP` when the list is empty), or the IPs of the plugin's
    /// event when the API has none yet (spec §3.3, §3.4).
    pub ips: Vec<IpAddr>,
    /// `status.phase`.
    pub phase: PodPhase,
}

/// The facts about a namespace the rules need.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NamespaceFacts {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
}

// === impl PodUid ===

impl PodUid {
    /// Wraps a UID as given by the API, `K8S_POD_UID` or the plugin event.
    pub fn new(uid: impl Into<String>) -> PodUid {
        PodUid(uid.into())
    }

    /// The UID as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for PodUid {
    fn from(uid: &str) -> PodUid {
        PodUid::new(uid)
    }
}

impl From<String> for PodUid {
    fn from(uid: String) -> PodUid {
        PodUid(uid)
    }
}

// === impl PodPhase ===

impl PodPhase {
    /// Parses `status.phase`; anything unrecognised (including `""`) is [`PodPhase::Unknown`].
    pub fn from_api(phase: &str) -> PodPhase {
        match phase {
            "Pending" => PodPhase::Pending,
            "Running" => PodPhase::Running,
            "Succeeded" => PodPhase::Succeeded,
            "Failed" => PodPhase::Failed,
            _ => PodPhase::Unknown,
        }
    }

    /// True for `Succeeded` and `Failed`: the pod never runs again (spec §3.2 step 3, §3.3).
    pub fn is_terminal(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

// === impl PodFacts ===

impl PodFacts {
    /// The facts of a `Pod` as the API serves it. IPs are `status.podIPs` (or `status.podIP`
    /// when the list is empty); unparsable addresses are skipped. A pod without
    /// `spec.serviceAccountName` has Kubernetes' `default`.
    pub fn from_pod(pod: &Pod) -> PodFacts {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        PodFacts {
            name: meta.name.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            uid: PodUid::new(meta.uid.clone().unwrap_or_default()),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            service_account: spec
                .and_then(|s| s.service_account_name.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "default".to_owned()),
            node_name: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            ips: pod_ips(pod),
            phase: PodPhase::from_api(status.and_then(|s| s.phase.as_deref()).unwrap_or("")),
        }
    }
}

/// `status.podIPs`, else `status.podIP`, parsed.
fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    let listed: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok())
        .collect();
    if !listed.is_empty() {
        return listed;
    }
    status
        .pod_ip
        .iter()
        .filter_map(|ip| ip.parse().ok())
        .collect()
}

// === impl NamespaceFacts ===

impl NamespaceFacts {
    /// The facts of namespace `name` (`None`: not known, so no labels).
    pub fn from_namespace(ns: Option<&Namespace>, name: &str) -> NamespaceFacts {
        NamespaceFacts {
            name: name.to_owned(),
            labels: ns
                .and_then(|n| n.metadata.labels.clone())
                .unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod kube_object_tests {
    use super::*;

    #[test]
    fn facts_come_from_the_api_fields() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "app", "uid": "u-1",
                         "labels": {"istio.io/dataplane-mode": "ambient"},
                         "annotations": {"a": "b"}},
            "spec": {"containers": [], "serviceAccountName": "web-sa", "nodeName": "n1"},
            "status": {"phase": "Running", "podIP": "10.0.0.9",
                       "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]}
        }))
        .expect("pod");
        let f = PodFacts::from_pod(&pod);
        assert_eq!((f.name.as_str(), f.namespace.as_str()), ("web", "app"));
        assert_eq!(f.uid.as_str(), "u-1");
        assert_eq!(f.service_account, "web-sa");
        assert_eq!(f.node_name, "n1");
        assert_eq!(f.phase, PodPhase::Running);
        assert_eq!(
            f.ips,
            [
                "10.0.0.5".parse::<IpAddr>().expect("ip"),
                "fd00::5".parse().expect("ip")
            ]
        );
        assert_eq!(f.labels["istio.io/dataplane-mode"], "ambient");
        assert!(!f.host_network);
    }

    #[test]
    fn defaults_when_fields_are_missing() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "n"},
            "spec": {"containers": [], "hostNetwork": true},
            "status": {"podIP": "10.1.1.1"}
        }))
        .expect("pod");
        let f = PodFacts::from_pod(&pod);
        assert_eq!(f.service_account, "default");
        assert!(f.host_network);
        assert_eq!(f.ips, ["10.1.1.1".parse::<IpAddr>().expect("ip")]);
        assert_eq!(f.phase, PodPhase::Unknown);
        assert!(NamespaceFacts::from_namespace(None, "n").labels.is_empty());
    }
}
