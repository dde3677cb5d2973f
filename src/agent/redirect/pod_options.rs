//! The merge of one pod's redirection options (the typed form of istio-cni's pod annotations,
//! [`PodOptions`], spec §3.1) with the node-wide [`RedirectPlan`] ([`RedirectPlan::for_pod`]):
//! ingress mode (spec §4.5), per-pod DNS capture (§4.4) and virtual interfaces (§4.5).

use super::RedirectPlan;
#[cfg(test)]
use crate::agent::enroll::InterfaceName;
use crate::agent::enroll::PodOptions;

impl RedirectPlan {
    /// The plan to install in one pod: `self` is the node-wide plan (IP families, probe SNAT
    /// addresses, packet mark, and in `dns_capture` the global DNS setting), `pod` the pod's
    /// options. The result keeps the node-wide fields, sets `dns_capture` to
    /// [`PodOptions::dns_capture`], and takes `bypass_inbound_capture` and
    /// `virtual_interfaces` from `pod` (they are per-pod only; any values in `self` are replaced).
    ///
    /// With `PodOptions::default()` the result equals a node-wide plan that has no per-pod
    /// fields set; applying the same `pod` again changes nothing.
    pub fn for_pod(&self, pod: &PodOptions) -> RedirectPlan {
        RedirectPlan {
            dns_capture: pod.dns_capture(self.dns_capture),
            bypass_inbound_capture: pod.bypass_inbound_capture,
            virtual_interfaces: pod.reroute_virtual_interfaces.clone(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> InterfaceName {
        InterfaceName::new(s).expect("valid name")
    }

    #[test]
    fn pod_dns_override_wins_and_unset_keeps_the_global_setting() {
        let unset = PodOptions::default();
        let on = PodOptions {
            dns_capture_override: Some(true),
            ..Default::default()
        };
        let off = PodOptions {
            dns_capture_override: Some(false),
            ..Default::default()
        };
        for global in [false, true] {
            assert_eq!(unset.dns_capture(global), global);
            assert!(on.dns_capture(global));
            assert!(!off.dns_capture(global));
        }
    }

    #[test]
    fn for_pod_keeps_node_settings_and_takes_the_pods() {
        let node = RedirectPlan {
            ipv6: true,
            dns_capture: true,
            probe_v4: "10.1.2.3".parse().expect("v4"),
            ..RedirectPlan::default()
        };
        assert_eq!(node.for_pod(&PodOptions::default()), node);

        let pod = PodOptions {
            bypass_inbound_capture: true,
            dns_capture_override: Some(false),
            reroute_virtual_interfaces: vec![name("eth1"), name("tap0")],
            ..Default::default()
        };
        let plan = node.for_pod(&pod);
        assert_eq!(
            plan,
            RedirectPlan {
                dns_capture: false,
                bypass_inbound_capture: true,
                virtual_interfaces: vec![name("eth1"), name("tap0")],
                ..node.clone()
            }
        );
        assert_eq!(plan.for_pod(&pod), plan, "applying the same options twice");
        // Per-pod fields are replaced, not accumulated.
        assert_eq!(plan.for_pod(&PodOptions::default()).virtual_interfaces, []);
    }
}
