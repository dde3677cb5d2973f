//! What every pod's DNS proxy shares ([`DnsProxy`]: upstreams, cluster domain, the host index of
//! the current state) and its settings ([`DnsOptions`]). Kept apart from the serving code in
//! `dns.rs` so the per-pod context (`proxy::pod`) can hold it without seeing the connection code.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use super::names::HostIndex;
use super::resolv::{ResolvConfError, Upstreams};
use crate::mesh::DNS_PORT;
use crate::proxy::state::{ProxyState, StateHandle};

/// The resolver config read by default: the proxy's own, i.e. the node's.
pub const DEFAULT_RESOLV_CONF: &str = "/etc/resolv.conf";
/// Kubernetes' default cluster domain (ztunnel `CLUSTER_DOMAIN`).
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";
/// DNS proxy settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsOptions {
    /// Serve 15053 in pods (default on, as ztunnel's `DNS_CAPTURE` proxy metadata).
    pub enabled: bool,
    /// The resolver config naming the upstream servers (default [`DEFAULT_RESOLV_CONF`]).
    pub resolv_conf: PathBuf,
    /// Cluster domain of the pods' search domains (default [`DEFAULT_CLUSTER_DOMAIN`]).
    pub cluster_domain: String,
}

impl Default for DnsOptions {
    fn default() -> DnsOptions {
        DnsOptions {
            enabled: true,
            resolv_conf: DEFAULT_RESOLV_CONF.into(),
            cluster_domain: DEFAULT_CLUSTER_DOMAIN.into(),
        }
    }
}

/// What every pod's DNS proxy shares: the upstreams, the cluster domain, and the mesh's host
/// index of the current state (rebuilt when the state changes).
#[derive(Debug)]
pub struct DnsProxy {
    upstreams: Upstreams,
    pub(crate) cluster_domain: String,
    index: Mutex<Option<(Arc<ProxyState>, Arc<HostIndex>)>>,
}

impl DnsProxy {
    /// A DNS proxy forwarding to `upstreams`.
    pub fn new(upstreams: Upstreams, cluster_domain: &str) -> DnsProxy {
        DnsProxy {
            upstreams,
            cluster_domain: cluster_domain.trim_matches('.').to_ascii_lowercase(),
            index: Mutex::new(None),
        }
    }

    /// The DNS proxy of `opts` (its resolver config read now), or `None` when it is off. A
    /// resolver config that cannot be read is an error, except a missing default one (then
    /// forwarded queries get SERVFAIL).
    pub fn from_options(opts: &DnsOptions) -> Result<Option<Arc<DnsProxy>>, ResolvConfError> {
        if !opts.enabled {
            return Ok(None);
        }
        let upstreams = match Upstreams::read(&opts.resolv_conf) {
            Ok(u) => u,
            // a node without the default file (not a pod's normal case) still serves mesh names
            Err(e)
                if e.source.kind() == std::io::ErrorKind::NotFound
                    && opts.resolv_conf == std::path::Path::new(DEFAULT_RESOLV_CONF) =>
            {
                tracing::warn!(error = %e, "DNS proxy without upstreams");
                Upstreams::new(Vec::new())
            }
            Err(e) => return Err(e),
        };
        for lo in upstreams.servers.iter().filter(|s| s.ip().is_loopback()) {
            // queries leave from the pod's netns, whose loopback is the pod's own
            tracing::warn!(upstream = %lo, file = %opts.resolv_conf.display(), "loopback nameserver: pods cannot reach the node's loopback, queries to it will fail");
        }
        if upstreams.servers.is_empty() {
            tracing::warn!(file = %opts.resolv_conf.display(), "no nameserver: forwarded DNS queries will get SERVFAIL");
        }
        tracing::info!(upstreams = ?upstreams.servers, file = %opts.resolv_conf.display(), cluster_domain = %opts.cluster_domain, "in-pod DNS proxy on port {DNS_PORT}");
        Ok(Some(Arc::new(DnsProxy::new(
            upstreams,
            &opts.cluster_domain,
        ))))
    }

    /// The upstream servers.
    pub fn upstreams(&self) -> &Upstreams {
        &self.upstreams
    }

    /// The host index of `state`'s current snapshot.
    pub(crate) fn index(&self, state: &StateHandle) -> Arc<HostIndex> {
        let current = state.load();
        let mut cached = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((s, idx)) = cached.as_ref()
            && Arc::ptr_eq(s, &current)
        {
            return idx.clone();
        }
        let idx = Arc::new(HostIndex::new(&current));
        *cached = Some((current, idx.clone()));
        idx
    }
}
