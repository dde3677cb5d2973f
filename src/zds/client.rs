//! The proxy side of the ZDS socket (ztunnel `src/inpod/{workloadmanager,protocol,statemanager}.rs`,
//! `../shared/spec/ztunnel.md` §1): connect to the node agent, announce `ZdsHello{V1}`, then answer
//! every request with one `WorkloadResponse{ack}`.
//!
//! Requests are turned into [`WorkloadRequest`]s (the SCM_RIGHTS fd of an Add becomes its [`Netns`])
//! and passed to the proxy through the in-process channel ([`InProcessSender`]), whose ack or nack text is
//! sent back. fd rules: exactly one fd with an Add, none with anything else. On `SnapshotSent` the
//! workloads not named since this connection started are deleted ([`SnapshotState`]).
//!
//! Errors: a read, decode or fd error is nacked and the connection is dropped and re-made; a proxy
//! failure is nacked and the connection kept; a protocol error (Add without `workload_info`, Keep
//! after the snapshot, a second `SnapshotSent`, an empty request) is nacked and ends [`run`] with the
//! error, as ztunnel exits. Reconnects back off from 10 ms, doubling, up to 15 s
//! ([`ZDS_RECONNECT`]), from the start again once connected.

use std::collections::{BTreeSet, HashSet};
use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};

use prost::Message;

use super::packet::{self, Packet, PacketError};
use super::proto::{self, workload_request::Payload};
use super::{InProcessSender, WorkloadRequest, ZdsError};
use crate::backoff::{Backoff, ZDS_RECONNECT};
use crate::netns::Netns;

/// Errors of the proxy's ZDS connection.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, sending or receiving failed.
    #[error(transparent)]
    Packet(#[from] PacketError),
    /// The agent closed the connection.
    #[error("the node agent closed the ZDS connection")]
    Closed,
    /// A request did not decode.
    #[error("decode WorkloadRequest: {0}")]
    Decode(#[source] prost::DecodeError),
    /// An Add came without its netns fd.
    #[error("AddWorkload {uid}: no control message (netns fd missing)")]
    NoFd {
        /// Pod uid.
        uid: String,
    },
    /// An Add came with more than one fd.
    #[error("AddWorkload {uid}: {count} fds, expected exactly one")]
    TooManyFds {
        /// Pod uid.
        uid: String,
        /// Number of fds received.
        count: usize,
    },
    /// A request other than Add came with fds.
    #[error("unexpected control message with {what}")]
    UnexpectedFd {
        /// The request kind.
        what: &'static str,
    },
    /// The received fd could not be inspected as a netns.
    #[error("AddWorkload {uid}: netns fd: {source}")]
    BadNetns {
        /// Pod uid.
        uid: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Protocol error: a request without payload.
    #[error("protocol error: WorkloadRequest without payload")]
    EmptyRequest,
    /// Protocol error: an Add without `workload_info`.
    #[error("protocol error: AddWorkload {uid} without workload_info")]
    NoWorkloadInfo {
        /// Pod uid.
        uid: String,
    },
    /// Protocol error: Keep after the snapshot.
    #[error("protocol error: KeepWorkload {uid} after SnapshotSent")]
    KeepAfterSnapshot {
        /// Pod uid.
        uid: String,
    },
    /// Protocol error: a second `SnapshotSent` on one connection.
    #[error("protocol error: SnapshotSent twice")]
    SnapshotTwice,
    /// The in-process proxy is gone.
    #[error("the proxy manager stopped")]
    ProxyGone,
}

/// Which workloads the proxy serves and which the current connection's snapshot named (ztunnel
/// `statemanager.rs`). Pure bookkeeping: the caller sends the Dels it returns.
#[derive(Debug, Default)]
pub struct SnapshotState {
    /// Uids the proxy serves (acked Adds not deleted since), across connections.
    live: BTreeSet<String>,
    /// Uids named by Add or Keep on this connection before `SnapshotSent`.
    named: HashSet<String>,
    /// Whether this connection's `SnapshotSent` arrived.
    received: bool,
}

/// The outcome of handling one request: `Ok(None)` ack, `Ok(Some(text))` nack and keep going.
type Handled = Result<Option<String>, ClientError>;

/// Connects to the agent at `path` and serves its requests through `proxy` until `shutdown`
/// resolves (`Ok`), reconnecting with backoff when the socket is absent or the connection ends.
/// `on_connection` is called with `true` once the hello is sent and with `false` when that
/// connection ends.
///
/// Errors: a protocol error from the agent or a stopped proxy ([`ClientError::is_fatal`]).
pub async fn run(
    path: PathBuf,
    proxy: InProcessSender,
    shutdown: impl Future<Output = ()>,
    mut on_connection: impl FnMut(bool),
) -> Result<(), ClientError> {
    tokio::pin!(shutdown);
    let mut state = SnapshotState::default();
    let mut backoff = Backoff::new(ZDS_RECONNECT);
    let mut quiet = false;
    loop {
        let Err(e) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            r = session(&path, &proxy, &mut state, &mut backoff, &mut on_connection) => r,
        };
        on_connection(false);
        match e {
            e if e.is_fatal() => return Err(e),
            ClientError::Packet(PacketError::Io { op: "connect", .. }) if quiet => {}
            e @ ClientError::Packet(PacketError::Io { op: "connect", .. }) => {
                tracing::warn!(error = %e, "node agent not reachable; retrying with backoff");
                quiet = true;
            }
            e => {
                tracing::warn!(socket = %path.display(), error = %e, "ZDS connection lost; reconnecting");
                quiet = false;
            }
        }
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// One connection: connect, hello, then requests until an error ends it (also the agent closing).
async fn session(
    path: &Path,
    proxy: &InProcessSender,
    state: &mut SnapshotState,
    backoff: &mut Backoff,
    on_connection: &mut impl FnMut(bool),
) -> Result<Infallible, ClientError> {
    let sock = packet::connect(path)?;
    sock.send(
        &proto::ZdsHello {
            version: proto::Version::V1 as i32,
        },
        None,
    )
    .await?;
    tracing::info!(socket = %path.display(), "connected to the node agent");
    on_connection(true);
    backoff.reset();
    state.connected();
    loop {
        let res = match sock.recv().await {
            Ok(Some(pkt)) => handle(pkt, proxy, state).await,
            Ok(None) => return Err(ClientError::Closed),
            Err(e) => Err(e.into()),
        };
        let (text, end) = match res {
            Ok(None) => (String::new(), None),
            Ok(Some(text)) => (text, None),
            Err(ClientError::ProxyGone) => return Err(ClientError::ProxyGone),
            Err(e) => (e.to_string(), Some(e)),
        };
        if !text.is_empty() {
            tracing::warn!(nack = %text, "nacking ZDS request");
        }
        let sent = sock.send(&proto::WorkloadResponse::ack(text), None).await;
        if let Some(e) = end {
            return Err(e);
        }
        sent?;
    }
}

/// Decodes one request carrying `fds` file descriptors and checks it as ztunnel does
/// (`../shared/spec/ztunnel.md` §1 "fd passing rules"): an Add has exactly one fd and its workload
/// info, every other request none. Pure. Errors: [`ClientError::Decode`],
/// [`ClientError::EmptyRequest`], [`ClientError::NoFd`], [`ClientError::TooManyFds`],
/// [`ClientError::NoWorkloadInfo`], [`ClientError::UnexpectedFd`].
pub fn check_request(data: &[u8], fds: usize) -> Result<Payload, ClientError> {
    let req = proto::WorkloadRequest::decode(data).map_err(ClientError::Decode)?;
    let payload = req.payload.ok_or(ClientError::EmptyRequest)?;
    match &payload {
        Payload::Add(add) => {
            let uid = || add.uid.clone();
            match fds {
                0 => return Err(ClientError::NoFd { uid: uid() }),
                1 => {}
                count => return Err(ClientError::TooManyFds { uid: uid(), count }),
            }
            if add.workload_info.is_none() {
                return Err(ClientError::NoWorkloadInfo { uid: uid() });
            }
        }
        other if fds > 0 => {
            return Err(ClientError::UnexpectedFd {
                what: payload_name(other),
            });
        }
        _ => {}
    }
    Ok(payload)
}

/// Decodes one request, checks its fds, and passes it to the proxy.
async fn handle(pkt: Packet, proxy: &InProcessSender, state: &mut SnapshotState) -> Handled {
    let payload = check_request(&pkt.data, pkt.fds.len())?;
    let mut fds = pkt.fds;
    match payload {
        Payload::Add(add) => {
            let uid = add.uid;
            let (Some(fd), Some(info)) = (fds.pop(), add.workload_info) else {
                return Err(ClientError::NoFd { uid });
            };
            let netns = Netns::from_file(std::fs::File::from(fd)).map_err(|source| {
                ClientError::BadNetns {
                    uid: uid.clone(),
                    source,
                }
            })?;
            tracing::info!(%uid, name = %info.name, namespace = %info.namespace, netns = %netns.id(), "AddWorkload");
            let res = forward(
                proxy,
                WorkloadRequest::Add {
                    uid: uid.clone(),
                    info,
                    netns,
                },
            )
            .await;
            state.added(&uid, matches!(res, Ok(None)));
            res
        }
        Payload::Del(del) => {
            tracing::info!(uid = %del.uid, "DelWorkload");
            state.deleted(&del.uid);
            forward(proxy, WorkloadRequest::Del { uid: del.uid }).await
        }
        Payload::Keep(keep) => {
            state.kept(&keep.uid)?;
            forward(proxy, WorkloadRequest::Keep { uid: keep.uid }).await
        }
        Payload::SnapshotSent(_) => {
            let stale = state.snapshot_sent()?;
            for uid in stale {
                tracing::info!(%uid, "workload not in the snapshot; stopping it");
                if let Some(text) = forward(proxy, WorkloadRequest::Del { uid }).await? {
                    return Ok(Some(text));
                }
            }
            tracing::info!("snapshot received");
            forward(proxy, WorkloadRequest::SnapshotSent).await
        }
    }
}

/// Passes `req` to the in-process proxy: ack `None`, nack `Some(text)`.
async fn forward(proxy: &InProcessSender, req: WorkloadRequest) -> Handled {
    match proxy.send(req).await {
        Ok(()) => Ok(None),
        Err(ZdsError::Nack(nack)) => Ok(Some(nack.message)),
        Err(_) => Err(ClientError::ProxyGone),
    }
}

fn payload_name(p: &Payload) -> &'static str {
    match p {
        Payload::Add(_) => "AddWorkload",
        Payload::Del(_) => "DelWorkload",
        Payload::SnapshotSent(_) => "SnapshotSent",
        Payload::Keep(_) => "KeepWorkload",
    }
}

// === impl ClientError ===

impl ClientError {
    /// Whether the error ends [`run`] (protocol errors, stopped proxy) rather than a reconnect.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            ClientError::EmptyRequest
                | ClientError::NoWorkloadInfo { .. }
                | ClientError::KeepAfterSnapshot { .. }
                | ClientError::SnapshotTwice
                | ClientError::ProxyGone
        )
    }
}

// === impl SnapshotState ===

impl SnapshotState {
    /// A new connection: nothing named yet, snapshot not received.
    pub fn connected(&mut self) {
        self.named.clear();
        self.received = false;
    }

    /// An Add for `uid` was handled; `served` tells whether the proxy acked it.
    pub fn added(&mut self, uid: &str, served: bool) {
        if !self.received {
            self.named.insert(uid.to_owned());
        }
        if served {
            self.live.insert(uid.to_owned());
        } else {
            self.live.remove(uid);
        }
    }

    /// A Keep for `uid`; only legal before `SnapshotSent`.
    pub fn kept(&mut self, uid: &str) -> Result<(), ClientError> {
        if self.received {
            return Err(ClientError::KeepAfterSnapshot {
                uid: uid.to_owned(),
            });
        }
        self.named.insert(uid.to_owned());
        Ok(())
    }

    /// A Del for `uid`.
    pub fn deleted(&mut self, uid: &str) {
        self.named.remove(uid);
        self.live.remove(uid);
    }

    /// `SnapshotSent`: returns the served uids the snapshot did not name (to delete), sorted.
    pub fn snapshot_sent(&mut self) -> Result<Vec<String>, ClientError> {
        if self.received {
            return Err(ClientError::SnapshotTwice);
        }
        self.received = true;
        let stale: Vec<String> = self
            .live
            .iter()
            .filter(|uid| !self.named.contains(*uid))
            .cloned()
            .collect();
        for uid in &stale {
            self.live.remove(uid);
        }
        Ok(stale)
    }

    /// Whether this connection's snapshot has arrived (ztunnel readiness).
    pub fn snapshot_received(&self) -> bool {
        self.received
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(payload: Payload) -> Vec<u8> {
        proto::WorkloadRequest::new(payload).encode_to_vec()
    }

    #[test]
    fn requests_are_checked_for_their_fds_and_workload_info() {
        let add = |info: bool| {
            encoded(Payload::Add(proto::AddWorkload {
                uid: "u1".into(),
                workload_info: info.then(proto::WorkloadInfo::default),
            }))
        };
        assert!(matches!(check_request(&add(true), 1), Ok(Payload::Add(_))));
        assert!(matches!(
            check_request(&add(true), 0),
            Err(ClientError::NoFd { .. })
        ));
        assert!(matches!(
            check_request(&add(true), 2),
            Err(ClientError::TooManyFds { count: 2, .. })
        ));
        assert!(matches!(
            check_request(&add(false), 1),
            Err(ClientError::NoWorkloadInfo { .. })
        ));
        let del = encoded(Payload::Del(proto::DelWorkload { uid: "u1".into() }));
        assert!(matches!(check_request(&del, 0), Ok(Payload::Del(_))));
        assert!(matches!(
            check_request(&del, 1),
            Err(ClientError::UnexpectedFd { .. })
        ));
        assert!(matches!(
            check_request(&[0xff, 0xff], 0),
            Err(ClientError::Decode(_))
        ));
        assert!(matches!(
            check_request(&[], 0),
            Err(ClientError::EmptyRequest)
        ));
    }

    #[test]
    fn snapshot_drops_only_workloads_not_named_since_connect() {
        let mut s = SnapshotState::default();
        s.connected();
        s.added("a", true);
        s.added("b", true);
        s.added("failed", false);
        assert_eq!(s.snapshot_sent().expect("first"), Vec::<String>::new());
        s.added("c", true);
        // reconnect: the new snapshot names a (Add) and b (Keep) only
        s.connected();
        assert!(!s.snapshot_received());
        s.added("a", true);
        s.kept("b").expect("keep before snapshot");
        assert_eq!(s.snapshot_sent().expect("second"), ["c"]);
        assert!(s.snapshot_received());
        // c is gone; a third connection with an empty snapshot drops a and b
        s.connected();
        assert_eq!(s.snapshot_sent().expect("third"), ["a", "b"]);
    }

    #[test]
    fn del_before_snapshot_unnames_the_workload() {
        let mut s = SnapshotState::default();
        s.added("a", true);
        s.snapshot_sent().expect("snapshot");
        s.connected();
        s.added("a", true);
        s.deleted("a");
        assert!(s.snapshot_sent().expect("snapshot").is_empty());
        s.connected();
        assert!(
            s.snapshot_sent().expect("snapshot").is_empty(),
            "a was deleted"
        );
    }

    #[test]
    fn keep_after_snapshot_and_second_snapshot_are_protocol_errors() {
        let mut s = SnapshotState::default();
        s.snapshot_sent().expect("first");
        let e = s.kept("x").expect_err("keep after snapshot");
        assert!(
            e.is_fatal() && e.to_string().contains("KeepWorkload x"),
            "{e}"
        );
        let e = s.snapshot_sent().expect_err("twice");
        assert!(matches!(e, ClientError::SnapshotTwice) && e.is_fatal());
    }
}
