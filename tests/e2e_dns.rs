//! End to end: the in-pod DNS proxy. `ztnode node --dns-capture` in a lab node, a fake upstream
//! resolver in the node netns (on the bridge gateway, named by a resolv.conf given with
//! `--dns-resolv-conf`), and an enrolled pod whose DNS goes to an address where nobody listens:
//! only the capture (port 53 → 15053) and the proxy make it answer.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::node::MeshNode;
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, SRV, TXT};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// The bridge gateway in the node netns: where the fake upstream listens.
const UPSTREAM: Ipv4Addr = Ipv4Addr::new(10, 249, 0, 1);
/// The pod's nameserver: an address on the pods' subnet that nobody has.
const POD_NAMESERVER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 249, 0, 53)), 53);
/// The external name's address in the fake upstream's answer (TEST-NET-1: data only).
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

const SERVICES: &str = "services:
- name: svc
  namespace: default
  hostname: svc.default.svc.cluster.local
  vips: [\"/10.249.0.200\"]
  ports: {80: 8080}
";

/// What the fake upstream saw: (source address, transport, query bytes, answer bytes).
type Seen = Arc<Mutex<Vec<(SocketAddr, &'static str, Vec<u8>, Vec<u8>)>>>;

/// The fake upstream's answer to `query` (`tcp`: over TCP): an A for `www.external.test`, an SRV
/// for `_http._tcp.svc.default.svc.cluster.local`, NOERROR for any UPDATE, and for
/// `big.external.test` TXT records of ~3 KB over TCP but only TC over UDP.
fn upstream_answer(query: &[u8], tcp: bool) -> Option<Vec<u8>> {
    let q = Message::from_vec(query).ok()?;
    let mut a = Message::response(q.metadata.id, q.metadata.op_code);
    a.metadata.recursion_desired = q.metadata.recursion_desired;
    a.metadata.recursion_available = true;
    a.add_queries(q.queries.iter().cloned());
    let question = q.queries.first()?;
    let name = question.name().clone();
    match (
        q.metadata.op_code,
        question.query_type(),
        name.to_ascii().as_str(),
    ) {
        (OpCode::Update, _, _) => {}
        (OpCode::Query, RecordType::A, "www.external.test.") => {
            a.add_answer(Record::from_rdata(name, 60, RData::A(A(EXTERNAL_IP))));
        }
        (OpCode::Query, RecordType::SRV, "_http._tcp.svc.default.svc.cluster.local.") => {
            let target = Name::from_ascii("svc.default.svc.cluster.local.").ok()?;
            a.add_answer(Record::from_rdata(
                name,
                60,
                RData::SRV(SRV::new(0, 100, 80, target)),
            ));
        }
        (OpCode::Query, RecordType::TXT, "big.external.test.") if !tcp => {
            a.metadata.truncation = true;
        }
        (OpCode::Query, RecordType::TXT, "big.external.test.") => {
            for i in 0..30 {
                let text = format!("{i:02}{}", "x".repeat(98));
                a.add_answer(Record::from_rdata(
                    name.clone(),
                    60,
                    RData::TXT(TXT::new(vec![text])),
                ));
            }
        }
        _ => a.metadata.response_code = ResponseCode::NXDomain,
    }
    a.to_vec().ok()
}

/// Serves the fake upstream on `UPSTREAM:53` (UDP and TCP) inside `ns` until the test ends.
fn start_upstream(ns: &Netns) -> Seen {
    let addr = SocketAddr::new(IpAddr::V4(UPSTREAM), 53);
    let (udp, tcp) = ns
        .run(move || (UdpSocket::bind(addr), TcpListener::bind(addr)))
        .expect("enter node netns");
    let (udp, tcp) = (udp.expect("bind udp 53"), tcp.expect("bind tcp 53"));
    let seen: Seen = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok((n, peer)) = udp.recv_from(&mut buf) {
            if let Some(a) = upstream_answer(&buf[..n], false) {
                // recorded before answering: the test reads the record once it has the answer
                if let Ok(mut s) = log.lock() {
                    s.push((peer, "udp", buf[..n].to_vec(), a.clone()));
                }
                let _ = udp.send_to(&a, peer);
            }
        }
    });
    let log = seen.clone();
    std::thread::spawn(move || {
        for mut s in tcp.incoming().flatten() {
            let peer = s.peer_addr().expect("peer");
            while let Some(q) = read_frame(&mut s) {
                let Some(a) = upstream_answer(&q, true) else {
                    break;
                };
                if let Ok(mut l) = log.lock() {
                    l.push((peer, "tcp", q, a.clone()));
                }
                if write_frame(&mut s, &a).is_err() {
                    break;
                }
            }
        }
    });
    seen
}

fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len).ok()?;
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut msg).ok()?;
    Some(msg)
}

fn write_frame(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<()> {
    let mut framed = u16::try_from(msg.len())
        .expect("size")
        .to_be_bytes()
        .to_vec();
    framed.extend_from_slice(msg);
    s.write_all(&framed)
}

fn query(id: u16, name: &str, t: RecordType) -> Vec<u8> {
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).expect("name"), t));
    m.to_vec().expect("encode")
}

/// A UDP exchange with the pod's nameserver from inside the pod.
fn ask_udp(pod: &Netns, msg: &[u8]) -> Vec<u8> {
    ask_udp_at(pod, POD_NAMESERVER, msg)
}

/// A UDP exchange with `server` from inside the pod.
fn ask_udp_at(pod: &Netns, server: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let local: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().expect("addr")
    } else {
        "[::]:0".parse().expect("addr")
    };
    let sock = pod
        .run(move || UdpSocket::bind(local))
        .expect("enter pod")
        .expect("bind");
    sock.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    sock.send_to(msg, server).expect("send");
    let mut buf = vec![0u8; 65535];
    let n = sock
        .recv(&mut buf)
        .expect("an answer over UDP from the pod's nameserver address");
    buf.truncate(n);
    buf
}

/// A TCP exchange with the pod's nameserver from inside the pod.
fn ask_tcp(pod: &Netns, msg: &[u8]) -> Vec<u8> {
    ask_tcp_at(pod, POD_NAMESERVER, msg)
}

/// A TCP exchange with `server` from inside the pod.
fn ask_tcp_at(pod: &Netns, server: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let mut s = Lab::connect_from(pod, server).expect("connect over TCP");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write_frame(&mut s, msg).expect("write");
    read_frame(&mut s).expect("an answer over TCP")
}

fn decode(raw: &[u8]) -> Message {
    Message::from_vec(raw).expect("a DNS message")
}

/// `/metrics` of the node (its metrics endpoint in the node netns).
fn node_metrics(node: &MeshNode) -> String {
    let addr: SocketAddr = "127.0.0.1:15020".parse().expect("addr");
    let mut s = Lab::connect_from(node.lab.node(), addr).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("response");
    body
}

#[test]
fn a_captured_pods_dns_is_served_by_the_proxy_and_forwarded_from_the_pod() {
    if !common::privileged("a_captured_pods_dns_is_served_by_the_proxy_and_forwarded_from_the_pod")
    {
        return;
    }
    let conf_dir = tempfile::tempdir().expect("tempdir");
    let resolv = conf_dir.path().join("resolv.conf");
    std::fs::write(
        &resolv,
        format!("nameserver {UPSTREAM}\noptions timeout:2\n"),
    )
    .expect("write");
    let resolv_arg = resolv.to_string_lossy().into_owned();
    let node = MeshNode::start_with_args(
        &common::prefix("e2dns"),
        SERVICES,
        &["--dns-capture", "--dns-resolv-conf", &resolv_arg],
    );
    let rules = MeshNode::ruleset(&node.client);
    assert!(
        rules.contains("redirect to :15053"),
        "DNS capture rules:\n{rules}"
    );
    node.wait_log(&["in-pod DNS proxy on port 15053"], Duration::from_secs(5));
    let seen = start_upstream(node.lab.node());
    let pod = Netns::open(&node.client.netns_path).expect("client netns");

    // a mesh service by its short name and by its FQDN: the VIP, from the proxy itself
    for (id, name) in [(1, "svc."), (2, "svc.default.svc.cluster.local.")] {
        let a = decode(&ask_udp(&pod, &query(id, name, RecordType::A)));
        assert_eq!(a.metadata.id, id);
        assert!(a.metadata.authoritative, "{name}: answered by the mesh");
        let ips: Vec<IpAddr> = a.answers.iter().filter_map(|r| r.data.ip_addr()).collect();
        assert_eq!(ips, vec![IpAddr::from([10, 249, 0, 200])], "{name}");
    }
    // its other family: NOERROR, nothing
    let aaaa = decode(&ask_udp(&pod, &query(3, "svc.", RecordType::AAAA)));
    assert_eq!(aaaa.metadata.response_code, ResponseCode::NoError);
    assert!(aaaa.answers.is_empty());
    assert!(
        seen.lock().expect("seen").is_empty(),
        "mesh names stay local"
    );

    // an external name: forwarded, the upstream's answer byte for byte
    let ext = query(4, "www.external.test.", RecordType::A);
    let got = ask_udp(&pod, &ext);
    let ips: Vec<IpAddr> = decode(&got)
        .answers
        .iter()
        .filter_map(|r| r.data.ip_addr())
        .collect();
    assert_eq!(ips, vec![IpAddr::V4(EXTERNAL_IP)]);
    {
        let seen = seen.lock().expect("seen");
        let (peer, transport, q, a) = seen.last().expect("the upstream saw the query");
        assert_eq!(
            (q, a, *transport),
            (&ext, &got, "udp"),
            "bytes unchanged both ways"
        );
        assert_eq!(
            peer.ip(),
            node.client.ip,
            "upstream query sent from the pod's netns"
        );
    }

    // an UPDATE: forwarded and answered by the upstream, not refused
    let mut update = Message::new(5, MessageType::Query, OpCode::Update);
    update.add_query(Query::query(
        Name::from_ascii("external.test.").expect("name"),
        RecordType::SOA,
    ));
    let update = decode(&ask_udp(&pod, &update.to_vec().expect("encode")));
    assert_eq!(update.metadata.op_code, OpCode::Update);
    assert_eq!(update.metadata.response_code, ResponseCode::NoError);

    // SRV of a mesh service: forwarded (the mesh answers addresses only)
    let srv = decode(&ask_udp(
        &pod,
        &query(
            6,
            "_http._tcp.svc.default.svc.cluster.local.",
            RecordType::SRV,
        ),
    ));
    assert!(
        matches!(srv.answers.first().map(|r| &r.data), Some(RData::SRV(s)) if s.port == 80),
        "{srv:?}"
    );

    // a large answer: TC over UDP, the whole of it over TCP (forwarded over TCP)
    let big = query(7, "big.external.test.", RecordType::TXT);
    let cut = decode(&ask_udp(&pod, &big));
    assert!(cut.metadata.truncation, "TC passed on");
    let full_raw = ask_tcp(&pod, &big);
    assert!(full_raw.len() > 512);
    assert_eq!(decode(&full_raw).answers.len(), 30);
    {
        let seen = seen.lock().expect("seen");
        let (peer, transport, _, a) = seen.last().expect("TCP query seen");
        assert_eq!((*transport, a), ("tcp", &full_raw));
        assert_eq!(peer.ip(), node.client.ip);
    }
    // a mesh name over TCP too
    let tcp_a = decode(&ask_tcp(&pod, &query(8, "svc.default.", RecordType::A)));
    assert_eq!(tcp_a.answers.len(), 1);
    // the IPv6 localhost listeners, asked directly (the lab's pods are IPv4: no v6 capture)
    let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 15053);
    for answer in [
        ask_udp_at(&pod, v6, &query(9, "svc.", RecordType::A)),
        ask_tcp_at(&pod, v6, &query(9, "svc.", RecordType::A)),
    ] {
        let ips: Vec<IpAddr> = decode(&answer)
            .answers
            .iter()
            .filter_map(|r| r.data.ip_addr())
            .collect();
        assert_eq!(
            ips,
            vec![IpAddr::from([10, 249, 0, 200])],
            "via [::1]:15053"
        );
    }

    let metrics = node_metrics(&node);
    for needle in [
        "istio_dns_requests_total{request_query_type=\"a\",request_protocol=\"udp\"",
        "istio_dns_requests_total{request_query_type=\"txt\",request_protocol=\"tcp\"",
        "istio_dns_upstream_requests_total{request_query_type=\"srv\",request_protocol=\"udp\"",
        "istio_dns_upstream_request_duration_seconds_count{request_query_type=\"soa\"",
    ] {
        assert!(metrics.contains(needle), "{needle} in\n{metrics}");
    }
}
