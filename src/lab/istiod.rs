//! Istio's control plane for the lab: the fake istiod (`../shared/tools/fake-istiod`, Python +
//! grpcio: delta xDS and the Istio CA on one TLS gRPC port, a plain-HTTP control endpoint, a
//! JSON-lines event log) started inside a namespace the lab made, and a scratch namespace for tests
//! that need no node.
//!
//! Tests (`tests/xds.rs`, `tests/ca_client.rs`, the two-node e2e) and the bench use it; nothing here
//! leaves the namespaces the lab made.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::node::{Lab, LabError, ProcessGuard};
use crate::netns::Netns;

/// Where the fake istiod lives relative to a checkout (`../shared/tools/...`).
pub const FAKE_ISTIOD_SCRIPT: &str = "../shared/tools/fake-istiod/fake_istiod.py";

/// How long [`FakeIstiod::start`] waits for the ready file (the first start compiles the protos).
const START_TIMEOUT: Duration = Duration::from_secs(30);

fn fail(what: impl Into<String>) -> LabError {
    LabError::FakeIstiod(what.into())
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LabError {
    let what = what.into();
    move |source| LabError::Io { what, source }
}

/// A named netns of its own with only `lo` up, deleted when dropped (also on panic). For tests
/// that need a place for a server and a client but no node or pods.
#[derive(Debug)]
pub struct ScratchNetns {
    /// Its name (`ip netns`).
    pub name: String,
    /// The namespace.
    pub netns: Netns,
}

impl ScratchNetns {
    /// Creates `name` (deleting a leftover of the same name first) and brings `lo` up.
    ///
    /// # Errors
    /// `ip` failures (not root, no iproute2).
    pub fn new(name: &str) -> Result<ScratchNetns, LabError> {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        run_ip(&["netns", "add", name])?;
        let guard = ScratchNetns {
            name: name.to_owned(),
            netns: Netns::open(format!("/var/run/netns/{name}"))?,
        };
        run_ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(guard)
    }
}

impl Drop for ScratchNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

fn run_ip(args: &[&str]) -> Result<(), LabError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(io("run ip"))?;
    if !out.status.success() {
        return Err(LabError::Ip {
            args: args.join(" "),
            output: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// How to start the fake istiod.
#[derive(Debug, Clone)]
pub struct FakeIstiodOptions {
    /// World in local-config YAML/JSON shape (written to `<dir>/world.yaml`); `None`: empty world.
    pub world: Option<String>,
    /// Listen address; a non-loopback one (a lab node's address) adds `--netns-address`.
    pub host: IpAddr,
    /// gRPC port (0: a free one).
    pub port: u16,
    /// Extra flags, e.g. `--intermediate`, `--token zt=spiffe://cluster.local/ns/default/*`.
    pub args: Vec<String>,
}

impl Default for FakeIstiodOptions {
    fn default() -> Self {
        FakeIstiodOptions {
            world: None,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            args: Vec::new(),
        }
    }
}

/// The fake istiod, running in one namespace; stopped when dropped.
#[derive(Debug)]
pub struct FakeIstiod {
    process: Option<ProcessGuard>,
    netns: Netns,
    netns_name: String,
    script: PathBuf,
    dir: PathBuf,
    opts: FakeIstiodOptions,
    /// gRPC address (xDS and CA), reachable from that namespace (and routed neighbours).
    pub grpc: SocketAddr,
    /// Control endpoint address (plain HTTP).
    pub control: SocketAddr,
    /// The CA root (`<dir>/root-cert.pem`): trust this for the server and the workload leaves.
    pub root_cert: PathBuf,
    /// The JSON-lines event log.
    pub log: PathBuf,
}

impl FakeIstiod {
    /// Starts `script` inside the namespace `netns_name` with state dir `dir` (kept across
    /// [`FakeIstiod::restart`], so the CA root stays the same), and waits for its ready file.
    ///
    /// # Errors
    /// Spawn failures, or no ready file within 30 s (the message names the stderr log).
    pub fn start(
        netns_name: &str,
        script: &Path,
        dir: &Path,
        opts: FakeIstiodOptions,
    ) -> Result<FakeIstiod, LabError> {
        std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
        let netns = Netns::open(format!("/var/run/netns/{netns_name}"))?;
        let mut istiod = FakeIstiod {
            process: None,
            netns,
            netns_name: netns_name.to_owned(),
            script: script.to_owned(),
            dir: dir.to_owned(),
            grpc: SocketAddr::new(opts.host, opts.port),
            control: SocketAddr::new(opts.host, 0),
            root_cert: dir.join("root-cert.pem"),
            log: dir.join("events.jsonl"),
            opts,
        };
        istiod.spawn()?;
        Ok(istiod)
    }

    fn spawn(&mut self) -> Result<(), LabError> {
        let ready = self.dir.join("ready.json");
        let _ = std::fs::remove_file(&ready);
        let stderr_path = self.dir.join("istiod.stderr");
        let stderr = std::fs::File::create(&stderr_path)
            .map_err(io(format!("create {}", stderr_path.display())))?;
        let mut cmd = Lab::exec_in(&self.netns_name, "python3");
        cmd.arg(&self.script)
            .arg("--host")
            .arg(self.opts.host.to_string())
            .arg("--port")
            .arg(self.grpc.port().to_string())
            .arg("--state-dir")
            .arg(&self.dir)
            .arg("--ready-file")
            .arg(&ready)
            .arg("--gen-dir")
            .arg(gen_dir())
            .args(&self.opts.args)
            .stdout(Stdio::null())
            .stderr(stderr);
        if !self.opts.host.is_loopback() {
            cmd.arg("--netns-address");
        }
        if let Some(world) = &self.opts.world {
            let path = self.dir.join("world.yaml");
            std::fs::write(&path, world).map_err(io(format!("write {}", path.display())))?;
            cmd.arg("--world").arg(path);
        }
        self.process = Some(ProcessGuard(
            cmd.spawn().map_err(io("start the fake istiod"))?,
        ));
        let deadline = Instant::now() + START_TIMEOUT;
        let info: Value = loop {
            if let Some(v) = std::fs::read_to_string(&ready)
                .ok()
                .and_then(|s| serde_json::from_str(&s).ok())
            {
                break v;
            }
            if let Some(p) = self.process.as_mut()
                && let Ok(Some(status)) = p.0.try_wait()
            {
                return Err(fail(format!(
                    "{} exited with {status}; see {}",
                    self.script.display(),
                    stderr_path.display()
                )));
            }
            if Instant::now() >= deadline {
                return Err(fail(format!(
                    "{} did not start within {START_TIMEOUT:?}; see {}",
                    self.script.display(),
                    stderr_path.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let port = |key: &str| {
            info[key]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| fail(format!("ready file has no {key}: {info}")))
        };
        self.grpc = SocketAddr::new(self.opts.host, port("grpc_port")?);
        self.control = SocketAddr::new(self.opts.host, port("control_port")?);
        Ok(())
    }

    /// `https://<host>:<port>`: the `XDS_ADDRESS` / `CA_ADDRESS` to give a proxy.
    pub fn address(&self) -> String {
        format!("https://{}", self.grpc)
    }

    /// The state dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the server (SIGTERM; its streams end).
    pub fn stop(&mut self) {
        self.process = None;
    }

    /// Starts it again on the same gRPC port and state dir (same CA root, same world file).
    ///
    /// # Errors
    /// As [`FakeIstiod::start`].
    pub fn restart(&mut self) -> Result<(), LabError> {
        self.stop();
        self.opts.port = self.grpc.port();
        self.spawn()
    }

    /// One control call (`GET /clients`, `POST /apply` with a partial world, ...): status and JSON.
    ///
    /// # Errors
    /// Connection failures.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), LabError> {
        super::http::request(
            &self.netns,
            self.control,
            method,
            path,
            body.map(|b| ("application/json", b)),
        )
    }

    /// A control call that must succeed (2xx): its body.
    ///
    /// # Errors
    /// Connection failures or a non-2xx answer (with the server's message).
    pub fn ok(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, LabError> {
        let (code, v) = self.call(method, path, body)?;
        if (200..300).contains(&code) {
            Ok(v)
        } else {
            Err(fail(format!("{method} {path}: {code} {v}")))
        }
    }

    /// The events of the log so far, optionally only those named `event` (`xds_request`,
    /// `ca_request`, ...), in order.
    ///
    /// # Errors
    /// An unreadable log (a missing one is empty).
    pub fn events(&self, event: Option<&str>) -> Result<Vec<Value>, LabError> {
        let text = match std::fs::read_to_string(&self.log) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(format!("read {}", self.log.display()))(e)),
        };
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| event.is_none_or(|e| v["event"] == e))
            .collect())
    }

    /// Polls [`FakeIstiod::events`] until one named `event` satisfies `pred`, up to `timeout`.
    ///
    /// # Errors
    /// [`LabError::FakeIstiod`] on timeout (naming the event), or log read failures.
    pub fn wait_event(
        &self,
        event: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value, LabError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.events(Some(event))?.into_iter().find(|v| pred(v)) {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(fail(format!(
                    "no matching {event} event within {timeout:?}; see {}",
                    self.log.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The shared cache of compiled protos (keyed by their hash inside), so only the first start of a
/// run compiles them.
fn gen_dir() -> PathBuf {
    std::env::var_os("FAKE_ISTIOD_GEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("ztnode-fake-istiod-gen"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_log_has_no_events_and_a_bad_line_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("events.jsonl");
        std::fs::write(
            &log,
            "{\"event\":\"ready\"}\nnot json\n{\"event\":\"xds_request\",\"seq\":2}\n",
        )
        .expect("write");
        let istiod = FakeIstiod {
            process: None,
            netns: Netns::current().expect("netns"),
            netns_name: "unused".into(),
            script: PathBuf::new(),
            dir: dir.path().to_owned(),
            opts: FakeIstiodOptions::default(),
            grpc: "127.0.0.1:1".parse().expect("addr"),
            control: "127.0.0.1:1".parse().expect("addr"),
            root_cert: PathBuf::new(),
            log: log.clone(),
        };
        assert_eq!(istiod.events(None).expect("events").len(), 2);
        let reqs = istiod.events(Some("xds_request")).expect("events");
        assert_eq!(reqs.len(), 1);
        assert_eq!(reqs[0]["seq"], 2);
        std::fs::remove_file(&log).expect("rm");
        assert!(istiod.events(None).expect("events").is_empty());
    }
}
