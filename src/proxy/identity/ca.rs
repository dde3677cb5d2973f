//! The built-in CA for standalone mode: a self-signed ECDSA P-256 root that issues
//! Istio-shaped workload leaves (spec §4: the FAKE CA's shape, with a P-256 root instead of RSA).

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType, SerialNumber,
};
use ring::rand::SecureRandom as _;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::{DEFAULT_TRUST_DOMAIN, Identity, IdentityError, WorkloadCert, der_to_pem};

/// File name of the CA (root) certificate in a CA directory, as in Istio's `cacerts`.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// File name of the CA private key (PKCS#8 PEM) in a CA directory; written with mode 0600.
pub const CA_KEY_FILE: &str = "ca-key.pem";

/// Validity of a generated root: 10 years.
const ROOT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);
/// Backdating of `not_before` to tolerate peers whose clock is behind (capped at lifetime/4).
const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// The built-in certificate authority: a root key and certificate that sign workload leaves.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    root_der: CertificateDer<'static>,
    root_pem: String,
    roots: RootCertStore,
}

// === impl Ca ===

impl Ca {
    /// Loads the CA from `dir` (`root-cert.pem` + `ca-key.pem`), or generates a new one and
    /// writes both files there (creating `dir`; the key file gets mode 0600). `None` keeps a
    /// freshly generated CA in memory only.
    ///
    /// # Errors
    /// Only one of the two files present ([`IdentityError::IncompleteCaDir`]), unreadable or
    /// unparsable files, a key that does not match the certificate, write failures.
    pub fn load_or_generate(dir: Option<&Path>) -> Result<Ca, IdentityError> {
        let Some(dir) = dir else {
            return Ca::generate();
        };
        let cert_path = dir.join(ROOT_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => Ca::load(&cert_path, &key_path),
            (false, false) => {
                let ca = Ca::generate()?;
                ca.write(dir, &cert_path, &key_path)?;
                tracing::info!(dir = %dir.display(), "generated a new CA");
                Ok(ca)
            }
            (true, false) => Err(IdentityError::IncompleteCaDir {
                dir: dir.to_owned(),
                present: ROOT_CERT_FILE,
                missing: CA_KEY_FILE,
            }),
            (false, true) => Err(IdentityError::IncompleteCaDir {
                dir: dir.to_owned(),
                present: CA_KEY_FILE,
                missing: ROOT_CERT_FILE,
            }),
        }
    }

    /// Generates a new in-memory CA: ECDSA P-256, subject `O=cluster.local`, CA:TRUE,
    /// keyCertSign + cRLSign, valid for 10 years from one minute ago.
    ///
    /// # Errors
    /// Key generation or signing failures.
    pub fn generate() -> Result<Ca, IdentityError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|source| {
            IdentityError::Rcgen {
                action: "generate the CA key".into(),
                source,
            }
        })?;
        let now = unix_secs(SystemTime::now());
        let mut params = CertificateParams::default();
        params.distinguished_name = organization(DEFAULT_TRUST_DOMAIN);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(random_serial()?);
        params.not_before = to_offset(now - CLOCK_SKEW.as_secs())?;
        params.not_after = to_offset(now + ROOT_LIFETIME.as_secs())?;
        let cert = params
            .self_signed(&key)
            .map_err(|source| IdentityError::Rcgen {
                action: "self-sign the CA certificate".into(),
                source,
            })?;
        let root_der = cert.der().clone();
        Ok(Ca {
            root_pem: der_to_pem(&root_der),
            roots: root_store(&root_der)?,
            root_der,
            issuer: Issuer::new(params, key),
        })
    }

    /// The root certificate as PEM.
    pub fn root_pem(&self) -> String {
        self.root_pem.clone()
    }

    /// The root certificate as DER.
    pub fn root_der(&self) -> CertificateDer<'static> {
        self.root_der.clone()
    }

    /// A rustls root store holding just this CA's root.
    pub fn root_store(&self) -> RootCertStore {
        self.roots.clone()
    }

    /// Issues a leaf for `id` valid for `lifetime` (whole seconds).
    ///
    /// Shape (spec §4, what Istio's CA signs for ztunnel's CSRs): fresh ECDSA P-256 key, empty
    /// subject (so the leaf's subject never equals its issuer's, which would make it look
    /// self-signed), the only SAN is the URI `spiffe://<td>/ns/<ns>/sa/<sa>` (critical, as
    /// RFC 5280 requires with an empty subject), KU
    /// digitalSignature + keyEncipherment, EKU serverAuth + clientAuth, random 159-bit serial,
    /// `not_before` = now - min(1 min, lifetime/4), `not_after` = `not_before` + lifetime.
    ///
    /// # Errors
    /// [`IdentityError::InvalidSpiffeId`] if `id` does not form a valid SPIFFE id,
    /// [`IdentityError::LifetimeTooShort`] below 1 s; key generation or signing failures.
    pub fn issue(&self, id: &Identity, lifetime: Duration) -> Result<WorkloadCert, IdentityError> {
        // Refuse identities whose SPIFFE id would not parse back (e.g. a `/` in a part).
        id.to_string().parse::<Identity>()?;
        let life = lifetime.as_secs();
        if life == 0 {
            return Err(IdentityError::LifetimeTooShort { lifetime });
        }
        let skew = CLOCK_SKEW.as_secs().min(life / 4);
        let not_before = unix_secs(SystemTime::now()) - skew;
        let not_after = not_before + life;

        let rcgen_err = |what: &str| {
            let action = format!("{what} for {id}");
            move |source| IdentityError::Rcgen { action, source }
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(rcgen_err("generate the key"))?;
        let uri = rcgen::string::Ia5String::try_from(id.to_string())
            .map_err(rcgen_err("encode the URI SAN"))?;

        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(random_serial()?);
        params.not_before = to_offset(not_before)?;
        params.not_after = to_offset(not_after)?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(rcgen_err("sign the certificate"))?;

        Ok(WorkloadCert {
            identity: id.clone(),
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::from(key),
            not_before: UNIX_EPOCH + Duration::from_secs(not_before),
            not_after: UNIX_EPOCH + Duration::from_secs(not_after),
        })
    }

    fn load(cert_path: &Path, key_path: &Path) -> Result<Ca, IdentityError> {
        let cert_pem = read(cert_path)?;
        let key_pem = read(key_path)?;
        let root_der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|source| {
            IdentityError::ParseRootCert {
                path: cert_path.to_owned(),
                source,
            }
        })?;
        let key = KeyPair::from_pem(&key_pem).map_err(|source| IdentityError::LoadCa {
            path: key_path.to_owned(),
            source,
        })?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&root_der).map_err(|source| {
            IdentityError::X509 {
                path: cert_path.to_owned(),
                source,
            }
        })?;
        if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(IdentityError::CaKeyMismatch {
                key: key_path.to_owned(),
                cert: cert_path.to_owned(),
            });
        }
        let issuer =
            Issuer::from_ca_cert_der(&root_der, key).map_err(|source| IdentityError::LoadCa {
                path: cert_path.to_owned(),
                source,
            })?;
        Ok(Ca {
            root_pem: der_to_pem(&root_der),
            roots: root_store(&root_der)?,
            root_der,
            issuer,
        })
    }

    fn write(&self, dir: &Path, cert_path: &Path, key_path: &Path) -> Result<(), IdentityError> {
        fs::create_dir_all(dir).map_err(|source| IdentityError::WriteFile {
            path: dir.to_owned(),
            source,
        })?;
        write_atomic(
            key_path,
            self.issuer.key().serialize_pem().as_bytes(),
            0o600,
        )?;
        write_atomic(cert_path, self.root_pem.as_bytes(), 0o644)
    }
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// Writes `data` to `path.tmp` with `mode`, then renames it over `path`.
fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), IdentityError> {
    let mut tmp = PathBuf::from(path);
    tmp.as_mut_os_string().push(".tmp");
    let err = |source| IdentityError::WriteFile {
        path: path.to_owned(),
        source,
    };
    // A leftover temp file from a crash may have a wider mode; never reuse it.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(data).map_err(err)?;
    f.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

fn read(path: &Path) -> Result<String, IdentityError> {
    fs::read_to_string(path).map_err(|source| IdentityError::ReadFile {
        path: path.to_owned(),
        source,
    })
}

fn root_store(root: &CertificateDer<'static>) -> Result<RootCertStore, IdentityError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(root.clone())
        .map_err(|source| IdentityError::TrustAnchor { source })?;
    Ok(roots)
}

fn organization(org: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, org);
    dn
}

/// A random positive 20-byte serial (top bit clear, first byte non-zero), like Istio's 159-bit ones.
fn random_serial() -> Result<SerialNumber, IdentityError> {
    let mut bytes = [0u8; 20];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| IdentityError::Random)?;
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    Ok(SerialNumber::from_slice(&bytes))
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn to_offset(secs: u64) -> Result<time::OffsetDateTime, IdentityError> {
    i64::try_from(secs)
        .ok()
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .ok_or(IdentityError::TimeOutOfRange { secs })
}
