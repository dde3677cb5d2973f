//! End to end, Kubernetes mode: `ztnode node --kubeconfig …` in a lab node against the fake API
//! server (also in the node netns), pods attached through the real CNI chain. Enrollment follows
//! the pods' and namespaces' labels, the status annotation follows enrollment, lost state is
//! rebuilt before readiness, the watches survive a 410 and two minutes without the API server
//! (partitioned, down, answering 503), and kubelet probes reach enrolled pods past the proxy.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::capture::BridgeCapture;
use common::kube::{FakeApi, FakeProc};
use common::node::{MeshNode, echo_once};
use serde_json::json;
use ztnode::lab::{LabOptions, MeshLab, MeshSpec, MeshStage};
use ztnode::netns::Netns;

const SUBNET: &str = "10.249.0.0/24";
const KUBELET_UID: u32 = 4242;
const AMBIENT: &str = "ambient";

/// A lab node in Kubernetes mode with pods `client` and `server` (namespace `default`, labelled
/// ambient, service accounts alice and bob), `outsider` (`default`, no label) and `web`
/// (namespace `shop`, not labelled), each running with its IP and a process in the fake procfs.
/// Only client and server are in the local config (the workload source): the others, once
/// enrolled, are served with the identity the agent hands over.
struct KubeNode {
    mesh: MeshLab<4>,
    api: FakeApi,
    /// The fake procfs the agent's netns finder reads.
    proc: FakeProc,
    run_dir: PathBuf,
    args: Vec<std::ffi::OsString>,
    dir: PathBuf,
}

impl KubeNode {
    fn start(prefix: &str, extra_config: &str) -> KubeNode {
        let dir = std::env::temp_dir().join(format!("ztnode-e2e-kube-{prefix}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test dir");
        let run_dir = dir.join("run");
        let proc = FakeProc::new(dir.join("proc"));
        let args: Vec<std::ffi::OsString> = vec![
            "--no-install".into(),
            "--kubeconfig".into(),
            dir.join("kubeconfig").into(),
            "--node-name".into(),
            prefix.into(),
            "--proc-root".into(),
            proc.root().to_owned().into(),
            "--kubelet-uid".into(),
            KUBELET_UID.to_string().into(),
        ];
        let ip = |n: u8| -> IpAddr { format!("10.249.0.{n}").parse().expect("ip") };
        let mut api = None;
        let mesh = MeshLab::start_observed(
            MeshSpec {
                lab: LabOptions {
                    prefix: prefix.into(),
                    ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
                    run_dir: run_dir.clone(),
                    subnet: SUBNET.into(),
                    cni_version: "1.0.0".into(),
                },
                exe: env!("CARGO_BIN_EXE_ztnode").as_ref(),
                workloads: &[
                    ("client", "default", "alice", ip(2)),
                    ("server", "default", "bob", ip(3)),
                ],
                extra_config,
                log_level: "info",
                node_args: &args,
                node_env: &[],
                pods: [
                    ("client", "default"),
                    ("server", "default"),
                    ("outsider", "default"),
                    ("web", "shop"),
                ],
            },
            |stage| {
                if let MeshStage::LabBuilt(lab) = stage {
                    let a = FakeApi::start(lab, &dir);
                    // the plugin's entry as the installer writes it in Kubernetes mode
                    lab.set_plugin_key("kubeconfig", json!(a.kubeconfig()));
                    a.create_namespace("shop", json!({}));
                    for (ns, name, sa, labels) in [
                        (
                            "default",
                            "client",
                            "alice",
                            json!({"istio.io/dataplane-mode": AMBIENT}),
                        ),
                        (
                            "default",
                            "server",
                            "bob",
                            json!({"istio.io/dataplane-mode": AMBIENT}),
                        ),
                        ("default", "outsider", "default", json!({})),
                        ("shop", "web", "web", json!({})),
                    ] {
                        a.create_pod(ns, name, &lab.pod_uid(name), prefix, sa, labels);
                    }
                    api = Some(a);
                }
                Ok::<(), ztnode::lab::LabError>(())
            },
        )
        .expect("start the Kubernetes-mode node with its pods");
        let api = api.expect("API server started");
        for (i, pod) in mesh.pods.iter().enumerate() {
            assert_eq!(pod.ip, ip(2 + i as u8), "host-local allocation order");
            api.set_pod_running(&pod.namespace, &pod.name, pod.ip);
            proc.pod(1000 + i as u32, &pod.uid, &pod.netns_name);
        }
        KubeNode {
            mesh,
            api,
            proc,
            run_dir,
            args,
            dir,
        }
    }

    fn pod(&self, name: &str) -> &ztnode::lab::Pod {
        self.mesh
            .pods
            .iter()
            .find(|p| p.name == name)
            .expect("lab pod")
    }

    fn captured(&self, name: &str) -> bool {
        MeshNode::ruleset(self.pod(name)).contains("istio-ambient-nat")
    }

    fn wait_captured(&self, name: &str, want: bool, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.captured(name) != want {
            assert!(
                Instant::now() < deadline,
                "{name}: captured should be {want}; node log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.mesh.log).unwrap_or_default()
    }

    fn netns(&self, name: &str) -> Netns {
        Netns::open(&self.pod(name).netns_path).expect("pod netns")
    }

    /// An echo from pod `from` to `to:port`; returns the source address the app saw.
    fn echo(&self, from: &str, to: &str, port: u16) -> IpAddr {
        let app = SocketAddr::new(self.pod(to).ip, port);
        let echo = echo_once(&self.netns(to), app);
        let mut c = ztnode::lab::Lab::connect_from(&self.netns(from), app).expect("connect");
        c.write_all(b"ping").expect("write");
        c.shutdown(std::net::Shutdown::Write).expect("half close");
        let mut back = Vec::new();
        c.read_to_end(&mut back).expect("read echo");
        assert_eq!(back, b"ping", "{from} -> {to}");
        echo.join().expect("echo thread").1.ip()
    }

    /// Stops the node and starts it again with the same arguments.
    fn restart_node(&mut self) {
        let _ = self.mesh.node.0.kill();
        let _ = self.mesh.node.0.wait();
        let (node, log) = self
            .mesh
            .lab
            .start_node(
                env!("CARGO_BIN_EXE_ztnode").as_ref(),
                &self.mesh.config,
                &self.run_dir,
                "info",
                &self.args,
            )
            .expect("restart ztnode node");
        self.mesh.node = node;
        self.mesh.log = log;
    }

    /// `GET /healthz/ready` on the node: the status code.
    fn readiness(&self) -> u16 {
        let addr = SocketAddr::from(([127, 0, 0, 1], 15021));
        let Ok(mut s) = ztnode::lab::Lab::connect_from(self.mesh.lab.node(), addr) else {
            return 0;
        };
        let _ = s.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for KubeNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn enrollment_and_the_status_annotation_follow_the_labels() {
    if !common::privileged("enrollment_and_the_status_annotation_follow_the_labels") {
        return;
    }
    let node = KubeNode::start(&common::prefix("k8a"), "");
    let t = Duration::from_secs(5);
    // labelled pods are enrolled at ADD and annotated; the others are left alone
    for name in ["client", "server"] {
        assert!(node.captured(name), "{name} not captured:\n{}", node.log());
        node.api
            .wait_redirection("default", name, Some("enabled"), t);
    }
    assert!(!node.captured("outsider") && !node.captured("web"));
    assert_eq!(node.api.redirection("default", "outsider"), None);
    // traffic between the labelled pods goes over HBONE with their identities
    assert_eq!(node.echo("client", "server", 8080), node.pod("client").ip);
    let inbound = MeshNode::wait_log_in(
        &node.mesh.log,
        &["connection complete", "direction=\"inbound\""],
        t,
    );
    assert!(
        inbound.contains("spiffe://cluster.local/ns/default/sa/alice"),
        "{inbound}"
    );

    // a namespace labelled while its pods run: they are found in procfs and enrolled; a pod
    // whose IP the API does not show yet waits for it
    node.api.clear_pod_ips("shop", "web");
    // the pod and namespace watches are separate streams: let the pod's update arrive first, or
    // the label may be seen with the old IP still there (then web is enrolled at once)
    std::thread::sleep(Duration::from_millis(500));
    node.api
        .label_namespace("shop", json!({"istio.io/dataplane-mode": AMBIENT}));
    MeshNode::wait_log_in(&node.mesh.log, &["shop/web", "no IP in its status yet"], t);
    assert!(!node.captured("web"));
    node.api.set_pod_running("shop", "web", node.pod("web").ip);
    node.wait_captured("web", true, t);
    node.api.wait_redirection("shop", "web", Some("enabled"), t);
    MeshNode::wait_log_in(
        &node.mesh.log,
        &[
            "pod proxy listening",
            "spiffe://cluster.local/ns/shop/sa/web",
        ],
        t,
    );

    // an annotation that changes the pod's rules (ingress mode: no inbound capture) is applied
    node.api.annotate_pod(
        "shop",
        "web",
        json!({"ambient.istio.io/bypass-inbound-capture": "true"}),
    );
    let deadline = Instant::now() + t;
    while MeshNode::ruleset(node.pod("web")).contains("redirect to :15006") {
        assert!(
            Instant::now() < deadline,
            "ingress mode not applied:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(node.captured("web"), "outbound capture stays");

    // a pod labelled `none` leaves the mesh: rules gone, annotation gone, plain traffic
    node.api.label_pod(
        "default",
        "server",
        json!({"istio.io/dataplane-mode": "none"}),
    );
    node.wait_captured("server", false, t);
    node.api.wait_redirection("default", "server", None, t);
    assert_eq!(
        node.echo("outsider", "server", 8081),
        node.pod("outsider").ip
    );
    assert!(
        !node
            .log()
            .contains(&format!("src.addr={}:", node.pod("outsider").ip)),
        "the outsider's connection must not pass the proxy:\n{}",
        node.log()
    );
}

#[test]
fn lost_state_is_rebuilt_before_the_node_is_ready() {
    if !common::privileged("lost_state_is_rebuilt_before_the_node_is_ready") {
        return;
    }
    let mut node = KubeNode::start(&common::prefix("k8r"), "");
    node.api
        .wait_redirection("default", "client", Some("enabled"), Duration::from_secs(5));
    // the agent goes away, its state file is lost and the pod's rules are flushed
    let _ = node.mesh.node.0.kill();
    let _ = node.mesh.node.0.wait();
    std::fs::remove_file(node.run_dir.join("pods.json")).expect("remove pods.json");
    let flushed = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &node.pod("client").netns_name,
            "nft",
            "flush",
            "ruleset",
        ])
        .status()
        .expect("nft");
    assert!(flushed.success());
    assert!(!node.captured("client"));
    // the client's process is not visible yet: its netns cannot be found, and the node must not
    // report ready while the pod is not captured
    let client_proc = node.proc.root().join("1000");
    let hidden = node.proc.root().join("hidden-1000");
    std::fs::rename(&client_proc, &hidden).expect("hide the client's process");
    node.restart_node();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        assert_ne!(
            node.readiness(),
            200,
            "ready while the client is not captured"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!node.captured("client"));
    std::fs::rename(&hidden, &client_proc).expect("show the client's process");
    // readiness turns 200 only once every meshed pod is captured again
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if node.readiness() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready:\n{}", node.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        node.captured("client"),
        "ready before the pod was captured:\n{}",
        node.log()
    );
    assert!(node.captured("server"));
    assert!(!node.captured("outsider"));
    assert_eq!(node.echo("client", "server", 8082), node.pod("client").ip);
}

#[test]
fn kubelet_probes_reach_enrolled_pods_past_an_identity_policy() {
    if !common::privileged("kubelet_probes_reach_enrolled_pods_past_an_identity_policy") {
        return;
    }
    // only mesh identities of namespace default may connect to the server
    let policy = "policies:\n- name: mesh-only\n  namespace: default\n  scope: Namespace\n  action: Allow\n  rules:\n  - - - namespaces: [{Exact: default}]\n";
    let node = KubeNode::start(&common::prefix("k8p"), policy);
    let server = SocketAddr::new(node.pod("server").ip, 8083);
    // a plain connection from outside the mesh is rejected by the policy
    let listener = ztnode::lab::Lab::listen_in(&node.netns("server"), server).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    // (refused with a reset: at connect or at the first read, depending on timing)
    if let Some(mut plain) =
        common::connect_unless_reset(&node.netns("outsider"), server, "connect")
    {
        let _ = plain.write_all(b"x");
        plain
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let mut buf = [0u8; 8];
        assert!(
            matches!(plain.read(&mut buf), Ok(0) | Err(_)),
            "plain connection not closed"
        );
    }
    assert!(
        listener.accept().is_err(),
        "the policy let a plain connection through"
    );
    // the kubelet's probe (its UID, from the node) is SNATed and reaches the app directly
    let probe = node
        .mesh
        .lab
        .node()
        .run(move || -> std::io::Result<std::net::TcpStream> {
            let before = nix::unistd::setfsuid(nix::unistd::Uid::from_raw(KUBELET_UID));
            let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None);
            nix::unistd::setfsuid(before);
            let sock = sock?;
            sock.connect_timeout(&server.into(), Duration::from_secs(5))?;
            Ok(sock.into())
        })
        .expect("node netns")
        .expect("probe connect");
    let deadline = Instant::now() + Duration::from_secs(5);
    let peer = loop {
        match listener.accept() {
            Ok((_, peer)) => break peer,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("the probe did not arrive: {e}\n{}", node.log()),
        }
    };
    assert_eq!(peer.ip().to_string(), "169.254.7.127");
    drop(probe);
    // host rules flushed by someone else are put back
    let host_rules = || {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                node.mesh.lab.node_name(),
                "nft",
                "list",
                "ruleset",
            ])
            .output()
            .expect("nft");
        String::from_utf8_lossy(&out.stdout).contains("snat ip to 169.254.7.127")
    };
    assert!(host_rules(), "no host probe rule");
    let flushed = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            node.mesh.lab.node_name(),
            "nft",
            "flush",
            "table",
            "inet",
            "istio-ambient-nat",
        ])
        .status()
        .expect("nft");
    assert!(flushed.success() && !host_rules());
    let deadline = Instant::now() + Duration::from_secs(15);
    while !host_rules() {
        assert!(
            Instant::now() < deadline,
            "host rules not repaired:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn watches_survive_a_410_and_two_minutes_without_the_api_server() {
    if !common::privileged("watches_survive_a_410_and_two_minutes_without_the_api_server") {
        return;
    }
    let mut node = KubeNode::start(&common::prefix("k8w"), "");
    let t = Duration::from_secs(5);
    node.api
        .wait_redirection("default", "client", Some("enabled"), t);
    // 410 Gone mid-watch: the watchers relist; nothing is enrolled twice or dropped
    node.api.expire_watches();
    node.api
        .label_namespace("shop", json!({"istio.io/dataplane-mode": AMBIENT}));
    node.wait_captured("web", true, t);
    node.api.wait_redirection("shop", "web", Some("enabled"), t);
    let log = node.log();
    assert!(!log.contains("pod removed from the mesh"), "{log}");
    assert_eq!(
        log.matches("pod enrolled, proxy serving it").count(),
        3,
        "client, server and web once each:\n{log}"
    );

    // an ambient pod the kubelet has not started yet: its ADD comes during the outage
    let lab = &node.mesh.lab;
    node.api.create_pod(
        "default",
        "late",
        &lab.pod_uid("late"),
        lab.node_name().trim_end_matches("-node"),
        "default",
        json!({"istio.io/dataplane-mode": AMBIENT}),
    );

    // Over two minutes the API server is unreachable three ways: partitioned (packets dropped,
    // the server still up), down (connections refused), behind a load balancer with no backend
    // (503). Meanwhile enrolled pods keep their rules and talk over HBONE, the node stays ready,
    // and an ambient pod's ADD fails closed naming the API server.
    let server = SocketAddr::new(node.pod("server").ip, 8090);
    common::node::serve_echo(&node.netns("server"), server);
    let capture = BridgeCapture::start(&node.mesh.lab, "outage");
    let mut secrets: Vec<Vec<u8>> = Vec::new();
    let api = node.api.addr();
    let phase = |node: &KubeNode, name: &str, length: Duration, secrets: &mut Vec<Vec<u8>>| {
        let start = Instant::now();
        let mut add_failed = false;
        while start.elapsed() < length {
            for pod in ["client", "server", "web"] {
                assert!(node.captured(pod), "{name}: {pod} lost its rules");
            }
            assert!(!node.captured("outsider"), "{name}: outsider enrolled");
            let msg = format!("{name} payload {}", secrets.len()).into_bytes();
            // a few tries: a busy machine can stall one exchange past the 500 ms of silence
            let echoed = (0..3).find_map(|_| {
                common::node::try_round_trip(&node.netns("client"), server, &msg)
                    .filter(|b| *b == msg)
            });
            assert_eq!(
                echoed.as_deref(),
                Some(msg.as_slice()),
                "{name}: client -> server after {:?}:\n{}",
                start.elapsed(),
                node.log()
            );
            secrets.push(msg);
            assert_eq!(node.readiness(), 200, "{name}: the node is not ready");
            if !add_failed && start.elapsed() > Duration::from_secs(6) {
                let err = node
                    .mesh
                    .lab
                    .add_pod("late", "default")
                    .expect_err("an ambient pod's ADD must fail while the API server is away")
                    .to_string();
                assert!(
                    err.contains("API server") && err.contains(&api.to_string()),
                    "{name}: the error must name the API server: {err}"
                );
                assert!(err.contains("\"code\":11"), "{name}: CNI code 11: {err}");
                eprintln!("{name}: ADD failed with {err}");
                add_failed = true;
            }
            std::thread::sleep(Duration::from_secs(5));
        }
        assert!(add_failed, "{name}: no ADD tried");
    };
    let partition = common::outage::Partition::start(&[node.mesh.lab.node_name()], api.port());
    phase(&node, "partitioned", Duration::from_secs(60), &mut secrets);
    // the partition heals with the same server: a change made now is seen within seconds (the
    // server's retransmissions have backed off by now; the agent must not wait for them)
    partition.heal();
    let healed = Instant::now();
    node.api.annotate_pod(
        "shop",
        "web",
        json!({"ambient.istio.io/bypass-inbound-capture": "true"}),
    );
    while MeshNode::ruleset(node.pod("web")).contains("redirect to :15006") {
        assert!(
            healed.elapsed() < Duration::from_secs(15),
            "a change after the partition was not applied:\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "a change after the partition took effect in {:?}",
        healed.elapsed()
    );
    // what the API server holds, to bring it back with (as a real one backed by etcd does)
    let mut objects = vec![node.api.namespace("shop")];
    for ns in ["default", "shop"] {
        objects.extend(node.api.pods(ns));
    }
    for o in &mut objects {
        o["kind"] = json!(if o["spec"]["containers"].is_array() {
            "Pod"
        } else {
            "Namespace"
        });
        o["apiVersion"] = json!("v1");
        o["metadata"]
            .as_object_mut()
            .map(|m| m.remove("resourceVersion"));
    }
    let old_version = node.api.resource_version();
    let load = node.dir.join("objects.json");
    std::fs::write(
        &load,
        json!({"kind": "List", "apiVersion": "v1", "items": objects}).to_string(),
    )
    .expect("write objects");
    node.api.stop();
    phase(&node, "down", Duration::from_secs(30), &mut secrets);
    let unavailable = common::outage::Unavailable::start(node.mesh.lab.node(), api);
    phase(&node, "unavailable", Duration::from_secs(35), &mut secrets);
    drop(unavailable);

    // the API server is back with the same objects (and a resourceVersion past the old one): a
    // label change is seen within seconds, nothing was removed, the node stayed ready
    node.api.restart(&node.mesh.lab, &load);
    node.api.create_namespace("bump", json!({}));
    let mut n = 0;
    while node.api.resource_version() <= old_version {
        node.api
            .label_namespace("bump", json!({"n": n.to_string()}));
        n += 1;
    }
    let back = Instant::now();
    node.api.label_pod(
        "default",
        "outsider",
        json!({"istio.io/dataplane-mode": AMBIENT}),
    );
    node.wait_captured("outsider", true, Duration::from_secs(15));
    eprintln!(
        "a label change after the outage took effect in {:?}",
        back.elapsed()
    );
    node.api.wait_redirection(
        "default",
        "outsider",
        Some("enabled"),
        Duration::from_secs(10),
    );
    // the pod whose ADD failed starts now
    let late = node
        .mesh
        .lab
        .add_pod("late", "default")
        .expect("ADD once the API server is back");
    assert!(MeshNode::ruleset(&late).contains("istio-ambient-nat"));
    let msg = b"late pod after the outage".to_vec();
    let late_ns = Netns::open(&late.netns_path).expect("late netns");
    assert_eq!(
        common::node::try_round_trip(&late_ns, server, &msg).as_deref(),
        Some(msg.as_slice())
    );
    secrets.push(msg);
    assert!(node.captured("client") && node.captured("server") && node.captured("web"));
    assert_eq!(node.readiness(), 200);
    let log = node.log();
    assert!(!log.contains("pod removed from the mesh"), "{log}");
    let mesh: Vec<IpAddr> = ["client", "server", "web", "outsider"]
        .iter()
        .map(|p| node.pod(p).ip)
        .chain([late.ip])
        .collect();
    let secrets: Vec<&[u8]> = secrets.iter().map(Vec::as_slice).collect();
    capture.check(&mesh, &secrets);
}

#[test]
fn the_plugin_asks_the_api_server_and_fails_closed_only_for_ambient_pods() {
    if !common::privileged("the_plugin_asks_the_api_server_and_fails_closed_only_for_ambient_pods")
    {
        return;
    }
    let mut node = KubeNode::start(&common::prefix("k8c"), "");
    // the node goes away (the plugin's entry has the kubeconfig, as the installer writes it)
    let _ = node.mesh.node.0.kill();
    let _ = node.mesh.node.0.wait();
    let lab = &node.mesh.lab;
    node.api.create_pod(
        "default",
        "plain",
        &lab.pod_uid("plain"),
        "n",
        "default",
        json!({}),
    );
    node.api.create_pod(
        "default",
        "meshed",
        &lab.pod_uid("meshed"),
        "n",
        "default",
        json!({"istio.io/dataplane-mode": AMBIENT}),
    );
    let plain = lab
        .add_pod("plain", "default")
        .expect("a pod outside the mesh starts without the agent");
    assert!(!MeshNode::ruleset(&plain).contains("istio-ambient"));
    let err = lab
        .add_pod("meshed", "default")
        .expect_err("an ambient pod must not start without the agent");
    assert!(err.to_string().contains("meshed"), "{err}");
}
