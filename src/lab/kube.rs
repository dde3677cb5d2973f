//! Kubernetes for the lab: the fake API server (`../shared/tools/fake-apiserver`, Python standard
//! library) started inside the lab's node netns, a small HTTP/1.1 client for its REST API, and a
//! fake procfs in which the agent's netns finder sees each lab pod as a process.
//!
//! The tests (`tests/e2e_kube.rs`) and `ztnode bench --only kube` use them; nothing here leaves the
//! namespaces the lab made.

use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::node::{Lab, LabError, ProcessGuard};
use crate::netns::Netns;

/// Where the fake API server lives relative to a checkout (`../shared/tools/...`).
pub const FAKE_APISERVER_SCRIPT: &str = "../shared/tools/fake-apiserver/fake_apiserver.py";

/// The fake API server, running in the lab's node netns on 127.0.0.1.
#[derive(Debug)]
pub struct FakeApi {
    process: Option<ProcessGuard>,
    script: PathBuf,
    dir: PathBuf,
    /// Its address (reachable from the node netns only).
    pub addr: SocketAddr,
    /// A kubeconfig for it.
    pub kubeconfig: PathBuf,
    node: Netns,
}

fn fail(what: impl Into<String>) -> LabError {
    LabError::FakeApi(what.into())
}

impl FakeApi {
    /// Starts `script` (the fake API server) inside `lab`'s node netns on `port` (0: a free one),
    /// preloaded with the objects of `load`; its files (port, kubeconfig, log) go to `dir`.
    pub fn start(
        lab: &Lab,
        script: &Path,
        dir: &Path,
        port: u16,
        load: Option<&Path>,
    ) -> Result<FakeApi, LabError> {
        let port_file = dir.join("apiserver.port");
        let kubeconfig = dir.join("kubeconfig");
        let _ = std::fs::remove_file(&port_file);
        let _ = std::fs::remove_file(&kubeconfig);
        let log =
            std::fs::File::create(dir.join("apiserver.log")).map_err(|source| LabError::Io {
                what: "create the API server log".into(),
                source,
            })?;
        let mut cmd = Command::new("python3");
        cmd.arg(script)
            .arg("--port")
            .arg(port.to_string())
            .args(["--bookmark-interval", "1", "--port-file"])
            .arg(&port_file)
            .arg("--write-kubeconfig")
            .arg(&kubeconfig)
            .args(
                load.map(|l| vec![std::ffi::OsString::from("--load"), l.into()])
                    .unwrap_or_default(),
            )
            .stdout(Stdio::null())
            .stderr(log);
        let process = ProcessGuard(lab.spawn_in_node(cmd)?);
        let deadline = Instant::now() + Duration::from_secs(15);
        let port: u16 = loop {
            if let Some(p) = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                && kubeconfig.exists()
            {
                break p;
            }
            if Instant::now() >= deadline {
                return Err(fail(format!(
                    "{} did not start within 15 s; see {}",
                    script.display(),
                    dir.join("apiserver.log").display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(FakeApi {
            process: Some(process),
            script: script.to_owned(),
            dir: dir.to_owned(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            kubeconfig,
            node: lab.node().clone(),
        })
    }

    /// Stops the server (its objects are gone with it).
    pub fn stop(&mut self) {
        self.process = None;
    }

    /// Starts the server again on the same port, preloaded with `load`.
    pub fn restart(&mut self, lab: &Lab, load: &Path) -> Result<(), LabError> {
        self.stop();
        let (script, dir) = (self.script.clone(), self.dir.clone());
        *self = FakeApi::start(lab, &script, &dir, self.addr.port(), Some(load))?;
        Ok(())
    }

    /// One request; returns the status code and the JSON body (`Null` when empty or not JSON).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &Value)>,
    ) -> Result<(u16, Value), LabError> {
        super::http::request(&self.node, self.addr, method, path, body)
    }

    /// A request that must succeed (2xx): its body.
    pub fn ok(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &Value)>,
    ) -> Result<Value, LabError> {
        let (code, v) = self.request(method, path, body)?;
        if (200..300).contains(&code) {
            Ok(v)
        } else {
            Err(fail(format!("{method} {path}: {code} {v}")))
        }
    }

    /// Creates namespace `name` with `labels`.
    pub fn create_namespace(&self, name: &str, labels: Value) -> Result<(), LabError> {
        let body = json!({"metadata": {"name": name, "labels": labels}});
        self.ok(
            "POST",
            "/api/v1/namespaces",
            Some(("application/json", &body)),
        )
        .map(drop)
    }

    /// Sets labels of namespace `name` (merge patch; `null` removes one).
    pub fn label_namespace(&self, name: &str, labels: Value) -> Result<(), LabError> {
        let body = json!({"metadata": {"labels": labels}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{name}"),
            Some(("application/merge-patch+json", &body)),
        )
        .map(drop)
    }

    /// Creates pod `namespace/name` with `uid` on `node`, service account `sa`, `labels`.
    pub fn create_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        sa: &str,
        labels: Value,
    ) -> Result<(), LabError> {
        let body = json!({
            "metadata": {"name": name, "uid": uid, "labels": labels},
            "spec": {"nodeName": node, "serviceAccountName": sa,
                     "containers": [{"name": "app", "image": "app"}]}
        });
        self.ok(
            "POST",
            &format!("/api/v1/namespaces/{namespace}/pods"),
            Some(("application/json", &body)),
        )
        .map(drop)
    }

    /// Sets labels of pod `namespace/name` (merge patch; `null` removes one).
    pub fn label_pod(&self, namespace: &str, name: &str, labels: Value) -> Result<(), LabError> {
        let body = json!({"metadata": {"labels": labels}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}"),
            Some(("application/merge-patch+json", &body)),
        )
        .map(drop)
    }

    /// Sets annotations of pod `namespace/name` (merge patch; `null` removes one).
    pub fn annotate_pod(
        &self,
        namespace: &str,
        name: &str,
        annotations: Value,
    ) -> Result<(), LabError> {
        let body = json!({"metadata": {"annotations": annotations}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}"),
            Some(("application/merge-patch+json", &body)),
        )
        .map(drop)
    }

    /// Marks pod `namespace/name` running with IP `ip` (what the kubelet reports).
    pub fn set_pod_running(&self, namespace: &str, name: &str, ip: IpAddr) -> Result<(), LabError> {
        let body = json!({"status": {"phase": "Running", "podIP": ip.to_string(),
                                     "podIPs": [{"ip": ip.to_string()}]}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}/status"),
            Some(("application/merge-patch+json", &body)),
        )
        .map(drop)
    }

    /// Clears pod `namespace/name`'s IPs (what the API shows before the kubelet reports them).
    pub fn clear_pod_ips(&self, namespace: &str, name: &str) -> Result<(), LabError> {
        let body = json!({"status": {"podIP": null, "podIPs": null}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}/status"),
            Some(("application/merge-patch+json", &body)),
        )
        .map(drop)
    }

    /// The pod's `ambient.istio.io/redirection` annotation.
    pub fn redirection(&self, namespace: &str, name: &str) -> Result<Option<String>, LabError> {
        let pod = self.ok(
            "GET",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}"),
            None,
        )?;
        Ok(
            pod["metadata"]["annotations"]["ambient.istio.io/redirection"]
                .as_str()
                .map(str::to_owned),
        )
    }

    /// Ends every watch with a 410 Gone (`/fake/expire-history`): watchers must relist.
    pub fn expire_watches(&self) -> Result<(), LabError> {
        self.ok("POST", "/fake/expire-history?mode=error", None)
            .map(drop)
    }

    /// The server's current `resourceVersion`.
    pub fn resource_version(&self) -> Result<u64, LabError> {
        let v = self.ok("GET", "/fake/state", None)?;
        v["resourceVersion"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| v["resourceVersion"].as_u64())
            .ok_or_else(|| fail(format!("no resourceVersion in {v}")))
    }

    /// Every pod of `namespace` as the server has it (metadata, spec, status).
    pub fn pods(&self, namespace: &str) -> Result<Vec<Value>, LabError> {
        let v = self.ok("GET", &format!("/api/v1/namespaces/{namespace}/pods"), None)?;
        Ok(v["items"].as_array().cloned().unwrap_or_default())
    }

    /// Namespace `name` as the server has it.
    pub fn namespace(&self, name: &str) -> Result<Value, LabError> {
        self.ok("GET", &format!("/api/v1/namespaces/{name}"), None)
    }
}

/// A fake procfs in which each lab pod is one process (cgroup naming its UID, `ns/net` its
/// netns). Removed when dropped.
#[derive(Debug)]
pub struct FakeProc {
    /// Its root (the agent's `--proc-root`).
    pub root: PathBuf,
}

impl FakeProc {
    /// An empty tree at `root` (recreated).
    pub fn new(root: PathBuf) -> Result<FakeProc, LabError> {
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).map_err(|source| LabError::Io {
            what: format!("create {}", root.display()),
            source,
        })?;
        Ok(FakeProc { root })
    }

    /// Process `pid` of the pod with `uid`, in netns `/var/run/netns/<netns_name>` (its start time
    /// is `pid`, so lower pids are older).
    pub fn pod(&self, pid: u32, uid: &str, netns_name: &str) -> Result<(), LabError> {
        let dir = self.root.join(pid.to_string());
        let io = |what: &'static str| {
            move |source| LabError::Io {
                what: what.into(),
                source,
            }
        };
        std::fs::create_dir_all(dir.join("ns")).map_err(io("fake proc dir"))?;
        let cgroup = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{pid:x}ab.scope\n",
            uid.replace('-', "_")
        );
        std::fs::write(dir.join("cgroup"), cgroup).map_err(io("fake cgroup"))?;
        let _ = std::fs::remove_file(dir.join("ns/net"));
        symlink(format!("/var/run/netns/{netns_name}"), dir.join("ns/net"))
            .map_err(io("fake ns/net"))?;
        let stat =
            format!("{pid} (pause) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {pid} 8000 200\n");
        std::fs::write(dir.join("stat"), stat).map_err(io("fake stat"))
    }
}

impl Drop for FakeProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
