//! The in-pod DNS proxy on 15053 (ztunnel's DNS proxy, spec ztunnel.md §2 and §7;
//! istio-cni.md §4.4 for the redirect).
//!
//! Inside every enrolled pod the proxy serves DNS on `127.0.0.1:15053` and, when the pod has it,
//! `[::1]:15053`, over UDP and TCP. With DNS capture on (`AMBIENT_DNS_CAPTURE` / `--dns-capture`,
//! or the pod's `ambient.istio.io/dns-capture` annotation) the agent's in-pod rules redirect the
//! app's UDP and TCP port 53 here; without it nothing arrives and the listeners cost two sockets.
//! The handoff (ZDS `WorkloadInfo`) does not say whether a pod's DNS is captured, so, as ztunnel
//! does with its DNS proxy on, every pod gets the listeners.
//!
//! A standard query (one question, class IN) for A or AAAA whose name is a mesh host for the pod
//! ([`names`]: service hostnames with the pod's search domains, wildcards, workload hostnames) is
//! answered here with the VIPs ([`message`]). Everything else (other types such as SRV, other
//! opcodes such as UPDATE and NOTIFY, names the mesh does not know, messages that do not decode)
//! is forwarded byte for byte to the node's upstream resolvers ([`resolv`], read once at start)
//! from the pod's netns with the packet mark ([`forward`]), and the answer comes back as it is:
//! EDNS, TC and all. ztunnel answers opcodes other than QUERY with NOTIMP; ztnode forwards them,
//! so a pod's dynamic updates keep working as without the mesh.
//!
//! Every request is counted in [`metrics`] with ztunnel's names.

pub mod forward;
pub mod message;
pub mod metrics;
pub mod names;
pub mod resolv;
pub mod shared;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

use crate::mesh::DNS_PORT;
use crate::proxy::pod::PodProxy;
use crate::proxy::socket::{PodSockets, SocketError};

use message::Request;
use metrics::{DnsLabels, Transport};
pub use resolv::{ResolvConfError, Upstreams};
pub use shared::{DEFAULT_CLUSTER_DOMAIN, DEFAULT_RESOLV_CONF, DnsOptions, DnsProxy};

/// A TCP client connection idle this long is closed (with its upstream connection).
const TCP_IDLE: Duration = Duration::from_secs(10);
/// UDP requests of one listener handled at once; more wait in the socket's buffer.
const MAX_UDP_IN_FLIGHT: usize = 256;
/// TCP client connections of one listener at once; more are closed on accept.
const MAX_TCP_CONNECTIONS: usize = 64;

/// A pod's bound DNS sockets (see [`bind`]).
#[derive(Debug)]
pub struct PodDns {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
}

/// Binds UDP and TCP 15053 on `127.0.0.1` (required) and `[::1]` (when the pod's lo has it) in the
/// pod netns, with the packet mark.
pub async fn bind(sockets: &PodSockets) -> Result<PodDns, SocketError> {
    let mut out = PodDns {
        udp: Vec::new(),
        tcp: Vec::new(),
    };
    for ip in [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ] {
        let addr = SocketAddr::new(ip, DNS_PORT);
        let bound = async {
            let udp = sockets.udp_bind(addr).await?;
            let tcp = sockets.listen_at(addr).await?;
            Ok::<_, SocketError>((udp, tcp))
        };
        match bound.await {
            Ok((udp, tcp)) => {
                out.udp.push(udp);
                out.tcp.push(tcp);
            }
            Err(e) if ip.is_ipv6() => {
                tracing::debug!(error = %e, "no DNS proxy on [::1] (no IPv6 on lo)")
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Serves `listeners` for `pod` until aborted (requests in flight go with it).
pub async fn serve(pod: Arc<PodProxy>, dns: Arc<DnsProxy>, listeners: PodDns) {
    let mut tasks = JoinSet::new();
    for sock in listeners.udp {
        tasks.spawn(serve_udp(pod.clone(), dns.clone(), Arc::new(sock)));
    }
    for l in listeners.tcp {
        tasks.spawn(serve_tcp(pod.clone(), dns.clone(), l));
    }
    while tasks.join_next().await.is_some() {}
}

/// What to do with one request.
enum Outcome {
    /// Send these bytes back.
    Reply(Vec<u8>),
    /// Forward the request's bytes upstream.
    Forward(Request),
    /// Nothing to reply to (shorter than a header).
    Drop,
}

/// Decides about `raw` from `pod` over `transport`, and counts it.
fn decide(
    pod: &PodProxy,
    dns: &DnsProxy,
    raw: &[u8],
    transport: Transport,
) -> (Outcome, Option<DnsLabels>) {
    let Some(req) = Request::parse(raw) else {
        return (Outcome::Drop, None);
    };
    let labels = DnsLabels {
        query_type: req.query_type_label(),
        protocol: transport,
        canonical_service: pod.workload.canonical_name.clone(),
        canonical_revision: pod.workload.canonical_revision.clone(),
    };
    pod.ctx.metrics.dns.request(&labels);
    if req.is_response {
        let reply = message::error_reply(raw, &req, ResponseCode::FormErr);
        return (Outcome::Reply(reply), Some(labels));
    }
    let Some((q, v6, found)) = req.query().and_then(|q| {
        let v6 = message::address_query(q)?;
        let name = message::lowercase_labels(q.name())?;
        let found =
            dns.index(&pod.ctx.state)
                .find(&name, &pod.workload.namespace, &dns.cluster_domain)?;
        Some((q, v6, found))
    }) else {
        return (Outcome::Forward(req), Some(labels));
    };
    let addrs = found.addresses(&pod.workload, v6);
    let cname = found.stripped_labels.filter(|_| !found.wildcard);
    let max_len = (transport == Transport::Udp).then(|| req.max_udp_payload());
    let reply = match message::answer(&req, q, cname, &addrs, max_len) {
        Ok(reply) => {
            tracing::debug!(target: "dns", name = %q.name(), query = %q.query_type(), endpoints = addrs.len(), result = "success");
            reply
        }
        Err(e) => {
            tracing::warn!(target: "dns", name = %q.name(), error = %e, "answer failed");
            message::error_reply(raw, &req, ResponseCode::ServFail)
        }
    };
    (Outcome::Reply(reply), Some(labels))
}

/// Receives datagrams on `sock` and answers each from its own task.
async fn serve_udp(pod: Arc<PodProxy>, dns: Arc<DnsProxy>, sock: Arc<UdpSocket>) {
    let in_flight = Arc::new(Semaphore::new(MAX_UDP_IN_FLIGHT));
    let mut requests = JoinSet::new();
    let mut buf = vec![0u8; forward::MAX_MESSAGE];
    loop {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        tokio::select! {
            r = sock.recv_from(&mut buf) => match r {
                Ok((n, client)) => {
                    let raw = buf[..n].to_vec();
                    let (pod, dns, sock) = (pod.clone(), dns.clone(), sock.clone());
                    requests.spawn(async move {
                        if let Some(reply) = udp_request(&pod, &dns, &raw).await
                            && let Err(e) = sock.send_to(&reply, client).await
                        {
                            tracing::debug!(target: "dns", %client, error = %e, "reply not sent");
                        }
                        drop(permit);
                    });
                }
                Err(e) => {
                    tracing::debug!(target: "dns", error = %e, "udp receive");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = requests.join_next(), if !requests.is_empty() => {}
        }
    }
}

/// The reply to one UDP request, if any.
async fn udp_request(pod: &PodProxy, dns: &DnsProxy, raw: &[u8]) -> Option<Vec<u8>> {
    let (outcome, labels) = decide(pod, dns, raw, Transport::Udp);
    match outcome {
        Outcome::Reply(reply) => Some(reply),
        Outcome::Drop => None,
        Outcome::Forward(req) => {
            let labels = labels?;
            let metrics = &pod.ctx.metrics.dns;
            metrics.upstream_request(&labels);
            let start = Instant::now();
            let res = forward::udp(&pod.sockets, dns.upstreams(), raw).await;
            metrics.upstream_duration(&labels, start.elapsed());
            Some(match res {
                Ok(answer) => {
                    tracing::debug!(target: "dns", id = req.id, op = %req.op_code, bytes = answer.len(), result = "forwarded");
                    answer
                }
                Err(e) => {
                    metrics.upstream_failure(&labels);
                    tracing::debug!(target: "dns", id = req.id, error = %e, result = "forwarding failed");
                    message::error_reply(raw, &req, ResponseCode::ServFail)
                }
            })
        }
    }
}

/// Accepts TCP clients on `l`.
async fn serve_tcp(pod: Arc<PodProxy>, dns: Arc<DnsProxy>, l: TcpListener) {
    let conns = Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS));
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            r = l.accept() => match r {
                Ok((stream, client)) => match conns.clone().try_acquire_owned() {
                    Ok(permit) => {
                        tasks.spawn(tcp_connection(pod.clone(), dns.clone(), stream, permit));
                    }
                    Err(_) => tracing::debug!(target: "dns", %client, "too many DNS TCP connections; closed"),
                },
                Err(e) => {
                    tracing::debug!(target: "dns", error = %e, "tcp accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

/// Forwarded TCP requests waiting for their answer: id → (sent at, labels).
/// The queries one upstream TCP connection carries and has not answered, and whether its relay
/// ended: whoever removes a query from here answers it (the relay with the upstream's answer or
/// SERVFAIL, the request loop by sending it again on a new connection).
#[derive(Default)]
struct InFlight {
    queries: HashMap<u16, PendingQuery>,
    /// The relay ended: nothing more is answered on this connection.
    ended: bool,
}

type Pending = Arc<Mutex<InFlight>>;

/// A query forwarded over TCP and not answered yet.
struct PendingQuery {
    sent: Instant,
    labels: DnsLabels,
    /// The SERVFAIL the client gets if the upstream connection ends first.
    servfail: Vec<u8>,
}

/// The client's writing half, shared by the request loop and the upstream relay.
type ClientWriter = Arc<tokio::sync::Mutex<OwnedWriteHalf>>;

/// An upstream TCP connection of one client connection, the task relaying its answers, and the
/// queries it carries.
struct Upstream {
    writer: OwnedWriteHalf,
    relay: AbortOnDrop,
    pending: Pending,
}

/// A task aborted when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One TCP client connection: each message is answered here or written to the connection's
/// upstream TCP connection, whose answers (any number, in any order: RFC 7766 §6.2.1.1) a relay
/// task copies back. When the client is done the upstream gets a FIN and `timeout` to answer.
async fn tcp_connection(
    pod: Arc<PodProxy>,
    dns: Arc<DnsProxy>,
    stream: TcpStream,
    _permit: tokio::sync::OwnedSemaphorePermit,
) {
    let (mut reader, writer) = stream.into_split();
    let writer: ClientWriter = Arc::new(tokio::sync::Mutex::new(writer));
    let mut upstream: Option<Upstream> = None;
    let metrics = &pod.ctx.metrics.dns;
    loop {
        let raw = match tokio::time::timeout(TCP_IDLE, forward::read_frame(&mut reader)).await {
            Ok(Ok(Some(raw))) => raw,
            _ => break,
        };
        let (outcome, labels) = decide(&pod, &dns, &raw, Transport::Tcp);
        let reply = match (outcome, labels) {
            (Outcome::Reply(reply), _) => reply,
            (Outcome::Forward(req), Some(labels)) => {
                metrics.upstream_request(&labels);
                let query = PendingQuery {
                    sent: Instant::now(),
                    labels: labels.clone(),
                    servfail: message::error_reply(&raw, &req, ResponseCode::ServFail),
                };
                match send_upstream(&pod, &dns, &mut upstream, &writer, &raw, req.id, query).await {
                    Ok(()) => continue,
                    Err((e, query)) => {
                        metrics.upstream_failure(&labels);
                        tracing::debug!(target: "dns", id = req.id, error = %e, result = "forwarding failed");
                        query.servfail
                    }
                }
            }
            _ => continue,
        };
        if forward::write_frame(&mut *writer.lock().await, &reply)
            .await
            .is_err()
        {
            break;
        }
    }
    if let Some(mut up) = upstream.take() {
        let _ = up.writer.shutdown().await;
        let _ = tokio::time::timeout(dns.upstreams().timeout, &mut up.relay.0).await;
        let mut in_flight = lock(&up.pending);
        in_flight.ended = true;
        for (_, q) in in_flight.queries.drain() {
            metrics.upstream_failure(&q.labels);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes query `id` (`raw`) to the client connection's upstream connection, (re)connecting first
/// when there is none or its relay ended; one more connection is tried if the write fails. The
/// query is registered with the connection before it is written, so its answer (or SERVFAIL,
/// when the connection ends first) comes from that connection's relay, exactly once: a query the
/// relay already answered is not sent again. Errors: no connection took it; the query is handed
/// back for the caller's SERVFAIL.
async fn send_upstream(
    pod: &Arc<PodProxy>,
    dns: &DnsProxy,
    upstream: &mut Option<Upstream>,
    client: &ClientWriter,
    raw: &[u8],
    id: u16,
    mut query: PendingQuery,
) -> Result<(), (forward::ForwardError, PendingQuery)> {
    for _ in 0..2 {
        if upstream.as_ref().is_none_or(|u| lock(&u.pending).ended) {
            let stream = match forward::tcp_connect(&pod.sockets, dns.upstreams()).await {
                Ok(s) => s,
                Err(e) => return Err((e, query)),
            };
            let (reader, writer) = stream.into_split();
            let pending = Pending::default();
            let relay = tokio::spawn(relay_answers(
                pod.clone(),
                reader,
                client.clone(),
                pending.clone(),
            ));
            *upstream = Some(Upstream {
                writer,
                relay: AbortOnDrop(relay),
                pending,
            });
        }
        let Some(up) = upstream.as_mut() else {
            continue;
        };
        {
            let mut in_flight = lock(&up.pending);
            if in_flight.ended {
                // the relay ended after the check above: connect again
                drop(in_flight);
                *upstream = None;
                continue;
            }
            in_flight.queries.insert(id, query);
        }
        if let Err(e) = forward::write_frame(&mut up.writer, raw).await {
            let Some(q) = lock(&up.pending).queries.remove(&id) else {
                // the relay answered it (SERVFAIL: its connection ended) meanwhile
                return Ok(());
            };
            tracing::debug!(target: "dns", error = %e, "upstream TCP write; reconnecting");
            query = q;
            *upstream = None;
            continue;
        }
        return Ok(());
    }
    Err((
        forward::ForwardError::NoAnswer(dns.upstreams().servers.clone()),
        query,
    ))
}

/// Copies the upstream's answers to the client as they come, timing the requests they answer.
/// When the upstream connection ends (or breaks) first, every query still waiting on it gets
/// SERVFAIL (counted as an upstream failure) rather than no answer at all.
async fn relay_answers(
    pod: Arc<PodProxy>,
    mut upstream: tokio::net::tcp::OwnedReadHalf,
    client: ClientWriter,
    pending: Pending,
) {
    while let Ok(Some(answer)) = forward::read_frame(&mut upstream).await {
        if let Some(id) = answer.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]))
            && let Some(q) = lock(&pending).queries.remove(&id)
        {
            pod.ctx
                .metrics
                .dns
                .upstream_duration(&q.labels, q.sent.elapsed());
        }
        tracing::debug!(target: "dns", bytes = answer.len(), result = "forwarded");
        if forward::write_frame(&mut *client.lock().await, &answer)
            .await
            .is_err()
        {
            lock(&pending).ended = true;
            return;
        }
    }
    let unanswered: Vec<PendingQuery> = {
        let mut in_flight = lock(&pending);
        in_flight.ended = true;
        in_flight.queries.drain().map(|(_, q)| q).collect()
    };
    for q in unanswered {
        pod.ctx.metrics.dns.upstream_failure(&q.labels);
        tracing::debug!(target: "dns", result = "upstream connection ended before the answer");
        if forward::write_frame(&mut *client.lock().await, &q.servfail)
            .await
            .is_err()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
