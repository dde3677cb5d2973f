//! Kubernetes pieces of the end-to-end tests: the fake API server (`../shared/tools/fake-apiserver`)
//! started inside the lab's node netns, a small HTTP/1.1 client for its REST API, and a fake procfs
//! in which the agent's netns finder sees each lab pod as a process.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use ztnode::lab::{Lab, ProcessGuard};
use ztnode::netns::Netns;

/// The fake API server, running in the lab's node netns on 127.0.0.1.
pub struct FakeApi {
    process: Option<ProcessGuard>,
    dir: PathBuf,
    /// Its address (reachable from the node netns only).
    pub addr: SocketAddr,
    /// A kubeconfig for it.
    pub kubeconfig: PathBuf,
    node: Netns,
}

impl FakeApi {
    /// Starts the server inside `lab`'s node netns; its files go to `dir`.
    pub fn start(lab: &Lab, dir: &Path) -> FakeApi {
        FakeApi::start_with(lab, dir, 0, None)
    }

    /// [`FakeApi::start`] on `port` (0: a free one), preloading the objects of `load`.
    pub fn start_with(lab: &Lab, dir: &Path, port: u16, load: Option<&Path>) -> FakeApi {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../shared/tools/fake-apiserver/fake_apiserver.py"
        );
        let port_file = dir.join("apiserver.port");
        let kubeconfig = dir.join("kubeconfig");
        let _ = std::fs::remove_file(&port_file);
        let _ = std::fs::remove_file(&kubeconfig);
        let log = std::fs::File::create(dir.join("apiserver.log")).expect("apiserver log");
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
        let process = ProcessGuard(lab.spawn_in_node(cmd).expect("start the fake API server"));
        let deadline = Instant::now() + Duration::from_secs(15);
        let port: u16 = loop {
            if let Some(p) = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                && kubeconfig.exists()
            {
                break p;
            }
            assert!(
                Instant::now() < deadline,
                "the fake API server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        FakeApi {
            process: Some(process),
            dir: dir.to_owned(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            kubeconfig,
            node: lab.node().clone(),
        }
    }

    /// Stops the server (its objects are gone with it).
    pub fn stop(&mut self) {
        self.process = None;
    }

    /// Starts the server again on the same port, preloaded with `load`.
    pub fn restart(&mut self, lab: &Lab, load: &Path) {
        self.stop();
        *self = FakeApi::start_with(lab, &self.dir.clone(), self.addr.port(), Some(load));
    }

    /// One request; returns the status code and the JSON body (`Null` when empty or not JSON).
    pub fn request(&self, method: &str, path: &str, body: Option<(&str, &Value)>) -> (u16, Value) {
        let mut s = Lab::connect_from(&self.node, self.addr).expect("connect to the API server");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let payload = body.map(|(_, v)| v.to_string()).unwrap_or_default();
        let ctype = body.map(|(c, _)| c).unwrap_or("application/json");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: fake\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
            payload.len()
        )
        .expect("send request");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("read response");
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_owned()
        };
        (code, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    fn ok(&self, method: &str, path: &str, body: Option<(&str, &Value)>) -> Value {
        let (code, v) = self.request(method, path, body);
        assert!((200..300).contains(&code), "{method} {path}: {code} {v}");
        v
    }

    /// Creates namespace `name` with `labels`.
    pub fn create_namespace(&self, name: &str, labels: Value) {
        let body = json!({"metadata": {"name": name, "labels": labels}});
        self.ok(
            "POST",
            "/api/v1/namespaces",
            Some(("application/json", &body)),
        );
    }

    /// Sets labels of namespace `name` (merge patch; `null` removes one).
    pub fn label_namespace(&self, name: &str, labels: Value) {
        let body = json!({"metadata": {"labels": labels}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{name}"),
            Some(("application/merge-patch+json", &body)),
        );
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
    ) {
        let body = json!({
            "metadata": {"name": name, "uid": uid, "labels": labels},
            "spec": {"nodeName": node, "serviceAccountName": sa,
                     "containers": [{"name": "app", "image": "app"}]}
        });
        self.ok(
            "POST",
            &format!("/api/v1/namespaces/{namespace}/pods"),
            Some(("application/json", &body)),
        );
    }

    /// Sets labels of pod `namespace/name` (merge patch; `null` removes one).
    pub fn label_pod(&self, namespace: &str, name: &str, labels: Value) {
        let body = json!({"metadata": {"labels": labels}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}"),
            Some(("application/merge-patch+json", &body)),
        );
    }

    /// Marks pod `namespace/name` running with IP `ip` (what the kubelet reports).
    pub fn set_pod_running(&self, namespace: &str, name: &str, ip: std::net::IpAddr) {
        let body = json!({"status": {"phase": "Running", "podIP": ip.to_string(),
                                     "podIPs": [{"ip": ip.to_string()}]}});
        self.ok(
            "PATCH",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}/status"),
            Some(("application/merge-patch+json", &body)),
        );
    }

    /// The pod's `ambient.istio.io/redirection` annotation.
    pub fn redirection(&self, namespace: &str, name: &str) -> Option<String> {
        let pod = self.ok(
            "GET",
            &format!("/api/v1/namespaces/{namespace}/pods/{name}"),
            None,
        );
        pod["metadata"]["annotations"]["ambient.istio.io/redirection"]
            .as_str()
            .map(str::to_owned)
    }

    /// Waits up to `timeout` for the annotation to be `want`.
    pub fn wait_redirection(
        &self,
        namespace: &str,
        name: &str,
        want: Option<&str>,
        timeout: Duration,
    ) {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.redirection(namespace, name);
            if got.as_deref() == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{namespace}/{name}: redirection annotation {got:?}, want {want:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server's current `resourceVersion`.
    pub fn resource_version(&self) -> u64 {
        let v = self.ok("GET", "/fake/state", None);
        v["resourceVersion"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| v["resourceVersion"].as_u64())
            .expect("resourceVersion")
    }

    /// Every pod of `namespace` as the server has it (metadata, spec, status).
    pub fn pods(&self, namespace: &str) -> Vec<Value> {
        let v = self.ok("GET", &format!("/api/v1/namespaces/{namespace}/pods"), None);
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// Namespace `name` as the server has it.
    pub fn namespace(&self, name: &str) -> Value {
        self.ok("GET", &format!("/api/v1/namespaces/{name}"), None)
    }

    /// Ends every watch with a 410 Gone (`/fake/expire-history`): watchers must relist.
    pub fn expire_watches(&self) {
        self.ok("POST", "/fake/expire-history?mode=error", None);
    }

    /// Requests the server logged for `method` (e.g. `PATCH`), as `(path, body)`.
    pub fn requests(&self, method: &str) -> Vec<(String, String)> {
        let v = self.ok("GET", &format!("/fake/requests?method={method}"), None);
        v.as_array()
            .or_else(|| v["requests"].as_array())
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r["path"].as_str().unwrap_or_default().to_owned(),
                    r["body"].to_string(),
                )
            })
            .collect()
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A fake procfs in which each lab pod is one process (cgroup naming its UID, `ns/net` its netns).
pub struct FakeProc {
    /// Its root (the agent's `--proc-root`).
    pub root: PathBuf,
}

impl FakeProc {
    /// An empty tree at `root` (recreated).
    pub fn new(root: PathBuf) -> FakeProc {
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("fake proc");
        FakeProc { root }
    }

    /// Process `pid` of the pod with `uid`, in netns `/var/run/netns/<netns_name>`.
    pub fn pod(&self, pid: u32, uid: &str, netns_name: &str) {
        let dir = self.root.join(pid.to_string());
        std::fs::create_dir_all(dir.join("ns")).expect("pid dir");
        let cgroup = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{pid:x}ab.scope\n",
            uid.replace('-', "_")
        );
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        let _ = std::fs::remove_file(dir.join("ns/net"));
        symlink(format!("/var/run/netns/{netns_name}"), dir.join("ns/net")).expect("ns/net");
        let stat =
            format!("{pid} (pause) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {pid} 8000 200\n");
        std::fs::write(dir.join("stat"), stat).expect("stat");
    }
}

impl Drop for FakeProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
