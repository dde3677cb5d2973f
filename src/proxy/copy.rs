//! Byte copying between a pod's TCP connection and an HBONE stream (or another TCP connection).
//!
//! Both directions run until each side has finished; EOF is propagated as a half-close (TCP
//! `shutdown(Write)` / HTTP/2 END_STREAM), an error or a stream reset on either side ends both.
//! Read buffers grow for bulk transfers (16 KiB, then 256 KiB after 1 MiB) so one read moves many TLS
//! records and HTTP/2 DATA frames; received HTTP/2 data is written out without a copy.

use std::future::poll_fn;
use std::io;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Initial read buffer, bytes.
const SMALL_BUF: usize = 16 * 1024;
/// Read buffer once a direction has moved [`GROW_AFTER`] bytes.
const LARGE_BUF: usize = 256 * 1024;
/// Bytes after which a direction switches to the large buffer.
const GROW_AFTER: u64 = 1024 * 1024;

/// Bytes moved by a finished relay.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// From the local (pod-side) TCP connection towards the peer.
    pub sent: u64,
    /// From the peer towards the local TCP connection.
    pub received: u64,
}

fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 io error"))
    } else {
        io::Error::other(e)
    }
}

/// Whether an h2 error on read means a clean end (RST_STREAM NO_ERROR or CANCEL).
fn is_clean_reset(e: &h2::Error) -> bool {
    matches!(
        e.reason(),
        Some(h2::Reason::NO_ERROR) | Some(h2::Reason::CANCEL)
    )
}

/// Copies `reader` into the HBONE `send` stream, ending it with END_STREAM on EOF. Returns bytes copied.
pub async fn tcp_to_h2<R: AsyncRead + Unpin>(
    mut reader: R,
    mut send: SendStream<Bytes>,
) -> io::Result<u64> {
    let mut buf = BytesMut::with_capacity(SMALL_BUF);
    let mut total = 0u64;
    loop {
        let want = if total >= GROW_AFTER {
            LARGE_BUF
        } else {
            SMALL_BUF
        };
        if buf.capacity() < want / 2 {
            buf.reserve(want);
        }
        let n = reader.read_buf(&mut buf).await?;
        if n == 0 {
            send.send_data(Bytes::new(), true).map_err(h2_io)?;
            return Ok(total);
        }
        total += n as u64;
        let mut chunk = buf.split().freeze();
        while !chunk.is_empty() {
            send.reserve_capacity(chunk.len());
            let cap = match poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(Ok(cap)) => cap,
                Some(Err(e)) => return Err(h2_io(e)),
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "HBONE stream closed",
                    ));
                }
            };
            if cap == 0 {
                continue;
            }
            let part = chunk.split_to(cap.min(chunk.len()));
            send.send_data(part, false).map_err(h2_io)?;
        }
    }
}

/// Copies the HBONE `recv` stream into `writer`, half-closing it at END_STREAM. Returns bytes copied.
pub async fn h2_to_tcp<W: AsyncWrite + Unpin>(
    mut recv: RecvStream,
    mut writer: W,
) -> io::Result<u64> {
    let mut total = 0u64;
    loop {
        match recv.data().await {
            Some(Ok(chunk)) => {
                let n = chunk.len();
                writer.write_all(&chunk).await?;
                total += n as u64;
                recv.flow_control().release_capacity(n).map_err(h2_io)?;
            }
            Some(Err(e)) if is_clean_reset(&e) => break,
            Some(Err(e)) => return Err(h2_io(e)),
            None => break,
        }
    }
    writer.shutdown().await?;
    Ok(total)
}

/// Relays between a TCP connection and an HBONE stream in both directions (see module docs).
pub async fn relay_h2<S>(
    tcp: S,
    send: SendStream<Bytes>,
    recv: RecvStream,
) -> io::Result<Transferred>
where
    S: AsyncRead + AsyncWrite,
{
    let (rd, wr) = tokio::io::split(tcp);
    let (sent, received) = tokio::try_join!(tcp_to_h2(rd, send), h2_to_tcp(recv, wr))?;
    Ok(Transferred { sent, received })
}

/// Relays between two TCP connections (plain passthrough), half-close propagated.
pub async fn relay_tcp(
    mut local: tokio::net::TcpStream,
    mut remote: tokio::net::TcpStream,
) -> io::Result<Transferred> {
    let (sent, received) =
        tokio::io::copy_bidirectional_with_sizes(&mut local, &mut remote, SMALL_BUF, SMALL_BUF)
            .await?;
    Ok(Transferred { sent, received })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    /// Builds an in-memory h2 client/server pair and returns (client send+recv, server send+recv).
    async fn h2_pair() -> (
        (SendStream<Bytes>, RecvStream),
        (SendStream<Bytes>, RecvStream),
    ) {
        let (a, b) = duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = crate::proxy::hbone::server_builder()
                .handshake::<_, Bytes>(b)
                .await
                .expect("server hs");
            let (req, mut respond) = conn.accept().await.expect("stream").expect("ok");
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let send = respond
                .send_response(http::Response::new(()), false)
                .expect("respond");
            (send, req.into_body())
        });
        let (mut client, conn) = crate::proxy::hbone::client_builder()
            .handshake::<_, Bytes>(a)
            .await
            .expect("client hs");
        tokio::spawn(conn);
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri("10.0.0.2:80")
            .body(())
            .expect("req");
        let (resp, send) = client.send_request(req, false).expect("send");
        let srv = server.await.expect("server task");
        let resp = resp.await.expect("response");
        ((send, resp.into_body()), srv)
    }

    #[tokio::test]
    async fn relays_both_ways_with_half_close() {
        let ((c_send, c_recv), (s_send, s_recv)) = h2_pair().await;
        let (app, proxy_side) = duplex(64 * 1024);
        let relay = tokio::spawn(relay_h2(proxy_side, c_send, c_recv));
        // the "peer" echoes everything it gets, then ends its side
        let peer = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut recv = s_recv;
            while let Some(chunk) = recv.data().await {
                let chunk = chunk.expect("data");
                recv.flow_control()
                    .release_capacity(chunk.len())
                    .expect("release");
                got.extend_from_slice(&chunk);
            }
            let mut send = s_send;
            send.send_data(Bytes::from(got.clone()), true)
                .expect("echo");
            got.len()
        });
        let (mut r, mut w) = tokio::io::split(app);
        let payload = vec![7u8; 3 * 1024 * 1024 + 5];
        w.write_all(&payload).await.expect("write");
        w.shutdown().await.expect("half close");
        let mut back = Vec::new();
        r.read_to_end(&mut back).await.expect("read back");
        assert_eq!(back, payload);
        assert_eq!(peer.await.expect("peer"), payload.len());
        let t = relay.await.expect("relay task").expect("relay ok");
        assert_eq!(
            t,
            Transferred {
                sent: payload.len() as u64,
                received: payload.len() as u64
            }
        );
    }

    #[tokio::test]
    async fn reset_from_peer_ends_the_relay_with_error() {
        let ((c_send, c_recv), (mut s_send, _s_recv)) = h2_pair().await;
        let (_app, proxy_side) = duplex(1024);
        let relay = tokio::spawn(relay_h2(proxy_side, c_send, c_recv));
        s_send.send_reset(h2::Reason::INTERNAL_ERROR);
        let res = relay.await.expect("relay task");
        assert!(res.is_err(), "{res:?}");
    }
}
