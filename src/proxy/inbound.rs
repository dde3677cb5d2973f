//! Inbound: the pod's HBONE server on 15008 and the plaintext capture on 15006.
//!
//! HBONE (`../shared/spec/ztunnel.md` §3): mTLS with a client certificate chained to our root and of
//! our trust domain, then HTTP/2 CONNECT streams. Each stream's `:authority` must name this pod's own
//! IP (the address 15008 was reached on) and a port outside 15001/15006/15008, else 400; then the
//! authorization policies must allow it ([`authz`], else 401); the app is dialled from the client's
//! IP (IP_TRANSPARENT) so it sees the real source; 200 only after that connect succeeded, 503
//! otherwise. Never an open proxy. Each HBONE connection is kept alive with HTTP/2 PINGs and owns
//! its streams ([`serve_streams`]). Plaintext connections are authorized without an identity.
//! Every stream and plaintext connection stays registered in the pod's live connections
//! ([`crate::proxy::live`]) while it is open, so a policy change that denies it closes it
//! ([`Revocable`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use h2::server::SendResponse;
use http::{Request, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::mesh::NEVER_TARGET_PORTS;
use crate::proxy::accesslog::ConnectionLog;
use crate::proxy::authz;
use crate::proxy::copy;
use crate::proxy::hbone::{self, CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT};
use crate::proxy::identity::Identity;
use crate::proxy::live::Revocable;
use crate::proxy::metrics::Direction;
use crate::proxy::metrics::labels::{self, ResponseFlags};
use crate::proxy::pod::PodProxy;
use crate::proxy::scope::TaskScope;
use crate::proxy::socket::{self, SocketError};
use crate::proxy::task::{self, ClientSide, Logged, ServerSide};

/// Why an inbound stream or connection was refused.
#[derive(Debug, thiserror::Error)]
pub enum InboundError {
    /// Not a CONNECT request.
    #[error("method {0} is not CONNECT")]
    Method(http::Method),
    /// Bad `:authority`.
    #[error(transparent)]
    Authority(#[from] hbone::AuthorityError),
    /// The CONNECT target is not this pod.
    #[error("ip mismatch: {0} != {1}")]
    IpMismatch(std::net::IpAddr, std::net::IpAddr),
    /// The CONNECT target is a proxy port.
    #[error("port {0} is not a valid target")]
    IllegalPort(u16),
    /// Connecting to the app failed.
    #[error("upstream: {0}")]
    Upstream(#[source] SocketError),
    /// TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(#[source] crate::proxy::tls::StreamError),
    /// HTTP/2 failed.
    #[error("HTTP/2: {0}")]
    H2(#[source] h2::Error),
    /// An authorization policy rejected the connection (ztunnel's wording).
    #[error("connection closed due to policy rejection: {0}")]
    Policy(#[from] authz::Denied),
}

/// Serves one HBONE connection (TLS + HTTP/2) accepted on 15008.
pub async fn handle_hbone(pod: Arc<PodProxy>, tcp: TcpStream, peer: SocketAddr) {
    let local = match tcp.local_addr() {
        Ok(a) => socket::canonical(a),
        Err(e) => {
            tracing::warn!(error = %e, "HBONE connection without local address");
            return;
        }
    };
    let peer = socket::canonical(peer);
    let accept = crate::proxy::tls::accept(pod.server_tls.clone(), tcp);
    let timed_out =
        || std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake timed out").into();
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept)
        .await
        .unwrap_or_else(|_| Err(timed_out()))
    {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(src.addr = %peer, error = %InboundError::Tls(e), "HBONE handshake refused");
            return;
        }
    };
    let peer_id = tls
        .peer_certificates()
        .and_then(crate::proxy::tls::peer_identity);
    let conn = match tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        hbone::server_builder().handshake::<_, Bytes>(tls),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Err(_) => {
            tracing::warn!(src.addr = %peer, "HBONE HTTP/2 handshake timed out");
            return;
        }
        Ok(Err(e)) => {
            tracing::warn!(src.addr = %peer, error = %InboundError::H2(e), "HBONE HTTP/2 handshake failed");
            return;
        }
    };
    let mut drain = pod.drain.clone();
    serve_streams(conn, peer, drain.started(), |req, respond| {
        // Checked here so the stream task keeps only the body, not the request head.
        let target = check_request(&req, local);
        let ends = Ends {
            peer,
            local,
            peer_id: peer_id.clone(),
        };
        stream(pod.clone(), target, req.into_body(), respond, ends)
    })
    .await;
}

/// Accepts the CONNECT streams of one HBONE connection and runs `on_stream` for each in a task of
/// a [`TaskScope`] owned here, so ending (or aborting) this future ends every stream of the
/// connection.
///
/// Sends a PING every 10 s and drops the connection (and its streams) when no PONG arrives within
/// 20 s, as ztunnel's server does (`../shared/spec/ztunnel.md` §3). When `drain` resolves (the
/// proxy shuts down) the connection is shut down gracefully, as ztunnel's server on drain: GOAWAY
/// (the client opens no new stream here), the open streams run on, and the connection closes
/// after the last one. After a close the streams are awaited: with the connection gone their
/// HTTP/2 halves fail fast, so they only finish their app side and access log.
pub async fn serve_streams<T, F, Fut>(
    mut conn: h2::server::Connection<T, Bytes>,
    peer: SocketAddr,
    drain: impl Future<Output = ()>,
    mut on_stream: F,
) where
    T: AsyncRead + AsyncWrite + Unpin,
    F: FnMut(Request<h2::RecvStream>, SendResponse<Bytes>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut streams = TaskScope::new();
    let keepalive = hbone::keepalive(conn.ping_pong());
    tokio::pin!(keepalive);
    tokio::pin!(drain);
    let mut draining = false;
    loop {
        tokio::select! {
            () = &mut drain, if !draining => {
                draining = true;
                tracing::debug!(src.addr = %peer, "draining: GOAWAY sent");
                conn.graceful_shutdown();
            }
            next = conn.accept() => match next {
                Some(Ok((req, respond))) => {
                    streams.spawn(on_stream(req, respond));
                }
                Some(Err(e)) => {
                    tracing::debug!(src.addr = %peer, error = %e, "HBONE connection ended");
                    break;
                }
                None => break,
            },
            () = &mut keepalive => {
                tracing::warn!(src.addr = %peer, "HBONE keepalive timed out, dropping connection");
                conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                return;
            }
        }
    }
    drop(conn);
    streams.wait_empty().await;
}

fn refuse(respond: &mut SendResponse<Bytes>, code: StatusCode) {
    let mut resp = Response::new(());
    *resp.status_mut() = code;
    let _ = respond.send_response(resp, true);
}

/// The two ends of an HBONE connection, as seen by its streams.
struct Ends {
    /// The client (HBONE peer) address.
    peer: SocketAddr,
    /// This pod's HBONE address.
    local: SocketAddr,
    /// The client's verified identity.
    peer_id: Option<Identity>,
}

/// Serves one CONNECT stream whose request was checked into `target` (see [`check_request`]) as a
/// [`task::run`] task.
fn stream(
    pod: Arc<PodProxy>,
    target: Result<SocketAddr, InboundError>,
    body: h2::RecvStream,
    respond: SendResponse<Bytes>,
    ends: Ends,
) -> impl Future<Output = ()> + Send + 'static {
    task::run(stream_setup(pod, target, body, respond, ends))
}

/// Everything before the relay: the app connect and the 200 (or the refusal, logged here).
async fn stream_setup(
    pod: Arc<PodProxy>,
    target: Result<SocketAddr, InboundError>,
    body: h2::RecvStream,
    mut respond: SendResponse<Bytes>,
    ends: Ends,
) -> Option<ServerSide<Revocable<copy::H2Relay>>> {
    let Ends {
        peer,
        local,
        peer_id,
    } = ends;
    let metrics = &pod.ctx.metrics;
    let mut log = ConnectionLog::new(metrics, Direction::Inbound, peer, local);
    describe(
        &pod,
        &mut log,
        peer,
        peer_id.as_ref(),
        *target.as_ref().unwrap_or(&local),
    );
    let target = match target {
        Ok(t) => t,
        Err(e) => {
            refuse(&mut respond, StatusCode::BAD_REQUEST);
            log.failed(metrics, ResponseFlags::Connect, &e);
            return None;
        }
    };
    log.set_hbone_target(target);
    log.opened();
    let conn = authz::Connection {
        src_identity: peer_id.as_ref(),
        src_ip: peer.ip(),
        dst: target,
    };
    // before the check, so that no policy change between the two is missed (see `live`)
    let registration = pod.live.register(&conn);
    if let Err(denied) = authorize(&pod, &conn) {
        refuse(&mut respond, StatusCode::UNAUTHORIZED);
        log.failed(
            metrics,
            ResponseFlags::Denied,
            &InboundError::Policy(denied),
        );
        return None;
    }
    let upstream = match pod
        .sockets
        .connect(target, Some(peer.ip()), CONNECT_TIMEOUT)
        .await
    {
        Ok(u) => u,
        Err(e) => {
            refuse(&mut respond, StatusCode::SERVICE_UNAVAILABLE);
            log.failed(metrics, ResponseFlags::Connect, &InboundError::Upstream(e));
            return None;
        }
    };
    let send = match respond.send_response(Response::new(()), false) {
        Ok(s) => s,
        Err(e) => {
            log.failed(metrics, ResponseFlags::H2, &InboundError::H2(e));
            return None;
        }
    };
    Some(Logged::new(
        pod.ctx.clone(),
        log,
        registration.revocable(copy::relay_h2(upstream, send, body)),
    ))
}

/// Labels `log` of a connection to this pod for `target` from `peer` (proving `peer_id`), from
/// the current state ([`labels::inbound`]).
fn describe(
    pod: &PodProxy,
    log: &mut ConnectionLog,
    peer: SocketAddr,
    peer_id: Option<&Identity>,
    target: SocketAddr,
) {
    let state = pod.ctx.state.load();
    let dest = pod.current_workload(&state);
    let (labels, src) = labels::inbound(&state, &dest, peer, peer_id, target);
    log.describe(&pod.ctx.metrics, labels, src, Some(dest));
}

/// [`authz::check`] against the current state, for this pod's workload as the state has it now
/// (its `authorizationPolicies` may have changed since the pod started).
fn authorize(pod: &PodProxy, conn: &authz::Connection<'_>) -> Result<(), authz::Denied> {
    let state = pod.ctx.state.load();
    authz::check_pod(&state, &pod.current_workload(&state), conn)
}

/// Validates a CONNECT request against the pod address `local`; returns the app address.
pub fn check_request<B>(req: &Request<B>, local: SocketAddr) -> Result<SocketAddr, InboundError> {
    if req.method() != http::Method::CONNECT {
        return Err(InboundError::Method(req.method().clone()));
    }
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str())
        .unwrap_or_default();
    let target = socket::canonical(hbone::parse_authority(authority)?);
    if target.ip() != local.ip() {
        return Err(InboundError::IpMismatch(target.ip(), local.ip()));
    }
    if NEVER_TARGET_PORTS.contains(&target.port()) {
        return Err(InboundError::IllegalPort(target.port()));
    }
    Ok(target)
}

/// Serves one plaintext connection captured on 15006 (from a client outside the mesh) as a
/// [`task::run`] task.
pub fn handle_plaintext(
    pod: Arc<PodProxy>,
    tcp: TcpStream,
    peer: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static {
    task::run(plaintext_setup(pod, tcp, peer))
}

/// A plaintext inbound relay.
type Plaintext = copy::TcpRelay;

/// Everything before the plaintext relay: original destination, the checks, the app connect.
async fn plaintext_setup(
    pod: Arc<PodProxy>,
    tcp: TcpStream,
    peer: SocketAddr,
) -> Option<ClientSide<Revocable<Plaintext>>> {
    let peer = socket::canonical(peer);
    let dst = match socket::original_dst(&tcp) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "inbound plaintext without original destination");
            socket::reset(tcp);
            return None;
        }
    };
    let metrics = &pod.ctx.metrics;
    let mut log = ConnectionLog::new(metrics, Direction::Inbound, peer, dst);
    describe(&pod, &mut log, peer, None, dst);
    if NEVER_TARGET_PORTS.contains(&dst.port()) {
        log.failed(
            metrics,
            ResponseFlags::Connect,
            &InboundError::IllegalPort(dst.port()),
        );
        socket::reset(tcp);
        return None;
    }
    // Only the pod itself is a valid target: never relay to other addresses (no open proxy).
    if !pod.ips.contains(&dst.ip()) {
        let own = pod.ips.first().copied().unwrap_or(dst.ip());
        log.failed(
            metrics,
            ResponseFlags::Connect,
            &InboundError::IpMismatch(dst.ip(), own),
        );
        socket::reset(tcp);
        return None;
    }
    log.opened();
    let conn = authz::Connection {
        src_identity: None,
        src_ip: peer.ip(),
        dst,
    };
    let registration = pod.live.register(&conn);
    if let Err(denied) = authorize(&pod, &conn) {
        log.failed(
            metrics,
            ResponseFlags::Denied,
            &InboundError::Policy(denied),
        );
        socket::reset(tcp);
        return None;
    }
    match pod
        .sockets
        .connect(dst, Some(peer.ip()), CONNECT_TIMEOUT)
        .await
    {
        Ok(upstream) => {
            let relay = copy::TcpRelay::new(tcp, upstream);
            Some(Logged::new(
                pod.ctx.clone(),
                log,
                registration.revocable(relay),
            ))
        }
        Err(e) => {
            log.failed(metrics, ResponseFlags::Connect, &InboundError::Upstream(e));
            socket::reset(tcp);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: http::Method, authority: &str) -> Request<()> {
        Request::builder()
            .method(method)
            .uri(authority)
            .body(())
            .expect("request")
    }

    #[test]
    fn hbone_stream_tasks_stay_small() {
        use crate::proxy::task::size::{MAX_TASK_FUTURE, returned5};
        let size = returned5(stream);
        assert!(
            size <= MAX_TASK_FUTURE,
            "inbound stream task future: {size} bytes"
        );
    }

    #[test]
    fn connect_checks() {
        let local: SocketAddr = "10.0.0.3:15008".parse().expect("addr");
        assert_eq!(
            check_request(&req(http::Method::CONNECT, "10.0.0.3:8080"), local).expect("ok"),
            "10.0.0.3:8080".parse().expect("addr")
        );
        assert!(matches!(
            check_request(&req(http::Method::CONNECT, "10.0.0.4:8080"), local),
            Err(InboundError::IpMismatch(..))
        ));
        for p in [15001, 15006, 15008] {
            let r = check_request(&req(http::Method::CONNECT, &format!("10.0.0.3:{p}")), local);
            assert!(
                matches!(r, Err(InboundError::IllegalPort(q)) if q == p),
                "{r:?}"
            );
        }
        assert!(matches!(
            check_request(&req(http::Method::GET, "http://10.0.0.3:80/"), local),
            Err(InboundError::Method(_))
        ));
    }

    type Sensors = tokio::sync::mpsc::UnboundedReceiver<tokio::sync::oneshot::Receiver<()>>;
    type ClientConn = h2::client::Connection<tokio::io::DuplexStream, Bytes>;

    /// An HBONE pair in memory. The server side runs [`serve_streams`] in a task; its stream
    /// handler answers 200 and then never finishes, holding a drop-sensor whose receiver it hands
    /// out through the returned channel.
    async fn pair() -> (
        h2::client::SendRequest<Bytes>,
        ClientConn,
        tokio::task::JoinHandle<()>,
        Sensors,
    ) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (sensors_tx, sensors) = tokio::sync::mpsc::unbounded_channel();
        let server = tokio::spawn(async move {
            let conn = hbone::server_builder()
                .handshake::<_, Bytes>(b)
                .await
                .expect("server handshake");
            let peer: SocketAddr = "10.0.0.2:40000".parse().expect("addr");
            serve_streams(
                conn,
                peer,
                std::future::pending(),
                move |_req, mut respond| {
                    let (alive, sensor) = tokio::sync::oneshot::channel::<()>();
                    let _ = sensors_tx.send(sensor);
                    async move {
                        let _alive = alive;
                        let _send = respond.send_response(Response::new(()), false);
                        std::future::pending::<()>().await
                    }
                },
            )
            .await
        });
        let (client, conn) = crate::proxy::hbone::client_builder()
            .handshake::<_, Bytes>(a)
            .await
            .expect("client handshake");
        (client, conn, server, sensors)
    }

    /// A drained connection: GOAWAY, so the client opens nothing new there, while its open stream
    /// carries on; the connection ends after that stream.
    #[tokio::test]
    async fn a_drained_connection_sends_goaway_and_closes_after_its_last_stream() {
        use std::time::Duration;
        let (a, b) = tokio::io::duplex(1 << 16);
        let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let conn = hbone::server_builder()
                .handshake::<_, Bytes>(b)
                .await
                .expect("server handshake");
            let peer: SocketAddr = "10.0.0.2:40000".parse().expect("addr");
            let drain = async {
                let _ = drain_rx.await;
            };
            serve_streams(conn, peer, drain, |req, mut respond| async move {
                let mut body = req.into_body();
                let Ok(mut send) = respond.send_response(Response::new(()), false) else {
                    return;
                };
                while let Some(Ok(chunk)) = body.data().await {
                    let _ = body.flow_control().release_capacity(chunk.len());
                    let _ = send.send_data(chunk, false);
                }
                let _ = send.send_data(Bytes::new(), true);
            })
            .await
        });
        let (client, conn) = crate::proxy::hbone::client_builder()
            .handshake::<_, Bytes>(a)
            .await
            .expect("client handshake");
        let driver = tokio::spawn(conn);
        let mut client = client.ready().await.expect("ready");
        let (resp, mut send) = client
            .send_request(req(http::Method::CONNECT, "10.0.0.3:8080"), false)
            .expect("send");
        let resp = resp.await.expect("response");
        assert_eq!(resp.status(), StatusCode::OK);
        let mut body = resp.into_body();
        drain_tx.send(()).expect("drain");
        // GOAWAY: a new stream fails (refused before or after it is sent)
        let refused = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let Ok(mut c) = client.clone().ready().await else {
                    return;
                };
                match c.send_request(req(http::Method::CONNECT, "10.0.0.3:8081"), true) {
                    Err(_) => return,
                    Ok((r, _)) => {
                        if r.await.is_err() {
                            return;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(refused.is_ok(), "no new stream after GOAWAY");
        // the open stream keeps flowing
        send.send_data(Bytes::from_static(b"still here"), false)
            .expect("data");
        let echoed = tokio::time::timeout(Duration::from_secs(5), body.data())
            .await
            .expect("echo in time")
            .expect("a chunk")
            .expect("data");
        assert_eq!(&echoed[..], b"still here");
        assert!(!server.is_finished(), "the connection waits for its stream");
        // the stream ends: the connection closes
        send.send_data(Bytes::new(), true).expect("end");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the drained connection closes after its last stream")
            .expect("server task");
        let _ = tokio::time::timeout(Duration::from_secs(5), driver).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_answering_pings_is_dropped_with_its_streams() {
        let (mut client, mut conn, server, mut sensors) = pair().await;
        let (resp, _send) = client
            .send_request(req(http::Method::CONNECT, "10.0.0.3:8080"), false)
            .expect("send");
        let resp = tokio::select! {
            r = resp => r.expect("response"),
            _ = &mut conn => panic!("client connection ended"),
        };
        assert_eq!(resp.status(), StatusCode::OK);
        let sensor = sensors.recv().await.expect("stream started");
        // From here on the client connection is never polled: PINGs get no PONG.
        tokio::time::timeout(std::time::Duration::from_secs(60), server)
            .await
            .expect("the server must give up on a silent peer")
            .expect("server task");
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), sensor).await;
        assert!(
            matches!(ended, Ok(Err(_))),
            "streams end with their connection: {ended:?}"
        );
        drop(conn);
    }

    #[tokio::test(start_paused = true)]
    async fn aborting_the_connection_task_ends_its_streams() {
        let (mut client, conn, server, mut sensors) = pair().await;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let (resp, _send) = client
            .send_request(req(http::Method::CONNECT, "10.0.0.3:8080"), false)
            .expect("send");
        assert_eq!(resp.await.expect("response").status(), StatusCode::OK);
        let sensor = sensors.recv().await.expect("stream started");
        server.abort();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), sensor).await;
        assert!(
            matches!(ended, Ok(Err(_))),
            "the stream task must end with its connection task: {ended:?}"
        );
        driver.abort();
    }
}
