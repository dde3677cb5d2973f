//! The runtime side of CNI: execute a conflist the way a container runtime (libcni) does.
//!
//! ADD runs the plugins in order, passing each one's result as the next one's `prevResult`; DEL runs
//! them in reverse with the final ADD result as `prevResult` (configs ≥ 0.4.0), CHECK in order
//! (`../shared/spec/cni.md` §1–3). Plugins are found in the `cni_path` dirs and executed with the
//! `CNI_*` variables, optionally from inside a given network namespace (the node's).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Map, Value};

use crate::netns::{Netns, NetnsError};

/// Errors running a plugin chain.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// The conflist lacks `plugins`, `name` or a plugin `type`.
    #[error("invalid conflist: {0}")]
    InvalidConflist(&'static str),
    /// No executable for a plugin type in the CNI path.
    #[error("plugin {0:?} not found in {1:?}")]
    PluginNotFound(String, Vec<PathBuf>),
    /// Spawning or talking to the plugin failed.
    #[error("exec plugin {plugin}: {source}")]
    Exec {
        /// Plugin type.
        plugin: String,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The plugin failed; `output` is its stdout (the CNI error JSON) plus stderr.
    #[error("plugin {plugin} {verb} failed (exit {status}): {output}")]
    PluginFailed {
        /// Plugin type.
        plugin: String,
        /// CNI verb.
        verb: String,
        /// Exit status.
        status: i32,
        /// stdout and stderr text.
        output: String,
    },
    /// The plugin printed something that is not JSON.
    #[error("plugin {plugin} printed invalid JSON: {source}")]
    BadOutput {
        /// Plugin type.
        plugin: String,
        /// Parse error.
        #[source]
        source: serde_json::Error,
    },
    /// Entering the exec netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

/// Per-attachment runtime arguments.
#[derive(Debug, Clone)]
pub struct Attachment {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS` (path).
    pub netns: PathBuf,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_ARGS` pairs.
    pub args: Vec<(String, String)>,
}

/// Runs one conflist.
#[derive(Debug)]
pub struct ChainRunner {
    /// Behind a lock so a key can be set while the runner is shared ([`ChainRunner::set_plugin_key`]).
    conflist: std::sync::RwLock<Value>,
    cni_path: Vec<PathBuf>,
    exec_netns: Option<Netns>,
}

impl ChainRunner {
    /// A runner for `conflist` with plugins looked up in `cni_path`; with `exec_netns` the plugins run
    /// inside that namespace (as if the runtime lived there).
    pub fn new(
        conflist: Value,
        cni_path: Vec<PathBuf>,
        exec_netns: Option<Netns>,
    ) -> Result<Self, ChainError> {
        let plugins = conflist
            .get("plugins")
            .and_then(Value::as_array)
            .ok_or(ChainError::InvalidConflist("no plugins list"))?;
        if plugins
            .iter()
            .any(|p| p.get("type").and_then(Value::as_str).is_none())
        {
            return Err(ChainError::InvalidConflist("plugin without type"));
        }
        if conflist.get("name").and_then(Value::as_str).is_none() {
            return Err(ChainError::InvalidConflist("no name"));
        }
        Ok(ChainRunner {
            conflist: std::sync::RwLock::new(conflist),
            cni_path,
            exec_netns,
        })
    }

    /// Sets `key` to `value` in every entry of type `plugin_type` (e.g. the plugin's
    /// `kubeconfig`, as the installer would write it).
    pub fn set_plugin_key(&self, plugin_type: &str, key: &str, value: Value) {
        let mut conflist = self
            .conflist
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(plugins) = conflist.get_mut("plugins").and_then(Value::as_array_mut) {
            for p in plugins
                .iter_mut()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some(plugin_type))
            {
                if let Some(entry) = p.as_object_mut() {
                    entry.insert(key.to_owned(), value.clone());
                }
            }
        }
    }

    fn conflist(&self) -> std::sync::RwLockReadGuard<'_, Value> {
        self.conflist
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn plugins(&self) -> Vec<Value> {
        self.conflist()
            .get("plugins")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    }

    fn version(&self) -> String {
        self.conflist()
            .get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or("0.4.0")
            .to_owned()
    }

    /// CNI ADD through the whole chain; returns the final result.
    pub fn add(&self, att: &Attachment) -> Result<Value, ChainError> {
        self.add_timed(att).map(|(result, _)| result)
    }

    /// CNI ADD through the whole chain; returns the final result and each plugin's exec time
    /// (spawn until it exited), in chain order.
    pub fn add_timed(
        &self,
        att: &Attachment,
    ) -> Result<(Value, Vec<(String, std::time::Duration)>), ChainError> {
        let mut prev: Option<Value> = None;
        let mut timings = Vec::new();
        for plugin in &self.plugins() {
            let start = std::time::Instant::now();
            let out = self.exec(plugin, "ADD", att, prev.as_ref())?;
            timings.push((plugin_type(plugin), start.elapsed()));
            prev = Some(out.ok_or_else(|| ChainError::BadOutput {
                plugin: plugin_type(plugin),
                source: serde_json::Error::io(std::io::Error::other("empty ADD result")),
            })?);
        }
        Ok((prev.unwrap_or(Value::Null), timings))
    }

    /// CNI DEL through the chain in reverse; `result` is the cached ADD result, if any.
    pub fn del(&self, att: &Attachment, result: Option<&Value>) -> Result<(), ChainError> {
        for plugin in self.plugins().iter().rev() {
            self.exec(plugin, "DEL", att, result)?;
        }
        Ok(())
    }

    /// CNI CHECK through the chain with the cached ADD result.
    pub fn check(&self, att: &Attachment, result: &Value) -> Result<(), ChainError> {
        for plugin in &self.plugins() {
            self.exec(plugin, "CHECK", att, Some(result))?;
        }
        Ok(())
    }

    fn find(&self, ty: &str) -> Result<PathBuf, ChainError> {
        self.cni_path
            .iter()
            .map(|d| d.join(ty))
            .find(|p| p.is_file())
            .ok_or_else(|| ChainError::PluginNotFound(ty.to_owned(), self.cni_path.clone()))
    }

    fn exec(
        &self,
        plugin: &Value,
        verb: &str,
        att: &Attachment,
        prev: Option<&Value>,
    ) -> Result<Option<Value>, ChainError> {
        let ty = plugin_type(plugin);
        let bin = self.find(&ty)?;
        let mut conf: Map<String, Value> = plugin.as_object().cloned().unwrap_or_default();
        conf.insert("name".into(), self.conflist()["name"].clone());
        conf.insert("cniVersion".into(), Value::String(self.version()));
        if let Some(p) = prev {
            conf.insert("prevResult".into(), p.clone());
        }
        let stdin =
            serde_json::to_vec(&Value::Object(conf)).map_err(|source| ChainError::BadOutput {
                plugin: ty.clone(),
                source,
            })?;
        let args = att
            .args
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";");
        let path = std::env::join_paths(&self.cni_path).unwrap_or_default();
        let run = || -> std::io::Result<std::process::Output> {
            let mut child = Command::new(&bin)
                .env_clear()
                .env("CNI_COMMAND", verb)
                .env("CNI_CONTAINERID", &att.container_id)
                .env("CNI_NETNS", &att.netns)
                .env("CNI_IFNAME", &att.ifname)
                .env("CNI_ARGS", &args)
                .env("CNI_PATH", &path)
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            if let Some(mut sin) = child.stdin.take() {
                sin.write_all(&stdin)?;
            }
            child.wait_with_output()
        };
        let output = match &self.exec_netns {
            Some(ns) => ns.run(run)?,
            None => run(),
        }
        .map_err(|source| ChainError::Exec {
            plugin: ty.clone(),
            source,
        })?;
        if !output.status.success() {
            return Err(ChainError::PluginFailed {
                plugin: ty,
                verb: verb.to_owned(),
                status: output.status.code().unwrap_or(-1),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
            });
        }
        if output.stdout.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        serde_json::from_slice(&output.stdout)
            .map(Some)
            .map_err(|source| ChainError::BadOutput { plugin: ty, source })
    }
}

fn plugin_type(plugin: &Value) -> String {
    plugin
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// Directories where Debian and upstream install the reference CNI plugins.
pub const REFERENCE_PLUGIN_DIRS: [&str; 2] = ["/usr/lib/cni", crate::mesh::DEFAULT_CNI_BIN_DIR];

/// The first directory of [`REFERENCE_PLUGIN_DIRS`] holding both `bridge` and `host-local`.
pub fn find_reference_plugins() -> Option<PathBuf> {
    REFERENCE_PLUGIN_DIRS
        .iter()
        .map(Path::new)
        .find(|d| d.join("bridge").is_file() && d.join("host-local").is_file())
        .map(Path::to_path_buf)
}
