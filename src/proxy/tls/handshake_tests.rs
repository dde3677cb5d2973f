//! Tests of the handshake (`tls/handshake.rs`): rejected peers, handshake messages split
//! over records, a corrupted handshake record, records that arrive with the client's Finished, and
//! a config the handshake cannot use. Helpers come from the stream tests.

use super::*;

#[tokio::test]
async fn a_rejected_peer_fails_both_handshakes() {
    let (_, server) = configs();
    // a client from another CA, expecting the right identity
    let other = CertManager::new(Ca::generate().expect("CA"), DEFAULT_CERT_LIFETIME);
    let client = client_config(other, client_id(), vec![server_id()]).expect("client");
    let (c, s) = tokio::io::duplex(64 * 1024);
    let (c, s) =
        within(async { tokio::join!(connect(client, name(), c), accept(server, s)) }).await;
    let c = c.expect_err("the client rejects the server's certificate");
    assert!(matches!(c, StreamError::Tls(_)), "{c}");
    // the server learns it from the client's alert, not from a bare close
    let s = s.expect_err("server handshake fails");
    assert!(matches!(s, StreamError::Tls(_)), "{s}");
}

#[tokio::test]
async fn handshake_messages_split_over_many_records_are_joined() {
    let (client, server) = configs();
    // tiny records on the rustls side: every handshake message spans several of them
    let mut rustls_server = (*server).clone();
    rustls_server.max_fragment_size = Some(64);
    let (mut c, mut s) = our_client_rustls_server(client.clone(), Arc::new(rustls_server)).await;
    within(async {
        tokio::join!(
            async { send_all(&mut c, b"over small records").await },
            async {
                let mut got = Vec::new();
                s.read_to_end(&mut got).await.expect("read");
                assert_eq!(got, b"over small records");
            }
        )
    })
    .await;
    let mut rustls_client = (*client).clone();
    rustls_client.max_fragment_size = Some(64);
    let (c, s) = tokio::io::duplex(64 * 1024);
    let (c, s) = within(async {
        tokio::join!(
            tokio_rustls::TlsConnector::from(Arc::new(rustls_client)).connect(name(), c),
            accept(server, s)
        )
    })
    .await;
    let (mut c, mut s) = (c.expect("rustls client"), s.expect("our server"));
    within(async {
        tokio::join!(
            async {
                c.write_all(b"small").await.expect("write");
                c.shutdown().await.expect("shutdown");
            },
            async { assert_eq!(read_to_end(&mut s).await.expect("read"), b"small") }
        )
    })
    .await;
}

#[tokio::test]
async fn a_corrupted_handshake_record_fails_the_handshake_with_an_alert() {
    let (client, server) = configs();
    let (c, relay_c) = tokio::io::duplex(64 * 1024);
    let (relay_s, s) = tokio::io::duplex(64 * 1024);
    // client -> server: the first read is the ClientHello; flip the last byte of the next one
    // (the end of the encrypted Finished)
    let relay = async move {
        let (mut cr, mut cw) = tokio::io::split(relay_c);
        let (mut sr, mut sw) = tokio::io::split(relay_s);
        let up = async {
            let mut buf = vec![0u8; 64 * 1024];
            let mut reads = 0;
            loop {
                let n = cr.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                reads += 1;
                if reads == 2 {
                    buf[n - 1] ^= 1;
                }
                if sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = sw.shutdown().await;
        };
        let down = async {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
            let _ = cw.shutdown().await;
        };
        tokio::join!(up, down);
    };
    let (_, c, s) = within(async {
        tokio::join!(
            relay,
            async {
                let c = tokio_rustls::TlsConnector::from(client)
                    .connect(name(), c)
                    .await;
                // the client learns of the failure from our alert on its first read
                match c {
                    Ok(mut c) => {
                        let mut b = [0u8; 1];
                        c.read(&mut b).await.map(|_| ())
                    }
                    Err(e) => Err(e),
                }
            },
            accept(server, s)
        )
    })
    .await;
    let s = s.expect_err("the server refuses the corrupted record");
    assert!(matches!(s, StreamError::Tls(_)), "{s}");
    let c = c.expect_err("the client sees the alert");
    assert!(c.to_string().contains("BadRecordMac"), "{c}");
}

/// A client whose Finished, a KeyUpdate(update_requested) and its first data reach our server in
/// one read: the KeyUpdate must be ours to follow and answer, not rustls'.
#[tokio::test]
async fn records_after_the_clients_finished_in_the_same_read_reach_the_stream() {
    let (client, server) = configs();
    let (mut c, s) = tokio::io::duplex(64 * 1024);
    let client_side = async move {
        let mut tls = rustls::ClientConnection::new(client, name()).expect("client");
        let mut buf = vec![0u8; 64 * 1024];
        let mut out = Vec::new();
        while tls.is_handshaking() {
            while tls.wants_write() {
                tls.write_tls(&mut out).expect("write_tls");
            }
            c.write_all(&out).await.expect("send");
            out.clear();
            if !tls.is_handshaking() {
                break;
            }
            let n = c.read(&mut buf).await.expect("read");
            assert!(n > 0, "server closed");
            let mut rd = &buf[..n];
            while !rd.is_empty() {
                tls.read_tls(&mut rd).expect("read_tls");
                tls.process_new_packets().expect("process");
            }
        }
        // Finished is queued: add a KeyUpdate request and data, and send all in one write
        tls.refresh_traffic_keys().expect("key update");
        std::io::Write::write_all(&mut tls.writer(), b"first").expect("plaintext");
        while tls.wants_write() {
            tls.write_tls(&mut out).expect("write_tls");
        }
        c.write_all(&out).await.expect("one write");
        // the answer: read the server's reply, sent under its updated key
        let mut got = Vec::new();
        while got.len() < 5 {
            let n = c.read(&mut buf).await.expect("read");
            assert!(n > 0, "server closed");
            let mut rd = &buf[..n];
            while !rd.is_empty() {
                tls.read_tls(&mut rd).expect("read_tls");
                tls.process_new_packets().expect("reply decrypts");
            }
            let mut chunk = [0u8; 64];
            while let Ok(k) = std::io::Read::read(&mut tls.reader(), &mut chunk) {
                if k == 0 {
                    break;
                }
                got.extend_from_slice(&chunk[..k]);
            }
        }
        assert_eq!(got, b"reply");
    };
    let server_side = async move {
        let mut s = accept(server, s).await.expect("our server");
        let mut got = [0u8; 5];
        s.read_exact(&mut got).await.expect("first data");
        assert_eq!(&got, b"first");
        assert_eq!((s.rx_updates, s.tx_updates), (1, 1), "{s:?}");
        s.write_all(b"reply").await.expect("reply");
        s.flush().await.expect("flush");
        s
    };
    let (_, _s) = within(async { tokio::join!(client_side, server_side) }).await;
}

#[tokio::test]
async fn a_config_without_secret_extraction_is_refused_before_the_handshake() {
    let (client, server) = configs();
    let mut client = (*client).clone();
    client.enable_secret_extraction = false;
    let mut server = (*server).clone();
    server.enable_secret_extraction = false;
    let (c, s) = tokio::io::duplex(1024);
    let c = connect(Arc::new(client), name(), c)
        .await
        .expect_err("client refused");
    let s = accept(Arc::new(server), s)
        .await
        .expect_err("server refused");
    for e in [c, s] {
        assert!(matches!(e, StreamError::Unsupported(_)), "{e}");
    }
}
