//! The agent side of the ZDS socket (istio-cni `ztunnelserver.go`, `../shared/spec/istio-cni.md`
//! §3.8): proxies connect, the agent pushes workloads.
//!
//! Per connection: register it (so adds can queue), read `ZdsHello` (5 s), send the snapshot (one
//! `AddWorkload` with the netns fd per held pod, then `SnapshotSent`, each waiting for its ack; a nack
//! during the snapshot is only logged), then serve queued requests in strict request/ack lock-step,
//! each write and each ack read with a 5 s deadline. Adds go to the newest connection, deletes to all.
//! While idle, any datagram from the proxy is a protocol error and end-of-stream closes the connection
//! (the proxy never sends unsolicited messages), which replaces Istio's periodic 10 ms read probe.
//! Accepts are rate-limited to 5 per second.

use std::collections::BTreeMap;
use std::future::Future;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use super::packet::{self, PacketError, SeqPacket, SeqPacketListener};
use super::proto::{self, workload_request::Payload, workload_response};
use super::{Nack, WorkloadInfo, WorkloadRequest, ZdsError};
use crate::netns::Netns;

/// Deadline of each write and of each ack or hello read (Istio `readWriteDeadline`).
pub const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Minimum spacing of accepts (Istio: 5 per second, burst 1).
const ACCEPT_INTERVAL: Duration = Duration::from_millis(200);
/// Queued requests per connection (Istio's updates channel).
const QUEUE: usize = 100;

/// Errors of the agent's ZDS server: setting up the socket, or why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Preparing the socket path failed.
    #[error("ZDS socket {path}: {what}: {source}")]
    Setup {
        /// The socket path.
        path: PathBuf,
        /// What was attempted.
        what: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Binding the socket failed.
    #[error(transparent)]
    Listen(PacketError),
    /// The proxy's `ZdsHello` did not arrive or did not decode.
    #[error("reading ZdsHello: {0}")]
    Hello(#[source] PacketError),
    /// A snapshot message failed (other than by a nack).
    #[error("snapshot {what}: {source}")]
    Snapshot {
        /// Pod uid, or `SnapshotSent`.
        what: String,
        /// Cause.
        #[source]
        source: ZdsError,
    },
    /// The proxy sent a datagram while no request was outstanding.
    #[error("unsolicited message from the proxy ({len} bytes)")]
    Unsolicited {
        /// Datagram length, bytes.
        len: usize,
    },
    /// Watching the idle connection failed.
    #[error("idle connection: {0}")]
    Idle(#[source] PacketError),
    /// A request failed on the connection in a way that leaves it unusable (the caller got the cause).
    #[error("connection dropped after a failed request ({what})")]
    Dropped {
        /// Pod uid or message kind.
        what: String,
    },
}

/// A request queued for one connection.
struct Job {
    msg: proto::WorkloadRequest,
    what: String,
    netns: Option<Netns>,
    reply: oneshot::Sender<Result<(), ZdsError>>,
}

/// A registered connection: where to queue requests for it.
#[derive(Debug, Clone)]
struct ConnHandle {
    id: u64,
    tx: mpsc::Sender<Job>,
}

/// Removes a connection from the registry when its task ends (also when aborted).
struct Registration {
    server: Arc<ZdsServer>,
    id: u64,
}

/// The agent's ZDS server: the pod snapshot and the connected proxies. See the module docs.
///
/// [`ZdsServer::send`] is the agent's "send a request, get the ack" call over the socket; the server
/// remembers every added pod (uid → info and netns fd) until it is deleted, so each new connection
/// gets the full snapshot, also pods whose add failed because no proxy was connected.
#[derive(Debug, Default)]
pub struct ZdsServer {
    snapshot: Mutex<BTreeMap<String, (WorkloadInfo, Netns)>>,
    conns: Mutex<Vec<ConnHandle>>,
    next_id: AtomicU64,
}

/// Prepares `path` and listens on it: creates the parent dir, removes a stale socket, binds a
/// SOCK_SEQPACKET socket and sets mode 0600 (only root proxies may connect).
pub fn bind(path: &Path) -> Result<SeqPacketListener, ServerError> {
    let setup = |what| {
        move |source| ServerError::Setup {
            path: path.to_owned(),
            what,
            source,
        }
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(setup("create parent dir"))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(setup("remove stale socket")(e)),
    }
    let listener = packet::listen(path).map_err(ServerError::Listen)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(setup("chmod 0600"))?;
    Ok(listener)
}

fn add_msg(uid: &str, info: &WorkloadInfo) -> proto::WorkloadRequest {
    proto::WorkloadRequest::new(Payload::Add(proto::AddWorkload {
        uid: uid.to_owned(),
        workload_info: Some(info.clone()),
    }))
}

/// Sends one request and reads its ack, each within [`OP_TIMEOUT`].
///
/// `owed` counts the acks of earlier requests whose read timed out: the proxy may still send
/// them (ZDS acks carry no request id), so the first `owed` responses read are those late acks,
/// discarded, not this request's. A timed-out ack read adds one.
async fn exchange(
    sock: &SeqPacket,
    msg: &proto::WorkloadRequest,
    fd: Option<BorrowedFd<'_>>,
    owed: &mut usize,
) -> Result<(), ZdsError> {
    let timeout = |op| PacketError::Timeout {
        op,
        after: OP_TIMEOUT,
    };
    tokio::time::timeout(OP_TIMEOUT, sock.send(msg, fd))
        .await
        .map_err(|_| ZdsError::Conn(timeout("write")))?
        .map_err(ZdsError::Conn)?;
    let deadline = tokio::time::Instant::now() + OP_TIMEOUT;
    let resp: proto::WorkloadResponse = loop {
        let read = tokio::time::timeout_at(deadline, sock.recv_msg("WorkloadResponse")).await;
        let Ok(resp) = read else {
            *owed += 1;
            return Err(ZdsError::Conn(timeout("ack read")));
        };
        let resp = resp.map_err(ZdsError::Conn)?;
        if *owed == 0 {
            break resp;
        }
        *owed -= 1;
        tracing::info!(late = ?resp.payload, "late ack of an earlier request discarded");
    };
    match resp.payload {
        Some(workload_response::Payload::Ack(a)) if a.error.is_empty() => Ok(()),
        Some(workload_response::Payload::Ack(a)) => Err(ZdsError::Nack(Nack::new(a.error))),
        None => Err(ZdsError::EmptyResponse),
    }
}

/// Whether a failed request leaves the connection unusable (everything but a nack or a timeout,
/// after which Istio keeps the connection).
fn is_fatal(r: &Result<(), ZdsError>) -> bool {
    !matches!(
        r,
        Ok(()) | Err(ZdsError::Nack(_)) | Err(ZdsError::Conn(PacketError::Timeout { .. }))
    )
}

// === impl ZdsServer ===

impl ZdsServer {
    /// An empty server (no pods, no connections).
    pub fn new() -> Arc<ZdsServer> {
        Arc::new(ZdsServer::default())
    }

    /// Number of connected proxies (Istio gauge `ztunnel_connected`).
    pub fn connections(&self) -> usize {
        self.conns.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Uids of the pods in the snapshot, sorted.
    pub fn pods(&self) -> Vec<String> {
        self.snapshot
            .lock()
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Sends `req` to the connected proxies and waits for the ack.
    ///
    /// `Add` is remembered for later snapshots, then goes to the newest connection; with none it
    /// fails with [`ZdsError::NoProxy`]. `Del` forgets the pod and goes to every connection (none is
    /// success); the first failure is returned. A nack is [`ZdsError::Nack`]. `Keep` and
    /// `SnapshotSent` are [`ZdsError::NotForwarded`]: the server sends them itself.
    pub async fn send(&self, req: WorkloadRequest) -> Result<(), ZdsError> {
        match req {
            WorkloadRequest::Add { uid, info, netns } => {
                let msg = add_msg(&uid, &info);
                if let Ok(mut s) = self.snapshot.lock() {
                    s.insert(uid.clone(), (info, netns.clone()));
                }
                let latest = self.conns.lock().ok().and_then(|c| c.last().cloned());
                let conn = latest.ok_or(ZdsError::NoProxy)?;
                conn.exchange(msg, uid, Some(netns)).await
            }
            WorkloadRequest::Del { uid } => {
                if let Ok(mut s) = self.snapshot.lock() {
                    s.remove(&uid);
                }
                let msg = proto::WorkloadRequest::new(Payload::Del(proto::DelWorkload {
                    uid: uid.clone(),
                }));
                let conns = self.conns.lock().map(|c| c.clone()).unwrap_or_default();
                let results = futures::future::join_all(
                    conns
                        .iter()
                        .map(|c| c.exchange(msg.clone(), uid.clone(), None)),
                )
                .await;
                results.into_iter().find(Result::is_err).unwrap_or(Ok(()))
            }
            WorkloadRequest::Keep { .. } => Err(ZdsError::NotForwarded("KeepWorkload")),
            WorkloadRequest::SnapshotSent => Err(ZdsError::NotForwarded("SnapshotSent")),
        }
    }

    /// Accepts proxies on `listener` until `shutdown` resolves, then closes every connection.
    pub async fn serve(
        self: Arc<Self>,
        listener: SeqPacketListener,
        shutdown: impl Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut tasks = JoinSet::new();
        loop {
            let accepted = tokio::select! {
                _ = &mut shutdown => return,
                a = listener.accept() => a,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            };
            match accepted {
                Ok(sock) => {
                    let (id, rx) = self.register();
                    let reg = Registration {
                        server: self.clone(),
                        id,
                    };
                    tasks.spawn(connection(reg, sock, rx));
                }
                Err(e) => tracing::warn!(error = %e, "ZDS accept failed"),
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(ACCEPT_INTERVAL) => {}
            }
        }
    }

    fn register(&self) -> (u64, mpsc::Receiver<Job>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(QUEUE);
        if let Ok(mut c) = self.conns.lock() {
            c.push(ConnHandle { id, tx });
        }
        (id, rx)
    }

    fn snapshot(&self) -> Vec<(String, WorkloadInfo, Netns)> {
        self.snapshot
            .lock()
            .map(|s| {
                s.iter()
                    .map(|(uid, (info, ns))| (uid.clone(), info.clone(), ns.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Runs one connection and logs why it ended.
async fn connection(reg: Registration, sock: SeqPacket, rx: mpsc::Receiver<Job>) {
    let span = tracing::info_span!("zds", conn = reg.id);
    let res = tracing::Instrument::instrument(drive(&reg.server, &sock, rx), span).await;
    match res {
        Ok(()) => tracing::info!(conn = reg.id, "ztunnel disconnected"),
        Err(e) => tracing::warn!(conn = reg.id, error = %e, "ztunnel connection closed"),
    }
}

/// Hello, snapshot, then the request loop; `Ok` when the proxy closed the connection.
async fn drive(
    server: &ZdsServer,
    sock: &SeqPacket,
    mut rx: mpsc::Receiver<Job>,
) -> Result<(), ServerError> {
    let hello: proto::ZdsHello = tokio::time::timeout(OP_TIMEOUT, sock.recv_msg("ZdsHello"))
        .await
        .map_err(|_| {
            ServerError::Hello(PacketError::Timeout {
                op: "hello read",
                after: OP_TIMEOUT,
            })
        })?
        .map_err(ServerError::Hello)?;
    tracing::info!(version = ?hello.version(), "ztunnel connected");
    let snapshot = server.snapshot();
    let count = snapshot.len();
    let mut owed = 0;
    for (uid, info, netns) in snapshot {
        match exchange(sock, &add_msg(&uid, &info), Some(netns.fd()), &mut owed).await {
            Ok(()) => {}
            Err(ZdsError::Nack(text)) => tracing::warn!(%uid, nack = %text, "snapshot add nacked"),
            Err(source) => return Err(ServerError::Snapshot { what: uid, source }),
        }
    }
    let sent = proto::WorkloadRequest::new(Payload::SnapshotSent(proto::SnapshotSent {}));
    match exchange(sock, &sent, None, &mut owed).await {
        Ok(()) => {}
        Err(ZdsError::Nack(text)) => tracing::warn!(nack = %text, "SnapshotSent nacked"),
        Err(source) => {
            return Err(ServerError::Snapshot {
                what: "SnapshotSent".into(),
                source,
            });
        }
    }
    tracing::info!(pods = count, "snapshot sent");
    loop {
        tokio::select! {
            job = rx.recv() => {
                let Some(job) = job else { return Ok(()) };
                let res = exchange(sock, &job.msg, job.netns.as_ref().map(|n| n.fd()), &mut owed).await;
                // a second ack owed: the proxy stopped answering, not just slow; start over
                // (the proxy reconnects and gets the snapshot again)
                let fatal = is_fatal(&res) || owed > 1;
                if let Err(e) = &res {
                    tracing::warn!(what = %job.what, error = %e, "ZDS request failed");
                }
                let _ = job.reply.send(res);
                if fatal {
                    return Err(ServerError::Dropped { what: job.what });
                }
            }
            pkt = sock.recv() => match pkt {
                Ok(None) => return Ok(()),
                // the ack of a request whose read timed out, arriving late: not a protocol error
                Ok(Some(_)) if owed > 0 => {
                    owed -= 1;
                    tracing::info!("late ack of an earlier request discarded");
                }
                Ok(Some(p)) => return Err(ServerError::Unsolicited { len: p.data.len() }),
                Err(e) => return Err(ServerError::Idle(e)),
            },
        }
    }
}

// === impl ConnHandle ===

impl ConnHandle {
    /// Queues `msg` on this connection and waits for its outcome; a connection that ends first is
    /// [`ZdsError::NoProxy`].
    async fn exchange(
        &self,
        msg: proto::WorkloadRequest,
        what: String,
        netns: Option<Netns>,
    ) -> Result<(), ZdsError> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            msg,
            what,
            netns,
            reply,
        };
        self.tx.send(job).await.map_err(|_| ZdsError::NoProxy)?;
        rx.await.unwrap_or(Err(ZdsError::NoProxy))
    }
}

// === impl Registration ===

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut c) = self.server.conns.lock() {
            c.retain(|h| h.id != self.id);
        }
    }
}
