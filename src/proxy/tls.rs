//! rustls configurations for HBONE mTLS (spec §3 "TLS", ztunnel `src/tls/workload.rs`).
//!
//! Both sides: TLS 1.3 only, cipher suites `TLS13_AES_256_GCM_SHA384` and
//! `TLS13_AES_128_GCM_SHA256` (ring), ALPN `h2`. Certificates come from a [`CertManager`] on
//! every handshake, so rotation needs no config rebuild.
//!
//! - Client ([`client_config`]): no SNI (callers use the dummy `ServerName` IP `0.0.0.0`), no
//!   session resumption; the server leaf must chain to our roots with EKU serverAuth, and one
//!   of its URI SANs must be one of the expected identities (DNS SANs and the server name are
//!   ignored), as ztunnel's `IdentityVerifier`.
//! - Server ([`server_config`]): client certificate required, chained to our roots with EKU
//!   clientAuth, and some SPIFFE URI SAN of the client must share the local identity's trust
//!   domain (ztunnel's `TrustDomainVerifier`); principals are left to authorization.

use std::fmt;
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::crypto::ring::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
use rustls::{ClientConfig, ServerConfig};
use rustls_pki_types::CertificateDer;

use super::identity::{CertManager, Identity, IdentityError};

mod handshake;
mod kernel;
pub mod message;
pub mod record;
pub mod stream;
mod verify;

pub use handshake::{accept, connect};
pub use stream::{StreamError, TlsStream};

/// The only ALPN protocol HBONE speaks.
pub const ALPN_H2: &[u8] = b"h2";

/// Errors building TLS configs, and the reasons peers are rejected during handshakes.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// rustls refused the config (e.g. provider and protocol versions do not fit).
    #[error("cannot build the {side} TLS config: {source}")]
    Build {
        /// `client` or `server`.
        side: &'static str,
        /// The rustls error.
        #[source]
        source: rustls::Error,
    },
    /// The webpki client verifier could not be built (e.g. no roots).
    #[error("cannot build the client certificate verifier: {source}")]
    ClientVerifier {
        /// The rustls error.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    /// Our own certificate could not be obtained.
    #[error("no certificate for {identity}: {source}")]
    Certificate {
        /// The local identity.
        identity: Identity,
        /// Why the certificate manager failed.
        #[source]
        source: Box<IdentityError>,
    },
    /// A client config needs at least one acceptable server identity.
    #[error("no expected peer identities given for the TLS client")]
    NoExpectedPeers,
    /// The server's leaf has none of the identities the client expects.
    #[error(
        "peer certificate URI SANs [{}] contain none of the expected identities [{}]",
        .presented.join(", "),
        join(.expected)
    )]
    PeerIdentityMismatch {
        /// The URI SANs of the peer's leaf.
        presented: Vec<String>,
        /// What the client accepts.
        expected: Vec<Identity>,
    },
    /// The client's leaf has no SPIFFE identity in the local trust domain.
    #[error(
        "peer certificate URI SANs [{}] have no SPIFFE identity in trust domain {trust_domain:?}",
        .presented.join(", ")
    )]
    TrustDomainMismatch {
        /// The URI SANs of the peer's leaf.
        presented: Vec<String>,
        /// The local trust domain.
        trust_domain: String,
    },
}

fn join(ids: &[Identity]) -> String {
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The crypto provider for HBONE: ring, restricted to the two TLS 1.3 AES-GCM suites
/// (key exchange groups and signature algorithms as ring's defaults). Built once and shared.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            let mut p = rustls::crypto::ring::default_provider();
            p.cipher_suites = vec![TLS13_AES_256_GCM_SHA384, TLS13_AES_128_GCM_SHA256];
            Arc::new(p)
        })
        .clone()
}

/// The client config for an HBONE connection from `src` to a peer that must present one of
/// `expected_peers` (the destination workload's identity plus its service's SANs).
///
/// TLS 1.3, ALPN `h2`, resumption disabled, SNI off. The client certificate of `src` is
/// fetched from `certs` on every handshake. Connect with `ServerName::IpAddress(0.0.0.0)`.
///
/// # Errors
/// [`TlsError::NoExpectedPeers`], [`TlsError::Certificate`] if `src` gets no certificate now,
/// [`TlsError::Build`].
pub fn client_config(
    certs: Arc<CertManager>,
    src: Identity,
    expected_peers: Vec<Identity>,
) -> Result<Arc<ClientConfig>, TlsError> {
    if expected_peers.is_empty() {
        return Err(TlsError::NoExpectedPeers);
    }
    check_certificate(&certs, &src)?;
    let provider = provider();
    let verifier = Arc::new(verify::PeerIdentityVerifier::new(
        certs.clone(),
        expected_peers,
        provider.signature_verification_algorithms,
    ));
    let resolver = Arc::new(verify::CertResolver::new(certs, src, provider.clone()));
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TlsError::Build {
            side: "client",
            source,
        })?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(resolver);
    cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
    cfg.resumption = rustls::client::Resumption::disabled();
    cfg.enable_sni = false;
    // the traffic keys go to `stream::TlsStream` after the handshake
    cfg.enable_secret_extraction = true;
    Ok(Arc::new(cfg))
}

/// The server config for the HBONE listener of the workload `local`.
///
/// TLS 1.3, ALPN `h2`, no session tickets or session cache. The server certificate of
/// `local` is fetched from `certs` on every handshake. Clients must present a certificate
/// chained (through the intermediates they send) to a root of the current trust bundle
/// ([`CertManager::bundle`]), whose SPIFFE URI SANs include one in `local`'s trust domain.
///
/// # Errors
/// [`TlsError::Certificate`] if `local` gets no certificate now, [`TlsError::ClientVerifier`]
/// (no usable root now), [`TlsError::Build`].
pub fn server_config(
    certs: Arc<CertManager>,
    local: Identity,
) -> Result<Arc<ServerConfig>, TlsError> {
    check_certificate(&certs, &local)?;
    let provider = provider();
    let verifier = Arc::new(verify::TrustDomainVerifier::new(
        certs.clone(),
        provider.clone(),
        local.trust_domain.to_string(),
    )?);
    let resolver = Arc::new(verify::CertResolver::new(certs, local, provider.clone()));
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TlsError::Build {
            side: "server",
            source,
        })?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
    cfg.send_tls13_tickets = 0;
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.enable_secret_extraction = true;
    Ok(Arc::new(cfg))
}

/// The identity of a peer: the first URI SAN of the leaf (`chain[0]`) that parses as a SPIFFE
/// id. `None` for an empty chain, an unparsable leaf, or no SPIFFE URI SAN.
pub fn peer_identity(chain: &[CertificateDer<'_>]) -> Option<Identity> {
    uri_sans(chain.first()?)
        .iter()
        .find_map(|uri| uri.parse().ok())
}

/// All URI SANs of a certificate, in order (empty if it does not parse or has none).
pub fn uri_sans(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, x)) = x509_parser::parse_x509_certificate(cert) else {
        return Vec::new();
    };
    let Ok(Some(san)) = x.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some((*u).to_owned()),
            _ => None,
        })
        .collect()
}

fn check_certificate(certs: &CertManager, id: &Identity) -> Result<(), TlsError> {
    certs
        .get(id)
        .map(|_| ())
        .map_err(|source| TlsError::Certificate {
            identity: id.clone(),
            source: Box::new(source),
        })
}

/// Wraps a [`TlsError`] so rustls reports it inside `CertificateError::Other`; its `Debug`
/// prints the message, because rustls formats that variant with `{:?}`.
struct Rejection(TlsError);

impl fmt::Debug for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for Rejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

fn reject(e: TlsError) -> rustls::Error {
    rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
        Arc::new(Rejection(e)),
    )))
}
