//! The HBONE server on 15008 against hand-made peers (from a pod outside the mesh): trust domain,
//! client certificates, CONNECT target checks and upstream failures.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::node::MeshNode;
use ztnode::netns::Netns;
use ztnode::proxy::identity::{Ca, CertManager, Identity};

fn identity(td: &str, sa: &str) -> Identity {
    Identity {
        trust_domain: td.into(),
        namespace: "default".into(),
        service_account: sa.into(),
    }
}

/// TCP connection to `addr` from inside `ns`, as a tokio stream.
fn tcp_from(ns: &Netns, addr: SocketAddr) -> tokio::net::TcpStream {
    let s = ns
        .run(move || std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)))
        .expect("netns")
        .expect("connect");
    s.set_nonblocking(true).expect("nonblocking");
    tokio::net::TcpStream::from_std(s).expect("tokio stream")
}

/// Does mTLS with `config`, HTTP/2, one CONNECT to `authority`; returns the status or an error text.
async fn connect_status(
    tcp: tokio::net::TcpStream,
    config: Arc<rustls::ClientConfig>,
    authority: &str,
) -> Result<u16, String> {
    let name = rustls_pki_types::ServerName::IpAddress(std::net::Ipv4Addr::UNSPECIFIED.into());
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("tls: {e}"))?;
    let (mut client, conn) = ztnode::proxy::hbone::client_builder()
        .handshake::<_, Bytes>(tls)
        .await
        .map_err(|e| format!("h2: {e}"))?;
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(authority)
        .body(())
        .map_err(|e| e.to_string())?;
    let (resp, _send) = client
        .send_request(req, false)
        .map_err(|e| format!("send: {e}"))?;
    let resp = tokio::time::timeout(Duration::from_secs(15), resp)
        .await
        .map_err(|_| "timeout".to_string())?;
    resp.map(|r| r.status().as_u16())
        .map_err(|e| format!("response: {e}"))
}

#[test]
fn hbone_server_checks_peers_and_targets() {
    if !common::privileged("hbone_server_checks_peers_and_targets") {
        return;
    }
    let node = MeshNode::start(&common::prefix("e2h"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let outsider = Netns::open(&node.outsider.netns_path).expect("outsider netns");
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let hbone = SocketAddr::new(node.server.ip, 15008);
    let bob = identity("cluster.local", "bob");
    let ca = Ca::load_or_generate(Some(&node.run_dir.join("ca"))).expect("node CA");
    let certs = CertManager::new(ca, Duration::from_secs(3600));
    let good = ztnode::proxy::tls::client_config(
        certs.clone(),
        identity("cluster.local", "mallory"),
        vec![bob.clone()],
    )
    .expect("client config");
    let app = SocketAddr::new(node.server.ip, 7070);
    let _listener = ztnode::lab::Lab::listen_in(&server_ns, app).expect("app listener");

    rt.block_on(async {
        // a valid peer reaches the app
        let s = connect_status(tcp_from(&outsider, hbone), good.clone(), &app.to_string()).await;
        assert_eq!(s, Ok(200));
        // CONNECT to another IP: 400 (never an open proxy)
        let s = connect_status(
            tcp_from(&outsider, hbone),
            good.clone(),
            &format!("{}:7070", node.client.ip),
        )
        .await;
        assert_eq!(s, Ok(400));
        // CONNECT to the proxy ports: 400
        for p in [15001, 15006, 15008] {
            let s = connect_status(
                tcp_from(&outsider, hbone),
                good.clone(),
                &format!("{}:{p}", node.server.ip),
            )
            .await;
            assert_eq!(s, Ok(400), "port {p}");
        }
        // garbage authority: 400
        let s = connect_status(tcp_from(&outsider, hbone), good.clone(), "not-an-ip:80").await;
        assert_eq!(s, Ok(400));
        // nothing listening: 503
        let s = connect_status(
            tcp_from(&outsider, hbone),
            good.clone(),
            &format!("{}:9999", node.server.ip),
        )
        .await;
        assert_eq!(s, Ok(503));

        // another trust domain (same CA): rejected
        let other_td = ztnode::proxy::tls::client_config(
            certs.clone(),
            identity("evil.local", "mallory"),
            vec![bob.clone()],
        )
        .expect("config");
        let s = connect_status(tcp_from(&outsider, hbone), other_td, &app.to_string()).await;
        assert!(s.is_err(), "other trust domain must be rejected, got {s:?}");

        // a certificate from another CA: rejected by the server (the client accepts any server)
        let foreign = CertManager::new(
            Ca::load_or_generate(None).expect("foreign CA"),
            Duration::from_secs(3600),
        );
        let cert = foreign
            .get(&identity("cluster.local", "mallory"))
            .expect("foreign cert");
        let mut cfg = rustls::ClientConfig::builder_with_provider(ztnode::proxy::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAny))
            .with_client_auth_cert(cert.chain.clone(), cert.key.clone_key())
            .expect("client cert");
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        let s = connect_status(tcp_from(&outsider, hbone), Arc::new(cfg), &app.to_string()).await;
        assert!(s.is_err(), "foreign CA must be rejected, got {s:?}");

        // no client certificate: rejected
        let no_cert = Arc::new(
            rustls::ClientConfig::builder_with_provider(ztnode::proxy::tls::provider())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .expect("versions")
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAny))
                .with_no_client_auth(),
        );
        let mut no_cert = (*no_cert).clone();
        no_cert.alpn_protocols = vec![b"h2".to_vec()];
        let s = connect_status(
            tcp_from(&outsider, hbone),
            Arc::new(no_cert),
            &app.to_string(),
        )
        .await;
        assert!(
            s.is_err(),
            "missing client certificate must be rejected, got {s:?}"
        );
    });
}

/// Test-only verifier that accepts any server certificate (so only the server's checks are tested).
#[derive(Debug)]
struct AcceptAny;

impl rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _: &rustls_pki_types::CertificateDer<'_>,
        _: &[rustls_pki_types::CertificateDer<'_>],
        _: &rustls_pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls_pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls_pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        ztnode::proxy::tls::provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}
