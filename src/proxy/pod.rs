//! The per-pod proxy context the connection tasks run with: [`ProxyContext`], shared by every pod,
//! and [`PodProxy`], one pod's identity, addresses, in-pod sockets, HBONE pool and server TLS
//! config. [`crate::proxy::manager`] builds a [`PodProxy`] for each pod it starts; the connection
//! code ([`crate::proxy::inbound`], [`crate::proxy::outbound`], [`crate::proxy::task`]) sees only
//! this module.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, PoisonError, RwLock};

use crate::mesh::PacketMark;
use crate::proxy::dns::shared::DnsProxy;
use crate::proxy::drain::DrainWatch;
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
    /// Trust domain of the pods served from their handoff ([`super::ProxyConfig::trust_domain`]).
    pub trust_domain: String,
}

/// IP → (pod uid, identity) of the pods a proxy serves (see [`ProxyContext::local`]). An IP two
/// pods claim is ambiguous and gives no identity at all (never a guess).
#[derive(Debug, Default)]
pub struct LocalPods(RwLock<HashMap<IpAddr, LocalClaim>>);

/// Who claims one local IP.
#[derive(Debug, Clone)]
enum LocalClaim {
    /// One pod: its uid and identity.
    One(String, Identity),
    /// Two or more pods claimed it (their uids).
    Ambiguous(Vec<String>),
}

impl LocalPods {
    /// Records that pod `uid` serving `identity` has `ips`.
    pub fn insert(&self, uid: &str, ips: &[IpAddr], identity: &Identity) {
        let mut m = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for ip in ips {
            let claim = match m.remove(ip) {
                None => LocalClaim::One(uid.to_owned(), identity.clone()),
                Some(LocalClaim::One(other, _)) if other == uid => {
                    LocalClaim::One(uid.to_owned(), identity.clone())
                }
                Some(LocalClaim::One(other, _)) => {
                    tracing::warn!(%ip, pods = ?[&other, uid], "two local pods claim one IP: neither is an HBONE destination by it");
                    LocalClaim::Ambiguous(vec![other, uid.to_owned()])
                }
                Some(LocalClaim::Ambiguous(mut uids)) => {
                    if !uids.iter().any(|u| u == uid) {
                        uids.push(uid.to_owned());
                    }
                    LocalClaim::Ambiguous(uids)
                }
            };
            m.insert(*ip, claim);
        }
    }

    /// Forgets pod `uid`'s claims on `ips` (the pod stopped); another pod's claim stays.
    pub fn remove(&self, uid: &str, ips: &[IpAddr]) {
        let mut m = self.0.write().unwrap_or_else(PoisonError::into_inner);
        for ip in ips {
            match m.remove(ip) {
                Some(LocalClaim::One(owner, id)) if owner != uid => {
                    m.insert(*ip, LocalClaim::One(owner, id));
                }
                Some(LocalClaim::Ambiguous(mut uids)) => {
                    uids.retain(|u| u != uid);
                    // the remaining claimants stay ambiguous (their identities are not kept)
                    if !uids.is_empty() {
                        m.insert(*ip, LocalClaim::Ambiguous(uids));
                    }
                }
                _ => {}
            }
        }
    }

    /// The identity of the one local pod at `ip` (`None` for no pod, or an ambiguous IP).
    pub fn get(&self, ip: IpAddr) -> Option<Identity> {
        match self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&ip)
        {
            Some(LocalClaim::One(_, id)) => Some(id.clone()),
            _ => None,
        }
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
    /// Turns draining when the proxy shuts down: the accept loop stops, HBONE connections send
    /// GOAWAY ([`crate::proxy::manager`]).
    pub drain: DrainWatch,
}

impl PodProxy {
    /// The pod's workload as `state` has it now ([`ProxyState::current`]).
    pub fn current_workload(&self, state: &ProxyState) -> Arc<Workload> {
        state.current(&self.workload)
    }

    /// The HBONE leg to `target` when it is a pod this proxy serves and the workload state has no
    /// record for its IP (`None` otherwise: the state decides whenever it knows the IP).
    pub fn local_hbone(
        &self,
        state: &ProxyState,
        target: SocketAddr,
    ) -> Option<crate::proxy::route::Hbone> {
        if state.workload_by_ip(target.ip()).is_some() {
            return None;
        }
        let identity = self.ctx.local.get(target.ip())?;
        Some(crate::proxy::route::Hbone {
            addr: SocketAddr::new(target.ip(), crate::mesh::HBONE_PORT),
            authority: target,
            identity,
            service_host: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(sa: &str) -> Identity {
        Identity::new("cluster.local", "default", sa)
    }

    #[test]
    fn a_local_ip_belongs_to_one_pod_and_only_its_owner_releases_it() {
        let local = LocalPods::default();
        let ip: IpAddr = "10.0.0.7".parse().expect("ip");
        local.insert("a", &[ip], &id("a"));
        assert_eq!(local.get(ip), Some(id("a")));
        // pod b reuses the IP before a's removal: b owns it, a's late removal leaves it
        local.remove("a", &[ip]);
        local.insert("b", &[ip], &id("b"));
        local.remove("a", &[ip]);
        assert_eq!(local.get(ip), Some(id("b")));
        // a second claim makes it ambiguous: no identity until only... none is guessed
        local.insert("c", &[ip], &id("c"));
        assert_eq!(local.get(ip), None, "ambiguous");
        local.remove("b", &[ip]);
        assert_eq!(
            local.get(ip),
            None,
            "still ambiguous: c's identity is not guessed"
        );
        local.remove("c", &[ip]);
        assert_eq!(local.get(ip), None);
        local.insert("d", &[ip], &id("d"));
        assert_eq!(local.get(ip), Some(id("d")));
    }
}
