//! Certificate resolvers and peer verifiers behind [`super::client_config`] and
//! [`super::server_config`].

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::{TlsError, reject, uri_sans};
use crate::proxy::identity::{CertManager, Identity, WorkloadCert};

/// Presents the certificate of one identity, asking the [`CertManager`] on every handshake.
/// The rustls key for the current certificate is built once and reused until it rotates.
pub(super) struct CertResolver {
    certs: Arc<CertManager>,
    identity: Identity,
    provider: Arc<CryptoProvider>,
    current: Mutex<Option<(Arc<WorkloadCert>, Arc<CertifiedKey>)>>,
}

/// Client side: chain to our roots (EKU serverAuth), then one of the expected identities must
/// be among the leaf's URI SANs. The server name is not checked (we send no SNI).
pub(super) struct PeerIdentityVerifier {
    certs: Arc<CertManager>,
    expected: Vec<Identity>,
    algs: WebPkiSupportedAlgorithms,
}

/// Server side: webpki client verification (mandatory, EKU clientAuth) against the current
/// trust bundle, then some SPIFFE URI SAN of the client must be in our trust domain. The webpki
/// verifier is rebuilt when the bundle's generation changes, so new roots apply to the next
/// handshake.
pub(super) struct TrustDomainVerifier {
    certs: Arc<CertManager>,
    provider: Arc<CryptoProvider>,
    current: Mutex<(u64, Arc<dyn ClientCertVerifier>)>,
    trust_domain: String,
}

// === impl CertResolver ===

impl CertResolver {
    pub(super) fn new(
        certs: Arc<CertManager>,
        identity: Identity,
        provider: Arc<CryptoProvider>,
    ) -> CertResolver {
        CertResolver {
            certs,
            identity,
            provider,
            current: Mutex::new(None),
        }
    }

    fn resolve(&self) -> Option<Arc<CertifiedKey>> {
        let cert = match self.certs.get(&self.identity) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(identity = %self.identity, error = %e, "no certificate for TLS handshake");
                return None;
            }
        };
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((c, key)) = current.as_ref()
            && Arc::ptr_eq(c, &cert)
        {
            return Some(key.clone());
        }
        match CertifiedKey::from_der(cert.chain.clone(), cert.key.clone_key(), &self.provider) {
            Ok(key) => {
                let key = Arc::new(key);
                *current = Some((cert, key.clone()));
                Some(key)
            }
            Err(e) => {
                tracing::warn!(identity = %self.identity, error = %e, "certificate key rejected by rustls");
                None
            }
        }
    }
}

impl ResolvesClientCert for CertResolver {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        CertResolver::resolve(self)
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        CertResolver::resolve(self)
    }
}

impl fmt::Debug for CertResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertResolver")
            .field("identity", &self.identity.to_string())
            .finish_non_exhaustive()
    }
}

// === impl PeerIdentityVerifier ===

impl PeerIdentityVerifier {
    pub(super) fn new(
        certs: Arc<CertManager>,
        expected: Vec<Identity>,
        algs: WebPkiSupportedAlgorithms,
    ) -> PeerIdentityVerifier {
        PeerIdentityVerifier {
            certs,
            expected,
            algs,
        }
    }
}

impl ServerCertVerifier for PeerIdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.certs.roots(),
            intermediates,
            now,
            self.algs.all,
        )?;
        let presented = uri_sans(end_entity);
        let ok = spiffe_ids(&presented).any(|id| self.expected.contains(&id));
        if ok {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(reject(TlsError::PeerIdentityMismatch {
                presented,
                expected: self.expected.clone(),
            }))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

impl fmt::Debug for PeerIdentityVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerIdentityVerifier")
            .field("expected", &self.expected)
            .finish_non_exhaustive()
    }
}

// === impl TrustDomainVerifier ===

impl TrustDomainVerifier {
    /// # Errors
    /// [`TlsError::ClientVerifier`] when the bundle has no usable root now.
    pub(super) fn new(
        certs: Arc<CertManager>,
        provider: Arc<CryptoProvider>,
        trust_domain: String,
    ) -> Result<TrustDomainVerifier, TlsError> {
        let (generation, roots) = certs.bundle().snapshot();
        let inner = webpki_verifier(roots, &provider)
            .map_err(|source| TlsError::ClientVerifier { source })?;
        Ok(TrustDomainVerifier {
            certs,
            provider,
            current: Mutex::new((generation, inner)),
            trust_domain,
        })
    }

    /// The webpki verifier for the current roots.
    fn inner(&self) -> Result<Arc<dyn ClientCertVerifier>, rustls::Error> {
        let (generation, roots) = self.certs.bundle().snapshot();
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.0 != generation {
            let inner = webpki_verifier(roots, &self.provider).map_err(|e| {
                rustls::Error::General(format!(
                    "no usable trust roots for client certificates: {e}"
                ))
            })?;
            *current = (generation, inner);
        }
        Ok(current.1.clone())
    }
}

fn webpki_verifier(
    roots: Arc<rustls::RootCertStore>,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ClientCertVerifier>, rustls::server::VerifierBuilderError> {
    rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider.clone()).build()
}

impl ClientCertVerifier for TrustDomainVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // the roots change at run time; peers present their one workload chain anyway
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()?
            .verify_client_cert(end_entity, intermediates, now)?;
        let presented = uri_sans(end_entity);
        let ok = spiffe_ids(&presented).any(|id| *id.trust_domain == *self.trust_domain);
        if ok {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(reject(TlsError::TrustDomainMismatch {
                presented,
                trust_domain: self.trust_domain.clone(),
            }))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl fmt::Debug for TrustDomainVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrustDomainVerifier")
            .field("trust_domain", &self.trust_domain)
            .finish_non_exhaustive()
    }
}

/// The URI SANs that parse as SPIFFE identities (others, and DNS SANs, are ignored).
fn spiffe_ids(uris: &[String]) -> impl Iterator<Item = Identity> + '_ {
    uris.iter().filter_map(|uri| uri.parse::<Identity>().ok())
}
