//! The per-pod proxy context the connection tasks run with: [`ProxyContext`], shared by every pod,
//! and [`PodProxy`], one pod's identity, addresses, in-pod sockets, HBONE pool and server TLS
//! config. [`crate::proxy::manager`] builds a [`PodProxy`] for each pod it starts; the connection
//! code ([`crate::proxy::inbound`], [`crate::proxy::outbound`], [`crate::proxy::task`]) sees only
//! this module.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, PoisonError, RwLock};

use crate::mesh::PacketMark;
use crate::proxy::dns::DnsProxy;
use crate::proxy::identity::{CertManager, Identity};
use crate::proxy::live::LiveConnections;
use crate::proxy::metrics::Metrics;
use crate::proxy::pool::{Pool, PoolConfig};
use crate::proxy::socket::PodSockets;
use crate::proxy::state::{ProxyState, StateHandle, Workload};

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
    /// Settings of every pod's outbound pool (ztunnel's `POOL_*` env).
    pub pool: PoolConfig,
    /// The pods this proxy serves, by IP: the identity each presents on its HBONE listener. A
    /// pod served from its handoff before the workload source lists it is still an HBONE
    /// destination for the other pods here (never plain TCP), see [`PodProxy::local_hbone`].
    pub local: LocalPods,
    /// The in-pod DNS proxy (`None`: off, no 15053 in pods).
    pub dns: Option<Arc<DnsProxy>>,
}

/// IP → identity of the pods a proxy serves (see [`ProxyContext::local`]).
#[derive(Debug, Default)]
pub struct LocalPods(RwLock<HashMap<IpAddr, Identity>>);

impl LocalPods {
    /// Records the pod `ips` serving `identity`.
    pub fn insert(&self, ips: &[IpAddr], identity: &Identity) {
        let mut m = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for ip in ips {
            m.insert(*ip, identity.clone());
        }
    }

    /// Forgets `ips` (the pod stopped).
    pub fn remove(&self, ips: &[IpAddr]) {
        let mut m = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for ip in ips {
            m.remove(ip);
        }
    }

    /// The identity of the local pod at `ip`.
    pub fn get(&self, ip: IpAddr) -> Option<Identity> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&ip)
            .cloned()
    }
}

/// The running proxy of one pod (shared by its connection tasks).
#[derive(Debug)]
pub struct PodProxy {
    /// Shared context.
    pub ctx: Arc<ProxyContext>,
    /// The pod's workload at start: the state's record, or the one made from its handoff when
    /// the state had none yet (see [`PodProxy::current_workload`]).
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
    /// The pod's open inbound connections, re-checked when the policies change.
    pub live: Arc<LiveConnections>,
}

impl PodProxy {
    /// The pod's workload as `state` has it now ([`ProxyState::current`]).
    pub fn current_workload(&self, state: &ProxyState) -> Arc<Workload> {
        state.current(&self.workload)
    }

    /// The HBONE leg to `target` when it is a pod this proxy serves (`None` otherwise): for a
    /// destination the workload source does not list (yet) as HBONE.
    pub fn local_hbone(&self, target: SocketAddr) -> Option<crate::proxy::route::Hbone> {
        let identity = self.ctx.local.get(target.ip())?;
        Some(crate::proxy::route::Hbone {
            addr: SocketAddr::new(target.ip(), crate::mesh::HBONE_PORT),
            authority: target,
            identity,
            service_host: None,
        })
    }
}
