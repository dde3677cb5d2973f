//! Per-pod redirection options read from annotations (spec §3.1, `nodeagent/net.go`
//! `getPodLevelTrafficOverrides`).
//!
//! Bad values never fail a pod: as in Istio, a value that does not parse is ignored (the option
//! keeps its default) and an [`AnnotationWarning`] says why, for the caller to log.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use super::facts::{
    BYPASS_INBOUND_CAPTURE_ANNOTATION, DNS_CAPTURE_ANNOTATION,
    REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
};

/// The options of one enrolled pod.
/// Stored with an enrolled pod (`pods.json`, `/config_dump`) without its warnings, so a restarted
/// agent re-applies the same rules.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PodOptions {
    /// `ambient.istio.io/bypass-inbound-capture`: no inbound redirection ("ingress mode").
    /// Default false.
    pub bypass_inbound_capture: bool,
    /// `ambient.istio.io/dns-capture`: `Some` overrides the global DNS capture
    /// (`AMBIENT_DNS_CAPTURE`) for this pod; `None` keeps it. See [`PodOptions::dns_capture`].
    pub dns_capture_override: Option<bool>,
    /// `istio.io/reroute-virtual-interfaces`: in-pod interfaces whose traffic is captured as
    /// outbound, in annotation order.
    pub reroute_virtual_interfaces: Vec<InterfaceName>,
    /// Annotation values that were ignored, and why.
    #[serde(skip)]
    pub warnings: Vec<AnnotationWarning>,
}

/// An annotation value that was ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationWarning {
    /// The annotation key.
    pub annotation: &'static str,
    /// The offending value (for the interface list: the one bad item).
    pub value: String,
    /// What was expected.
    pub expected: &'static str,
}

// === impl PodOptions ===

impl PodOptions {
    /// Reads the options from a pod's annotations. Never fails; see the module docs.
    ///
    /// Booleans take Go's `strconv.ParseBool` spellings (`1 t T TRUE true True`, `0 f F FALSE
    /// false False`), as Istio's `CheckBooleanAnnotation`. The interface list is split on `,`,
    /// items trimmed, empty items dropped; items that cannot name a Linux interface are dropped
    /// with a warning (no interface can match them, so capture is unchanged).
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> PodOptions {
        let mut opts = PodOptions::default();
        if let Some(v) = opts.bool_annotation(annotations, BYPASS_INBOUND_CAPTURE_ANNOTATION) {
            opts.bypass_inbound_capture = v;
        }
        opts.dns_capture_override = opts.bool_annotation(annotations, DNS_CAPTURE_ANNOTATION);
        if let Some(list) = annotations.get(REROUTE_VIRTUAL_INTERFACES_ANNOTATION) {
            for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match InterfaceName::new(item) {
                    Ok(name) => opts.reroute_virtual_interfaces.push(name),
                    Err(_) => opts.warnings.push(AnnotationWarning {
                        annotation: REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
                        value: item.to_owned(),
                        expected: "an interface name (1-15 bytes of A-Z a-z 0-9 - _ . @)",
                    }),
                }
            }
        }
        opts
    }

    /// The effective DNS capture of the pod given the global setting.
    pub fn dns_capture(&self, global: bool) -> bool {
        self.dns_capture_override.unwrap_or(global)
    }

    fn bool_annotation(
        &mut self,
        annotations: &BTreeMap<String, String>,
        key: &'static str,
    ) -> Option<bool> {
        let value = annotations.get(key)?;
        let parsed = parse_go_bool(value);
        if parsed.is_none() {
            self.warnings.push(AnnotationWarning {
                annotation: key,
                value: value.clone(),
                expected: "a boolean (true/false, 1/0, t/f)",
            });
        }
        parsed
    }
}

/// Go's `strconv.ParseBool`.
pub fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

// === impl InterfaceName ===

/// Longest interface name Linux accepts (`IFNAMSIZ` 16, minus the terminating NUL).
pub const MAX_INTERFACE_NAME_LEN: usize = 15;

/// A network interface name as the kernel (and an nf_tables `iifname` match) sees it: 1 to 15
/// bytes of ASCII letters, digits, `-`, `_`, `.` or `@`, and not `.` or `..`.
///
/// Stricter than Linux's `dev_valid_name`: characters that `nft` would read as syntax inside a
/// quoted name (`"`, `\`, a `*` wildcard) or that rarely appear in pod interface names are refused,
/// so the rule we program and the script we print (`redirect::render_script`) always mean the same
/// exact-name match.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
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

impl TryFrom<String> for InterfaceName {
    type Error = InterfaceNameError;

    /// Same as [`InterfaceName::new`] (used when a stored name is read back).
    fn try_from(s: String) -> Result<InterfaceName, InterfaceNameError> {
        InterfaceName::new(&s)
    }
}

impl From<InterfaceName> for String {
    fn from(n: InterfaceName) -> String {
        n.0
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

// === impl AnnotationWarning ===

impl fmt::Display for AnnotationWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "annotation {}={:?} ignored: expected {}",
            self.annotation, self.value, self.expected
        )
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
}
