//! What the enrollment rules look at: the facts of one pod and of its namespace, as plain data
//! (filled from the Kubernetes API by the caller), and the label and annotation keys Istio reads.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

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
