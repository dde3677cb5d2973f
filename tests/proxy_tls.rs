//! In-process HBONE mTLS handshakes over `tokio::io::duplex` with the configs from
//! `ztnode::proxy::tls`, certificates from the built-in CA.

#![allow(clippy::unwrap_used)]

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, anyhow};
use rustls::client::ResolvesClientCert;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, ServerConfig, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio_rustls::{TlsAcceptor, TlsConnector, client, server};

use ztnode::proxy::identity::{Ca, CertManager, Clock, DEFAULT_CERT_LIFETIME, Identity};
use ztnode::proxy::tls::{
    ALPN_H2, TlsError, client_config, peer_identity, provider, server_config, uri_sans,
};

type Handshake = (
    std::io::Result<client::TlsStream<DuplexStream>>,
    std::io::Result<server::TlsStream<DuplexStream>>,
);

fn id(td: &str, ns: &str, sa: &str) -> Identity {
    Identity::new(td, ns, sa)
}

fn client_id() -> Identity {
    id("cluster.local", "ns-a", "client")
}

fn server_id() -> Identity {
    id("cluster.local", "ns-b", "server")
}

fn manager() -> Arc<CertManager> {
    CertManager::new(Ca::generate().expect("CA"), DEFAULT_CERT_LIFETIME)
}

/// Runs both handshake sides to completion (bounded in time) over an in-memory pipe.
async fn handshake(client: Arc<ClientConfig>, server: Arc<ServerConfig>) -> Handshake {
    let (c, s) = tokio::io::duplex(64 * 1024);
    let name = ServerName::IpAddress(Ipv4Addr::UNSPECIFIED.into());
    let both = async {
        tokio::join!(
            TlsConnector::from(client).connect(name, c),
            TlsAcceptor::from(server).accept(s)
        )
    };
    tokio::time::timeout(Duration::from_secs(10), both)
        .await
        .expect("handshake finished in time")
}

/// After a server-side rejection the client gets the server's alert on its first read.
async fn client_sees_rejection(client: std::io::Result<client::TlsStream<DuplexStream>>) {
    if let Ok(mut c) = client {
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .expect("read finished in time");
        eprintln!("client read after rejection: {read:?}");
        assert!(
            read.is_err(),
            "client must get the server's alert: {read:?}"
        );
    }
}

fn serial_of(chain: &[CertificateDer<'_>]) -> Vec<u8> {
    let (_, x) = x509_parser::parse_x509_certificate(&chain[0]).expect("leaf parses");
    x.raw_serial().to_vec()
}

/// A client certificate resolver with a fixed answer (possibly none).
#[derive(Debug)]
struct FixedClientCert(Option<Arc<CertifiedKey>>);

impl ResolvesClientCert for FixedClientCert {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.0.clone()
    }

    fn has_certs(&self) -> bool {
        self.0.is_some()
    }
}

/// `base` with its client certificate replaced.
fn with_client_cert(base: &ClientConfig, cert: Option<Arc<CertifiedKey>>) -> Arc<ClientConfig> {
    let mut cfg = base.clone();
    cfg.client_auth_cert_resolver = Arc::new(FixedClientCert(cert));
    Arc::new(cfg)
}

#[tokio::test]
async fn matching_identities_connect_with_h2() -> Result<()> {
    let certs = manager();
    let ccfg = client_config(certs.clone(), client_id(), vec![server_id()])?;
    let scfg = server_config(certs.clone(), server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    let mut c = c.context("client handshake")?;
    let mut s = s.context("server handshake")?;

    let (_, cconn) = c.get_ref();
    let (_, sconn) = s.get_ref();
    assert_eq!(cconn.alpn_protocol(), Some(ALPN_H2));
    assert_eq!(sconn.alpn_protocol(), Some(ALPN_H2));
    assert_eq!(
        cconn.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    let suite = cconn
        .negotiated_cipher_suite()
        .ok_or_else(|| anyhow!("no suite"))?
        .suite();
    assert!(
        [
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        ]
        .contains(&suite),
        "{suite:?}"
    );
    // No SNI reached the server.
    assert_eq!(sconn.server_name(), None);
    // Each side sees the other's SPIFFE identity.
    assert_eq!(
        peer_identity(cconn.peer_certificates().unwrap_or_default()),
        Some(server_id())
    );
    assert_eq!(
        peer_identity(sconn.peer_certificates().unwrap_or_default()),
        Some(client_id())
    );

    c.write_all(b"ping").await?;
    c.flush().await?;
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"ping");
    s.write_all(b"pong").await?;
    s.flush().await?;
    c.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"pong");
    Ok(())
}

#[tokio::test]
async fn any_expected_identity_is_enough() -> Result<()> {
    let certs = manager();
    let other = id("cluster.local", "ns-b", "someone-else");
    let ccfg = client_config(certs.clone(), client_id(), vec![other, server_id()])?;
    let scfg = server_config(certs, server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    c.context("client")?;
    s.context("server")?;
    Ok(())
}

#[tokio::test]
async fn client_expecting_another_identity_fails() -> Result<()> {
    let certs = manager();
    let wanted = id("cluster.local", "ns-b", "not-the-server");
    let ccfg = client_config(certs.clone(), client_id(), vec![wanted.clone()])?;
    let scfg = server_config(certs, server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    let err = c
        .err()
        .ok_or_else(|| anyhow!("client must reject the server"))?;
    let text = err.to_string();
    eprintln!("client error: {text}");
    assert!(text.contains(&wanted.to_string()), "{text}");
    assert!(text.contains(&server_id().to_string()), "{text}");
    assert!(text.contains("none of the expected identities"), "{text}");
    assert!(s.is_err(), "server sees the client's alert");
    Ok(())
}

#[tokio::test]
async fn client_cert_from_another_ca_is_rejected() -> Result<()> {
    let certs = manager();
    let foreign = manager();
    let base = client_config(certs.clone(), client_id(), vec![server_id()])?;
    let foreign_cert = foreign.get(&client_id())?;
    let key = CertifiedKey::from_der(
        foreign_cert.chain.clone(),
        foreign_cert.key.clone_key(),
        &provider(),
    )?;
    let ccfg = with_client_cert(&base, Some(Arc::new(key)));
    let scfg = server_config(certs, server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    let err = s
        .err()
        .ok_or_else(|| anyhow!("server must reject a foreign client cert"))?;
    // Both roots are named O=cluster.local, so webpki reports the signature, not the issuer.
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );
    client_sees_rejection(c).await;
    Ok(())
}

#[tokio::test]
async fn server_cert_from_another_ca_is_rejected() -> Result<()> {
    let ccfg = client_config(manager(), client_id(), vec![server_id()])?;
    let scfg = server_config(manager(), server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    let err = c.err().ok_or_else(|| anyhow!("client must reject"))?;
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );
    assert!(s.is_err());
    Ok(())
}

#[tokio::test]
async fn client_of_another_trust_domain_is_rejected() -> Result<()> {
    let certs = manager();
    let foreign_td = id("other.local", "ns-a", "client");
    let ccfg = client_config(certs.clone(), foreign_td, vec![server_id()])?;
    let scfg = server_config(certs, server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    let err = s
        .err()
        .ok_or_else(|| anyhow!("server must reject another trust domain"))?;
    let text = err.to_string();
    eprintln!("server error: {text}");
    assert!(text.contains("trust domain \"cluster.local\""), "{text}");
    assert!(
        text.contains("spiffe://other.local/ns/ns-a/sa/client"),
        "{text}"
    );
    client_sees_rejection(c).await;
    Ok(())
}

#[tokio::test]
async fn client_without_cert_is_rejected() -> Result<()> {
    let certs = manager();
    let base = client_config(certs.clone(), client_id(), vec![server_id()])?;
    let ccfg = with_client_cert(&base, None);
    let scfg = server_config(certs, server_id())?;
    let (c, s) = handshake(ccfg, scfg).await;
    let err = s
        .err()
        .ok_or_else(|| anyhow!("server must require a client cert"))?;
    assert!(
        err.to_string().contains("peer sent no certificates"),
        "{err}"
    );
    client_sees_rejection(c).await;
    Ok(())
}

#[tokio::test]
async fn rotation_needs_no_config_rebuild() -> Result<()> {
    let start = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let secs = Arc::new(AtomicU64::new(start));
    let s2 = secs.clone();
    let clock: Clock =
        Arc::new(move || UNIX_EPOCH + Duration::from_secs(s2.load(Ordering::SeqCst)));
    let certs = CertManager::with_clock(Ca::generate()?, DEFAULT_CERT_LIFETIME, clock);
    let scfg = server_config(certs.clone(), server_id())?;
    let ccfg = client_config(certs.clone(), client_id(), vec![server_id()])?;

    let (c, s) = handshake(ccfg.clone(), scfg.clone()).await;
    let c1 = c.context("first client")?;
    let s1 = s.context("first server")?;
    let server_serial_1 = serial_of(c1.get_ref().1.peer_certificates().unwrap_or_default());
    let client_serial_1 = serial_of(s1.get_ref().1.peer_certificates().unwrap_or_default());

    // Past half-life the manager re-issues; the same configs pick up the new certs.
    secs.store(
        start + DEFAULT_CERT_LIFETIME.as_secs() / 2 + 120,
        Ordering::SeqCst,
    );
    let (c, s) = handshake(ccfg, scfg).await;
    let c2 = c.context("second client")?;
    let s2 = s.context("second server")?;
    let server_serial_2 = serial_of(c2.get_ref().1.peer_certificates().unwrap_or_default());
    let client_serial_2 = serial_of(s2.get_ref().1.peer_certificates().unwrap_or_default());
    assert_ne!(server_serial_1, server_serial_2, "server cert rotated");
    assert_ne!(client_serial_1, client_serial_2, "client cert rotated");
    // `certificates()` shows the cache without re-issuing (the fake clock stays ahead).
    let current = certs
        .certificates()
        .into_iter()
        .find(|c| c.identity == server_id())
        .ok_or_else(|| anyhow!("server cert cached"))?;
    assert_eq!(
        serial_of(&current.chain),
        server_serial_2,
        "the new handshake presents the manager's current cert"
    );
    Ok(())
}

#[test]
fn config_builders_validate_inputs() {
    let certs = manager();
    let err = client_config(certs, client_id(), vec![]).unwrap_err();
    assert!(matches!(err, TlsError::NoExpectedPeers), "{err}");
}

#[test]
fn provider_has_only_the_two_tls13_suites() {
    let p = provider();
    let suites: Vec<_> = p.cipher_suites.iter().map(|s| s.suite()).collect();
    assert_eq!(
        suites,
        vec![
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        ]
    );
}

#[test]
fn peer_identity_reads_the_first_spiffe_san() {
    let certs = manager();
    let cert = certs.get(&server_id()).expect("cert");
    assert_eq!(peer_identity(&cert.chain), Some(server_id()));
    assert_eq!(
        uri_sans(&cert.chain[0]),
        vec!["spiffe://cluster.local/ns/ns-b/sa/server".to_owned()]
    );
    assert_eq!(peer_identity(&[]), None);
    assert_eq!(peer_identity(&[CertificateDer::from(vec![1, 2, 3])]), None);
}
