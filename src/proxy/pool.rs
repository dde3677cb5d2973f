//! Pool of HBONE client connections of one pod.
//!
//! Keyed by (source identity, destination identity, destination HBONE address), as ztunnel's
//! `WorkloadKey` (`../shared/spec/ztunnel.md` §3 "Connection pool"). Many CONNECT streams share one
//! mTLS + HTTP/2 connection. The cap, [`PoolConfig::max_streams_per_connection`] (ztunnel
//! `POOL_MAX_STREAMS_PER_CONNECTION`, default 100, lowered to the peer's
//! `SETTINGS_MAX_CONCURRENT_STREAMS` when that is smaller, as ztunnel's `spawn_connection`), is on
//! the streams *open at once*: each stream holds a [`StreamLease`] on its connection until its
//! relay ends (ztunnel's `stream_count`, decremented by its `DropCounter`), so sequential traffic
//! keeps riding one connection and a new one is dialed only while all of a key's connections are
//! full. New streams go to the oldest connection with room, so extra connections empty out and
//! get released.
//!
//! Concurrent requests for a new key wait for a single dial (a per-key async mutex, as ztunnel's
//! `established_conn_writelock`), bounded by [`CONNECT_TIMEOUT`]. Each connection is kept alive
//! with HTTP/2 PINGs ([`keepalive`]) and dropped when no PONG comes back. A connection with no open
//! stream that no stream started or ended on for [`PoolConfig::unused_release_timeout`] (ztunnel
//! `POOL_UNUSED_RELEASE_TIMEOUT`, default 5 min; "idle" there is "no one has asked for it or
//! dropped it in X time") is released by [`Pool::sweep`], and a key left without connections is
//! pruned, so keys do not pile up with pod churn. Unlike ztunnel, a connection at the cap stays
//! pooled and takes new streams again once some of its streams ended (ztunnel's pool drops it for
//! good: "TODO: in the future, we can keep track of these and start to use them once they finish
//! some streams"), and one with open streams is not released.
//!
//! On shutdown [`Pool::drain`] lets go of every pooled connection (each closes once its open
//! streams ended) and from then on each stream gets a connection of its own, never pooled.
//!
//! [`Pool::send_request`] retries a CONNECT once on a fresh connection when the peer provably did
//! not process it (REFUSED_STREAM, or a GOAWAY that excludes the stream: RFC 9113 §8.7), which
//! covers a GOAWAY racing the pool's readiness check.

mod connector;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use h2::{RecvStream, SendStream};
use http::{Request, Response};
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::proxy::hbone::{CONNECT_TIMEOUT, MAX_STREAMS_PER_CONNECTION, client_builder, keepalive};
use crate::proxy::identity::Identity;
use crate::proxy::socket::SocketError;
use crate::proxy::tls::TlsError;

pub use connector::{Connector, PodConnector};

/// Default of [`PoolConfig::unused_release_timeout`] (ztunnel `POOL_UNUSED_RELEASE_TIMEOUT`,
/// 5 min).
pub const POOL_UNUSED_RELEASE_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// Longest interval between two [`Pool::sweep`]s of a pod's proxy (shorter release timeouts are
/// swept more often: [`PoolConfig::sweep_interval`]).
pub const POOL_SWEEP_INTERVAL: Duration = Duration::from_secs(30);
/// Shortest interval between two sweeps.
const MIN_SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// Settings of every pod's pool, from ztunnel's env ([`crate::proxy::istio_env::IstioEnv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Streams open at once on one connection before another one is dialed
    /// (`POOL_MAX_STREAMS_PER_CONNECTION`, default [`MAX_STREAMS_PER_CONNECTION`]); at least 1.
    pub max_streams_per_connection: usize,
    /// How long a connection without streams is kept (`POOL_UNUSED_RELEASE_TIMEOUT`, default
    /// [`POOL_UNUSED_RELEASE_TIMEOUT`]).
    pub unused_release_timeout: Duration,
    /// Whether an outbound connection to a pod's own HBONE port sends the app's first bytes with
    /// its CONNECT ([`Pool::send_request_with`]; `HBONE_EARLY_DATA`, a ztnode setting, default
    /// true).
    pub early_data: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_streams_per_connection: MAX_STREAMS_PER_CONNECTION,
            unused_release_timeout: POOL_UNUSED_RELEASE_TIMEOUT,
            early_data: true,
        }
    }
}

impl PoolConfig {
    /// How often a pod's proxy calls [`Pool::sweep`]: half the release timeout, within 100 ms ..
    /// [`POOL_SWEEP_INTERVAL`] (a connection goes at most that long after its timeout).
    pub fn sweep_interval(&self) -> Duration {
        (self.unused_release_timeout / 2).clamp(MIN_SWEEP_INTERVAL, POOL_SWEEP_INTERVAL)
    }
}

/// Errors getting a pooled HBONE connection.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// TCP connect to the peer failed (maybe a NetworkPolicy blocks 15008).
    #[error("connect to HBONE peer {addr}: {source}")]
    Connect {
        /// Peer HBONE address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: SocketError,
    },
    /// Building the TLS config failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The TLS handshake failed (peer identity, trust, protocol).
    #[error("TLS handshake with {addr}: {source}")]
    Handshake {
        /// Peer HBONE address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: crate::proxy::tls::StreamError,
    },
    /// The HTTP/2 handshake failed or the connection closed.
    #[error("HTTP/2 with {addr}: {source}")]
    H2 {
        /// Peer HBONE address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: h2::Error,
    },
    /// The CONNECT stream failed (after the one retry, if the peer refused it unprocessed).
    #[error("HBONE CONNECT to {addr}: {source}")]
    Stream {
        /// Peer HBONE address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: h2::Error,
    },
}

/// Pool key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// Our (source pod) identity.
    pub src: Identity,
    /// Expected peer identity.
    pub dst: Identity,
    /// Peer HBONE address (`ip:15008`).
    pub addr: SocketAddr,
}

/// An open CONNECT stream from [`Pool::send_request`].
#[derive(Debug)]
pub struct PooledStream {
    /// The peer's answer (any status) and the stream's data from the peer.
    pub response: Response<RecvStream>,
    /// The stream's data towards the peer.
    pub send: SendStream<Bytes>,
    /// The stream's place in its connection's cap: keep it until the stream's relay ends.
    pub lease: StreamLease,
}

/// What a pooled connection and the leases of its streams share.
#[derive(Debug)]
struct Usage {
    /// Streams open now (leases alive).
    open: AtomicUsize,
    /// When a stream last started or ended, in ms after `born`.
    last_active_ms: AtomicU64,
    born: Instant,
}

impl Usage {
    fn new() -> Usage {
        Usage {
            open: AtomicUsize::new(0),
            last_active_ms: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_active_ms.store(ms, Ordering::Release);
    }

    /// How long no stream has been open on it, `None` while one is.
    fn unused_for(&self, now: Instant) -> Option<Duration> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last = self.born + Duration::from_millis(self.last_active_ms.load(Ordering::Acquire));
        Some(now.saturating_duration_since(last))
    }
}

/// One open stream's hold on its pooled connection (ztunnel's `DropCounter`): counted in the
/// connection's open streams from checkout until dropped.
#[derive(Debug)]
pub struct StreamLease(Arc<Usage>);

impl StreamLease {
    /// Counts a new stream on `usage`.
    fn take(usage: &Arc<Usage>) -> StreamLease {
        usage.open.fetch_add(1, Ordering::AcqRel);
        usage.touch();
        StreamLease(usage.clone())
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        // The time first: a sweep that sees no open stream sees when the last one ended.
        self.0.touch();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A relay `F` holding its stream's [`StreamLease`] for as long as it runs.
#[derive(Debug)]
pub struct Leased<F> {
    relay: F,
    _lease: StreamLease,
}

impl<F> Leased<F> {
    /// `relay` holding `lease` until it is dropped.
    pub fn new(relay: F, lease: StreamLease) -> Leased<F> {
        Leased {
            relay,
            _lease: lease,
        }
    }
}

impl<F: crate::proxy::live::SoFar> crate::proxy::live::SoFar for Leased<F> {
    fn so_far(&self) -> crate::proxy::copy::Transferred {
        self.relay.so_far()
    }
}

impl<F: Future + Unpin> Future for Leased<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        Pin::new(&mut self.relay).poll(cx)
    }
}

#[derive(Debug)]
struct Conn {
    /// Pool-unique id, so a retry can tell a connection dialed meanwhile from the failed one.
    id: u64,
    sender: SendRequest<Bytes>,
    /// Open streams allowed at once: the configured cap, or the peer's limit when lower.
    max_streams: usize,
    usage: Arc<Usage>,
}

/// A key's connections, oldest first.
type Slot = Arc<AsyncMutex<Vec<Conn>>>;

/// The pool of one pod; `C` makes the transport connections (mTLS from the pod netns in
/// production, see [`PodConnector`]).
#[derive(Debug)]
pub struct Pool<C = PodConnector> {
    connector: C,
    config: PoolConfig,
    slots: std::sync::Mutex<foldhash::HashMap<PoolKey, Slot>>,
    next_id: AtomicU64,
    draining: AtomicBool,
}

// === impl Pool ===

impl Pool {
    /// An empty pool dialing mTLS from `sockets` with certificates from `certs`.
    pub fn new(
        sockets: crate::proxy::socket::PodSockets,
        certs: Arc<crate::proxy::identity::CertManager>,
        config: PoolConfig,
    ) -> Pool {
        Pool::with_connector(PodConnector::new(sockets, certs), config)
    }
}

impl<C: Connector> Pool<C> {
    /// An empty pool over `connector`.
    pub fn with_connector(connector: C, config: PoolConfig) -> Pool<C> {
        Pool {
            connector,
            config,
            slots: Default::default(),
            next_id: AtomicU64::new(1),
            draining: AtomicBool::new(false),
        }
    }

    /// Shutdown: forgets every pooled connection (each closes when its last open stream ends,
    /// nobody else holding it) and pools nothing from now on: each later stream dials a
    /// connection of its own, closed when that stream ends.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        let slots = std::mem::take(&mut *self.slots.lock().unwrap_or_else(|p| p.into_inner()));
        if !slots.is_empty() {
            tracing::debug!(keys = slots.len(), "HBONE pool drained");
        }
    }

    /// Sends the CONNECT `request` to `key` and waits for the response head. When the peer did
    /// not process the stream (REFUSED_STREAM, a GOAWAY excluding it, or a connection that went
    /// away before the request left) the request is sent once more on a fresh connection.
    ///
    /// Errors: [`PoolError::Stream`] when the stream failed (also after the retry), or the dial
    /// errors ([`PoolError::Connect`], [`PoolError::Tls`], [`PoolError::Handshake`],
    /// [`PoolError::H2`]). A non-200 status is returned as a response, not an error.
    pub async fn send_request(
        &self,
        key: &PoolKey,
        request: Request<()>,
    ) -> Result<PooledStream, PoolError> {
        self.send_request_with(key, request, None).await
    }

    /// [`send_request`](Self::send_request) with `early` data: the first bytes of the stream's
    /// body, sent right after the request head instead of after the response, so the peer can
    /// hand them to its app as soon as it connected (one round trip less before the app sees the
    /// client's first bytes; RFC 9113 §8.5 CONNECT puts no order between the response and the
    /// client's DATA). A retry sends them again on the fresh stream; a non-200 peer drops them.
    pub async fn send_request_with(
        &self,
        key: &PoolKey,
        request: Request<()>,
        early: Option<Bytes>,
    ) -> Result<PooledStream, PoolError> {
        let again = copy_head(&request);
        let (sender, lease, used) = self.checkout(key, None).await?;
        match send_once(sender, request, early.clone()).await {
            Ok((response, send)) => Ok(PooledStream {
                response,
                send,
                lease,
            }),
            Err(Failure::Unprocessed(e)) => {
                drop(lease);
                tracing::debug!(peer = %key.addr, error = %e, "HBONE stream not processed by the peer, retrying on a fresh connection");
                let (sender, lease, _) = self.checkout(key, Some(used)).await?;
                let (response, send) =
                    send_once(sender, again, early)
                        .await
                        .map_err(|f| PoolError::Stream {
                            addr: key.addr,
                            source: f.into_inner(),
                        })?;
                Ok(PooledStream {
                    response,
                    send,
                    lease,
                })
            }
            Err(Failure::Other(source)) => Err(PoolError::Stream {
                addr: key.addr,
                source,
            }),
        }
    }

    /// Releases connections without open streams that no stream started or ended on for
    /// [`PoolConfig::unused_release_timeout`], and prunes keys left without connections (also
    /// those whose dial failed); slots in use right now are skipped. A released connection
    /// closes (its last handle is gone). Returns the number of keys pruned.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let timeout = self.config.unused_release_timeout;
        let mut released = 0;
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let before = slots.len();
        slots.retain(|_, slot| {
            // Clones are only made under this lock, so a count of 1 means nobody waits on it.
            if Arc::strong_count(slot) > 1 {
                return true;
            }
            let Ok(mut conns) = slot.try_lock() else {
                return true;
            };
            let had = conns.len();
            conns.retain(|c| c.usage.unused_for(now).is_none_or(|d| d < timeout));
            released += had - conns.len();
            !conns.is_empty()
        });
        let pruned = before - slots.len();
        if released > 0 || pruned > 0 {
            tracing::debug!(
                released,
                pruned,
                kept = slots.len(),
                "released unused HBONE connections"
            );
        }
        pruned
    }

    /// Number of keys in the pool.
    pub fn len(&self) -> usize {
        self.slots.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// Whether the pool holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pool's settings.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Number of pooled connections of `key` (0 while the key is being checked out).
    #[cfg(test)]
    fn connections(&self, key: &PoolKey) -> usize {
        let slot = self.slots.lock().ok().and_then(|s| s.get(key).cloned());
        slot.and_then(|s| s.try_lock().ok().map(|c| c.len()))
            .unwrap_or(0)
    }

    /// A ready sender on the oldest of `key`'s connections with room for one more stream (those
    /// that went away are dropped on the way), else on a new one; with the stream's lease and the
    /// connection's id. With `avoid`, that connection (which just failed a stream unprocessed)
    /// leaves the pool first.
    async fn checkout(
        &self,
        key: &PoolKey,
        avoid: Option<u64>,
    ) -> Result<(SendRequest<Bytes>, StreamLease, u64), PoolError> {
        if self.draining.load(Ordering::Acquire) {
            let (sender, _) = self.dial_timed(key).await?;
            let ready = sender.ready().await.map_err(|source| PoolError::H2 {
                addr: key.addr,
                source,
            })?;
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            return Ok((ready, StreamLease::take(&Arc::new(Usage::new())), id));
        }
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            match slots.get(key) {
                Some(slot) => slot.clone(),
                None => slots.entry(key.clone()).or_default().clone(),
            }
        };
        let mut conns = slot.lock().await;
        if let Some(avoid) = avoid {
            conns.retain(|c| c.id != avoid);
        }
        let mut i = 0;
        while let Some(conn) = conns.get(i) {
            if conn.usage.open.load(Ordering::Acquire) >= conn.max_streams {
                i += 1;
                continue;
            }
            match conn.sender.clone().ready().await {
                Ok(ready) => return Ok((ready, StreamLease::take(&conn.usage), conn.id)),
                // GOAWAY or closed: no new stream can go there
                Err(_) => {
                    conns.remove(i);
                }
            }
        }
        let (sender, max_streams) = self.dial_timed(key).await?;
        let ready = sender
            .clone()
            .ready()
            .await
            .map_err(|source| PoolError::H2 {
                addr: key.addr,
                source,
            })?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let usage = Arc::new(Usage::new());
        let lease = StreamLease::take(&usage);
        conns.push(Conn {
            id,
            sender,
            max_streams,
            usage,
        });
        Ok((ready, lease, id))
    }

    /// [`Pool::dial`] within [`CONNECT_TIMEOUT`].
    async fn dial_timed(&self, key: &PoolKey) -> Result<(SendRequest<Bytes>, usize), PoolError> {
        match tokio::time::timeout(CONNECT_TIMEOUT, self.dial(key)).await {
            Ok(r) => r,
            Err(_) => Err(PoolError::Connect {
                addr: key.addr,
                source: SocketError::Io {
                    op: format!("HBONE handshake with {}", key.addr),
                    source: std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"),
                },
            }),
        }
    }

    /// A new connection to `key` and its stream cap: the configured one, or the peer's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` when lower, as h2 knows it right after the handshake
    /// (ztunnel's `spawn_connection` does the same; h2 queues streams beyond a limit the peer
    /// announces later).
    async fn dial(&self, key: &PoolKey) -> Result<(SendRequest<Bytes>, usize), PoolError> {
        let io = self.connector.connect(key).await?;
        let cap = self.config.max_streams_per_connection.max(1);
        let (sender, mut conn) = client_builder()
            .initial_max_send_streams(cap)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|source| PoolError::H2 {
                addr: key.addr,
                source,
            })?;
        let max_streams = cap.min(conn.max_concurrent_send_streams()).max(1);
        let ping = conn.ping_pong();
        let addr = key.addr;
        tokio::spawn(async move {
            tokio::select! {
                res = &mut conn => if let Err(e) = res {
                    tracing::debug!(peer = %addr, error = %e, "HBONE connection ended");
                },
                () = keepalive(ping) => tracing::warn!(peer = %addr, "HBONE keepalive timed out, dropping connection"),
            }
        });
        tracing::debug!(peer = %addr, src = %key.src, dst = %key.dst, max_streams, "HBONE connection established");
        Ok((sender, max_streams))
    }
}

/// Why one CONNECT attempt failed.
enum Failure {
    /// The peer did not process the stream: safe to send again.
    Unprocessed(h2::Error),
    /// Anything else.
    Other(h2::Error),
}

impl Failure {
    fn into_inner(self) -> h2::Error {
        match self {
            Failure::Unprocessed(e) | Failure::Other(e) => e,
        }
    }
}

async fn send_once(
    mut sender: SendRequest<Bytes>,
    request: Request<()>,
    early: Option<Bytes>,
) -> Result<(Response<RecvStream>, SendStream<Bytes>), Failure> {
    // A synchronous failure means the request never left: the connection got a GOAWAY or died
    // between the readiness check and now.
    let (resp, mut send) = sender.send_request(request, false).map_err(|e| {
        if e.is_go_away() || e.is_io() || e.reason() == Some(h2::Reason::REFUSED_STREAM) {
            Failure::Unprocessed(e)
        } else {
            Failure::Other(e)
        }
    })?;
    if let Some(data) = early {
        // Queued behind the HEADERS frame (h2 holds it until the stream's window allows; early
        // data is one small read). A failure here shows in the response future below.
        let _ = send.send_data(data, false);
    }
    match resp.await {
        Ok(r) => Ok((r, send)),
        Err(e) if unprocessed(&e) => Err(Failure::Unprocessed(e)),
        Err(e) => Err(Failure::Other(e)),
    }
}

/// Whether a stream error proves the peer did not process the stream (RFC 9113 §8.7): it refused
/// the stream, or its GOAWAY named a last stream id below ours.
fn unprocessed(e: &h2::Error) -> bool {
    e.reason() == Some(h2::Reason::REFUSED_STREAM) || (e.is_go_away() && e.is_remote())
}

/// A copy of a body-less request's head (method, URI, version, headers).
fn copy_head(req: &Request<()>) -> Request<()> {
    let mut copy = Request::new(());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    copy
}

#[cfg(test)]
mod tests;
