//! Client of Istio's CA (spec §4 "CA gRPC", "CSR"; ztunnel `src/identity/caclient.rs`,
//! `src/tls/csr.rs`): one `CreateCertificate` call per workload certificate.
//!
//! - The CSR: a fresh ECDSA P-256 key, SHA-256 signature, empty subject, one URI SAN = the SPIFFE
//!   id (critical, since the subject is empty).
//! - The request: `validity_duration` = the configured TTL (`SECRET_TTL`) in seconds, metadata
//!   `ImpersonatedIdentity = <spiffe id>` (shared / node-proxy mode), `authorization` and
//!   `clusterid` headers from [`CallAuth`].
//! - The response: `cert_chain` leaf first; every element but the last is presented (leaf +
//!   intermediates); the last holds the root(s), possibly several concatenated PEMs, which go to
//!   the trust bundle. The leaf must carry exactly the requested identity and our key.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use rcgen::{CertificateParams, DistinguishedName, KeyPair, PKCS_ECDSA_P256_SHA256, SanType};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::Channel;

use super::{Identity, WorkloadCert};
use crate::proxy::control::{self, CallAuth, ControlEndpoint, ControlError};

/// gRPC path of the CA's signing call (proto `istio.v1.auth.IstioCertificateService`).
pub const CREATE_CERTIFICATE_PATH: &str =
    "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// Request metadata key naming the identity a node proxy asks for on a workload's behalf.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// Upper bound of one CA call (connect included); a hung CA then counts as a failed attempt.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// `istio.v1.auth.IstioCertificateRequest` (field numbers from the proto; field 2 is unused).
#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateRequest {
    /// The CSR, PEM.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// Requested lifetime in seconds (0 = the CA's default).
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    /// Extra request data; node proxies put `ImpersonatedIdentity` here.
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<prost_types::Struct>,
}

/// `istio.v1.auth.IstioCertificateResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateResponse {
    /// PEM strings, leaf first; the last one holds the root(s).
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

/// A certificate from the CA with the roots that came with it.
#[derive(Debug)]
pub struct Issued {
    /// The workload certificate: chain = leaf + intermediates, as returned.
    pub cert: WorkloadCert,
    /// The roots from the last chain element (trust anchors for peers).
    pub roots: Vec<CertificateDer<'static>>,
}

/// Something that signs workload certificates over the network: the Istio CA ([`CaClient`]) or,
/// in tests, a fake. [`super::CertManager`] calls it from its background workers.
pub trait RemoteCa: Send + Sync + 'static {
    /// Obtains a new certificate for `id`.
    fn fetch<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Result<Issued, CaClientError>>;

    /// Where the CA is, as errors name it (Istio's CA: its URL).
    fn address(&self) -> String;
}

/// Why a certificate could not be obtained from the CA.
#[derive(Debug, thiserror::Error)]
pub enum CaClientError {
    /// rcgen could not build the key or the CSR.
    #[error("cannot build the CSR for {identity}: {source}")]
    Csr {
        /// The identity asked for.
        identity: String,
        /// The rcgen error.
        #[source]
        source: rcgen::Error,
    },
    /// The channel or the call metadata could not be set up (roots, token file, connect).
    #[error("cannot call the CA: {0}")]
    Control(#[from] ControlError),
    /// The CA answered `UNAUTHENTICATED`: bad or missing token or cluster id.
    #[error("CA refused the token (UNAUTHENTICATED): {message}")]
    Unauthenticated {
        /// The CA's message.
        message: String,
    },
    /// The CA answered `PERMISSION_DENIED`: the token may not obtain this identity.
    #[error("CA denied the identity (PERMISSION_DENIED): {message}")]
    PermissionDenied {
        /// The CA's message.
        message: String,
    },
    /// Any other gRPC status.
    #[error("CA call failed ({}): {message}", code_name(*.code))]
    Status {
        /// The gRPC code.
        code: tonic::Code,
        /// The CA's (or transport's) message.
        message: String,
    },
    /// No answer within [`CALL_TIMEOUT`].
    #[error("CA call timed out after {0:?}")]
    Timeout(Duration),
    /// The response has an empty `cert_chain`.
    #[error("CA response has no certificate")]
    EmptyChain,
    /// A `cert_chain` element holds no PEM certificate (or broken PEM).
    #[error("CA response element {index} is not PEM certificates")]
    BadPem {
        /// Position in `cert_chain`.
        index: usize,
    },
    /// The leaf is not valid X.509.
    #[error("CA returned an unparsable leaf: {0}")]
    BadLeaf(String),
    /// The leaf's URI SANs are not exactly the requested identity.
    #[error("CA returned a certificate for [{}] instead of {requested}", .presented.join(", "))]
    IdentityMismatch {
        /// What was asked for.
        requested: String,
        /// The leaf's URI SANs.
        presented: Vec<String>,
    },
    /// The leaf certifies another public key than the CSR's.
    #[error("CA returned a certificate for another key than the CSR's")]
    KeyMismatch,
    /// The configured TTL does not fit the request (whole seconds, 1 s up to `i64::MAX`).
    #[error("certificate TTL {0:?} is out of range")]
    Ttl(Duration),
}

/// The client of Istio's CA (`CA_ADDRESS`); see the module docs. Cheap to share as `Arc`.
pub struct CaClient {
    endpoint: ControlEndpoint,
    auth: CallAuth,
    ttl: Duration,
    channel: tokio::sync::Mutex<Option<Channel>>,
}

// === impl CaClientError ===

impl CaClientError {
    /// Whether retrying can help soon (CA unreachable or overloaded) rather than being a
    /// refusal or a bad answer. [`super::CertManager::ensure`] fails at once on the others.
    pub fn is_transient(&self) -> bool {
        use tonic::Code;
        match self {
            CaClientError::Control(ControlError::Connect { .. }) | CaClientError::Timeout(_) => {
                true
            }
            CaClientError::Status { code, .. } => matches!(
                code,
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::Unknown
                    | Code::Cancelled
            ),
            _ => false,
        }
    }

    fn from_status(s: tonic::Status) -> CaClientError {
        let message = s.message().to_owned();
        match s.code() {
            tonic::Code::Unauthenticated => CaClientError::Unauthenticated { message },
            tonic::Code::PermissionDenied => CaClientError::PermissionDenied { message },
            code => CaClientError::Status { code, message },
        }
    }
}

/// The gRPC code as in the proto (`UNAVAILABLE`, ...).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

// === impl CaClient ===

impl CaClient {
    /// A client of the CA at `endpoint` asking for certificates valid for `ttl` (whole seconds;
    /// ztunnel's `SECRET_TTL`, default 24 h). Connects on the first call.
    pub fn new(endpoint: ControlEndpoint, auth: CallAuth, ttl: Duration) -> CaClient {
        CaClient {
            endpoint,
            auth,
            ttl,
            channel: tokio::sync::Mutex::new(None),
        }
    }

    /// The requested certificate lifetime.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The CA endpoint.
    pub fn endpoint(&self) -> &ControlEndpoint {
        &self.endpoint
    }

    /// Makes a CSR for `id`, calls `CreateCertificate` and checks the answer.
    ///
    /// # Errors
    /// See [`CaClientError`]; a refused token is [`CaClientError::Unauthenticated`].
    pub async fn create_certificate(&self, id: &Identity) -> Result<Issued, CaClientError> {
        let validity_duration = i64::try_from(self.ttl.as_secs())
            .ok()
            .filter(|s| *s > 0)
            .ok_or(CaClientError::Ttl(self.ttl))?;
        let csr = Csr::new(id)?;
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr: csr.pem.clone(),
            validity_duration,
            metadata: Some(impersonation(id)),
        });
        self.auth.apply(&mut req)?;
        let channel = self.channel().await?;
        let call =
            control::unary::<_, IstioCertificateResponse>(channel, CREATE_CERTIFICATE_PATH, req);
        let resp = match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(status)) => {
                let err = CaClientError::from_status(status);
                if err.is_transient() {
                    // reconnect (and re-read the roots) next time
                    *self.channel.lock().await = None;
                }
                return Err(err);
            }
            Err(_) => {
                *self.channel.lock().await = None;
                return Err(CaClientError::Timeout(CALL_TIMEOUT));
            }
        };
        let issued = parse_response(id, &resp.cert_chain, csr)?;
        tracing::debug!(
            identity = %id,
            serial = ?issued.cert.serial_hex(),
            chain = issued.cert.chain.len(),
            roots = issued.roots.len(),
            "certificate from the CA"
        );
        Ok(issued)
    }

    async fn channel(&self) -> Result<Channel, CaClientError> {
        let mut guard = self.channel.lock().await;
        if let Some(ch) = guard.as_ref() {
            return Ok(ch.clone());
        }
        let ch = tokio::time::timeout(CALL_TIMEOUT, self.endpoint.connect())
            .await
            .map_err(|_| CaClientError::Timeout(CALL_TIMEOUT))??;
        *guard = Some(ch.clone());
        Ok(ch)
    }
}

impl RemoteCa for CaClient {
    fn fetch<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Result<Issued, CaClientError>> {
        Box::pin(self.create_certificate(id))
    }

    fn address(&self) -> String {
        self.endpoint.address.to_string()
    }
}

impl fmt::Debug for CaClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaClient")
            .field("address", &self.endpoint.address.to_string())
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// A CSR with the key it was made for.
pub struct Csr {
    /// The CSR, PEM (`CERTIFICATE REQUEST`).
    pub pem: String,
    /// The new private key.
    pub key: KeyPair,
    /// The raw public key (uncompressed EC point), to match against the leaf.
    pub key_public: Vec<u8>,
}

impl Csr {
    /// A CSR for `id`: fresh ECDSA P-256 key, SHA-256, empty subject, the SPIFFE id as the only
    /// (critical) URI SAN, no other extension.
    ///
    /// # Errors
    /// [`CaClientError::Csr`] when key generation or signing fails, or the id is not IA5.
    pub fn new(id: &Identity) -> Result<Csr, CaClientError> {
        let spiffe = id.to_string();
        let err = |source| CaClientError::Csr {
            identity: spiffe.clone(),
            source,
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(err)?;
        let uri = rcgen::string::Ia5String::try_from(spiffe.clone()).map_err(err)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(uri)];
        let pem = params
            .serialize_request(&key)
            .and_then(|csr| csr.pem())
            .map_err(err)?;
        Ok(Csr {
            pem,
            key_public: key.public_key_raw().to_vec(),
            key,
        })
    }
}

impl fmt::Debug for Csr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Csr")
            .field("pem", &self.pem)
            .finish_non_exhaustive()
    }
}

/// `{ImpersonatedIdentity: "<spiffe id>"}` as a protobuf Struct.
fn impersonation(id: &Identity) -> prost_types::Struct {
    let value = prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue(id.to_string())),
    };
    prost_types::Struct {
        fields: BTreeMap::from([(IMPERSONATED_IDENTITY.to_owned(), value)]),
    }
}

/// Checks a `cert_chain` answer to `csr` (made for `id`) and builds the certificate with the
/// CSR's key.
///
/// # Errors
/// Empty chain, bad PEM, unparsable leaf, a leaf for another identity or key.
pub fn parse_response(
    id: &Identity,
    cert_chain: &[String],
    csr: Csr,
) -> Result<Issued, CaClientError> {
    let (last, presented) = cert_chain.split_last().ok_or(CaClientError::EmptyChain)?;
    // A single element is the leaf alone; its roots then come from the root files.
    let (presented, roots) = if presented.is_empty() {
        (cert_chain, Vec::new())
    } else {
        (presented, pem_certs(cert_chain.len() - 1, last)?)
    };
    let mut chain = Vec::new();
    for (index, pem) in presented.iter().enumerate() {
        chain.extend(pem_certs(index, pem)?);
    }
    let leaf = chain.first().ok_or(CaClientError::EmptyChain)?;
    let (_, x) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| CaClientError::BadLeaf(e.to_string()))?;
    let sans = crate::proxy::tls::uri_sans(leaf);
    let requested = id.to_string();
    if sans != [requested.as_str()] {
        return Err(CaClientError::IdentityMismatch {
            requested,
            presented: sans,
        });
    }
    if x.public_key().subject_public_key.data.as_ref() != csr.key_public.as_slice() {
        return Err(CaClientError::KeyMismatch);
    }
    let secs = |t: x509_parser::time::ASN1Time| {
        u64::try_from(t.timestamp()).map_or(UNIX_EPOCH, |s| UNIX_EPOCH + Duration::from_secs(s))
    };
    let not_before: SystemTime = secs(x.validity().not_before);
    let not_after: SystemTime = secs(x.validity().not_after);
    Ok(Issued {
        cert: WorkloadCert {
            identity: id.clone(),
            chain,
            key: PrivateKeyDer::from(csr.key),
            not_before,
            not_after,
        },
        roots,
    })
}

/// All certificates in one PEM string (at least one).
fn pem_certs(index: usize, pem: &str) -> Result<Vec<CertificateDer<'static>>, CaClientError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| CaClientError::BadPem { index })?;
    if certs.is_empty() {
        return Err(CaClientError::BadPem { index });
    }
    Ok(certs)
}

#[cfg(test)]
#[path = "caclient_tests.rs"]
mod tests;
