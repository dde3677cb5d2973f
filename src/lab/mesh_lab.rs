//! A lab node running `ztnode node` with its first pods: the sequence the demo, the bench and the
//! end-to-end tests share (create the lab, write the local config, start the node, add the pods).

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::node::{Lab, LabError, LabOptions, Pod, ProcessGuard, local_config};

/// What [`MeshLab::start`] builds; `N` is the number of pods added once the node runs.
#[derive(Debug, Clone)]
pub struct MeshSpec<'a, const N: usize> {
    /// The lab; its `run_dir` is the node's `--run-dir`, its `prefix` the node name in the config.
    pub lab: LabOptions,
    /// The ztnode binary started as `ztnode node`.
    pub exe: &'a Path,
    /// Workloads of the local config: `(name, namespace, service account, ip)`, see
    /// [`local_config`].
    pub workloads: &'a [(&'a str, &'a str, &'a str, IpAddr)],
    /// YAML appended to the local config (e.g. a `policies:` list); may be empty.
    pub extra_config: &'a str,
    /// `RUST_LOG` of the node.
    pub log_level: &'a str,
    /// Arguments appended to `ztnode node --config <config> --run-dir <run dir>`.
    pub node_args: &'a [OsString],
    /// Environment added to the node's (e.g. ztunnel's `POOL_MAX_STREAMS_PER_CONNECTION`).
    pub node_env: &'a [(String, String)],
    /// Pods `(name, namespace)` added through the CNI chain, in this order, once the node runs.
    pub pods: [(&'a str, &'a str); N],
}

/// Where [`MeshLab::start_observed`] is, reported between its steps.
#[derive(Debug)]
pub enum MeshStage<'a> {
    /// The lab exists (its dir is fresh); the node is not started yet.
    LabBuilt(&'a Lab),
    /// `ztnode node` runs and opened its plugin socket; no pod is added yet.
    NodeStarted {
        /// The lab.
        lab: &'a Lab,
        /// Process id of the node.
        pid: u32,
        /// The node's log (its stderr).
        log: &'a Path,
    },
}

/// A lab node running `ztnode node`, with the pods of its [`MeshSpec`]. Field order is drop order:
/// the node process stops before the lab removes the pods and namespaces.
#[derive(Debug)]
pub struct MeshLab<const N: usize> {
    /// The `ztnode node` process (stopped when dropped).
    pub node: ProcessGuard,
    /// The lab node.
    pub lab: Lab,
    /// The node's log (its stderr).
    pub log: PathBuf,
    /// The local config the node reads (`<lab dir>/local-config.yaml`).
    pub config: PathBuf,
    /// The pods of [`MeshSpec::pods`], in that order.
    pub pods: [Pod; N],
}

impl<const N: usize> MeshLab<N> {
    /// Creates the lab, writes the local config into its dir, starts `ztnode node` in the node
    /// netns (waiting for its plugin socket) and adds the pods.
    pub fn start(spec: MeshSpec<'_, N>) -> Result<MeshLab<N>, LabError> {
        MeshLab::start_observed(spec, |_| Ok::<(), LabError>(()))
    }

    /// [`MeshLab::start`], calling `observe` after the lab is built and after the node started; an
    /// error from `observe` stops the sequence (what was built is removed again).
    pub fn start_observed<E: From<LabError>>(
        spec: MeshSpec<'_, N>,
        mut observe: impl FnMut(MeshStage<'_>) -> Result<(), E>,
    ) -> Result<MeshLab<N>, E> {
        let node_name = spec.lab.prefix.clone();
        let run_dir = spec.lab.run_dir.clone();
        let lab = Lab::new(spec.lab)?;
        observe(MeshStage::LabBuilt(&lab))?;
        let config = lab.dir().join("local-config.yaml");
        let yaml = local_config(&node_name, spec.workloads) + spec.extra_config;
        std::fs::write(&config, yaml).map_err(|source| LabError::Io {
            what: format!("write {}", config.display()),
            source,
        })?;
        let mut args: Vec<OsString> = vec!["--config".into(), config.clone().into()];
        args.extend_from_slice(spec.node_args);
        let (node, log) =
            lab.start_node_with(spec.exe, &run_dir, &args, spec.node_env, spec.log_level)?;
        observe(MeshStage::NodeStarted {
            lab: &lab,
            pid: node.0.id(),
            log: &log,
        })?;
        let pods = add_pods(&lab, spec.pods)?;
        Ok(MeshLab {
            node,
            lab,
            log,
            config,
            pods,
        })
    }
}

/// Adds `pods` to `lab` in order, stopping at the first failure.
fn add_pods<const N: usize>(lab: &Lab, pods: [(&str, &str); N]) -> Result<[Pod; N], LabError> {
    let mut added = Vec::with_capacity(N);
    for (name, namespace) in pods {
        added.push(lab.add_pod(name, namespace)?);
    }
    match added.try_into() {
        Ok(added) => Ok(added),
        Err(_) => unreachable!("one pod is added per entry of `pods`"),
    }
}
