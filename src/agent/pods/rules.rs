//! The redirection step of the pod lifecycle behind a trait, so the lifecycle can be tested with a
//! recording fake and without privileges (STYLE practice 7: rules applied through a trait).

use crate::agent::redirect::{self, RedirectError, RedirectPlan};
use crate::netns::Netns;

/// Installs and removes a pod's traffic redirection. Both calls are blocking (they enter the
/// pod's netns); the pod manager runs them on the blocking pool.
pub trait RuleApplier: Send + Sync {
    /// Installs the redirection in `netns`. Must be idempotent: applying twice equals once.
    fn apply(&self, netns: &Netns) -> Result<(), RedirectError>;
    /// Removes the redirection from `netns`; succeeds when nothing is installed.
    fn remove(&self, netns: &Netns) -> Result<(), RedirectError>;
}

/// The real rules: istio-cni's nftables rule set and policy routing of `plan`
/// ([`redirect::apply`], [`redirect::remove`]).
#[derive(Debug, Clone)]
pub struct NftRules {
    plan: RedirectPlan,
}

impl NftRules {
    /// Rules of `plan`.
    pub fn new(plan: RedirectPlan) -> NftRules {
        NftRules { plan }
    }
}

impl RuleApplier for NftRules {
    fn apply(&self, netns: &Netns) -> Result<(), RedirectError> {
        redirect::apply(netns, &self.plan)
    }

    fn remove(&self, netns: &Netns) -> Result<(), RedirectError> {
        redirect::remove(netns)
    }
}
