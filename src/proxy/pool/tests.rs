//! Pool logic over in-memory peers: reuse, the cap on open streams, the one retry after an
//! unprocessed stream, and the release of unused connections (paused time).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::watch;

use super::*;

/// How one dialed fake peer treats CONNECT streams.
#[derive(Debug, Clone, Copy)]
enum Peer {
    /// Answers every stream 200.
    Accept,
    /// Resets every stream with REFUSED_STREAM.
    Refuse,
    /// Answers the first HEADERS with GOAWAY(last_stream_id = 0): nothing was processed.
    GoAway,
    /// Waits for the stream's first DATA before it answers 200, then sends that data back and
    /// ends the stream: a client that holds its data until the response never gets one.
    EarlyEcho,
}

/// Dials in-memory peers, one behaviour per dial (the last one repeats), and records when each
/// accepted connection closes.
#[derive(Debug)]
struct FakeConnector {
    plan: Mutex<VecDeque<Peer>>,
    dials: AtomicUsize,
    closed: Mutex<Vec<watch::Receiver<bool>>>,
}

impl FakeConnector {
    fn new(plan: &[Peer]) -> FakeConnector {
        FakeConnector {
            plan: Mutex::new(plan.iter().copied().collect()),
            dials: AtomicUsize::new(0),
            closed: Mutex::new(Vec::new()),
        }
    }

    fn dials(&self) -> usize {
        self.dials.load(Ordering::SeqCst)
    }

    /// Closed-flag of the `n`th dialed connection.
    fn closed(&self, n: usize) -> watch::Receiver<bool> {
        self.closed.lock().expect("closed")[n].clone()
    }
}

impl Connector for FakeConnector {
    type Io = DuplexStream;

    async fn connect(&self, _key: &PoolKey) -> Result<DuplexStream, PoolError> {
        self.dials.fetch_add(1, Ordering::SeqCst);
        let peer = {
            let mut plan = self.plan.lock().expect("plan");
            if plan.len() > 1 {
                plan.pop_front()
            } else {
                plan.front().copied()
            }
        }
        .expect("a plan");
        let (client, server) = tokio::io::duplex(1 << 20);
        let (closed_tx, closed_rx) = watch::channel(false);
        self.closed.lock().expect("closed").push(closed_rx);
        tokio::spawn(async move {
            match peer {
                Peer::Accept | Peer::Refuse | Peer::EarlyEcho => h2_peer(server, peer).await,
                Peer::GoAway => goaway_peer(server).await,
            }
            let _ = closed_tx.send(true);
        });
        Ok(client)
    }
}

async fn h2_peer(io: DuplexStream, peer: Peer) {
    let Ok(mut conn) = crate::proxy::hbone::server_builder()
        .handshake::<_, Bytes>(io)
        .await
    else {
        return;
    };
    while let Some(Ok((req, mut respond))) = conn.accept().await {
        match peer {
            Peer::Refuse => respond.send_reset(h2::Reason::REFUSED_STREAM),
            Peer::EarlyEcho => {
                tokio::spawn(async move {
                    let mut body = req.into_body();
                    let Some(Ok(data)) = body.data().await else {
                        return;
                    };
                    let _ = body.flow_control().release_capacity(data.len());
                    if let Ok(mut send) = respond.send_response(Response::new(()), false) {
                        let _ = send.send_data(data, true);
                    }
                });
            }
            _ => {
                let _ = respond.send_response(Response::new(()), true);
            }
        }
    }
}

fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, 0];
    f.extend_from_slice(payload);
    f
}

/// A raw HTTP/2 server that sends GOAWAY(last_stream_id = 0, NO_ERROR) on the first HEADERS.
async fn goaway_peer(mut io: DuplexStream) {
    const SETTINGS: u8 = 4;
    const HEADERS: u8 = 1;
    const GOAWAY: u8 = 7;
    let mut preface = [0u8; 24];
    if io.read_exact(&mut preface).await.is_err() {
        return;
    }
    if io.write_all(&frame(SETTINGS, 0, &[])).await.is_err() {
        return;
    }
    loop {
        let mut head = [0u8; 9];
        if io.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        if io.read_exact(&mut payload).await.is_err() {
            return;
        }
        let reply = match head[3] {
            SETTINGS if head[4] & 1 == 0 => frame(SETTINGS, 1, &[]),
            HEADERS => frame(GOAWAY, 0, &[0; 8]),
            _ => continue,
        };
        if io.write_all(&reply).await.is_err() {
            return;
        }
    }
}

fn key(dst: &str) -> PoolKey {
    PoolKey {
        src: Identity::new("cluster.local", "default", "alice"),
        dst: Identity::new("cluster.local", "default", dst),
        addr: "10.0.0.3:15008".parse().expect("addr"),
    }
}

fn connect_req() -> Request<()> {
    Request::builder()
        .method(http::Method::CONNECT)
        .uri("10.0.0.3:8080")
        .header("forwarded", "for=\"10.0.0.2:40000\"")
        .body(())
        .expect("request")
}

fn pool(plan: &[Peer]) -> Pool<FakeConnector> {
    Pool::with_connector(FakeConnector::new(plan), PoolConfig::default())
}

/// A CONNECT to `key`, its stream ended right away; the status.
async fn status(pool: &Pool<FakeConnector>, key: &PoolKey) -> Result<http::StatusCode, PoolError> {
    pool.send_request(key, connect_req())
        .await
        .map(|s| s.response.status())
}

/// A CONNECT to `key` answered 200, its stream kept open.
async fn open(pool: &Pool<FakeConnector>, key: &PoolKey) -> PooledStream {
    let s = pool.send_request(key, connect_req()).await.expect("open");
    assert_eq!(s.response.status(), 200);
    s
}

#[tokio::test]
async fn streams_share_one_connection() {
    let pool = pool(&[Peer::Accept]);
    for _ in 0..3 {
        assert_eq!(status(&pool, &key("bob")).await.expect("ok"), 200);
    }
    assert_eq!(pool.connector.dials(), 1);
}

#[tokio::test]
async fn refused_stream_is_retried_once_on_a_fresh_connection() {
    let pool = pool(&[Peer::Refuse, Peer::Accept]);
    assert_eq!(status(&pool, &key("bob")).await.expect("retried"), 200);
    assert_eq!(pool.connector.dials(), 2);
    // the fresh connection replaced the refusing one in the pool
    assert_eq!(status(&pool, &key("bob")).await.expect("pooled"), 200);
    assert_eq!(pool.connector.dials(), 2);
}

#[tokio::test]
async fn goaway_excluding_the_stream_is_retried_on_a_fresh_connection() {
    let pool = pool(&[Peer::GoAway, Peer::Accept]);
    assert_eq!(status(&pool, &key("bob")).await.expect("retried"), 200);
    assert_eq!(pool.connector.dials(), 2);
}

#[tokio::test]
async fn a_second_refusal_is_returned_not_retried_again() {
    let pool = pool(&[Peer::Refuse]);
    let err = status(&pool, &key("bob")).await.expect_err("refused twice");
    assert!(
        matches!(&err, PoolError::Stream { source, .. } if source.reason() == Some(h2::Reason::REFUSED_STREAM)),
        "{err:?}"
    );
    assert_eq!(pool.connector.dials(), 2);
}

#[tokio::test(start_paused = true)]
async fn unused_connections_are_released_and_their_keys_pruned() {
    let pool = pool(&[Peer::Accept]);
    let (a, b) = (key("bob"), key("carol"));
    assert_eq!(status(&pool, &a).await.expect("a"), 200);
    assert_eq!(status(&pool, &b).await.expect("b"), 200);
    assert_eq!((pool.len(), pool.connector.dials()), (2, 2));

    tokio::time::sleep(POOL_UNUSED_RELEASE_TIMEOUT - Duration::from_secs(60)).await;
    assert_eq!(pool.sweep(), 0, "both used within the timeout");
    assert_eq!(status(&pool, &a).await.expect("a again"), 200);
    assert_eq!(pool.connector.dials(), 2, "a reused its connection");

    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(pool.sweep(), 1, "b unused for longer than the timeout");
    assert_eq!(pool.len(), 1);

    // the released connection closes (its last handle is gone); a's stays open
    let mut b_closed = pool.connector.closed(1);
    tokio::time::timeout(Duration::from_secs(5), b_closed.wait_for(|c| *c))
        .await
        .expect("b's connection closed")
        .expect("flag");
    assert!(!*pool.connector.closed(0).borrow(), "a must stay open");

    assert_eq!(status(&pool, &b).await.expect("b again"), 200);
    assert_eq!(pool.connector.dials(), 3, "b dialed anew");
}

#[tokio::test]
async fn sweep_drops_keys_whose_dial_failed() {
    #[derive(Debug)]
    struct Unreachable;
    impl Connector for Unreachable {
        type Io = DuplexStream;
        async fn connect(&self, key: &PoolKey) -> Result<DuplexStream, PoolError> {
            Err(PoolError::Connect {
                addr: key.addr,
                source: SocketError::Io {
                    op: "connect".into(),
                    source: std::io::ErrorKind::ConnectionRefused.into(),
                },
            })
        }
    }
    let pool = Pool::with_connector(Unreachable, PoolConfig::default());
    for dst in ["bob", "carol", "dave"] {
        assert!(pool.send_request(&key(dst), connect_req()).await.is_err());
    }
    assert_eq!(pool.len(), 3);
    assert_eq!(pool.sweep(), 3);
    assert!(pool.is_empty());
}

/// The cap is on streams open at once (ztunnel's `stream_count` goes down as streams end): 101
/// streams held open need a second connection; once they have ended, any number of later streams
/// ride the pooled connections without a new dial (a cap on streams over a connection's life
/// dialed 5 times here).
#[tokio::test]
async fn the_stream_cap_counts_open_streams_not_streams_ever_opened() {
    let pool = pool(&[Peer::Accept]);
    let k = key("bob");
    let mut streams = Vec::new();
    for _ in 0..101 {
        streams.push(open(&pool, &k).await);
    }
    assert_eq!(
        pool.connector.dials(),
        2,
        "100 streams per connection at once"
    );
    assert_eq!(pool.connections(&k), 2);
    drop(streams);
    for _ in 0..300 {
        assert_eq!(status(&pool, &k).await.expect("reuse"), 200);
    }
    assert_eq!(pool.connector.dials(), 2, "ended streams free their slots");
}

/// `POOL_MAX_STREAMS_PER_CONNECTION` sets the cap; new streams fill the oldest connection with
/// room first, and a stream that ends frees its place on its own connection.
#[tokio::test]
async fn the_configured_cap_applies_and_the_oldest_connection_fills_first() {
    let config = PoolConfig {
        max_streams_per_connection: 2,
        ..PoolConfig::default()
    };
    let pool = Pool::with_connector(FakeConnector::new(&[Peer::Accept]), config);
    let k = key("bob");
    let a = open(&pool, &k).await;
    let b = open(&pool, &k).await;
    let c = open(&pool, &k).await;
    assert_eq!(
        pool.connector.dials(),
        2,
        "a third stream needs a second connection"
    );
    drop(a);
    let d = open(&pool, &k).await;
    assert_eq!(
        pool.connector.dials(),
        2,
        "a's place on the first connection is free"
    );
    let e = open(&pool, &k).await;
    assert_eq!(pool.connector.dials(), 2, "the second connection had room");
    let f = open(&pool, &k).await;
    assert_eq!(pool.connector.dials(), 3, "both full");
    drop((b, c, d, e, f));
}

/// A connection is released only once no stream is open on it and none started or ended on it
/// for the configured timeout; the key goes with its last connection.
#[tokio::test(start_paused = true)]
async fn a_connection_is_released_after_the_configured_unused_timeout() {
    let config = PoolConfig {
        unused_release_timeout: Duration::from_secs(10),
        ..PoolConfig::default()
    };
    let pool = Pool::with_connector(FakeConnector::new(&[Peer::Accept]), config);
    let k = key("bob");
    let long = open(&pool, &k).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(pool.sweep(), 0, "a stream is open on it");
    drop(long);
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert_eq!(pool.sweep(), 0, "its stream ended 9 s ago");
    assert_eq!(status(&pool, &k).await.expect("reuse"), 200);
    assert_eq!(pool.connector.dials(), 1);
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(pool.sweep(), 1, "unused for 11 s");
    assert!(pool.is_empty());
    let mut closed = pool.connector.closed(0);
    tokio::time::timeout(Duration::from_secs(5), closed.wait_for(|c| *c))
        .await
        .expect("the released connection closed")
        .expect("flag");
    assert_eq!(status(&pool, &k).await.expect("anew"), 200);
    assert_eq!(pool.connector.dials(), 2);
    assert_eq!(config.sweep_interval(), Duration::from_secs(5));
    assert_eq!(
        PoolConfig::default().sweep_interval(),
        POOL_SWEEP_INTERVAL,
        "5 min: every 30 s"
    );
}

/// Shutdown: the pooled connection closes once its open stream ended (not before), and every
/// later stream gets a connection of its own that closes with it.
#[tokio::test]
async fn a_drained_pool_lets_go_of_its_connections_and_pools_nothing_new() {
    let pool = pool(&[Peer::Accept]);
    let bob = key("bob");
    let open_stream = open(&pool, &bob).await;
    let mut first = pool.connector.closed(0);
    pool.drain();
    assert!(pool.is_empty(), "no key pooled after the drain");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!*first.borrow(), "the open stream keeps its connection");
    drop(open_stream);
    tokio::time::timeout(std::time::Duration::from_secs(5), first.wait_for(|c| *c))
        .await
        .expect("the connection closes after its last stream")
        .expect("closed flag");
    for n in 1..=2 {
        assert_eq!(status(&pool, &bob).await.expect("ok"), 200);
        assert_eq!(pool.connector.dials(), n + 1, "a connection per stream");
        let mut closed = pool.connector.closed(n);
        tokio::time::timeout(std::time::Duration::from_secs(5), closed.wait_for(|c| *c))
            .await
            .expect("closed with its stream")
            .expect("closed flag");
    }
    assert!(pool.is_empty());
}

/// The response body of `s`, to its end.
async fn body_of(s: PooledStream) -> Vec<u8> {
    let mut body = s.response.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("data");
        let _ = body.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    got
}

/// A CONNECT to `bob` with `early` data, answered within 5 s (an [`Peer::EarlyEcho`] peer answers
/// only once the early data arrived).
async fn open_with_early(pool: &Pool<FakeConnector>, early: &'static [u8]) -> PooledStream {
    tokio::time::timeout(
        Duration::from_secs(5),
        pool.send_request_with(&key("bob"), connect_req(), Some(Bytes::from_static(early))),
    )
    .await
    .expect("answered: the early data arrived before the response")
    .expect("stream")
}

#[tokio::test]
async fn early_data_reaches_the_peer_before_the_response() {
    let pool = pool(&[Peer::EarlyEcho]);
    let s = open_with_early(&pool, b"hello").await;
    assert_eq!(s.response.status(), 200);
    assert_eq!(body_of(s).await, b"hello");
}

#[tokio::test]
async fn a_retried_stream_carries_the_early_data_again() {
    let pool = pool(&[Peer::Refuse, Peer::EarlyEcho]);
    let s = open_with_early(&pool, b"again").await;
    assert_eq!(
        pool.connector.dials(),
        2,
        "refused, then a fresh connection"
    );
    assert_eq!(body_of(s).await, b"again");
}
