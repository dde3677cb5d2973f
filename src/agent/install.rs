//! Self-installer of the CNI plugin: copies the running binary into the CNI bin dir as `ztnode-cni`
//! and chains a `ztnode-cni` entry into the node's primary CNI network config; undoes both on
//! uninstall; [`watch_and_repair`] keeps both in place while the agent runs.
//!
//! Follows Istio's installer (`cni/pkg/install`, `../shared/spec/istio-cni.md` §2) with these choices:
//! - Primary config = first `.conf`/`.conflist` in the conf dir by byte-wise name order that the runtime
//!   accepts (kubelet/libcni semantics); unparseable files, `.conf` without `type` and lists without
//!   plugins are skipped.
//! - Our entry goes LAST into the primary's `plugins`, exactly once; every other key and plugin keeps
//!   its value and position (unlike Istio, which re-sorts keys). Files are rewritten only when their
//!   JSON value changes, as 2-space indented JSON plus a newline, atomically, keeping their mode.
//! - A single-plugin `X.conf` becomes `X.conflist` with the conf's own `cniVersion` and `name` (Istio
//!   writes `0.3.1`/`k8s-pod-network`); our entry records `"ztnode_converted_from": "X.conf"` so a later
//!   uninstall writes `X.conf` back.
//! - Entries of ours in files that are no longer primary are removed (a converted `.conf` is restored).
//! - Kubernetes mode ([`InstallConfig::kube`], [`PluginKube`]): the plugin's kubeconfig is written to
//!   `<run_dir>/ztnode-cni-kubeconfig` before the config entry that names it (spec §2.1, §2.5), kept
//!   current while the agent runs (token rotation) and removed on uninstall.

mod conflist;
mod files;
mod kubeconfig;
mod plan;
mod watch;

use std::io;
use std::path::PathBuf;

pub use conflist::{CONVERTED_FROM_KEY, PLUGIN_TYPE};
pub use kubeconfig::{
    CLUSTER_NAME, CONTEXT_NAME, DEFAULT_SERVICE_ACCOUNT_DIR, InClusterApi, KUBECONFIG_MODE,
    KubeconfigSource, PLUGIN_KUBECONFIG_NAME, PluginKube, USER_NAME, kubeconfig_path,
};
pub use watch::watch_and_repair;

use crate::mesh::{DEFAULT_CNI_BIN_DIR, DEFAULT_CNI_CONF_DIR, DEFAULT_EXCLUDED_NAMESPACES};
use conflist::{EntryKube, EntryParams};

/// File name of the installed plugin binary (the multi-call binary dispatches on it).
pub const PLUGIN_BINARY_NAME: &str = "ztnode-cni";

/// Errors of the installer. Each names the file or directory concerned.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// Listing a directory failed.
    #[error("read dir {dir}: {source}")]
    ReadDir {
        /// The directory.
        dir: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// Reading a config file (other than it vanishing meanwhile), or a source of the plugin's
    /// kubeconfig (the copied kubeconfig, the service-account token or CA), failed.
    #[error("read {path}: {source}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// The conf dir has no config the runtime would use (yet): the primary CNI has not written one.
    /// [`watch_and_repair`] waits for one; [`install`] still copied the binary.
    #[error("no valid CNI network config (.conf/.conflist) in {dir}; waiting for the primary CNI")]
    NoPrimaryConfig {
        /// The conf dir.
        dir: PathBuf,
    },
    /// The primary is `X.conf` but converting it would overwrite an `X.conflist` we did not write.
    #[error("cannot convert {conf} to a list: {conflist} exists and was not written by ztnode")]
    ConflistExists {
        /// The primary `.conf`.
        conf: PathBuf,
        /// Its existing `.conflist` sibling.
        conflist: PathBuf,
    },
    /// The in-cluster API server settings cannot make a server URL (spec §2.5).
    #[error("in-cluster API server for the plugin's kubeconfig: {reason}")]
    InClusterApi {
        /// What is wrong (names the variable, never a secret).
        reason: String,
    },
    /// Serialising the plugin's kubeconfig failed.
    #[error("render the plugin's kubeconfig: {source}")]
    RenderYaml {
        /// The serde error.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// Serialising a config failed.
    #[error("render {path}: {source}")]
    Render {
        /// The file that was to be written.
        path: PathBuf,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// Writing a config file (temp file, fsync, rename) failed.
    #[error("write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// Removing a file failed.
    #[error("remove {path}: {source}")]
    Remove {
        /// The file.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// Comparing or copying the plugin binary failed (a read-only bin dir ends up here).
    #[error("copy plugin binary {from} to {to}: {source}")]
    CopyBinary {
        /// The running binary.
        from: PathBuf,
        /// The target in the CNI bin dir.
        to: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// A path that goes into the config JSON is not UTF-8.
    #[error("path {path} is not valid UTF-8 and cannot go into the CNI config")]
    NonUtf8Path {
        /// The path.
        path: PathBuf,
    },
    /// Setting up or reading the inotify watch failed.
    #[error("watch CNI dirs: {source}")]
    Watch {
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// A blocking install task panicked or was cancelled.
    #[error("install task failed: {source}")]
    Task {
        /// The join error.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// Where to install and what to write into our entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallConfig {
    /// CNI binary dir; default [`DEFAULT_CNI_BIN_DIR`]. Created if missing.
    pub cni_bin_dir: PathBuf,
    /// CNI network config dir; default [`DEFAULT_CNI_CONF_DIR`].
    pub cni_conf_dir: PathBuf,
    /// The binary to install as `ztnode-cni`, normally `std::env::current_exe()`.
    pub source_binary: PathBuf,
    /// Agent run dir, written as `cni_agent_run_dir` (where the plugin finds `pluginevent.sock`).
    pub run_dir: PathBuf,
    /// Written as `exclude_namespaces`; default [`DEFAULT_EXCLUDED_NAMESPACES`].
    pub exclude_namespaces: Vec<String>,
    /// Written as `plugin_log_level` if set.
    pub log_level: Option<String>,
    /// Kubernetes mode: write the plugin's kubeconfig and the entry keys `kubeconfig`,
    /// `ambient_enablement_selector`, `ztnode_namespace`, so the plugin classifies pods itself.
    /// `None` (the default): standalone, the plugin hands every pod to the agent.
    pub kube: Option<PluginKube>,
}

/// What [`install`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallOutcome {
    /// The binary was written; `false` when the installed one already had the same content.
    pub binary_written: bool,
    /// The plugin's kubeconfig was written (Kubernetes mode; `false` when it was current).
    pub kubeconfig_written: bool,
    /// The config side.
    pub conf: ConfOutcome,
}

/// What the config side of [`install`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfOutcome {
    /// The config file holding our entry afterwards.
    pub primary: PathBuf,
    /// The `.conf` that `primary` was converted from (in this run or an earlier one).
    pub converted_from: Option<PathBuf>,
    /// Whether any config file was written or removed (`false`: everything was in place).
    pub changed: bool,
}

// === impl InstallConfig ===

impl InstallConfig {
    /// Config with the default dirs, the given binary and run dir, `kube-system` excluded.
    pub fn new(source_binary: PathBuf, run_dir: PathBuf) -> Self {
        InstallConfig {
            cni_bin_dir: DEFAULT_CNI_BIN_DIR.into(),
            cni_conf_dir: DEFAULT_CNI_CONF_DIR.into(),
            source_binary,
            run_dir,
            exclude_namespaces: DEFAULT_EXCLUDED_NAMESPACES
                .iter()
                .map(|n| n.to_string())
                .collect(),
            log_level: None,
            kube: None,
        }
    }

    /// Path of the installed plugin binary.
    pub fn installed_binary(&self) -> PathBuf {
        self.cni_bin_dir.join(PLUGIN_BINARY_NAME)
    }

    fn entry_params(&self) -> Result<EntryParams, InstallError> {
        let run_dir = self
            .run_dir
            .to_str()
            .ok_or_else(|| InstallError::NonUtf8Path {
                path: self.run_dir.clone(),
            })?;
        let kube = match &self.kube {
            None => None,
            Some(k) => {
                let path = kubeconfig_path(&self.run_dir);
                let kubeconfig = path
                    .to_str()
                    .ok_or_else(|| InstallError::NonUtf8Path { path: path.clone() })?
                    .to_owned();
                Some(EntryKube {
                    kubeconfig,
                    enablement_selector: k.enablement_selector.clone(),
                    namespace: k.namespace.clone(),
                })
            }
        };
        Ok(EntryParams {
            run_dir: run_dir.to_owned(),
            exclude_namespaces: self.exclude_namespaces.clone(),
            log_level: self.log_level.clone(),
            kube,
        })
    }
}

// === impl InstallOutcome ===

impl InstallOutcome {
    /// Whether anything on disk changed.
    pub fn changed(&self) -> bool {
        self.binary_written || self.kubeconfig_written || self.conf.changed
    }
}

/// Installs: copies the binary (skipped when identical), writes the plugin's kubeconfig in
/// Kubernetes mode (skipped when current), then chains our entry into the primary config (last, so
/// the plugin never runs with an entry naming a missing kubeconfig). Errors:
/// [`InstallError::NoPrimaryConfig`] when there is no usable config yet (binary and kubeconfig are
/// written anyway), otherwise the failing file operation.
pub fn install(cfg: &InstallConfig) -> Result<InstallOutcome, InstallError> {
    let binary_written = install_binary(cfg)?;
    let kubeconfig_written = install_kubeconfig(cfg)?;
    let conf = install_conf(cfg)?;
    Ok(InstallOutcome {
        binary_written,
        kubeconfig_written,
        conf,
    })
}

/// Uninstalls: removes our entries from every config in the conf dir (a `.conf` we converted is
/// written back and its `.conflist` removed), then the plugin's kubeconfig (in either mode: the
/// path is ours), then the binary. Missing dirs or files are fine, so a second call succeeds too.
pub fn uninstall(cfg: &InstallConfig) -> Result<(), InstallError> {
    let dir = &cfg.cni_conf_dir;
    files::remove_stale_conf_tmp(dir)?;
    match files::scan_conf_dir(dir) {
        Ok(snapshot) => {
            let actions = plan::plan_uninstall(&snapshot);
            files::apply(dir, &actions)?;
            if !actions.is_empty() {
                tracing::info!(dir = %dir.display(), "removed ztnode-cni from the CNI config");
            }
        }
        Err(InstallError::ReadDir { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    kubeconfig::remove(&cfg.run_dir)?;
    files::remove_if_exists(&cfg.installed_binary())
}

/// Whether everything is in place: the installed binary has the source's content and mode 0755, the
/// plugin's kubeconfig (Kubernetes mode) is current, and an install would change no config file.
/// `Ok(false)` when there is no primary config or conf dir.
pub fn is_installed(cfg: &InstallConfig) -> Result<bool, InstallError> {
    if !files::binary_current(&cfg.source_binary, &cfg.installed_binary())? {
        return Ok(false);
    }
    if !kubeconfig_in_place(cfg)? {
        return Ok(false);
    }
    conf_in_place(cfg)
}

/// What a CNI config dir holds, as the runtime reads it (for `ztnode doctor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfDirReport {
    /// The primary config (the first file by name the runtime accepts), if any.
    pub primary: Option<String>,
    /// The primary's plugin types, in chain order (one for a `.conf`).
    pub chain: Vec<String>,
    /// ztnode entries inside the primary's plugins' `delegates` (Multus's embedded copy of the
    /// cluster network): each makes the plugin run once more per pod.
    pub embedded: usize,
    /// Files other than the primary that hold a ztnode entry.
    pub stray: Vec<String>,
    /// Files with a config extension that do not parse or that the runtime skips.
    pub invalid: Vec<String>,
}

impl ConfDirReport {
    /// How many times the primary runs ztnode's plugin: its chain's entries plus those embedded in
    /// delegates.
    pub fn ours(&self) -> usize {
        self.chain.iter().filter(|t| *t == PLUGIN_TYPE).count() + self.embedded
    }

    /// Whether the primary's chain ends with ztnode's entry.
    pub fn ours_last(&self) -> bool {
        self.chain.last().is_some_and(|t| t == PLUGIN_TYPE)
    }
}

/// Reads `dir` as [`ConfDirReport`]. Errors: the dir or a file in it cannot be read.
pub fn inspect_conf_dir(dir: &std::path::Path) -> Result<ConfDirReport, InstallError> {
    let files = files::scan_conf_dir(dir)?;
    let primary = plan::primary(&files);
    let chain = match primary {
        Some((f, conflist::ConfKind::List)) => f
            .value
            .as_ref()
            .and_then(|v| v.get("plugins"))
            .and_then(serde_json::Value::as_array)
            .map(|p| {
                p.iter()
                    .map(|e| {
                        e.get("type")
                            .and_then(serde_json::Value::as_str)
                            .unwrap_or("")
                            .to_owned()
                    })
                    .collect()
            })
            .unwrap_or_default(),
        Some((f, conflist::ConfKind::Single)) => f
            .value
            .as_ref()
            .and_then(|v| v.get("type"))
            .and_then(serde_json::Value::as_str)
            .map(|t| vec![t.to_owned()])
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let embedded = primary
        .and_then(|(f, _)| f.value.as_ref())
        .map_or(0, conflist::count_embedded);
    let primary_name = primary.map(|(f, _)| f.name.clone());
    let stray = files
        .iter()
        .filter(|f| Some(&f.name) != primary_name.as_ref())
        .filter(|f| {
            f.value
                .as_ref()
                .is_some_and(|v| conflist::count_ours(v) + conflist::count_embedded(v) > 0)
        })
        .map(|f| f.name.clone())
        .collect();
    let invalid = files
        .iter()
        .filter(|f| {
            f.value
                .as_ref()
                .and_then(|v| conflist::classify(&f.name, v))
                .is_none()
        })
        .map(|f| f.name.clone())
        .collect();
    Ok(ConfDirReport {
        primary: primary_name,
        chain,
        embedded,
        stray,
        invalid,
    })
}

/// `type` of Istio's own CNI plugin entry (istio-cni's installer, `../shared/spec/istio-cni.md` §2.4).
pub const ISTIO_CNI_TYPE: &str = "istio-cni";

/// Names of the config files in `dir` that hold Istio's `istio-cni` plugin: as a `.conf`'s type,
/// in a list's `plugins`, or inside a plugin's `delegates` (Multus). Sorted; empty when `dir` is
/// missing. Errors: the dir or a file in it cannot be read.
pub fn istio_cni_files(dir: &std::path::Path) -> Result<Vec<String>, InstallError> {
    let files = match files::scan_conf_dir(dir) {
        Err(InstallError::ReadDir { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(Vec::new());
        }
        other => other?,
    };
    Ok(files
        .into_iter()
        .filter(|f| {
            f.value
                .as_ref()
                .is_some_and(|v| conflist::has_type(v, ISTIO_CNI_TYPE))
        })
        .map(|f| f.name)
        .collect())
}

/// Writes the plugin's kubeconfig unless current (Kubernetes mode only); returns whether written.
fn install_kubeconfig(cfg: &InstallConfig) -> Result<bool, InstallError> {
    let Some(kube) = &cfg.kube else {
        return Ok(false);
    };
    let written = kubeconfig::install(&cfg.run_dir, kube)?;
    if written {
        let path = kubeconfig_path(&cfg.run_dir);
        tracing::info!(path = %path.display(), "wrote the CNI plugin's kubeconfig");
    }
    Ok(written)
}

/// Whether the plugin's kubeconfig is current (always true in standalone mode).
fn kubeconfig_in_place(cfg: &InstallConfig) -> Result<bool, InstallError> {
    match &cfg.kube {
        None => Ok(true),
        Some(kube) => kubeconfig::in_place(&cfg.run_dir, kube),
    }
}

/// Copies the binary unless identical; returns whether it was written.
fn install_binary(cfg: &InstallConfig) -> Result<bool, InstallError> {
    let written = files::install_binary(&cfg.source_binary, &cfg.cni_bin_dir, PLUGIN_BINARY_NAME)?;
    if written {
        let to = cfg.installed_binary();
        tracing::info!(to = %to.display(), "installed the CNI plugin binary");
    }
    Ok(written)
}

/// The config half of [`install`].
fn install_conf(cfg: &InstallConfig) -> Result<ConfOutcome, InstallError> {
    let params = cfg.entry_params()?;
    let dir = &cfg.cni_conf_dir;
    files::remove_stale_conf_tmp(dir)?;
    let snapshot = scan_for_install(cfg)?;
    let plan = plan::plan_install(dir, &snapshot, &params)?;
    files::apply(dir, &plan.actions)?;
    let outcome = ConfOutcome {
        primary: dir.join(&plan.primary),
        converted_from: plan.converted_from.map(|name| dir.join(name)),
        changed: !plan.actions.is_empty(),
    };
    if outcome.changed {
        tracing::info!(primary = %outcome.primary.display(), "chained ztnode-cni into the CNI config");
    }
    Ok(outcome)
}

/// Whether an install would leave every config file as it is.
fn conf_in_place(cfg: &InstallConfig) -> Result<bool, InstallError> {
    let params = cfg.entry_params()?;
    let planned = scan_for_install(cfg)
        .and_then(|snapshot| plan::plan_install(&cfg.cni_conf_dir, &snapshot, &params));
    match planned {
        Ok(plan) => Ok(plan.actions.is_empty()),
        Err(InstallError::NoPrimaryConfig { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Scans the conf dir; a missing dir means no primary config yet.
fn scan_for_install(cfg: &InstallConfig) -> Result<Vec<plan::ConfFile>, InstallError> {
    let dir = &cfg.cni_conf_dir;
    match files::scan_conf_dir(dir) {
        Err(InstallError::ReadDir { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Err(InstallError::NoPrimaryConfig { dir: dir.clone() })
        }
        other => other,
    }
}
