//! End to end (issue 17): policies apply to open connections, and fail closed on what L4 cannot
//! see. `ztnode node` in a lab node with client, server and outsider pods; the policies change by
//! rewriting the node's local config, which it re-reads when the file changes.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::capture::BridgeCapture;
use common::node::MeshNode;
use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// How long an open connection may keep flowing after the policies that deny it were stored.
const LATE_CLOSE_BOUND: Duration = Duration::from_secs(1);

/// The node's local config file.
fn config_path(node: &MeshNode) -> PathBuf {
    node.lab.dir().join("local-config.yaml")
}

/// Number of "local config reloaded" lines in the node log.
fn reloads(node: &MeshNode) -> usize {
    node.log_text()
        .lines()
        .filter(|l| l.contains("local config reloaded"))
        .count()
}

/// Replaces the node's config with `base` (the workloads as the lab wrote them), the server
/// workload naming the selector policies `selected`, and `policies` (a `policies:` list) appended;
/// returns once the node logged the reload, at the moment it saw it.
fn rewrite(node: &MeshNode, base: &str, selected: &[&str], policies: &str) -> Instant {
    let named: Vec<String> = selected.iter().map(|k| format!("\"{k}\"")).collect();
    let server = format!(
        "  name: server\n  authorizationPolicies: [{}]\n",
        named.join(", ")
    );
    let yaml = base.replace("  name: server\n", &server) + policies;
    assert_ne!(yaml, base, "the server workload is in the config");
    let before = reloads(node);
    // written whole, then renamed: the node never reads half a file
    let path = config_path(node);
    let tmp = path.with_extension("yaml.new");
    std::fs::write(&tmp, yaml).expect("write config");
    std::fs::rename(&tmp, &path).expect("replace config");
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads(node) <= before {
        assert!(
            Instant::now() < deadline,
            "the node did not reload its config; log:\n{}",
            node.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Instant::now()
}

/// An app on `addr` in `ns` that echoes one connection until it ends, then reports when.
fn echo_until_closed(ns: &Netns, addr: SocketAddr) -> mpsc::Receiver<Instant> {
    let listener = Lab::listen_in(ns, addr).expect("listen");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = tx.send(Instant::now());
    });
    rx
}

/// Writes `msg` on `c` and reads the echo back.
fn ping(c: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(msg)?;
    let mut back = vec![0u8; msg.len()];
    c.read_exact(&mut back)?;
    Ok(back)
}

/// Whether `c` is closed (EOF or an error other than a timeout) by `deadline`.
fn closed_by(c: &mut TcpStream, deadline: Instant) -> Result<(), String> {
    let left = deadline.saturating_duration_since(Instant::now());
    c.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    match c.read(&mut buf) {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!("got {n} more bytes")),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            Err("still open".into())
        }
        Err(_) => Ok(()),
    }
}

#[test]
fn a_deny_closes_open_connections_it_denies_within_a_second_and_no_other() {
    if !common::privileged("a_deny_closes_open_connections_it_denies_within_a_second_and_no_other")
    {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2l"));
    let capture = BridgeCapture::start(&node.lab, "deny-live");
    let base = std::fs::read_to_string(config_path(&node)).expect("config");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    let server = |port| SocketAddr::new(node.server.ip, port);

    // 8080 over HBONE and 8082 in plaintext (through the server's 15006) will be denied; 8081
    // over HBONE (most likely on the same HBONE connection as 8080) stays allowed
    let app_8080 = echo_until_closed(&server_ns, server(8080));
    let app_8081 = echo_until_closed(&server_ns, server(8081));
    let app_8082 = echo_until_closed(&server_ns, server(8082));
    let mut denied_hbone = Lab::connect_from(&client_ns, server(8080)).expect("connect 8080");
    let mut kept = Lab::connect_from(&client_ns, server(8081)).expect("connect 8081");
    let mut denied_plain = Lab::connect_from(&outsider_ns, server(8082)).expect("connect 8082");
    for (c, msg) in [
        (&mut denied_hbone, &b"before 8080"[..]),
        (&mut kept, b"before 8081"),
        (&mut denied_plain, b"before 8082"),
    ] {
        assert_eq!(ping(c, msg).expect("echo before the policy"), msg);
    }

    let stored = rewrite(
        &node,
        &base,
        &[],
        "policies:\n- name: deny-late\n  namespace: default\n  scope: Namespace\n  action: Deny\n  \
         rules: [[[{destinationPorts: [8080, 8082]}]]]\n",
    );
    let deadline = stored + LATE_CLOSE_BOUND;
    // both directions: the client's connection and the app's end
    for (what, c, app) in [
        ("HBONE 8080", &mut denied_hbone, &app_8080),
        ("plaintext 8082", &mut denied_plain, &app_8082),
    ] {
        closed_by(c, deadline)
            .unwrap_or_else(|e| panic!("{what}: client side not closed in time: {e}"));
        let left = deadline.saturating_duration_since(Instant::now());
        app.recv_timeout(left + Duration::from_millis(1))
            .unwrap_or_else(|_| panic!("{what}: app side not closed in time"));
    }
    // the stream the policy allows keeps flowing, well after the closings
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        ping(&mut kept, b"after 8081").expect("the allowed stream is untouched"),
        b"after 8081"
    );
    assert!(
        app_8081.try_recv().is_err(),
        "the allowed app connection is open"
    );

    // a log line per closing names the policy, and each access-log line carries the error (the
    // app's address is the HBONE target of the mesh client, the plain destination of the other)
    for (src, port, field) in [
        (node.client.ip, 8080, "dst.hbone_addr"),
        (node.outsider.ip, 8082, "dst.addr"),
    ] {
        let dst = format!("dst.addr={}:{port}", node.server.ip);
        let target = format!("{field}={}:{port}", node.server.ip);
        node.wait_log(
            &[
                "no longer allowed after a policy update",
                &format!("src.addr={src}"),
                &dst,
                "explicitly denied by: default/deny-late",
            ],
            Duration::from_secs(5),
        );
        let line = node.wait_log(
            &[
                "connection complete",
                "direction=\"inbound\"",
                &target,
                "connection closed due to policy change: explicitly denied by: default/deny-late",
            ],
            Duration::from_secs(5),
        );
        // what moved before the closing is counted (the 11-byte ping and its echo)
        for field in ["bytes_sent=11", "bytes_recv=11"] {
            assert!(line.contains(field), "{field} expected: {line}");
        }
    }
    assert!(
        !node
            .log_text()
            .lines()
            .any(|l| l.contains("no longer allowed") && l.contains(":8081")),
        "the allowed stream was closed"
    );
    drop(kept);
    app_8081
        .recv_timeout(Duration::from_secs(5))
        .expect("the allowed connection ends when its client closes it");
    // 8082 came from the outsider, outside the mesh: plaintext there is expected
    capture.check(
        &[node.client.ip, node.server.ip],
        &[b"before 8080", b"before 8081", b"after 8081"],
    );
}

/// Connects from `from` to `to`, sends a line and reads to the end: what came back.
fn exchange(from: &Netns, to: SocketAddr) -> Vec<u8> {
    // a refusal may reset the connection before connect returns
    let Some(mut c) = common::connect_unless_reset(from, to, "connect to the capture") else {
        return Vec::new();
    };
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = c.write_all(b"hello");
    let _ = c.shutdown(std::net::Shutdown::Write);
    let mut back = Vec::new();
    // a refusal is an end of stream or a reset, never data
    let _ = c.read_to_end(&mut back);
    back
}

/// An app on `addr` in `ns` echoing every connection (each until its client's end).
fn echo_all(ns: &Netns, addr: SocketAddr) {
    let listener = Lab::listen_in(ns, addr).expect("listen");
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut got = Vec::new();
                if s.read_to_end(&mut got).is_ok() {
                    let _ = s.write_all(&got);
                }
            });
        }
    });
}

#[test]
fn deny_rules_with_empty_or_http_only_matches_deny() {
    if !common::privileged("deny_rules_with_empty_or_http_only_matches_deny") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2f"));
    let capture = BridgeCapture::start(&node.lab, "deny-l7");
    let base = std::fs::read_to_string(config_path(&node)).expect("config");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    for port in [8080, 9000] {
        echo_all(&server_ns, SocketAddr::new(node.server.ip, port));
    }
    // the positive control: the client's app, which no policy selects
    let to_client = SocketAddr::new(node.client.ip, 8080);
    echo_all(&client_ns, to_client);
    let to_server = |port| SocketAddr::new(node.server.ip, port);
    assert_eq!(
        exchange(&client_ns, to_server(8080)),
        b"hello",
        "no policy yet"
    );

    // (policies selected by the server, port denied, port still allowed or None, policy denying)
    let cases: [(&str, u16, Option<u16>, &str); 4] = [
        // issue 17's smallest input: a DENY with an empty match allowed everything
        ("rules: [[[{}]]]", 8080, None, "default/sel"),
        // HTTP attributes only: every connection the policy selects
        (
            "rules: [[[{paths: [/admin], methods: [GET]}]]]",
            8080,
            None,
            "default/sel",
        ),
        // HTTP attributes next to L4 ones: what the L4 fields select
        (
            "rules: [[[{destinationPorts: [9000], methods: [POST], paths: [/upload]}]]]",
            9000,
            Some(8080),
            "default/sel",
        ),
        // an empty match in a clause next to an L4 clause
        (
            "rules: [[[{destinationPorts: [9000]}], [{}]]]",
            9000,
            Some(8080),
            "default/sel",
        ),
    ];
    for (rules, denied, allowed, policy) in cases {
        rewrite(
            &node,
            &base,
            &["default/sel"],
            &format!(
                "policies:\n- {{name: sel, namespace: default, scope: WorkloadSelector, action: Deny, {rules}}}\n"
            ),
        );
        let before = node.log_text().len();
        assert_eq!(
            exchange(&client_ns, to_server(denied)),
            b"",
            "{rules}: port {denied} must be denied"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        let needle =
            format!("connection closed due to policy rejection: explicitly denied by: {policy}");
        while !node.log_text()[before..].lines().any(|l| {
            l.contains(&needle)
                && l.contains(&format!("dst.hbone_addr={}:{denied}", node.server.ip))
        }) {
            assert!(
                Instant::now() < deadline,
                "{rules}: no rejection by {policy} logged; log:\n{}",
                node.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(port) = allowed {
            assert_eq!(
                exchange(&client_ns, to_server(port)),
                b"hello",
                "{rules}: port {port}"
            );
        }
        assert_eq!(
            exchange(&server_ns, to_client),
            b"hello",
            "{rules}: the client's app"
        );
    }

    // a policy with an unknown key: that policy fails closed (a DENY denies all it selects), the
    // rest of the config still loads (here: the ALLOW below, which the client's app then needs)
    rewrite(
        &node,
        &base,
        &["default/typo"],
        "policies:\n- {name: typo, namespace: default, scope: WorkloadSelector, action: Deny, \
         rules: [[[{destinationPort: [9000]}]]]}\n\
         - {name: from-server, namespace: default, scope: Global, action: Allow, \
         rules: [[[{principals: [{Exact: cluster.local/ns/default/sa/bob}]}], [{destinationPorts: [8080]}]]]}\n",
    );
    node.wait_log(
        &[
            "invalid authorization policy",
            "default/typo",
            "unknown field `destinationPort`",
        ],
        Duration::from_secs(5),
    );
    assert_eq!(
        exchange(&client_ns, to_server(8080)),
        b"",
        "typo denies 8080 too"
    );
    node.wait_log(
        &["explicitly denied by: default/typo"],
        Duration::from_secs(5),
    );
    // the ALLOW loaded: it lets the server's identity in, and nothing without one
    assert_eq!(
        exchange(&server_ns, to_client),
        b"hello",
        "bob to the client"
    );
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    assert_eq!(
        exchange(&outsider_ns, to_client),
        b"",
        "plaintext to the client"
    );
    node.wait_log(
        &[
            &format!("src.addr={}", node.outsider.ip),
            "allow policies exist, but none allowed",
        ],
        Duration::from_secs(5),
    );
    // between the mesh pods only HBONE (the outsider's "hello" is plaintext by design)
    capture.check(&[node.client.ip, node.server.ip], &[]);
}
