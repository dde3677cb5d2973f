//! Outbound: connections the pod's app opens, captured on 15001.
//!
//! The original destination (SO_ORIGINAL_DST) picks the path ([`route`]): a service VIP resolves
//! to its waypoint or to one of its endpoints (service port mapped to the target port); a
//! destination workload with protocol HBONE gets an HBONE CONNECT to `<pod ip>:15008` (or to its
//! waypoint) with `:authority` = `<pod ip>:<port>`; anything else (unknown IP, protocol TCP) is
//! passed through as plain TCP. Loopback self-calls to the proxy ports are refused.

use std::future::Future;
use std::net::SocketAddr;

use std::sync::Arc;

use futures::future::Either;
use tokio::net::TcpStream;

use crate::mesh::NEVER_TARGET_PORTS;
use crate::proxy::accesslog::ConnectionLog;
use crate::proxy::copy;
use crate::proxy::hbone::{self, CONNECT_TIMEOUT};
use crate::proxy::metrics::Direction;
use crate::proxy::metrics::labels::{self, ResponseFlags};
use crate::proxy::pod::PodProxy;
use crate::proxy::pool::{Leased, PoolError, PoolKey, PooledStream};
use crate::proxy::route::{self, RouteError};
use crate::proxy::task::{self, ClientSide, Logged};

/// Errors of one outbound connection.
#[derive(Debug, thiserror::Error)]
pub enum OutboundError {
    /// The app connected to a proxy port on loopback or on its own IP.
    #[error("refusing self-call to proxy port {0}")]
    SelfCall(SocketAddr),
    /// Reading the original destination failed.
    #[error("original destination: {0}")]
    OrigDst(#[source] std::io::Error),
    /// No HBONE connection.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The CONNECT request failed.
    #[error("HBONE CONNECT to {0}: {1}")]
    Connect(SocketAddr, #[source] h2::Error),
    /// The peer answered the CONNECT with a non-200 status.
    #[error("HBONE CONNECT to {0} answered {1}")]
    Status(SocketAddr, http::StatusCode),
    /// Passthrough connect failed.
    #[error(transparent)]
    Socket(#[from] crate::proxy::socket::SocketError),
    /// No route (a service without endpoints, an unresolvable waypoint).
    #[error(transparent)]
    Route(#[from] RouteError),
    /// Building the request failed.
    #[error("bad request: {0}")]
    Request(#[source] http::Error),
    /// Reading the app's first bytes failed (it reset the connection before it was set up).
    #[error("reading the app's first bytes: {0}")]
    Early(#[source] std::io::Error),
}

impl OutboundError {
    /// The `response_flags` of a connection that failed so.
    pub fn flags(&self) -> ResponseFlags {
        match self {
            OutboundError::Pool(PoolError::Tls(_) | PoolError::Handshake { .. }) => {
                ResponseFlags::Tls
            }
            OutboundError::Pool(PoolError::H2 { .. }) => ResponseFlags::H2,
            _ => ResponseFlags::Connect,
        }
    }
}

/// A passthrough relay (boxed: the rare path must not size every HBONE task).
type Passthrough = copy::TcpRelay;

/// The relay an outbound connection keeps once set up; an HBONE relay holds its stream's place in
/// the pool's per-connection cap until it ends.
type Relay = ClientSide<Either<Leased<copy::H2Relay>, Passthrough>>;

/// Serves one captured outbound connection to the end (a [`task::run`] task).
pub fn handle(
    pod: Arc<PodProxy>,
    tcp: TcpStream,
    client: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static {
    task::run(setup(pod, tcp, client))
}

/// Everything before the relay: original destination, routing, the HBONE CONNECT or the
/// passthrough connect. Failures are logged here and the app's connection reset (`None`).
async fn setup(pod: Arc<PodProxy>, tcp: TcpStream, client: SocketAddr) -> Option<Relay> {
    let dst = match crate::proxy::socket::original_dst(&tcp) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %OutboundError::OrigDst(e), "outbound connection dropped");
            crate::proxy::socket::reset(tcp);
            return None;
        }
    };
    let client = crate::proxy::socket::canonical(client);
    let metrics = &pod.ctx.metrics;
    let mut log = ConnectionLog::new(metrics, Direction::Outbound, client, dst);
    if NEVER_TARGET_PORTS.contains(&dst.port())
        && (dst.ip().is_loopback() || pod.ips.contains(&dst.ip()))
    {
        log.failed(
            metrics,
            ResponseFlags::Connect,
            &OutboundError::SelfCall(dst),
        );
        crate::proxy::socket::reset(tcp);
        return None;
    }
    let state = pod.ctx.state.load();
    let src = pod.current_workload(&state);
    let route = match route::route(&state, &src, dst, client) {
        Ok(r) => r,
        Err(e) => {
            // what is known: the source and the service dialled
            let none = route::Route {
                target: dst,
                hbone: None,
            };
            let (labels, _) = labels::outbound(&state, &src, &pod.identity, dst, &none);
            log.describe(metrics, labels, Some(src.clone()), None);
            log.failed(metrics, ResponseFlags::Connect, &OutboundError::Route(e));
            crate::proxy::socket::reset(tcp);
            return None;
        }
    };
    let mut route = route;
    if route.hbone.is_none() {
        route.hbone = pod.local_hbone(&state, route.target);
    }
    let (labels, dest) = labels::outbound(&state, &src, &pod.identity, dst, &route);
    log.describe(metrics, labels, Some(src), dest);
    drop(state);
    let target = route.target;
    match &route.hbone {
        Some(h) => {
            log.set_dst(h.addr);
            log.set_hbone_target(h.authority);
        }
        None => log.set_dst(target),
    }
    log.opened();
    let relay = match route.hbone {
        Some(hbone) => {
            let key = PoolKey {
                src: pod.identity.clone(),
                dst: hbone.identity,
                addr: hbone.addr,
            };
            // Only to a pod's own HBONE port: a waypoint (Envoy) may refuse a CONNECT whose data
            // came before its response (`reject_connect_request_early_data`).
            let early = if pod.pool.config().early_data && hbone.addr.ip() == hbone.authority.ip() {
                match copy::early_data(&tcp) {
                    Ok(early) => early,
                    Err(e) => {
                        log.failed(metrics, ResponseFlags::Connect, &OutboundError::Early(e));
                        crate::proxy::socket::reset(tcp);
                        return None;
                    }
                }
            } else {
                None
            };
            let early_len = early.as_ref().map_or(0, |b| b.len() as u64);
            let connect = connect_hbone(
                &pod,
                key,
                client,
                hbone.authority,
                hbone.service_host.as_deref(),
                early,
            );
            match connect.await {
                Ok(PooledStream {
                    response,
                    send,
                    lease,
                }) => Either::Left(Leased::new(
                    copy::relay_h2(tcp, send, response.into_body()).with_sent(early_len),
                    lease,
                )),
                Err(e) => {
                    log.failed(metrics, e.flags(), &e);
                    crate::proxy::socket::reset(tcp);
                    return None;
                }
            }
        }
        None => match pod.sockets.connect(target, None, CONNECT_TIMEOUT).await {
            Ok(upstream) => {
                let relay: Passthrough = copy::TcpRelay::new(tcp, upstream);
                Either::Right(relay)
            }
            Err(e) => {
                log.failed(metrics, ResponseFlags::Connect, &OutboundError::Socket(e));
                crate::proxy::socket::reset(tcp);
                return None;
            }
        },
    };
    Some(Logged::new(pod.ctx.clone(), log, relay))
}

async fn connect_hbone(
    pod: &PodProxy,
    key: PoolKey,
    client: SocketAddr,
    target: SocketAddr,
    service_host: Option<&str>,
    early: Option<bytes::Bytes>,
) -> Result<PooledStream, OutboundError> {
    let req =
        hbone::connect_request(target, client, service_host).map_err(OutboundError::Request)?;
    // The pool retries once on a fresh connection when the peer refused the stream unprocessed.
    let stream = pod
        .pool
        .send_request_with(&key, req, early)
        .await
        .map_err(|e| match e {
            PoolError::Stream { addr, source } => OutboundError::Connect(addr, source),
            e => OutboundError::Pool(e),
        })?;
    let status = stream.response.status();
    if status != http::StatusCode::OK {
        return Err(OutboundError::Status(key.addr, status));
    }
    Ok(stream)
}
