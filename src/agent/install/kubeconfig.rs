//! The kubeconfig the installer writes for the plugin, so the plugin can ask the API server whether
//! a pod is ambient (`../shared/spec/istio-cni.md` §1.4 step 4, §2.5).
//!
//! The file is `<run_dir>/ztnode-cni-kubeconfig` (not in the CNI conf dir), mode 0600, written
//! atomically and only when its bytes would change, so a rotated service-account token rewrites it
//! while an unchanged one leaves it alone. Its content is either a copy of a kubeconfig file (tests,
//! development) or built from the in-cluster service account: server
//! `https://<KUBERNETES_SERVICE_HOST>:<KUBERNETES_SERVICE_PORT>` (an IPv6 host bracketed), CA data
//! from `<SA dir>/ca.crt`, bearer token from `<SA dir>/token`, cluster `local`, user `ztnode-cni`,
//! context `ztnode-cni-context`. The token and CA never appear in logs or error messages.

use std::fs;
use std::io;
use std::net::Ipv6Addr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::InstallError;
use super::files;

/// File name of the plugin's kubeconfig inside the agent run dir.
pub const PLUGIN_KUBECONFIG_NAME: &str = "ztnode-cni-kubeconfig";
/// Permission bits of the plugin's kubeconfig (Istio's `KUBECONFIG_MODE` default).
pub const KUBECONFIG_MODE: u32 = 0o600;
/// Where Kubernetes mounts a pod's service account (`token`, `ca.crt`).
pub const DEFAULT_SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Cluster name in the generated kubeconfig.
pub const CLUSTER_NAME: &str = "local";
/// User name in the generated kubeconfig.
pub const USER_NAME: &str = "ztnode-cni";
/// Context name (and `current-context`) in the generated kubeconfig.
pub const CONTEXT_NAME: &str = "ztnode-cni-context";

/// The Kubernetes part of the installer's settings: what the plugin needs to classify pods like
/// the agent does. Set in Kubernetes mode; `None` in [`super::InstallConfig`] keeps standalone
/// behaviour (no kubeconfig, no extra entry keys).
///
/// The entry keys written for it: `kubeconfig` (path of the written file),
/// `ambient_enablement_selector` (only when [`PluginKube::enablement_selector`] is set) and
/// `ztnode_namespace`. Pass the same values the agent's `EnrollmentRules::from_env` reads
/// (`AMBIENT_ENABLEMENT_SELECTOR`, `POD_NAMESPACE`) and set [`super::InstallConfig::exclude_namespaces`]
/// from `EXCLUDE_NAMESPACES`, so plugin and agent decide alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginKube {
    /// Where the kubeconfig's content comes from.
    pub source: KubeconfigSource,
    /// The raw `AMBIENT_ENABLEMENT_SELECTOR` value if the variable is set (even to `""`, which
    /// enrolls nothing); `None` = Istio's default selectors, in the plugin as in the agent.
    pub enablement_selector: Option<String>,
    /// The namespace ztnode runs in (`POD_NAMESPACE`, default `istio-system`): the plugin never
    /// enrolls ztnode's own pods there.
    pub namespace: String,
}

/// Where the plugin's kubeconfig content comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeconfigSource {
    /// Copy this kubeconfig byte for byte (the agent's own `--kubeconfig`; tests, development).
    /// Paths inside it must be absolute and readable by the plugin, which runs on the host.
    Copy(PathBuf),
    /// Build it from the pod's service account (in-cluster).
    InCluster(InClusterApi),
}

/// The in-cluster API server and service account, as values (the caller reads the env).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InClusterApi {
    /// `KUBERNETES_SERVICE_HOST`: an IP address (IPv6 gets bracketed) or a host name.
    pub host: String,
    /// `KUBERNETES_SERVICE_PORT`.
    pub port: String,
    /// The service-account dir holding `token` and `ca.crt`; normally
    /// [`DEFAULT_SERVICE_ACCOUNT_DIR`].
    pub service_account_dir: PathBuf,
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct KubeconfigDoc<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    clusters: [Named<ClusterDoc<'a>>; 1],
    users: [Named<UserDoc<'a>>; 1],
    contexts: [Named<ContextDoc>; 1],
    current_context: &'static str,
}

#[derive(Serialize)]
struct Named<T> {
    name: &'static str,
    #[serde(flatten)]
    item: T,
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ClusterDoc<'a> {
    cluster: ClusterFields<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ClusterFields<'a> {
    server: &'a str,
    certificate_authority_data: &'a str,
}

#[derive(Serialize)]
struct UserDoc<'a> {
    user: UserFields<'a>,
}

#[derive(Serialize)]
struct UserFields<'a> {
    token: &'a str,
}

#[derive(Serialize)]
struct ContextDoc {
    context: ContextFields,
}

#[derive(Serialize)]
struct ContextFields {
    cluster: &'static str,
    user: &'static str,
}

// === impl KubeconfigSource ===

impl KubeconfigSource {
    /// The directory whose changes may change the rendered kubeconfig (the service-account dir,
    /// or the copied file's dir), for the repair loop to watch.
    pub fn watched_dir(&self) -> Option<&Path> {
        match self {
            KubeconfigSource::Copy(path) => path.parent(),
            KubeconfigSource::InCluster(api) => Some(&api.service_account_dir),
        }
    }

    /// The kubeconfig bytes for the current state of the source files. Errors:
    /// [`InstallError::ReadFile`] for an unreadable source, token or CA file,
    /// [`InstallError::InClusterApi`] for an empty host or a bad port, [`InstallError::RenderYaml`].
    pub fn render(&self) -> Result<Vec<u8>, InstallError> {
        match self {
            KubeconfigSource::Copy(path) => read(path),
            KubeconfigSource::InCluster(api) => api.render(),
        }
    }
}

// === impl InClusterApi ===

impl InClusterApi {
    /// The API server URL, `https://<host>:<port>` with an IPv6 host in brackets.
    pub fn server_url(&self) -> Result<String, InstallError> {
        let host = self.host.trim();
        if host.is_empty() {
            return Err(InstallError::InClusterApi {
                reason: "KUBERNETES_SERVICE_HOST is empty".into(),
            });
        }
        let port: u16 = self
            .port
            .trim()
            .parse()
            .map_err(|_| InstallError::InClusterApi {
                reason: format!("KUBERNETES_SERVICE_PORT {:?} is not a port", self.port),
            })?;
        let host = match host.parse::<Ipv6Addr>() {
            Ok(v6) => format!("[{v6}]"),
            Err(_) => host.to_owned(),
        };
        Ok(format!("https://{host}:{port}"))
    }

    fn render(&self) -> Result<Vec<u8>, InstallError> {
        let server = self.server_url()?;
        let ca = read(&self.service_account_dir.join("ca.crt"))?;
        let token_bytes = read(&self.service_account_dir.join("token"))?;
        let token = String::from_utf8_lossy(&token_bytes);
        let ca_data = base64(&ca);
        let doc = KubeconfigDoc {
            api_version: "v1",
            kind: "Config",
            clusters: [Named {
                name: CLUSTER_NAME,
                item: ClusterDoc {
                    cluster: ClusterFields {
                        server: &server,
                        certificate_authority_data: &ca_data,
                    },
                },
            }],
            users: [Named {
                name: USER_NAME,
                item: UserDoc {
                    user: UserFields {
                        token: token.trim(),
                    },
                },
            }],
            contexts: [Named {
                name: CONTEXT_NAME,
                item: ContextDoc {
                    context: ContextFields {
                        cluster: CLUSTER_NAME,
                        user: USER_NAME,
                    },
                },
            }],
            current_context: CONTEXT_NAME,
        };
        let yaml =
            serde_yaml_ng::to_string(&doc).map_err(|source| InstallError::RenderYaml { source })?;
        let mut out =
            String::from("# Kubeconfig of the ztnode CNI plugin, written by the ztnode agent.\n");
        out.push_str(&yaml);
        Ok(out.into_bytes())
    }
}

/// Path of the plugin's kubeconfig in `run_dir`.
pub fn kubeconfig_path(run_dir: &Path) -> PathBuf {
    run_dir.join(PLUGIN_KUBECONFIG_NAME)
}

/// Writes the plugin's kubeconfig into `run_dir` unless it already has exactly these bytes and mode
/// 0600; returns whether it was written. Creates `run_dir` if missing and removes our stale temp
/// files there first.
pub(crate) fn install(run_dir: &Path, kube: &PluginKube) -> Result<bool, InstallError> {
    let desired = kube.source.render()?;
    let path = kubeconfig_path(run_dir);
    if current(&path, &desired)? {
        return Ok(false);
    }
    let write_err = |source| InstallError::Write {
        path: path.clone(),
        source,
    };
    fs::create_dir_all(run_dir).map_err(write_err)?;
    files::remove_stale_tmp(run_dir, PLUGIN_KUBECONFIG_NAME)?;
    files::atomic_write(&path, &desired, KUBECONFIG_MODE).map_err(write_err)?;
    Ok(true)
}

/// Whether the kubeconfig in `run_dir` has the content and mode `kube` calls for.
pub(crate) fn in_place(run_dir: &Path, kube: &PluginKube) -> Result<bool, InstallError> {
    current(&kubeconfig_path(run_dir), &kube.source.render()?)
}

/// Removes the plugin's kubeconfig from `run_dir`; a missing file is fine.
pub(crate) fn remove(run_dir: &Path) -> Result<(), InstallError> {
    files::remove_if_exists(&kubeconfig_path(run_dir))
}

/// Whether `path` is a regular file with exactly `desired` and mode 0600.
fn current(path: &Path, desired: &[u8]) -> Result<bool, InstallError> {
    let md = match fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(InstallError::ReadFile {
                path: path.to_owned(),
                source,
            });
        }
    };
    if !md.is_file() || md.mode() & 0o7777 != KUBECONFIG_MODE || md.len() != desired.len() as u64 {
        return Ok(false);
    }
    match fs::read(path) {
        Ok(bytes) => Ok(bytes == desired),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(InstallError::ReadFile {
            path: path.to_owned(),
            source,
        }),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, InstallError> {
    fs::read(path).map_err(|source| InstallError::ReadFile {
        path: path.to_owned(),
        source,
    })
}

/// Standard base64 with padding (RFC 4648 §4), as kubeconfig `*-data` fields use.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 0x3f) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn sa_dir(token: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("ca.crt"),
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        fs::write(dir.path().join("token"), token).unwrap();
        dir
    }

    fn in_cluster(host: &str, port: &str, sa: &Path) -> PluginKube {
        PluginKube {
            source: KubeconfigSource::InCluster(InClusterApi {
                host: host.into(),
                port: port.into(),
                service_account_dir: sa.to_owned(),
            }),
            enablement_selector: None,
            namespace: "ztnode-system".into(),
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want, "{input:?}");
        }
        assert_eq!(base64(&[0xfb, 0xff, 0xfe]), "+//+");
    }

    #[test]
    fn in_cluster_rendering_has_istios_shape() {
        let sa = sa_dir("eyJhbGciOi.tok\n");
        let kube = in_cluster("10.96.0.1", "443", sa.path());
        let text = String::from_utf8(kube.source.render().unwrap()).unwrap();
        let ca = base64(&fs::read(sa.path().join("ca.crt")).unwrap());
        let want = format!(
            "# Kubeconfig of the ztnode CNI plugin, written by the ztnode agent.\n\
             apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    \
             server: https://10.96.0.1:443\n    certificate-authority-data: {ca}\n\
             users:\n- name: ztnode-cni\n  user:\n    token: eyJhbGciOi.tok\n\
             contexts:\n- name: ztnode-cni-context\n  context:\n    cluster: local\n    user: ztnode-cni\n\
             current-context: ztnode-cni-context\n"
        );
        assert_eq!(text, want);
        let parsed = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        assert_eq!(parsed.current_context.as_deref(), Some(CONTEXT_NAME));
        let cluster = parsed.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://10.96.0.1:443"));
    }

    #[test]
    fn ipv6_hosts_are_bracketed() {
        let api = |host: &str, port: &str| InClusterApi {
            host: host.into(),
            port: port.into(),
            service_account_dir: PathBuf::from("/sa"),
        };
        assert_eq!(
            api("fd00:10:96::1", "443").server_url().unwrap(),
            "https://[fd00:10:96::1]:443"
        );
        assert_eq!(
            api("kubernetes.default.svc", "6443").server_url().unwrap(),
            "https://kubernetes.default.svc:6443"
        );
        for (host, port) in [
            ("", "443"),
            ("10.0.0.1", ""),
            ("10.0.0.1", "https"),
            ("10.0.0.1", "70000"),
        ] {
            let err = api(host, port).server_url().unwrap_err();
            assert!(
                matches!(err, InstallError::InClusterApi { .. }),
                "{host} {port}: {err}"
            );
        }
        let sa = sa_dir("t");
        let text = String::from_utf8(
            in_cluster("::1", "6443", sa.path())
                .source
                .render()
                .unwrap(),
        )
        .unwrap();
        assert!(text.contains("server: https://[::1]:6443\n"), "{text}");
    }

    #[test]
    fn copy_source_is_verbatim() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("agent.kubeconfig");
        fs::write(&src, "apiVersion: v1\nkind: Config\n").unwrap();
        let source = KubeconfigSource::Copy(src.clone());
        assert_eq!(source.render().unwrap(), b"apiVersion: v1\nkind: Config\n");
        assert_eq!(source.watched_dir(), Some(dir.path()));
        let missing = KubeconfigSource::Copy(dir.path().join("nope"));
        assert!(matches!(
            missing.render(),
            Err(InstallError::ReadFile { .. })
        ));
    }

    #[test]
    fn written_with_mode_0600_only_when_changed_and_removed() {
        let sa = sa_dir("one");
        let run = tempfile::tempdir().unwrap();
        let run_dir = run.path().join("run");
        let kube = in_cluster("10.0.0.1", "443", sa.path());
        assert!(!in_place(&run_dir, &kube).unwrap());
        assert!(install(&run_dir, &kube).unwrap(), "first write");
        let path = kubeconfig_path(&run_dir);
        assert_eq!(mode(&path), KUBECONFIG_MODE);
        assert!(in_place(&run_dir, &kube).unwrap());
        assert!(!install(&run_dir, &kube).unwrap(), "unchanged: no write");

        // Token rotation: new content, rewritten.
        fs::write(sa.path().join("token"), "two").unwrap();
        assert!(!in_place(&run_dir, &kube).unwrap());
        assert!(install(&run_dir, &kube).unwrap());
        assert!(fs::read_to_string(&path).unwrap().contains("token: two\n"));

        // A widened mode is repaired.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(!in_place(&run_dir, &kube).unwrap());
        assert!(install(&run_dir, &kube).unwrap());
        assert_eq!(mode(&path), KUBECONFIG_MODE);
        assert_eq!(
            fs::read_dir(&run_dir).unwrap().count(),
            1,
            "no temp files left"
        );

        remove(&run_dir).unwrap();
        assert!(!path.exists());
        remove(&run_dir).unwrap();
    }

    #[test]
    fn missing_service_account_files_name_the_file_not_the_secret() {
        let sa = sa_dir("s3cret-token");
        fs::remove_file(sa.path().join("ca.crt")).unwrap();
        let err = in_cluster("10.0.0.1", "443", sa.path())
            .source
            .render()
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("ca.crt"), "{msg}");
        assert!(!msg.contains("s3cret"), "{msg}");
    }
}
