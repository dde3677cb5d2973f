//! The DNS proxy end to end in the test's own netns: a pod's listeners on ephemeral localhost
//! ports, a fake upstream on another, raw DNS messages in and out.

use std::net::SocketAddr;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, RecordType};
use tokio::net::{TcpStream, UdpSocket};

use super::*;
use crate::mesh::PacketMark;
use crate::netns::Netns;
use crate::proxy::config::parse_local_config;
use crate::proxy::identity::{Ca, CertManager};
use crate::proxy::metrics::Metrics;
use crate::proxy::pod::ProxyContext;
use crate::proxy::pool::Pool;
use crate::proxy::state::{ProxyState, StateHandle};

const MESH: &str = "workloads:\n\
    - {uid: c1, name: client, namespace: ns1, serviceAccount: alice, workloadIps: [\"10.0.0.2\"], canonicalName: client}\n\
    services:\n\
    - {name: svc, namespace: ns1, hostname: svc.ns1.svc.cluster.local, vips: [\"/10.1.0.1\"]}\n";

/// A running pod DNS proxy on ephemeral localhost ports forwarding to `upstream`.
struct Harness {
    udp: SocketAddr,
    tcp: SocketAddr,
    ctx: Arc<ProxyContext>,
    _task: AbortOnDrop,
}

async fn harness(upstream: Vec<SocketAddr>) -> Harness {
    let cfg = parse_local_config(MESH).expect("config");
    let state = StateHandle::new(ProxyState::from_config(&cfg).expect("state"));
    let workload = state
        .load()
        .workload_by_name("ns1", "client")
        .expect("workload");
    let certs = CertManager::new(
        Ca::load_or_generate(None).expect("CA"),
        Duration::from_secs(3600),
    );
    let up = Upstreams {
        timeout: Duration::from_millis(500),
        attempts: 1,
        ..Upstreams::new(upstream)
    };
    let dns = Arc::new(DnsProxy::new(up, "cluster.local"));
    let ctx = Arc::new(ProxyContext {
        state,
        certs: certs.clone(),
        metrics: Metrics::default(),
        mark: PacketMark::DEFAULT,
        pool: crate::proxy::pool::PoolConfig::default(),
        local: Default::default(),
        dns: Some(dns.clone()),
        trust_domain: "cluster.local".into(),
    });
    let sockets =
        PodSockets::new(&Netns::current().expect("netns"), PacketMark::DEFAULT).expect("sockets");
    let identity = workload.identity();
    certs.ensure(&identity).await.expect("cert");
    let pod = Arc::new(PodProxy {
        ctx: ctx.clone(),
        ips: workload.workload_ips.clone(),
        identity: identity.clone(),
        workload,
        pool: Pool::new(
            sockets.clone(),
            certs.clone(),
            crate::proxy::pool::PoolConfig::default(),
        ),
        live: Arc::default(),
        server_tls: crate::proxy::tls::server_config(certs, identity).expect("tls"),
        sockets: sockets.clone(),
        drain: crate::proxy::drain::DrainWatch::never(),
    });
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let listeners = PodDns {
        udp: vec![sockets.udp_bind(any).await.expect("udp")],
        tcp: vec![sockets.listen_at(any).await.expect("tcp")],
    };
    let udp = listeners.udp[0].local_addr().expect("addr");
    let tcp = listeners.tcp[0].local_addr().expect("addr");
    Harness {
        udp,
        tcp,
        ctx,
        _task: AbortOnDrop(tokio::spawn(serve(pod, dns, listeners))),
    }
}

fn query(id: u16, name: &str, t: RecordType) -> Vec<u8> {
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).expect("name"), t));
    m.to_vec().expect("encode")
}

async fn ask_udp(server: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let c = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    c.send_to(msg, server).await.expect("send");
    let mut buf = vec![0u8; 65535];
    let n = tokio::time::timeout(Duration::from_secs(3), c.recv(&mut buf))
        .await
        .expect("answer in time")
        .expect("recv");
    buf.truncate(n);
    buf
}

async fn ask_tcp(server: SocketAddr, msgs: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut s = TcpStream::connect(server).await.expect("connect");
    for m in msgs {
        forward::write_frame(&mut s, m).await.expect("write");
    }
    let mut out = Vec::new();
    for _ in msgs {
        let f = tokio::time::timeout(Duration::from_secs(3), forward::read_frame(&mut s))
            .await
            .expect("answer in time")
            .expect("read");
        out.push(f.expect("a frame"));
    }
    out
}

/// A fake upstream: answers every UDP datagram with `udp_answer(query)` and every TCP frame with
/// `tcp_answer(query)`; returns its (UDP, TCP) addresses (same port).
async fn fake_upstream(
    udp_answer: fn(&[u8]) -> Vec<u8>,
    tcp_answer: fn(&[u8]) -> Vec<u8>,
) -> SocketAddr {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = tcp.local_addr().expect("addr");
    let udp = UdpSocket::bind(addr)
        .await
        .expect("bind udp on the same port");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65535];
        while let Ok((n, peer)) = udp.recv_from(&mut buf).await {
            let _ = udp.send_to(&udp_answer(&buf[..n]), peer).await;
        }
    });
    tokio::spawn(async move {
        while let Ok((mut s, _)) = tcp.accept().await {
            tokio::spawn(async move {
                while let Ok(Some(q)) = forward::read_frame(&mut s).await {
                    if forward::write_frame(&mut s, &tcp_answer(&q)).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// `q` turned into a response with `trailer` appended (bytes the proxy cannot have made up).
fn echo(q: &[u8], tc: bool, trailer: &[u8]) -> Vec<u8> {
    let mut a = q.to_vec();
    a[2] |= 0x80 | if tc { 0x02 } else { 0 };
    a.extend_from_slice(trailer);
    a
}

#[tokio::test]
async fn mesh_names_are_answered_with_vips_and_everything_else_is_forwarded_unchanged() {
    let up = fake_upstream(|q| echo(q, false, b"udp"), |q| echo(q, false, b"tcp")).await;
    let h = harness(vec![up]).await;

    // a mesh service by its short name: the VIP, authoritative
    let a =
        Message::from_vec(&ask_udp(h.udp, &query(1, "svc.", RecordType::A)).await).expect("decode");
    assert_eq!(a.metadata.id, 1);
    assert!(a.metadata.authoritative);
    assert_eq!(
        a.answers
            .iter()
            .filter_map(|r| r.data.ip_addr())
            .collect::<Vec<_>>(),
        vec!["10.1.0.1".parse::<IpAddr>().expect("ip")]
    );
    // the family it has not: NOERROR, no answers
    let aaaa =
        Message::from_vec(&ask_udp(h.udp, &query(2, "svc.ns1.svc.", RecordType::AAAA)).await)
            .expect("decode");
    assert_eq!(aaaa.metadata.response_code, ResponseCode::NoError);
    assert!(aaaa.answers.is_empty());

    // an external name, an SRV for a mesh name, an UPDATE: the upstream's bytes, id kept
    let ext = query(3, "www.example.org.", RecordType::A);
    assert_eq!(ask_udp(h.udp, &ext).await, echo(&ext, false, b"udp"));
    let srv = query(4, "_http._tcp.svc.ns1.svc.cluster.local.", RecordType::SRV);
    assert_eq!(ask_udp(h.udp, &srv).await, echo(&srv, false, b"udp"));
    let mut update = Message::new(5, MessageType::Query, OpCode::Update);
    update.add_query(Query::query(
        Name::from_ascii("example.org.").expect("name"),
        RecordType::SOA,
    ));
    let update = update.to_vec().expect("encode");
    assert_eq!(ask_udp(h.udp, &update).await, echo(&update, false, b"udp"));
    // with EDNS: forwarded as is (the OPT record included)
    let mut m = Message::from_vec(&query(6, "edns.example.org.", RecordType::TXT)).expect("m");
    m.set_edns(Edns::new());
    let edns = m.to_vec().expect("encode");
    assert_eq!(ask_udp(h.udp, &edns).await, echo(&edns, false, b"udp"));

    // over TCP: local and forwarded answers on one connection, the forwarded one over TCP
    let answers = ask_tcp(h.tcp, &[query(7, "svc.ns1.", RecordType::A), ext.clone()]).await;
    let mut by_id: HashMap<u16, Vec<u8>> = answers
        .into_iter()
        .map(|a| (u16::from_be_bytes([a[0], a[1]]), a))
        .collect();
    let forwarded = by_id.remove(&3).expect("forwarded answer");
    assert_eq!(forwarded, echo(&ext, false, b"tcp"));
    let local = Message::from_vec(&by_id.remove(&7).expect("local answer")).expect("decode");
    assert_eq!(local.answers.len(), 1);

    let text = h.ctx.metrics.render();
    let labels = |t: &str, p: &str| {
        format!(
            "{{request_query_type=\"{t}\",request_protocol=\"{p}\",\
             source_canonical_service=\"client\",source_canonical_revision=\"unknown\"}}"
        )
    };
    for (line, want) in [
        (format!("istio_dns_requests_total{}", labels("a", "udp")), 2),
        (format!("istio_dns_requests_total{}", labels("a", "tcp")), 2),
        (
            format!("istio_dns_upstream_requests_total{}", labels("a", "udp")),
            1,
        ),
        (
            format!("istio_dns_upstream_requests_total{}", labels("srv", "udp")),
            1,
        ),
        (
            format!("istio_dns_upstream_requests_total{}", labels("soa", "udp")),
            1,
        ),
        (
            format!("istio_dns_upstream_requests_total{}", labels("a", "tcp")),
            1,
        ),
    ] {
        assert!(
            text.contains(&format!("{line} {want}\n")),
            "{line} {want} in\n{text}"
        );
    }
    assert!(
        !text.contains("istio_dns_upstream_failures_total{"),
        "{text}"
    );
}

#[tokio::test]
async fn a_truncated_udp_answer_is_passed_on_and_the_tcp_retry_gets_the_full_one() {
    let up = fake_upstream(|q| echo(q, true, b""), |q| echo(q, false, &[7u8; 3000])).await;
    let h = harness(vec![up]).await;
    let q = query(9, "big.example.org.", RecordType::TXT);
    let cut = ask_udp(h.udp, &q).await;
    assert_eq!(cut, echo(&q, true, b""), "TC passed on");
    let full = ask_tcp(h.tcp, std::slice::from_ref(&q)).await;
    assert_eq!(full, vec![echo(&q, false, &[7u8; 3000])]);
}

#[tokio::test]
async fn no_upstream_answer_is_servfail_and_counted() {
    // a port nobody serves: UDP gets refused, TCP too
    let closed = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = closed.local_addr().expect("addr");
    drop(closed);
    let h = harness(vec![addr]).await;
    for reply in [
        ask_udp(h.udp, &query(11, "gone.example.org.", RecordType::A)).await,
        ask_tcp(h.tcp, &[query(11, "gone.example.org.", RecordType::A)])
            .await
            .remove(0),
    ] {
        let m = Message::from_vec(&reply).expect("decode");
        assert_eq!(m.metadata.id, 11);
        assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(m.queries.len(), 1, "question echoed");
    }
    let text = h.ctx.metrics.render();
    assert!(
        text.contains(
            "istio_dns_upstream_failures_total{request_query_type=\"a\",request_protocol=\"udp\""
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "istio_dns_upstream_failures_total{request_query_type=\"a\",request_protocol=\"tcp\""
        ),
        "{text}"
    );
}

#[tokio::test]
async fn a_response_sent_as_a_request_gets_formerr_and_runts_are_dropped() {
    let h = harness(vec![]).await;
    let mut q = query(12, "svc.", RecordType::A);
    q[2] |= 0x80;
    let m = Message::from_vec(&ask_udp(h.udp, &q).await).expect("decode");
    assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
    let c = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    c.send_to(&[1, 2, 3], h.udp).await.expect("send");
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(200), c.recv(&mut buf))
            .await
            .is_err(),
        "no reply to a runt"
    );
}

#[tokio::test]
async fn a_tcp_upstream_that_closes_with_queries_pending_gets_them_servfail() {
    // reads two queries, then closes without answering
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = upstream.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = upstream.accept().await {
            for _ in 0..2 {
                let _ = forward::read_frame(&mut s).await;
            }
        }
    });
    let h = harness(vec![addr]).await;
    let asked = [
        query(21, "one.example.org.", RecordType::A),
        query(22, "two.example.org.", RecordType::AAAA),
    ];
    let mut ids: Vec<u16> = ask_tcp(h.tcp, &asked)
        .await
        .iter()
        .map(|reply| {
            let m = Message::from_vec(reply).expect("decode");
            assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
            m.metadata.id
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, [21, 22]);
    let text = h.ctx.metrics.render();
    assert!(
        text.contains(
            "istio_dns_upstream_failures_total{request_query_type=\"aaaa\",request_protocol=\"tcp\""
        ),
        "{text}"
    );
}
