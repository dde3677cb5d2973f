//! Pool of HBONE client connections of one pod.
//!
//! Keyed by (source identity, destination identity, destination HBONE address), as ztunnel's
//! `WorkloadKey`. Many CONNECT streams share one mTLS + HTTP/2 connection; after
//! [`MAX_STREAMS_PER_CONNECTION`] streams a new connection is dialed. Concurrent requests for a new
//! key wait for a single dial. Each connection sends a PING every 10 s and is dropped when no PONG
//! arrives within 20 s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use rustls_pki_types::ServerName;
use tokio::sync::Mutex as AsyncMutex;

use crate::proxy::hbone::{MAX_STREAMS_PER_CONNECTION, client_builder};
use crate::proxy::identity::{CertManager, Identity};
use crate::proxy::socket::{PodSockets, SocketError};
use crate::proxy::tls::{self, TlsError};

/// TCP connect timeout towards a peer's 15008, as ztunnel.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const PING_INTERVAL: Duration = Duration::from_secs(10);
const PING_TIMEOUT: Duration = Duration::from_secs(20);

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
        source: std::io::Error,
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
    sender: SendRequest<Bytes>,
    streams: usize,
}

type Slot = Arc<AsyncMutex<Option<Conn>>>;

/// The pool of one pod.
#[derive(Debug)]
pub struct Pool {
    sockets: PodSockets,
    certs: Arc<CertManager>,
    slots: std::sync::Mutex<HashMap<PoolKey, Slot>>,
}

impl Pool {
    /// An empty pool dialing from `sockets` with certificates from `certs`.
    pub fn new(sockets: PodSockets, certs: Arc<CertManager>) -> Pool {
        Pool {
            sockets,
            certs,
            slots: Default::default(),
        }
    }

    /// A ready sender for one new stream to `key`, dialing if needed.
    pub async fn sender(&self, key: &PoolKey) -> Result<SendRequest<Bytes>, PoolError> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.entry(key.clone()).or_default().clone()
        };
        let mut guard = slot.lock().await;
        if let Some(conn) = guard.as_mut() {
            if conn.streams < MAX_STREAMS_PER_CONNECTION {
                if let Ok(ready) = conn.sender.clone().ready().await {
                    conn.streams += 1;
                    return Ok(ready);
                }
            }
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
        *guard = Some(Conn { sender, streams: 1 });
        Ok(ready)
    }

    async fn dial(&self, key: &PoolKey) -> Result<SendRequest<Bytes>, PoolError> {
        let tcp = self
            .sockets
            .connect(key.addr, None, CONNECT_TIMEOUT)
            .await
            .map_err(|source| PoolError::Connect {
                addr: key.addr,
                source,
            })?;
        let config =
            tls::client_config(self.certs.clone(), key.src.clone(), vec![key.dst.clone()])?;
        // An IP server name makes rustls send no SNI, as ztunnel does.
        let name = ServerName::IpAddress(std::net::Ipv4Addr::UNSPECIFIED.into());
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|source| PoolError::Handshake {
                addr: key.addr,
                source,
            })?;
        let (sender, mut conn) =
            client_builder()
                .handshake::<_, Bytes>(tls)
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

async fn keepalive(ping: Option<h2::PingPong>) {
    let Some(mut ping) = ping else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(PING_INTERVAL).await;
        match tokio::time::timeout(PING_TIMEOUT, ping.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => return,
        }
    }
}
