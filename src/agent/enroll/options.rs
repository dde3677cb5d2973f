//! Per-pod redirection options read from annotations (spec §3.1, `nodeagent/net.go`
//! `getPodLevelTrafficOverrides`).
//!
//! Bad values never fail a pod: as in Istio, a value that does not parse is ignored (the option
//! keeps its default) and an [`AnnotationWarning`] says why, for the caller to log.

use std::collections::BTreeMap;
use std::fmt;

use super::facts::{
    BYPASS_INBOUND_CAPTURE_ANNOTATION, DNS_CAPTURE_ANNOTATION,
    REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
};

/// Longest Linux interface name (`IFNAMSIZ - 1`).
pub const MAX_INTERFACE_NAME_LEN: usize = 15;

/// The options of one enrolled pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
    pub warnings: Vec<AnnotationWarning>,
}

/// A Linux interface name: 1 to 15 bytes, no `/`, `:` or whitespace, not `.` or `..` (the
/// kernel's `dev_valid_name`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InterfaceName(String);

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
                    Some(name) => opts.reroute_virtual_interfaces.push(name),
                    None => opts.warnings.push(AnnotationWarning {
                        annotation: REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
                        value: item.to_owned(),
                        expected: "a Linux interface name (1-15 bytes, no '/', ':' or whitespace)",
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

impl InterfaceName {
    /// `Some` when `name` is a valid Linux interface name (see the type's docs).
    pub fn new(name: &str) -> Option<InterfaceName> {
        let valid = !name.is_empty()
            && name.len() <= MAX_INTERFACE_NAME_LEN
            && name != "."
            && name != ".."
            && !name
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace());
        valid.then(|| InterfaceName(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InterfaceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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
