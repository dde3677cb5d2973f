//! Workload identities (SPIFFE ids), workload certificates and their cache (spec §4).
//!
//! - [`Identity`]: `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`, parsed as
//!   strictly as ztunnel does (`src/identity/manager.rs`).
//! - [`Ca`] (in `identity/ca.rs`): the built-in CA used in standalone mode; it issues
//!   Istio-shaped leaves (ECDSA P-256, the SPIFFE id as the only SAN).
//! - [`CaClient`] (in `identity/caclient.rs`): the client of Istio's CA (CSR over gRPC).
//! - [`CertManager`] (in `identity/manager.rs`): per-identity certificate cache over either
//!   issuer, refreshing once a certificate passes half its lifetime (ztunnel
//!   `src/tls/certificate.rs` `refresh_at`), with references per identity and retries.
//! - [`TrustBundle`] (in `identity/bundle.rs`): the roots peers are verified against, from the
//!   built-in CA, root files (hot-reloaded) and CA responses.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls_pki_types::{CertificateDer, PrivateKeyDer};

pub mod bundle;
mod ca;
pub mod caclient;
mod manager;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod manager_tests;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

pub use bundle::TrustBundle;
pub use ca::{CA_KEY_FILE, Ca, ROOT_CERT_FILE};
pub use caclient::{CaClient, CaClientError, Issued, RemoteCa};
pub use manager::{
    CertManager, CertOptions, CertSource, CertState, Clock, ENSURE_TIMEOUT, MAX_CONCURRENT_CSRS,
};

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
    /// No certificate from the remote CA is cached for the identity.
    #[error(
        "no certificate for {identity} yet (not prefetched, or the CA has not answered){}",
        last_error.as_ref().map(|e| format!("; last attempt: {e}")).unwrap_or_default()
    )]
    NotFetched {
        /// The identity.
        identity: Identity,
        /// Why the last fetch failed, if one did.
        last_error: Option<Arc<caclient::CaClientError>>,
    },
    /// The cached certificate expired and no refresh succeeded.
    #[error("the certificate for {identity} expired at {not_after:?} and could not be renewed")]
    Expired {
        /// The identity.
        identity: Identity,
        /// End of its validity.
        not_after: SystemTime,
    },
    /// The CA refused or botched the request (not retried by [`CertManager::ensure`]).
    #[error("fetching the certificate for {identity} failed: {source}")]
    Fetch {
        /// The identity.
        identity: Identity,
        /// What the CA client reported.
        #[source]
        source: Arc<caclient::CaClientError>,
    },
    /// The CA stayed unreachable while [`CertManager::ensure`] waited.
    #[error(
        "no certificate for {identity} from the CA {ca} within {waited:?}: {}",
        last_error.as_ref().map_or_else(|| "no answer yet".to_owned(), |e| e.to_string())
    )]
    FetchTimeout {
        /// The identity.
        identity: Identity,
        /// The CA ([`caclient::RemoteCa::address`]).
        ca: String,
        /// How long it waited.
        waited: Duration,
        /// The last (transient) failure, if any.
        last_error: Option<Arc<caclient::CaClientError>>,
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

    /// Whether the certificate can still be presented at `now`: not yet expired. `not_before` is
    /// not checked, as ztunnel does not for its own certificates: a CA whose clock runs ahead
    /// (Istio does not backdate) must not make a fresh certificate unusable.
    pub fn is_usable_at(&self, now: SystemTime) -> bool {
        now < self.not_after
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
