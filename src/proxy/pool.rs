//! Pool of HBONE client connections of one pod.
//!
//! Keyed by (source identity, destination identity, destination HBONE address), as ztunnel's
//! `WorkloadKey` (`../shared/spec/ztunnel.md` §3 "Connection pool"). Many CONNECT streams share one
//! mTLS + HTTP/2 connection; after [`MAX_STREAMS_PER_CONNECTION`] streams a new connection is
//! dialed. Concurrent requests for a new key wait for a single dial, bounded by [`CONNECT_TIMEOUT`].
//! Each connection is kept alive with HTTP/2 PINGs ([`keepalive`]) and dropped when no PONG comes
//! back. A connection no stream was requested on for [`POOL_UNUSED_RELEASE_TIMEOUT`] is released by
//! [`Pool::sweep`] and its key pruned, so keys do not pile up with pod churn. [`Pool::send_request`] retries a CONNECT once on a fresh
//! connection when the peer provably did not process it (REFUSED_STREAM, or a GOAWAY that excludes
//! the stream: RFC 9113 §8.7), which covers a GOAWAY racing the pool's readiness check.

mod connector;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// A pooled connection no new stream was requested on for this long is released (ztunnel
/// `POOL_UNUSED_RELEASE_TIMEOUT`, default 5 min). Streams still running on it are not cut.
pub const POOL_UNUSED_RELEASE_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// How often a pod's proxy calls [`Pool::sweep`].
pub const POOL_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

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

#[derive(Debug)]
struct Conn {
    /// Pool-unique id, so a retry can tell a connection replaced meanwhile from the failed one.
    id: u64,
    sender: SendRequest<Bytes>,
    streams: usize,
    last_used: Instant,
}

type Slot = Arc<AsyncMutex<Option<Conn>>>;

/// The pool of one pod; `C` makes the transport connections (mTLS from the pod netns in
/// production, see [`PodConnector`]).
#[derive(Debug)]
pub struct Pool<C = PodConnector> {
    connector: C,
    slots: std::sync::Mutex<HashMap<PoolKey, Slot>>,
    next_id: AtomicU64,
}

// === impl Pool ===

impl Pool {
    /// An empty pool dialing mTLS from `sockets` with certificates from `certs`.
    pub fn new(
        sockets: crate::proxy::socket::PodSockets,
        certs: Arc<crate::proxy::identity::CertManager>,
    ) -> Pool {
        Pool::with_connector(PodConnector::new(sockets, certs))
    }
}

impl<C: Connector> Pool<C> {
    /// An empty pool over `connector`.
    pub fn with_connector(connector: C) -> Pool<C> {
        Pool {
            connector,
            slots: Default::default(),
            next_id: AtomicU64::new(1),
        }
    }

    /// A ready sender for one new stream to `key`, dialing if needed.
    pub async fn sender(&self, key: &PoolKey) -> Result<SendRequest<Bytes>, PoolError> {
        Ok(self.checkout(key, None).await?.0)
    }

    /// Sends the CONNECT `request` to `key` and waits for the response head. When the peer did
    /// not process the stream (REFUSED_STREAM, a GOAWAY excluding it, or a connection that went
    /// away before the request left) the request is sent once more on a fresh connection.
    ///
    /// Errors: [`PoolError::Stream`] when the stream failed (also after the retry), or the dial
    /// errors of [`Pool::sender`]. A non-200 status is returned as a response, not an error.
    pub async fn send_request(
        &self,
        key: &PoolKey,
        request: Request<()>,
    ) -> Result<(Response<RecvStream>, SendStream<Bytes>), PoolError> {
        let again = copy_head(&request);
        let (sender, used) = self.checkout(key, None).await?;
        match send_once(sender, request).await {
            Ok(r) => Ok(r),
            Err(Failure::Unprocessed(e)) => {
                tracing::debug!(peer = %key.addr, error = %e, "HBONE stream not processed by the peer, retrying on a fresh connection");
                let (sender, _) = self.checkout(key, Some(used)).await?;
                send_once(sender, again)
                    .await
                    .map_err(|f| PoolError::Stream {
                        addr: key.addr,
                        source: f.into_inner(),
                    })
            }
            Err(Failure::Other(source)) => Err(PoolError::Stream {
                addr: key.addr,
                source,
            }),
        }
    }

    /// Releases connections no stream was requested on for [`POOL_UNUSED_RELEASE_TIMEOUT`] (and
    /// slots whose dial failed), pruning their keys; slots in use right now are skipped. Streams
    /// still open on a released connection run to their end, then the connection closes. Returns
    /// the number of keys pruned.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let before = slots.len();
        slots.retain(|_, slot| {
            // Clones are only made under this lock, so a count of 1 means nobody waits on it.
            if Arc::strong_count(slot) > 1 {
                return true;
            }
            match slot.try_lock() {
                Ok(conn) => conn
                    .as_ref()
                    .is_some_and(|c| now.duration_since(c.last_used) < POOL_UNUSED_RELEASE_TIMEOUT),
                Err(_) => true,
            }
        });
        let pruned = before - slots.len();
        if pruned > 0 {
            tracing::debug!(
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

    /// A ready sender and the id of its connection. With `avoid`, that connection (which just
    /// failed a stream) is not reused: a connection another task dialed meanwhile is, else a new
    /// one is dialed.
    async fn checkout(
        &self,
        key: &PoolKey,
        avoid: Option<u64>,
    ) -> Result<(SendRequest<Bytes>, u64), PoolError> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.entry(key.clone()).or_default().clone()
        };
        let mut guard = slot.lock().await;
        if let Some(conn) = guard.as_mut()
            && conn.streams < MAX_STREAMS_PER_CONNECTION
            && Some(conn.id) != avoid
            && let Ok(ready) = conn.sender.clone().ready().await
        {
            conn.streams += 1;
            conn.last_used = Instant::now();
            return Ok((ready, conn.id));
        }
        let sender = match tokio::time::timeout(CONNECT_TIMEOUT, self.dial(key)).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(PoolError::Connect {
                    addr: key.addr,
                    source: SocketError::Io {
                        op: format!("HBONE handshake with {}", key.addr),
                        source: std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"),
                    },
                });
            }
        };
        let ready = sender
            .clone()
            .ready()
            .await
            .map_err(|source| PoolError::H2 {
                addr: key.addr,
                source,
            })?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        *guard = Some(Conn {
            id,
            sender,
            streams: 1,
            last_used: Instant::now(),
        });
        Ok((ready, id))
    }

    async fn dial(&self, key: &PoolKey) -> Result<SendRequest<Bytes>, PoolError> {
        let io = self.connector.connect(key).await?;
        let (sender, mut conn) =
            client_builder()
                .handshake::<_, Bytes>(io)
                .await
                .map_err(|source| PoolError::H2 {
                    addr: key.addr,
                    source,
                })?;
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
        tracing::debug!(peer = %addr, src = %key.src, dst = %key.dst, "HBONE connection established");
        Ok(sender)
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
) -> Result<(Response<RecvStream>, SendStream<Bytes>), Failure> {
    // A synchronous failure means the request never left: the connection got a GOAWAY or died
    // between the readiness check and now.
    let (resp, send) = sender.send_request(request, false).map_err(|e| {
        if e.is_go_away() || e.is_io() || e.reason() == Some(h2::Reason::REFUSED_STREAM) {
            Failure::Unprocessed(e)
        } else {
            Failure::Other(e)
        }
    })?;
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
