//! End to end: `ztnode node` as a separate process in a lab node, pods attached through the real CNI
//! chain (reference bridge + host-local, then ztnode-cni), traffic between them over HBONE.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::node::{MeshNode, answer_once, echo_once};
use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// The TCP segments between client and server in the capture at `pcap` (stopped), after checking
/// there are some and all are on the HBONE port.
fn hbone_segments_between(
    node: &MeshNode,
    pcap: &std::path::Path,
) -> Vec<ztnode::lab::pcap::TcpSegment> {
    let data = std::fs::read(pcap).expect("pcap");
    let segs = ztnode::lab::pcap::tcp_segments(&data).expect("parse pcap");
    let between: Vec<_> = segs
        .into_iter()
        .filter(|s| {
            [s.src, s.dst].contains(&node.client.ip) && [s.src, s.dst].contains(&node.server.ip)
        })
        .collect();
    assert!(!between.is_empty(), "capture saw nothing between the pods");
    assert!(
        between
            .iter()
            .all(|s| s.src_port == 15008 || s.dst_port == 15008),
        "non-HBONE packets between pods"
    );
    between
}

#[test]
fn pods_talk_over_hbone_with_identities_and_real_source_ip() {
    if !common::privileged("pods_talk_over_hbone_with_identities_and_real_source_ip") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2a"));
    // once ready the node unmaps its binary's start-up pages; all that follows runs after it
    let released = node.wait_log(
        &["released the start-up pages of the executable"],
        Duration::from_secs(10),
    );
    assert!(!released.contains("kib=0"), "{released}");
    // enrollment: rules in both mesh pods, none in the outsider
    for pod in [&node.client, &node.server] {
        let rules = MeshNode::ruleset(pod);
        assert!(
            rules.contains("redirect to :15001") && rules.contains("redirect to :15006"),
            "{rules}"
        );
    }
    assert!(
        !MeshNode::ruleset(&node.outsider).contains("istio-ambient"),
        "outsider must not be enrolled"
    );

    let pcap = node.lab.dir().join("e2e.pcap");
    let dump = node.lab.capture(&pcap).expect("tcpdump");

    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    let echo = echo_once(&server_ns, app);
    let secret = b"the quick brown fox jumps over the lazy mesh";
    let mut c = Lab::connect_from(&client_ns, app).expect("connect");
    c.write_all(secret).expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    assert_eq!(back, secret);
    let (got, peer) = echo.join().expect("echo thread");
    assert_eq!(got, secret);
    assert_eq!(
        peer.ip(),
        node.client.ip,
        "the app must see the client's real IP"
    );

    let out = node.wait_log(
        &["connection complete", "direction=\"outbound\""],
        Duration::from_secs(5),
    );
    let inb = node.wait_log(
        &["connection complete", "direction=\"inbound\""],
        Duration::from_secs(5),
    );
    for line in [&out, &inb] {
        assert!(
            line.contains("spiffe://cluster.local/ns/default/sa/alice"),
            "{line}"
        );
        assert!(
            line.contains("spiffe://cluster.local/ns/default/sa/bob"),
            "{line}"
        );
    }
    assert!(
        inb.contains(&format!("src.addr={}", node.client.ip)),
        "{inb}"
    );

    std::thread::sleep(Duration::from_millis(500));
    drop(dump);
    let between = hbone_segments_between(&node, &pcap);
    assert!(
        !between
            .iter()
            .any(|s| ztnode::lab::pcap::contains(&s.payload, secret)),
        "payload crossed in clear"
    );
    assert!(
        between
            .iter()
            .any(|s| s.payload.starts_with(&[0x17, 0x03, 0x03])),
        "no TLS records"
    );

    // a client outside the mesh reaches the server through its inbound plaintext capture (15006),
    // and the app still sees the real client address
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    let plain = SocketAddr::new(node.server.ip, 8081);
    let answer = answer_once(&server_ns, plain, |_| b"ack".to_vec());
    let mut c = Lab::connect_from(&outsider_ns, plain).expect("connect from outsider");
    c.write_all(b"plain").expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read answer");
    assert_eq!(back, b"ack");
    let (got, peer) = answer.join().expect("answer thread");
    assert_eq!(got, b"plain");
    assert_eq!(peer.ip(), node.outsider.ip);
    // the inbound view: sent towards the client 3, received from it 5
    node.wait_log(
        &[
            "connection complete",
            "direction=\"inbound\"",
            &format!("src.addr={}", node.outsider.ip),
            "bytes_sent=3 bytes_recv=5",
        ],
        Duration::from_secs(5),
    );

    // CNI DEL removes the rules; a second DEL succeeds
    node.lab.cni_del(&node.client).expect("DEL");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while MeshNode::ruleset(&node.client).contains("istio-ambient") {
        assert!(std::time::Instant::now() < deadline, "rules left after DEL");
        std::thread::sleep(Duration::from_millis(50));
    }
    node.lab.cni_del(&node.client).expect("second DEL");
}

/// One packet mark for rules and sockets: with `--packet-mark 0x540` the in-pod rules exclude (and
/// connmark) 0x540 instead of 0x539, so the proxy's own connections are not captured again and the
/// app's replies to a spoofed client source find their way back to the proxy.
#[test]
fn a_non_default_packet_mark_reaches_the_rules_and_the_sockets() {
    if !common::privileged("a_non_default_packet_mark_reaches_the_rules_and_the_sockets") {
        return;
    }
    let node = MeshNode::start_with_args(&common::prefix("e2m"), "", &["--packet-mark", "0x540"]);
    for pod in [&node.client, &node.server] {
        let rules = MeshNode::ruleset(pod);
        assert!(
            rules.contains("0x00000540") || rules.contains("0x540"),
            "rules do not name the configured mark:\n{rules}"
        );
        assert!(
            !rules.contains("0x00000539") && !rules.contains("0x539"),
            "rules still name the default mark:\n{rules}"
        );
    }

    let pcap = node.lab.dir().join("mark.pcap");
    let dump = node.lab.capture(&pcap).expect("tcpdump");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    let echo = echo_once(&server_ns, app);
    let secret = b"marked by the configured packet mark";
    let mut c = Lab::connect_from(&client_ns, app).expect("connect");
    c.write_all(secret).expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    assert_eq!(back, secret);
    let (got, peer) = echo.join().expect("echo thread");
    assert_eq!(got, secret);
    assert_eq!(peer.ip(), node.client.ip, "the app sees the client's IP");
    for direction in ["direction=\"outbound\"", "direction=\"inbound\""] {
        let line = node.wait_log(&["connection complete", direction], Duration::from_secs(5));
        assert!(
            line.contains("spiffe://cluster.local/ns/default/sa/bob"),
            "{line}"
        );
    }

    std::thread::sleep(Duration::from_millis(500));
    drop(dump);
    hbone_segments_between(&node, &pcap);
}

#[test]
fn gigabyte_transfer_and_200_concurrent_connections() {
    if !common::privileged("gigabyte_transfer_and_200_concurrent_connections") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2b"));
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");

    // 1 GiB one way, checksum compared
    let bulk = SocketAddr::new(node.server.ip, 9000);
    let listener = Lab::listen_in(&server_ns, bulk).expect("listen");
    let sink = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = s.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            ctx.update(&buf[..n]);
            total += n as u64;
        }
        (total, ctx.finish().as_ref().to_vec())
    });
    let mut c = Lab::connect_from(&client_ns, bulk).expect("connect");
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut chunk = vec![0u8; 1 << 20];
    for i in 0..1024u32 {
        for (j, b) in chunk.iter_mut().enumerate() {
            *b = (i as usize).wrapping_mul(31).wrapping_add(j) as u8;
        }
        ctx.update(&chunk);
        c.write_all(&chunk).expect("write");
    }
    drop(c);
    let (total, digest) = sink.join().expect("sink");
    assert_eq!(total, 1 << 30);
    assert_eq!(digest, ctx.finish().as_ref().to_vec(), "checksum mismatch");
    // one way: the client's proxy sent it all towards the server, the server's received it all
    // from the client (the access log's view from each proxy)
    for (direction, counts) in [
        ("outbound", "bytes_sent=1073741824 bytes_recv=0"),
        ("inbound", "bytes_sent=0 bytes_recv=1073741824"),
    ] {
        node.wait_log(
            &[
                "connection complete",
                &format!("direction=\"{direction}\""),
                counts,
            ],
            Duration::from_secs(5),
        );
    }

    // 200 concurrent connections, each echoing its own id
    let many = SocketAddr::new(node.server.ip, 9001);
    let listener = Lab::listen_in(&server_ns, many).expect("listen");
    let server = std::thread::spawn(move || {
        let mut handles = Vec::new();
        for _ in 0..200 {
            let (mut s, _) = listener.accept().expect("accept");
            handles.push(std::thread::spawn(move || {
                let mut buf = [0u8; 4];
                s.read_exact(&mut buf).expect("read id");
                s.write_all(&buf).expect("echo id");
            }));
        }
        for h in handles {
            h.join().expect("conn thread");
        }
    });
    let conns: Vec<_> = (0..200u32)
        .map(|i| {
            let mut s = Lab::connect_from(&client_ns, many).expect("connect");
            s.write_all(&i.to_be_bytes()).expect("write id");
            (i, s)
        })
        .collect();
    for (i, mut s) in conns {
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).expect("read echo");
        assert_eq!(u32::from_be_bytes(buf), i);
    }
    server.join().expect("server");
}

/// A refused destination looks refused to the app (RST, as without the mesh), not accepted and
/// then closed cleanly.
#[test]
fn destination_without_listener_looks_refused_to_the_client() {
    if !common::privileged("destination_without_listener_looks_refused_to_the_client") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2c"));
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    for (ns, to, path) in [
        // HBONE to a closed port of a mesh pod: the peer answers 503
        (&client_ns, SocketAddr::new(node.server.ip, 9999), "HBONE"),
        // passthrough to a destination outside the mesh that refuses
        (
            &client_ns,
            SocketAddr::new(node.outsider.ip, 9998),
            "passthrough",
        ),
        // a client outside the mesh to an enrolled pod's closed port (inbound plaintext, 15006)
        (
            &outsider_ns,
            SocketAddr::new(node.server.ip, 9997),
            "inbound plaintext",
        ),
    ] {
        assert_reset(ns, to, path);
    }
    node.wait_log(&["connection failed", "503"], Duration::from_secs(5));
}

/// A connection to `to` from `ns` is reset: at connect (when the proxy resets before connect
/// returns) or at the first read; never a clean end of stream.
fn assert_reset(ns: &Netns, to: SocketAddr, path: &str) {
    let Some(mut c) = common::connect_unless_reset(ns, to, path) else {
        return;
    };
    c.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    let mut buf = [0u8; 16];
    let r = c.read(&mut buf);
    assert!(
        r.as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{path}: the connection must be reset, got {r:?}"
    );
}

/// ztunnel's example policy (`examples/localhost.yaml`): in namespace `default`, allow every
/// destination port but 9999.
const ALLOW_BUT_9999: &str = "policies:
- name: deny-9999
  namespace: default
  scope: Namespace
  action: Allow
  rules:
  - - - notDestinationPorts: [9999]
";

#[test]
fn authorization_policies_reject_inbound_connections() {
    if !common::privileged("authorization_policies_reject_inbound_connections") {
        return;
    }
    let node = MeshNode::start_with(&common::prefix("e2p"), ALLOW_BUT_9999);
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");

    // allowed: port 8080 over HBONE
    let app = SocketAddr::new(node.server.ip, 8080);
    let echo = echo_once(&server_ns, app);
    let mut c = Lab::connect_from(&client_ns, app).expect("connect");
    c.write_all(b"allowed").expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    assert_eq!(back, b"allowed");
    echo.join().expect("echo thread");

    // denied: port 9999, over HBONE and in plaintext; the app never sees a connection
    let denied = SocketAddr::new(node.server.ip, 9999);
    let listener = Lab::listen_in(&server_ns, denied).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    // (client netns, source address, what the inbound line must also say)
    for (ns, src, extra) in [
        // over HBONE: the peer identity is known
        (
            &client_ns,
            node.client.ip,
            "src.identity=\"spiffe://cluster.local/ns/default/sa/alice\"",
        ),
        // plaintext through 15006
        (&outsider_ns, node.outsider.ip, "direction=\"inbound\""),
    ] {
        // refused with a reset: at connect (the proxy may reset before connect returns) or at
        // the first read; never data
        if let Some(mut c) = common::connect_unless_reset(ns, denied, "connect to the capture") {
            c.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let _ = c.write_all(b"denied");
            let mut back = Vec::new();
            let _ = c.read_to_end(&mut back);
            assert!(back.is_empty(), "denied connection got data: {back:?}");
        }
        node.wait_log(
            &[
                "direction=\"inbound\"",
                &format!("src.addr={src}"),
                "connection closed due to policy rejection: allow policies exist, but none allowed",
                extra,
            ],
            Duration::from_secs(5),
        );
    }
    // the client's proxy got the HBONE server's 401
    node.wait_log(
        &["direction=\"outbound\"", "answered 401 Unauthorized"],
        Duration::from_secs(5),
    );
    assert_eq!(
        listener.accept().map(|_| ()).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "the app must not see a denied connection"
    );
}

/// A service at VIP 10.249.0.200:80 (-> 8080 on the server) whose waypoint is the server pod
/// itself: an HBONE server that is not a real waypoint, so it refuses the CONNECT for the VIP.
const SERVICE_WITH_WAYPOINT: &str = "services:
- name: svc
  namespace: default
  hostname: svc.example
  vips: [\"/10.249.0.200\"]
  ports: {80: 8080}
  waypoint: {destination: \"/10.249.0.3\", hboneMtlsPort: 15008}
  endpoints:
    server: {workloadUid: cluster1//v1/Pod/default/server}
";

#[test]
fn service_traffic_goes_through_its_waypoint_never_around_it() {
    if !common::privileged("service_traffic_goes_through_its_waypoint_never_around_it") {
        return;
    }
    let node = MeshNode::start_with(&common::prefix("e2w"), SERVICE_WITH_WAYPOINT);
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    let listener = Lab::listen_in(&server_ns, app).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");

    let vip: SocketAddr = "10.249.0.200:80".parse().expect("vip");
    // refused with a reset: at connect (the proxy may reset before connect returns) or later
    if let Some(mut c) = common::connect_unless_reset(&client_ns, vip, "connect to the VIP") {
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let _ = c.write_all(b"to the service");
        let mut back = Vec::new();
        let _ = c.read_to_end(&mut back);
        assert!(back.is_empty(), "got data: {back:?}");
    }
    // the CONNECT went to the waypoint (the server's 15008) for the VIP, which refused it
    node.wait_log(
        &[
            "direction=\"outbound\"",
            "dst.addr=10.249.0.3:15008",
            "dst.hbone_addr=10.249.0.200:80",
            "HBONE CONNECT to 10.249.0.3:15008 answered 400",
        ],
        Duration::from_secs(5),
    );
    node.wait_log(
        &[
            "direction=\"inbound\"",
            "ip mismatch: 10.249.0.200 != 10.249.0.3",
        ],
        Duration::from_secs(5),
    );
    // and nothing reached the app behind the service directly
    assert_eq!(
        listener.accept().map(|_| ()).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "the waypoint was bypassed"
    );
}

/// The /64 of the v6 addresses the v6 test adds (`::1` on the bridge, the pods after it).
const V6_SUBNET: &str = "fd00:249::";

/// Gives `pod` `::<last octet of its v4>/64` (no DAD) in [`V6_SUBNET`]; returns that address.
fn add_v6(pod: &ztnode::lab::Pod) -> std::net::IpAddr {
    let std::net::IpAddr::V4(v4) = pod.ip else {
        panic!("v4 pod address expected");
    };
    let addr: std::net::IpAddr = format!("{V6_SUBNET}{}", v4.octets()[3])
        .parse()
        .expect("v6 address");
    let run = |ns: &str, args: &[&str]| {
        let out = std::process::Command::new("ip")
            .args(["-n", ns])
            .args(args)
            .output()
            .expect("ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(
        &pod.netns_name,
        &["addr", "add", &format!("{addr}/64"), "dev", "eth0", "nodad"],
    );
    addr
}

/// A v6 connection to an app that listens on v4 only is refused (RST), over HBONE and on the
/// inbound plaintext path, as it is without the mesh; a v6 app on the same pod is reached over
/// HBONE, with no plaintext on the bridge.
#[test]
fn v6_connection_to_a_v4_only_app_looks_refused() {
    if !common::privileged("v6_connection_to_a_v4_only_app_looks_refused") {
        return;
    }
    let node = MeshNode::start_with_args(&common::prefix("e26"), "", &["--ipv6"]);
    let bridge_ns = format!("{}-node", common::prefix("e26"));
    let out = std::process::Command::new("ip")
        .args(["-n", &bridge_ns, "addr", "add", &format!("{V6_SUBNET}1/64")])
        .args(["dev", &node.lab.bridge(), "nodad"])
        .output()
        .expect("ip");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client6 = add_v6(&node.client);
    let server6 = add_v6(&node.server);
    add_v6(&node.outsider);
    // the workloads get their v6 addresses (the node re-reads its config)
    let path = node.lab.dir().join("local-config.yaml");
    let base = std::fs::read_to_string(&path).expect("config");
    let yaml = base
        .replace(
            &format!("[\"{}\"]", node.client.ip),
            &format!("[\"{}\", \"{client6}\"]", node.client.ip),
        )
        .replace(
            &format!("[\"{}\"]", node.server.ip),
            &format!("[\"{}\", \"{server6}\"]", node.server.ip),
        );
    assert_ne!(yaml, base);
    let tmp = path.with_extension("yaml.new");
    std::fs::write(&tmp, yaml).expect("write config");
    std::fs::rename(&tmp, &path).expect("replace config");
    node.wait_log(&["local config reloaded"], Duration::from_secs(10));

    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let outsider_ns = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    let _v4_only =
        Lab::listen_in(&server_ns, SocketAddr::new(node.server.ip, 8080)).expect("listen");
    let v6_app = echo_once(&server_ns, SocketAddr::new(server6, 8081));

    let capture = common::capture::BridgeCapture::start(&node.lab, "v6");
    // control: v6 through the mesh works
    let secret = b"v6-secret-payload";
    let mut c = Lab::connect_from(&client_ns, SocketAddr::new(server6, 8081)).expect("connect v6");
    c.write_all(secret).expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    c.read_to_end(&mut back).expect("read echo");
    assert_eq!(back, secret);
    let (_, peer) = v6_app.join().expect("v6 app");
    assert_eq!(peer.ip(), client6, "the app sees the client's v6 address");

    let refused = SocketAddr::new(server6, 8080);
    assert_reset(&client_ns, refused, "HBONE over v6");
    assert_reset(&outsider_ns, refused, "inbound plaintext over v6");
    node.wait_log(
        &["connection failed", &refused.to_string()],
        Duration::from_secs(5),
    );
    let segs = capture.check(
        &[node.client.ip, client6, node.server.ip, server6],
        &[secret],
    );
    assert!(
        segs.iter()
            .any(|s| s.src == client6 && s.dst == server6 && s.dst_port == 15008),
        "the v6 connection went over HBONE between the pods' v6 addresses"
    );
}
