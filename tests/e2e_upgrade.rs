//! End to end: an upgrade without a gap (`../shared/spec/ztunnel.md` §1 "ztunnel restart", §3
//! "Drain / shutdown"). A new process binds every enrolled pod's ports beside the old one
//! (SO_REUSEPORT, `INPOD_PORT_REUSE`) and takes every new connection; then the old one gets
//! SIGTERM and drains. In both shapes — `ztnode node` replaced by a new `ztnode node` on the same
//! run dir, and `ztnode proxy` replaced while `ztnode agent` stays — a client opening a
//! connection every 10 ms sees no failure, a connection open on the old process finishes intact,
//! and nothing crosses the bridge between the mesh pods but HBONE.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::lifecycle::{ConnectLoop, Stream, echo_server, readiness, sigterm, wait_exit};
use common::node::{MeshNode, NodeProcess};
use ztnode::lab::{self, Lab, LabOptions, ProcessGuard};
use ztnode::netns::Netns;

/// How often the client opens a connection.
const EVERY: Duration = Duration::from_millis(10);
/// What each looped connection sends (looked for on the bridge).
const SECRET: &str = "upgrade-secret";

/// Waits until readiness on the lab node answers 200.
fn wait_ready(lab: &Lab) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((status, _)) = readiness(lab)
            && status.contains(" 200 ")
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not ready: {:?}",
            readiness(lab)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Outbound connections to `app` (the HBONE target) the process logging to `log` has completed.
fn completed(log: &Path, app: SocketAddr) -> usize {
    let dst = format!("dst.hbone_addr={app}");
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.contains("connection complete")
                && l.contains("direction=\"outbound\"")
                && l.contains(&dst)
        })
        .count()
}

/// Once the new process listens, the old one (logging to `old_log`) gets no new connection:
/// those it had in flight end, and then its count stays while the loop goes on.
fn old_process_gets_nothing_new(looping: &ConnectLoop, old_log: &Path, app: SocketAddr) {
    std::thread::sleep(Duration::from_millis(300));
    let before = completed(old_log, app);
    assert!(
        before > 0,
        "the old process carried the loop's first connections"
    );
    looping.wait_for_more(30, Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        completed(old_log, app),
        before,
        "new connections went to the old process while the new one listened"
    );
}

/// Runs `old_stream` on during the drain of the old process, then closes it: it must stay intact.
fn finish_during_drain(mut old_stream: Stream) {
    for _ in 0..10 {
        old_stream
            .exchange(SECRET)
            .expect("a connection on the old process flows during its drain");
        std::thread::sleep(Duration::from_millis(50));
    }
    old_stream
        .finish()
        .expect("a connection on the old process ends cleanly");
}

/// The new process bound its readiness port (taking the kubelet's probes from the old one)
/// before it restored the pods, and answered not-ready from then on until it serves them: its
/// endpoints came up with `node agent start` pending, which is done only after the restore.
fn readiness_taken_over_before_the_restore(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = |needle: &str| {
        text.lines()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in the new process's log:\n{text}"))
    };
    let listening = line("admin, readiness and metrics endpoints listening");
    let restored = line("pod table restored");
    assert!(
        listening < restored,
        "readiness bound after the restore (lines {listening}, {restored}):\n{text}"
    );
    let at_bind = text.lines().nth(listening).unwrap_or_default();
    assert!(
        at_bind.contains(ztnode::node::AGENT_START_TASK),
        "not-ready while restoring: {at_bind}"
    );
}

/// A second `ztnode node` with the first one's config and run dir, logging to `log`.
fn start_second_node(node: &MeshNode, log: &Path) -> NodeProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ztnode"));
    cmd.arg("node")
        .arg("--config")
        .arg(node.lab.dir().join("local-config.yaml"))
        .arg("--run-dir")
        .arg(&node.run_dir)
        .arg("--no-install")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"));
    NodeProcess(node.lab.spawn_in_node(cmd).expect("spawn ztnode node"))
}

#[test]
fn a_node_process_is_replaced_without_a_failed_connection() {
    if !common::privileged("a_node_process_is_replaced_without_a_failed_connection") {
        return;
    }
    let mut node = MeshNode::start(&common::prefix("e2u"));
    node.wait_log(&["workload proxy manager ready"], Duration::from_secs(10));
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    echo_server(&server_ns, app);
    let capture = common::capture::BridgeCapture::start(&node.lab, "upgrade-node");
    let mut old_stream = Stream::open(&client_ns, app);
    old_stream
        .exchange(SECRET)
        .expect("through the old process");
    let looping = ConnectLoop::start(&client_ns, app, EVERY, SECRET);
    looping.wait_for_more(10, Duration::from_secs(10));

    // the new process starts beside the old one and takes both pods over
    let log2 = node.lab.dir().join("node2.log");
    let _new = start_second_node(&node, &log2);
    let restored = MeshNode::wait_log_in(&log2, &["pod table restored"], Duration::from_secs(20));
    assert!(restored.contains("restored=2"), "{restored}");
    readiness_taken_over_before_the_restore(&log2);
    MeshNode::wait_log_in(
        &log2,
        &["workload proxy manager ready"],
        Duration::from_secs(10),
    );
    wait_ready(&node.lab);
    old_process_gets_nothing_new(&looping, &node.log, app);

    // the old one drains
    sigterm(&node.process);
    node.wait_log(&["draining: listeners closed"], Duration::from_secs(5));
    finish_during_drain(old_stream);
    let (status, _) = wait_exit(&mut node.process, Duration::from_secs(15));
    assert!(status.success(), "the old process exits 0: {status}");
    let plugin_socket = ztnode::podevent::plugin_socket_path(&node.run_dir);
    assert!(
        plugin_socket.exists(),
        "the old process left the new one's plugin socket in place"
    );
    looping.wait_for_more(25, Duration::from_secs(10));
    wait_ready(&node.lab);

    let report = looping.stop();
    assert!(
        report.failed.is_empty(),
        "{} of {} connections failed during the hand-over: {:?}",
        report.failed.len(),
        report.ok + report.failed.len(),
        report.failed
    );
    capture.check(&[node.client.ip, node.server.ip], &[SECRET.as_bytes()]);
}

/// `ztnode agent` in the lab node serving ZDS on `zds`; returns once its plugin socket is up.
fn start_agent(lab: &Lab, config: &Path, run_dir: &Path, zds: &Path) -> (ProcessGuard, PathBuf) {
    let log = lab.dir().join("agent.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ztnode"));
    cmd.arg("agent")
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run_dir)
        .arg("--no-install")
        .env("ZTUNNEL_UDS_ADDRESS", zds)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("agent log"));
    let agent = ProcessGuard(lab.spawn_in_node(cmd).expect("spawn ztnode agent"));
    MeshNode::wait_log_in(
        &log,
        &["plugin event socket ready"],
        Duration::from_secs(15),
    );
    (agent, log)
}

/// `ztnode proxy` in the lab node on the agent's `zds`, logging to `log`; returns once it has
/// the agent's snapshot.
fn start_proxy(lab: &Lab, config: &Path, run_dir: &Path, zds: &Path, log: &Path) -> ProcessGuard {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ztnode"));
    cmd.arg("proxy")
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run_dir)
        .env("INPOD_UDS", zds)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("proxy log"));
    let proxy = ProcessGuard(lab.spawn_in_node(cmd).expect("spawn ztnode proxy"));
    MeshNode::wait_log_in(log, &["snapshot received"], Duration::from_secs(20));
    proxy
}

#[test]
fn a_proxy_process_is_replaced_under_its_agent_without_a_failed_connection() {
    if !common::privileged(
        "a_proxy_process_is_replaced_under_its_agent_without_a_failed_connection",
    ) {
        return;
    }
    let prefix = common::prefix("e2v");
    let run_dir = std::env::temp_dir().join(format!("ztnode-e2e-run-{prefix}"));
    let _ = std::fs::remove_dir_all(&run_dir);
    let _run_dir = common::RemoveOnDrop(run_dir.clone());
    let lab = Lab::new(LabOptions {
        prefix: prefix.clone(),
        ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
        run_dir: run_dir.clone(),
        subnet: "10.246.0.0/24".into(),
        cni_version: "1.0.0".into(),
    })
    .expect("lab");
    let server_ip: IpAddr = "10.246.0.2".parse().expect("ip");
    let client_ip: IpAddr = "10.246.0.3".parse().expect("ip");
    let config = lab.dir().join("local-config.yaml");
    std::fs::write(
        &config,
        lab::local_config(
            &prefix,
            &[
                ("client", "default", "alice", client_ip),
                ("server", "default", "bob", server_ip),
            ],
        ),
    )
    .expect("write config");
    let zds = run_dir.join("ztunnel.sock");
    let (_agent, agent_log) = start_agent(&lab, &config, &run_dir, &zds);
    let log1 = lab.dir().join("proxy1.log");
    let mut old = start_proxy(&lab, &config, &run_dir, &zds, &log1);
    let server = lab.add_pod("server", "default").expect("add server");
    let client = lab.add_pod("client", "default").expect("add client");
    assert_eq!(
        (server.ip, client.ip),
        (server_ip, client_ip),
        "host-local order"
    );
    let client_ns = Netns::open(&client.netns_path).expect("client netns");
    let server_ns = Netns::open(&server.netns_path).expect("server netns");
    let app = SocketAddr::new(server_ip, 8080);
    echo_server(&server_ns, app);
    wait_ready(&lab);
    let capture = common::capture::BridgeCapture::start(&lab, "upgrade-proxy");
    let mut old_stream = Stream::open(&client_ns, app);
    old_stream.exchange(SECRET).expect("through the old proxy");
    let looping = ConnectLoop::start(&client_ns, app, EVERY, SECRET);
    looping.wait_for_more(10, Duration::from_secs(10));

    // the new proxy connects while the old one is connected, and gets every pod
    let log2 = lab.dir().join("proxy2.log");
    let _new = start_proxy(&lab, &config, &run_dir, &zds, &log2);
    let listening = std::fs::read_to_string(&log2)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("pod proxy listening"))
        .count();
    assert_eq!(listening, 2, "both pods from the agent's snapshot");
    MeshNode::wait_log_in(
        &agent_log,
        &["snapshot sent", "pods=2"],
        Duration::from_secs(5),
    );
    old_process_gets_nothing_new(&looping, &log1, app);

    // the old one drains
    sigterm(&old);
    MeshNode::wait_log_in(
        &log1,
        &["draining: listeners closed"],
        Duration::from_secs(5),
    );
    finish_during_drain(old_stream);
    let (status, _) = wait_exit(&mut old, Duration::from_secs(15));
    assert!(status.success(), "the old proxy exits 0: {status}");
    looping.wait_for_more(25, Duration::from_secs(10));
    wait_ready(&lab);

    let report = looping.stop();
    assert!(
        report.failed.is_empty(),
        "{} of {} connections failed during the hand-over: {:?}",
        report.failed.len(),
        report.ok + report.failed.len(),
        report.failed
    );
    capture.check(&[client_ip, server_ip], &[SECRET.as_bytes()]);
    drop(client);
    drop(server);
}
