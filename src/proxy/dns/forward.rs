//! Forwarding to the node's upstream resolvers, byte for byte, from the pod's netns with the
//! packet mark (ztunnel's forwarder creates its upstream sockets with the pod's socket factory,
//! `src/dns/forwarder.rs` `RuntimeProviderAdaptor`; the in-pod rules then leave them alone and
//! put their UDP flows in their own conntrack zone, istio#33469).
//!
//! UDP: a fresh socket per try (a new random source port), connected to the server; the first
//! datagram from it that is a response with the query's id is the answer, whatever else it holds
//! (TC included: the client then retries over TCP, and that query is forwarded over TCP). Servers
//! are tried in order, `attempts` rounds, each try waiting `timeout` (glibc's `res_send` order).
//!
//! TCP: a connection from the pod to the first server that accepts one (each given `timeout`),
//! over which the client's length-prefixed messages are relayed (RFC 1035 §4.2.2, RFC 7766).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::resolv::Upstreams;
use crate::proxy::socket::{PodSockets, SocketError};

/// The largest DNS message (UDP datagram or TCP frame).
pub const MAX_MESSAGE: usize = 65535;

/// Forwarding failed.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The resolver config lists no server.
    #[error("no upstream DNS server configured")]
    NoServers,
    /// No server answered in time.
    #[error("no answer from the upstream DNS servers {0:?}")]
    NoAnswer(Vec<SocketAddr>),
    /// The query is shorter than a DNS header's id.
    #[error("DNS query of {0} bytes has no id")]
    TooShort(usize),
    /// A socket in the pod could not be made or connected.
    #[error(transparent)]
    Socket(#[from] SocketError),
}

/// Sends `query` over UDP and returns the answer's bytes as they came.
pub async fn udp(
    sockets: &PodSockets,
    upstreams: &Upstreams,
    query: &[u8],
) -> Result<Vec<u8>, ForwardError> {
    if upstreams.servers.is_empty() {
        return Err(ForwardError::NoServers);
    }
    let id = query.get(..2).ok_or(ForwardError::TooShort(query.len()))?;
    let mut last_socket_error = None;
    for _ in 0..upstreams.attempts {
        for server in &upstreams.servers {
            match udp_try(sockets, *server, query, id, upstreams.timeout).await {
                Ok(Some(answer)) => return Ok(answer),
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(%server, error = %e, "upstream DNS over UDP");
                    last_socket_error = Some(e);
                }
            }
        }
    }
    match last_socket_error {
        Some(SocketError::Stopped) => Err(ForwardError::Socket(SocketError::Stopped)),
        _ => Err(ForwardError::NoAnswer(upstreams.servers.clone())),
    }
}

/// One try: `Ok(None)` when `server` did not answer within `timeout`.
async fn udp_try(
    sockets: &PodSockets,
    server: SocketAddr,
    query: &[u8],
    id: &[u8],
    timeout: std::time::Duration,
) -> Result<Option<Vec<u8>>, SocketError> {
    let io_err = |op: &str| {
        let op = format!("{op} {server}");
        move |source: io::Error| SocketError::Io { op, source }
    };
    let sock = sockets.udp_bind(any_port(server)).await?;
    sock.connect(server).await.map_err(io_err("connect udp"))?;
    sock.send(query).await.map_err(io_err("send to"))?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    let wait = async {
        loop {
            let n = sock.recv(&mut buf).await.map_err(io_err("receive from"))?;
            // a response (QR) with our id; anything else on this port is not ours
            if n >= 3 && buf[..2] == *id && buf[2] & 0x80 != 0 {
                return Ok::<usize, SocketError>(n);
            }
        }
    };
    match tokio::time::timeout(timeout, wait).await {
        Ok(Ok(n)) => {
            buf.truncate(n);
            Ok(Some(buf))
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Ok(None),
    }
}

/// The wildcard address of `server`'s family, port 0.
fn any_port(server: SocketAddr) -> SocketAddr {
    match server {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
    }
}

/// A TCP connection from the pod to the first upstream server that accepts one.
pub async fn tcp_connect(
    sockets: &PodSockets,
    upstreams: &Upstreams,
) -> Result<TcpStream, ForwardError> {
    if upstreams.servers.is_empty() {
        return Err(ForwardError::NoServers);
    }
    for server in &upstreams.servers {
        match sockets.connect(*server, None, upstreams.timeout).await {
            // TCP_NODELAY is on already (every socket the pod's socket thread makes has it).
            Ok(s) => return Ok(s),
            Err(SocketError::Stopped) => return Err(SocketError::Stopped.into()),
            Err(e) => tracing::debug!(%server, error = %e, "upstream DNS over TCP"),
        }
    }
    Err(ForwardError::NoAnswer(upstreams.servers.clone()))
}

/// Reads one length-prefixed DNS message; `None` at a clean end of stream.
pub async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 2];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    r.read_exact(&mut msg).await?;
    Ok(Some(msg))
}

/// Writes `msg` with its length prefix in one write.
pub async fn write_frame<W: AsyncWriteExt + Unpin>(w: &mut W, msg: &[u8]) -> io::Result<()> {
    let len = u16::try_from(msg.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "DNS message over 65535 bytes"))?;
    let mut framed = Vec::with_capacity(msg.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(msg);
    w.write_all(&framed).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::PacketMark;
    use crate::netns::Netns;
    use std::time::Duration;

    fn own_sockets() -> PodSockets {
        PodSockets::new(&Netns::current().expect("netns"), PacketMark::DEFAULT).expect("sockets")
    }

    #[tokio::test]
    async fn udp_answers_come_back_byte_for_byte_with_tc_and_ids_are_checked() {
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = server.local_addr().expect("addr");
        let up = Upstreams {
            servers: vec![addr],
            timeout: Duration::from_secs(2),
            attempts: 1,
        };
        let responder = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, peer) = server.recv_from(&mut buf).await.expect("recv");
            let query = buf[..n].to_vec();
            // first a datagram with another id (ignored), then the answer: TC set, odd trailer
            let mut wrong = query.clone();
            wrong[0] ^= 0xff;
            wrong[2] |= 0x80;
            server.send_to(&wrong, peer).await.expect("send");
            let mut answer = query.clone();
            answer[2] |= 0x80 | 0x02;
            answer.extend_from_slice(b"\x00trailing bytes kept");
            server.send_to(&answer, peer).await.expect("send");
            (query, answer)
        });
        let query = b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01x\x00\x00\x01\x00\x01";
        let got = udp(&own_sockets(), &up, query).await.expect("answer");
        let (seen, sent) = responder.await.expect("responder");
        assert_eq!(seen, query, "the query went out unchanged");
        assert_eq!(got, sent, "the answer came back unchanged, TC included");
    }

    #[tokio::test]
    async fn a_silent_server_is_skipped_for_the_next_one() {
        let silent = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let answering = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let up = Upstreams {
            servers: vec![
                silent.local_addr().expect("addr"),
                answering.local_addr().expect("addr"),
            ],
            timeout: Duration::from_millis(200),
            attempts: 1,
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, peer) = answering.recv_from(&mut buf).await.expect("recv");
            buf[2] |= 0x80;
            answering.send_to(&buf[..n], peer).await.expect("send");
        });
        let query = b"\x00\x07\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00";
        let got = udp(&own_sockets(), &up, query).await.expect("answer");
        assert_eq!(got[..2], query[..2]);
        let none = Upstreams {
            servers: vec![silent.local_addr().expect("addr")],
            timeout: Duration::from_millis(50),
            attempts: 2,
        };
        assert!(matches!(
            udp(&own_sockets(), &none, query).await,
            Err(ForwardError::NoAnswer(_))
        ));
        assert!(matches!(
            udp(&own_sockets(), &Upstreams::new(vec![]), query).await,
            Err(ForwardError::NoServers)
        ));
    }

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        write_frame(&mut a, b"hello").await.expect("write");
        drop(a);
        assert_eq!(
            read_frame(&mut b).await.expect("read"),
            Some(b"hello".to_vec())
        );
        assert_eq!(read_frame(&mut b).await.expect("eof"), None);
    }
}
