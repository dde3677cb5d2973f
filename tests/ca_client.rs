//! The Istio CA client and the certificate manager against the real fake istiod
//! (`../shared/tools/fake-istiod`), with in-memory mTLS handshakes between the fetched
//! certificates.
//!
//! All traffic stays inside a network namespace each test makes (`ScratchNetns`, only `lo`):
//! the fake istiod runs there (`ip netns exec`), and the client runs on a thread that entered it,
//! with its own tokio runtime. Guards stop the server and delete the namespace, also on panic.
//! Needs root and iproute2; without them the tests skip loudly, or fail when `CI` is set.

#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::{ClientConfig, ServerConfig};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::io::DuplexStream;
use tokio_rustls::{TlsAcceptor, TlsConnector, client, server};

use ztnode::lab::istiod::{FAKE_ISTIOD_SCRIPT, FakeIstiod, FakeIstiodOptions, ScratchNetns};
use ztnode::netns::Netns;
use ztnode::proxy::control::{CallAuth, ControlEndpoint, RootSource};
use ztnode::proxy::identity::{CertManager, CertSource, Identity, IdentityError};
use ztnode::proxy::tls::{client_config, peer_identity, server_config, uri_sans};

const TOKEN: &str = "zt-token";

/// The test's namespace and scratch dir; the servers it starts are dropped before it.
struct Setup {
    ns: ScratchNetns,
    dir: tempfile::TempDir,
}

/// `None` (after a loud skip) without root; under `CI` that panics instead.
fn setup(test: &str, tag: &str) -> Option<Setup> {
    if !common::privileged(test) {
        return None;
    }
    let ns = ScratchNetns::new(&format!("{}-{tag}", common::prefix("ca"))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    Some(Setup { ns, dir })
}

impl Setup {
    /// A fake istiod with its own state dir (so its own CA) named `name`, accepting [`TOKEN`] for
    /// `spiffe://cluster.local/ns/default/*`.
    fn istiod(&self, name: &str, extra: &[&str]) -> FakeIstiod {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(FAKE_ISTIOD_SCRIPT);
        let mut args: Vec<String> = vec![
            "--token".into(),
            format!("{TOKEN}=spiffe://cluster.local/ns/default/*"),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let opts = FakeIstiodOptions {
            args,
            ..FakeIstiodOptions::default()
        };
        FakeIstiod::start(&self.ns.name, &script, &self.dir.path().join(name), opts).unwrap()
    }

    /// A token file holding `token` (no newline).
    fn token(&self, token: &str) -> PathBuf {
        let path = self.dir.path().join(format!("token-{token}"));
        std::fs::write(&path, token).unwrap();
        path
    }
}

/// The certificate source for `istiod`, trusting its root file for the channel.
fn source(istiod: &FakeIstiod, token: PathBuf) -> CertSource {
    CertSource::Istio {
        endpoint: ControlEndpoint::new(
            &istiod.address(),
            RootSource::File(istiod.root_cert.clone()),
            None,
        )
        .unwrap(),
        auth: CallAuth {
            token_file: Some(token),
            cluster_id: "Kubernetes".into(),
            headers: Vec::new(),
        },
    }
}

/// Runs `f` on a thread inside `ns` with its own current-thread runtime.
fn in_netns<F, Fut, T>(ns: &Netns, f: F) -> T
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = T>,
    T: Send,
{
    ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(f())
    })
    .expect("client thread in the test netns (a panic there is printed above)")
}

fn id(sa: &str) -> Identity {
    Identity::new("cluster.local", "default", sa)
}

fn pem_roots(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

type Handshake = (
    std::io::Result<client::TlsStream<DuplexStream>>,
    std::io::Result<server::TlsStream<DuplexStream>>,
);

/// Both sides of one handshake over an in-memory pipe, bounded in time.
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

/// A handshake from `src` (certificates of `client`) to `dst` (of `server`); `Ok` with the
/// identities each side saw, or both errors as text.
async fn mtls(
    client: &Arc<CertManager>,
    src: &Identity,
    server: &Arc<CertManager>,
    dst: &Identity,
) -> Result<(Identity, Identity), String> {
    let ccfg =
        client_config(client.clone(), src.clone(), vec![dst.clone()]).map_err(|e| e.to_string())?;
    let scfg = server_config(server.clone(), dst.clone()).map_err(|e| e.to_string())?;
    match handshake(ccfg, scfg).await {
        (Ok(c), Ok(s)) => {
            // TLS 1.3: the server's verdict on the client certificate reaches the client on
            // its first read; the server side has decided by now.
            let seen_by_client =
                peer_identity(c.get_ref().1.peer_certificates().unwrap_or_default());
            let seen_by_server =
                peer_identity(s.get_ref().1.peer_certificates().unwrap_or_default());
            Ok((
                seen_by_client.ok_or("no server identity")?,
                seen_by_server.ok_or("no client identity")?,
            ))
        }
        (c, s) => Err(format!(
            "client: {:?}; server: {:?}",
            c.err().map(|e| e.to_string()),
            s.err().map(|e| e.to_string())
        )),
    }
}

/// A handshake refused because a chain does not end at a trusted root. The fake CAs all name
/// their root `O=cluster.local`, so webpki may find a root of that name that did not sign the
/// chain (`BadSignature`) rather than none (`UnknownIssuer`).
fn untrusted(r: Result<(Identity, Identity), String>) {
    let err = r.expect_err("the handshake must fail");
    assert!(
        err.contains("UnknownIssuer") || err.contains("BadSignature"),
        "{err}"
    );
}

fn ca_requests(istiod: &FakeIstiod, identity: &Identity) -> Vec<Value> {
    let want = identity.to_string();
    istiod
        .events(Some("ca_request"))
        .unwrap()
        .into_iter()
        .filter(|e| e["identity"] == want.as_str())
        .collect()
}

#[test]
fn a_certificate_is_fetched_for_the_impersonated_identity() {
    let Some(t) = setup(
        "a_certificate_is_fetched_for_the_impersonated_identity",
        "imp",
    ) else {
        return;
    };
    let istiod = t.istiod("istiod", &[]);
    let src = source(&istiod, t.token(TOKEN));
    let root = pem_roots(&istiod.root_cert);
    let (alice, bob) = (id("alice"), id("bob"));
    in_netns(&t.ns.netns, || async {
        let certs = CertManager::from_source(&src, Duration::from_secs(3600), &[]).unwrap();
        assert!(certs.is_remote());
        let a = certs.ensure(&alice).await.unwrap();
        certs.ensure(&bob).await.unwrap();
        assert_eq!(
            a.chain.len(),
            1,
            "the leaf alone (the root goes to the bundle)"
        );
        assert_eq!(uri_sans(&a.chain[0]), [alice.to_string()]);
        assert_eq!(
            a.not_after.duration_since(a.not_before).unwrap(),
            Duration::from_secs(3600),
            "lifetime = the requested TTL"
        );
        assert_eq!(
            certs.bundle().certificates(),
            root,
            "the fake CA's root is trusted"
        );
        // both certificates verify each other, in both directions
        assert_eq!(
            mtls(&certs, &alice, &certs, &bob).await,
            Ok((bob.clone(), alice.clone()))
        );
        assert_eq!(
            mtls(&certs, &bob, &certs, &alice).await,
            Ok((alice.clone(), bob.clone()))
        );
    });
    let reqs = ca_requests(&istiod, &alice);
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    let r = &reqs[0];
    assert_eq!(r["result"], "OK", "{r}");
    assert_eq!(
        r["metadata"],
        json!({"ImpersonatedIdentity": alice.to_string()})
    );
    assert_eq!(r["csr_sans"], json!([alice.to_string()]));
    assert_eq!(r["requested_ttl"], 3600);
    assert_eq!(r["ttl"], 3600);
    assert_eq!(r["clusterid"], "Kubernetes");
    assert_eq!(r["chain_len"], 2);
}

#[test]
fn a_refused_token_or_identity_fails_with_a_clear_error() {
    let Some(t) = setup(
        "a_refused_token_or_identity_fails_with_a_clear_error",
        "tok",
    ) else {
        return;
    };
    let istiod = t.istiod("istiod", &[]);
    let wrong = source(&istiod, t.token("not-the-token"));
    let right = source(&istiod, t.token(TOKEN));
    let outsider = Identity::new("cluster.local", "kube-system", "intruder");
    in_netns(&t.ns.netns, || async {
        let started = Instant::now();
        let certs = CertManager::from_source(&wrong, Duration::from_secs(3600), &[]).unwrap();
        let err = certs.ensure(&id("alice")).await.unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "a refusal is not retried by ensure"
        );
        assert!(matches!(err, IdentityError::Fetch { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("spiffe://cluster.local/ns/default/sa/alice")
                && text.contains("CA refused the token (UNAUTHENTICATED)"),
            "{text}"
        );
        assert_eq!(certs.holders(&id("alice")), 0);
        assert!(certs.get(&id("alice")).is_err());

        // the right token, an identity it may not obtain
        let certs = CertManager::from_source(&right, Duration::from_secs(3600), &[]).unwrap();
        let err = certs.ensure(&outsider).await.unwrap_err().to_string();
        assert!(
            err.contains("CA denied the identity (PERMISSION_DENIED)") && err.contains("intruder"),
            "{err}"
        );
    });
    let refused = istiod.events(Some("ca_request")).unwrap();
    assert!(
        refused.iter().any(|e| e["result"] == "UNAUTHENTICATED"),
        "{refused:?}"
    );
}

#[test]
fn an_intermediate_chain_verifies_against_the_root() {
    let Some(t) = setup("an_intermediate_chain_verifies_against_the_root", "int") else {
        return;
    };
    let istiod = t.istiod("istiod", &["--intermediate"]);
    let src = source(&istiod, t.token(TOKEN));
    let root = pem_roots(&istiod.root_cert);
    let (alice, bob) = (id("alice"), id("bob"));
    in_netns(&t.ns.netns, || async {
        let certs = CertManager::from_source(&src, Duration::from_secs(3600), &[]).unwrap();
        let a = certs.ensure(&alice).await.unwrap();
        certs.ensure(&bob).await.unwrap();
        assert_eq!(a.chain.len(), 2, "leaf + intermediate are presented");
        assert!(
            !root.contains(&a.chain[1]),
            "the intermediate is not a root"
        );
        assert_eq!(
            certs.bundle().certificates(),
            root,
            "only the root is trusted"
        );
        assert_eq!(
            mtls(&certs, &alice, &certs, &bob).await,
            Ok((bob.clone(), alice.clone()))
        );
    });
    assert_eq!(ca_requests(&istiod, &alice)[0]["chain_len"], 3);
}

#[test]
fn peers_of_two_cas_verify_with_a_two_root_bundle_reloaded_at_run_time() {
    let Some(t) = setup(
        "peers_of_two_cas_verify_with_a_two_root_bundle_reloaded_at_run_time",
        "two",
    ) else {
        return;
    };
    let one = t.istiod("one", &[]);
    let two = t.istiod("two", &["--intermediate"]);
    let token = t.token(TOKEN);
    let (src1, src2) = (source(&one, token.clone()), source(&two, token));
    let (root1, root2) = (pem_roots(&one.root_cert), pem_roots(&two.root_cert));
    assert_ne!(root1, root2, "two different CAs");
    // manager 1 trusts CA 2 through a file that appears later; manager 2 trusts CA 1 at once
    let later = t.dir.path().join("more-roots.pem");
    let extra1 = [RootSource::File(later.clone())];
    let extra2 = [RootSource::File(one.root_cert.clone())];
    let (alice, bob) = (id("alice"), id("bob"));
    in_netns(&t.ns.netns, || async {
        let m1 = CertManager::from_source(&src1, Duration::from_secs(3600), &extra1).unwrap();
        let m2 = CertManager::from_source(&src2, Duration::from_secs(3600), &extra2).unwrap();
        m1.bundle().watch(Duration::from_millis(50));
        m1.ensure(&alice).await.unwrap();
        m2.ensure(&bob).await.unwrap();
        assert_eq!(m2.bundle().certificates().len(), 2);

        // bob (CA 2, with its intermediate) is not yet trusted by alice's side
        untrusted(mtls(&m2, &bob, &m1, &alice).await);
        untrusted(mtls(&m1, &alice, &m2, &bob).await);

        // CA 2's root (concatenated with CA 1's: several roots in one file) appears in the file:
        // the next handshakes trust it, no config rebuilt
        let both = format!(
            "{}{}",
            std::fs::read_to_string(&one.root_cert).unwrap(),
            std::fs::read_to_string(&two.root_cert).unwrap()
        );
        std::fs::write(&later, both).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while m1.bundle().certificates().len() < 2 {
            assert!(Instant::now() < deadline, "root file not reloaded");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut expected = root1.clone();
        expected.extend(root2.clone());
        assert_eq!(m1.bundle().certificates(), expected);
        assert_eq!(
            mtls(&m2, &bob, &m1, &alice).await,
            Ok((alice.clone(), bob.clone()))
        );
        assert_eq!(
            mtls(&m1, &alice, &m2, &bob).await,
            Ok((bob.clone(), alice.clone()))
        );

        // a third CA stays untrusted (by both sides)
        let m3 = CertManager::new(
            ztnode::proxy::identity::Ca::generate().unwrap(),
            Duration::from_secs(3600),
        );
        untrusted(mtls(&m3, &id("mallory"), &m1, &alice).await);
    });
}

#[test]
fn short_lived_certificates_rotate_without_a_failed_handshake() {
    let Some(t) = setup(
        "short_lived_certificates_rotate_without_a_failed_handshake",
        "ttl",
    ) else {
        return;
    };
    let istiod = t.istiod("istiod", &[]);
    let src = source(&istiod, t.token(TOKEN));
    let (alice, bob) = (id("alice"), id("bob"));
    let ttl = Duration::from_secs(4);
    let serials = in_netns(&t.ns.netns, || async {
        let certs = CertManager::from_source(&src, ttl, &[]).unwrap();
        certs.ensure(&alice).await.unwrap();
        certs.ensure(&bob).await.unwrap();
        let mut serials = Vec::new();
        let end = Instant::now() + Duration::from_secs(9);
        let mut handshakes = 0;
        while Instant::now() < end {
            let r = mtls(&certs, &alice, &certs, &bob).await;
            assert_eq!(
                r,
                Ok((bob.clone(), alice.clone())),
                "handshake {handshakes}"
            );
            handshakes += 1;
            let serial = certs.get(&bob).unwrap().serial_hex();
            if serials.last() != Some(&serial) {
                serials.push(serial);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(handshakes > 50, "{handshakes}");
        serials
    });
    // refreshed every ~2 s (half of 4 s) over 9 s
    assert!(serials.len() >= 4, "{serials:?}");
    let reqs = ca_requests(&istiod, &bob);
    assert!(reqs.len() >= 4, "{reqs:?}");
    assert!(
        reqs.iter()
            .all(|r| r["result"] == "OK" && r["requested_ttl"] == 4)
    );
}

#[test]
fn an_unavailable_ca_is_retried_with_backoff() {
    let Some(t) = setup("an_unavailable_ca_is_retried_with_backoff", "bo") else {
        return;
    };
    let istiod = t.istiod("istiod", &[]);
    istiod
        .ok(
            "POST",
            "/ca/fail",
            Some(&json!({"count": 2, "code": "UNAVAILABLE", "message": "warming up"})),
        )
        .unwrap();
    let src = source(&istiod, t.token(TOKEN));
    let alice = id("alice");
    let waited = in_netns(&t.ns.netns, || async {
        let certs = CertManager::from_source(&src, Duration::from_secs(3600), &[]).unwrap();
        let started = Instant::now();
        certs.ensure(&alice).await.unwrap();
        started.elapsed()
    });
    // retries after ~0.5 s and ~1 s (±20 %)
    assert!(
        waited >= Duration::from_millis(1200) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    let results: Vec<_> = ca_requests(&istiod, &alice)
        .iter()
        .map(|r| r["result"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(results, ["UNAVAILABLE", "UNAVAILABLE", "OK"]);
}

#[test]
fn an_enrolled_pod_starts_once_its_certificate_is_fetched_and_a_refused_one_fails() {
    use ztnode::proxy::state::{ProxyState, StateHandle};
    use ztnode::zds::{WorkloadInfo, WorkloadRequest};

    let Some(t) = setup(
        "an_enrolled_pod_starts_once_its_certificate_is_fetched_and_a_refused_one_fails",
        "pod",
    ) else {
        return;
    };
    let pod_ns = ScratchNetns::new(&format!("{}-pod", t.ns.name)).unwrap();
    let istiod = t.istiod("istiod", &[]);
    let yaml = "workloads:\n\
        - {uid: c1//v1/Pod/default/client, name: client, namespace: default, serviceAccount: alice, workloadIps: [\"10.9.0.2\"], protocol: HBONE, node: n1}\n\
        - {uid: c1//v1/Pod/kube-system/intruder, name: intruder, namespace: kube-system, serviceAccount: intruder, workloadIps: [\"10.9.0.3\"], protocol: HBONE, node: n1}\n";
    let cfg = ztnode::proxy::config::parse_local_config(yaml).unwrap();
    let state = StateHandle::new(ProxyState::from_config(&cfg).unwrap());
    let proxy_cfg = ztnode::proxy::ProxyConfig {
        cert_source: source(&istiod, t.token(TOKEN)),
        cert_lifetime: Duration::from_secs(3600),
        ..ztnode::proxy::ProxyConfig::new(t.dir.path().join("unused-ca"))
    };
    let pod = pod_ns.netns.clone();
    let add = |name: &str, ns: &str, sa: &str| WorkloadRequest::Add {
        uid: format!("uid-{name}"),
        info: WorkloadInfo {
            name: name.into(),
            namespace: ns.into(),
            service_account: sa.into(),
        },
        netns: pod.clone(),
    };
    let (alice, intruder) = (
        id("alice"),
        Identity::new("cluster.local", "kube-system", "intruder"),
    );
    in_netns(&t.ns.netns, || async {
        let ready = ztnode::ready::Readiness::new();
        let proxy = ztnode::proxy::start(&proxy_cfg, state, &ready).unwrap();
        let certs = proxy.manager.ctx().certs.clone();
        assert!(certs.is_remote());
        // the Add is acked once the pod's certificate is there
        proxy
            .link
            .send(add("client", "default", "alice"))
            .await
            .unwrap();
        assert_eq!(certs.holders(&alice), 1);
        assert!(certs.get(&alice).is_ok());
        assert_eq!(proxy.manager.len(), 1);
        // an identity the node's token may not obtain: the Add is nacked with the CA's words
        let err = proxy
            .link
            .send(add("intruder", "kube-system", "intruder"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("CA denied the identity (PERMISSION_DENIED)") && err.contains("intruder"),
            "{err}"
        );
        assert_eq!(certs.holders(&intruder), 0);
        proxy
            .link
            .send(WorkloadRequest::SnapshotSent)
            .await
            .unwrap();
        assert!(!ready.is_ready(), "a failed pod keeps the proxy unready");
        proxy
            .link
            .send(WorkloadRequest::Del {
                uid: "uid-intruder".into(),
            })
            .await
            .unwrap();
        assert!(ready.is_ready(), "{:?}", ready.pending_tasks());
        // the last pod of an identity gone: its certificate goes too
        proxy
            .link
            .send(WorkloadRequest::Del {
                uid: "uid-client".into(),
            })
            .await
            .unwrap();
        assert_eq!(certs.holders(&alice), 0);
        assert!(certs.get(&alice).is_err());
    });
    let alice_reqs = ca_requests(&istiod, &alice);
    assert_eq!(alice_reqs.len(), 1);
    assert_eq!(alice_reqs[0]["result"], "OK");
    assert_eq!(
        ca_requests(&istiod, &intruder)[0]["result"],
        "PERMISSION_DENIED"
    );
}
