//! End to end with the agent and the proxy as two processes joined by the ZDS socket (`ztnode agent`
//! and `ztnode proxy`, as istio-cni and ztunnel), in a lab node with pods attached through the real
//! CNI chain. The server pod is added while no proxy is connected: its ADD fails closed, but the agent
//! keeps it and the proxy, started afterwards, gets it from the snapshot. A killed and restarted
//! proxy gets both pods again, also when it died in the middle of a stream (fail closed meanwhile).

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::node::echo_once;
use ztnode::lab::cnichain::Attachment;
use ztnode::lab::{self, Lab, LabOptions, ProcessGuard};
use ztnode::netns::Netns;

/// A pod netns attached by hand through the lab's chain (the lab's own `add_pod` undoes a failed
/// ADD, as a runtime retrying would). Dropped before the lab: CNI DEL, then the netns is deleted.
struct ManualPod<'a> {
    lab: &'a Lab,
    att: Attachment,
    netns_name: String,
}

impl Drop for ManualPod<'_> {
    fn drop(&mut self) {
        let _ = self.lab.runner().del(&self.att, None);
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns_name])
            .status();
    }
}

fn manual_pod<'a>(lab: &'a Lab, prefix: &str, name: &str) -> ManualPod<'a> {
    let netns_name = format!("{prefix}-{name}");
    let _ = Command::new("ip")
        .args(["netns", "del", &netns_name])
        .stderr(Stdio::null())
        .status();
    let ok = Command::new("ip")
        .args(["netns", "add", &netns_name])
        .status()
        .expect("ip netns add")
        .success();
    assert!(ok, "ip netns add {netns_name}");
    let att = Attachment {
        container_id: netns_name.clone(),
        netns: PathBuf::from(format!("/var/run/netns/{netns_name}")),
        ifname: "eth0".into(),
        args: vec![
            ("IgnoreUnknown".into(), "1".into()),
            ("K8S_POD_NAMESPACE".into(), "default".into()),
            ("K8S_POD_NAME".into(), name.into()),
            ("K8S_POD_INFRA_CONTAINER_ID".into(), netns_name.clone()),
            (
                "K8S_POD_UID".into(),
                format!("{:08x}-0000-4000-8000-00000000beef", std::process::id()),
            ),
        ],
    };
    let pod = ManualPod {
        lab,
        att,
        netns_name,
    };
    let ok = Command::new("ip")
        .args(["-n", &pod.netns_name, "link", "set", "lo", "up"])
        .status()
        .expect("ip link")
        .success();
    assert!(ok, "lo up");
    pod
}

fn log_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Waits until the log at `path` has a line matching all `needles`; returns it.
fn wait_log(path: &Path, needles: &[&str], timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = log_text(path);
        if let Some(l) = text
            .split_inclusive('\n')
            // only whole lines: the process may be halfway through writing the last one
            .filter(|l| l.ends_with('\n'))
            .map(|l| l.trim_end_matches('\n'))
            .find(|l| needles.iter().all(|n| l.contains(n)))
        {
            return l.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "no line with {needles:?} in {}:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ruleset(netns_name: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", netns_name, "nft", "list", "ruleset"])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ipv4_of(netns_name: &str) -> IpAddr {
    let out = Command::new("ip")
        .args(["-n", netns_name, "-4", "-o", "addr", "show", "dev", "eth0"])
        .output()
        .expect("ip addr");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no IPv4 on eth0 in {netns_name}: {text}"))
}

struct Proxy {
    process: ProcessGuard,
    log: PathBuf,
}

impl Proxy {
    /// SIGKILL (no graceful shutdown), then reap.
    fn kill(mut self) {
        self.process.0.kill().expect("kill proxy");
        let _ = self.process.0.wait();
    }
}

/// `GET /healthz/ready` on the proxy's readiness port (15021) from inside the node netns: the status
/// line and the body.
fn readiness(lab: &Lab) -> (String, String) {
    let addr: SocketAddr = "127.0.0.1:15021".parse().expect("addr");
    let mut s = Lab::connect_from(lab.node(), addr).expect("connect to readiness");
    s.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("response");
    let status = resp.lines().next().unwrap_or_default().to_owned();
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

/// Starts `ztnode agent` (local config `config`, serving ZDS on `zds`) in the node netns and
/// waits for its plugin socket; returns the process and its log.
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
    wait_log(
        &log,
        &["plugin event socket ready"],
        Duration::from_secs(15),
    );
    (agent, log)
}

/// Starts `ztnode proxy` in the node netns and waits until it has received the agent's snapshot.
fn start_proxy(lab: &Lab, config: &Path, run_dir: &Path, zds: &Path, log: PathBuf) -> Proxy {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ztnode"));
    cmd.arg("proxy")
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run_dir)
        .env("INPOD_UDS", zds)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("proxy log"));
    let process = ProcessGuard(lab.spawn_in_node(cmd).expect("spawn ztnode proxy"));
    wait_log(&log, &["snapshot received"], Duration::from_secs(20));
    Proxy { process, log }
}

/// Sends `msg` from `client_ns` to `app`, checks the echo and the source address the app saw, and
/// checks both access-log lines in `log` name both identities.
fn round_trip(
    client_ns: &Netns,
    server_ns: &Netns,
    app: SocketAddr,
    client_ip: IpAddr,
    log: &Path,
) {
    let msg = format!("hello over hbone to port {}", app.port());
    let echo = echo_once(server_ns, app);
    let mut c = Lab::connect_from(client_ns, app).expect("connect");
    c.write_all(msg.as_bytes()).expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    assert_eq!(back, msg.as_bytes());
    let (got, peer) = echo.join().expect("echo thread");
    assert_eq!(got, msg.as_bytes());
    assert_eq!(
        peer.ip(),
        client_ip,
        "the app must see the client's real IP"
    );
    let dst = format!("dst.hbone_addr={app}");
    for dir in ["direction=\"outbound\"", "direction=\"inbound\""] {
        let line = wait_log(
            log,
            &["connection complete", dir, &dst],
            Duration::from_secs(5),
        );
        for id in [
            "spiffe://cluster.local/ns/default/sa/alice",
            "spiffe://cluster.local/ns/default/sa/bob",
        ] {
            assert!(line.contains(id), "{dir} line lacks {id}: {line}");
        }
    }
}

/// A lab of these tests: its name prefix, run dir (removed after the lab) and the addresses
/// host-local gives the first two pods, `10.<net>.0.2` and `.3`.
struct SplitLab {
    lab: Lab,
    prefix: String,
    run_dir: PathBuf,
    first_ip: IpAddr,
    second_ip: IpAddr,
    _run_dir: common::RemoveOnDrop,
}

fn split_lab(tag: &str, net: u8) -> SplitLab {
    let prefix = common::prefix(tag);
    let run_dir = std::env::temp_dir().join(format!("ztnode-e2e-run-{prefix}"));
    let _ = std::fs::remove_dir_all(&run_dir);
    let guard = common::RemoveOnDrop(run_dir.clone());
    let lab = Lab::new(LabOptions {
        prefix: prefix.clone(),
        ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
        run_dir: run_dir.clone(),
        subnet: format!("10.{net}.0.0/24"),
        cni_version: "1.0.0".into(),
    })
    .expect("lab");
    SplitLab {
        lab,
        prefix,
        run_dir,
        first_ip: IpAddr::from([10, net, 0, 2]),
        second_ip: IpAddr::from([10, net, 0, 3]),
        _run_dir: guard,
    }
}

#[test]
fn agent_and_proxy_as_separate_processes_over_zds() {
    if !common::privileged("agent_and_proxy_as_separate_processes_over_zds") {
        return;
    }
    let SplitLab {
        lab,
        prefix,
        run_dir,
        first_ip: server_ip,
        second_ip: client_ip,
        _run_dir,
    } = split_lab("e2s", 248);
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
    assert!(zds.exists(), "ZDS socket at {}", zds.display());

    // no proxy yet: the server's ADD fails closed (rules in, no proxy), the agent keeps the pod
    let server = manual_pod(&lab, &prefix, "server");
    let err = lab
        .runner()
        .add(&server.att)
        .expect_err("ADD without a proxy");
    assert!(err.to_string().contains("no ztunnel connection"), "{err}");
    assert_eq!(ipv4_of(&server.netns_name), server_ip);
    assert!(
        ruleset(&server.netns_name).contains("redirect to :15006"),
        "fail closed: rules stay in the pod"
    );

    // the proxy starts afterwards and gets the server from the snapshot
    let proxy = start_proxy(&lab, &config, &run_dir, &zds, lab.dir().join("proxy1.log"));
    wait_log(
        &proxy.log,
        &["pod proxy listening", "sa/bob"],
        Duration::from_secs(5),
    );
    // ready once connected and the snapshot is applied
    wait_log(
        &proxy.log,
        &["workload proxy manager ready"],
        Duration::from_secs(5),
    );
    let (status, body) = readiness(&lab);
    assert!(status.contains(" 200 "), "{status}: {body}");
    assert_eq!(body, "ready\n");
    let client = lab.add_pod("client", "default").expect("add client");
    assert_eq!(client.ip, client_ip, "host-local allocation order");

    let server_ns = Netns::open(&server.att.netns).expect("server netns");
    let client_ns = Netns::open(&client.netns_path).expect("client netns");
    round_trip(
        &client_ns,
        &server_ns,
        SocketAddr::new(server_ip, 8080),
        client_ip,
        &proxy.log,
    );

    // kill the proxy and start it again: it reconnects and gets both pods from the snapshot
    proxy.kill();
    let proxy = start_proxy(&lab, &config, &run_dir, &zds, lab.dir().join("proxy2.log"));
    let started = log_text(&proxy.log)
        .lines()
        .filter(|l| l.contains("pod proxy listening"))
        .count();
    assert_eq!(started, 2, "both pods from the snapshot");
    wait_log(
        &agent_log,
        &["snapshot sent", "pods=2"],
        Duration::from_secs(5),
    );
    round_trip(
        &client_ns,
        &server_ns,
        SocketAddr::new(server_ip, 8081),
        client_ip,
        &proxy.log,
    );
}

/// The proxy's workload source lists the server pod 8 s after its ADD (istiod slow to push it):
/// the ADD does not wait for it, the server is served at once with the identity its handoff
/// carries, the client added behind it is not held up, and traffic flows over HBONE, with the
/// record in place later too.
#[test]
fn a_late_workload_record_holds_up_no_add() {
    if !common::privileged("a_late_workload_record_holds_up_no_add") {
        return;
    }
    let SplitLab {
        lab,
        prefix,
        run_dir,
        first_ip: server_ip,
        second_ip: client_ip,
        _run_dir,
    } = split_lab("e2l", 247);
    let both = [
        ("client", "default", "alice", client_ip),
        ("server", "default", "bob", server_ip),
    ];
    // the agent enrolls both; the proxy's source knows only the client for now
    let agent_config = lab.dir().join("agent-config.yaml");
    std::fs::write(&agent_config, lab::local_config(&prefix, &both)).expect("write");
    let proxy_config = lab.dir().join("proxy-config.yaml");
    std::fs::write(&proxy_config, lab::local_config(&prefix, &both[..1])).expect("write");
    let zds = run_dir.join("ztunnel.sock");
    let (_agent, _agent_log) = start_agent(&lab, &agent_config, &run_dir, &zds);
    let proxy = start_proxy(
        &lab,
        &proxy_config,
        &run_dir,
        &zds,
        lab.dir().join("proxy.log"),
    );

    let started = Instant::now();
    let server = lab.add_pod("server", "default").expect("server ADD");
    // the bridge exists from the first ADD on; no traffic before both pods are there
    let capture = common::capture::BridgeCapture::start(&lab, "late-record");
    let client = lab.add_pod("client", "default").expect("client ADD");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the ADDs waited for the record: {:?}",
        started.elapsed()
    );
    wait_log(
        &proxy.log,
        &["serving it with its handoff identity"],
        Duration::from_secs(5),
    );
    let server_ns = Netns::open(&server.netns_path).expect("server netns");
    let client_ns = Netns::open(&client.netns_path).expect("client netns");
    round_trip(
        &client_ns,
        &server_ns,
        SocketAddr::new(server_ip, 8080),
        client_ip,
        &proxy.log,
    );

    // the record arrives 8 s after the ADD: traffic keeps flowing over HBONE
    let elapsed = started.elapsed();
    std::thread::sleep(Duration::from_secs(8).saturating_sub(elapsed));
    std::fs::write(&proxy_config, lab::local_config(&prefix, &both)).expect("write");
    wait_log(
        &proxy.log,
        &["local config reloaded"],
        Duration::from_secs(5),
    );
    round_trip(
        &client_ns,
        &server_ns,
        SocketAddr::new(server_ip, 8081),
        client_ip,
        &proxy.log,
    );
    capture.check(
        &[client_ip, server_ip],
        &[
            b"hello over hbone to port 8080",
            b"hello over hbone to port 8081",
        ],
    );
}

/// The proxy dies (SIGKILL) while a stream runs between two enrolled pods: the stream ends for the
/// client instead of hanging or going on unencrypted, new connections fail while nobody serves the
/// pods (their rules stay: fail closed), the agent keeps both pods, and a restarted proxy gets them
/// from the snapshot and carries traffic over HBONE again. Nothing crosses the bridge in plaintext.
#[test]
fn a_proxy_killed_mid_stream_fails_closed_until_it_is_back() {
    if !common::privileged("a_proxy_killed_mid_stream_fails_closed_until_it_is_back") {
        return;
    }
    let SplitLab {
        lab,
        prefix,
        run_dir,
        first_ip: server_ip,
        second_ip: client_ip,
        _run_dir,
    } = split_lab("e2k", 244);
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
    let proxy = start_proxy(&lab, &config, &run_dir, &zds, lab.dir().join("proxy1.log"));
    let server = lab.add_pod("server", "default").expect("server ADD");
    let capture = common::capture::BridgeCapture::start(&lab, "proxy-killed");
    let client = lab.add_pod("client", "default").expect("client ADD");
    assert_eq!(
        (server.ip, client.ip),
        (server_ip, client_ip),
        "host-local order"
    );
    let server_ns = Netns::open(&server.netns_path).expect("server netns");
    let client_ns = Netns::open(&client.netns_path).expect("client netns");

    // a long stream: the app echoes every chunk
    let app = SocketAddr::new(server_ip, 8080);
    let listener = Lab::listen_in(&server_ns, app).expect("listen");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut stream = Lab::connect_from(&client_ns, app).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let chunk = b"stream chunk over hbone";
    for _ in 0..5 {
        stream.write_all(chunk).expect("write");
        let mut back = [0u8; 23];
        stream.read_exact(&mut back).expect("echo");
        assert_eq!(&back, chunk);
    }

    // SIGKILL mid-stream: the client's stream ends (reset or EOF) within the timeout
    proxy.kill();
    let mut back = [0u8; 64];
    match stream
        .write_all(b"stream chunk after the kill")
        .and_then(|()| stream.read(&mut back))
    {
        Ok(0) => {}
        Err(e) => assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the stream neither ended nor answered in 10 s"
        ),
        Ok(n) => panic!("an answer came back after the proxy died: {:?}", &back[..n]),
    }
    drop(stream);
    echo.join().expect("echo thread");

    // nobody serves the pods: new connections fail, the rules stay, the agent keeps both pods
    for (from, to, port) in [(&client_ns, server_ip, 8081), (&server_ns, client_ip, 8082)] {
        let to = SocketAddr::new(to, port);
        // refused, reset or answered with nothing, and the app never sees it: fail closed
        let to_ns = if to.ip() == server_ip {
            &server_ns
        } else {
            &client_ns
        };
        let app = Lab::listen_in(to_ns, to).expect("listen");
        app.set_nonblocking(true).expect("nonblocking");
        if let Ok(mut c) = Lab::connect_from(from, to) {
            c.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            let _ = c.write_all(b"secret while the proxy is down");
            let mut buf = [0u8; 16];
            assert_eq!(c.read(&mut buf).unwrap_or(0), 0, "an answer with no proxy");
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(app.accept().is_err(), "{to} reached the app with no proxy");
    }
    for pod in [&server, &client] {
        assert!(
            ruleset(&pod.netns_name).contains("redirect to :15006"),
            "{}: the rules stay while the proxy is down",
            pod.name
        );
    }
    let agent_text = log_text(&agent_log);
    assert!(
        !agent_text.contains("pod removed"),
        "the agent must keep its pods:\n{agent_text}"
    );

    // back: the restarted proxy gets both pods and carries traffic again
    let proxy = start_proxy(&lab, &config, &run_dir, &zds, lab.dir().join("proxy2.log"));
    wait_log(
        &agent_log,
        &["snapshot sent", "pods=2"],
        Duration::from_secs(5),
    );
    round_trip(
        &client_ns,
        &server_ns,
        SocketAddr::new(server_ip, 8083),
        client_ip,
        &proxy.log,
    );
    capture.check(
        &[client_ip, server_ip],
        &[
            b"stream chunk",
            b"secret while the proxy is down",
            b"hello over hbone to port 8083",
        ],
    );
}
