//! ZDS server and client over a real SOCK_SEQPACKET socket in a tempdir, with a fake proxy behind the
//! client (a task answering the in-process channel) and raw peers for the wire-level checks.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::packet::{self, PacketError, SeqPacket};
use super::proto::{self, workload_request::Payload};
use super::server::{self, ZdsServer};
use super::{InProcessSender, WorkloadInfo, WorkloadRequest, ZdsError, client};
use crate::netns::{Netns, NetnsId};

/// Upper bound for any wait, so a broken test fails instead of hanging (not a timing assertion).
const WAIT: Duration = Duration::from_secs(10);

/// What the fake proxy was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Add(String, WorkloadInfo, NetnsId),
    Del(String),
    Keep(String),
    SnapshotSent,
}

/// A fake proxy: records every request and nacks the uids in `nacks` with their text.
fn fake_proxy(nacks: HashMap<String, String>) -> (InProcessSender, mpsc::UnboundedReceiver<Seen>) {
    let (link, mut rx) = super::in_process();
    let (tx, seen) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some((req, ack)) = rx.recv().await {
            let nack = req.uid().and_then(|u| nacks.get(u)).cloned();
            let _ = tx.send(match req {
                WorkloadRequest::Add { uid, info, netns } => Seen::Add(uid, info, netns.id()),
                WorkloadRequest::Del { uid } => Seen::Del(uid),
                WorkloadRequest::Keep { uid } => Seen::Keep(uid),
                WorkloadRequest::SnapshotSent => Seen::SnapshotSent,
            });
            let _ = ack.send(nack.map_or(Ok(()), |text| Err(super::Nack::new(text))));
        }
    });
    (link, seen)
}

fn info(name: &str) -> WorkloadInfo {
    WorkloadInfo {
        name: name.into(),
        namespace: "default".into(),
        service_account: format!("sa-{name}"),
    }
}

fn add(uid: &str) -> WorkloadRequest {
    WorkloadRequest::Add {
        uid: uid.into(),
        info: info(uid),
        netns: Netns::current().expect("own netns"),
    }
}

fn del(uid: &str) -> WorkloadRequest {
    WorkloadRequest::Del { uid: uid.into() }
}

fn seen_add(uid: &str) -> Seen {
    Seen::Add(
        uid.into(),
        info(uid),
        Netns::current().expect("own netns").id(),
    )
}

/// A server listening in a tempdir; stops when dropped.
struct Agent {
    server: Arc<ZdsServer>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Agent {
    fn start(path: &Path) -> Agent {
        let server = ZdsServer::new();
        Agent::with(server, path)
    }

    fn with(server: Arc<ZdsServer>, path: &Path) -> Agent {
        let listener = server::bind(path).expect("bind");
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(server.clone().serve(listener, async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        Agent { server, stop, task }
    }

    async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    async fn wait_connections(&self, n: usize) {
        tokio::time::timeout(WAIT, async {
            while self.server.connections() != n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("expected {n} connections"));
    }
}

fn spawn_client(path: &Path, link: InProcessSender) -> JoinHandle<Result<(), client::ClientError>> {
    spawn_watched_client(path, link).0
}

/// [`spawn_client`], plus whether it is connected (its `on_connection` reports).
fn spawn_watched_client(
    path: &Path,
    link: InProcessSender,
) -> (
    JoinHandle<Result<(), client::ClientError>>,
    watch::Receiver<bool>,
) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(client::run(
        path.to_owned(),
        link,
        std::future::pending(),
        move |up| {
            let _ = tx.send(up);
        },
    ));
    (task, rx)
}

/// Waits until the watched client's connection state is `up`.
async fn wait_connected(rx: &mut watch::Receiver<bool>, up: bool) {
    tokio::time::timeout(WAIT, rx.wait_for(|u| *u == up))
        .await
        .unwrap_or_else(|_| panic!("client never reported connected = {up}"))
        .expect("client alive");
}

async fn next(seen: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(WAIT, seen.recv())
        .await
        .expect("fake proxy saw nothing")
        .expect("fake proxy channel open")
}

async fn expect_seen(seen: &mut mpsc::UnboundedReceiver<Seen>, want: &[Seen]) {
    for w in want {
        assert_eq!(&next(seen).await, w);
    }
}

fn sock_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("run").join("ztunnel.sock")
}

#[tokio::test]
async fn snapshot_then_steady_state_adds_dels_and_nacks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let agent = Agent::start(&path);
    let mode = std::fs::metadata(&path).expect("socket file").permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );

    // no proxy yet: adds fail closed but are remembered for the snapshot
    for uid in ["pod-b", "pod-a"] {
        let err = agent.server.send(add(uid)).await.expect_err("no proxy");
        assert!(matches!(err, ZdsError::NoProxy), "{err}");
        assert_eq!(err.to_string(), "no ztunnel connection");
    }
    assert_eq!(agent.server.pods(), ["pod-a", "pod-b"]);

    let nacks = HashMap::from([("pod-bad".to_owned(), "no such workload".to_owned())]);
    let (link, mut seen) = fake_proxy(nacks);
    let client = spawn_client(&path, link);
    expect_seen(
        &mut seen,
        &[seen_add("pod-a"), seen_add("pod-b"), Seen::SnapshotSent],
    )
    .await;

    agent.server.send(add("pod-c")).await.expect("add acked");
    expect_seen(&mut seen, &[seen_add("pod-c")]).await;
    let err = agent.server.send(add("pod-bad")).await.expect_err("nack");
    match err {
        ZdsError::Nack(nack) => assert_eq!(nack.message, "no such workload"),
        other => panic!("expected a nack, got {other}"),
    }
    expect_seen(&mut seen, &[seen_add("pod-bad")]).await;
    agent.server.send(del("pod-a")).await.expect("del acked");
    expect_seen(&mut seen, &[Seen::Del("pod-a".into())]).await;
    assert_eq!(agent.server.pods(), ["pod-b", "pod-bad", "pod-c"]);
    let err = agent
        .server
        .send(WorkloadRequest::SnapshotSent)
        .await
        .expect_err("not forwarded");
    assert!(
        matches!(err, ZdsError::NotForwarded("SnapshotSent")),
        "{err}"
    );
    client.abort();
    agent.shutdown().await;
}

#[tokio::test]
async fn adds_go_to_the_latest_connection_and_dels_to_all() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let agent = Agent::start(&path);
    let (link1, mut seen1) = fake_proxy(HashMap::new());
    let c1 = spawn_client(&path, link1);
    expect_seen(&mut seen1, &[Seen::SnapshotSent]).await;
    let (link2, mut seen2) = fake_proxy(HashMap::new());
    let c2 = spawn_client(&path, link2);
    expect_seen(&mut seen2, &[Seen::SnapshotSent]).await;
    agent.wait_connections(2).await;

    agent.server.send(add("x")).await.expect("add");
    expect_seen(&mut seen2, &[seen_add("x")]).await;
    agent.server.send(del("x")).await.expect("del");
    expect_seen(&mut seen2, &[Seen::Del("x".into())]).await;
    // the older connection saw only the delete
    expect_seen(&mut seen1, &[Seen::Del("x".into())]).await;

    // the latest proxy goes away: adds fall back to the previous connection
    c2.abort();
    agent.wait_connections(1).await;
    agent.server.send(add("y")).await.expect("add");
    expect_seen(&mut seen1, &[seen_add("y")]).await;
    c1.abort();
    agent.wait_connections(0).await;
    let err = agent.server.send(del("y")).await;
    assert!(err.is_ok(), "del without connections succeeds: {err:?}");
    agent.shutdown().await;
}

#[tokio::test]
async fn reconnect_resends_the_snapshot_and_drops_stale_workloads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let agent = Agent::start(&path);
    let (link, mut seen) = fake_proxy(HashMap::new());
    let (client, mut connected) = spawn_watched_client(&path, link);
    expect_seen(&mut seen, &[Seen::SnapshotSent]).await;
    wait_connected(&mut connected, true).await;
    agent.server.send(add("a")).await.expect("add a");
    agent.server.send(add("b")).await.expect("add b");
    expect_seen(&mut seen, &[seen_add("a"), seen_add("b")]).await;

    // the agent restarts with only pod a (b went away while it was down): the client reports the
    // lost connection, reconnects, gets a in the snapshot and stops b
    agent.shutdown().await;
    wait_connected(&mut connected, false).await;
    let server = ZdsServer::new();
    assert!(matches!(
        server.send(add("a")).await,
        Err(ZdsError::NoProxy)
    ));
    let agent = Agent::with(server, &path);
    expect_seen(
        &mut seen,
        &[seen_add("a"), Seen::Del("b".into()), Seen::SnapshotSent],
    )
    .await;
    wait_connected(&mut connected, true).await;

    // the proxy restarts: a new connection gets the full snapshot again
    agent.server.send(add("c")).await.expect("add c");
    expect_seen(&mut seen, &[seen_add("c")]).await;
    client.abort();
    agent.wait_connections(0).await;
    let (link, mut seen) = fake_proxy(HashMap::new());
    let client = spawn_client(&path, link);
    expect_seen(
        &mut seen,
        &[seen_add("a"), seen_add("c"), Seen::SnapshotSent],
    )
    .await;
    client.abort();
    agent.shutdown().await;
}

/// A raw agent: accepts one connection and checks the hello bytes.
async fn raw_accept(listener: &packet::SeqPacketListener) -> SeqPacket {
    let sock = tokio::time::timeout(WAIT, listener.accept())
        .await
        .expect("client connects")
        .expect("accept");
    let hello = sock.recv().await.expect("hello").expect("open");
    assert_eq!(hello.data, [0x08, 0x01], "ZdsHello{{version: V1}}");
    assert!(hello.fds.is_empty());
    sock
}

async fn raw_ack(sock: &SeqPacket) -> String {
    let resp: proto::WorkloadResponse = tokio::time::timeout(WAIT, sock.recv_msg("response"))
        .await
        .expect("ack in time")
        .expect("ack");
    match resp.payload {
        Some(proto::workload_response::Payload::Ack(a)) => a.error,
        None => panic!("response without ack"),
    }
}

/// An Add of pod `uid` in `default` with service account `sa` (`None`: without `workload_info`).
fn raw_add(uid: &str, sa: Option<&str>) -> proto::WorkloadRequest {
    proto::WorkloadRequest::new(Payload::Add(proto::AddWorkload {
        uid: uid.into(),
        workload_info: sa.map(|sa| proto::WorkloadInfo {
            name: uid.into(),
            namespace: "default".into(),
            service_account: sa.into(),
        }),
    }))
}

#[tokio::test]
async fn client_checks_fds_and_sizes_and_reconnects_after_bad_messages() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let listener = server::bind(&path).expect("bind");
    let (link, mut seen) = fake_proxy(HashMap::new());
    let client = spawn_client(&path, link);
    let ns = Netns::current().expect("own netns");

    let sock = raw_accept(&listener).await;
    sock.send(&raw_add("ok", Some("sa")), Some(ns.fd()))
        .await
        .expect("send");
    assert_eq!(raw_ack(&sock).await, "");
    assert_eq!(
        next(&mut seen).await,
        Seen::Add(
            "ok".into(),
            WorkloadInfo {
                name: "ok".into(),
                namespace: "default".into(),
                service_account: "sa".into()
            },
            ns.id()
        )
    );
    // Del with an fd is rejected
    let del = proto::WorkloadRequest::new(Payload::Del(proto::DelWorkload { uid: "ok".into() }));
    sock.send(&del, Some(ns.fd())).await.expect("send");
    assert!(
        raw_ack(&sock).await.contains("unexpected control message"),
        "nack"
    );
    assert!(
        sock.recv().await.expect("recv").is_none(),
        "client hangs up"
    );

    // Add without fd: nack, then reconnect with a fresh hello
    let sock = raw_accept(&listener).await;
    sock.send(&raw_add("nofd", Some("sa")), None)
        .await
        .expect("send");
    let nack = raw_ack(&sock).await;
    assert!(nack.contains("no control message"), "{nack}");
    assert!(
        sock.recv().await.expect("recv").is_none(),
        "client hangs up"
    );

    // a datagram over 1024 bytes is truncated: nack and reconnect
    let sock = raw_accept(&listener).await;
    sock.send_bytes(&[0u8; packet::MAX_MESSAGE + 100], None)
        .await
        .expect("send");
    let nack = raw_ack(&sock).await;
    assert!(nack.contains("truncated"), "{nack}");
    assert!(
        sock.recv().await.expect("recv").is_none(),
        "client hangs up"
    );

    // nothing of the rejected requests reached the proxy
    let sock = raw_accept(&listener).await;
    let snap = proto::WorkloadRequest::new(Payload::SnapshotSent(proto::SnapshotSent {}));
    sock.send(&snap, None).await.expect("send");
    assert_eq!(raw_ack(&sock).await, "");
    // "ok" was not named by this connection's (empty) snapshot
    expect_seen(&mut seen, &[Seen::Del("ok".into()), Seen::SnapshotSent]).await;

    // protocol error: Add without workload_info is nacked and ends the client
    sock.send(&raw_add("noinfo", None), Some(ns.fd()))
        .await
        .expect("send");
    let nack = raw_ack(&sock).await;
    assert!(nack.contains("without workload_info"), "{nack}");
    let end = tokio::time::timeout(WAIT, client)
        .await
        .expect("client ends")
        .expect("join");
    assert!(
        matches!(end, Err(client::ClientError::NoWorkloadInfo { .. })),
        "{end:?}"
    );
}

#[tokio::test]
async fn server_sends_fds_with_adds_only_and_rejects_bad_responses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let agent = Agent::start(&path);
    let ns = Netns::current().expect("own netns");
    let _ = agent.server.send(add("snap")).await;

    let sock = packet::connect(&path).expect("connect");
    sock.send(
        &proto::ZdsHello {
            version: proto::Version::V1 as i32,
        },
        None,
    )
    .await
    .expect("hello");
    let pkt = sock.recv().await.expect("snapshot add").expect("open");
    assert_eq!(
        proto::WorkloadRequest::decode(pkt.data.as_slice()).expect("decode"),
        raw_add("snap", Some("sa-snap"))
    );
    assert_eq!(pkt.fds.len(), 1);
    let got = Netns::from_file(std::fs::File::from(pkt.fds.into_iter().next().expect("fd")))
        .expect("fd is a netns");
    assert_eq!(got.id(), ns.id());
    assert_ne!(got.raw_fd(), ns.raw_fd(), "a fresh fd");
    sock.send(&proto::WorkloadResponse::ack(""), None)
        .await
        .expect("ack");
    let pkt = sock.recv().await.expect("snapshot sent").expect("open");
    assert_eq!(pkt.data, [0x1a, 0x00]);
    assert!(pkt.fds.is_empty());
    sock.send(&proto::WorkloadResponse::ack(""), None)
        .await
        .expect("ack");

    // a Del carries no fd; a response over 1024 bytes fails the request and drops the connection
    let server = agent.server.clone();
    let pending = tokio::spawn(async move { server.send(del("snap")).await });
    let pkt = sock.recv().await.expect("del").expect("open");
    assert_eq!(pkt.data, [0x12, 0x06, 0x12, 0x04, b's', b'n', b'a', b'p']);
    assert!(pkt.fds.is_empty());
    sock.send_bytes(&[0x0a; packet::MAX_MESSAGE + 1], None)
        .await
        .expect("oversized");
    let res = pending.await.expect("join");
    assert!(
        matches!(res, Err(ZdsError::Conn(PacketError::Truncated))),
        "{res:?}"
    );
    agent.wait_connections(0).await;
    assert!(
        sock.recv().await.expect("recv").is_none(),
        "server hangs up"
    );
    agent.shutdown().await;
}

#[tokio::test]
async fn unsolicited_message_from_the_proxy_closes_the_connection() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let agent = Agent::start(&path);
    let sock = raw_proxy(&path, &agent).await;
    sock.send(&proto::WorkloadResponse::ack(""), None)
        .await
        .expect("extra ack");
    agent.wait_connections(0).await;
    assert!(
        sock.recv().await.expect("recv").is_none(),
        "server hangs up"
    );
    agent.shutdown().await;
}

/// A raw proxy connected to `agent` at `path`: hello sent, the (empty) snapshot's SnapshotSent
/// acked, the connection registered.
async fn raw_proxy(path: &Path, agent: &Agent) -> SeqPacket {
    let sock = packet::connect(path).expect("connect");
    sock.send(&proto::ZdsHello { version: 1 }, None)
        .await
        .expect("hello");
    let pkt = sock.recv().await.expect("snapshot sent").expect("open");
    assert_eq!(pkt.data, [0x1a, 0x00]);
    sock.send(&proto::WorkloadResponse::ack(""), None)
        .await
        .expect("ack");
    agent.wait_connections(1).await;
    sock
}

/// An ack that arrives after the agent's deadline (while idle, or while the next request waits)
/// is the late answer of the timed-out request: discarded, not a protocol error, and the next
/// request gets its own ack.
#[tokio::test]
async fn a_late_ack_is_discarded_and_the_connection_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = sock_path(&dir);
    let agent = Agent::start(&path);
    let sock = raw_proxy(&path, &agent).await;

    // "a" is not acked within the deadline
    let server = agent.server.clone();
    let first = tokio::spawn(async move { server.send(add("a")).await });
    let req = sock.recv().await.expect("add a").expect("open");
    assert!(!req.data.is_empty());
    let res = tokio::time::timeout(WAIT + server::OP_TIMEOUT, first)
        .await
        .expect("the agent gives up")
        .expect("task");
    assert!(
        matches!(res, Err(ZdsError::Conn(PacketError::Timeout { .. }))),
        "{res:?}"
    );
    // its ack arrives late, while the agent is idle: the connection stays
    sock.send(&proto::WorkloadResponse::ack(""), None)
        .await
        .expect("late ack");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        agent.server.connections(),
        1,
        "a late ack is not a protocol error"
    );

    // "b" times out too, and its late ack comes just before the ack of "c": "c" gets its own
    let server = agent.server.clone();
    let second = tokio::spawn(async move { server.send(add("b")).await });
    sock.recv().await.expect("add b").expect("open");
    let res = tokio::time::timeout(WAIT + server::OP_TIMEOUT, second)
        .await
        .expect("the agent gives up")
        .expect("task");
    assert!(res.is_err(), "{res:?}");
    let server = agent.server.clone();
    let third = tokio::spawn(async move { server.send(add("c")).await });
    sock.recv().await.expect("add c").expect("open");
    sock.send(&proto::WorkloadResponse::ack(""), None)
        .await
        .expect("late ack of b");
    sock.send(&proto::WorkloadResponse::ack("c is refused"), None)
        .await
        .expect("ack of c");
    let res = tokio::time::timeout(WAIT, third)
        .await
        .expect("c answered")
        .expect("task");
    assert!(
        matches!(&res, Err(ZdsError::Nack(n)) if n.to_string().contains("c is refused")),
        "c's own answer, not b's late one: {res:?}"
    );
    assert_eq!(agent.server.connections(), 1);
    agent.shutdown().await;
}
