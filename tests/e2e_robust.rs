//! End to end robustness of `ztnode node` in a lab node: enrolled pods survive a crash of the node
//! process (the pod table in the run dir is restored, without the pods being added again), and the
//! proxy's accepted sockets carry TCP keepalive.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::node::{MeshNode, NodeProcess};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use ztnode::lab::{Lab, Pod};
use ztnode::netns::Netns;

/// An echo server for one connection inside `ns`: reads to EOF, writes everything back. Gives up
/// (returning `None`) once `stop` is set without a connection having come.
fn echo_once(
    ns: &Netns,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Option<Vec<u8>>> {
    let listener = Lab::listen_in(ns, addr).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let mut s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if stop.load(Ordering::SeqCst) {
                        return None;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        s.set_nonblocking(false).expect("blocking");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("read");
        s.write_all(&buf).expect("echo");
        Some(buf)
    })
}

/// One echo round trip client -> server:`port` through the mesh.
fn round_trip(node: &MeshNode, port: u16, payload: &[u8]) -> Result<Vec<u8>, String> {
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let addr = SocketAddr::new(node.server.ip, port);
    let stop = Arc::new(AtomicBool::new(false));
    let echo = echo_once(&server_ns, addr, stop.clone());
    let run = || -> Result<Vec<u8>, String> {
        let mut c = Lab::connect_from(&client_ns, addr).map_err(|e| e.to_string())?;
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        c.write_all(payload).map_err(|e| e.to_string())?;
        c.shutdown(std::net::Shutdown::Write)
            .map_err(|e| e.to_string())?;
        let mut back = Vec::new();
        c.read_to_end(&mut back).map_err(|e| e.to_string())?;
        Ok(back)
    };
    let res = run();
    stop.store(true, Ordering::SeqCst);
    let got = echo.join().expect("echo thread");
    if res.is_ok() {
        assert_eq!(got.as_deref(), Some(payload), "the app got what was sent");
    }
    res
}

/// `ss` lines of established TCP sockets with local port `port` in `pod`'s netns, with timers.
fn sockets(pod: &Pod, port: u16) -> String {
    let out = Lab::exec_in(&pod.netns_name, "ss")
        .args([
            "-tnoH",
            "state",
            "established",
            "sport",
            "=",
            &format!(":{port}"),
        ])
        .output()
        .expect("ss");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts `ztnode node` again in the lab node with the same config and run dir, logging to `log`.
fn start_again(node: &MeshNode, log: &std::path::Path) -> NodeProcess {
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
fn enrolled_pods_survive_a_crash_of_the_node_process() {
    if !common::privileged("enrolled_pods_survive_a_crash_of_the_node_process") {
        return;
    }
    let mut node = MeshNode::start(&common::prefix("e2r"));
    assert_eq!(
        round_trip(&node, 8080, b"before the crash").expect("traffic before"),
        b"before the crash"
    );

    // the table on disk names both pods, readable by root only
    let table = node.run_dir.join("pods.json");
    let mode = std::fs::metadata(&table)
        .expect("pods.json")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let text = std::fs::read_to_string(&table).expect("read pods.json");
    for pod in [&node.client, &node.server] {
        assert!(text.contains(&pod.uid), "{} missing in {text}", pod.name);
    }

    // SIGKILL: no cleanup at all. Wait until it is dead but leave the reaping to the guard.
    let pid = Pid::from_raw(node.process.0.id() as i32);
    kill(pid, Signal::SIGKILL).expect("SIGKILL");
    waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT).expect("wait for death");

    // the rules stayed: the client's traffic is captured with nobody serving it (fail closed)
    assert!(
        round_trip(&node, 8081, b"while down").is_err(),
        "traffic must not bypass the mesh while the node is down"
    );

    let log = node.lab.dir().join("node-restarted.log");
    node.process = start_again(&node, &log);
    node.log = log;
    let restored = node.wait_log(&["pod table restored"], Duration::from_secs(20));
    assert!(
        restored.contains("restored=2") && restored.contains("dropped=0"),
        "{restored}"
    );

    let deadline = Instant::now() + Duration::from_secs(10);
    let mut port = 8082;
    let back = loop {
        match round_trip(&node, port, b"after the restart") {
            Ok(b) => break b,
            Err(e) => {
                assert!(Instant::now() < deadline, "no traffic after restart: {e}");
                port += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    assert_eq!(back, b"after the restart");
    node.wait_log(
        &[
            "connection complete",
            "direction=\"inbound\"",
            "spiffe://cluster.local/ns/default/sa/alice",
        ],
        Duration::from_secs(5),
    );
    let text = node.log_text();
    assert!(
        !text.contains("pod enrolled, proxy serving it"),
        "pods must come back without a new ADD:\n{text}"
    );
}

#[test]
fn accepted_proxy_sockets_carry_tcp_keepalive() {
    if !common::privileged("accepted_proxy_sockets_carry_tcp_keepalive") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2k"));
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let addr = SocketAddr::new(node.server.ip, 8090);
    let echo = echo_once(&server_ns, addr, Arc::new(AtomicBool::new(false)));
    let mut c = Lab::connect_from(&client_ns, addr).expect("connect");
    c.write_all(b"hold").expect("write");
    // the outbound capture (15001) in the client pod and the HBONE server (15008) in the server pod
    for (pod, port) in [(&node.client, 15001), (&node.server, 15008)] {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let ss = sockets(pod, port);
            if ss.contains("timer:(keepalive") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no keepalive on {}'s :{port} sockets:\n{ss}",
                pod.name
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    assert_eq!(back, b"hold");
    assert_eq!(echo.join().expect("echo").as_deref(), Some(&b"hold"[..]));
}

/// Which of the server's two apps (8080 = the original port, 9090 = where the pod's own DNAT
/// points) answers a plaintext connection from the outsider to server:8080.
fn who_answers(node: &MeshNode) -> Option<u16> {
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    let mut c = Lab::connect_from(&outsider_ns, SocketAddr::new(node.server.ip, 8080)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let _ = c.write_all(b"who");
    let _ = c.shutdown(std::net::Shutdown::Write);
    let mut back = String::new();
    c.read_to_string(&mut back).ok()?;
    back.trim().parse().ok()
}

/// A pod's own nat rules (a DNAT of its port 8080 to 9090 at `dstnat`, installed after the
/// in-pod redirect as an app would) never take a connection away from the redirect, before or
/// after a restart of the node: the inbound connection reaches the proxy (which dials 8080), not
/// the DNAT's 9090 around it. The redirect's nat chains run at -101; at the same priority the
/// kernel would run the chain registered last first, so the outcome would depend on history.
#[test]
fn a_pods_own_dnat_never_wins_over_the_redirect_before_or_after_a_node_restart() {
    if !common::privileged(
        "a_pods_own_dnat_never_wins_over_the_redirect_before_or_after_a_node_restart",
    ) {
        return;
    }
    let mut node = MeshNode::start(&common::prefix("e2d"));
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    for port in [8080u16, 9090] {
        let listener =
            Lab::listen_in(&server_ns, SocketAddr::new(node.server.ip, port)).expect("listen");
        std::thread::spawn(move || {
            for mut s in listener.incoming().flatten() {
                let mut buf = [0u8; 16];
                let _ = s.read(&mut buf);
                let _ = s.write_all(port.to_string().as_bytes());
            }
        });
    }
    let out = Command::new("ip")
        .args(["netns", "exec", &node.server.netns_name, "nft"])
        .arg(format!(
            "add table inet pod-own ; add chain inet pod-own pre {{ type nat hook prerouting priority -100 ; }} ; add rule inet pod-own pre tcp dport 8080 dnat ip to {}:9090",
            node.server.ip
        ))
        .output()
        .expect("nft");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = who_answers(&node);
    assert_eq!(
        before,
        Some(8080),
        "the redirect must win over the pod's DNAT"
    );

    // SIGKILL and start again: the pod's rules are restored
    let pid = Pid::from_raw(node.process.0.id() as i32);
    kill(pid, Signal::SIGKILL).expect("SIGKILL");
    waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT).expect("wait for death");
    let log = node.lab.dir().join("node-restarted.log");
    node.process = start_again(&node, &log);
    node.log = log;
    node.wait_log(
        &["pod table restored", "restored=2"],
        Duration::from_secs(20),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let got = who_answers(&node);
        if got.is_some() || Instant::now() >= deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(after, Some(8080), "after the restart the pod's DNAT won");
}
