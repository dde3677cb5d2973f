//! End to end: `ztnode node` drains on SIGTERM (`../shared/spec/ztunnel.md` §3 "Drain /
//! shutdown"). With connections open between two enrolled pods, readiness answers 500 at once,
//! no new connection is accepted, connections that end within `CONNECTION_TERMINATION_DEADLINE`
//! flow on to their clean end, those still open at the deadline are closed then, and the process
//! exits 0. `POST /quitquitquit` drains the same way.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::lifecycle::{Stream, echo_server, quitquitquit, readiness, sigterm, wait_exit};
use common::node::MeshNode;
use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// The drain deadline the node runs with here.
const DEADLINE: Duration = Duration::from_secs(4);
/// Connections that end on their own during the drain.
const FINISHING: usize = 40;
/// Connections that outlive the deadline.
const OUTLIVING: usize = 10;

#[test]
fn sigterm_drains_open_connections_until_the_deadline() {
    if !common::privileged("sigterm_drains_open_connections_until_the_deadline") {
        return;
    }
    let mut node = MeshNode::start_with_env(
        &common::prefix("e2d"),
        "",
        &[],
        &[("CONNECTION_TERMINATION_DEADLINE", "4s")],
    );
    node.wait_log(&["workload proxy manager ready"], Duration::from_secs(10));
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    echo_server(&server_ns, app);
    let capture = common::capture::BridgeCapture::start(&node.lab, "drain");
    let mut finishing: Vec<Stream> = (0..FINISHING)
        .map(|_| Stream::open(&client_ns, app))
        .collect();
    let mut outliving: Vec<Stream> = (0..OUTLIVING)
        .map(|_| Stream::open(&client_ns, app))
        .collect();
    for s in finishing.iter_mut().chain(outliving.iter_mut()) {
        s.exchange("drain-secret").expect("before the drain");
    }
    let (status, body) = readiness(&node.lab).expect("readiness");
    assert!(status.contains(" 200 "), "{status}: {body}");

    sigterm(&node.process);
    let term = Instant::now();
    // readiness goes not-ready at once (the first answer that is not 200 is the drain's 500)
    let (status, body) = loop {
        let r = readiness(&node.lab).expect("readiness answers during the drain");
        if !r.0.contains(" 200 ") {
            break r;
        }
        assert!(
            term.elapsed() < Duration::from_secs(1),
            "still ready after SIGTERM"
        );
    };
    assert!(status.contains(" 500 "), "{status}: {body}");
    assert!(body.contains("draining"), "{body}");
    node.wait_log(&["draining: listeners closed"], Duration::from_secs(5));
    // no new connection: the pod's outbound listener is closed
    let refused = Lab::connect_from(&client_ns, app)
        .map_err(|e| e.to_string())
        .and_then(|s| Stream::from_connected(s).exchange("late"));
    assert!(
        refused.is_err(),
        "a new connection was accepted during the drain"
    );

    // the finishing ones flow on for a while, then end cleanly, all within the deadline
    let until = term + DEADLINE / 3;
    while Instant::now() < until {
        for s in finishing.iter_mut().chain(outliving.iter_mut()) {
            s.exchange("drain-secret")
                .expect("open connections flow during the drain");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for s in finishing {
        s.finish()
            .expect("a connection ending within the deadline ends cleanly");
    }
    assert!(
        term.elapsed() < DEADLINE,
        "the finishing ones took too long for this test"
    );
    // the outliving ones keep going until the deadline closes them
    let mut closed_at = Vec::new();
    for mut s in outliving {
        let err = loop {
            if let Err(e) = s.exchange("drain-secret") {
                break e;
            }
            assert!(
                term.elapsed() < DEADLINE * 3,
                "a connection outlived the deadline by far"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        closed_at.push((term.elapsed(), err));
    }
    for (at, err) in &closed_at {
        assert!(
            *at >= DEADLINE - Duration::from_millis(500),
            "closed at {at:?}, before the {DEADLINE:?} deadline: {err}"
        );
    }
    let (status, exited) = wait_exit(&mut node.process, Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
    assert!(exited - term >= DEADLINE - Duration::from_millis(500));
    node.wait_log(
        &["drain deadline expired with open connections"],
        Duration::from_secs(1),
    );
    let complete = node
        .log_text()
        .lines()
        .filter(|l| l.contains("connection complete") && l.contains("direction=\"inbound\""))
        .count();
    assert!(
        complete >= FINISHING,
        "every finished connection is logged: {complete}"
    );
    capture.check(&[node.client.ip, node.server.ip], &[b"drain-secret"]);
}

#[test]
fn quitquitquit_drains_like_sigterm() {
    if !common::privileged("quitquitquit_drains_like_sigterm") {
        return;
    }
    let mut node = MeshNode::start(&common::prefix("e2q"));
    node.wait_log(&["workload proxy manager ready"], Duration::from_secs(10));
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    echo_server(&server_ns, app);
    let mut open = Stream::open(&client_ns, app);
    open.exchange("quit").expect("before");
    let status = quitquitquit(&node.lab).expect("quitquitquit");
    assert!(status.contains(" 200 "), "{status}");
    node.wait_log(&["draining: listeners closed"], Duration::from_secs(5));
    let (status, body) = readiness(&node.lab).expect("readiness during the drain");
    assert!(
        status.contains(" 500 ") && body.contains("draining"),
        "{status}: {body}"
    );
    for _ in 0..10 {
        open.exchange("quit")
            .expect("the open connection flows during the drain");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        node.process.0.try_wait().expect("try_wait").is_none(),
        "the node waits for its open connection"
    );
    open.finish().expect("ends cleanly");
    let (status, _) = wait_exit(&mut node.process, Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
    node.wait_log(
        &["drain complete: every connection ended"],
        Duration::from_secs(1),
    );
}
