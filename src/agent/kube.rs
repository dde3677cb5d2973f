//! Kubernetes mode of the agent: the API client, the watches of this node's pods and of all
//! namespaces, and the pods' status annotation (`../shared/spec/istio-cni.md` §2.5, §3.1–3.3).
//!
//! The mode is on when a kubeconfig is given (`--kubeconfig` or `KUBECONFIG`) or the agent runs in
//! a cluster (the service-account token and `KUBERNETES_SERVICE_HOST`); `NODE_NAME` names this
//! node. Watches use kube-rs reflectors with bookmarks and relist on 410 Gone; while the API server
//! is unreachable they retry with backoff and the last known state stays in the stores.

pub mod http;
pub mod placement;
pub mod policy;
pub mod reconcile;
pub mod status;
pub mod watch;

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Where the in-cluster service-account token is mounted.
pub const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// How the agent reaches the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeAccess {
    /// A kubeconfig file (`--kubeconfig`, `KUBECONFIG`).
    Kubeconfig(PathBuf),
    /// The pod's service account (in-cluster config).
    InCluster,
}

/// Settings of Kubernetes mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeSettings {
    /// How to reach the API server.
    pub access: KubeAccess,
    /// This node's name (`NODE_NAME`): only its pods are watched.
    pub node_name: String,
}

/// Errors reaching the API server.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig file could not be read or parsed.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The in-cluster config (token, CA, `KUBERNETES_SERVICE_HOST`) is incomplete.
    #[error("in-cluster config: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    /// The client could not be built from the config (TLS settings, URL).
    #[error("kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// `NODE_NAME` is missing or empty.
    #[error("NODE_NAME is required in Kubernetes mode")]
    NoNodeName,
}

impl KubeAccess {
    /// The access Kubernetes mode would use: `flag` (`--kubeconfig`), else the `KUBECONFIG`
    /// value, else in-cluster when both the service-account token and
    /// `KUBERNETES_SERVICE_HOST` are present; `None`: standalone mode.
    pub fn detect(
        flag: Option<&Path>,
        kubeconfig_env: Option<&str>,
        service_host_env: Option<&str>,
        token_file: &Path,
    ) -> Option<KubeAccess> {
        if let Some(p) = flag {
            return Some(KubeAccess::Kubeconfig(p.to_owned()));
        }
        if let Some(p) = kubeconfig_env.filter(|p| !p.is_empty()) {
            // KUBECONFIG may list several files; the first one is ours.
            let first = p.split(':').next().unwrap_or(p);
            return Some(KubeAccess::Kubeconfig(PathBuf::from(first)));
        }
        if service_host_env.is_some_and(|h| !h.is_empty()) && token_file.exists() {
            return Some(KubeAccess::InCluster);
        }
        None
    }
}

/// A client for `access` ([`http::client`]: keepalive, no retry layer). The client is lazy:
/// nothing is sent until the first request.
pub async fn client(access: &KubeAccess) -> Result<kube::Client, KubeError> {
    let config = match access {
        KubeAccess::Kubeconfig(path) => {
            let kc = Kubeconfig::read_from(path).map_err(|source| KubeError::Kubeconfig {
                path: path.clone(),
                source,
            })?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|source| KubeError::Kubeconfig {
                    path: path.clone(),
                    source,
                })?
        }
        KubeAccess::InCluster => kube::Config::incluster().map_err(KubeError::InCluster)?,
    };
    http::client(config).map_err(KubeError::Client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_is_on_with_a_kubeconfig_or_in_a_cluster() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token = dir.path().join("token");
        let flag = Path::new("/etc/kc");
        assert_eq!(
            KubeAccess::detect(Some(flag), Some("/other"), None, &token),
            Some(KubeAccess::Kubeconfig(flag.into()))
        );
        assert_eq!(
            KubeAccess::detect(None, Some("/a:/b"), None, &token),
            Some(KubeAccess::Kubeconfig("/a".into()))
        );
        assert_eq!(
            KubeAccess::detect(None, Some(""), Some("10.0.0.1"), &token),
            None
        );
        std::fs::write(&token, "t").expect("token");
        assert_eq!(
            KubeAccess::detect(None, None, Some("10.0.0.1"), &token),
            Some(KubeAccess::InCluster)
        );
        assert_eq!(KubeAccess::detect(None, None, None, &token), None);
    }

    #[tokio::test]
    async fn an_unreadable_kubeconfig_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing");
        let Err(err) = client(&KubeAccess::Kubeconfig(path.clone())).await else {
            panic!("a missing kubeconfig must fail");
        };
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        std::fs::write(&path, "not: [yaml").expect("write");
        let Err(err) = client(&KubeAccess::Kubeconfig(path.clone())).await else {
            panic!("a malformed kubeconfig must fail");
        };
        assert!(err.to_string().starts_with("kubeconfig "), "{err}");
    }
}
