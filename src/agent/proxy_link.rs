//! The agent's link to the proxy: where it sends each pod's ZDS request and waits for the ack.

use std::sync::Arc;

use crate::zds::server::ZdsServer;
use crate::zds::{InProcessSender, WorkloadRequest, ZdsError};

/// Where the agent sends workload requests: the proxy in the same process (`ztnode node`) or the
/// separate proxies connected to the agent's ZDS socket (`ztnode agent`).
#[derive(Debug, Clone)]
pub enum WorkloadSink {
    /// The proxy in the same process.
    InProcess(InProcessSender),
    /// Separate proxies connected to the agent's ZDS socket.
    Socket(Arc<ZdsServer>),
}

impl WorkloadSink {
    /// Sends `req` and waits for its ack (see [`InProcessSender::send`] and [`ZdsServer::send`]).
    pub async fn send(&self, req: WorkloadRequest) -> Result<(), ZdsError> {
        match self {
            WorkloadSink::InProcess(c) => c.send(req).await,
            WorkloadSink::Socket(s) => s.send(req).await,
        }
    }
}

impl From<InProcessSender> for WorkloadSink {
    fn from(c: InProcessSender) -> Self {
        WorkloadSink::InProcess(c)
    }
}

impl From<Arc<ZdsServer>> for WorkloadSink {
    fn from(s: Arc<ZdsServer>) -> Self {
        WorkloadSink::Socket(s)
    }
}
