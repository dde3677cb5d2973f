//! The plugin's inputs besides env: the network config on stdin and the Kubernetes `CNI_ARGS`.
//!
//! Parsing is two-step, in skel's order (`../shared/spec/cni.md` §1): [`ConfHeader::parse`] checks the JSON
//! and the network `name`; after the caller's version gate, [`NetConf::from_header`] reads ztnode's
//! keys (`cni_agent_run_dir`, `exclude_namespaces`, `plugin_log_level`, as istio-cni's `Config`,
//! `../shared/spec/istio-cni.md` §1.2). Unknown keys are ignored.
//!
//! Kubernetes mode is on when the key `kubeconfig` is present ([`KubeConf`]); then
//! `ambient_enablement_selector` and `ztnode_namespace` are read too and, with
//! `exclude_namespaces`, make the same [`EnrollmentRules`] the agent uses. Without `kubeconfig`
//! those two keys are ignored like any unknown key.

use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::agent::enroll::{
    EnablementSelectors, EnrollmentRules, ExcludedNamespaces, OwnPods, SelectorError,
};
use crate::mesh::{DEFAULT_EXCLUDED_NAMESPACES, DEFAULT_RUN_DIR};

use super::log::Level;

/// Why the config on stdin was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    /// stdin is not valid JSON.
    #[error("decoding network config: {source}")]
    Json {
        /// The serde error (line and column included).
        #[source]
        source: serde_json::Error,
    },
    /// stdin is valid JSON but not an object.
    #[error("network config must be a JSON object, got {kind}")]
    NotObject {
        /// JSON type found instead.
        kind: &'static str,
    },
    /// `name` is absent or empty (skel's exact message).
    #[error("missing network name")]
    MissingName,
    /// `name` does not match `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`.
    #[error(
        "invalid network name {name:?}: must start with a letter or digit and contain only letters, digits, '_', '.' and '-'"
    )]
    InvalidName {
        /// The offending value.
        name: String,
    },
    /// A known key has the wrong JSON type or an unusable value.
    #[error("invalid config key {key:?} = {value}: {expected}")]
    InvalidKey {
        /// Key name.
        key: &'static str,
        /// The value as JSON text.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// `ambient_enablement_selector` is not a valid selector list (the source names the key and
    /// the value).
    #[error("invalid config key: {source}")]
    Selector {
        /// Why the selector text was refused (boxed: it is large).
        #[source]
        source: Box<SelectorError>,
    },
}

/// A decoded config whose `name` is valid; the version is not checked yet.
#[derive(Debug, Clone)]
pub struct ConfHeader {
    /// The whole config object.
    pub map: Map<String, Value>,
    /// Network name.
    pub name: String,
    /// `cniVersion` as given; `None` when absent (CNI reads that as "0.1.0").
    pub version: Option<String>,
}

/// Validated plugin config.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// Network name.
    pub name: String,
    /// Directory holding the agent's `pluginevent.sock`.
    pub run_dir: PathBuf,
    /// Pods in these namespaces never reach the agent.
    pub exclude_namespaces: Vec<String>,
    /// Log level from `plugin_log_level`; `None` keeps the default.
    pub log_level: Option<Level>,
    /// `prevResult`, unparsed (it is parsed by its own `cniVersion`, see `result`).
    pub prev_result: Option<Value>,
    /// GC's list of still-valid attachments (`cni.dev/valid-attachments` or legacy `cni.dev/attachments`).
    pub valid_attachments: Option<Vec<Value>>,
    /// Kubernetes mode: present when the key `kubeconfig` is.
    pub kube: Option<KubeConf>,
}

/// Kubernetes mode's settings: the plugin asks the API server about each pod and decides like the
/// agent (`../shared/spec/istio-cni.md` §1.4 steps 3-8).
#[derive(Debug, Clone, PartialEq)]
pub struct KubeConf {
    /// `kubeconfig`: absolute path of the kubeconfig the installer wrote.
    pub kubeconfig: PathBuf,
    /// The agent's rules: selectors from `ambient_enablement_selector` (absent = Istio's default
    /// selectors; `""` = nothing enrolled), excluded namespaces from `exclude_namespaces`, own pods
    /// in `ztnode_namespace` (absent or empty = `istio-system`), the defaults of
    /// `EnrollmentRules::from_env`.
    pub rules: EnrollmentRules,
}

/// The Kubernetes keys of `CNI_ARGS`. Empty values count as absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct K8sArgs {
    /// `K8S_POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME`.
    pub pod_name: Option<String>,
    /// `K8S_POD_UID` (old runtimes do not send it).
    pub pod_uid: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID` (the sandbox id).
    pub infra_container_id: Option<String>,
}

// === impl ConfHeader ===

impl ConfHeader {
    /// Decodes stdin and checks `name`. Errors: [`ConfError::Json`], [`ConfError::NotObject`] (decode),
    /// [`ConfError::MissingName`], [`ConfError::InvalidName`], or [`ConfError::InvalidKey`] for a
    /// non-string `name`/`cniVersion`.
    pub fn parse(bytes: &[u8]) -> Result<ConfHeader, ConfError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|source| ConfError::Json { source })?;
        let Value::Object(map) = value else {
            return Err(ConfError::NotObject {
                kind: json_kind(&value),
            });
        };
        let name = match optional_string(&map, "name")? {
            None => return Err(ConfError::MissingName),
            Some(n) if n.is_empty() => return Err(ConfError::MissingName),
            Some(n) if !valid_identifier(&n) => return Err(ConfError::InvalidName { name: n }),
            Some(n) => n,
        };
        let version = optional_string(&map, "cniVersion")?;
        Ok(ConfHeader { map, name, version })
    }

    /// Best-effort `cniVersion` of a raw stdin, for error objects and VERSION; never fails.
    pub fn sniff_version(bytes: &[u8]) -> Option<String> {
        let value: Value = serde_json::from_slice(bytes).ok()?;
        value.get("cniVersion")?.as_str().map(str::to_owned)
    }
}

// === impl NetConf ===

impl NetConf {
    /// Reads ztnode's keys. Absent keys take their defaults; `exclude_namespaces: null` or `[]` means
    /// no exclusion. Errors: [`ConfError::InvalidKey`] naming the key and value.
    pub fn from_header(header: ConfHeader) -> Result<NetConf, ConfError> {
        let map = header.map;
        let run_dir = match optional_string(&map, "cni_agent_run_dir")? {
            None => PathBuf::from(DEFAULT_RUN_DIR),
            Some(dir) if dir.starts_with('/') => PathBuf::from(dir),
            Some(dir) => {
                return Err(ConfError::InvalidKey {
                    key: "cni_agent_run_dir",
                    value: Value::String(dir).to_string(),
                    expected: "an absolute path",
                });
            }
        };
        let exclude_namespaces = match map.get("exclude_namespaces") {
            None => DEFAULT_EXCLUDED_NAMESPACES
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            Some(Value::Null) => Vec::new(),
            Some(v) => string_list(v).ok_or_else(|| ConfError::InvalidKey {
                key: "exclude_namespaces",
                value: v.to_string(),
                expected: "a list of strings or null",
            })?,
        };
        let log_level = match optional_string(&map, "plugin_log_level")? {
            None => None,
            Some(s) if s.is_empty() => None,
            Some(s) => Some(Level::parse(&s).ok_or_else(|| ConfError::InvalidKey {
                key: "plugin_log_level",
                value: Value::String(s.clone()).to_string(),
                expected: "one of debug, info, warn, error, none",
            })?),
        };
        let prev_result = map.get("prevResult").filter(|v| !v.is_null()).cloned();
        let valid_attachments = ["cni.dev/valid-attachments", "cni.dev/attachments"]
            .iter()
            .find_map(|k| map.get(*k).and_then(Value::as_array).cloned());
        let kube = KubeConf::from_map(&map, &exclude_namespaces)?;
        Ok(NetConf {
            name: header.name,
            run_dir,
            exclude_namespaces,
            log_level,
            prev_result,
            valid_attachments,
            kube,
        })
    }

    /// True if pods of `namespace` must not be sent to the agent.
    pub fn is_excluded(&self, namespace: &str) -> bool {
        self.exclude_namespaces.iter().any(|n| n == namespace)
    }
}

// === impl KubeConf ===

impl KubeConf {
    /// Entry key naming the plugin's kubeconfig; its presence turns Kubernetes mode on.
    pub const KEY_KUBECONFIG: &'static str = "kubeconfig";
    /// Entry key with the raw `AMBIENT_ENABLEMENT_SELECTOR` text.
    pub const KEY_SELECTOR: &'static str = "ambient_enablement_selector";
    /// Entry key with the namespace of ztnode's own pods.
    pub const KEY_NAMESPACE: &'static str = "ztnode_namespace";

    /// Reads Kubernetes mode's keys; `Ok(None)` without `kubeconfig` (or with it `null`).
    /// Errors: [`ConfError::InvalidKey`] for a non-string or relative `kubeconfig` or a non-string
    /// selector or namespace, [`ConfError::Selector`] for selector text that does not parse.
    fn from_map(
        map: &Map<String, Value>,
        exclude_namespaces: &[String],
    ) -> Result<Option<KubeConf>, ConfError> {
        let kubeconfig = match optional_string(map, Self::KEY_KUBECONFIG)? {
            None => return Ok(None),
            Some(path) if path.starts_with('/') => PathBuf::from(path),
            Some(path) => {
                return Err(ConfError::InvalidKey {
                    key: Self::KEY_KUBECONFIG,
                    value: Value::String(path).to_string(),
                    expected: "an absolute path",
                });
            }
        };
        let selectors = match optional_string(map, Self::KEY_SELECTOR)? {
            None => EnablementSelectors::default(),
            Some(text) => EnablementSelectors::parse(Self::KEY_SELECTOR, &text).map_err(|e| {
                ConfError::Selector {
                    source: Box::new(e),
                }
            })?,
        };
        let own = optional_string(map, Self::KEY_NAMESPACE)?
            .filter(|ns| !ns.is_empty())
            .map(OwnPods::new)
            .unwrap_or_default();
        Ok(Some(KubeConf {
            kubeconfig,
            rules: EnrollmentRules {
                selectors,
                excluded: ExcludedNamespaces::new(exclude_namespaces.iter().cloned()),
                own,
            },
        }))
    }
}

// === impl K8sArgs ===

impl K8sArgs {
    /// Parses `CNI_ARGS` (`K=V;K=V`): empty pieces and pieces without `=` are skipped, each piece splits on
    /// its first `=`, unknown keys (including `IgnoreUnknown`) are ignored. Never fails.
    pub fn parse(cni_args: &str) -> K8sArgs {
        let mut args = K8sArgs::default();
        for (key, value) in cni_args.split(';').filter_map(|p| p.split_once('=')) {
            let slot = match key {
                "K8S_POD_NAMESPACE" => &mut args.pod_namespace,
                "K8S_POD_NAME" => &mut args.pod_name,
                "K8S_POD_UID" => &mut args.pod_uid,
                "K8S_POD_INFRA_CONTAINER_ID" => &mut args.infra_container_id,
                _ => continue,
            };
            *slot = Some(value.to_owned()).filter(|v| !v.is_empty());
        }
        args
    }

    /// `(namespace, name)` when both are present, i.e. when this is a Kubernetes pod.
    pub fn pod(&self) -> Option<(&str, &str)> {
        Some((self.pod_namespace.as_deref()?, self.pod_name.as_deref()?))
    }
}

/// CNI's identifier rule for network names and container ids: `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`.
pub fn valid_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn optional_string(
    map: &Map<String, Value>,
    key: &'static str,
) -> Result<Option<String>, ConfError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ConfError::InvalidKey {
            key,
            value: other.to_string(),
            expected: "a string",
        }),
    }
}

fn string_list(v: &Value) -> Option<Vec<String>> {
    v.as_array()?
        .iter()
        .map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// JSON type name of `v`, for messages.
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conf(v: Value) -> Result<NetConf, ConfError> {
        NetConf::from_header(ConfHeader::parse(v.to_string().as_bytes())?)
    }

    #[test]
    fn defaults_when_keys_absent() {
        let c =
            conf(json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "ztnode-cni"}))
                .expect("valid");
        assert_eq!(c.run_dir, PathBuf::from("/var/run/ztnode"));
        assert_eq!(c.exclude_namespaces, vec!["kube-system".to_owned()]);
        assert!(c.is_excluded("kube-system"));
        assert_eq!(c.log_level, None);
        assert_eq!(c.prev_result, None);
    }

    #[test]
    fn reads_our_keys_and_ignores_unknown_ones() {
        let c = conf(json!({"name": "n", "cni_agent_run_dir": "/run/x", "exclude_namespaces": ["a", "b"],
            "plugin_log_level": "debug", "ipam": {}, "dns": {}, "capabilities": {"x": true},
            "kubernetes": {"kubeconfig": "/k"}, "ambient_enabled": true, "prevResult": {"ips": []}}))
        .expect("valid");
        assert_eq!(c.run_dir, PathBuf::from("/run/x"));
        assert_eq!(c.exclude_namespaces, vec!["a".to_owned(), "b".to_owned()]);
        assert!(!c.is_excluded("kube-system"));
        assert_eq!(c.log_level, Some(Level::Debug));
        assert_eq!(c.prev_result, Some(json!({"ips": []})));
    }

    #[test]
    fn kubernetes_mode_needs_the_kubeconfig_key() {
        let c =
            conf(json!({"name": "n", "ambient_enablement_selector": "[", "ztnode_namespace": 1}))
                .expect("without kubeconfig the kube keys are unknown keys");
        assert_eq!(c.kube, None);

        let c = conf(json!({"name": "n", "kubeconfig": "/run/z/ztnode-cni-kubeconfig"}))
            .expect("valid");
        let kube = c.kube.expect("kube mode");
        assert_eq!(
            kube.kubeconfig,
            PathBuf::from("/run/z/ztnode-cni-kubeconfig")
        );
        assert_eq!(
            kube.rules,
            EnrollmentRules::default(),
            "the agent's defaults"
        );

        let c = conf(
            json!({"name": "n", "kubeconfig": "/k", "exclude_namespaces": ["a"],
            "ztnode_namespace": "mesh", "ambient_enablement_selector": ""}),
        )
        .expect("valid");
        let rules = c.kube.expect("kube mode").rules;
        assert!(rules.selectors.is_empty(), "set but empty enrolls nothing");
        assert!(rules.excluded.contains("a") && !rules.excluded.contains("kube-system"));
        assert_eq!(rules.own, OwnPods::new("mesh"));

        let c = conf(
            json!({"name": "n", "kubeconfig": "/k", "exclude_namespaces": null,
            "ztnode_namespace": ""}),
        )
        .expect("valid");
        let rules = c.kube.expect("kube mode").rules;
        assert_eq!(rules.excluded.iter().count(), 0);
        assert_eq!(rules.own, OwnPods::default());
    }

    #[test]
    fn bad_selector_is_an_error_naming_the_key() {
        for text in [
            "[",
            "- podSelectr: {}",
            "- podSelector: {matchLabels: {\"bad key!\": x}}",
        ] {
            let err =
                conf(json!({"name": "n", "kubeconfig": "/k", "ambient_enablement_selector": text}))
                    .expect_err(text);
            assert!(matches!(err, ConfError::Selector { .. }), "{text}: {err:?}");
            assert!(
                err.to_string().contains("ambient_enablement_selector"),
                "{err}"
            );
        }
        for (v, key) in [
            (json!({"name": "n", "kubeconfig": "rel/kc"}), "kubeconfig"),
            (json!({"name": "n", "kubeconfig": 7}), "kubeconfig"),
            (
                json!({"name": "n", "kubeconfig": "/k", "ambient_enablement_selector": []}),
                "ambient_enablement_selector",
            ),
            (
                json!({"name": "n", "kubeconfig": "/k", "ztnode_namespace": false}),
                "ztnode_namespace",
            ),
        ] {
            match conf(v.clone()) {
                Err(e @ ConfError::InvalidKey { .. }) => {
                    assert!(e.to_string().contains(key), "{e}")
                }
                other => panic!("{v}: {other:?}"),
            }
        }
    }

    #[test]
    fn null_or_empty_exclusion_means_none() {
        for v in [Value::Null, json!([])] {
            let c = conf(json!({"name": "n", "exclude_namespaces": v})).expect("valid");
            assert!(c.exclude_namespaces.is_empty());
        }
    }

    #[test]
    fn wrong_types_name_the_key() {
        let cases = [
            (
                json!({"name": "n", "exclude_namespaces": 5}),
                "exclude_namespaces",
            ),
            (
                json!({"name": "n", "exclude_namespaces": ["a", 1]}),
                "exclude_namespaces",
            ),
            (
                json!({"name": "n", "cni_agent_run_dir": 1}),
                "cni_agent_run_dir",
            ),
            (
                json!({"name": "n", "cni_agent_run_dir": "rel/dir"}),
                "cni_agent_run_dir",
            ),
            (
                json!({"name": "n", "plugin_log_level": "loud"}),
                "plugin_log_level",
            ),
            (json!({"name": "n", "cniVersion": 1}), "cniVersion"),
        ];
        for (v, key) in cases {
            match conf(v.clone()) {
                Err(e @ ConfError::InvalidKey { .. }) => {
                    assert!(e.to_string().contains(key), "{e}")
                }
                other => panic!("{v}: {other:?}"),
            }
        }
    }

    #[test]
    fn name_and_decode_errors() {
        assert!(matches!(
            ConfHeader::parse(b"{"),
            Err(ConfError::Json { .. })
        ));
        assert!(matches!(
            ConfHeader::parse(b"[1]"),
            Err(ConfError::NotObject { .. })
        ));
        assert!(matches!(
            ConfHeader::parse(b"{}"),
            Err(ConfError::MissingName)
        ));
        assert!(matches!(
            ConfHeader::parse(br#"{"name":""}"#),
            Err(ConfError::MissingName)
        ));
        assert!(matches!(
            ConfHeader::parse(br#"{"name":"-bad"}"#),
            Err(ConfError::InvalidName { .. })
        ));
        let h = ConfHeader::parse(br#"{"name":"a.b_c-1"}"#).expect("valid name");
        assert_eq!(h.version, None);
    }

    #[test]
    fn identifiers() {
        for ok in ["a", "0", "k8s-pod-network", "a.b_c-d", "ABC123"] {
            assert!(valid_identifier(ok), "{ok}");
        }
        for bad in ["", "-a", ".a", "_a", "a b", "a/b", "a:b", "é"] {
            assert!(!valid_identifier(bad), "{bad}");
        }
    }

    #[test]
    fn gc_accepts_both_attachment_keys() {
        for key in ["cni.dev/valid-attachments", "cni.dev/attachments"] {
            let c = conf(json!({"name": "n", key: [{"containerID": "c", "ifname": "eth0"}]}))
                .expect("valid");
            assert_eq!(c.valid_attachments.map(|a| a.len()), Some(1), "{key}");
        }
    }

    #[test]
    fn cni_args_parsing() {
        let a = K8sArgs::parse(
            ";IgnoreUnknown=1;K8S_POD_NAMESPACE=default;;K8S_POD_NAME=web-0;FOO;BAR=x=y;\
             K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1;",
        );
        assert_eq!(a.pod(), Some(("default", "web-0")));
        assert_eq!(a.pod_uid.as_deref(), Some("u-1"));
        assert_eq!(a.infra_container_id.as_deref(), Some("abc"));

        let a = K8sArgs::parse("K8S_POD_NAME=a=b;K8S_POD_NAMESPACE=");
        assert_eq!(a.pod_name.as_deref(), Some("a=b"));
        assert_eq!(a.pod(), None, "empty namespace is absent");
        assert_eq!(K8sArgs::parse(""), K8sArgs::default());
        assert_eq!(K8sArgs::parse("IgnoreUnknown=0;X=1").pod(), None);
    }
}
