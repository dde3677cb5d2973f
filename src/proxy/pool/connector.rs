//! How the pool gets a transport connection to a peer: the [`Connector`] seam and its production
//! implementation (TCP from the pod netns, then mTLS with the pod's certificate).

use std::future::Future;
use std::sync::Arc;

use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::{PoolError, PoolKey};
use crate::proxy::hbone::CONNECT_TIMEOUT;
use crate::proxy::identity::CertManager;
use crate::proxy::socket::PodSockets;
use crate::proxy::tls;

/// Opens the byte stream HTTP/2 runs over for one pool key (a seam so the pool's logic can be
/// tested over in-memory streams).
pub trait Connector: Send + Sync + 'static {
    /// The connected, authenticated stream.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Connects to `key.addr` as `key.src`, accepting only `key.dst` as the peer.
    fn connect(&self, key: &PoolKey) -> impl Future<Output = Result<Self::Io, PoolError>> + Send;
}

/// The production connector: TCP from the pod netns (with the proxy mark) to the peer's 15008,
/// then a TLS 1.3 handshake presenting `key.src`'s certificate and verifying `key.dst`.
#[derive(Debug)]
pub struct PodConnector {
    sockets: PodSockets,
    certs: Arc<CertManager>,
}

impl PodConnector {
    /// A connector dialing from `sockets` with certificates from `certs`.
    pub fn new(sockets: PodSockets, certs: Arc<CertManager>) -> PodConnector {
        PodConnector { sockets, certs }
    }
}

impl Connector for PodConnector {
    type Io = tls::TlsStream<TcpStream>;

    async fn connect(&self, key: &PoolKey) -> Result<Self::Io, PoolError> {
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
        tls::connect(config, name, tcp)
            .await
            .map_err(|source| PoolError::Handshake {
                addr: key.addr,
                source,
            })
    }
}
