//! The per-pod proxy context the connection tasks run with: [`ProxyContext`], shared by every pod,
//! and [`PodProxy`], one pod's identity, addresses, in-pod sockets, HBONE pool and server TLS
//! config. [`crate::proxy::manager`] builds a [`PodProxy`] for each pod it starts; the connection
//! code ([`crate::proxy::inbound`], [`crate::proxy::outbound`], [`crate::proxy::task`]) sees only
//! this module.

use std::net::IpAddr;
use std::sync::Arc;

use crate::mesh::PacketMark;
use crate::proxy::dns::DnsProxy;
use crate::proxy::identity::{CertManager, Identity};
use crate::proxy::metrics::Metrics;
use crate::proxy::pool::Pool;
use crate::proxy::socket::PodSockets;
use crate::proxy::state::{StateHandle, Workload};

/// What every pod proxy shares.
#[derive(Debug)]
pub struct ProxyContext {
    /// Workload state.
    pub state: StateHandle,
    /// Certificates.
    pub certs: Arc<CertManager>,
    /// Connection counters.
    pub metrics: Metrics,
    /// SO_MARK of every socket opened in a pod.
    pub mark: PacketMark,
    /// Serve a pod the workload state does not know with the identity of its handoff
    /// (Kubernetes mode) instead of refusing it after [`crate::proxy::manager`]'s wait.
    pub identity_from_handoff: bool,
    /// The in-pod DNS proxy (`None`: off, no 15053 in pods).
    pub dns: Option<Arc<DnsProxy>>,
}

/// The running proxy of one pod (shared by its connection tasks).
#[derive(Debug)]
pub struct PodProxy {
    /// Shared context.
    pub ctx: Arc<ProxyContext>,
    /// The pod's workload at start.
    pub workload: Arc<Workload>,
    /// The pod's identity.
    pub identity: Identity,
    /// The pod's IPs (its workload's addresses at start).
    pub ips: Vec<IpAddr>,
    /// Socket factory in the pod netns.
    pub sockets: PodSockets,
    /// Outbound HBONE pool.
    pub pool: Pool,
    /// Server TLS config of the pod identity.
    pub server_tls: Arc<rustls::ServerConfig>,
}
