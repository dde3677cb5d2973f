//! The CNI protocol harness, like Go's `pkg/skel` (`../shared/spec/cni.md` §1, §2, §5, §6): verbs,
//! per-verb env requirements, version gates, and the one place where failures become CNI error codes.

use std::fmt;
use std::path::PathBuf;

use super::client::AgentError;
use super::env::Env;
use super::kube::KubeError;
use super::netconf::{ConfError, K8sArgs, valid_identifier};
use super::result::ResultError;
use super::version::CniVersion;
use serde::Serialize;

/// Env var naming the verb.
pub const ENV_COMMAND: &str = "CNI_COMMAND";
/// Env var with the container (sandbox) id.
pub const ENV_CONTAINERID: &str = "CNI_CONTAINERID";
/// Env var with the pod's netns path.
pub const ENV_NETNS: &str = "CNI_NETNS";
/// Env var with the interface name inside the container.
pub const ENV_IFNAME: &str = "CNI_IFNAME";
/// Env var with `K=V;K=V` extra arguments.
pub const ENV_ARGS: &str = "CNI_ARGS";
/// Env var with the plugin search path.
pub const ENV_PATH: &str = "CNI_PATH";
/// Env var allowing `CNI_NETNS` to be the plugin's own netns (`1`/`true`, any case).
pub const ENV_NETNS_OVERRIDE: &str = "CNI_NETNS_OVERRIDE";

/// A CNI verb (`CNI_COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Attach: tell the agent about the pod, print the result.
    Add,
    /// Detach, best effort.
    Del,
    /// Verify an attachment (config >= 0.4.0).
    Check,
    /// Print supported versions.
    Version,
    /// Readiness (config 1.1.0).
    Status,
    /// Garbage-collect stale attachments (config 1.1.0).
    Gc,
}

/// The `CNI_*` env of one invocation (missing vars are empty strings, as in skel).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CmdArgs {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`; may be empty on DEL.
    pub netns: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// The Kubernetes keys of `CNI_ARGS`.
    pub args: K8sArgs,
    /// `CNI_PATH` (unused: the plugin delegates to nothing).
    pub path: String,
    /// `CNI_NETNS_OVERRIDE` is truthy.
    pub netns_override: bool,
}

/// Every way an invocation can fail. [`PluginError::code`] maps each to its CNI error code.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// `CNI_COMMAND` is not a known verb (skel's message; libcni matches it for VERSION).
    #[error("unknown CNI_COMMAND: {command}")]
    UnknownCommand {
        /// The value given.
        command: String,
    },
    /// Required env vars are missing or empty (skel's message).
    #[error("required env variables [{}] missing", .vars.join(","))]
    MissingEnv {
        /// Names of the missing vars.
        vars: Vec<&'static str>,
    },
    /// An env var has an unusable value.
    #[error("invalid {var} {value:?}: {reason}")]
    InvalidEnv {
        /// The var.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// Reading stdin failed.
    #[error("error reading from stdin: {source}")]
    Stdin {
        /// Underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The config on stdin is malformed or invalid.
    #[error(transparent)]
    Conf(#[from] ConfError),
    /// The config's `cniVersion` is not supported (skel's message; details name the versions).
    #[error("incompatible CNI versions")]
    IncompatibleVersion {
        /// The config's version (`0.1.0` when absent).
        config: String,
    },
    /// The verb does not exist at the config's version (skel's message).
    #[error("config version does not allow {verb}")]
    VerbNotAllowed {
        /// The verb.
        verb: Command,
    },
    /// `prevResult` is malformed or of an unknown version.
    #[error(transparent)]
    PrevResult(#[from] ResultError),
    /// `CNI_NETNS` is the plugin's own netns (a recycled `/proc/<pid>/ns/net`, cni.md §9.7).
    #[error("CNI_NETNS {netns:?} is the host network namespace; refusing to enroll it")]
    HostNetns {
        /// The path given.
        netns: String,
    },
    /// ADD could not hand the pod to the agent (fail closed; the runtime retries the sandbox).
    #[error("ztnode-cni ADD for pod {pod}: the node agent at {} did not enroll it: {source}", .socket.display())]
    AgentAdd {
        /// `namespace/name`.
        pod: String,
        /// The agent socket.
        socket: PathBuf,
        /// What went wrong.
        #[source]
        source: AgentError,
    },
    /// Kubernetes mode: ADD could not classify the pod (kubeconfig unreadable, API server
    /// unreachable or erroring); fails closed, the runtime retries the sandbox (spec §1.4 step 8).
    #[error("ztnode-cni ADD for pod {pod} cannot tell whether the pod is ambient: {source}")]
    Classify {
        /// `namespace/name`.
        pod: String,
        /// What went wrong (boxed: it is large).
        #[source]
        source: Box<KubeError>,
    },
    /// STATUS found no agent listening.
    #[error("node agent socket {} does not accept connections: {source}", .socket.display())]
    AgentStatus {
        /// The agent socket.
        socket: PathBuf,
        /// What went wrong.
        #[source]
        source: AgentError,
    },
}

/// The error object printed on stdout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorReply {
    /// The config's version when known, else the newest supported.
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    /// CNI error code.
    pub code: u32,
    /// Short message.
    pub msg: String,
    /// Longer explanation, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<String>,
}

/// The VERSION reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionReply {
    /// Echo of a supported input version, else the newest.
    #[serde(rename = "cniVersion")]
    pub cni_version: &'static str,
    /// Exactly [`CniVersion::ALL`].
    #[serde(rename = "supportedVersions")]
    pub supported_versions: Vec<&'static str>,
}

// === impl Command ===

impl Command {
    /// Parses the exact upper-case verb.
    pub fn parse(s: &str) -> Option<Command> {
        Some(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            _ => return None,
        })
    }

    /// The verb as spelled in `CNI_COMMAND`.
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Version => "VERSION",
            Command::Status => "STATUS",
            Command::Gc => "GC",
        }
    }

    /// Env vars that must be non-empty, per SPEC.md §2 (`CNI_PATH` only for GC: we delegate nothing).
    pub fn required_env(self) -> &'static [&'static str] {
        match self {
            Command::Add | Command::Check => &[ENV_CONTAINERID, ENV_NETNS, ENV_IFNAME],
            Command::Del => &[ENV_CONTAINERID, ENV_IFNAME],
            Command::Gc => &[ENV_PATH],
            Command::Version | Command::Status => &[],
        }
    }

    /// Oldest config version at which the verb exists.
    pub fn min_version(self) -> CniVersion {
        match self {
            Command::Check => CniVersion::V0_4_0,
            Command::Status | Command::Gc => CniVersion::V1_1_0,
            _ => CniVersion::V0_3_0,
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl CmdArgs ===

impl CmdArgs {
    /// Reads the `CNI_*` vars for `cmd`. Errors (code 4): [`PluginError::MissingEnv`] listing every
    /// missing required var, or [`PluginError::InvalidEnv`] for a malformed container id or ifname.
    pub fn from_env(env: &dyn Env, cmd: Command) -> Result<CmdArgs, PluginError> {
        let get = |k: &str| env.get(k).unwrap_or_default();
        let missing: Vec<&'static str> = cmd
            .required_env()
            .iter()
            .copied()
            .filter(|k| get(k).is_empty())
            .collect();
        if !missing.is_empty() {
            return Err(PluginError::MissingEnv { vars: missing });
        }
        let args = CmdArgs {
            container_id: get(ENV_CONTAINERID),
            netns: get(ENV_NETNS),
            ifname: get(ENV_IFNAME),
            args: K8sArgs::parse(&get(ENV_ARGS)),
            path: get(ENV_PATH),
            netns_override: matches!(
                get(ENV_NETNS_OVERRIDE).to_ascii_lowercase().as_str(),
                "1" | "true"
            ),
        };
        if !args.container_id.is_empty() && !valid_identifier(&args.container_id) {
            return Err(PluginError::InvalidEnv {
                var: ENV_CONTAINERID,
                value: args.container_id,
                reason: "must start with a letter or digit and contain only letters, digits, '_', '.' and '-'",
            });
        }
        if let Some(reason) = ifname_problem(&args.ifname) {
            return Err(PluginError::InvalidEnv {
                var: ENV_IFNAME,
                value: args.ifname,
                reason,
            });
        }
        Ok(args)
    }
}

/// Why `ifname` is not a valid Linux interface name (empty is allowed here; required-ness is separate).
fn ifname_problem(ifname: &str) -> Option<&'static str> {
    if ifname.is_empty() {
        None
    } else if ifname.len() > 15 {
        Some("longer than 15 bytes")
    } else if ifname == "." || ifname == ".." {
        Some("must not be . or ..")
    } else if ifname
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        Some("must not contain '/', ':' or whitespace")
    } else {
        None
    }
}

/// The version gate (skel's `reconcile`): the config version must be one we support, and the verb
/// must exist at that version. `config` is `cniVersion` as given (`None` reads as "0.1.0").
pub fn version_gate(cmd: Command, config: Option<&str>) -> Result<CniVersion, PluginError> {
    let config = config.unwrap_or("0.1.0");
    let version = CniVersion::parse(config).ok_or_else(|| PluginError::IncompatibleVersion {
        config: config.to_owned(),
    })?;
    if version < cmd.min_version() {
        return Err(PluginError::VerbNotAllowed { verb: cmd });
    }
    Ok(version)
}

/// VERSION's answer: echoes the input version if supported, else the newest.
pub fn version_reply(input: Option<&str>) -> VersionReply {
    let echo = input
        .and_then(CniVersion::parse)
        .unwrap_or(CniVersion::NEWEST);
    VersionReply {
        cni_version: echo.as_str(),
        supported_versions: CniVersion::ALL.iter().map(|v| v.as_str()).collect(),
    }
}

// === impl PluginError ===

impl PluginError {
    /// The CNI error code (`../shared/spec/cni.md` §6). This match is the only code mapping.
    pub fn code(&self) -> u32 {
        match self {
            PluginError::IncompatibleVersion { .. } | PluginError::VerbNotAllowed { .. } => 1,
            PluginError::UnknownCommand { .. }
            | PluginError::MissingEnv { .. }
            | PluginError::InvalidEnv { .. } => 4,
            PluginError::Stdin { .. } => 5,
            PluginError::Conf(ConfError::Json { .. } | ConfError::NotObject { .. }) => 6,
            PluginError::Conf(
                ConfError::MissingName
                | ConfError::InvalidName { .. }
                | ConfError::InvalidKey { .. }
                | ConfError::Selector { .. },
            ) => 7,
            PluginError::PrevResult(ResultError::Shape { .. }) => 6,
            PluginError::PrevResult(ResultError::UnsupportedVersion { .. }) => 7,
            PluginError::HostNetns { .. } => 8,
            PluginError::AgentAdd { .. } | PluginError::Classify { .. } => 11,
            PluginError::AgentStatus { .. } => 50,
        }
    }

    /// The error object, tagged with `version`.
    pub fn reply(&self, version: CniVersion) -> ErrorReply {
        let details = match self {
            PluginError::IncompatibleVersion { config } => {
                let supported: Vec<String> = CniVersion::ALL
                    .iter()
                    .map(|v| format!("{:?}", v.as_str()))
                    .collect();
                Some(format!(
                    "config is {config:?}, plugin supports [{}]",
                    supported.join(" ")
                ))
            }
            _ => None,
        };
        ErrorReply {
            cni_version: version.as_str().to_owned(),
            code: self.code(),
            msg: self.to_string(),
            details,
        }
    }
}

/// Serialises `value` plus a newline, as printed on stdout.
pub fn to_line<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising our own types and `serde_json::Value` cannot fail (string keys only).
    let mut out = serde_json::to_vec(value).unwrap_or_default();
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::env::MapEnv;
    use serde_json::Value;

    #[test]
    fn verbs_round_trip() {
        for c in ["ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC"] {
            assert_eq!(Command::parse(c).map(Command::as_str), Some(c));
        }
        assert_eq!(Command::parse("add"), None);
    }

    #[test]
    fn missing_env_lists_all_vars() {
        let env = MapEnv::from_pairs([("CNI_NETNS", "/x")]);
        let err = CmdArgs::from_env(&env, Command::Add).expect_err("missing");
        assert_eq!(err.code(), 4);
        assert_eq!(
            err.to_string(),
            "required env variables [CNI_CONTAINERID,CNI_IFNAME] missing"
        );
        let ok = CmdArgs::from_env(&MapEnv::from_pairs([("CNI_PATH", "/opt")]), Command::Gc);
        assert!(ok.is_ok());
        assert!(CmdArgs::from_env(&MapEnv::default(), Command::Status).is_ok());
    }

    #[test]
    fn del_does_not_need_netns() {
        let env = MapEnv::from_pairs([("CNI_CONTAINERID", "c1"), ("CNI_IFNAME", "eth0")]);
        let args = CmdArgs::from_env(&env, Command::Del).expect("ok");
        assert_eq!(args.netns, "");
    }

    #[test]
    fn bad_values_are_code_4() {
        let base = [
            ("CNI_NETNS", "/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_CONTAINERID", "c1"),
        ];
        for (k, v) in [
            ("CNI_CONTAINERID", "-abc"),
            ("CNI_CONTAINERID", "a/b"),
            ("CNI_IFNAME", "a-very-long-ifname0"),
            ("CNI_IFNAME", ".."),
            ("CNI_IFNAME", "eth:0"),
            ("CNI_IFNAME", "eth 0"),
        ] {
            let mut env = MapEnv::from_pairs(base);
            env.set(k, v);
            let err = CmdArgs::from_env(&env, Command::Add).expect_err(v);
            assert_eq!(err.code(), 4);
            assert!(err.to_string().contains(k), "{err}");
        }
    }

    #[test]
    fn netns_override_is_truthy_only_for_1_or_true() {
        for (v, want) in [
            ("1", true),
            ("TRUE", true),
            ("true", true),
            ("0", false),
            ("yes", false),
        ] {
            let env = MapEnv::from_pairs([("CNI_NETNS_OVERRIDE", v)]);
            let args = CmdArgs::from_env(&env, Command::Status).expect("ok");
            assert_eq!(args.netns_override, want, "{v}");
        }
    }

    #[test]
    fn gates() {
        use CniVersion::*;
        assert_eq!(version_gate(Command::Add, Some("0.3.0")).ok(), Some(V0_3_0));
        let e = version_gate(Command::Add, None).expect_err("0.1.0");
        assert_eq!(
            (e.code(), e.to_string().as_str()),
            (1, "incompatible CNI versions")
        );
        assert_eq!(
            e.reply(CniVersion::NEWEST).details.as_deref(),
            Some(r#"config is "0.1.0", plugin supports ["0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#)
        );
        assert!(version_gate(Command::Del, Some("1.2.0")).is_err());
        let e = version_gate(Command::Check, Some("0.3.1")).expect_err("check");
        assert_eq!(e.to_string(), "config version does not allow CHECK");
        assert!(version_gate(Command::Check, Some("0.4.0")).is_ok());
        for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0"] {
            for c in [Command::Gc, Command::Status] {
                let e = version_gate(c, Some(v)).expect_err("gated");
                assert_eq!(e.to_string(), format!("config version does not allow {c}"));
            }
        }
        assert!(version_gate(Command::Gc, Some("1.1.0")).is_ok());
    }

    #[test]
    fn version_reply_echoes_supported_input_only() {
        assert_eq!(version_reply(Some("0.4.0")).cni_version, "0.4.0");
        assert_eq!(version_reply(Some("0.2.0")).cni_version, "1.1.0");
        assert_eq!(version_reply(None).cni_version, "1.1.0");
        assert_eq!(
            version_reply(None).supported_versions,
            ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
        );
    }

    #[test]
    fn error_reply_shape() {
        let e = PluginError::MissingEnv {
            vars: vec![ENV_IFNAME],
        };
        let v: Value =
            serde_json::from_slice(&to_line(&e.reply(CniVersion::V0_4_0))).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"cniVersion": "0.4.0", "code": 4,
                "msg": "required env variables [CNI_IFNAME] missing"})
        );
    }
}
