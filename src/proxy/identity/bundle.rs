//! The trust bundle: every root a peer's chain may end at (spec §4: all roots of a CA response
//! are trusted; root files are hot-reloaded).
//!
//! Roots come from three places, merged and de-duplicated by DER:
//! - fixed roots (the built-in CA's own root),
//! - root files (`CA_ROOT_CA` / `XDS_ROOT_CA` paths, the built-in CA dir's `root-cert.pem`), each
//!   may hold several PEM certificates; re-read by [`TrustBundle::reload`], which
//!   [`TrustBundle::watch`] calls every [`RELOAD_INTERVAL`],
//! - the roots of the latest CA response per identity ([`TrustBundle::set_issued`]).
//!
//! Handshakes read [`TrustBundle::roots`] (or [`TrustBundle::snapshot`] with its generation), so
//! a change is seen by the next handshake without any config rebuild.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;

use super::{Identity, der_to_pem};
use crate::proxy::control::RootSource;

/// How often [`TrustBundle::watch`] re-reads the root files.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// The set of trusted roots; share it as `Arc<TrustBundle>`. See the module docs.
pub struct TrustBundle {
    files: Vec<PathBuf>,
    state: Mutex<State>,
}

struct State {
    fixed: Vec<CertificateDer<'static>>,
    /// Per file: the bytes last read (`None`: unreadable) and the roots they held.
    from_files: Vec<(Option<Vec<u8>>, Vec<CertificateDer<'static>>)>,
    issued: BTreeMap<Identity, Vec<CertificateDer<'static>>>,
    store: Arc<RootCertStore>,
    der: Vec<CertificateDer<'static>>,
    generation: u64,
}

// === impl TrustBundle ===

impl TrustBundle {
    /// A bundle of `fixed` roots plus the roots in `sources`: files are read now and on every
    /// [`TrustBundle::reload`]; inline PEM is fixed; [`RootSource::System`] is ignored (web
    /// roots never sign workload certificates). Unreadable files are logged and retried.
    pub fn new(fixed: Vec<CertificateDer<'static>>, sources: &[RootSource]) -> TrustBundle {
        let mut fixed = fixed;
        let mut files = Vec::new();
        for s in sources {
            match s {
                RootSource::File(p) => files.push(p.clone()),
                RootSource::Pem(pem) => match parse_pem(pem.as_bytes()) {
                    Ok(certs) => fixed.extend(certs),
                    Err(why) => tracing::warn!(%why, "inline trust root ignored"),
                },
                RootSource::System => {}
            }
        }
        let bundle = TrustBundle {
            state: Mutex::new(State {
                fixed,
                from_files: vec![(None, Vec::new()); files.len()],
                issued: BTreeMap::new(),
                store: Arc::new(RootCertStore::empty()),
                der: Vec::new(),
                generation: 0,
            }),
            files,
        };
        bundle.lock().rebuild();
        bundle.reload();
        bundle
    }

    /// The current roots (a snapshot; cheap: one `Arc` clone).
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.lock().store.clone()
    }

    /// The current roots with their generation, which changes whenever the set of roots does
    /// (for caches of things built from the roots, e.g. a client-certificate verifier).
    pub fn snapshot(&self) -> (u64, Arc<RootCertStore>) {
        let st = self.lock();
        (st.generation, st.store.clone())
    }

    /// The current roots as DER, in order: fixed, files, CA responses.
    pub fn certificates(&self) -> Vec<CertificateDer<'static>> {
        self.lock().der.clone()
    }

    /// The current roots as concatenated PEM.
    pub fn pem(&self) -> String {
        self.lock().der.iter().map(|c| der_to_pem(c)).collect()
    }

    /// The root files watched.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Records the roots of the latest CA response for `id` (replacing earlier ones).
    pub fn set_issued(&self, id: &Identity, roots: Vec<CertificateDer<'static>>) {
        let mut st = self.lock();
        if st.issued.get(id) != Some(&roots) {
            st.issued.insert(id.clone(), roots);
            st.rebuild();
        }
    }

    /// Forgets the CA-response roots of `id` (its last workload left).
    pub fn remove_issued(&self, id: &Identity) {
        let mut st = self.lock();
        if st.issued.remove(id).is_some() {
            st.rebuild();
        }
    }

    /// Re-reads the root files; returns whether the set of roots changed. A file that cannot be
    /// read or parsed keeps its previous roots (logged once per change).
    pub fn reload(&self) -> bool {
        let read: Vec<_> = self.files.iter().map(|p| std::fs::read(p).ok()).collect();
        let mut st = self.lock();
        let before = st.generation;
        let mut changed = false;
        for ((path, bytes), slot) in self.files.iter().zip(read).zip(st.from_files.iter_mut()) {
            if slot.0 == bytes {
                continue;
            }
            match &bytes {
                None => {
                    tracing::warn!(path = %path.display(), "trust root file unreadable; keeping its previous roots")
                }
                Some(b) => match parse_pem(b) {
                    Ok(certs) => {
                        tracing::info!(path = %path.display(), roots = certs.len(), "trust root file loaded");
                        slot.1 = certs;
                        changed = true;
                    }
                    Err(why) => {
                        tracing::warn!(path = %path.display(), %why, "trust root file ignored; keeping its previous roots")
                    }
                },
            }
            slot.0 = bytes;
        }
        if changed {
            st.rebuild();
        }
        st.generation != before
    }

    /// Spawns a task re-reading the root files every `interval` while the bundle lives (it holds
    /// only a weak reference). Needs a tokio runtime; does nothing without files.
    pub fn watch(self: &Arc<Self>, interval: Duration) -> Option<tokio::task::AbortHandle> {
        if self.files.is_empty() {
            return None;
        }
        let weak: Weak<TrustBundle> = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(bundle) = weak.upgrade() else { return };
                // file reads off the async workers
                if tokio::task::spawn_blocking(move || bundle.reload())
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        Some(task.abort_handle())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for TrustBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("TrustBundle")
            .field("files", &self.files)
            .field("roots", &st.der.len())
            .field("generation", &st.generation)
            .finish()
    }
}

// === impl State ===

impl State {
    /// Recomputes the merged roots; bumps the generation only if they differ.
    fn rebuild(&mut self) {
        let mut seen = HashSet::new();
        let der: Vec<CertificateDer<'static>> = self
            .fixed
            .iter()
            .chain(self.from_files.iter().flat_map(|(_, c)| c))
            .chain(self.issued.values().flatten())
            .filter(|c| seen.insert(c.as_ref().to_vec()))
            .cloned()
            .collect();
        if der == self.der && self.generation > 0 {
            return;
        }
        let mut store = RootCertStore::empty();
        for c in &der {
            if let Err(e) = store.add(c.clone()) {
                tracing::warn!(error = %e, "root certificate is not a usable trust anchor; skipped");
            }
        }
        self.der = der;
        self.store = Arc::new(store);
        self.generation += 1;
    }
}

/// All certificates in `pem`; at least one.
fn parse_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, &'static str> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "broken PEM")?;
    if certs.is_empty() {
        return Err("no PEM certificate");
    }
    Ok(certs)
}

/// `root-cert.pem` of a CA dir, as a [`RootSource`].
pub fn ca_dir_root(dir: &Path) -> RootSource {
    RootSource::File(dir.join(super::ROOT_CERT_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::identity::Ca;

    fn root() -> CertificateDer<'static> {
        Ca::generate().expect("CA").root_der()
    }

    #[test]
    fn roots_merge_from_fixed_files_and_responses_without_duplicates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b, c) = (root(), root(), root());
        let file = dir.path().join("roots.pem");
        std::fs::write(&file, format!("{}{}", der_to_pem(&a), der_to_pem(&b))).expect("write");
        let bundle = TrustBundle::new(vec![a.clone()], &[RootSource::File(file.clone())]);
        assert_eq!(bundle.certificates(), vec![a.clone(), b.clone()]);
        assert_eq!(bundle.roots().len(), 2);
        let (g1, _) = bundle.snapshot();

        let id = Identity::new("cluster.local", "ns", "sa");
        bundle.set_issued(&id, vec![c.clone(), a.clone()]);
        assert_eq!(bundle.certificates(), vec![a.clone(), b.clone(), c.clone()]);
        let (g2, _) = bundle.snapshot();
        assert!(g2 > g1);
        // the same roots again change nothing
        bundle.set_issued(&id, vec![c.clone(), a.clone()]);
        assert_eq!(bundle.snapshot().0, g2);
        bundle.remove_issued(&id);
        assert_eq!(bundle.certificates(), vec![a, b]);
        assert!(bundle.pem().matches("BEGIN CERTIFICATE").count() == 2);
    }

    #[test]
    fn a_changed_file_is_reloaded_and_a_broken_one_keeps_its_roots() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("root-cert.pem");
        let (a, b) = (root(), root());
        // missing at first: no roots, no error
        let bundle = TrustBundle::new(Vec::new(), &[RootSource::File(file.clone())]);
        assert!(bundle.certificates().is_empty());
        std::fs::write(&file, der_to_pem(&a)).expect("write");
        assert!(bundle.reload());
        assert_eq!(bundle.certificates(), vec![a.clone()]);
        assert!(!bundle.reload(), "unchanged file");
        std::fs::write(&file, "garbage").expect("write");
        assert!(!bundle.reload());
        assert_eq!(bundle.certificates(), vec![a.clone()], "kept");
        std::fs::write(&file, format!("{}{}", der_to_pem(&a), der_to_pem(&b))).expect("write");
        assert!(bundle.reload());
        assert_eq!(bundle.certificates(), vec![a, b]);
        std::fs::remove_file(&file).expect("rm");
        assert!(!bundle.reload());
        assert_eq!(bundle.certificates().len(), 2, "kept while missing");
    }

    #[tokio::test]
    async fn the_watcher_picks_up_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("root-cert.pem");
        let bundle = Arc::new(TrustBundle::new(
            Vec::new(),
            &[RootSource::File(file.clone()), RootSource::System],
        ));
        let task = bundle.watch(Duration::from_millis(20)).expect("watching");
        std::fs::write(&file, der_to_pem(&root())).expect("write");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while bundle.roots().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "not reloaded");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
    }
}
