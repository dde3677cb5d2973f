//! Tests of the relays: plain TCP and HTTP/2 streams both ways, half-close, resets with the bytes
//! moved, early data, and how a plain relay yields.

use super::*;

use tokio::io::{AsyncReadExt, duplex};

/// A connected loopback TCP pair.
async fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
    (a.expect("connect"), b.expect("accept").0)
}

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

#[test]
fn read_size_follows_the_traffic() {
    let mut s = ReadSize::new();
    s.update(SMALL_BUF, SMALL_BUF);
    assert_eq!(s.get(), 4 * SMALL_BUF);
    for _ in 0..10 {
        s.update(s.get(), s.get());
    }
    assert_eq!(s.get(), LARGE_BUF);
    s.update(SMALL_BUF, LARGE_BUF);
    assert_eq!(
        s.get(),
        LARGE_BUF,
        "a partly filled bulk read keeps the size"
    );
    s.update(1024, LARGE_BUF);
    assert_eq!(s.get(), SMALL_BUF);
}

#[tokio::test]
async fn relays_both_ways_with_half_close() {
    let ((c_send, c_recv), (s_send, s_recv)) = h2_pair().await;
    let (app, proxy_side) = tcp_pair().await;
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
    let (mut r, mut w) = app.into_split();
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
async fn empty_end_stream_frame_half_closes_the_socket() {
    let ((c_send, c_recv), (mut s_send, _s_recv)) = h2_pair().await;
    let (app, proxy_side) = tcp_pair().await;
    let relay = tokio::spawn(relay_h2(proxy_side, c_send, c_recv));
    s_send
        .send_data(Bytes::from_static(b"reply"), false)
        .expect("data");
    s_send.send_data(Bytes::new(), true).expect("end stream");
    let (mut r, mut w) = app.into_split();
    let mut back = Vec::new();
    r.read_to_end(&mut back).await.expect("read until EOF");
    assert_eq!(back, b"reply");
    w.shutdown().await.expect("half close");
    let t = relay.await.expect("relay task").expect("relay ok");
    assert_eq!(
        t,
        Transferred {
            sent: 0,
            received: 5
        }
    );
}

#[tokio::test]
async fn fin_right_after_data_rides_on_the_data_frame() {
    let ((c_send, c_recv), (_s_send, mut s_recv)) = h2_pair().await;
    let (app, proxy_side) = tcp_pair().await;
    let (_r, mut w) = app.into_split();
    w.write_all(b"request").await.expect("write");
    w.shutdown().await.expect("half close");
    // Both the data and the FIN are in the socket before the relay's first read.
    while !proxy_side
        .ready(tokio::io::Interest::READABLE)
        .await
        .expect("ready")
        .is_read_closed()
    {
        tokio::task::yield_now().await;
    }
    let relay = tokio::spawn(relay_h2(proxy_side, c_send, c_recv));
    let chunk = s_recv.data().await.expect("data").expect("ok");
    assert_eq!(&chunk[..], b"request");
    assert!(
        s_recv.is_end_stream(),
        "END_STREAM came on the DATA frame, not in a frame of its own"
    );
    assert!(s_recv.data().await.is_none());
    relay.abort();
}

#[test]
fn read_chunk_yields_when_the_budget_is_spent() {
    // On its own thread: if read_chunk spun, this thread would never return.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let (app, proxy_side) = tcp_pair().await;
            let (mut rd, _wr) = proxy_side.into_split();
            let (_ard, mut awr) = app.into_split();
            awr.write_all(b"data").await.expect("write");
            rd.readable().await.expect("readable");
            let mut size = ReadSize::new();
            let mut read = Box::pin(read_chunk(&mut rd, &mut size));
            // Spend the whole budget, then poll the read in the same task poll.
            let first = std::future::poll_fn(|cx| {
                while let Poll::Ready(restore) = tokio::task::coop::poll_proceed(cx) {
                    restore.made_progress();
                }
                Poll::Ready(read.as_mut().poll(cx).is_pending())
            })
            .await;
            let got = read.await.expect("read").expect("data");
            let _ = done_tx.send((first, got));
        });
    });
    let (first_pending, got) = done_rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("read_chunk spun with a spent budget");
    assert!(first_pending, "a spent budget makes the first poll yield");
    assert_eq!(&got[..], b"data");
}

#[tokio::test]
async fn reset_from_peer_ends_the_relay_with_error() {
    let ((c_send, c_recv), (mut s_send, _s_recv)) = h2_pair().await;
    let (_app, proxy_side) = tcp_pair().await;
    let relay = tokio::spawn(relay_h2(proxy_side, c_send, c_recv));
    s_send.send_reset(h2::Reason::INTERNAL_ERROR);
    let res = relay.await.expect("relay task");
    assert!(res.is_err(), "{res:?}");
}

/// The peer resets the stream after taking part of an upload and answering a little: the
/// relay ends with the error and the bytes both directions moved until then.
#[tokio::test]
async fn a_reset_mid_transfer_keeps_the_bytes_moved() {
    const TAKEN: usize = 256 * 1024;
    let ((c_send, c_recv), (mut s_send, mut s_recv)) = h2_pair().await;
    let (app, proxy_side) = tcp_pair().await;
    let relay = tokio::spawn(relay_h2(proxy_side, c_send, c_recv));
    let (mut r, mut w) = app.into_split();
    s_send
        .send_data(Bytes::from(vec![1u8; 1000]), false)
        .expect("answer");
    let mut answer = vec![0u8; 1000];
    r.read_exact(&mut answer).await.expect("answer read");
    let upload = tokio::spawn(async move {
        let _ = w.write_all(&vec![2u8; 4 << 20]).await;
        w
    });
    let mut got = 0;
    while got < TAKEN {
        let chunk = s_recv.data().await.expect("data").expect("ok");
        s_recv
            .flow_control()
            .release_capacity(chunk.len())
            .expect("release");
        got += chunk.len();
    }
    s_send.send_reset(h2::Reason::INTERNAL_ERROR);
    let err = reset_error(relay, TAKEN).await;
    assert!(err.transferred.sent <= 4 << 20, "{err}");
    assert_eq!(err.transferred.received, 1000, "{err}");
    assert!(err.to_string().contains("bytes sent"), "{err}");
    drop(r);
    upload.abort();
}

/// A plain relay carrying bulk data (a writer thread far ahead, a reader thread keeping up)
/// on a one-thread runtime: another task gets the thread back after every bulk chunk, never
/// more than one chunk ([`LARGE_BUF`] at most) later.
#[test]
fn a_plain_relay_yields_after_each_bulk_chunk() {
    use std::io::{Read, Write};
    const TOTAL: usize = 64 << 20;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (src_app, proxy_in) = tcp_pair().await;
        let (proxy_out, dst_app) = tcp_pair().await;
        let mut src = src_app.into_std().expect("std");
        let mut dst = dst_app.into_std().expect("std");
        src.set_nonblocking(false).expect("blocking");
        dst.set_nonblocking(false).expect("blocking");
        // nothing comes back: the other direction ends at once
        dst.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let writer = std::thread::spawn(move || {
            let chunk = vec![7u8; 1 << 20];
            for _ in 0..TOTAL / chunk.len() {
                src.write_all(&chunk).expect("write");
            }
            src.shutdown(std::net::Shutdown::Write).expect("shutdown");
            src
        });
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0;
            loop {
                match dst.read(&mut buf).expect("read") {
                    0 => return got,
                    n => got += n,
                }
            }
        });
        let counts = Arc::new(LiveCounts::default());
        let shared = counts.clone();
        let relay =
            tokio::spawn(async move { relay_tcp_counted(proxy_in, proxy_out, &shared).await });
        let (mut last, mut widest) = (0, 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !relay.is_finished() {
            assert!(std::time::Instant::now() < deadline, "relay still running");
            tokio::task::yield_now().await;
            let now = counts.get().sent;
            widest = widest.max(now - last);
            last = now;
        }
        relay.await.expect("task").expect("relay");
        let _src = writer.join().expect("writer");
        assert_eq!(reader.join().expect("reader"), TOTAL);
        assert!(
            widest <= LARGE_BUF as u64,
            "{widest} bytes relayed between two turns of another task"
        );
    });
}

/// The remote of a plain relay reads part of an upload, then closes with a reset (SO_LINGER
/// 0): the relay ends with the error and what it moved both ways.
#[tokio::test]
async fn a_plain_relay_reset_mid_transfer_keeps_the_bytes_moved() {
    const TAKEN: usize = 256 * 1024;
    let (app, local) = tcp_pair().await;
    let (remote, mut server) = tcp_pair().await;
    let relay = tokio::spawn(relay_tcp(local, remote));
    server.write_all(b"hello").await.expect("greet");
    let (mut r, mut w) = app.into_split();
    let mut hello = [0u8; 5];
    r.read_exact(&mut hello).await.expect("greeting");
    let upload = tokio::spawn(async move {
        let _ = w.write_all(&vec![3u8; 4 << 20]).await;
        let _ = w.shutdown().await;
        w
    });
    let mut buf = vec![0u8; TAKEN];
    server
        .read_exact(&mut buf)
        .await
        .expect("part of the upload");
    socket2::SockRef::from(&server)
        .set_linger(Some(std::time::Duration::ZERO))
        .expect("SO_LINGER 0");
    drop(server);
    let err = reset_error(relay, TAKEN).await;
    assert_eq!(err.transferred.received, 5, "{err}");
    drop(r);
    upload.abort();
}

/// The error a relay task ended with after a reset, having sent at least the `taken` bytes the
/// peer read before it.
async fn reset_error(
    relay: tokio::task::JoinHandle<Result<Transferred, CopyError>>,
    taken: usize,
) -> CopyError {
    let err = relay
        .await
        .expect("relay task")
        .expect_err("a reset ends the relay with an error");
    assert!(
        err.transferred.sent >= taken as u64,
        "sent {} < {taken}: {err}",
        err.transferred.sent
    );
    err
}

/// Waits until `s` has seen the peer's FIN or reset (up to 5 s), reading nothing.
async fn read_closed(s: &TcpStream) {
    let wait = async {
        loop {
            let ready = s.ready(tokio::io::Interest::READABLE).await.expect("ready");
            if ready.is_read_closed() {
                return;
            }
            // stale readiness (from an earlier read): clear it so the next wait polls epoll
            let _ = s.try_io(tokio::io::Interest::READABLE, || {
                Err::<(), _>(io::ErrorKind::WouldBlock.into())
            });
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), wait)
        .await
        .expect("FIN or reset seen");
}

#[tokio::test]
async fn early_data_takes_what_the_app_sent_without_waiting() {
    let (mut app, proxy_side) = tcp_pair().await;
    assert_eq!(
        early_data(&proxy_side).expect("read"),
        None,
        "nothing sent yet"
    );
    app.write_all(b"GET / HTTP/1.1\r\n\r\n")
        .await
        .expect("write");
    proxy_side.readable().await.expect("readable");
    assert_eq!(
        early_data(&proxy_side).expect("read").as_deref(),
        Some(&b"GET / HTTP/1.1\r\n\r\n"[..])
    );
    // That short read drained the socket: no readiness is left for a read that would only
    // say EAGAIN; the next bytes bring it back.
    assert!(
        futures::poll!(std::pin::pin!(proxy_side.readable())).is_pending(),
        "readiness left after a short read"
    );
    app.write_all(b"more").await.expect("write");
    proxy_side.readable().await.expect("readable again");
    let mut more = [0u8; 8];
    assert_eq!(proxy_side.try_read(&mut more).expect("read"), 4);
    app.shutdown().await.expect("fin");
    read_closed(&proxy_side).await;
    assert_eq!(
        early_data(&proxy_side).expect("read"),
        None,
        "EOF is left to the relay"
    );
    let mut rest = [0u8; 1];
    assert_eq!(
        proxy_side.try_read(&mut rest).expect("eof"),
        0,
        "which finds it"
    );
}

#[tokio::test]
async fn early_data_of_one_connection_never_carries_another_ones_bytes() {
    // The read buffer is the thread's, kept between connections.
    let (mut first_app, first) = tcp_pair().await;
    first_app.write_all(&[b'a'; 3000]).await.expect("write");
    first.readable().await.expect("readable");
    let first_data = early_data(&first).expect("read").expect("bytes");
    assert_eq!(first_data.len(), 3000, "one short read takes all of it");
    assert!(first_data.iter().all(|&b| b == b'a'));
    let (mut second_app, second) = tcp_pair().await;
    second_app.write_all(b"bb").await.expect("write");
    second.readable().await.expect("readable");
    assert_eq!(
        early_data(&second).expect("read").as_deref(),
        Some(&b"bb"[..])
    );
}

#[tokio::test]
async fn early_data_takes_only_the_bytes_read_from_a_used_buffer() {
    let (mut app, proxy_side) = tcp_pair().await;
    app.write_all(b"bb").await.expect("write");
    proxy_side.readable().await.expect("readable");
    let mut used = vec![0xff; SMALL_BUF];
    assert_eq!(
        early_data_into(&proxy_side, &mut used)
            .expect("read")
            .as_deref(),
        Some(&b"bb"[..])
    );
}

#[tokio::test]
async fn early_data_reports_a_reset_by_the_app() {
    let (app, proxy_side) = tcp_pair().await;
    crate::proxy::socket::reset(app);
    read_closed(&proxy_side).await;
    let e = early_data(&proxy_side).expect_err("the reset");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
}
