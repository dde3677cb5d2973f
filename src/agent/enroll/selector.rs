//! `AMBIENT_ENABLEMENT_SELECTOR`: which pods ambient takes, as a list of (pod selector, namespace
//! selector) pairs in Kubernetes `LabelSelector` form (spec §3.1, `cni/pkg/util/enablement_selector.go`).
//!
//! The env value is YAML (JSON is YAML too), a list of entries
//! `{podSelector: <LabelSelector>, namespaceSelector: <LabelSelector>}`. A pod matches when ANY entry
//! has both selectors matching (pod labels, namespace labels). Inside an entry a missing or empty
//! selector matches everything; a list with zero entries matches nothing. Labels and expressions
//! are validated as `metav1.LabelSelectorAsSelector` does (qualified-name keys, label values, the
//! four operators and their value-count rules).
//!
//! Stricter than Istio on purpose: unknown keys (a misspelt `podSelectr`) and `null` entries are
//! errors here, where Istio's YAML decoding ignores them and so turns the entry into "match every
//! pod".

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::Deserialize;

use super::facts::{DATAPLANE_MODE_AMBIENT, DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE};

#[cfg(test)]
mod tests;

/// The env var the selectors are read from (spec §6).
pub const ENV_AMBIENT_ENABLEMENT_SELECTOR: &str = "AMBIENT_ENABLEMENT_SELECTOR";

/// Istio's shipped default (the chart's `values.yaml`, spec §3.1): pod label `ambient` always
/// enrolls; namespace label `ambient` enrolls unless the pod's label is `none`.
/// [`EnablementSelectors::default`] is this list.
pub const ISTIO_DEFAULT_ENABLEMENT_SELECTOR: &str = "\
- podSelector:
    matchLabels:
      istio.io/dataplane-mode: ambient
- podSelector:
    matchExpressions:
    - key: istio.io/dataplane-mode
      operator: NotIn
      values:
      - none
  namespaceSelector:
    matchLabels:
      istio.io/dataplane-mode: ambient
";

/// A compiled Kubernetes label selector: all requirements must hold. No requirements = everything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

/// One requirement of a [`LabelSelector`] (`matchLabels` entries become `In` with one value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    /// Label key (a qualified name).
    pub key: String,
    /// How the label is tested.
    pub operator: Operator,
    /// Values for `In`/`NotIn` (non-empty); empty for `Exists`/`DoesNotExist`.
    pub values: BTreeSet<String>,
}

/// `matchExpressions[].operator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operator {
    /// The label is present with one of the values.
    In,
    /// The label is absent, or present with none of the values.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// One entry: both selectors must match.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EnablementSelector {
    /// Tested against the pod's labels.
    pub pod: LabelSelector,
    /// Tested against the pod's namespace's labels.
    pub namespace: LabelSelector,
}

/// The parsed `AMBIENT_ENABLEMENT_SELECTOR` list. `Default` is Istio's shipped default
/// ([`ISTIO_DEFAULT_ENABLEMENT_SELECTOR`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnablementSelectors {
    entries: Vec<EnablementSelector>,
}

/// Which selector of an entry a problem is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectorField {
    /// `podSelector`.
    Pod,
    /// `namespaceSelector`.
    Namespace,
}

/// What is wrong with one selector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorProblem {
    /// A label key that is not a qualified name (`[prefix/]name`).
    #[error("label key {key:?} is invalid: {why}")]
    Key {
        /// The key.
        key: String,
        /// The broken rule.
        why: &'static str,
    },
    /// A value that is not a valid label value.
    #[error("value {value:?} of label key {key:?} is invalid: {why}")]
    Value {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// The broken rule.
        why: &'static str,
    },
    /// Not one of `In`, `NotIn`, `Exists`, `DoesNotExist`.
    #[error("operator {operator:?} of key {key:?} is not one of In, NotIn, Exists, DoesNotExist")]
    Operator {
        /// The key.
        key: String,
        /// The operator as written.
        operator: String,
    },
    /// `In`/`NotIn` without values.
    #[error("operator {operator:?} of key {key:?} needs at least one value")]
    ValuesRequired {
        /// The key.
        key: String,
        /// The operator.
        operator: &'static str,
    },
    /// `Exists`/`DoesNotExist` with values.
    #[error("operator {operator:?} of key {key:?} takes no values")]
    ValuesForbidden {
        /// The key.
        key: String,
        /// The operator.
        operator: &'static str,
    },
}

/// Why a selector list was refused. Every variant names the variable (or config key) and the value.
#[derive(Debug, thiserror::Error)]
pub enum SelectorError {
    /// Not YAML, or not a list of `{podSelector, namespaceSelector}` entries.
    #[error(
        "{variable}={value:?} is not a YAML list of {{podSelector, namespaceSelector}} entries: {error}"
    )]
    Syntax {
        /// Env var or config key the value came from.
        variable: String,
        /// The value as given.
        value: String,
        /// The decoder's message (with line and column).
        #[source]
        error: serde_yaml_ng::Error,
    },
    /// Well-formed, but a selector cannot be compiled.
    #[error("{variable}={value:?}: entry {index}, {field}: {problem}")]
    Invalid {
        /// Env var or config key the value came from.
        variable: String,
        /// The value as given.
        value: String,
        /// Index of the entry in the list.
        index: usize,
        /// The selector of the entry.
        field: SelectorField,
        /// What is wrong.
        #[source]
        problem: SelectorProblem,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawEntry {
    pod_selector: Option<RawLabelSelector>,
    namespace_selector: Option<RawLabelSelector>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawLabelSelector {
    match_labels: Option<BTreeMap<String, String>>,
    match_expressions: Option<Vec<RawRequirement>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequirement {
    key: String,
    operator: String,
    values: Option<Vec<String>>,
}

// === impl LabelSelector ===

impl LabelSelector {
    /// The selector that matches every label set.
    pub fn everything() -> LabelSelector {
        LabelSelector::default()
    }

    /// A selector of checked requirements.
    pub fn new(requirements: Vec<Requirement>) -> Result<LabelSelector, SelectorProblem> {
        for r in &requirements {
            r.validate()?;
        }
        Ok(LabelSelector { requirements })
    }

    /// True when the selector has no requirements (matches everything).
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    /// The requirements, `matchLabels` first (by key), then `matchExpressions` in order.
    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// True when every requirement holds for `labels`.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    fn from_raw(raw: Option<RawLabelSelector>) -> Result<LabelSelector, SelectorProblem> {
        let Some(raw) = raw else {
            return Ok(LabelSelector::everything());
        };
        let mut requirements = Vec::new();
        for (key, value) in raw.match_labels.unwrap_or_default() {
            requirements.push(Requirement::one_of(Operator::In, key, [value]));
        }
        for expr in raw.match_expressions.unwrap_or_default() {
            let operator =
                Operator::parse(&expr.operator).ok_or_else(|| SelectorProblem::Operator {
                    key: expr.key.clone(),
                    operator: expr.operator.clone(),
                })?;
            let values = expr.values.unwrap_or_default();
            requirements.push(Requirement::one_of(operator, expr.key, values));
        }
        LabelSelector::new(requirements)
    }
}

// === impl Requirement ===

impl Requirement {
    /// A requirement (not yet validated; [`LabelSelector::new`] checks it).
    pub fn one_of(
        operator: Operator,
        key: impl Into<String>,
        values: impl IntoIterator<Item = impl Into<String>>,
    ) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.into_iter().map(Into::into).collect(),
        }
    }

    /// True when the requirement holds for `labels`.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }

    fn validate(&self) -> Result<(), SelectorProblem> {
        validate_key(&self.key).map_err(|why| SelectorProblem::Key {
            key: self.key.clone(),
            why,
        })?;
        match self.operator {
            Operator::In | Operator::NotIn if self.values.is_empty() => {
                return Err(SelectorProblem::ValuesRequired {
                    key: self.key.clone(),
                    operator: self.operator.as_str(),
                });
            }
            Operator::Exists | Operator::DoesNotExist if !self.values.is_empty() => {
                return Err(SelectorProblem::ValuesForbidden {
                    key: self.key.clone(),
                    operator: self.operator.as_str(),
                });
            }
            _ => {}
        }
        for value in &self.values {
            validate_value(value).map_err(|why| SelectorProblem::Value {
                key: self.key.clone(),
                value: value.clone(),
                why,
            })?;
        }
        Ok(())
    }
}

// === impl Operator ===

impl Operator {
    /// Parses the operator as Kubernetes spells it (case-sensitive).
    pub fn parse(s: &str) -> Option<Operator> {
        match s {
            "In" => Some(Operator::In),
            "NotIn" => Some(Operator::NotIn),
            "Exists" => Some(Operator::Exists),
            "DoesNotExist" => Some(Operator::DoesNotExist),
            _ => None,
        }
    }

    /// The Kubernetes spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Operator::In => "In",
            Operator::NotIn => "NotIn",
            Operator::Exists => "Exists",
            Operator::DoesNotExist => "DoesNotExist",
        }
    }
}

// === impl EnablementSelector ===

impl EnablementSelector {
    /// True when both selectors match.
    pub fn matches(
        &self,
        pod_labels: &BTreeMap<String, String>,
        namespace_labels: &BTreeMap<String, String>,
    ) -> bool {
        self.pod.matches(pod_labels) && self.namespace.matches(namespace_labels)
    }
}

// === impl EnablementSelectors ===

impl EnablementSelectors {
    /// A list of entries (zero entries enroll nothing).
    pub fn new(entries: Vec<EnablementSelector>) -> EnablementSelectors {
        EnablementSelectors { entries }
    }

    /// Parses `value` (YAML or JSON), as read from `variable` (named in errors). Empty or
    /// whitespace-only text and `null` are the empty list, as in Istio.
    ///
    /// # Errors
    /// [`SelectorError::Syntax`] for text that is not a list of entries (unknown keys included),
    /// [`SelectorError::Invalid`] for a selector Kubernetes would refuse.
    pub fn parse(variable: &str, value: &str) -> Result<EnablementSelectors, SelectorError> {
        if value.trim().is_empty() {
            return Ok(EnablementSelectors::new(Vec::new()));
        }
        let raw: Option<Vec<RawEntry>> =
            serde_yaml_ng::from_str(value).map_err(|error| SelectorError::Syntax {
                variable: variable.to_owned(),
                value: value.to_owned(),
                error,
            })?;
        let invalid = |index, field, problem| SelectorError::Invalid {
            variable: variable.to_owned(),
            value: value.to_owned(),
            index,
            field,
            problem,
        };
        let mut entries = Vec::new();
        for (index, entry) in raw.unwrap_or_default().into_iter().enumerate() {
            let pod = LabelSelector::from_raw(entry.pod_selector)
                .map_err(|p| invalid(index, SelectorField::Pod, p))?;
            let namespace = LabelSelector::from_raw(entry.namespace_selector)
                .map_err(|p| invalid(index, SelectorField::Namespace, p))?;
            entries.push(EnablementSelector { pod, namespace });
        }
        Ok(EnablementSelectors::new(entries))
    }

    /// The entries, in configuration order.
    pub fn entries(&self) -> &[EnablementSelector] {
        &self.entries
    }

    /// True with zero entries (nothing is ever enrolled).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Index of the first entry matching the pod and namespace labels, if any (Istio's `Matches`
    /// without its hostNetwork/sidecar checks, which [`super::EnrollmentRules::decide`] applies).
    pub fn first_match(
        &self,
        pod_labels: &BTreeMap<String, String>,
        namespace_labels: &BTreeMap<String, String>,
    ) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| e.matches(pod_labels, namespace_labels))
    }

    /// True when a non-empty namespace selector matches `namespace_labels` (Istio's
    /// `MatchesNamespace`): the agent re-examines a namespace's pods only when this flips (spec §3.3).
    pub fn matches_namespace(&self, namespace_labels: &BTreeMap<String, String>) -> bool {
        self.entries
            .iter()
            .any(|e| !e.namespace.is_empty() && e.namespace.matches(namespace_labels))
    }
}

impl Default for EnablementSelectors {
    fn default() -> EnablementSelectors {
        let ambient = |op| Requirement::one_of(op, DATAPLANE_MODE_LABEL, [DATAPLANE_MODE_AMBIENT]);
        let not_none =
            Requirement::one_of(Operator::NotIn, DATAPLANE_MODE_LABEL, [DATAPLANE_MODE_NONE]);
        EnablementSelectors::new(vec![
            EnablementSelector {
                pod: LabelSelector {
                    requirements: vec![ambient(Operator::In)],
                },
                namespace: LabelSelector::everything(),
            },
            EnablementSelector {
                pod: LabelSelector {
                    requirements: vec![not_none],
                },
                namespace: LabelSelector {
                    requirements: vec![ambient(Operator::In)],
                },
            },
        ])
    }
}

impl FromStr for EnablementSelectors {
    type Err = SelectorError;

    /// [`EnablementSelectors::parse`] with errors naming [`ENV_AMBIENT_ENABLEMENT_SELECTOR`].
    fn from_str(s: &str) -> Result<EnablementSelectors, SelectorError> {
        EnablementSelectors::parse(ENV_AMBIENT_ENABLEMENT_SELECTOR, s)
    }
}

impl fmt::Display for SelectorField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SelectorField::Pod => "podSelector",
            SelectorField::Namespace => "namespaceSelector",
        })
    }
}

/// Kubernetes `IsQualifiedName`: `[prefix/]name`, prefix a DNS-1123 subdomain.
fn validate_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Err("prefix part must be non-empty");
        }
        validate_dns_subdomain(prefix)?;
    }
    if name.is_empty() {
        return Err("name part must be non-empty");
    }
    validate_name_chars(name)
}

/// A label value: empty, or a name of at most 63 characters.
fn validate_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() {
        return Ok(());
    }
    validate_name_chars(value)
}

/// At most 63 of `[A-Za-z0-9_.-]`, alphanumeric at both ends.
fn validate_name_chars(s: &str) -> Result<(), &'static str> {
    if s.len() > 63 {
        return Err("must be at most 63 characters");
    }
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if !s.chars().all(ok) {
        return Err("may contain only letters, digits, '-', '_' and '.'");
    }
    let alnum_ends = s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric());
    if !alnum_ends {
        return Err("must start and end with a letter or digit");
    }
    Ok(())
}

/// DNS-1123 subdomain: at most 253 characters, dot-separated lowercase labels.
fn validate_dns_subdomain(s: &str) -> Result<(), &'static str> {
    if s.len() > 253 {
        return Err("prefix part must be at most 253 characters");
    }
    for label in s.split('.') {
        let ok = !label.is_empty()
            && label
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err("prefix part must be a DNS-1123 subdomain (lowercase, digits, '-', '.')");
        }
    }
    Ok(())
}
