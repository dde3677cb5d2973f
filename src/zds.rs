//! The agent → proxy workload protocol (ZDS semantics), in-process form.
//!
//! Mirrors Istio's ZDS messages (`../shared/spec/ztunnel.md` §1, package `istio.workload.zds`):
//! `AddWorkload{uid, workload_info}` carrying the pod's netns, `DelWorkload{uid}`, `KeepWorkload`,
//! `SnapshotSent`, each answered by one `Ack{error}` (empty = ack, text = nack). Here the messages
//! travel over a tokio channel with a oneshot reply instead of a SOCK_SEQPACKET socket; the uid is the
//! Kubernetes pod UID (in standalone mode, the workload uid of the local config when no pod UID is known).

use tokio::sync::{mpsc, oneshot};

use crate::netns::Netns;

/// `WorkloadInfo`: what the proxy needs to find the pod's workload and identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkloadInfo {
    /// Pod name.
    pub name: String,
    /// Pod namespace.
    pub namespace: String,
    /// Kubernetes service account (the SPIFFE `sa` segment).
    pub service_account: String,
}

/// One request from the agent to the proxy.
#[derive(Debug)]
pub enum WorkloadRequest {
    /// Start (or keep, if the same netns is already served) the per-pod proxy.
    Add {
        /// Pod UID.
        uid: String,
        /// Pod identity.
        info: WorkloadInfo,
        /// The pod's network namespace.
        netns: Netns,
    },
    /// The pod exists but its netns is unknown (snapshot only).
    Keep {
        /// Pod UID.
        uid: String,
    },
    /// Stop the per-pod proxy (idempotent: an unknown uid is acked).
    Del {
        /// Pod UID.
        uid: String,
    },
    /// End of the initial snapshot: the proxy drops every workload not named since connect.
    SnapshotSent,
}

/// Errors of the agent → proxy channel.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    /// No proxy is attached (the receiving side was dropped).
    #[error("no proxy connection")]
    NoProxy,
    /// The proxy answered with a nack.
    #[error("proxy nacked: {0}")]
    Nack(String),
}

/// The agent's end: send a request and wait for its ack.
#[derive(Debug, Clone)]
pub struct ZdsClient {
    tx: mpsc::Sender<(WorkloadRequest, oneshot::Sender<Result<(), String>>)>,
}

/// The proxy's end: receives requests, answers each through the oneshot.
pub type ZdsReceiver = mpsc::Receiver<(WorkloadRequest, oneshot::Sender<Result<(), String>>)>;

/// Creates a connected pair.
pub fn channel() -> (ZdsClient, ZdsReceiver) {
    let (tx, rx) = mpsc::channel(100);
    (ZdsClient { tx }, rx)
}

impl ZdsClient {
    /// Sends `req` and waits for the ack; a nack becomes [`ZdsError::Nack`].
    pub async fn send(&self, req: WorkloadRequest) -> Result<(), ZdsError> {
        let (ack_tx, ack_rx) = oneshot::channel();
        self.tx
            .send((req, ack_tx))
            .await
            .map_err(|_| ZdsError::NoProxy)?;
        match ack_rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(text)) => Err(ZdsError::Nack(text)),
            Err(_) => Err(ZdsError::NoProxy),
        }
    }
}
