//! The enrollment decision: one pure function of the pod's and namespace's facts and the rules'
//! configuration, shared by the plugin and the agent so they never disagree (spec §1.4, §3.1).

use std::collections::BTreeSet;
use std::fmt;

use crate::mesh::DEFAULT_EXCLUDED_NAMESPACES;

use super::facts::{NamespaceFacts, PodFacts, SIDECAR_STATUS_ANNOTATION};
use super::options::PodOptions;
use super::selector::{ENV_AMBIENT_ENABLEMENT_SELECTOR, EnablementSelectors, SelectorError};

/// Env var of the excluded namespaces: comma list (spec §6).
pub const ENV_EXCLUDE_NAMESPACES: &str = "EXCLUDE_NAMESPACES";
/// Env var of the namespace ztnode runs in (the downward API's `metadata.namespace`, spec §6).
pub const ENV_POD_NAMESPACE: &str = "POD_NAMESPACE";
/// Namespace of ztnode's own pods when [`ENV_POD_NAMESPACE`] is unset or empty (`deploy/`).
pub const DEFAULT_OWN_NAMESPACE: &str = "istio-system";
/// `app` label value of ztnode's own pods (`deploy/base/daemonset.yaml`).
pub const OWN_APP_LABEL: &str = "ztnode";
/// Name prefix of ztnode's own pods: DaemonSet `ztnode` names its pods `ztnode-<suffix>`.
pub const OWN_NAME_PREFIX: &str = "ztnode-";

/// Namespaces whose pods are never enrolled (`EXCLUDE_NAMESPACES`; default
/// [`DEFAULT_EXCLUDED_NAMESPACES`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExcludedNamespaces(BTreeSet<String>);

/// How ztnode recognises its own pods, which it never enrolls: namespace equal to `namespace`
/// AND (label `app=ztnode` OR name starting with `ztnode-`).
///
/// The name test alone is what the plugin can apply before it has fetched the pod (Istio's
/// `istio-cni-node-` failsafe, spec §1.4 step 3); the label test covers pods renamed by other
/// controllers (Istio's `app=ztunnel` rule, spec §3.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnPods {
    /// The namespace ztnode runs in.
    pub namespace: String,
}

/// Everything [`EnrollmentRules::decide`] needs besides the facts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EnrollmentRules {
    /// `AMBIENT_ENABLEMENT_SELECTOR`.
    pub selectors: EnablementSelectors,
    /// `EXCLUDE_NAMESPACES`.
    pub excluded: ExcludedNamespaces,
    /// ztnode's own pods.
    pub own: OwnPods,
}

/// The outcome for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The pod belongs in the mesh.
    Enroll {
        /// Index of the first enablement selector entry that matched.
        selector: usize,
        /// Its per-pod options.
        options: PodOptions,
    },
    /// The pod stays out, for this reason.
    Skip(SkipReason),
}

/// Why a pod is not enrolled. When several apply, the first in this order is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Empty pod name or namespace (spec §1.4 step 6).
    NotKubernetesPod,
    /// One of ztnode's own pods ([`OwnPods`]; spec §1.4 step 3, §3.1).
    OwnPod,
    /// The namespace is excluded (spec §1.4 step 7, §3.1).
    ExcludedNamespace,
    /// Phase `Succeeded` or `Failed` (spec §3.2 step 3, §3.3).
    Terminated,
    /// `spec.hostNetwork` (spec §3.1): its netns is the node's.
    HostNetwork,
    /// Has `sidecar.istio.io/status` (spec §3.1): sidecar and ambient do not mix.
    SidecarInjected,
    /// The selector list is empty, so nothing is enrolled (spec §3.1, §6).
    NoSelectors,
    /// No enablement selector entry matched (spec §3.1).
    NotSelected,
}

// === impl ExcludedNamespaces ===

impl ExcludedNamespaces {
    /// Exactly these namespaces.
    pub fn new<S: Into<String>>(names: impl IntoIterator<Item = S>) -> ExcludedNamespaces {
        ExcludedNamespaces(names.into_iter().map(Into::into).collect())
    }

    /// Parses `EXCLUDE_NAMESPACES`: comma-separated, items trimmed, empty items dropped (so `""`
    /// excludes nothing).
    pub fn parse(list: &str) -> ExcludedNamespaces {
        ExcludedNamespaces::new(list.split(',').map(str::trim).filter(|s| !s.is_empty()))
    }

    /// True when pods of `namespace` are never enrolled.
    pub fn contains(&self, namespace: &str) -> bool {
        self.0.contains(namespace)
    }

    /// The namespaces, sorted.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }
}

impl Default for ExcludedNamespaces {
    fn default() -> ExcludedNamespaces {
        ExcludedNamespaces::new(DEFAULT_EXCLUDED_NAMESPACES.iter().copied())
    }
}

// === impl OwnPods ===

impl OwnPods {
    /// Own pods live in `namespace`.
    pub fn new(namespace: impl Into<String>) -> OwnPods {
        OwnPods {
            namespace: namespace.into(),
        }
    }

    /// The name-only test, for callers that have not fetched the pod (the plugin's failsafe).
    pub fn matches_name(&self, namespace: &str, name: &str) -> bool {
        namespace == self.namespace && name.starts_with(OWN_NAME_PREFIX)
    }

    /// The full test (see the type's docs).
    pub fn matches(&self, pod: &PodFacts) -> bool {
        self.matches_name(&pod.namespace, &pod.name)
            || (pod.namespace == self.namespace
                && pod.labels.get("app").map(String::as_str) == Some(OWN_APP_LABEL))
    }
}

impl Default for OwnPods {
    fn default() -> OwnPods {
        OwnPods::new(DEFAULT_OWN_NAMESPACE)
    }
}

// === impl EnrollmentRules ===

impl EnrollmentRules {
    /// Reads the rules from the environment through `env` (a lookup, so tests pass a map).
    ///
    /// - `AMBIENT_ENABLEMENT_SELECTOR`: unset = Istio's shipped default
    ///   ([`EnablementSelectors::default`]); set = parsed as given, so `""` enrolls nothing, as in
    ///   Istio's code.
    /// - `EXCLUDE_NAMESPACES`: unset = [`DEFAULT_EXCLUDED_NAMESPACES`]; set = the parsed list.
    /// - `POD_NAMESPACE`: unset or empty = [`DEFAULT_OWN_NAMESPACE`].
    ///
    /// # Errors
    /// [`SelectorError`] naming `AMBIENT_ENABLEMENT_SELECTOR` and its value.
    pub fn from_env(
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<EnrollmentRules, SelectorError> {
        let selectors = match env(ENV_AMBIENT_ENABLEMENT_SELECTOR) {
            None => EnablementSelectors::default(),
            Some(v) => EnablementSelectors::parse(ENV_AMBIENT_ENABLEMENT_SELECTOR, &v)?,
        };
        let excluded = env(ENV_EXCLUDE_NAMESPACES)
            .map(|v| ExcludedNamespaces::parse(&v))
            .unwrap_or_default();
        let own = env(ENV_POD_NAMESPACE)
            .filter(|ns| !ns.is_empty())
            .map(OwnPods::new)
            .unwrap_or_default();
        Ok(EnrollmentRules {
            selectors,
            excluded,
            own,
        })
    }

    /// Decides whether `pod` is enrolled. `namespace` must be the pod's namespace (its labels feed
    /// the namespace selectors; the exclusion test uses `pod.namespace`).
    ///
    /// Pure: the plugin (at CNI ADD) and the agent (informer, CNI event, restart) call it with the
    /// same facts and get the same answer. Unlike Istio's agent, the excluded-namespace test is
    /// applied on every path, including the CNI event (spec §3.1 notes Istio skips it there).
    pub fn decide(&self, pod: &PodFacts, namespace: &NamespaceFacts) -> Decision {
        match self.skip_reason(pod) {
            Some(reason) => Decision::Skip(reason),
            None => match self.selectors.first_match(&pod.labels, &namespace.labels) {
                Some(selector) => Decision::Enroll {
                    selector,
                    options: PodOptions::from_annotations(&pod.annotations),
                },
                None if self.selectors.is_empty() => Decision::Skip(SkipReason::NoSelectors),
                None => Decision::Skip(SkipReason::NotSelected),
            },
        }
    }

    fn skip_reason(&self, pod: &PodFacts) -> Option<SkipReason> {
        if pod.name.is_empty() || pod.namespace.is_empty() {
            Some(SkipReason::NotKubernetesPod)
        } else if self.own.matches(pod) {
            Some(SkipReason::OwnPod)
        } else if self.excluded.contains(&pod.namespace) {
            Some(SkipReason::ExcludedNamespace)
        } else if pod.phase.is_terminal() {
            Some(SkipReason::Terminated)
        } else if pod.host_network {
            Some(SkipReason::HostNetwork)
        } else if pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
            Some(SkipReason::SidecarInjected)
        } else {
            None
        }
    }
}

// === impl Decision ===

impl Decision {
    /// True for [`Decision::Enroll`].
    pub fn is_enrolled(&self) -> bool {
        matches!(self, Decision::Enroll { .. })
    }

    /// The options of an enrolled pod.
    pub fn options(&self) -> Option<&PodOptions> {
        match self {
            Decision::Enroll { options, .. } => Some(options),
            Decision::Skip(_) => None,
        }
    }

    /// The skip reason of a pod that is not enrolled.
    pub fn skip_reason(&self) -> Option<SkipReason> {
        match self {
            Decision::Enroll { .. } => None,
            Decision::Skip(reason) => Some(*reason),
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Enroll { selector, .. } => {
                write!(f, "enrolled: enablement selector entry {selector} matched")
            }
            Decision::Skip(reason) => write!(f, "not enrolled: {reason}"),
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipReason::NotKubernetesPod => "no pod name or namespace",
            SkipReason::OwnPod => "one of ztnode's own pods",
            SkipReason::ExcludedNamespace => "namespace is excluded",
            SkipReason::Terminated => "pod has terminated",
            SkipReason::HostNetwork => "host network pod",
            SkipReason::SidecarInjected => "sidecar-injected pod",
            SkipReason::NoSelectors => "no enablement selectors configured",
            SkipReason::NotSelected => "no enablement selector matched",
        })
    }
}
