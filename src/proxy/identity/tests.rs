use std::os::unix::fs::PermissionsExt as _;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::X509Certificate;

use super::*;

fn id(ns: &str, sa: &str) -> Identity {
    Identity::new(DEFAULT_TRUST_DOMAIN, ns, sa)
}

fn parse(cert: &WorkloadCert) -> X509Certificate<'_> {
    x509_parser::parse_x509_certificate(&cert.chain[0])
        .expect("leaf parses")
        .1
}

fn problem(s: &str) -> SpiffeIdProblem {
    match s.parse::<Identity>() {
        Err(IdentityError::InvalidSpiffeId { problem, id }) => {
            assert_eq!(id, s);
            problem
        }
        other => panic!("{s:?}: expected InvalidSpiffeId, got {other:?}"),
    }
}

#[test]
fn identity_display_and_parse_round_trip() {
    let i = Identity::new("example.org", "ns1", "sa-1");
    assert_eq!(i.to_string(), "spiffe://example.org/ns/ns1/sa/sa-1");
    assert_eq!(i.to_string().parse::<Identity>().unwrap(), i);
    let d: Identity = "spiffe://cluster.local/ns/default/sa/default"
        .parse()
        .unwrap();
    assert_eq!(d, id("default", "default"));
}

#[test]
fn identity_parse_failures_name_the_problem() {
    assert_eq!(
        problem("http://cluster.local/ns/a/sa/b"),
        SpiffeIdProblem::Scheme
    );
    assert_eq!(problem("cluster.local/ns/a/sa/b"), SpiffeIdProblem::Scheme);
    assert_eq!(
        problem("spiffe://cluster.local/ns/a/sa"),
        SpiffeIdProblem::SegmentCount(4)
    );
    assert_eq!(
        problem("spiffe://cluster.local/ns/a/sa/b/c"),
        SpiffeIdProblem::SegmentCount(6)
    );
    assert_eq!(
        problem("spiffe://cluster.local/nx/a/sa/b"),
        SpiffeIdProblem::NsLiteral
    );
    assert_eq!(
        problem("spiffe://cluster.local/ns/a/sx/b"),
        SpiffeIdProblem::SaLiteral
    );
    assert_eq!(
        problem("spiffe://cluster.local/ns//sa/b"),
        SpiffeIdProblem::EmptySegment
    );
    assert_eq!(
        problem("spiffe:///ns/a/sa/b"),
        SpiffeIdProblem::EmptySegment
    );
    let text = "spiffe://td/ns/a"
        .parse::<Identity>()
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("got 3") && text.contains("spiffe://td/ns/a"),
        "{text}"
    );
}

#[test]
fn issued_leaf_has_istio_shape() {
    let ca = Ca::load_or_generate(None).unwrap();
    let ident = Identity::new("example.org", "ns1", "sa1");
    let lifetime = Duration::from_secs(3600);
    let cert = ca.issue(&ident, lifetime).unwrap();
    assert_eq!(cert.identity, ident);
    assert_eq!(cert.chain.len(), 1);

    let x = parse(&cert);
    let san = x.subject_alternative_name().unwrap().expect("SAN present");
    assert_eq!(
        san.value.general_names,
        vec![GeneralName::URI("spiffe://example.org/ns/ns1/sa/sa1")]
    );
    let eku = x.extended_key_usage().unwrap().expect("EKU present").value;
    assert!(eku.server_auth && eku.client_auth);
    let ku = x.key_usage().unwrap().expect("KU present").value;
    assert!(ku.digital_signature());
    assert!(!x.is_ca());
    assert_eq!(x.subject().iter().count(), 0, "empty subject");
    assert!(san.critical, "URI SAN critical with an empty subject");
    assert_eq!(
        x.public_key().algorithm.algorithm,
        x509_parser::oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY
    );
    assert!(x.raw_serial().len() >= 19, "serial {:?}", x.raw_serial());

    // Lifetime as asked, and the struct matches the encoded times.
    assert_eq!(
        cert.not_after.duration_since(cert.not_before).unwrap(),
        lifetime
    );
    let nb = x.validity().not_before.timestamp();
    let na = x.validity().not_after.timestamp();
    let secs = |t: SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert_eq!(nb, secs(cert.not_before));
    assert_eq!(na, secs(cert.not_after));
    assert!(cert.is_valid_at(SystemTime::now()));
    assert_eq!(cert.refresh_at(), cert.not_before + lifetime / 2);

    // Signed by the CA root.
    let root_der = ca.root_der();
    let root = x509_parser::parse_x509_certificate(&root_der).unwrap().1;
    assert!(root.is_ca());
    x.verify_signature(Some(root.public_key()))
        .expect("leaf signed by root");
}

#[test]
fn serials_differ_between_issues() {
    let ca = Ca::load_or_generate(None).unwrap();
    let a = ca.issue(&id("a", "b"), DEFAULT_CERT_LIFETIME).unwrap();
    let b = ca.issue(&id("a", "b"), DEFAULT_CERT_LIFETIME).unwrap();
    assert_ne!(a.serial_hex().unwrap(), b.serial_hex().unwrap());
}

#[test]
fn identity_that_does_not_round_trip_is_not_issued() {
    let ca = Ca::generate().unwrap();
    let err = ca
        .issue(&id("a/b", "c"), DEFAULT_CERT_LIFETIME)
        .unwrap_err();
    assert!(
        matches!(err, IdentityError::InvalidSpiffeId { .. }),
        "{err}"
    );
}

#[test]
fn zero_lifetime_is_rejected() {
    let ca = Ca::load_or_generate(None).unwrap();
    let err = ca
        .issue(&id("a", "b"), Duration::from_millis(500))
        .unwrap_err();
    assert!(
        matches!(err, IdentityError::LifetimeTooShort { .. }),
        "{err}"
    );
}

#[test]
fn short_lifetime_is_already_valid() {
    let ca = Ca::load_or_generate(None).unwrap();
    let cert = ca.issue(&id("a", "b"), Duration::from_secs(4)).unwrap();
    assert!(cert.not_before <= SystemTime::now());
    assert_eq!(
        cert.not_after.duration_since(cert.not_before).unwrap(),
        Duration::from_secs(4)
    );
}

#[test]
fn ca_dir_is_written_and_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let ca_dir = dir.path().join("ca");
    let ca = Ca::load_or_generate(Some(&ca_dir)).unwrap();

    let pem = std::fs::read_to_string(ca_dir.join(ROOT_CERT_FILE)).unwrap();
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n"), "{pem}");
    assert_eq!(pem, ca.root_pem());
    let key_meta = std::fs::metadata(ca_dir.join(CA_KEY_FILE)).unwrap();
    assert_eq!(key_meta.permissions().mode() & 0o777, 0o600);
    let key_pem = std::fs::read_to_string(ca_dir.join(CA_KEY_FILE)).unwrap();
    assert!(key_pem.contains("PRIVATE KEY"));

    let again = Ca::load_or_generate(Some(&ca_dir)).unwrap();
    assert_eq!(again.root_der(), ca.root_der());
    assert_eq!(again.root_pem(), ca.root_pem());
    // The reloaded CA signs leaves that chain to the original root.
    let leaf = again.issue(&id("x", "y"), DEFAULT_CERT_LIFETIME).unwrap();
    let root_der = ca.root_der();
    let root = x509_parser::parse_x509_certificate(&root_der).unwrap().1;
    parse(&leaf)
        .verify_signature(Some(root.public_key()))
        .expect("reloaded CA signs with the same key");
    // Same issuer name as the root's subject.
    assert_eq!(parse(&leaf).issuer(), root.subject());
}

#[test]
fn ca_dir_with_one_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    Ca::load_or_generate(Some(dir.path())).unwrap();
    std::fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
    let err = Ca::load_or_generate(Some(dir.path())).expect_err("must fail");
    assert!(
        matches!(
            err,
            IdentityError::IncompleteCaDir {
                missing: CA_KEY_FILE,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn ca_key_mismatch_is_detected() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    Ca::load_or_generate(Some(a.path())).unwrap();
    Ca::load_or_generate(Some(b.path())).unwrap();
    std::fs::copy(b.path().join(CA_KEY_FILE), a.path().join(CA_KEY_FILE)).unwrap();
    let err = Ca::load_or_generate(Some(a.path())).expect_err("must fail");
    assert!(matches!(err, IdentityError::CaKeyMismatch { .. }), "{err}");
}

#[test]
fn garbage_root_is_reported_with_path() {
    let dir = tempfile::tempdir().unwrap();
    Ca::load_or_generate(Some(dir.path())).unwrap();
    std::fs::write(dir.path().join(ROOT_CERT_FILE), "not a pem").unwrap();
    let err = Ca::load_or_generate(Some(dir.path())).expect_err("must fail");
    assert!(err.to_string().contains(ROOT_CERT_FILE), "{err}");
}

/// A clock the test moves by hand (seconds since the epoch).
fn fake_clock() -> (Arc<AtomicU64>, Clock) {
    let now = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let secs = Arc::new(AtomicU64::new(now));
    let s = secs.clone();
    let clock: Clock =
        Arc::new(move || std::time::UNIX_EPOCH + Duration::from_secs(s.load(Ordering::SeqCst)));
    (secs, clock)
}

#[test]
fn cert_manager_caches_until_refresh_time() {
    let (secs, clock) = fake_clock();
    let mgr = CertManager::with_clock(Ca::generate().unwrap(), DEFAULT_CERT_LIFETIME, clock);
    let me = id("default", "a");
    let first = mgr.get(&me).unwrap();
    let second = mgr.get(&me).unwrap();
    assert!(Arc::ptr_eq(&first, &second), "cached");
    assert_eq!(first.identity, me);

    // Just before half-life: still cached.
    let refresh = first
        .refresh_at()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    secs.store(refresh - 1, Ordering::SeqCst);
    assert!(Arc::ptr_eq(&first, &mgr.get(&me).unwrap()));

    // At half-life: re-issued with a new serial.
    secs.store(refresh, Ordering::SeqCst);
    let third = mgr.get(&me).unwrap();
    assert!(!Arc::ptr_eq(&first, &third));
    assert_ne!(first.serial_hex(), third.serial_hex());
    assert_eq!(mgr.certificates().len(), 1);
    assert!(Arc::ptr_eq(&mgr.certificates()[0], &third));
}

#[test]
fn cert_manager_reissues_after_real_refresh_time() {
    let mgr = CertManager::new(Ca::generate().unwrap(), Duration::from_secs(2));
    let me = id("default", "short");
    let first = mgr.get(&me).unwrap();
    let wait = first
        .refresh_at()
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    std::thread::sleep(wait + Duration::from_millis(50));
    let second = mgr.get(&me).unwrap();
    assert_ne!(first.serial_hex(), second.serial_hex());
}

#[test]
fn cert_manager_lists_identities_and_roots() {
    let ca = Ca::generate().unwrap();
    let root = ca.root_der();
    let root_pem = ca.root_pem();
    let mgr = CertManager::new(ca, DEFAULT_CERT_LIFETIME);
    mgr.get(&id("b", "x")).unwrap();
    mgr.get(&id("a", "x")).unwrap();
    let ids: Vec<_> = mgr
        .certificates()
        .iter()
        .map(|c| c.identity.clone())
        .collect();
    assert_eq!(ids, vec![id("a", "x"), id("b", "x")]);
    assert_eq!(mgr.roots().len(), 1);
    assert_eq!(mgr.root_pem(), root_pem);
    assert!(root_pem.contains("BEGIN CERTIFICATE"));
    let parsed: CertificateDer<'static> =
        rustls_pki_types::pem::PemObject::from_pem_slice(root_pem.as_bytes()).unwrap();
    assert_eq!(parsed, root);
    mgr.forget(&id("a", "x"));
    assert_eq!(mgr.certificates().len(), 1);
}

/// `openssl verify` accepts the built-in CA's leaves (an empty subject, so OpenSSL does not take
/// them for self-signed). Needs the `openssl` CLI; under `CI` its absence is a failure.
#[test]
fn openssl_verifies_a_leaf_against_the_root() {
    let Ok(out) = Command::new("openssl").arg("version").output() else {
        if std::env::var_os("CI").is_some() {
            panic!("the openssl CLI is missing and CI is set");
        }
        eprintln!("SKIP openssl_verifies_a_leaf_against_the_root: no openssl CLI");
        return;
    };
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::generate().unwrap();
    let leaf = ca
        .issue(&id("default", "verify"), DEFAULT_CERT_LIFETIME)
        .unwrap();
    let root = dir.path().join("root.pem");
    let leaf_pem = dir.path().join("leaf.pem");
    std::fs::write(&root, ca.root_pem()).unwrap();
    std::fs::write(&leaf_pem, leaf.chain_pem()).unwrap();
    let out = Command::new("openssl")
        .args(["verify", "-CAfile"])
        .arg(&root)
        .arg(&leaf_pem)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "openssl verify failed: {text}");
    assert!(text.contains(": OK"), "{text}");
    // and a root that did not sign it is refused
    let other = dir.path().join("other.pem");
    std::fs::write(&other, Ca::generate().unwrap().root_pem()).unwrap();
    let out = Command::new("openssl")
        .args(["verify", "-CAfile"])
        .arg(&other)
        .arg(&leaf_pem)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a foreign root must not verify the leaf"
    );
}
