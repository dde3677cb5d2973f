//! Tests of the CA client's CSR and response checks (no network: a local rcgen CA answers).

use rcgen::{BasicConstraints, CertificateSigningRequestParams, IsCa, Issuer, KeyUsagePurpose};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::oid_registry;
use x509_parser::prelude::FromDer as _;

use super::*;
use crate::proxy::identity::der_to_pem;

fn ident() -> Identity {
    Identity::new("cluster.local", "app", "server")
}

/// A CA (optionally an intermediate below it) that signs CSRs as the fake istiod does.
struct TestCa {
    root: rcgen::Certificate,
    issuer: Issuer<'static, KeyPair>,
    intermediate: Option<(rcgen::Certificate, Issuer<'static, KeyPair>)>,
}

impl TestCa {
    fn new(with_intermediate: bool) -> TestCa {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("key");
        let params = ca_params("root");
        let root = params.self_signed(&key).expect("root");
        let issuer = Issuer::new(params, key);
        let intermediate = with_intermediate.then(|| {
            let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("key");
            let params = ca_params("intermediate");
            let cert = params.signed_by(&key, &issuer).expect("intermediate");
            (cert, Issuer::new(params, key))
        });
        TestCa {
            root,
            issuer,
            intermediate,
        }
    }

    /// `cert_chain` as the CA returns it: `[leaf, (intermediate,) root]`.
    fn sign(&self, csr_pem: &str) -> Vec<String> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem).expect("csr parses");
        let issuer = self.intermediate.as_ref().map_or(&self.issuer, |(_, i)| i);
        let leaf = csr.signed_by(issuer).expect("sign");
        let mut chain = vec![der_to_pem(leaf.der())];
        if let Some((cert, _)) = &self.intermediate {
            chain.push(der_to_pem(cert.der()));
        }
        chain.push(der_to_pem(self.root.der()));
        chain
    }
}

fn ca_params(cn: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, format!("test {cn}"));
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p
}

#[test]
fn the_csr_is_p256_with_an_empty_subject_and_one_critical_uri_san() {
    let csr = Csr::new(&ident()).expect("csr");
    assert!(csr.pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
    let der = pem::parse(&csr.pem).expect("pem");
    let (rest, req) = X509CertificationRequest::from_der(der.contents()).expect("parses");
    assert!(rest.is_empty());
    req.verify_signature().expect("self-signed by its key");
    let info = &req.certification_request_info;
    assert_eq!(info.subject.iter().count(), 0, "empty subject");
    assert_eq!(
        info.subject_pki.algorithm.algorithm,
        oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY
    );
    let curve = info
        .subject_pki
        .algorithm
        .parameters
        .as_ref()
        .and_then(|p| p.as_oid().ok());
    assert_eq!(curve, Some(oid_registry::OID_EC_P256));
    assert_eq!(
        req.signature_algorithm.algorithm,
        oid_registry::OID_SIG_ECDSA_WITH_SHA256
    );
    assert_eq!(
        info.subject_pki.subject_public_key.data.as_ref(),
        csr.key_public
    );

    let exts: Vec<_> = info
        .iter_attributes()
        .filter_map(|a| match a.parsed_attribute() {
            x509_parser::cri_attributes::ParsedCriAttribute::ExtensionRequest(r) => {
                Some(r.extensions.clone())
            }
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(exts.len(), 1, "only the SAN extension: {exts:?}");
    assert!(exts[0].critical, "SAN is critical with an empty subject");
    let ParsedExtension::SubjectAlternativeName(san) = exts[0].parsed_extension() else {
        panic!("not a SAN: {:?}", exts[0]);
    };
    assert_eq!(
        san.general_names,
        vec![GeneralName::URI("spiffe://cluster.local/ns/app/sa/server")]
    );
}

#[test]
fn the_request_carries_the_ttl_and_the_impersonated_identity() {
    let md = impersonation(&ident());
    let v = md
        .fields
        .get(IMPERSONATED_IDENTITY)
        .and_then(|v| v.kind.clone());
    assert_eq!(
        v,
        Some(prost_types::value::Kind::StringValue(
            "spiffe://cluster.local/ns/app/sa/server".into()
        ))
    );
    // wire shape: csr = field 1, validity_duration = field 3, metadata = field 4
    let req = IstioCertificateRequest {
        csr: "x".into(),
        validity_duration: 60,
        metadata: Some(md),
    };
    let bytes = prost::Message::encode_to_vec(&req);
    assert_eq!(&bytes[..3], &[0x0a, 0x01, b'x']);
    assert_eq!(&bytes[3..5], &[0x18, 60]);
    assert_eq!(bytes[5], 0x22);
}

#[test]
fn leaf_and_root_are_split_as_istio_returns_them() {
    let ca = TestCa::new(false);
    let csr = Csr::new(&ident()).expect("csr");
    let chain = ca.sign(&csr.pem);
    let issued = parse_response(&ident(), &chain, csr).expect("issued");
    assert_eq!(issued.cert.chain.len(), 1, "the leaf only");
    assert_eq!(issued.roots, vec![ca.root.der().clone()]);
    assert_eq!(issued.cert.identity, ident());
    assert!(issued.cert.not_before < issued.cert.not_after);
}

#[test]
fn intermediates_are_presented_and_several_roots_are_kept() {
    let ca = TestCa::new(true);
    let other = TestCa::new(false);
    let csr = Csr::new(&ident()).expect("csr");
    let mut chain = ca.sign(&csr.pem);
    // the last element holds two concatenated roots
    let last = chain.pop().expect("root");
    chain.push(format!("{last}{}", der_to_pem(other.root.der())));
    let issued = parse_response(&ident(), &chain, csr).expect("issued");
    assert_eq!(issued.cert.chain.len(), 2, "leaf + intermediate");
    let inter = ca.intermediate.as_ref().map(|(c, _)| c.der().clone());
    assert_eq!(issued.cert.chain.get(1).cloned(), inter);
    assert_eq!(
        issued.roots,
        vec![ca.root.der().clone(), other.root.der().clone()]
    );
}

#[test]
fn a_leaf_for_another_identity_or_key_is_refused() {
    let ca = TestCa::new(false);
    let other_id = Identity::new("cluster.local", "app", "intruder");
    let csr = Csr::new(&other_id).expect("csr");
    let chain = ca.sign(&csr.pem);
    let err = parse_response(&ident(), &chain, csr).expect_err("mismatch");
    assert!(
        matches!(&err, CaClientError::IdentityMismatch { presented, .. }
            if presented == &["spiffe://cluster.local/ns/app/sa/intruder"]),
        "{err}"
    );

    let theirs = Csr::new(&ident()).expect("csr");
    let ours = Csr::new(&ident()).expect("csr");
    let chain = ca.sign(&theirs.pem);
    let err = parse_response(&ident(), &chain, ours).expect_err("key");
    assert!(matches!(err, CaClientError::KeyMismatch), "{err}");
}

#[test]
fn empty_or_garbled_answers_are_errors() {
    let csr = Csr::new(&ident()).expect("csr");
    let err = parse_response(&ident(), &[], csr).expect_err("empty");
    assert!(matches!(err, CaClientError::EmptyChain), "{err}");
    let csr = Csr::new(&ident()).expect("csr");
    let err = parse_response(&ident(), &["junk".into(), "junk".into()], csr).expect_err("pem");
    assert!(matches!(err, CaClientError::BadPem { index: 1 }), "{err}");
}

#[test]
fn refusals_read_clearly_and_only_outages_are_transient() {
    let e = CaClientError::from_status(tonic::Status::unauthenticated("unknown token"));
    assert_eq!(
        e.to_string(),
        "CA refused the token (UNAUTHENTICATED): unknown token"
    );
    assert!(!e.is_transient());
    let e = CaClientError::from_status(tonic::Status::permission_denied("no"));
    assert!(
        e.to_string()
            .starts_with("CA denied the identity (PERMISSION_DENIED)")
    );
    assert!(!e.is_transient());
    let e = CaClientError::from_status(tonic::Status::unavailable("down"));
    assert_eq!(e.to_string(), "CA call failed (UNAVAILABLE): down");
    assert!(e.is_transient());
    let e = CaClientError::from_status(tonic::Status::invalid_argument("ttl"));
    assert!(!e.is_transient());
}
