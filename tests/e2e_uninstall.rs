//! End to end, Kubernetes mode: what SIGTERM leaves on the node, decided as istio-cni decides it
//! (`../shared/spec/istio-cni.md` §2.6, §3.10). `ztnode node` runs in a lab node with the installer
//! on (temp CNI dirs), one enrolled pod, and the fake API server behind a small front that answers
//! the agent's `GET` of its own DaemonSet as the test says (the fake serves no `apps` group).
//! - DaemonSet there (and, with a `nodeSelector`, still selecting this node, read from the Node):
//!   an upgrade or a reboot, the plugin binary, its config entry, its kubeconfig and the host
//!   probe table stay;
//! - DaemonSet gone (the fake's own 404), no longer selecting this node, being deleted, or the
//!   token refused (401): each host artefact is removed;
//! - the lookup forbidden (403, as istio-cni counts only 401): a failed lookup, everything stays;
//! - every time, the enrolled pod keeps its in-pod rules.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::kube::{FakeApi, FakeProc};
use common::node::MeshNode;
use serde_json::{Value, json};
use ztnode::agent::install::{PLUGIN_BINARY_NAME, PLUGIN_KUBECONFIG_NAME, PLUGIN_TYPE};
use ztnode::agent::redirect::host::HOST_NAT_TABLE;
use ztnode::lab::{Lab, LabOptions, MeshLab, MeshSpec, MeshStage};
use ztnode::netns::Netns;
use ztnode::nft::Table;

const SUBNET: &str = "10.248.7.0/24";
const KUBELET_UID: u32 = 4242;
const DS_PATH: &str = "/apis/apps/v1/namespaces/istio-system/daemonsets/ztnode";
const FLANNEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/testdata/real-conflists/10-flannel.conflist"
);

/// What the front answers for the DaemonSet.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ds {
    /// Pass to the fake API server (404: it serves no `apps` group).
    Passthrough,
    Present,
    /// There, with `nodeSelector: kubernetes.io/os: <os>` (this node is linux).
    Selecting(&'static str),
    Deleting,
    Unauthorized,
    Forbidden,
}

/// An HTTP/1.1 front in the node netns: the DaemonSet GET from `state`, everything else passed
/// to `upstream` one request per connection (`Connection: close` both ways, so watches stream).
struct Front {
    addr: SocketAddr,
    state: Arc<Mutex<Ds>>,
}

impl Front {
    fn start(node: &Netns, upstream: SocketAddr) -> Front {
        let listener = node
            .run(|| TcpListener::bind("127.0.0.1:0"))
            .expect("netns")
            .expect("bind front");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(Ds::Passthrough));
        let st = state.clone();
        let node = Arc::new(node.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (st, node) = (st.clone(), node.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &st, &node, upstream);
                });
            }
        });
        Front { addr, state }
    }

    fn set(&self, ds: Ds) {
        *self.state.lock().expect("state") = ds;
    }
}

/// Reads a request or response head (through the blank line).
fn read_head(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Vec<String>>> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        let line = line.trim_end().to_owned();
        if line.is_empty() {
            return Ok(Some(lines));
        }
        lines.push(line);
    }
}

/// `head` with `Connection: close` instead of any Connection header.
fn closing(head: &[String]) -> String {
    let mut out: String = head
        .iter()
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .map(|l| format!("{l}\r\n"))
        .collect();
    out.push_str("Connection: close\r\n\r\n");
    out
}

fn content_length(head: &[String]) -> usize {
    head.iter()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

fn answer(c: &mut TcpStream, status: &str, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn daemonset(deleting: bool, os: Option<&str>) -> Value {
    let mut meta = json!({"name": "ztnode", "namespace": "istio-system", "uid": "ds-uid", "resourceVersion": "1"});
    if deleting {
        meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    }
    let mut pod = json!({"containers": [{"name": "ztnode"}]});
    if let Some(os) = os {
        pod["nodeSelector"] = json!({"kubernetes.io/os": os});
    }
    json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta, "spec": {
        "selector": {"matchLabels": {"app": "ztnode"}},
        "template": {"metadata": {"labels": {"app": "ztnode"}}, "spec": pod}
    }})
}

/// This node as the API server has it (the fake serves only the nodes it was given).
fn node_object(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "uid": "node-uid", "resourceVersion": "1",
        "labels": {"kubernetes.io/os": "linux", "kubernetes.io/hostname": name}
    }})
}

fn serve(
    client: TcpStream,
    state: &Mutex<Ds>,
    node: &Netns,
    upstream: SocketAddr,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut client = client;
    loop {
        let Some(head) = read_head(&mut reader)? else {
            return Ok(());
        };
        let path = head
            .first()
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or_default()
            .to_owned();
        let ds = *state.lock().expect("state");
        let bare = path.split('?').next().unwrap_or_default();
        if let Some(name) = bare.strip_prefix("/api/v1/nodes/") {
            answer(&mut client, "200 OK", &node_object(name))?;
            continue;
        }
        if bare == DS_PATH && ds != Ds::Passthrough {
            match ds {
                Ds::Present => answer(&mut client, "200 OK", &daemonset(false, None))?,
                Ds::Selecting(os) => answer(&mut client, "200 OK", &daemonset(false, Some(os)))?,
                Ds::Deleting => answer(&mut client, "200 OK", &daemonset(true, None))?,
                Ds::Forbidden => answer(
                    &mut client,
                    "403 Forbidden",
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": "daemonsets.apps \"ztnode\" is forbidden", "reason": "Forbidden", "code": 403}),
                )?,
                _ => answer(
                    &mut client,
                    "401 Unauthorized",
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": "Unauthorized", "reason": "Unauthorized", "code": 401}),
                )?,
            }
            continue;
        }
        let mut body = vec![0; content_length(&head)];
        reader.read_exact(&mut body)?;
        let mut up =
            Lab::connect_from(node, upstream).map_err(|e| std::io::Error::other(e.to_string()))?;
        up.write_all(closing(&head).as_bytes())?;
        up.write_all(&body)?;
        let mut up_reader = BufReader::new(up);
        let Some(resp) = read_head(&mut up_reader)? else {
            return Ok(());
        };
        client.write_all(closing(&resp).as_bytes())?;
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = up_reader.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            client.write_all(&buf[..n])?;
        }
    }
}

/// The host artefacts of an installed Kubernetes-mode agent.
struct Artefacts {
    binary: PathBuf,
    conf: PathBuf,
    kubeconfig: PathBuf,
}

impl Artefacts {
    /// Each artefact's presence: binary, our conflist entry, kubeconfig, host probe table.
    fn present(&self, node: &Netns) -> [bool; 4] {
        let chained = std::fs::read(&self.conf)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["plugins"].as_array().cloned())
            .is_some_and(|p| p.iter().any(|p| p["type"] == PLUGIN_TYPE));
        let table = node
            .run(|| ztnode::nft::table_exists(&Table::inet(HOST_NAT_TABLE)))
            .expect("netns")
            .expect("list tables");
        [
            self.binary.exists(),
            chained,
            self.kubeconfig.exists(),
            table,
        ]
    }
}

fn wait_for(what: &str, log: &Path, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what}; node log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM, then the exit (bounded).
fn terminate(child: &mut std::process::Child, log: &Path) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    wait_for(
        "the node did not exit after SIGTERM",
        log,
        Duration::from_secs(30),
        || child.try_wait().ok().flatten().is_some(),
    );
}

#[test]
fn sigterm_keeps_the_host_on_upgrade_and_cleans_it_on_uninstall() {
    if !common::privileged("sigterm_keeps_the_host_on_upgrade_and_cleans_it_on_uninstall") {
        return;
    }
    let prefix = common::prefix("unst");
    let dir = std::env::temp_dir().join(format!("ztnode-e2e-uninstall-{prefix}"));
    let _ = std::fs::remove_dir_all(&dir);
    let _remove = common::RemoveOnDrop(dir.clone());
    for d in ["bin", "net.d"] {
        std::fs::create_dir_all(dir.join(d)).expect("host dirs");
    }
    std::fs::copy(FLANNEL, dir.join("net.d/10-flannel.conflist")).expect("primary conflist");
    let run_dir = dir.join("run");
    let proc = FakeProc::new(dir.join("proc"));
    let front_kubeconfig = dir.join("front.kubeconfig");
    let args: Vec<std::ffi::OsString> = vec![
        "--kubeconfig".into(),
        front_kubeconfig.clone().into(),
        "--node-name".into(),
        prefix.clone().into(),
        "--proc-root".into(),
        proc.root().to_owned().into(),
        "--kubelet-uid".into(),
        KUBELET_UID.to_string().into(),
        "--cni-bin-dir".into(),
        dir.join("bin").into(),
        "--cni-conf-dir".into(),
        dir.join("net.d").into(),
    ];
    let env = [
        ("POD_NAMESPACE".to_owned(), "istio-system".to_owned()),
        (
            "ZTUNNEL_UDS_ADDRESS".to_owned(),
            dir.join("none.sock").to_string_lossy().into_owned(),
        ),
    ];
    let ip: std::net::IpAddr = "10.248.7.2".parse().expect("ip");
    let mut api = None;
    let mut front = None;
    let mut mesh = MeshLab::start_observed(
        MeshSpec {
            lab: LabOptions {
                prefix: prefix.clone(),
                ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
                run_dir: run_dir.clone(),
                subnet: SUBNET.into(),
                cni_version: "1.0.0".into(),
            },
            exe: env!("CARGO_BIN_EXE_ztnode").as_ref(),
            workloads: &[("client", "default", "alice", ip)],
            extra_config: "",
            log_level: "info",
            node_args: &args,
            node_env: &env,
            pods: [("client", "default")],
        },
        |stage| {
            if let MeshStage::LabBuilt(lab) = stage {
                let a = FakeApi::start(lab, &dir);
                let f = Front::start(lab.node(), a.addr());
                let text = std::fs::read_to_string(a.kubeconfig()).expect("kubeconfig");
                let text = text.replace(&a.addr().to_string(), &f.addr.to_string());
                assert!(
                    text.contains(&f.addr.to_string()),
                    "server not replaced:\n{text}"
                );
                std::fs::write(&front_kubeconfig, text).expect("front kubeconfig");
                lab.set_plugin_key("kubeconfig", json!(a.kubeconfig()));
                a.create_pod(
                    "default",
                    "client",
                    &lab.pod_uid("client"),
                    &prefix,
                    "alice",
                    json!({"istio.io/dataplane-mode": "ambient"}),
                );
                api = Some(a);
                front = Some(f);
            }
            Ok::<(), ztnode::lab::LabError>(())
        },
    )
    .expect("start the Kubernetes-mode node");
    let api = api.expect("API server");
    let front = front.expect("front");
    let pod = mesh.pods[0].clone();
    api.set_pod_running(&pod.namespace, &pod.name, pod.ip);
    proc.pod(1000, &pod.uid, &pod.netns_name);
    let artefacts = Artefacts {
        binary: dir.join("bin").join(PLUGIN_BINARY_NAME),
        conf: dir.join("net.d/10-flannel.conflist"),
        kubeconfig: run_dir.join(PLUGIN_KUBECONFIG_NAME),
    };
    let node = mesh.lab.node().clone();
    let captured = |pod: &ztnode::lab::Pod| MeshNode::ruleset(pod).contains("istio-ambient-nat");

    let cases = [
        (
            Ds::Present,
            [true; 4],
            "DaemonSet there: upgrade or reboot",
            "lookup=Present",
        ),
        (
            Ds::Selecting("linux"),
            [true; 4],
            "DaemonSet there, selecting this node",
            "lookup=Present",
        ),
        (
            Ds::Passthrough,
            [false; 4],
            "DaemonSet gone (404)",
            "lookup=Gone",
        ),
        (
            Ds::Selecting("windows"),
            [false; 4],
            "DaemonSet no longer selecting this node",
            "lookup=NotThisNode",
        ),
        (
            Ds::Deleting,
            [false; 4],
            "DaemonSet being deleted",
            "lookup=Deleting",
        ),
        (
            Ds::Unauthorized,
            [false; 4],
            "token refused (401)",
            "lookup=Unauthorized",
        ),
        (
            Ds::Forbidden,
            [true; 4],
            "lookup forbidden (403)",
            "lookup=Failed",
        ),
    ];
    for (i, (ds, want, what, logged)) in cases.into_iter().enumerate() {
        if i > 0 {
            let (n, log) = mesh
                .lab
                .start_node_with(
                    env!("CARGO_BIN_EXE_ztnode").as_ref(),
                    &run_dir,
                    &[
                        &["--config".into(), mesh.config.clone().into()][..],
                        &args[..],
                    ]
                    .concat(),
                    &env,
                    "info",
                )
                .expect("start ztnode node again");
            mesh.node = n;
            mesh.log = log;
        }
        wait_for(
            &format!("{what}: not installed"),
            &mesh.log,
            Duration::from_secs(30),
            || artefacts.present(&node) == [true; 4],
        );
        wait_for(
            &format!("{what}: pod not captured"),
            &mesh.log,
            Duration::from_secs(30),
            || captured(&pod),
        );
        front.set(ds);
        terminate(&mut mesh.node.0, &mesh.log);
        let log = std::fs::read_to_string(&mesh.log).unwrap_or_default();
        assert_eq!(
            artefacts.present(&node),
            want,
            "{what}: [binary, entry, kubeconfig, host table]; node log:\n{log}"
        );
        assert!(
            log.contains(logged),
            "{what}: the agent did not decide on {logged}; node log:\n{log}"
        );
        assert!(
            !log.contains("cannot read this node"),
            "{what}: the node was not read; node log:\n{log}"
        );
        assert!(captured(&pod), "{what}: the pod lost its in-pod rules");
        front.set(Ds::Passthrough);
    }
}
