//! `ztnode ca init`: one built-in CA root for every node of a standalone cluster. Each node's
//! proxy loads its CA from `--ca-dir` and generates one there when the dir is empty, so nodes
//! started without a shared dir each trust only their own root and cross-node HBONE fails. This
//! writes a root once, either as the CA dir's files ([`ROOT_CERT_FILE`], [`CA_KEY_FILE`] 0600) or
//! as a Kubernetes Secret manifest holding both ([`secret_manifest`]) that the standalone
//! component (`deploy/components/standalone`) mounts read-only into every node as `--ca-dir`.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::proxy::identity::{CA_KEY_FILE, Ca, IdentityError, ROOT_CERT_FILE};

/// Name of the Secret the standalone component mounts as the CA dir.
pub const CA_SECRET_NAME: &str = "ztnode-ca";
/// Namespace of that Secret (the DaemonSet's).
pub const CA_SECRET_NAMESPACE: &str = "istio-system";
/// Where the standalone component mounts the Secret (the proxy's `--ca-dir`).
pub const CA_MOUNT_DIR: &str = "/etc/ztnode-ca";

/// Errors of `ztnode ca init`.
#[derive(Debug, thiserror::Error)]
pub enum CaInitError {
    /// The target dir already holds a CA file: never overwritten (nodes trust the old root).
    #[error(
        "{path} exists: not overwriting a CA that nodes may trust (remove the dir to make a new root)"
    )]
    Exists {
        /// The existing file.
        path: PathBuf,
    },
    /// Generating or writing the CA failed.
    #[error(transparent)]
    Ca(#[from] IdentityError),
    /// A file or the scratch dir could not be read, made or removed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// Rendering the Secret failed.
    #[error("render the Secret: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
}

/// Generates a new root and writes it into `dir` (created if missing) as the proxy's CA dir
/// reads it. Errors: [`CaInitError::Exists`] if either file is already there.
pub fn write_dir(dir: &Path) -> Result<(), CaInitError> {
    for file in [ROOT_CERT_FILE, CA_KEY_FILE] {
        let path = dir.join(file);
        if path.exists() {
            return Err(CaInitError::Exists { path });
        }
    }
    Ca::load_or_generate(Some(dir))?;
    Ok(())
}

/// A new root as a Secret manifest (YAML): `name`/`namespace`, type `Opaque`, keys
/// [`ROOT_CERT_FILE`] and [`CA_KEY_FILE`]. The key passes through a scratch dir (mode 0700)
/// under `scratch_parent` that is removed before returning.
pub fn secret_manifest(
    name: &str,
    namespace: &str,
    scratch_parent: &Path,
) -> Result<String, CaInitError> {
    let scratch = scratch_dir(scratch_parent)?;
    let files = write_dir(&scratch).and_then(|()| {
        let read = |file: &str| {
            let path = scratch.join(file);
            fs::read(&path).map_err(|source| CaInitError::Io { path, source })
        };
        Ok((read(ROOT_CERT_FILE)?, read(CA_KEY_FILE)?))
    });
    let removed = fs::remove_dir_all(&scratch).map_err(|source| CaInitError::Io {
        path: scratch.clone(),
        source,
    });
    let (cert, key) = files?;
    removed?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([("app".into(), "ztnode".into())])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (ROOT_CERT_FILE.into(), ByteString(cert)),
            (CA_KEY_FILE.into(), ByteString(key)),
        ])),
        ..Default::default()
    };
    let mut value = serde_yaml_ng::to_value(&secret)?;
    if let serde_yaml_ng::Value::Mapping(m) = &mut value {
        // k8s-openapi's Serialize writes the kind and apiVersion; keep them first for readers.
        let mut out = serde_yaml_ng::Mapping::new();
        for k in ["apiVersion", "kind"] {
            if let Some(v) = m.remove(k) {
                out.insert(k.into(), v);
            }
        }
        out.extend(std::mem::take(m));
        *m = out;
    }
    Ok(serde_yaml_ng::to_string(&value)?)
}

/// A new private (0700) dir under `parent`.
fn scratch_dir(parent: &Path) -> Result<PathBuf, CaInitError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = parent.join(format!("ztnode-ca-{}-{nanos}", std::process::id()));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&path)
        .map_err(|source| CaInitError::Io {
            path: path.clone(),
            source,
        })?;
    Ok(path)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn dir_is_written_once_and_loads() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ca");
        write_dir(&dir).unwrap();
        let key_mode = fs::metadata(dir.join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(key_mode & 0o777, 0o600);
        let before = fs::read(dir.join(ROOT_CERT_FILE)).unwrap();
        assert!(matches!(write_dir(&dir), Err(CaInitError::Exists { .. })));
        assert_eq!(fs::read(dir.join(ROOT_CERT_FILE)).unwrap(), before);
        let ca = Ca::load_or_generate(Some(&dir)).unwrap();
        assert_eq!(ca.root_pem().as_bytes(), before.as_slice());
    }

    #[test]
    fn secret_holds_a_loadable_ca_and_leaves_nothing_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let yaml = secret_manifest(CA_SECRET_NAME, CA_SECRET_NAMESPACE, tmp.path()).unwrap();
        assert!(yaml.starts_with("apiVersion: v1\nkind: Secret\n"), "{yaml}");
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0, "scratch left");
        let secret: Secret = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(secret.metadata.name.as_deref(), Some(CA_SECRET_NAME));
        assert_eq!(
            secret.metadata.namespace.as_deref(),
            Some(CA_SECRET_NAMESPACE)
        );
        let data = secret.data.unwrap();
        let dir = tmp.path().join("mounted");
        fs::create_dir(&dir).unwrap();
        for (k, v) in &data {
            fs::write(dir.join(k), &v.0).unwrap();
        }
        let ca = Ca::load_or_generate(Some(&dir)).unwrap();
        assert_eq!(ca.root_pem().as_bytes(), data[ROOT_CERT_FILE].0.as_slice());
        let other = secret_manifest(CA_SECRET_NAME, CA_SECRET_NAMESPACE, tmp.path()).unwrap();
        assert_ne!(other, yaml, "each run makes a new root");
    }
}
