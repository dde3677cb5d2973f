//! End to end (issue 17): how many HBONE connections a pod's traffic takes (ztunnel's pool caps
//! the streams open at once on a connection, not the streams over its life), and the byte counts
//! of a connection that ends with an error (access log and metrics keep what it moved).

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::node::MeshNode;
use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// The HBONE connections the client pod opened to the server pod in the capture at `pcap`
/// (stopped): the distinct client ports of the segments towards the server's 15008. Also checks
/// that nothing else crossed between the two pods (no plaintext path).
fn hbone_connections(node: &MeshNode, pcap: &std::path::Path) -> usize {
    let data = std::fs::read(pcap).expect("pcap");
    let segs = ztnode::lab::pcap::tcp_segments(&data).expect("parse pcap");
    let between: Vec<_> = segs
        .iter()
        .filter(|s| {
            [s.src, s.dst].contains(&node.client.ip) && [s.src, s.dst].contains(&node.server.ip)
        })
        .collect();
    assert!(!between.is_empty(), "capture saw nothing between the pods");
    assert!(
        between
            .iter()
            .all(|s| s.src_port == 15008 || s.dst_port == 15008),
        "non-HBONE packets between the pods"
    );
    let ports: std::collections::BTreeSet<u16> = between
        .iter()
        .filter(|s| s.src == node.client.ip && s.dst_port == 15008)
        .map(|s| s.src_port)
        .collect();
    ports.len()
}

/// 300 sequential connections from one pod to another ride one pooled HBONE connection: each
/// stream ends before the next starts, so the pool's cap of 100 streams (ztunnel
/// `POOL_MAX_STREAMS_PER_CONNECTION`, on streams open at once) is never reached. The bar
/// is ≤ 3; ≤ 2 is asserted (one spare dial), as a cap on streams over the connection's life
/// takes exactly 3 for 300.
#[test]
fn sequential_connections_share_one_hbone_connection() {
    if !common::privileged("sequential_connections_share_one_hbone_connection") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2p"));
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let pcap = node.lab.dir().join("pool.pcap");
    let dump = node.lab.capture(&pcap).expect("tcpdump");

    const CONNS: usize = 300;
    let app = SocketAddr::new(node.server.ip, 8090);
    let listener = Lab::listen_in(&server_ns, app).expect("listen");
    let server = std::thread::spawn(move || {
        for _ in 0..CONNS {
            let (mut s, _) = listener.accept().expect("accept");
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).expect("read");
            s.write_all(&buf).expect("echo");
        }
    });
    for i in 0..CONNS {
        let mut c = Lab::connect_from(&client_ns, app).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let msg = format!("request {i}");
        c.write_all(msg.as_bytes()).expect("write");
        c.shutdown(std::net::Shutdown::Write).expect("half close");
        let mut back = Vec::new();
        c.read_to_end(&mut back).expect("read echo");
        assert_eq!(back, msg.as_bytes(), "connection {i}");
    }
    server.join().expect("server");
    std::thread::sleep(Duration::from_millis(300));
    drop(dump);
    let n = hbone_connections(&node, &pcap);
    assert!(
        (1..=2).contains(&n),
        "{CONNS} sequential connections took {n} HBONE connections"
    );
}

/// Echoes every connection on `app` inside `ns` (each in its own thread, until EOF), for `conns`
/// connections.
fn echo_server(ns: &Netns, app: SocketAddr, conns: usize) -> std::thread::JoinHandle<()> {
    let listener = Lab::listen_in(ns, app).expect("listen");
    std::thread::spawn(move || {
        let mut threads = Vec::new();
        for _ in 0..conns {
            let (s, _) = listener.accept().expect("accept");
            threads.push(std::thread::spawn(move || {
                let mut w = s.try_clone().expect("clone");
                let mut r = s;
                let _ = std::io::copy(&mut r, &mut w);
            }));
        }
        for t in threads {
            t.join().expect("echo thread");
        }
    })
}

/// One round trip on `c`: writes `b`, reads it back.
fn ping(c: &mut std::net::TcpStream, b: u8) {
    c.write_all(&[b]).expect("write");
    let mut back = [0u8; 1];
    c.read_exact(&mut back).expect("echo");
    assert_eq!(back[0], b);
}

/// ztunnel's pool env reaches every pod's pool: with `POOL_MAX_STREAMS_PER_CONNECTION=2`, five
/// connections open at once take three HBONE connections; with `POOL_UNUSED_RELEASE_TIMEOUT=2s`,
/// once they have ended the pooled connections are released, and the next connection dials anew.
#[test]
fn ztunnels_pool_env_sets_the_cap_and_the_release_timeout() {
    if !common::privileged("ztunnels_pool_env_sets_the_cap_and_the_release_timeout") {
        return;
    }
    let node = MeshNode::start_with_env(
        &common::prefix("e2v"),
        "",
        &[],
        &[
            ("POOL_MAX_STREAMS_PER_CONNECTION", "2"),
            ("POOL_UNUSED_RELEASE_TIMEOUT", "2s"),
        ],
    );
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let pcap = node.lab.dir().join("env.pcap");
    let dump = node.lab.capture(&pcap).expect("tcpdump");

    let app = SocketAddr::new(node.server.ip, 8091);
    let server = echo_server(&server_ns, app, 6);
    let mut open: Vec<_> = (0..5u8)
        .map(|i| {
            let mut c = Lab::connect_from(&client_ns, app).expect("connect");
            c.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            ping(&mut c, i);
            c
        })
        .collect();
    for (i, c) in (0..).zip(open.iter_mut()) {
        ping(c, 10 + i);
    }
    drop(open);
    // released within the timeout plus one sweep (1 s at a 2 s timeout)
    std::thread::sleep(Duration::from_secs(4));
    let mut c = Lab::connect_from(&client_ns, app).expect("connect after release");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    ping(&mut c, 99);
    drop(c);
    server.join().expect("server");
    std::thread::sleep(Duration::from_millis(300));
    drop(dump);
    let n = hbone_connections(&node, &pcap);
    assert_eq!(
        n, 4,
        "3 for 5 streams at a cap of 2, then 1 after the release"
    );
    let log = node.log_text();
    assert!(
        !log.lines()
            .any(|l| l.contains("not supported") && l.contains("POOL_")),
        "the pool env is supported:\n{log}"
    );
}

/// Parses `name=<u64>` out of an access-log line.
fn field(line: &str, name: &str) -> u64 {
    let start = line
        .find(&format!("{name}="))
        .unwrap_or_else(|| panic!("no {name} in {line}"))
        + name.len()
        + 1;
    line[start..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} is not a number in {line}"))
}

/// The sum of the counter lines `name{reporter="<reporter>",...} v` in a metrics text.
fn counter(text: &str, name: &str, reporter: &str) -> u64 {
    let prefix = format!("{name}{{reporter=\"{reporter}\"");
    let values: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(!values.is_empty(), "no {prefix} in\n{text}");
    values.iter().sum()
}

/// A transfer the server app ends with a reset (SO_LINGER 0 close after reading `N` bytes) is
/// logged with its error and the bytes it moved: the server proxy's inbound line has at least `N`
/// received (at most what the client sent), and so do the byte counters. Today's failure: such a
/// line said `bytes_recv=0`.
#[test]
fn a_transfer_ended_by_a_reset_keeps_its_byte_counts() {
    if !common::privileged("a_transfer_ended_by_a_reset_keeps_its_byte_counts") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2r"));
    let capture = common::capture::BridgeCapture::start(&node.lab, "reset");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");

    const N: u64 = 2 << 20;
    const TOTAL: u64 = 8 << 20;
    let app = SocketAddr::new(node.server.ip, 9100);
    let listener = Lab::listen_in(&server_ns, app).expect("listen");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; N as usize];
        s.read_exact(&mut buf).expect("read N bytes");
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .expect("SO_LINGER 0");
        drop(s); // RST
    });
    let mut c = Lab::connect_from(&client_ns, app).expect("connect");
    c.set_write_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let chunk = vec![0x5au8; 64 * 1024];
    let mut written = 0u64;
    while written < TOTAL {
        match c.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(_) => break, // the reset reached the client: expected
        }
    }
    server.join().expect("server");
    drop(c);
    assert!(written >= N, "the client wrote {written}");

    let inbound = node.wait_log(
        &["connection complete", "direction=\"inbound\"", "error="],
        Duration::from_secs(10),
    );
    let recv = field(&inbound, "bytes_recv");
    assert!(
        (N..=written).contains(&recv),
        "inbound bytes_recv={recv}, the app read {N} of {written}: {inbound}"
    );
    // the client's proxy: whatever way its side ended, it moved at least what the app read
    let outbound = node.wait_log(
        &["connection complete", "direction=\"outbound\""],
        Duration::from_secs(10),
    );
    let sent = field(&outbound, "bytes_sent");
    assert!(
        (N..=written).contains(&sent),
        "outbound bytes_sent={sent}: {outbound}"
    );

    let metrics = SocketAddr::from(([127, 0, 0, 1], 15020));
    let (code, text) =
        ztnode::lab::http::get_text(node.lab.node(), metrics, "/metrics").expect("metrics");
    assert_eq!(code, 200, "{text}");
    for reporter in ["source", "destination"] {
        let got = counter(&text, "istio_tcp_received_bytes_total", reporter);
        assert!(
            got >= N,
            "{reporter}: istio_tcp_received_bytes_total={got} < {N}"
        );
    }
    capture.check(&[node.client.ip, node.server.ip], &[&[0x5a; 64]]);
}
