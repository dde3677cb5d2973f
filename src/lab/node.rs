//! A throwaway node on one machine, for the demo, the end-to-end tests and the benchmarks.
//!
//! Layout: a "node" netns (the host of a real node) holding a bridge made by the reference CNI
//! `bridge` + `host-local` plugins, and "pod" netns attached to it through the real CNI chain
//! (`bridge`, then `ztnode-cni` when enabled), executed as a runtime does ([`super::cnichain`]).
//! Everything lives in namespaces this module creates: nothing is configured in the machine's root
//! namespace and nothing is routed out of the machine. Dropping a [`Lab`] runs CNI DEL for its pods
//! and deletes every namespace and file it made, also after a failure or panic.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use super::cnichain::{self, Attachment, ChainError, ChainRunner};
use crate::netns::{Netns, NetnsError};

/// Errors building the lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The reference plugins are missing.
    #[error(
        "the reference CNI plugins (bridge, host-local) were not found in {:?}; \
         install Debian's `containernetworking-plugins` package",
        cnichain::REFERENCE_PLUGIN_DIRS
    )]
    NoReferencePlugins,
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {output}")]
    Ip {
        /// Arguments.
        args: String,
        /// stderr.
        output: String,
    },
    /// File system work in the lab dir failed.
    #[error("{what}: {source}")]
    Io {
        /// What was attempted.
        what: String,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The CNI chain failed.
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// Opening a namespace failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// `ztnode node` did not open its plugin socket in time.
    #[error("ztnode node did not start within 15 s; see {0}")]
    NodeStart(PathBuf),
    /// tcpdump did not start listening in time.
    #[error(
        "tcpdump did not start listening on the bridge (is the tcpdump package installed?); see {0}"
    )]
    Capture(PathBuf),
    /// The fake API server did not start, or answered a request with an error.
    #[error("fake API server: {0}")]
    FakeApi(String),
    /// The fake istiod did not start, or answered a control call with an error.
    #[error("fake istiod: {0}")]
    FakeIstiod(String),
}

/// Options of a lab.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// Unique short prefix for names (netns `<prefix>-node`, `<prefix>-<pod>`); ≤ 8 chars recommended.
    pub prefix: String,
    /// The ztnode binary; when set, `ztnode-cni` is chained after the bridge plugin.
    pub ztnode_binary: Option<PathBuf>,
    /// Agent run dir written into our plugin entry.
    pub run_dir: PathBuf,
    /// Pod subnet, e.g. `10.44.0.0/24` (the gateway is `.1` on the bridge).
    pub subnet: String,
    /// cniVersion of the conflist.
    pub cni_version: String,
}

/// A pod attached to the lab.
#[derive(Debug, Clone)]
pub struct Pod {
    /// Pod name (also used as netns suffix).
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Pod UID.
    pub uid: String,
    /// netns name (`ip netns`).
    pub netns_name: String,
    /// netns path (`/var/run/netns/<name>`).
    pub netns_path: PathBuf,
    /// The IPv4 address CNI gave the pod.
    pub ip: std::net::IpAddr,
    /// The final ADD result.
    pub result: Value,
    /// Exec time of each plugin of the ADD, in chain order.
    pub add_timings: Vec<(String, std::time::Duration)>,
}

/// The node and its pods; see the module docs.
#[derive(Debug)]
pub struct Lab {
    opts: LabOptions,
    dir: PathBuf,
    node_name: String,
    node: Netns,
    runner: ChainRunner,
    pods: std::sync::Mutex<Vec<Pod>>,
}

fn ip(args: &[&str]) -> Result<(), LabError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| LabError::Io {
            what: "run ip".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(LabError::Ip {
            args: args.join(" "),
            output: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LabError {
    let what = what.into();
    move |source| LabError::Io { what, source }
}

impl Lab {
    /// Creates the node netns, the lab dir (`/tmp/ztnode-lab-<prefix>`) and the CNI bin dir.
    pub fn new(opts: LabOptions) -> Result<Lab, LabError> {
        let plugins = cnichain::find_reference_plugins().ok_or(LabError::NoReferencePlugins)?;
        let dir = std::env::temp_dir().join(format!("ztnode-lab-{}", opts.prefix));
        let _ = std::fs::remove_dir_all(&dir);
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).map_err(io(format!("create {}", bin.display())))?;
        for p in ["bridge", "host-local", "loopback"] {
            let target = plugins.join(p);
            if target.is_file() {
                std::os::unix::fs::symlink(&target, bin.join(p))
                    .map_err(io(format!("link {p}")))?;
            }
        }
        let mut plugin_list = vec![json!({
            "type": "bridge",
            "bridge": format!("{}-br", opts.prefix),
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": false,
            "ipam": {
                "type": "host-local",
                "subnet": opts.subnet,
                "dataDir": dir.join("ipam"),
                "routes": [{"dst": "0.0.0.0/0"}]
            }
        })];
        if let Some(z) = &opts.ztnode_binary {
            std::os::unix::fs::symlink(z, bin.join("ztnode-cni")).map_err(io("link ztnode-cni"))?;
            plugin_list.push(json!({
                "type": "ztnode-cni",
                "name": "ztnode-cni",
                "cni_agent_run_dir": opts.run_dir,
                "exclude_namespaces": crate::mesh::DEFAULT_EXCLUDED_NAMESPACES,
            }));
        }
        let conflist = json!({
            "cniVersion": opts.cni_version,
            "name": format!("{}-net", opts.prefix),
            "plugins": plugin_list,
        });
        let node_name = format!("{}-node", opts.prefix);
        let _ = ip(&["netns", "del", &node_name]);
        ip(&["netns", "add", &node_name])?;
        let node = Netns::open(format!("/var/run/netns/{node_name}"))?;
        let runner = ChainRunner::new(conflist, vec![bin], Some(node.clone()))?;
        let lab = Lab {
            opts,
            dir,
            node_name,
            node,
            runner,
            pods: Default::default(),
        };
        ip(&["-n", &lab.node_name, "link", "set", "lo", "up"])?;
        Ok(lab)
    }

    /// The node netns.
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// The node netns name (for `ip netns exec`).
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The lab's private directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The bridge device name in the node netns.
    pub fn bridge(&self) -> String {
        format!("{}-br", self.opts.prefix)
    }

    /// Sets `key` in the lab's `ztnode-cni` entry (for the pods added from now on).
    pub fn set_plugin_key(&self, key: &str, value: Value) {
        self.runner.set_plugin_key("ztnode-cni", key, value);
    }

    /// The conflist the lab's runtime executes.
    pub fn runner(&self) -> &ChainRunner {
        &self.runner
    }

    /// The pod UID [`Lab::add_pod`] gives pod `name` (`K8S_POD_UID`): stable for this lab and
    /// process, so a test can create the pod in an API server first.
    pub fn pod_uid(&self, name: &str) -> String {
        format!(
            "{:08x}-0000-4000-8000-{:012x}",
            std::process::id(),
            fxhash(&format!("{}-{}", self.opts.prefix, name))
        )
    }

    /// The netns name [`Lab::add_pod`] gives pod `name` (under `/var/run/netns/`).
    pub fn pod_netns_name(&self, name: &str) -> String {
        format!("{}-{}", self.opts.prefix, name)
    }

    /// Creates a pod netns and runs CNI ADD for it through the chain.
    pub fn add_pod(&self, name: &str, namespace: &str) -> Result<Pod, LabError> {
        let netns_name = format!("{}-{}", self.opts.prefix, name);
        let _ = ip(&["netns", "del", &netns_name]);
        ip(&["netns", "add", &netns_name])?;
        ip(&["-n", &netns_name, "link", "set", "lo", "up"])?;
        let uid = self.pod_uid(name);
        let netns_path = PathBuf::from(format!("/var/run/netns/{netns_name}"));
        let att = self.attachment(&netns_name, &netns_path, name, namespace, &uid);
        let (result, add_timings) = match self.runner.add_timed(&att) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.runner.del(&att, None);
                let _ = ip(&["netns", "del", &netns_name]);
                return Err(e.into());
            }
        };
        let ip_addr = result
            .get("ips")
            .and_then(Value::as_array)
            .and_then(|ips| ips.first())
            .and_then(|i| i.get("address"))
            .and_then(Value::as_str)
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .ok_or(LabError::Chain(ChainError::InvalidConflist(
                "ADD result has no IP",
            )))?;
        let pod = Pod {
            name: name.into(),
            namespace: namespace.into(),
            uid,
            netns_name,
            netns_path,
            ip: ip_addr,
            result,
            add_timings,
        };
        if let Ok(mut pods) = self.pods.lock() {
            pods.push(pod.clone());
        }
        Ok(pod)
    }

    fn attachment(
        &self,
        container_id: &str,
        netns: &Path,
        name: &str,
        namespace: &str,
        uid: &str,
    ) -> Attachment {
        Attachment {
            container_id: container_id.to_owned(),
            netns: netns.to_owned(),
            ifname: "eth0".into(),
            args: vec![
                ("IgnoreUnknown".into(), "1".into()),
                ("K8S_POD_NAMESPACE".into(), namespace.into()),
                ("K8S_POD_NAME".into(), name.into()),
                ("K8S_POD_INFRA_CONTAINER_ID".into(), container_id.into()),
                ("K8S_POD_UID".into(), uid.into()),
            ],
        }
    }

    /// Runs CNI DEL for `pod` (keeps its netns).
    pub fn cni_del(&self, pod: &Pod) -> Result<(), LabError> {
        let att = self.attachment(
            &pod.netns_name,
            &pod.netns_path,
            &pod.name,
            &pod.namespace,
            &pod.uid,
        );
        Ok(self.runner.del(&att, Some(&pod.result))?)
    }

    /// Runs CNI DEL for `pod` and deletes its netns.
    pub fn del_pod(&self, pod: &Pod) -> Result<(), LabError> {
        let res = self.cni_del(pod);
        let _ = ip(&["netns", "del", &pod.netns_name]);
        if let Ok(mut pods) = self.pods.lock() {
            pods.retain(|p| p.netns_name != pod.netns_name);
        }
        res
    }

    /// A command that runs inside `netns_name` (via `ip netns exec`).
    pub fn exec_in(netns_name: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", netns_name, program]);
        c
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let pods = self.pods.lock().map(|p| p.clone()).unwrap_or_default();
        for pod in pods.iter().rev() {
            let _ = self.del_pod(pod);
        }
        let _ = ip(&["netns", "del", &self.node_name]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Small stable hash for making unique-looking UIDs.
fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) & 0xffff_ffff_ffff
}

impl Lab {
    /// Starts `<exe> node --config <config> --run-dir <run_dir> <extra...>` inside the
    /// node netns with `RUST_LOG=<log_level>` and stderr in `<lab dir>/node.log`, and waits up to 15 s
    /// for its plugin socket. Returns the process (stopped when dropped) and the log path.
    pub fn start_node(
        &self,
        exe: &Path,
        config: &Path,
        run_dir: &Path,
        log_level: &str,
        extra: &[std::ffi::OsString],
    ) -> Result<(ProcessGuard, PathBuf), LabError> {
        let mut args: Vec<std::ffi::OsString> = vec!["--config".into(), config.into()];
        args.extend_from_slice(extra);
        self.start_node_with(exe, run_dir, &args, &[], log_level)
    }

    /// Starts `<exe> node --run-dir <run_dir> <args...>` with the extra environment `env` (e.g.
    /// ztunnel's `XDS_ADDRESS`) inside the node netns, as [`Lab::start_node`] does.
    pub fn start_node_with(
        &self,
        exe: &Path,
        run_dir: &Path,
        args: &[std::ffi::OsString],
        env: &[(String, String)],
        log_level: &str,
    ) -> Result<(ProcessGuard, PathBuf), LabError> {
        let log = self.dir.join("node.log");
        let stderr =
            std::fs::File::create(&log).map_err(io(format!("create {}", log.display())))?;
        let mut cmd = Command::new(exe);
        cmd.arg("node")
            .arg("--run-dir")
            .arg(run_dir)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", log_level)
            .stdout(std::process::Stdio::null())
            .stderr(stderr);
        let node = ProcessGuard(self.spawn_in_node(cmd)?);
        let socket = crate::podevent::plugin_socket_path(run_dir);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        while !socket.exists() {
            if std::time::Instant::now() >= deadline {
                return Err(LabError::NodeStart(log));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok((node, log))
    }

    /// Joins this node and `other` with a veth pair (`<prefix>-wan` on each side, this side
    /// [`LINK_ADDRS`]`.0`, the other `.1`, a /30) and routes each node's pod subnet to the other
    /// through it, so pods of the two labs reach each other as pods on two nodes do. The link
    /// goes away with the namespaces.
    pub fn link(&self, other: &Lab) -> Result<(), LabError> {
        let (a, b) = (
            format!("{}-wan", self.opts.prefix),
            format!("{}-wan", other.opts.prefix),
        );
        let (a_ip, b_ip) = (LINK_ADDRS.0.to_string(), LINK_ADDRS.1.to_string());
        ip(&[
            "-n",
            &self.node_name,
            "link",
            "add",
            &a,
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            &other.node_name,
        ])?;
        for (ns, dev, addr) in [(&self.node_name, &a, &a_ip), (&other.node_name, &b, &b_ip)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        ip(&[
            "-n",
            &self.node_name,
            "route",
            "add",
            &other.opts.subnet,
            "via",
            &b_ip,
        ])?;
        ip(&[
            "-n",
            &other.node_name,
            "route",
            "add",
            &self.opts.subnet,
            "via",
            &a_ip,
        ])?;
        Ok(())
    }

    /// Starts tcpdump on the bridge (TCP only, immediate mode) writing to `pcap`, and waits until it
    /// listens. Stop it (drop the guard) before reading the file.
    pub fn capture(&self, pcap: &Path) -> Result<ProcessGuard, LabError> {
        let log = pcap.with_extension("tcpdump.log");
        let stderr =
            std::fs::File::create(&log).map_err(io(format!("create {}", log.display())))?;
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.node_name,
                "tcpdump",
                "--immediate-mode",
                "-i",
                &self.bridge(),
                "-U",
                "-n",
                "-w",
            ])
            .arg(pcap)
            .arg("tcp")
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(io("start tcpdump"))?;
        let guard = ProcessGuard(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("listening on")) {
            if std::time::Instant::now() >= deadline {
                return Err(LabError::Capture(log));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(guard)
    }

    /// Spawns `cmd` inside the node netns (the child inherits the namespace of the spawning thread).
    pub fn spawn_in_node(&self, mut cmd: Command) -> Result<std::process::Child, LabError> {
        self.node
            .run(move || cmd.spawn())?
            .map_err(io("spawn process in the node netns"))
    }

    /// Connects from inside `netns` to `addr` (blocking std stream; it stays in that namespace).
    pub fn connect_from(
        netns: &Netns,
        addr: std::net::SocketAddr,
    ) -> Result<std::net::TcpStream, LabError> {
        netns
            .run(move || {
                std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5))
            })?
            .map_err(io(format!("connect to {addr}")))
    }

    /// Binds a listener inside `netns` (SO_REUSEADDR, backlog 4096).
    pub fn listen_in(
        netns: &Netns,
        addr: std::net::SocketAddr,
    ) -> Result<std::net::TcpListener, LabError> {
        netns
            .run(move || -> std::io::Result<std::net::TcpListener> {
                use socket2::{Domain, Socket, Type};
                let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
                sock.set_reuse_address(true)?;
                sock.bind(&addr.into())?;
                // Bursts of connections (the bench's idle connections) must not overflow the accept
                // queue: an overflowed connection that never sends data never reaches accept().
                sock.listen(LISTEN_BACKLOG)?;
                Ok(sock.into())
            })?
            .map_err(io(format!("listen on {addr}")))
    }
}

/// The two ends of a [`Lab::link`]: the node that links, and the node it links to.
pub const LINK_ADDRS: (std::net::Ipv4Addr, std::net::Ipv4Addr) = (
    std::net::Ipv4Addr::new(192, 168, 250, 1),
    std::net::Ipv4Addr::new(192, 168, 250, 2),
);

/// Accept queue length of [`Lab::listen_in`] listeners (the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: i32 = 4096;

/// Local config YAML (ztunnel format) for pods `(name, namespace, service account, ip)` on `node`,
/// all with protocol HBONE, the pod name as workload and canonical name, revision `latest` (what
/// the telemetry labels show) and no services (`services: {}`, which ztunnel requires).
pub fn local_config(node: &str, pods: &[(&str, &str, &str, std::net::IpAddr)]) -> String {
    local_config_with_protocol(node, pods, "HBONE")
}

/// [`local_config`] with every workload's `protocol` set to `protocol` (`HBONE` or `TCP`; with
/// `TCP` a proxy passes the pods' traffic through in plain TCP, captured but not encrypted).
pub fn local_config_with_protocol(
    node: &str,
    pods: &[(&str, &str, &str, std::net::IpAddr)],
    protocol: &str,
) -> String {
    let mut y = String::from("workloads:\n");
    for (name, ns, sa, ip) in pods {
        y.push_str(&format!(
            "- uid: cluster1//v1/Pod/{ns}/{name}\n  name: {name}\n  namespace: {ns}\n  serviceAccount: {sa}\n  \
             workloadIps: [\"{ip}\"]\n  protocol: {protocol}\n  node: {node}\n  workloadName: {name}\n  \
             canonicalName: {name}\n  canonicalRevision: latest\n  services: {{}}\n"
        ));
    }
    y
}

/// A child process that is stopped (SIGTERM, then SIGKILL after 3 s) when dropped.
#[derive(Debug)]
pub struct ProcessGuard(pub std::process::Child);

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
