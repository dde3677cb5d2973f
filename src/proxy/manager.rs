//! The manager that starts and stops the per-pod proxy sets on agent requests (ZDS semantics), the
//! table of running pods, and each pod's accept loop.
//!
//! For each added pod: find its workload in the state by namespace/name, or else serve it at once
//! with the identity of its handoff (as ztunnel serves in-pod workloads from ZDS), make sure its identity has a certificate ([`CertManager::ensure`]: with a remote CA
//! the Add, and so readiness, waits for it; a refusal fails the Add), open a socket thread in the
//! pod netns, bind 15001 (outbound), 15006 (inbound
//! plaintext), 15008 (HBONE) and, with the DNS proxy on, 15053 on localhost (UDP and TCP,
//! [`dns`]) there, and serve them until the pod is deleted. An Add for a uid that
//! already runs with the same netns is acked without change; with another netns (sandbox recreated)
//! the old set is stopped first. A Del stops the set and every connection it carries immediately, and
//! releases the pod's reference on its certificate (the last pod of an identity drops it).
//!
//! Shutdown ([`ProxyManager::start_drain`], `../shared/spec/ztunnel.md` §3 "Drain / shutdown"):
//! every pod stops accepting (its listeners close; with port reuse a new proxy process has taken
//! the ports over already), its HBONE connections send GOAWAY, its pool hands out no pooled
//! connection any more, and open connections finish on their own until the termination deadline,
//! when the rest are closed ([`Draining::finish`]). Adds are refused from then on.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::mesh::{DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use crate::netns::{Netns, NetnsId};
use crate::proxy::drain::{self, DrainTrigger};
use crate::proxy::identity::{CertManager, Identity, IdentityError};
use crate::proxy::live::PolicyWatcher;
use crate::proxy::pod::{PodProxy, ProxyContext};
use crate::proxy::pool::Pool;
use crate::proxy::scope::TaskScope;
use crate::proxy::socket::{PodSockets, SocketError};
use crate::proxy::state::Workload;
use crate::proxy::{dns, inbound, outbound, tls};
use crate::zds::{InProcessReceiver, Nack, WorkloadInfo, WorkloadRequest};

/// Errors starting a pod's proxy set.
#[derive(Debug, thiserror::Error)]
pub enum PodProxyError {
    /// Sockets in the pod netns failed.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// TLS setup failed.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// The pod's certificate could not be obtained (e.g. the CA refused the token).
    #[error(transparent)]
    Certificate(#[from] IdentityError),
    /// Reading the pod's addresses failed.
    #[error("reading the addresses of netns {0} failed")]
    Handoff(NetnsId),
    /// The proxy is shutting down (draining): it starts no pod any more.
    #[error("the proxy is shutting down")]
    Draining,
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

/// State of a pod in `/config_dump` (`workloadState`).
#[derive(Debug, Clone, Serialize)]
pub struct PodStatus {
    /// Workload info from the agent, with ztunnel's keys (`name`, `namespace`, `serviceAccount`).
    #[serde(serialize_with = "ztunnel_workload_info")]
    pub info: WorkloadInfo,
    /// `Up`.
    pub state: &'static str,
    /// SPIFFE identity served.
    pub identity: String,
    /// netns identity.
    pub netns: String,
}

/// [`WorkloadInfo`] as ztunnel's `/config_dump` writes it (camelCase keys).
fn ztunnel_workload_info<S: serde::Serializer>(
    info: &WorkloadInfo,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeStruct;
    let mut st = s.serialize_struct("WorkloadInfo", 3)?;
    st.serialize_field("name", &info.name)?;
    st.serialize_field("namespace", &info.namespace)?;
    st.serialize_field("serviceAccount", &info.service_account)?;
    st.end()
}

#[derive(Debug)]
struct Running {
    netns: NetnsId,
    identity: Identity,
    ips: Vec<IpAddr>,
    task: JoinHandle<()>,
    drain: DrainTrigger,
    status: PodStatus,
}

/// The drain deadline used when the one asked for does not fit in an [`Instant`] (the env's is
/// capped lower already, [`crate::proxy::istio_env::MAX_TERMINATION_DEADLINE`]).
const MAX_DRAIN: Duration = Duration::from_secs(3600);

/// A shutdown in progress: the pods whose drain [`ProxyManager::start_drain`] began, and the
/// deadline of their open connections.
#[derive(Debug)]
pub struct Draining {
    ctx: Arc<ProxyContext>,
    pods: Vec<(String, Running)>,
    deadline: Instant,
}

/// What [`Draining::finish`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Pods whose connections all ended on their own before the deadline.
    pub drained: usize,
    /// Pods that still had open connections at the deadline (closed then).
    pub forced: usize,
}

/// The reference on an identity's certificate that `add` takes; released when dropped unless
/// [`CertHold::keep`] hands it to the running pod (the undo of a failed start).
struct CertHold<'a> {
    certs: &'a CertManager,
    identity: Option<Identity>,
}

/// Starts and stops pod proxies; see the module docs.
pub struct ProxyManager {
    ctx: Arc<ProxyContext>,
    running: Mutex<HashMap<String, Running>>,
    port_reuse: bool,
    draining: AtomicBool,
}

impl ProxyManager {
    /// A manager over `ctx`, with port reuse on the pods' listeners (ztunnel's default).
    pub fn new(ctx: Arc<ProxyContext>) -> Arc<ProxyManager> {
        ProxyManager::with_port_reuse(ctx, true)
    }

    /// A manager over `ctx`; `port_reuse` (`INPOD_PORT_REUSE`) puts `SO_REUSEPORT` on the pods'
    /// listeners ([`PodSockets::with_port_reuse`]).
    pub fn with_port_reuse(ctx: Arc<ProxyContext>, port_reuse: bool) -> Arc<ProxyManager> {
        Arc::new(ProxyManager {
            ctx,
            running: Mutex::new(HashMap::new()),
            port_reuse,
            draining: AtomicBool::new(false),
        })
    }

    /// Shared context.
    pub fn ctx(&self) -> &Arc<ProxyContext> {
        &self.ctx
    }

    /// `workloadState` for `/config_dump`: pod uid → status.
    pub fn status(&self) -> BTreeMap<String, PodStatus> {
        self.running
            .lock()
            .map(|r| {
                r.iter()
                    .map(|(k, v)| (k.clone(), v.status.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Number of pods served.
    pub fn len(&self) -> usize {
        self.running.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// Whether no pod is served.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Serves agent requests until the channel closes; answers each with an ack or nack text.
    ///
    /// `on_ready` follows ztunnel's "workload proxy manager" readiness: it is called with `true`
    /// once the first `SnapshotSent` arrived while no workload's start has failed (a failed Add
    /// stays pending until a later Add of that uid succeeds or a Del removes it), and with `false`
    /// when that stops holding. Each change is reported before the request's ack.
    pub async fn run(
        self: Arc<Self>,
        mut rx: InProcessReceiver,
        mut on_ready: impl FnMut(bool) + Send,
    ) {
        let mut snapshot = false;
        let mut failed: HashSet<String> = HashSet::new();
        let mut ready = false;
        while let Some((req, ack)) = rx.recv().await {
            let res = match req {
                WorkloadRequest::Add { uid, info, netns } => {
                    let res = self.add(uid.clone(), info, netns).await;
                    if res.is_ok() {
                        failed.remove(&uid);
                    } else {
                        failed.insert(uid);
                    }
                    res.map_err(|e| Nack::new(format!("failure to start proxy : {e}")))
                }
                WorkloadRequest::Del { uid } => {
                    self.del(&uid);
                    failed.remove(&uid);
                    Ok(())
                }
                WorkloadRequest::SnapshotSent => {
                    snapshot = true;
                    Ok(())
                }
                WorkloadRequest::Keep { .. } => Ok(()),
            };
            let wm = &self.ctx.metrics.workload_manager;
            wm.active.set(i64::try_from(self.len()).unwrap_or(i64::MAX));
            wm.pending
                .set(i64::try_from(failed.len()).unwrap_or(i64::MAX));
            if ready != (snapshot && failed.is_empty()) {
                ready = !ready;
                on_ready(ready);
            }
            let _ = ack.send(res);
        }
        self.stop_all();
    }

    /// Stops every pod proxy at once (their connections too).
    pub fn stop_all(&self) {
        if let Ok(mut r) = self.running.lock() {
            for (uid, p) in r.drain() {
                self.ctx.metrics.workload_manager.stopped.inc();
                p.task.abort();
                self.ctx.local.remove(&uid, &p.ips);
                self.ctx.certs.release(&p.identity);
            }
            self.ctx.metrics.workload_manager.active.set(0);
        }
    }

    /// Begins a graceful shutdown: from now on Adds are refused ([`PodProxyError::Draining`]),
    /// and every running pod stops accepting, sends GOAWAY on its HBONE connections and stops
    /// pooling, while its open connections go on; they get `deadline` from now to end
    /// ([`Draining::finish`]). The pods leave the table at once (a later Del finds nothing; their
    /// certificates and local addresses are released when they finish).
    pub fn start_drain(&self, deadline: Duration) -> Draining {
        // set under the table's lock: an Add that started before checks it again when it
        // inserts, so no pod gets into the table behind the drain
        let pods: Vec<(String, Running)> = {
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            self.draining.store(true, Ordering::Release);
            running.drain().collect()
        };
        for (_, p) in &pods {
            p.drain.start();
        }
        tracing::info!(
            pods = pods.len(),
            ?deadline,
            "draining: listeners closed, open connections may finish"
        );
        Draining {
            ctx: self.ctx.clone(),
            pods,
            deadline: Instant::now()
                .checked_add(deadline)
                .unwrap_or_else(|| Instant::now() + MAX_DRAIN),
        }
    }

    fn del(&self, uid: &str) {
        let removed = self.running.lock().ok().and_then(|mut r| r.remove(uid));
        if let Some(p) = removed {
            p.task.abort();
            self.ctx.local.remove(uid, &p.ips);
            self.ctx.certs.release(&p.identity);
            self.ctx.metrics.workload_manager.stopped.inc();
            tracing::info!(%uid, "pod proxy stopped");
        }
    }

    async fn add(
        &self,
        uid: String,
        info: WorkloadInfo,
        netns: Netns,
    ) -> Result<(), PodProxyError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(PodProxyError::Draining);
        }
        if let Ok(r) = self.running.lock()
            && r.get(&uid).is_some_and(|p| p.netns == netns.id())
        {
            return Ok(());
        }
        let known = self
            .ctx
            .state
            .load()
            .workload_by_name(&info.namespace, &info.name);
        // A pod the state does not list yet is served at once with its handoff's identity, as
        // ztunnel serves in-pod workloads from their ZDS `WorkloadInfo`: a late or missing record
        // never holds up the ack (and every other pod's Add behind it).
        let workload = match known {
            Some(w) => w,
            None => self.handoff_workload(&uid, &info, &netns).await?,
        };
        let identity = workload.identity();
        // the new hold before the old proxy of this uid (another netns) lets go of its own, so a
        // sandbox recreated with the same identity keeps its certificate
        let hold = CertHold::take(&self.ctx.certs, &identity).await?;
        self.del(&uid);
        let sockets = PodSockets::new(&netns, self.ctx.mark)?.with_port_reuse(self.port_reuse);
        let outbound_l = sockets.listen(OUTBOUND_PORT).await?;
        let inbound_l = sockets.listen(INBOUND_PLAINTEXT_PORT).await?;
        let hbone_l = sockets.listen(HBONE_PORT).await?;
        for l in [&outbound_l, &inbound_l, &hbone_l] {
            tune_listener(l);
        }
        let dns_l = match &self.ctx.dns {
            Some(_) => Some(dns::bind(&sockets).await?),
            None => None,
        };
        let server_tls = tls::server_config(self.ctx.certs.clone(), identity.clone())?;
        let ips = workload.workload_ips.clone();
        let (drain, drain_watch) = drain::channel();
        let pod = Arc::new(PodProxy {
            ctx: self.ctx.clone(),
            ips: ips.clone(),
            identity: identity.clone(),
            workload,
            pool: Pool::new(sockets.clone(), self.ctx.certs.clone(), self.ctx.pool),
            sockets,
            server_tls,
            live: Arc::default(),
            drain: drain_watch,
        });
        let span = tracing::info_span!("pod", %uid, name = %info.name, namespace = %info.namespace);
        let listeners = Listeners {
            outbound: outbound_l,
            inbound: inbound_l,
            hbone: hbone_l,
            dns: dns_l,
        };
        let task = tokio::spawn(tracing::Instrument::instrument(serve(pod, listeners), span));
        let dns_port = self.ctx.dns.as_ref().map(|_| DNS_PORT);
        tracing::info!(%uid, %identity, netns = %netns.id(), ports = ?[OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT], dns = ?dns_port, "pod proxy listening");
        let status = PodStatus {
            info,
            state: "Up",
            identity: identity.to_string(),
            netns: netns.id().to_string(),
        };
        let mut r = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if self.draining.load(Ordering::Acquire) {
            // the drain began while this pod was starting: it is not served (its certificate
            // hold is released on return)
            drop(r);
            task.abort();
            tracing::info!(%uid, "pod start refused: the proxy began draining meanwhile");
            return Err(PodProxyError::Draining);
        }
        self.ctx.local.insert(&uid, &ips, &identity);
        r.insert(
            uid,
            Running {
                netns: netns.id(),
                identity,
                ips,
                task,
                drain,
                status,
            },
        );
        hold.keep();
        self.ctx.metrics.workload_manager.started.inc();
        Ok(())
    }

    /// The workload of a pod the state does not list: its handoff's identity and its netns's
    /// addresses (loopback and IPv6 link-local left out).
    async fn handoff_workload(
        &self,
        uid: &str,
        info: &WorkloadInfo,
        netns: &Netns,
    ) -> Result<Arc<Workload>, PodProxyError> {
        let ns = netns.clone();
        let addrs = tokio::task::spawn_blocking(move || ns.interface_addrs())
            .await
            .map_err(|_| PodProxyError::Handoff(netns.id()))?
            .map_err(|e| PodProxyError::Socket(SocketError::Netns(e)))?;
        let ips: Vec<IpAddr> = addrs
            .into_iter()
            .filter(|ip| !ip.is_loopback() && !is_link_local(ip))
            .collect();
        tracing::info!(%uid, ?ips, "workload not in the state: serving it with its handoff identity");
        Ok(Arc::new(Workload::from_handoff(
            &self.ctx.trust_domain,
            uid,
            &info.name,
            &info.namespace,
            &info.service_account,
            ips,
        )))
    }
}

// === impl Draining ===

impl Draining {
    /// Waits until every draining pod's connections ended, or the deadline passed; then closes
    /// what is left (those pods' tasks are aborted, their sockets closed) and releases the pods'
    /// certificates and local addresses.
    pub async fn finish(self) -> DrainReport {
        let Draining {
            ctx,
            mut pods,
            deadline,
        } = self;
        let all = futures::future::join_all(pods.iter_mut().map(|(_, p)| &mut p.task));
        let timed_out = tokio::time::timeout_at(deadline, all).await.is_err();
        let mut report = DrainReport {
            drained: 0,
            forced: 0,
        };
        for (uid, p) in pods {
            if p.task.is_finished() {
                report.drained += 1;
            } else {
                p.task.abort();
                report.forced += 1;
                tracing::info!(%uid, "termination deadline passed: closing the pod's open connections");
            }
            ctx.local.remove(&uid, &p.ips);
            ctx.certs.release(&p.identity);
        }
        if timed_out {
            tracing::warn!(
                drained = report.drained,
                forced = report.forced,
                "drain deadline expired with open connections; closed them"
            );
        } else {
            tracing::info!(
                pods = report.drained,
                "drain complete: every connection ended"
            );
        }
        report
    }
}

// === impl CertHold ===

impl<'a> CertHold<'a> {
    /// [`CertManager::ensure`] for `identity`.
    async fn take(
        certs: &'a CertManager,
        identity: &Identity,
    ) -> Result<CertHold<'a>, IdentityError> {
        certs.ensure(identity).await?;
        Ok(CertHold {
            certs,
            identity: Some(identity.clone()),
        })
    }

    /// The running pod holds the reference from now on (released by `del`).
    fn keep(mut self) {
        self.identity = None;
    }
}

impl Drop for CertHold<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.identity.take() {
            self.certs.release(&id);
        }
    }
}

/// A pod's listeners, as [`serve`] takes them.
struct Listeners {
    outbound: TcpListener,
    inbound: TcpListener,
    hbone: TcpListener,
    dns: Option<dns::PodDns>,
}

/// Accepts on the three listeners and serves the pod's DNS proxy ([`dns::serve`]) when it has one;
/// connection tasks live in a [`TaskScope`] so aborting this task ends them. Accepted sockets
/// inherit TCP_NODELAY and TCP keepalive from the listeners ([`tune_listener`]); the outbound pool
/// is swept every [`PoolConfig::sweep_interval`](crate::proxy::pool::PoolConfig::sweep_interval);
/// open inbound connections are re-checked when the policies change ([`PolicyWatcher`]).
///
/// Once the pod's drain starts ([`PodProxy::drain`]) the listeners and the DNS proxy close, the
/// pool stops pooling ([`Pool::drain`]), and this returns when the last connection ended.
async fn serve(pod: Arc<PodProxy>, listeners: Listeners) {
    let Listeners {
        outbound: outbound_l,
        inbound: inbound_l,
        hbone: hbone_l,
        dns: dns_l,
    } = listeners;
    let mut conns = TaskScope::new();
    let mut dns_task = JoinSet::new();
    if let (Some(listeners), Some(d)) = (dns_l, pod.ctx.dns.clone()) {
        dns_task.spawn(dns::serve(pod.clone(), d, listeners));
    }
    let mut sweep = tokio::time::interval(pod.pool.config().sweep_interval());
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut policies = PolicyWatcher::new(
        pod.ctx.state.clone(),
        pod.live.clone(),
        pod.workload.clone(),
    );
    let mut drain = pod.drain.clone();
    loop {
        tokio::select! {
            () = drain.started() => break,
            () = policies.changed() => {
                policies.recheck();
            }
            r = outbound_l.accept() => match r {
                Ok((s, peer)) => {
                    conns.spawn(outbound::handle(pod.clone(), s, peer));
                }
                Err(e) => accept_backoff(e).await,
            },
            r = inbound_l.accept() => match r {
                Ok((s, peer)) => {
                    conns.spawn(inbound::handle_plaintext(pod.clone(), s, peer));
                }
                Err(e) => accept_backoff(e).await,
            },
            r = hbone_l.accept() => match r {
                Ok((s, peer)) => {
                    conns.spawn(inbound::handle_hbone(pod.clone(), s, peer));
                }
                Err(e) => accept_backoff(e).await,
            },
            _ = sweep.tick() => {
                pod.pool.sweep();
            }
        }
    }
    drop((outbound_l, inbound_l, hbone_l));
    dns_task.abort_all();
    pod.pool.drain();
    tracing::info!(
        connections = conns.len(),
        "pod proxy draining: listeners closed"
    );
    loop {
        tokio::select! {
            () = policies.changed() => {
                policies.recheck();
            }
            () = conns.wait_empty() => break,
        }
    }
    tracing::info!("pod proxy drained");
}

/// TCP keepalive of accepted sockets, as ztunnel: first probe after 180 s idle, then every 180 s,
/// 9 probes before the kernel drops the connection.
pub const TCP_KEEPALIVE_TIME: Duration = Duration::from_secs(180);
/// Interval between TCP keepalive probes.
pub const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(180);
/// Unanswered TCP keepalive probes before the connection is dropped.
pub const TCP_KEEPALIVE_RETRIES: u32 = 9;

/// Sets TCP_NODELAY and the TCP keepalive above on a listener; Linux copies both to every socket
/// it accepts (so no per-connection syscalls). Failures are logged (connections still work).
pub fn tune_listener(s: &TcpListener) {
    let sock = socket2::SockRef::from(s);
    if let Err(e) = sock.set_tcp_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY on listener");
    }
    let ka = socket2::TcpKeepalive::new()
        .with_time(TCP_KEEPALIVE_TIME)
        .with_interval(TCP_KEEPALIVE_INTERVAL)
        .with_retries(TCP_KEEPALIVE_RETRIES);
    if let Err(e) = sock.set_tcp_keepalive(&ka) {
        tracing::debug!(error = %e, "TCP keepalive on listener");
    }
}

/// Logs an accept error and pauses briefly (EMFILE must not spin the CPU).
async fn accept_backoff(e: std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

#[cfg(test)]
mod tests;
