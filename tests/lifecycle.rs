//! The node's lifecycle on a host, with the real binary in a fresh network namespace per test
//! (standing in for the node's host netns; nothing runs in the machine's own) and temp dirs for the
//! host's CNI dirs:
//! - coexistence: `ztnode node` and `ztnode agent` refuse to start, exit 1 and say what to remove,
//!   when the CNI conf dir holds Istio's `istio-cni` entry or something serves the ZDS socket;
//!   nothing is installed and the other agent's socket is left alone;
//! - `ztnode uninstall` removes every host artefact: the conflist entry, the plugin binary, the
//!   plugin's kubeconfig and the host probe table.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use socket2::{Domain, SockAddr, Socket, Type};
use ztnode::agent::install::{PLUGIN_BINARY_NAME, PLUGIN_KUBECONFIG_NAME, PLUGIN_TYPE};
use ztnode::agent::redirect::host::{HOST_NAT_TABLE, HostProbe};
use ztnode::netns::Netns;
use ztnode::nft::Table;

const EXE: &str = env!("CARGO_BIN_EXE_ztnode");
const FLANNEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/testdata/real-conflists/10-flannel.conflist"
);
/// How long a refusing start may take (it checks before doing anything else).
const REFUSAL_WITHIN: Duration = Duration::from_secs(20);

/// A named network namespace and temp host dirs, removed on drop.
struct Host {
    ns: String,
    netns: Netns,
    dir: PathBuf,
}

impl Host {
    fn new(tag: &str) -> Result<Host> {
        let ns = format!("{}-{tag}", common::prefix("lc"));
        let dir = std::env::temp_dir().join(&ns);
        let _ = fs::remove_dir_all(&dir);
        for d in ["bin", "net.d", "run"] {
            fs::create_dir_all(dir.join(d))?;
        }
        fs::write(dir.join("config.yaml"), "workloads: []\n")?;
        let status = Command::new("ip").args(["netns", "add", &ns]).status()?;
        ensure!(status.success(), "ip netns add {ns}");
        match Netns::open(format!("/var/run/netns/{ns}")) {
            Ok(netns) => Ok(Host { ns, netns, dir }),
            Err(e) => {
                let _ = Command::new("ip").args(["netns", "del", &ns]).status();
                Err(e.into())
            }
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.join(p)
    }

    /// `ztnode <sub> <args>` with the host dirs, inside the namespace, outside Kubernetes.
    fn ztnode(&self, sub: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, EXE, sub]);
        c.arg("--cni-bin-dir").arg(self.path("bin"));
        c.arg("--cni-conf-dir").arg(self.path("net.d"));
        c.arg("--run-dir").arg(self.path("run"));
        c.args(args);
        for v in [
            "KUBECONFIG",
            "KUBERNETES_SERVICE_HOST",
            "LOCAL_XDS_PATH",
            "XDS_ADDRESS",
        ] {
            c.env_remove(v);
        }
        c.env("ZTUNNEL_UDS_ADDRESS", self.path("absent.sock"));
        c
    }

    fn has_host_table(&self) -> Result<bool> {
        Ok(self
            .netns
            .run(|| ztnode::nft::table_exists(&Table::inet(HOST_NAT_TABLE)))??)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Runs `c` to its end, killing it (and failing) if it is still running after `within`.
fn run_to_end(mut c: Command, within: Duration) -> Result<Output> {
    let mut child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn ztnode")?;
    let start = Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > within {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            bail!(
                "still running after {within:?} (it should have refused to start):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child.wait_with_output()?)
}

/// `out` is a refusal: exit code 1, stderr holding every one of `says`.
fn refused(out: &Output, says: &[&str]) -> Result<()> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1),
        "exit {:?}, stderr:\n{stderr}",
        out.status
    );
    for s in says {
        ensure!(stderr.contains(s), "stderr lacks {s:?}:\n{stderr}");
    }
    Ok(())
}

/// Nothing of ztnode's is on the host: no plugin binary, no table in the namespace.
fn nothing_installed(host: &Host) -> Result<()> {
    ensure!(
        !host.path("bin").join(PLUGIN_BINARY_NAME).exists(),
        "the plugin was installed"
    );
    ensure!(!host.has_host_table()?, "host rules were installed");
    Ok(())
}

/// A SOCK_SEQPACKET listener at `path`, as istio-cni's agent serves ZDS.
fn zds_listener(path: &Path) -> Result<Socket> {
    let l = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    l.bind(&SockAddr::unix(path)?)?;
    l.listen(8)?;
    Ok(l)
}

#[test]
fn node_and_agent_refuse_a_conf_dir_with_istio_cni() -> Result<()> {
    if !common::privileged("node_and_agent_refuse_a_conf_dir_with_istio_cni") {
        return Ok(());
    }
    let host = Host::new("istiocni")?;
    let mut flannel: Value = serde_json::from_slice(&fs::read(FLANNEL)?)?;
    flannel["plugins"]
        .as_array_mut()
        .context("plugins")?
        .push(serde_json::json!({"type": "istio-cni", "name": "istio-cni"}));
    let conf = host.path("net.d/10-flannel.conflist");
    let bytes = serde_json::to_vec_pretty(&flannel)?;
    fs::write(&conf, &bytes)?;
    let config = host.path("config.yaml");
    let config = config.to_str().context("utf-8")?;

    let out = run_to_end(host.ztnode("node", &["--config", config]), REFUSAL_WITHIN)?;
    refused(
        &out,
        &[
            "Istio's istio-cni is installed",
            "10-flannel.conflist",
            "remove Istio's CNI",
        ],
    )?;
    nothing_installed(&host)?;
    ensure!(fs::read(&conf)? == bytes, "the conflist was changed");

    let zds = host.path("run/ztunnel.sock");
    let zds = zds.to_str().context("utf-8")?;
    let out = run_to_end(
        host.ztnode("agent", &["--config", config, "--zds-socket", zds]),
        REFUSAL_WITHIN,
    )?;
    refused(
        &out,
        &["Istio's istio-cni is installed", "10-flannel.conflist"],
    )?;
    nothing_installed(&host)?;
    ensure!(!Path::new(zds).exists(), "the agent served ZDS");
    ensure!(fs::read(&conf)? == bytes, "the conflist was changed");
    Ok(())
}

#[test]
fn node_and_agent_refuse_a_served_zds_socket() -> Result<()> {
    if !common::privileged("node_and_agent_refuse_a_served_zds_socket") {
        return Ok(());
    }
    let host = Host::new("zds")?;
    let flannel = fs::read(FLANNEL)?;
    fs::write(host.path("net.d/10-flannel.conflist"), &flannel)?;
    let sock = host.path("ztunnel.sock");
    let listener = zds_listener(&sock)?;
    let config = host.path("config.yaml");
    let config = config.to_str().context("utf-8")?;
    let sock_str = sock.to_str().context("utf-8")?;

    let mut node = host.ztnode("node", &["--config", config]);
    node.env("ZTUNNEL_UDS_ADDRESS", &sock);
    refused(
        &run_to_end(node, REFUSAL_WITHIN)?,
        &[
            sock_str,
            "is in use",
            "remove Istio's istio-cni-node and ztunnel DaemonSets",
        ],
    )?;
    let agent = host.ztnode("agent", &["--config", config, "--zds-socket", sock_str]);
    refused(
        &run_to_end(agent, REFUSAL_WITHIN)?,
        &[sock_str, "is in use"],
    )?;

    nothing_installed(&host)?;
    ensure!(
        fs::read(host.path("net.d/10-flannel.conflist"))? == flannel,
        "the conflist was changed"
    );
    // The other agent's socket is still its own: a proxy still reaches it.
    let client = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    client
        .connect(&SockAddr::unix(&sock)?)
        .context("the served socket was taken over")?;
    drop(listener);
    Ok(())
}

#[test]
fn uninstall_removes_every_host_artefact() -> Result<()> {
    if !common::privileged("uninstall_removes_every_host_artefact") {
        return Ok(());
    }
    let host = Host::new("uninst")?;
    let original = fs::read(FLANNEL)?;
    let conf = host.path("net.d/10-flannel.conflist");
    fs::write(&conf, &original)?;
    let out = run_to_end(host.ztnode("install", &[]), REFUSAL_WITHIN)?;
    ensure!(
        out.status.success(),
        "install: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chained: Value = serde_json::from_slice(&fs::read(&conf)?)?;
    ensure!(
        chained["plugins"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["type"] == PLUGIN_TYPE)),
        "not chained: {chained}"
    );
    ensure!(host.path("bin").join(PLUGIN_BINARY_NAME).exists());
    // What Kubernetes mode adds: the plugin's kubeconfig and the host probe table.
    let kubeconfig = host.path("run").join(PLUGIN_KUBECONFIG_NAME);
    fs::write(&kubeconfig, "apiVersion: v1\nkind: Config\n")?;
    host.netns.run(|| HostProbe::new(4242).apply())??;
    ensure!(host.has_host_table()?);

    let out = run_to_end(host.ztnode("uninstall", &[]), REFUSAL_WITHIN)?;
    ensure!(
        out.status.success(),
        "uninstall: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back: Value = serde_json::from_slice(&fs::read(&conf)?)?;
    ensure!(
        back == serde_json::from_slice::<Value>(&original)?,
        "conflist not given back: {back}"
    );
    ensure!(
        !host.path("bin").join(PLUGIN_BINARY_NAME).exists(),
        "binary left"
    );
    ensure!(!kubeconfig.exists(), "plugin kubeconfig left");
    ensure!(!host.has_host_table()?, "host probe table left");

    let out = run_to_end(host.ztnode("uninstall", &[]), REFUSAL_WITHIN)?;
    ensure!(out.status.success(), "a second uninstall fails");
    Ok(())
}
