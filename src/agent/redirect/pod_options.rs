//! Per-pod redirection options, the typed form of istio-cni's pod annotations (spec §3.1), and
//! their merge with the node-wide [`RedirectPlan`] ([`RedirectPlan::for_pod`]).
//!
//! - `ambient.istio.io/bypass-inbound-capture` → [`PodRedirectOptions::bypass_inbound_capture`]
//!   ("ingress mode", spec §4.5);
//! - `ambient.istio.io/dns-capture` → [`PodRedirectOptions::dns_capture`] (spec §4.4);
//! - `istio.io/reroute-virtual-interfaces` → [`PodRedirectOptions::virtual_interfaces`] (§4.5).
//!
//! Parsing the annotations is not done here: this module takes typed values.

use std::fmt;
use std::str::FromStr;

use super::RedirectPlan;

/// Longest interface name Linux accepts (`IFNAMSIZ` 16, minus the terminating NUL).
pub const MAX_INTERFACE_NAME_LEN: usize = 15;

/// A network interface name as the kernel (and an nf_tables `iifname` match) sees it: 1 to 15
/// bytes of ASCII letters, digits, `-`, `_`, `.` or `@`, and not `.` or `..`.
///
/// Stricter than Linux's `dev_valid_name`: characters that `nft` would read as syntax inside a
/// quoted name (`"`, `\`, a `*` wildcard) or that rarely appear in pod interface names are refused,
/// so the rule we program and the script we print ([`super::render_script`]) always mean the same
/// exact-name match.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InterfaceName(String);

/// Why a string is not an [`InterfaceName`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterfaceNameError {
    /// The name is empty.
    #[error("empty interface name")]
    Empty,
    /// The name is longer than [`MAX_INTERFACE_NAME_LEN`] bytes.
    #[error("interface name {name:?} is {len} bytes, at most {MAX_INTERFACE_NAME_LEN} allowed")]
    TooLong {
        /// The rejected name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The name is `.` or `..`, which Linux refuses.
    #[error("interface name {name:?} is reserved")]
    Reserved {
        /// The rejected name.
        name: String,
    },
    /// The name contains a character outside `A-Z a-z 0-9 - _ . @`.
    #[error("interface name {name:?} contains {ch:?}")]
    InvalidChar {
        /// The rejected name.
        name: String,
        /// The first offending character.
        ch: char,
    },
}

impl InterfaceName {
    /// Checks `name` (see [`InterfaceName`] for the rules).
    ///
    /// Errors: [`InterfaceNameError`] saying which rule `name` breaks.
    pub fn new(name: &str) -> Result<InterfaceName, InterfaceNameError> {
        if name.is_empty() {
            return Err(InterfaceNameError::Empty);
        }
        if let Some(ch) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@')))
        {
            return Err(InterfaceNameError::InvalidChar {
                name: name.to_owned(),
                ch,
            });
        }
        if name.len() > MAX_INTERFACE_NAME_LEN {
            return Err(InterfaceNameError::TooLong {
                name: name.to_owned(),
                len: name.len(),
            });
        }
        if name == "." || name == ".." {
            return Err(InterfaceNameError::Reserved {
                name: name.to_owned(),
            });
        }
        Ok(InterfaceName(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for InterfaceName {
    type Err = InterfaceNameError;

    /// Same as [`InterfaceName::new`].
    fn from_str(s: &str) -> Result<InterfaceName, InterfaceNameError> {
        InterfaceName::new(s)
    }
}

impl fmt::Display for InterfaceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for InterfaceName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// What one pod asks for beyond the node-wide settings (spec §3.1). The default asks for nothing:
/// the pod gets the node-wide plan unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodRedirectOptions {
    /// "Ingress mode" (`ambient.istio.io/bypass-inbound-capture: "true"`): inbound traffic is not
    /// redirected to ztunnel (no `:15006` redirect, no prerouting probe accept); outbound capture,
    /// the connmark rules and DNS capture are unchanged (spec §4.5).
    pub bypass_inbound_capture: bool,
    /// Per-pod DNS capture (`ambient.istio.io/dns-capture`): `Some(true)` / `Some(false)` override
    /// the node's global setting, `None` keeps it (spec §4.4). See
    /// [`PodRedirectOptions::effective_dns_capture`].
    pub dns_capture: Option<bool>,
    /// Interfaces whose inbound TCP is the pod's own outbound traffic (VMs, KubeVirt, DinD;
    /// `istio.io/reroute-virtual-interfaces`): redirected to ztunnel's outbound port `:15001`, one
    /// redirect + return pair per name, in this order, ahead of every other inbound rule
    /// (spec §4.5). UDP on them is not captured.
    pub virtual_interfaces: Vec<InterfaceName>,
}

impl PodRedirectOptions {
    /// Whether DNS is captured for this pod when the node-wide setting (`AMBIENT_DNS_CAPTURE`) is
    /// `global`: the pod's override if it has one, else `global` (istio-cni's `PodDNSEnabled` /
    /// `PodDNSDisabled` / `PodDNSUnset`, spec §4.4). The one place this is decided.
    pub fn effective_dns_capture(&self, global: bool) -> bool {
        self.dns_capture.unwrap_or(global)
    }
}

impl RedirectPlan {
    /// The plan to install in one pod: `self` is the node-wide plan (IP families, probe SNAT
    /// addresses, packet mark, and in `dns_capture` the global DNS setting), `pod` the pod's
    /// options. The result keeps the node-wide fields, sets `dns_capture` to
    /// [`PodRedirectOptions::effective_dns_capture`], and takes `bypass_inbound_capture` and
    /// `virtual_interfaces` from `pod` (they are per-pod only; any values in `self` are replaced).
    ///
    /// With `PodRedirectOptions::default()` the result equals a node-wide plan that has no per-pod
    /// fields set; applying the same `pod` again changes nothing.
    pub fn for_pod(&self, pod: &PodRedirectOptions) -> RedirectPlan {
        RedirectPlan {
            dns_capture: pod.effective_dns_capture(self.dns_capture),
            bypass_inbound_capture: pod.bypass_inbound_capture,
            virtual_interfaces: pod.virtual_interfaces.clone(),
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
    fn interface_names_follow_linux_and_nft_rules() {
        for ok in [
            "eth0",
            "fake1s0f0",
            "k6t-eth0",
            "net1.100",
            "tap_0",
            "a",
            "x@y",
            "0abc",
        ] {
            assert_eq!(name(ok).as_str(), ok);
        }
        assert_eq!(
            name("123456789012345").as_str().len(),
            MAX_INTERFACE_NAME_LEN
        );
        assert_eq!(InterfaceName::new(""), Err(InterfaceNameError::Empty));
        assert!(matches!(
            InterfaceName::new("1234567890123456"),
            Err(InterfaceNameError::TooLong { len: 16, .. })
        ));
        for reserved in [".", ".."] {
            assert!(matches!(
                InterfaceName::new(reserved),
                Err(InterfaceNameError::Reserved { .. })
            ));
        }
        for (bad, ch) in [
            ("eth 0", ' '),
            ("eth*", '*'),
            ("a\"b", '"'),
            ("a/b", '/'),
            ("a:b", ':'),
            ("a\\b", '\\'),
            ("ethé", 'é'),
        ] {
            assert_eq!(
                InterfaceName::new(bad),
                Err(InterfaceNameError::InvalidChar {
                    name: bad.to_owned(),
                    ch
                }),
                "{bad}"
            );
        }
        assert_eq!("eth1".parse::<InterfaceName>(), Ok(name("eth1")));
        assert_eq!(name("eth1").to_string(), "eth1");
    }

    #[test]
    fn pod_dns_override_wins_and_unset_keeps_the_global_setting() {
        let unset = PodRedirectOptions::default();
        let on = PodRedirectOptions {
            dns_capture: Some(true),
            ..Default::default()
        };
        let off = PodRedirectOptions {
            dns_capture: Some(false),
            ..Default::default()
        };
        for global in [false, true] {
            assert_eq!(unset.effective_dns_capture(global), global);
            assert!(on.effective_dns_capture(global));
            assert!(!off.effective_dns_capture(global));
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
        assert_eq!(node.for_pod(&PodRedirectOptions::default()), node);

        let pod = PodRedirectOptions {
            bypass_inbound_capture: true,
            dns_capture: Some(false),
            virtual_interfaces: vec![name("eth1"), name("tap0")],
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
        assert_eq!(
            plan.for_pod(&PodRedirectOptions::default())
                .virtual_interfaces,
            []
        );
    }
}
