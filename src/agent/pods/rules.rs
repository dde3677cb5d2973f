//! The redirection step of the pod lifecycle behind a trait, so the lifecycle can be tested with a
//! recording fake and without privileges (STYLE practice 7: rules applied through a trait).

use crate::agent::enroll::PodOptions;
use crate::agent::redirect::{self, RedirectError, RedirectPlan};
use crate::netns::Netns;

/// Installs and removes a pod's traffic redirection. All calls are blocking (they enter the
/// pod's netns); the pod manager runs them on the blocking pool.
pub trait RuleApplier: Send + Sync {
    /// Installs the redirection of a pod without per-pod options in `netns`:
    /// [`RuleApplier::apply_for_pod`] with [`PodOptions::default()`].
    fn apply(&self, netns: &Netns) -> Result<(), RedirectError> {
        self.apply_for_pod(netns, &PodOptions::default())
    }
    /// Installs the redirection of a pod with options `pod` (ingress mode, DNS capture override,
    /// virtual interfaces; spec §3.1) in `netns`. Must be idempotent: applying twice equals once;
    /// applying with other options converges to them.
    fn apply_for_pod(&self, netns: &Netns, pod: &PodOptions) -> Result<(), RedirectError>;
    /// Removes the redirection from `netns`; succeeds when nothing is installed.
    fn remove(&self, netns: &Netns) -> Result<(), RedirectError>;
}

/// The real rules: istio-cni's nftables rule set and policy routing of the node-wide `plan`,
/// merged with each pod's options ([`RedirectPlan::for_pod`], [`redirect::apply`],
/// [`redirect::remove`]).
#[derive(Debug, Clone)]
pub struct NftRules {
    plan: RedirectPlan,
}

impl NftRules {
    /// Rules of the node-wide `plan`.
    pub fn new(plan: RedirectPlan) -> NftRules {
        NftRules { plan }
    }

    /// The plan installed for a pod with options `pod` (pure; what
    /// [`RuleApplier::apply_for_pod`] applies).
    pub fn plan_for(&self, pod: &PodOptions) -> RedirectPlan {
        self.plan.for_pod(pod)
    }
}

impl RuleApplier for NftRules {
    fn apply_for_pod(&self, netns: &Netns, pod: &PodOptions) -> Result<(), RedirectError> {
        redirect::apply(netns, &self.plan_for(pod))
    }

    fn remove(&self, netns: &Netns) -> Result<(), RedirectError> {
        redirect::remove(netns)
    }
}
