//! The shared fake Kubernetes API server (`../shared/tools/fake-apiserver`, Python stdlib) as a test
//! fixture: started on a free loopback port, driven through its REST API with a tiny HTTP/1.1
//! client, killed when the guard drops (also when the test panics).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The server script.
pub const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/tools/fake-apiserver/fake_apiserver.py"
);

/// A running fake API server; killed on drop.
pub struct FakeApiServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

/// An answer of the server: status code and JSON body (`Null` when the body is not JSON).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

impl FakeApiServer {
    /// Starts the server with a fresh port and kubeconfig; waits until it answers `/healthz`.
    pub fn start() -> FakeApiServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let port_file = dir.path().join("port");
        let kubeconfig = dir.path().join("kubeconfig");
        let child = Command::new("python3")
            .arg(SCRIPT)
            .args(["--port", "0", "--port-file"])
            .arg(&port_file)
            .arg("--write-kubeconfig")
            .arg(&kubeconfig)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn python3 fake_apiserver.py");
        let mut server = FakeApiServer {
            child: Some(child),
            port: 0,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let port = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|s| s.trim().parse::<u16>().ok());
            if let Some(port) = port.filter(|_| kubeconfig.exists()) {
                server.port = port;
                if server.try_get("/healthz").is_some() {
                    return server;
                }
            }
            if let Some(child) = server.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("fake API server exited early: {status}");
            }
            assert!(Instant::now() < deadline, "fake API server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The kubeconfig it wrote (plain HTTP, token `fake-token`).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the server now (SIGKILL) and waits for it; the kubeconfig stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends one request (`Connection: close`) and returns the answer; panics on transport errors.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Answer {
        self.try_request(method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// Creates namespace `name` with `labels`.
    pub fn create_namespace(&self, name: &str, labels: Value) {
        let body = json!({"metadata": {"name": name, "labels": labels}});
        let a = self.request("POST", "/api/v1/namespaces", Some(&body));
        assert_eq!(a.status, 201, "create namespace {name}: {:?}", a.body);
    }

    /// Creates pod `namespace/name` with `metadata` merged into its metadata and `spec` extras.
    pub fn create_pod(&self, namespace: &str, name: &str, metadata: Value, spec: Value) {
        let mut meta = json!({"name": name});
        merge(&mut meta, metadata);
        let mut pod_spec = json!({"containers": [{"name": "app", "image": "nginx"}]});
        merge(&mut pod_spec, spec);
        let body = json!({"metadata": meta, "spec": pod_spec});
        let path = format!("/api/v1/namespaces/{namespace}/pods");
        let a = self.request("POST", &path, Some(&body));
        assert_eq!(a.status, 201, "create pod {namespace}/{name}: {:?}", a.body);
    }

    /// The API requests the server logged whose path starts with `prefix`.
    pub fn requests_under(&self, prefix: &str) -> Vec<Value> {
        let a = self.request("GET", &format!("/fake/requests?pathPrefix={prefix}"), None);
        assert_eq!(a.status, 200, "{:?}", a.body);
        a.body["items"].as_array().cloned().unwrap_or_default()
    }

    fn try_get(&self, path: &str) -> Option<Answer> {
        self.try_request("GET", path, None).ok()
    }

    fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> std::io::Result<Answer> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let payload = body.map(Value::to_string).unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\
             Accept: application/json\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.port,
            payload.len()
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(payload.as_bytes())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok(Answer {
            status,
            body: serde_json::from_str(body).unwrap_or(Value::Null),
        })
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Shallow-merges the object `extra` into the object `base`.
fn merge(base: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (base.as_object_mut(), extra) {
        b.extend(e);
    }
}
