//! The lab's fake API server and fake procfs (`ztnode::lab::kube`) for the end-to-end tests:
//! the same calls, failing the test on an error, plus waits.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use ztnode::lab::Lab;
use ztnode::lab::kube::{self, FAKE_APISERVER_SCRIPT};

/// [`kube::FakeApi`] whose calls fail the test on an error.
pub struct FakeApi(kube::FakeApi);

/// [`kube::FakeProc`] whose calls fail the test on an error.
pub struct FakeProc(kube::FakeProc);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(FAKE_APISERVER_SCRIPT)
}

impl FakeApi {
    /// Starts the server inside `lab`'s node netns; its files go to `dir`.
    pub fn start(lab: &Lab, dir: &Path) -> FakeApi {
        FakeApi(kube::FakeApi::start(lab, &script(), dir, 0, None).expect("fake API server"))
    }

    /// Its address (node netns).
    pub fn addr(&self) -> SocketAddr {
        self.0.addr
    }

    /// Its kubeconfig.
    pub fn kubeconfig(&self) -> &Path {
        &self.0.kubeconfig
    }

    /// Stops it.
    pub fn stop(&mut self) {
        self.0.stop();
    }

    /// Starts it again on the same port with the objects of `load`.
    pub fn restart(&mut self, lab: &Lab, load: &Path) {
        self.0
            .restart(lab, load)
            .expect("restart the fake API server");
    }

    pub fn create_namespace(&self, name: &str, labels: Value) {
        self.0
            .create_namespace(name, labels)
            .expect("create namespace");
    }

    pub fn label_namespace(&self, name: &str, labels: Value) {
        self.0
            .label_namespace(name, labels)
            .expect("label namespace");
    }

    pub fn create_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        sa: &str,
        labels: Value,
    ) {
        self.0
            .create_pod(namespace, name, uid, node, sa, labels)
            .expect("create pod");
    }

    pub fn label_pod(&self, namespace: &str, name: &str, labels: Value) {
        self.0
            .label_pod(namespace, name, labels)
            .expect("label pod");
    }

    pub fn annotate_pod(&self, namespace: &str, name: &str, annotations: Value) {
        self.0
            .annotate_pod(namespace, name, annotations)
            .expect("annotate pod");
    }

    pub fn set_pod_running(&self, namespace: &str, name: &str, ip: IpAddr) {
        self.0
            .set_pod_running(namespace, name, ip)
            .expect("pod status");
    }

    pub fn clear_pod_ips(&self, namespace: &str, name: &str) {
        self.0
            .clear_pod_ips(namespace, name)
            .expect("clear pod IPs");
    }

    pub fn redirection(&self, namespace: &str, name: &str) -> Option<String> {
        self.0.redirection(namespace, name).expect("get pod")
    }

    /// Waits up to `timeout` for the pod's redirection annotation to be `want`.
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

    pub fn expire_watches(&self) {
        self.0.expire_watches().expect("expire history");
    }

    pub fn resource_version(&self) -> u64 {
        self.0.resource_version().expect("resourceVersion")
    }

    pub fn pods(&self, namespace: &str) -> Vec<Value> {
        self.0.pods(namespace).expect("list pods")
    }

    pub fn namespace(&self, name: &str) -> Value {
        self.0.namespace(name).expect("get namespace")
    }
}

impl FakeProc {
    pub fn new(root: PathBuf) -> FakeProc {
        FakeProc(kube::FakeProc::new(root).expect("fake proc"))
    }

    pub fn root(&self) -> &Path {
        &self.0.root
    }

    pub fn pod(&self, pid: u32, uid: &str, netns_name: &str) {
        self.0.pod(pid, uid, netns_name).expect("fake proc entry");
    }
}
