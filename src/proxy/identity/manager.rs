//! [`CertManager`]: the per-identity certificate cache behind every HBONE handshake, fed by the
//! built-in [`Ca`] (standalone) or a [`RemoteCa`] such as Istio's CA ([`super::CaClient`]).
//!
//! Spec §4 "Rotation" (ztunnel `src/identity/manager.rs`, `src/tls/certificate.rs`):
//! - [`CertManager::get`] is synchronous and cheap; handshakes call it. With the built-in CA it
//!   issues on demand (a local signature). With a remote CA it only reads the cache and never
//!   waits on the network.
//! - [`CertManager::ensure`] (remote CA) takes a reference on the identity, starts its
//!   background worker and waits for the first certificate; the proxy manager calls it before a
//!   pod counts as started. [`CertManager::release`] drops the reference; the last one drops the
//!   certificate and stops the worker (ztunnel forgets an identity when its last workload goes).
//! - The worker refreshes at `not_before + lifetime / 2`; a failed fetch is retried with a
//!   [`Backoff`] of [`CA_RETRY`] (500 ms ×2, jitter 0.2, max 150 s) while the old certificate
//!   stays in use until it expires. At most [`MAX_CONCURRENT_CSRS`] fetches run at once.
//! - Not done: ztunnel's fetch priorities (RealTime > Warmup > Background).

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use rustls::RootCertStore;
use tokio::sync::{Semaphore, watch};
use tokio::task::AbortHandle;

use super::bundle::{TrustBundle, ca_dir_root};
use super::caclient::{CaClient, CaClientError, Issued, RemoteCa};
use super::{Ca, Identity, IdentityError, WorkloadCert};
use crate::backoff::{Backoff, CA_RETRY};
use crate::proxy::control::{CallAuth, ControlEndpoint, RootSource};

/// Most certificate fetches in flight at once (ztunnel: 8).
pub const MAX_CONCURRENT_CSRS: usize = 8;

/// How long [`CertManager::ensure`] waits through transient CA failures (unreachable,
/// `UNAVAILABLE`) before failing; a refusal fails at once.
///
/// Shorter than the agent's 5 s ZDS ack deadline (`zds::server::OP_TIMEOUT`), so a CA outage
/// turns into a nack the agent still reads in time, not a late ack.
pub const ENSURE_TIMEOUT: Duration = Duration::from_secs(4);

/// Shortest pause between two fetches of one identity after a success (guards against a CA
/// issuing certificates that are already past their refresh time).
const MIN_REFRESH_WAIT: Duration = Duration::from_millis(500);

/// Source of "now" for [`CertManager`]'s refresh decisions; tests inject a fake clock.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Where workload certificates come from (what [`crate::proxy::start`] is configured with).
#[derive(Debug, Clone)]
pub enum CertSource {
    /// The built-in CA in `ca_dir` (`root-cert.pem`, `ca-key.pem`; generated when absent).
    BuiltIn {
        /// The CA directory.
        ca_dir: PathBuf,
    },
    /// Istio's CA (`CA_ADDRESS`): CSRs over gRPC; `endpoint.roots` (`CA_ROOT_CA`) is also
    /// trusted for peers.
    Istio {
        /// The CA address and the TLS settings to reach it.
        endpoint: ControlEndpoint,
        /// Token and cluster id sent with every call.
        auth: CallAuth,
    },
}

/// One identity's certificate as [`CertManager::certificate_states`] reports it.
#[derive(Clone)]
pub enum CertState {
    /// Issued (it may be due for refresh).
    Available(Arc<WorkloadCert>),
    /// Requested, nothing issued yet.
    Initializing,
    /// Requested, and the last fetch failed with this error.
    Unavailable(String),
}

/// Tunables of a [`CertManager`]; [`CertOptions::new`] gives the defaults.
#[derive(Clone)]
pub struct CertOptions {
    /// Lifetime of new certificates: the built-in CA's leaves, the remote CA's
    /// `validity_duration` (`SECRET_TTL`).
    pub lifetime: Duration,
    /// "Now" for refresh and validity decisions.
    pub clock: Clock,
    /// See [`ENSURE_TIMEOUT`].
    pub ensure_timeout: Duration,
    /// See [`MAX_CONCURRENT_CSRS`].
    pub max_concurrent_csrs: usize,
}

/// Per-identity cache of workload certificates; share it as `Arc<CertManager>`. See the module
/// docs.
pub struct CertManager {
    issuer: Issuer,
    opts: CertOptions,
    bundle: Arc<TrustBundle>,
    csr_slots: Arc<Semaphore>,
    entries: Mutex<HashMap<Identity, Entry>>,
    me: Weak<CertManager>,
}

enum Issuer {
    BuiltIn(Box<Ca>),
    Remote(Arc<dyn RemoteCa>),
}

/// One identity's state.
struct Entry {
    cert: Option<Arc<WorkloadCert>>,
    /// Holders ([`CertManager::ensure`] minus [`CertManager::release`]).
    refs: usize,
    worker: Option<AbortHandle>,
    /// Fetch outcomes so far (successes and failures).
    attempts: u64,
    last_error: Option<Arc<CaClientError>>,
    /// Bumped after every fetch outcome; [`CertManager::ensure`] waits on it.
    changed: watch::Sender<u64>,
}

// === impl CertOptions ===

impl CertOptions {
    /// `lifetime` with the system clock and the default limits.
    pub fn new(lifetime: Duration) -> CertOptions {
        CertOptions {
            lifetime,
            clock: Arc::new(SystemTime::now),
            ensure_timeout: ENSURE_TIMEOUT,
            max_concurrent_csrs: MAX_CONCURRENT_CSRS,
        }
    }
}

impl fmt::Debug for CertOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertOptions")
            .field("lifetime", &self.lifetime)
            .field("ensure_timeout", &self.ensure_timeout)
            .field("max_concurrent_csrs", &self.max_concurrent_csrs)
            .finish_non_exhaustive()
    }
}

// === impl Entry ===

impl Entry {
    fn new() -> Entry {
        Entry {
            cert: None,
            refs: 0,
            worker: None,
            attempts: 0,
            last_error: None,
            changed: watch::Sender::new(0),
        }
    }

    fn valid_at(&self, now: SystemTime) -> Option<Arc<WorkloadCert>> {
        self.cert.clone().filter(|c| c.is_usable_at(now))
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v += 1);
    }
}

// === impl CertManager ===

impl CertManager {
    /// A cache issuing from the built-in `ca` with the given certificate lifetime (use
    /// [`super::DEFAULT_CERT_LIFETIME`] for Istio's 24 h), trusting the CA's root. Uses the
    /// system clock.
    pub fn new(ca: Ca, lifetime: Duration) -> Arc<CertManager> {
        Self::with_clock(ca, lifetime, Arc::new(SystemTime::now))
    }

    /// Like [`CertManager::new`] but decides refreshes with `clock` (for tests). Certificates
    /// themselves always carry real (system clock) validity times.
    pub fn with_clock(ca: Ca, lifetime: Duration, clock: Clock) -> Arc<CertManager> {
        let bundle = TrustBundle::new(vec![ca.root_der()], &[]);
        let opts = CertOptions {
            clock,
            ..CertOptions::new(lifetime)
        };
        Self::built_in(ca, Arc::new(bundle), opts)
    }

    /// A cache issuing from the built-in `ca`, trusting `bundle` (which should hold the CA's
    /// root).
    pub fn built_in(ca: Ca, bundle: Arc<TrustBundle>, opts: CertOptions) -> Arc<CertManager> {
        Self::build(Issuer::BuiltIn(Box::new(ca)), bundle, opts)
    }

    /// A cache fetching from `ca` in the background, trusting `bundle` plus the roots of the
    /// CA's responses.
    pub fn remote(
        ca: Arc<dyn RemoteCa>,
        bundle: Arc<TrustBundle>,
        opts: CertOptions,
    ) -> Arc<CertManager> {
        Self::build(Issuer::Remote(ca), bundle, opts)
    }

    /// The manager for `source` with certificates of `lifetime`, trusting also `extra_roots`
    /// (e.g. `XDS_ROOT_CA`). Root files are re-read by [`TrustBundle::watch`], which the caller
    /// starts (inside a runtime).
    ///
    /// # Errors
    /// Loading or generating the built-in CA.
    pub fn from_source(
        source: &CertSource,
        lifetime: Duration,
        extra_roots: &[RootSource],
    ) -> Result<Arc<CertManager>, IdentityError> {
        let opts = CertOptions::new(lifetime);
        Ok(match source {
            CertSource::BuiltIn { ca_dir } => {
                let ca = Ca::load_or_generate(Some(ca_dir))?;
                let mut sources = vec![ca_dir_root(ca_dir)];
                sources.extend_from_slice(extra_roots);
                let bundle = TrustBundle::new(vec![ca.root_der()], &sources);
                Self::built_in(ca, Arc::new(bundle), opts)
            }
            CertSource::Istio { endpoint, auth } => {
                let mut sources = vec![endpoint.roots.clone()];
                sources.extend_from_slice(extra_roots);
                let bundle = TrustBundle::new(Vec::new(), &sources);
                let client = CaClient::new(endpoint.clone(), auth.clone(), lifetime);
                Self::remote(Arc::new(client), Arc::new(bundle), opts)
            }
        })
    }

    fn build(issuer: Issuer, bundle: Arc<TrustBundle>, opts: CertOptions) -> Arc<CertManager> {
        Arc::new_cyclic(|me| CertManager {
            issuer,
            csr_slots: Arc::new(Semaphore::new(opts.max_concurrent_csrs.max(1))),
            opts,
            bundle,
            entries: Mutex::new(HashMap::new()),
            me: me.clone(),
        })
    }

    /// The certificate for `id`, for a handshake. Never waits on the network.
    ///
    /// Built-in CA: the cached one until its refresh time, else a newly issued one (if that
    /// fails, the old one until it expires). Remote CA: the cached one while valid.
    ///
    /// # Errors
    /// Built-in: issuing errors from [`Ca::issue`] when no valid certificate is cached. Remote:
    /// [`IdentityError::NotFetched`] (not prefetched with [`CertManager::ensure`], or not yet),
    /// [`IdentityError::Expired`].
    pub fn get(&self, id: &Identity) -> Result<Arc<WorkloadCert>, IdentityError> {
        let now = (self.opts.clock)();
        let mut entries = self.lock();
        let ca = match &self.issuer {
            Issuer::BuiltIn(ca) => ca,
            Issuer::Remote(_) => {
                return match entries.get(id) {
                    Some(e) => match &e.cert {
                        Some(c) if c.is_usable_at(now) => Ok(c.clone()),
                        Some(c) => Err(IdentityError::Expired {
                            identity: id.clone(),
                            not_after: c.not_after,
                        }),
                        None => Err(IdentityError::NotFetched {
                            identity: id.clone(),
                            last_error: e.last_error.clone(),
                        }),
                    },
                    None => Err(IdentityError::NotFetched {
                        identity: id.clone(),
                        last_error: None,
                    }),
                };
            }
        };
        let entry = entries.entry(id.clone()).or_insert_with(Entry::new);
        let cached = entry.cert.clone();
        if let Some(cert) = &cached
            && now < cert.refresh_at()
        {
            return Ok(cert.clone());
        }
        match ca.issue(id, self.opts.lifetime) {
            Ok(cert) => {
                let cert = Arc::new(cert);
                entry.cert = Some(cert.clone());
                tracing::debug!(identity = %id, serial = ?cert.serial_hex(), "issued workload certificate");
                Ok(cert)
            }
            Err(e) => match cached {
                Some(old) if now < old.not_after => {
                    tracing::warn!(identity = %id, error = %e, "certificate refresh failed; keeping the current one");
                    Ok(old)
                }
                _ => Err(e),
            },
        }
    }

    /// Takes a reference on `id` and returns its certificate, fetching it now if there is none
    /// (waiting for the fetch). Pair every success with one [`CertManager::release`]. On error
    /// no reference is kept.
    ///
    /// # Errors
    /// Built-in: as [`CertManager::get`]. Remote: [`IdentityError::Fetch`] at the first
    /// non-transient failure (a refused token or identity, a bad answer),
    /// [`IdentityError::FetchTimeout`] when transient failures last
    /// [`CertOptions::ensure_timeout`].
    ///
    /// # Panics
    /// With a remote CA, outside a tokio runtime (it spawns the identity's worker).
    pub async fn ensure(&self, id: &Identity) -> Result<Arc<WorkloadCert>, IdentityError> {
        let ca = match &self.issuer {
            Issuer::BuiltIn(_) => {
                let cert = self.get(id)?;
                self.lock()
                    .entry(id.clone())
                    .or_insert_with(Entry::new)
                    .refs += 1;
                return Ok(cert);
            }
            Issuer::Remote(ca) => ca.clone(),
        };
        let now = (self.opts.clock)();
        let (mut rx, seen) = {
            let mut entries = self.lock();
            let entry = entries.entry(id.clone()).or_insert_with(Entry::new);
            entry.refs += 1;
            if entry.worker.is_none() {
                let task = tokio::spawn(refresh_loop(self.me.clone(), ca.clone(), id.clone()));
                entry.worker = Some(task.abort_handle());
            }
            if let Some(cert) = entry.valid_at(now) {
                return Ok(cert);
            }
            (entry.changed.subscribe(), entry.attempts)
        };
        let deadline = tokio::time::sleep(self.opts.ensure_timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                r = rx.changed() => {
                    if r.is_err() {
                        // forgotten meanwhile
                        return Err(IdentityError::NotFetched { identity: id.clone(), last_error: None });
                    }
                    let now = (self.opts.clock)();
                    let entries = self.lock();
                    let Some(entry) = entries.get(id) else { continue };
                    if let Some(cert) = entry.valid_at(now) {
                        return Ok(cert);
                    }
                    let refused = entry
                        .last_error
                        .clone()
                        .filter(|e| entry.attempts > seen && !e.is_transient());
                    drop(entries);
                    if let Some(source) = refused {
                        self.release(id);
                        return Err(IdentityError::Fetch { identity: id.clone(), source });
                    }
                }
                () = &mut deadline => {
                    let last_error = self.lock().get(id).and_then(|e| e.last_error.clone());
                    self.release(id);
                    return Err(IdentityError::FetchTimeout {
                        identity: id.clone(),
                        ca: ca.address(),
                        waited: self.opts.ensure_timeout,
                        last_error,
                    });
                }
            }
        }
    }

    /// Drops one reference on `id`; the last one drops its certificate, its CA-response roots
    /// and its background worker. Unknown identities are ignored.
    pub fn release(&self, id: &Identity) {
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(id) else {
            return;
        };
        entry.refs = entry.refs.saturating_sub(1);
        if entry.refs == 0 {
            if let Some(w) = entry.worker.take() {
                w.abort();
            }
            entries.remove(id);
            drop(entries);
            self.bundle.remove_issued(id);
            tracing::debug!(identity = %id, "last holder gone: certificate dropped");
        }
    }

    /// Drops the cached certificate of `id` whatever its references (its worker stops too).
    pub fn forget(&self, id: &Identity) {
        if let Some(mut e) = self.lock().remove(id)
            && let Some(w) = e.worker.take()
        {
            w.abort();
        }
        self.bundle.remove_issued(id);
    }

    /// How many holders `id` has (0 when unknown).
    pub fn holders(&self, id: &Identity) -> usize {
        self.lock().get(id).map_or(0, |e| e.refs)
    }

    /// The trust anchors for verifying peers (the current [`TrustBundle`] roots).
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.bundle.roots()
    }

    /// The trust bundle (roots with their generation, root files).
    pub fn bundle(&self) -> &Arc<TrustBundle> {
        &self.bundle
    }

    /// All cached certificates, sorted by identity (for `/config_dump`).
    pub fn certificates(&self) -> Vec<Arc<WorkloadCert>> {
        let mut certs: Vec<_> = self
            .lock()
            .values()
            .filter_map(|e| e.cert.clone())
            .collect();
        certs.sort_by(|a, b| a.identity.cmp(&b.identity));
        certs
    }

    /// Every identity the cache holds with its state, sorted by identity (ztunnel's
    /// `CertState` in `/config_dump`): a certificate is `Available`; none yet is `Initializing`,
    /// or `Unavailable` with the last fetch error.
    pub fn certificate_states(&self) -> Vec<(Identity, CertState)> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .map(|(id, e)| {
                let state = match (&e.cert, &e.last_error) {
                    (Some(c), _) => CertState::Available(c.clone()),
                    (None, Some(err)) => CertState::Unavailable(err.to_string()),
                    (None, None) => CertState::Initializing,
                };
                (id.clone(), state)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The trusted roots as PEM (the built-in CA's root first).
    pub fn root_pem(&self) -> String {
        self.bundle.pem()
    }

    /// The lifetime of newly issued certificates.
    pub fn lifetime(&self) -> Duration {
        self.opts.lifetime
    }

    /// Whether certificates come from a remote CA.
    pub fn is_remote(&self) -> bool {
        matches!(self.issuer, Issuer::Remote(_))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Identity, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stores a fetched certificate; returns when to refresh it (`None`: `id` was released).
    fn store(&self, id: &Identity, issued: Issued) -> Option<SystemTime> {
        let mut entries = self.lock();
        let entry = entries.get_mut(id)?;
        let cert = Arc::new(issued.cert);
        let refresh = cert.refresh_at();
        tracing::info!(
            identity = %id,
            serial = ?cert.serial_hex(),
            not_after = ?cert.not_after,
            "workload certificate fetched"
        );
        entry.cert = Some(cert);
        entry.attempts += 1;
        entry.last_error = None;
        entry.notify();
        drop(entries);
        self.bundle.set_issued(id, issued.roots);
        Some(refresh)
    }

    /// Records a failed fetch (the old certificate, if any, stays until it expires).
    fn record_failure(&self, id: &Identity, error: CaClientError, retry_in: Duration) {
        let now = (self.opts.clock)();
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(id) else {
            return;
        };
        let keeping = entry.valid_at(now).is_some();
        tracing::warn!(identity = %id, %error, ?retry_in, keeping_current = keeping, "certificate fetch failed");
        entry.attempts += 1;
        entry.last_error = Some(Arc::new(error));
        entry.notify();
    }
}

impl Drop for CertManager {
    fn drop(&mut self) {
        let entries = self
            .entries
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for e in entries.values_mut() {
            if let Some(w) = e.worker.take() {
                w.abort();
            }
        }
    }
}

impl fmt::Debug for CertManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertManager")
            .field("remote", &self.is_remote())
            .field("lifetime", &self.opts.lifetime)
            .finish_non_exhaustive()
    }
}

/// The background worker of one identity: fetch, sleep until the refresh time (or the backoff
/// delay after a failure), repeat. Ends when the manager is gone; aborted on release.
async fn refresh_loop(mgr: Weak<CertManager>, ca: Arc<dyn RemoteCa>, id: Identity) {
    let mut backoff = Backoff::new(CA_RETRY);
    loop {
        let Some(m) = mgr.upgrade() else { return };
        let permit = m.csr_slots.clone().acquire_owned().await;
        let result = ca.fetch(&id).await;
        drop(permit);
        let wait = match result {
            Ok(issued) => {
                backoff.reset();
                let Some(refresh) = m.store(&id, issued) else {
                    return;
                };
                refresh
                    .duration_since((m.opts.clock)())
                    .unwrap_or_default()
                    .max(MIN_REFRESH_WAIT)
            }
            Err(e) => {
                let wait = backoff.next_delay();
                m.record_failure(&id, e, wait);
                wait
            }
        };
        drop(m);
        tokio::time::sleep(wait).await;
    }
}
