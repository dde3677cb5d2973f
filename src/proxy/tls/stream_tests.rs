//! Tests of [`TlsStream`]: our two ends together, and each end against rustls' own buffered
//! stream (tokio-rustls), which is what Istio's ztunnel runs: tickets, KeyUpdate both ways,
//! close_notify, tampering and truncation.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use rustls::{ClientConfig, ServerConfig};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::*;
use crate::proxy::identity::{Ca, CertManager, DEFAULT_CERT_LIFETIME, Identity};
use crate::proxy::tls::{accept, client_config, connect, peer_identity, server_config};

fn client_id() -> Identity {
    Identity::new("cluster.local", "ns-a", "client")
}

fn server_id() -> Identity {
    Identity::new("cluster.local", "ns-b", "server")
}

fn configs() -> (Arc<ClientConfig>, Arc<ServerConfig>) {
    let certs = CertManager::new(Ca::generate().expect("CA"), DEFAULT_CERT_LIFETIME);
    let client = client_config(certs.clone(), client_id(), vec![server_id()]).expect("client");
    let server = server_config(certs, server_id()).expect("server");
    (client, server)
}

fn name() -> ServerName<'static> {
    ServerName::IpAddress(Ipv4Addr::UNSPECIFIED.into())
}

async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("finished in time")
}

/// Our client and our server, handshaken over an in-memory pipe.
async fn ours() -> (TlsStream<DuplexStream>, TlsStream<DuplexStream>) {
    ours_over(64 * 1024).await
}

/// As [`ours`], over a pipe that buffers `pipe` bytes each way.
async fn ours_over(pipe: usize) -> (TlsStream<DuplexStream>, TlsStream<DuplexStream>) {
    let (client, server) = configs();
    let (c, s) = tokio::io::duplex(pipe);
    let (c, s) =
        within(async { tokio::join!(connect(client, name(), c), accept(server, s)) }).await;
    (c.expect("client handshake"), s.expect("server handshake"))
}

type RustlsClient = tokio_rustls::client::TlsStream<DuplexStream>;
type RustlsServer = tokio_rustls::server::TlsStream<DuplexStream>;

/// A rustls client (tokio-rustls) and our server, handshaken.
async fn rustls_client_our_server() -> (RustlsClient, TlsStream<DuplexStream>) {
    let (client, server) = configs();
    let (c, s) = tokio::io::duplex(64 * 1024);
    let (c, s) = within(async {
        tokio::join!(
            tokio_rustls::TlsConnector::from(client).connect(name(), c),
            accept(server, s)
        )
    })
    .await;
    (c.expect("rustls client"), s.expect("our server"))
}

/// Our client (with `client`) and a rustls server (tokio-rustls, with `server`), handshaken.
async fn our_client_rustls_server(
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
) -> (TlsStream<DuplexStream>, RustlsServer) {
    let (c, s) = tokio::io::duplex(64 * 1024);
    let (c, s) = within(async {
        tokio::join!(
            connect(client, name(), c),
            tokio_rustls::TlsAcceptor::from(server).accept(s)
        )
    })
    .await;
    (c.expect("our client"), s.expect("rustls server"))
}

fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

/// Writes `data` in uneven pieces (some vectored), then shuts down (close_notify).
async fn send_all<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) {
    let mut at = 0;
    let mut step = 1;
    while at < data.len() {
        let end = (at + step).min(data.len());
        if step % 2 == 0 {
            let mid = at + (end - at) / 2;
            let bufs = [IoSlice::new(&data[at..mid]), IoSlice::new(&data[mid..end])];
            let n = w.write_vectored(&bufs).await.expect("write_vectored");
            at += n;
        } else {
            w.write_all(&data[at..end]).await.expect("write");
            at = end;
        }
        step = (step * 3 + 1) % 70_000;
    }
    w.shutdown().await.expect("shutdown");
}

async fn read_to_end<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Vec<u8>> {
    let mut got = Vec::new();
    r.read_to_end(&mut got).await?;
    Ok(got)
}

/// Reads to close_notify with a fixed 256 KiB buffer: room for reads into the caller's buffer.
async fn read_large<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Vec<u8>> {
    read_with(r, 256 * 1024).await
}

/// Reads to close_notify with a fixed buffer of `size` bytes.
async fn read_with<R: AsyncRead + Unpin>(r: &mut R, size: usize) -> io::Result<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; size];
    loop {
        match r.read(&mut buf).await? {
            0 => return Ok(got),
            n => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test]
async fn our_ends_carry_data_both_ways_and_close_with_close_notify() {
    // the server reads into a large buffer (decrypting there), then into a small one
    for size in [256 * 1024, 4096] {
        both_ways(size).await;
    }
}

async fn both_ways(read_size: usize) {
    let (mut c, mut s) = ours().await;
    assert_eq!(c.alpn_protocol(), Some(&b"h2"[..]));
    let chain = s.peer_certificates().expect("client chain");
    assert_eq!(peer_identity(chain), Some(client_id()));
    let up = payload(3 * 1024 * 1024 + 5);
    let down = payload(700_001);
    let (got_down, got_up) = within(async {
        tokio::join!(
            async {
                send_all(&mut c, &up).await;
                read_to_end(&mut c)
                    .await
                    .expect("client reads to close_notify")
            },
            async {
                let got = read_with(&mut s, read_size)
                    .await
                    .expect("server reads to close_notify");
                send_all(&mut s, &down).await;
                got
            }
        )
    })
    .await;
    assert!(got_up == up, "upload intact ({} bytes)", got_up.len());
    assert!(
        got_down == down,
        "download intact ({} bytes)",
        got_down.len()
    );
    // both batches were sent and released
    assert!(c.wbuf.capacity() == 0 && c.wnext.capacity() == 0);
    assert_eq!(s.direct_reads > 0, read_size > DIRECT_READ_MIN, "{s:?}");
}

#[tokio::test]
async fn our_client_follows_a_rustls_server_with_tickets_and_key_updates() {
    let (client, server) = configs();
    // a client that offers resumption, so that the server sends its tickets
    let mut client = (*client).clone();
    client.resumption = rustls::client::Resumption::in_memory_sessions(4);
    let client = Arc::new(client);
    let mut server = (*server).clone();
    server.send_tls13_tickets = 2;
    server.session_storage = rustls::server::ServerSessionMemoryCache::new(16);
    let (mut c, mut s) = our_client_rustls_server(client, Arc::new(server)).await;
    let first = payload(100_000);
    let second = payload(300_000);
    let reply = payload(200_000);
    within(async {
        tokio::join!(
            async {
                s.write_all(&first).await.expect("write");
                s.flush().await.expect("flush");
                // KeyUpdate(update_requested): we must follow it and answer with our own
                s.get_mut().1.refresh_traffic_keys().expect("key update");
                s.write_all(&second).await.expect("write");
                s.flush().await.expect("flush");
                let mut got = vec![0; reply.len()];
                s.read_exact(&mut got)
                    .await
                    .expect("reply under our new key");
                assert!(got == reply);
                s.shutdown().await.expect("shutdown");
            },
            async {
                let mut got = vec![0; first.len() + second.len()];
                c.read_exact(&mut got).await.expect("both halves");
                assert!(got[..first.len()] == first[..] && got[first.len()..] == second[..]);
                assert_eq!(c.tickets, 2, "both tickets were read and skipped");
                // followed the server's KeyUpdate and answered the request with our own
                assert_eq!((c.rx_updates, c.tx_updates), (1, 1), "{c:?}");
                c.write_all(&reply).await.expect("reply");
                c.flush().await.expect("flush");
                assert_eq!(read_to_end(&mut c).await.expect("close_notify"), b"");
            }
        )
    })
    .await;
}

/// The rustls client sends `data` with a KeyUpdate request after `at` bytes, closes (close_notify)
/// and returns what the server sends back before its own close_notify.
async fn send_with_a_key_update(c: &mut RustlsClient, data: &[u8], at: usize) -> Vec<u8> {
    c.write_all(&data[..at]).await.expect("write");
    c.get_mut().1.refresh_traffic_keys().expect("key update");
    c.write_all(&data[at..]).await.expect("write");
    c.shutdown().await.expect("shutdown");
    let mut echo = Vec::new();
    c.read_to_end(&mut echo)
        .await
        .expect("echo to close_notify");
    echo
}

#[tokio::test]
async fn our_server_follows_a_rustls_client_with_key_updates() {
    let (mut c, mut s) = rustls_client_our_server().await;
    let data = payload(500_000);
    within(async {
        tokio::join!(
            async {
                let echo = send_with_a_key_update(&mut c, &data, 1000).await;
                assert!(echo == data);
            },
            async {
                let got = read_to_end(&mut s).await.expect("read to close_notify");
                assert!(got == data);
                assert_eq!((s.rx_updates, s.tx_updates), (1, 1), "{s:?}");
                send_all(&mut s, &got).await;
            }
        )
    })
    .await;
}

#[tokio::test]
async fn large_reads_decrypt_in_the_callers_buffer_across_a_key_update() {
    let (mut c, mut s) = rustls_client_our_server().await;
    let data = payload(2 * 1024 * 1024 + 77);
    within(async {
        tokio::join!(
            async {
                let echo = send_with_a_key_update(&mut c, &data, 300_000).await;
                assert!(echo == b"done");
            },
            async {
                let got = read_large(&mut s).await.expect("read to close_notify");
                assert!(got == data, "{} of {} bytes", got.len(), data.len());
                // the 64 KiB pipe ends reads inside records: their tails were carried over
                assert!(s.direct_reads > 10, "{s:?}");
                assert_eq!((s.rx_updates, s.tx_updates), (1, 1), "{s:?}");
                send_all(&mut s, b"done").await;
            }
        )
    })
    .await;
}

#[tokio::test]
async fn a_tampered_record_fails_a_large_read_after_the_good_ones() {
    let (mut c, mut s) = ours().await;
    c.write_all(b"good").await.expect("write");
    c.flush().await.expect("flush");
    c.write_all(&[7u8; 100]).await.expect("write");
    c.flush().await.expect("flush");
    let mut raw = vec![0u8; (5 + 4 + 1 + 16) + (5 + 100 + 1 + 16)];
    within(s.io.read_exact(&mut raw))
        .await
        .expect("raw records");
    raw[60] ^= 1;
    c.io.write_all(&raw).await.expect("resend");
    let mut buf = vec![0u8; 64 * 1024];
    let n = within(s.read(&mut buf)).await.expect("good record");
    assert_eq!(&buf[..n], b"good");
    assert_eq!(s.direct_reads, 1, "{s:?}");
    let err = within(s.read(&mut buf)).await.expect_err("tampered");
    assert!(err.to_string().contains("authentication"), "{err}");
    let again = within(s.read(&mut buf)).await.expect_err("still failed");
    assert_eq!(again.to_string(), err.to_string());
}

#[tokio::test]
async fn the_send_key_is_updated_at_the_confidentiality_limit() {
    let (client, server) = configs();
    let (mut c, mut s) = our_client_rustls_server(client, server).await;
    c.rekey_at(3);
    let data = payload(10 * record::MAX_PLAINTEXT);
    within(async {
        tokio::join!(
            async {
                c.write_all(&data).await.expect("write");
                c.shutdown().await.expect("shutdown");
            },
            async {
                let mut got = Vec::new();
                s.read_to_end(&mut got)
                    .await
                    .expect("rustls reads across the updates");
                assert!(got == data);
            }
        )
    })
    .await;
    // 10 data records and a close_notify: an update after every 3 records
    assert_eq!(c.tx_updates, 3, "{c:?}");
    assert!(c.tx.seq() < 3, "{c:?}");
}

#[tokio::test]
async fn a_tampered_record_fails_the_read_for_good() {
    let (mut c, mut s) = ours().await;
    c.write_all(b"fine").await.expect("write");
    c.flush().await.expect("flush");
    let mut four = [0u8; 4];
    within(s.read_exact(&mut four)).await.expect("first record");
    c.write_all(&[7u8; 100]).await.expect("write");
    c.flush().await.expect("flush");
    // flip one bit of the sealed record on its way (it is still in the pipe)
    let mut raw = vec![0u8; 5 + 100 + 1 + 16];
    within(s.io.read_exact(&mut raw)).await.expect("raw record");
    raw[50] ^= 1;
    s.rbuf.extend_from_slice(&raw);
    let err = within(s.read(&mut four)).await.expect_err("tampered");
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    assert!(err.to_string().contains("authentication"), "{err}");
    let again = within(s.read(&mut four)).await.expect_err("still failed");
    assert_eq!(again.to_string(), err.to_string());
    // the peer learns why: bad_record_mac, and nothing more is sent
    let alert = within(c.read(&mut four)).await.expect_err("alert");
    assert!(alert.to_string().contains("alert 20"), "{alert}");
    assert_eq!(
        s.write(b"more").await.expect_err("closed").kind(),
        io::ErrorKind::BrokenPipe
    );
}

#[tokio::test]
async fn oversized_and_foreign_records_are_rejected_with_an_alert() {
    for size in [8, 64 * 1024] {
        for (header, want, alert) in [
            ([23u8, 3, 3, 0x41, 0x01], "exceeds", "alert 22"),
            ([22u8, 3, 3, 0, 10], "type 22", "alert 10"),
        ] {
            let (mut c, mut s) = ours().await;
            c.io.write_all(&header).await.expect("raw header");
            let mut buf = vec![0u8; size];
            let err = within(s.read(&mut buf)).await.expect_err("rejected");
            assert!(err.to_string().contains(want), "{size}: {err}");
            let err = within(c.read(&mut buf)).await.expect_err("alert");
            assert!(err.to_string().contains(alert), "{size}: {err}");
        }
    }
}

#[tokio::test]
async fn a_rustls_client_gets_bad_record_mac_for_a_forged_record() {
    let (mut c, mut s) = rustls_client_our_server().await;
    // a record rustls did not seal, written under it
    let mut forged = vec![23u8, 3, 3, 0, 40];
    forged.extend_from_slice(&[0x55; 40]);
    c.get_mut()
        .0
        .write_all(&forged)
        .await
        .expect("forged record");
    let mut buf = vec![0u8; 64 * 1024];
    let err = within(s.read(&mut buf)).await.expect_err("forged");
    assert!(err.to_string().contains("authentication"), "{err}");
    let err = within(c.read(&mut buf)).await.expect_err("alert at rustls");
    assert!(err.to_string().contains("BadRecordMac"), "{err}");
}

#[tokio::test]
async fn truncation_without_close_notify_is_an_error() {
    for size in [8, 64 * 1024] {
        let (c, mut s) = ours().await;
        drop(c);
        let mut buf = vec![0u8; size];
        let err = within(s.read(&mut buf)).await.expect_err("truncated");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(err.to_string().contains("without close_notify"), "{err}");
        // a close inside a record
        let (mut c, mut s) = ours().await;
        c.io.write_all(&[23, 3, 3, 0, 100, 1, 2, 3])
            .await
            .expect("raw");
        drop(c);
        let err = within(s.read(&mut buf)).await.expect_err("truncated");
        assert!(
            err.to_string().contains("inside a TLS record"),
            "{size}: {err}"
        );
    }
}

#[tokio::test]
async fn a_write_whose_rest_is_under_a_record_goes_in_whole() {
    let (mut c, _s) = ours_over(4 * 1024 * 1024).await;
    let data = payload(WRITE_QUEUE + 9);
    let n = within(std::future::poll_fn(|cx| {
        Pin::new(&mut c).poll_write_vectored(cx, &[io::IoSlice::new(&data)])
    }))
    .await
    .expect("write");
    assert_eq!(n, data.len(), "the 9 bytes after a full batch ride with it");
    let more = payload(WRITE_QUEUE + record::MAX_PLAINTEXT);
    let n = within(std::future::poll_fn(|cx| {
        Pin::new(&mut c).poll_write_vectored(cx, &[io::IoSlice::new(&more)])
    }))
    .await
    .expect("write");
    assert_eq!(
        n, WRITE_QUEUE,
        "a rest of a whole record waits for the next batch"
    );
}

/// A transport whose next read fails once with `Interrupted`.
struct Flaky {
    io: DuplexStream,
    fail_next: bool,
}

impl AsyncRead for Flaky {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if std::mem::take(&mut self.fail_next) {
            return Poll::Ready(Err(io::ErrorKind::Interrupted.into()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Flaky {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Our client and our server over a pipe whose server end fails its next read when asked.
async fn ours_flaky() -> (TlsStream<DuplexStream>, TlsStream<Flaky>) {
    let (client, server) = configs();
    let (c, s) = tokio::io::duplex(64 * 1024);
    let s = Flaky {
        io: s,
        fail_next: false,
    };
    let (c, s) =
        within(async { tokio::join!(connect(client, name(), c), accept(server, s)) }).await;
    (c.expect("client"), s.expect("server"))
}

/// Has `c` send `data` as one record, takes it off `s`'s socket and gives `s` only its first
/// `part` bytes, which a read then waits on without returning anything. Returns the record's
/// other bytes, for the caller to write to `s` (through `c.io`).
async fn send_part_of_a_record<IO: AsyncRead + AsyncWrite + Unpin>(
    c: &mut TlsStream<DuplexStream>,
    s: &mut TlsStream<IO>,
    data: &[u8],
    part: usize,
) -> Vec<u8> {
    c.write_all(data).await.expect("write");
    c.flush().await.expect("flush");
    let mut raw = vec![0u8; 5 + data.len() + 1 + 16];
    within(s.io.read_exact(&mut raw)).await.expect("raw record");
    c.io.write_all(&raw[..part]).await.expect("first part");
    let mut buf = vec![0u8; 64 * 1024];
    let early = tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "no data before the record is whole: {early:?}"
    );
    raw.split_off(part)
}

/// [`send_part_of_a_record`] with a record of `payload(5000)` of which `s` holds the first 1000
/// bytes.
async fn hold_a_partial_record<IO: AsyncRead + AsyncWrite + Unpin>(
    c: &mut TlsStream<DuplexStream>,
    s: &mut TlsStream<IO>,
) -> Vec<u8> {
    let rest = send_part_of_a_record(c, s, &payload(5000), 1000).await;
    assert_eq!(s.rbuf.len() - s.rpos, 1000, "the partial record is held");
    rest
}

#[tokio::test]
async fn a_socket_error_is_returned_as_it_is_and_not_kept() {
    let (mut c, mut s) = ours_flaky().await;
    c.write_all(b"after").await.expect("write");
    c.flush().await.expect("flush");
    for size in [8, 64 * 1024] {
        s.io.fail_next = true;
        let mut buf = vec![0u8; size];
        let err = within(s.read(&mut buf)).await.expect_err("interrupted");
        assert_eq!(err.kind(), io::ErrorKind::Interrupted, "{size}");
    }
    // one `read` (not `read_exact`, which would retry a kept `Interrupted` forever)
    let mut got = [0u8; 64];
    let n = within(s.read(&mut got))
        .await
        .expect("read after the error");
    assert_eq!(&got[..n], b"after");
}

#[tokio::test]
async fn a_socket_error_keeps_a_held_partial_record() {
    let (mut c, mut s) = ours_flaky().await;
    let rest = hold_a_partial_record(&mut c, &mut s).await;
    let mut buf = vec![0u8; 64 * 1024];
    s.io.fail_next = true;
    let err = within(s.read(&mut buf)).await.expect_err("interrupted");
    assert_eq!(err.kind(), io::ErrorKind::Interrupted);
    assert_eq!(s.rbuf.len() - s.rpos, 1000, "still held after the error");
    c.io.write_all(&rest).await.expect("rest");
    let n = within(s.read(&mut buf)).await.expect("the record");
    assert!(buf[..n] == payload(5000)[..], "{n}");
}

#[tokio::test]
async fn a_burst_of_key_update_requests_gets_one_answer_per_burst() {
    let (mut c, mut s) = rustls_client_our_server().await;
    within(async {
        tokio::join!(
            async {
                c.write_all(b"a").await.expect("write");
                for _ in 0..20 {
                    c.get_mut().1.refresh_traffic_keys().expect("key update");
                }
                c.write_all(b"b").await.expect("write");
                c.flush().await.expect("flush");
                // our data comes under our answered key
                let mut x = [0u8; 1];
                c.read_exact(&mut x)
                    .await
                    .expect("reply after our KeyUpdate");
                assert_eq!(&x, b"x");
                for _ in 0..5 {
                    c.get_mut().1.refresh_traffic_keys().expect("key update");
                }
                c.write_all(b"c").await.expect("write");
                c.shutdown().await.expect("shutdown");
            },
            async {
                let mut ab = [0u8; 2];
                s.read_exact(&mut ab).await.expect("read");
                assert_eq!(&ab, b"ab");
                assert_eq!((s.rx_updates, s.tx_updates), (20, 1), "{s:?}");
                s.write_all(b"x").await.expect("write");
                s.flush().await.expect("flush");
                assert_eq!(read_to_end(&mut s).await.expect("rest"), b"c");
                // we sent data since the first answer: the second burst gets its own
                assert_eq!((s.rx_updates, s.tx_updates), (25, 2), "{s:?}");
            }
        )
    })
    .await;
}

#[tokio::test]
async fn a_flood_of_records_without_data_ends_the_stream() {
    let (mut c, mut s) = rustls_client_our_server().await;
    within(async {
        c.write_all(b"a").await.expect("write");
        for _ in 0..=MAX_EMPTY_RECORDS_IN_A_ROW {
            c.get_mut().1.refresh_traffic_keys().expect("key update");
        }
        c.write_all(b"b").await.expect("write");
        c.flush().await.expect("flush");
    })
    .await;
    let err = within(read_to_end(&mut s))
        .await
        .expect_err("flood refused");
    assert!(
        err.to_string().contains("too many records without data"),
        "{err}"
    );
    // and no close_notify after the failure
    within(s.shutdown()).await.expect("shutdown");
    let mut rest = Vec::new();
    let end = within(c.read_to_end(&mut rest)).await;
    let err = end.expect_err("the peer must not see a clean close");
    assert!(err.to_string().contains("UnexpectedMessage"), "{err}");
}

#[tokio::test]
async fn no_key_update_answer_after_our_close_notify() {
    let (mut c, mut s) = rustls_client_our_server().await;
    within(s.shutdown()).await.expect("our close_notify");
    c.get_mut().1.refresh_traffic_keys().expect("key update");
    within(c.write_all(b"late")).await.expect("write");
    within(c.flush()).await.expect("flush");
    let mut got = [0u8; 4];
    within(s.read_exact(&mut got))
        .await
        .expect("data after the update");
    assert_eq!(&got, b"late");
    assert_eq!((s.rx_updates, s.tx_updates), (1, 0), "{s:?}");
}

#[tokio::test]
async fn a_peer_alert_gets_no_alert_back_and_ends_our_writes() {
    let (mut c, mut s) = ours().await;
    // a fatal handshake_failure (40) from the client
    c.seal(content::ALERT, |o| o.extend_from_slice(&[2, 40]))
        .expect("seal");
    within(c.flush()).await.expect("flush");
    let mut buf = vec![0u8; 64 * 1024];
    let err = within(s.read(&mut buf)).await.expect_err("alert");
    assert!(err.to_string().contains("alert 40"), "{err}");
    assert!(s.wnext.is_empty() && s.wbuf.is_empty(), "{s:?}");
    let w = s.write(b"x").await.expect_err("no writes after an alert");
    assert_eq!(w.kind(), io::ErrorKind::BrokenPipe);
    // nothing was sent: the client sees only the close
    within(s.shutdown()).await.expect("shutdown");
    let err = within(c.read(&mut buf)).await.expect_err("closed");
    assert!(err.to_string().contains("without close_notify"), "{err}");
}

#[tokio::test]
async fn key_update_with_an_illegal_request_or_length_gets_its_alert() {
    for (body, alert) in [
        (&[KEY_UPDATE, 0, 0, 1, 2][..], "alert 47"),
        (&[KEY_UPDATE, 0, 0, 2, 0, 0][..], "alert 50"),
    ] {
        let (mut c, mut s) = ours().await;
        c.seal(content::HANDSHAKE, |o| o.extend_from_slice(body))
            .expect("seal");
        within(c.flush()).await.expect("flush");
        let mut buf = vec![0u8; 64 * 1024];
        within(s.read(&mut buf)).await.expect_err("refused");
        let err = within(c.read(&mut buf)).await.expect_err("alert");
        assert!(err.to_string().contains(alert), "{err}");
    }
}

#[tokio::test]
async fn no_alert_after_our_close_notify() {
    let (mut c, mut s) = ours().await;
    within(s.shutdown()).await.expect("close_notify");
    let mut forged = vec![23u8, 3, 3, 0, 40];
    forged.extend_from_slice(&[0x55; 40]);
    c.io.write_all(&forged).await.expect("forged record");
    let mut buf = vec![0u8; 64 * 1024];
    within(s.read(&mut buf)).await.expect_err("forged");
    // the client sees the clean close and nothing after it
    assert_eq!(within(c.read(&mut buf)).await.expect("close_notify"), 0);
    assert!(s.wnext.is_empty() && s.wbuf.is_empty(), "{s:?}");
}

#[path = "handshake_tests.rs"]
mod handshake;

#[path = "stream_read_tests.rs"]
mod read;

/// A small deterministic PRNG (xorshift64*) for the randomized tests.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }
}

/// Copies `from` to `to` in pieces of random size (1 byte to 20 KiB), so records reach the other
/// end split at arbitrary boundaries and several per read; ends `to` when `from` ends.
async fn choppy_relay(
    mut from: tokio::io::ReadHalf<DuplexStream>,
    mut to: tokio::io::WriteHalf<DuplexStream>,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let mut buf = vec![0u8; 20 * 1024];
    loop {
        let want = 1 + rng.below(buf.len());
        match from.read(&mut buf[..want]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let mut at = 0;
                while at < n {
                    let end = (at + 1 + rng.below(n - at)).min(n);
                    if to.write_all(&buf[at..end]).await.is_err() {
                        return;
                    }
                    at = end;
                }
            }
        }
    }
    let _ = to.shutdown().await;
}

/// One step of the rustls client's loop in the differential test.
enum Step {
    Wrote(io::Result<usize>),
    Closed(io::Result<()>),
    Read(io::Result<usize>),
}

/// Differential test against rustls' own stream (what ztunnel runs): a rustls client and our
/// server, through a relay that splits the bytes at random boundaries both ways, with KeyUpdates
/// from both ends at random points (the client's own, answered by ours; ours at a random
/// confidentiality limit), random write and read sizes, then close_notify each way. For several
/// seeds: every byte arrives once and in order, both ways, and both ends see a clean end.
#[tokio::test]
async fn rustls_and_our_stream_agree_over_random_record_boundaries_and_key_updates() {
    let mut client_updates = 0;
    for seed in 1..=6u64 {
        let (client, server) = configs();
        let (c_io, relay_c) = tokio::io::duplex(64 * 1024);
        let (relay_s, s_io) = tokio::io::duplex(64 * 1024);
        let (rc_read, rc_write) = tokio::io::split(relay_c);
        let (rs_read, rs_write) = tokio::io::split(relay_s);
        tokio::spawn(choppy_relay(rc_read, rs_write, seed));
        tokio::spawn(choppy_relay(rs_read, rc_write, seed.wrapping_mul(31)));
        let (c, s) = within(async {
            tokio::join!(
                tokio_rustls::TlsConnector::from(client).connect(name(), c_io),
                accept(server, s_io)
            )
        })
        .await;
        let (mut c, mut s) = (c.expect("rustls client"), s.expect("our server"));
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9));
        s.rekey_at(2 + rng.below(3) as u64);
        let data = payload(150_000 + rng.below(100_000));
        let ((echo, updates), (got, rx_updates, tx_updates)) = within(async {
            tokio::join!(
                async {
                    // writes and reads interleaved in one loop: the echo must be read while
                    // writing, or the pipes fill up
                    let mut rng = Rng(seed ^ 0x5555);
                    let (mut at, mut closed, mut updates) = (0, false, 0);
                    let mut echo = Vec::new();
                    let mut rbuf = vec![0u8; 32 * 1024];
                    loop {
                        let end = (at + 1 + rng.below(40_000)).min(data.len());
                        let step = std::future::poll_fn(|cx| {
                            let mut pinned = std::pin::Pin::new(&mut c);
                            if at < data.len() {
                                if let Poll::Ready(r) =
                                    pinned.as_mut().poll_write(cx, &data[at..end])
                                {
                                    return Poll::Ready(Step::Wrote(r));
                                }
                            } else if !closed
                                && let Poll::Ready(r) = pinned.as_mut().poll_shutdown(cx)
                            {
                                return Poll::Ready(Step::Closed(r));
                            }
                            let mut rb = tokio::io::ReadBuf::new(&mut rbuf);
                            match pinned.poll_read(cx, &mut rb) {
                                Poll::Ready(r) => {
                                    Poll::Ready(Step::Read(r.map(|()| rb.filled().len())))
                                }
                                Poll::Pending => Poll::Pending,
                            }
                        })
                        .await;
                        match step {
                            Step::Wrote(n) => {
                                at += n.expect("client write");
                                if updates < 4 && rng.below(4) == 0 {
                                    c.get_mut().1.refresh_traffic_keys().expect("key update");
                                    updates += 1;
                                }
                            }
                            Step::Closed(r) => {
                                r.expect("client close_notify");
                                closed = true;
                            }
                            Step::Read(n) => match n.expect("client read") {
                                0 => break,
                                n => echo.extend_from_slice(&rbuf[..n]),
                            },
                        }
                    }
                    assert!(
                        closed,
                        "seed {seed}: our close_notify came before the client's"
                    );
                    (echo, updates)
                },
                async {
                    let mut rng = Rng(seed ^ 0xaaaa);
                    let mut got = Vec::new();
                    let mut buf = vec![0u8; 70_000];
                    loop {
                        let size = 1 + rng.below(buf.len());
                        match s.read(&mut buf[..size]).await.expect("our read") {
                            0 => break,
                            n => {
                                s.write_all(&buf[..n]).await.expect("our write");
                                got.extend_from_slice(&buf[..n]);
                            }
                        }
                    }
                    s.shutdown().await.expect("our close_notify");
                    (got, s.rx_updates, s.tx_updates)
                }
            )
        })
        .await;
        assert!(got == data, "seed {seed}: our server read other bytes");
        assert!(echo == data, "seed {seed}: rustls read other bytes back");
        assert!(
            tx_updates > updates,
            "seed {seed}: our send key was updated only in answer ({tx_updates} for {updates})"
        );
        assert_eq!(
            rx_updates, updates,
            "seed {seed}: every client KeyUpdate is followed"
        );
        client_updates += updates;
    }
    assert!(client_updates > 0, "no seed made the client update its key");
}

/// Bytes after the peer's close_notify are not read (RFC 8446 §6.1: data after a closure alert is
/// ignored): the read ends cleanly with what came before, the record after it is never opened.
#[tokio::test]
async fn data_after_close_notify_is_not_delivered() {
    let (mut c, mut s) = rustls_client_our_server().await;
    within(async {
        c.write_all(b"before").await.expect("write");
        c.get_mut().1.send_close_notify();
        c.flush().await.expect("close_notify out");
        // a record after the alert, on the same socket
        c.get_mut()
            .0
            .write_all(&[23, 3, 3, 0, 20])
            .await
            .expect("raw header");
        c.get_mut()
            .0
            .write_all(&[0x42; 20])
            .await
            .expect("raw body");
    })
    .await;
    let got = within(read_to_end(&mut s)).await.expect("a clean end");
    assert_eq!(got, b"before");
}
