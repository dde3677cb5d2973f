//! Workload identities (SPIFFE ids), workload certificates and their cache (spec §4).
//!
//! - [`Identity`]: `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`, parsed as
//!   strictly as ztunnel does (`src/identity/manager.rs`).
//! - [`Ca`] (in `identity/ca.rs`): the built-in CA used in standalone mode; it issues
//!   Istio-shaped leaves (ECDSA P-256, the SPIFFE id as the only SAN).
//! - [`CertManager`]: per-identity certificate cache, re-issuing once a certificate passes
//!   half its lifetime (ztunnel `src/tls/certificate.rs` `refresh_at`).

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rustls::RootCertStore;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

mod ca;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

pub use ca::{CA_KEY_FILE, Ca, ROOT_CERT_FILE};

/// Trust domain used when none is configured (ztunnel: empty XDS `trust_domain`).
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

/// Default workload certificate lifetime (ztunnel `SECRET_TTL`, 24 h).
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(24 * 60 * 60);

/// A workload identity: the SPIFFE id `spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>`.
///
/// The parts are shared strings: a clone (one per connection for the access log, the pool key,
/// ...) costs three reference-count increments, no allocation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    /// Trust domain, e.g. `cluster.local`.
    pub trust_domain: Arc<str>,
    /// Kubernetes namespace.
    pub namespace: Arc<str>,
    /// Kubernetes service account.
    pub service_account: Arc<str>,
}

/// What is wrong with a string that should be a SPIFFE id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpiffeIdProblem {
    /// It does not start with `spiffe://`.
    Scheme,
    /// The path does not have exactly 5 `/`-separated segments (`td/ns/X/sa/Y`); holds the count.
    SegmentCount(usize),
    /// The second segment is not the literal `ns`.
    NsLiteral,
    /// The fourth segment is not the literal `sa`.
    SaLiteral,
    /// The trust domain, namespace or service account is empty.
    EmptySegment,
}

/// Errors of identities, the CA and the certificate cache.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A string is not a valid SPIFFE id.
    #[error("invalid SPIFFE id {id:?}: {problem}")]
    InvalidSpiffeId {
        /// The string as given.
        id: String,
        /// What is wrong with it.
        problem: SpiffeIdProblem,
    },
    /// Key generation or signing failed in rcgen.
    #[error("cannot {action}: {source}")]
    Rcgen {
        /// What was being done, e.g. `sign the certificate for spiffe://...`.
        action: String,
        /// The rcgen error.
        #[source]
        source: rcgen::Error,
    },
    /// The requested certificate lifetime is below one second.
    #[error("certificate lifetime {lifetime:?} is too short (minimum 1 s)")]
    LifetimeTooShort {
        /// The requested lifetime.
        lifetime: Duration,
    },
    /// A CA file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A CA file could not be written.
    #[error("cannot write {}: {source}", path.display())]
    WriteFile {
        /// The file (or directory).
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Only one of the two CA files exists; refusing to overwrite it.
    #[error(
        "CA directory {} has {present} but not {missing}; provide both or neither",
        dir.display()
    )]
    IncompleteCaDir {
        /// The directory.
        dir: PathBuf,
        /// The file that exists.
        present: &'static str,
        /// The file that is missing.
        missing: &'static str,
    },
    /// The root certificate PEM holds no parsable certificate.
    #[error("cannot parse root certificate {}: {source}", path.display())]
    ParseRootCert {
        /// The file.
        path: PathBuf,
        /// The PEM error.
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The CA key or certificate was rejected by rcgen.
    #[error("cannot load CA from {}: {source}", path.display())]
    LoadCa {
        /// The offending file.
        path: PathBuf,
        /// The rcgen error.
        #[source]
        source: rcgen::Error,
    },
    /// The CA key does not belong to the root certificate.
    #[error("{} does not match the public key of {}", key.display(), cert.display())]
    CaKeyMismatch {
        /// The key file.
        key: PathBuf,
        /// The certificate file.
        cert: PathBuf,
    },
    /// The root certificate is not valid X.509.
    #[error("cannot parse certificate {}: {source}", path.display())]
    X509 {
        /// The file.
        path: PathBuf,
        /// The parser error.
        #[source]
        source: x509_parser::nom::Err<x509_parser::error::X509Error>,
    },
    /// The system random generator failed.
    #[error("cannot generate a random serial number: the system random generator failed")]
    Random,
    /// A validity time does not fit in an X.509 time.
    #[error("certificate time {secs} s after the epoch is out of range")]
    TimeOutOfRange {
        /// Seconds since the Unix epoch.
        secs: u64,
    },
    /// The root certificate could not be added to a rustls root store.
    #[error("root certificate is not a usable trust anchor: {source}")]
    TrustAnchor {
        /// The rustls error.
        #[source]
        source: rustls::Error,
    },
}

/// A workload's certificate and key, as issued for one [`Identity`].
pub struct WorkloadCert {
    /// The identity in the leaf's URI SAN.
    pub identity: Identity,
    /// The chain, leaf first (then intermediates; the root is not included).
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key (PKCS#8, ECDSA P-256).
    pub key: PrivateKeyDer<'static>,
    /// Start of validity (whole seconds, as encoded in the certificate).
    pub not_before: SystemTime,
    /// End of validity (whole seconds, as encoded in the certificate).
    pub not_after: SystemTime,
}

/// Source of "now" for [`CertManager`]'s refresh decision; tests inject a fake clock.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Per-identity cache of workload certificates issued by a [`Ca`]; share it as `Arc<CertManager>`.
///
/// [`CertManager::get`] returns the cached certificate until its [`WorkloadCert::refresh_at`]
/// time, then issues a new one. If re-issuing fails, the old certificate is kept until it
/// expires (as ztunnel does).
pub struct CertManager {
    ca: Ca,
    lifetime: Duration,
    roots: Arc<RootCertStore>,
    clock: Clock,
    cache: Mutex<HashMap<Identity, Arc<WorkloadCert>>>,
}

// === impl Identity ===

impl Identity {
    /// Builds an identity from its three parts (not validated; see [`FromStr`] for parsing).
    pub fn new(
        trust_domain: impl Into<Arc<str>>,
        namespace: impl Into<Arc<str>>,
        service_account: impl Into<Arc<str>>,
    ) -> Identity {
        Identity {
            trust_domain: trust_domain.into(),
            namespace: namespace.into(),
            service_account: service_account.into(),
        }
    }
}

impl fmt::Display for Identity {
    /// `spiffe://<td>/ns/<ns>/sa/<sa>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

impl FromStr for Identity {
    type Err = IdentityError;

    /// Parses exactly `spiffe://<td>/ns/<ns>/sa/<sa>` with non-empty parts.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |problem| IdentityError::InvalidSpiffeId {
            id: s.to_owned(),
            problem,
        };
        let path = s
            .strip_prefix("spiffe://")
            .ok_or(fail(SpiffeIdProblem::Scheme))?;
        let parts: Vec<&str> = path.split('/').collect();
        let [td, ns_lit, ns, sa_lit, sa] = parts[..] else {
            return Err(fail(SpiffeIdProblem::SegmentCount(parts.len())));
        };
        if ns_lit != "ns" {
            return Err(fail(SpiffeIdProblem::NsLiteral));
        }
        if sa_lit != "sa" {
            return Err(fail(SpiffeIdProblem::SaLiteral));
        }
        if td.is_empty() || ns.is_empty() || sa.is_empty() {
            return Err(fail(SpiffeIdProblem::EmptySegment));
        }
        Ok(Identity::new(td, ns, sa))
    }
}

impl serde::Serialize for Identity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for SpiffeIdProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpiffeIdProblem::Scheme => f.write_str("must start with `spiffe://`"),
            SpiffeIdProblem::SegmentCount(n) => write!(
                f,
                "expected 5 path segments `<trust-domain>/ns/<namespace>/sa/<service-account>`, got {n}"
            ),
            SpiffeIdProblem::NsLiteral => f.write_str("second segment must be the literal `ns`"),
            SpiffeIdProblem::SaLiteral => f.write_str("fourth segment must be the literal `sa`"),
            SpiffeIdProblem::EmptySegment => {
                f.write_str("trust domain, namespace and service account must not be empty")
            }
        }
    }
}

// === impl WorkloadCert ===

impl WorkloadCert {
    /// When to re-issue: `not_before + (not_after - not_before) / 2` (ztunnel `refresh_at`).
    pub fn refresh_at(&self) -> SystemTime {
        let life = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + life / 2
    }

    /// The leaf certificate (first element of the chain).
    pub fn leaf(&self) -> Option<&CertificateDer<'static>> {
        self.chain.first()
    }

    /// Whether `now` lies inside the validity period.
    pub fn is_valid_at(&self, now: SystemTime) -> bool {
        self.not_before <= now && now < self.not_after
    }

    /// The leaf's serial number as lowercase hex with `:` separators, if the leaf parses.
    pub fn serial_hex(&self) -> Option<String> {
        let leaf = self.leaf()?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
        Some(
            cert.raw_serial()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
        )
    }

    /// The chain as concatenated PEM blocks, leaf first (for dumps and debugging).
    pub fn chain_pem(&self) -> String {
        self.chain.iter().map(|c| der_to_pem(c)).collect()
    }
}

impl fmt::Debug for WorkloadCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkloadCert")
            .field("identity", &self.identity.to_string())
            .field("serial", &self.serial_hex())
            .field("chain_len", &self.chain.len())
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// PEM-encodes one certificate (`-----BEGIN CERTIFICATE-----`, 64-column base64, `\n` endings).
pub(crate) fn der_to_pem(der: &CertificateDer<'_>) -> String {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der.as_ref()), config)
}

// === impl CertManager ===

impl CertManager {
    /// A cache issuing from `ca` with the given certificate lifetime (use
    /// [`DEFAULT_CERT_LIFETIME`] for Istio's 24 h). Uses the system clock.
    pub fn new(ca: Ca, lifetime: Duration) -> Arc<CertManager> {
        Self::with_clock(ca, lifetime, Arc::new(SystemTime::now))
    }

    /// Like [`CertManager::new`] but decides refreshes with `clock` (for tests). Certificates
    /// themselves always carry real (system clock) validity times.
    pub fn with_clock(ca: Ca, lifetime: Duration, clock: Clock) -> Arc<CertManager> {
        let roots = Arc::new(ca.root_store());
        Arc::new(CertManager {
            ca,
            lifetime,
            roots,
            clock,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The certificate for `id`: the cached one until its refresh time, else a new one.
    ///
    /// # Errors
    /// Issuing errors from [`Ca::issue`], only when no still-valid certificate is cached.
    pub fn get(&self, id: &Identity) -> Result<Arc<WorkloadCert>, IdentityError> {
        let now = (self.clock)();
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let cached = cache.get(id).cloned();
        if let Some(cert) = &cached
            && now < cert.refresh_at()
        {
            return Ok(cert.clone());
        }
        match self.ca.issue(id, self.lifetime) {
            Ok(cert) => {
                let cert = Arc::new(cert);
                cache.insert(id.clone(), cert.clone());
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

    /// Drops the cached certificate of `id` (e.g. when its last workload left the node).
    pub fn forget(&self, id: &Identity) {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    /// The trust anchors (our CA's root) for verifying peers.
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.roots.clone()
    }

    /// All cached certificates, sorted by identity (for `/config_dump`).
    pub fn certificates(&self) -> Vec<Arc<WorkloadCert>> {
        let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let mut certs: Vec<_> = cache.values().cloned().collect();
        certs.sort_by(|a, b| a.identity.cmp(&b.identity));
        certs
    }

    /// The CA root certificate as PEM.
    pub fn root_pem(&self) -> String {
        self.ca.root_pem()
    }

    /// The lifetime of newly issued certificates.
    pub fn lifetime(&self) -> Duration {
        self.lifetime
    }
}

impl fmt::Debug for CertManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertManager")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}
