//! Kubernetes mode of the plugin: GET the pod and its namespace from the API server and turn them
//! into the facts the enrollment rules decide on (`../shared/spec/istio-cni.md` §1.4 step 8, §3.1).
//!
//! One short-lived current-thread tokio runtime per call; the kubeconfig is the one the installer
//! wrote (`crate::agent::install::PluginKube`). Both GETs run concurrently under one total timeout.
//! There is no retry (the client is the agent's, [`crate::agent::kube::http::client`], without
//! kube-rs' retry layer): an unreachable or failing API server fails ADD at once (fail closed) and
//! the runtime retries the sandbox, as Istio does with `enable_ambient_detection_retry`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};

use crate::agent::enroll::{NamespaceFacts, PodFacts, PodUid};

/// Total time ADD waits for the API server (client setup and both GETs).
pub const KUBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the pod could not be looked up. Messages name files and objects, never credentials.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The plugin could not start its async runtime.
    #[error("starting the tokio runtime: {source}")]
    Runtime {
        /// Underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The kubeconfig is missing, unreadable or not a kubeconfig.
    #[error("reading kubeconfig {} (the ztnode agent writes it): {}", .path.display(), chain(.source))]
    Kubeconfig {
        /// The file (the conf's `kubeconfig` key).
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: KubeconfigError,
    },
    /// No client could be built from the kubeconfig (bad server URL, TLS settings).
    #[error("API client from kubeconfig {}: {}", .path.display(), chain(.source))]
    Client {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: kube::Error,
    },
    /// A GET failed: connection refused, an error status (404 included), an undecodable answer.
    #[error("GET {what} from the API server {server}: {}", chain(.source))]
    Api {
        /// `pod <ns>/<name>` or `namespace <ns>`.
        what: String,
        /// The server URL from the kubeconfig.
        server: String,
        /// What went wrong.
        #[source]
        source: kube::Error,
    },
    /// No complete answer within the timeout.
    #[error("the API server {server} did not answer within {} ms", .after.as_millis())]
    Timeout {
        /// The server URL from the kubeconfig (`?` if the timeout hit before it was known).
        server: String,
        /// The total timeout.
        after: Duration,
    },
}

/// GETs pod `namespace/name` and namespace `namespace` with the kubeconfig at `kubeconfig`, within
/// `timeout` in total (client setup included). Errors: [`KubeError`].
pub fn fetch(
    kubeconfig: &Path,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<(Pod, Namespace), KubeError> {
    let kc = Kubeconfig::read_from(kubeconfig).map_err(|source| KubeError::Kubeconfig {
        path: kubeconfig.to_owned(),
        source,
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| KubeError::Runtime { source })?;
    let server = kc
        .clusters
        .first()
        .and_then(|c| c.cluster.as_ref()?.server.clone())
        .unwrap_or_else(|| "?".to_owned());
    runtime.block_on(async {
        tokio::time::timeout(timeout, get_both(kubeconfig, kc, namespace, name))
            .await
            .unwrap_or(Err(KubeError::Timeout {
                server,
                after: timeout,
            }))
    })
}

async fn get_both(
    path: &Path,
    kc: Kubeconfig,
    namespace: &str,
    name: &str,
) -> Result<(Pod, Namespace), KubeError> {
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|source| KubeError::Kubeconfig {
            path: path.to_owned(),
            source,
        })?;
    // kube builds its TLS connector even for a plain-HTTP server, and without CA data that means
    // loading every system root (several ms per ADD). Plain HTTP never uses them.
    if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
        config.root_cert = Some(Vec::new());
    }
    let server = config.cluster_url.to_string();
    let client = crate::agent::kube::http::client(config).map_err(|source| KubeError::Client {
        path: path.to_owned(),
        source,
    })?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let namespaces: Api<Namespace> = Api::all(client);
    let api_err = |what: String| {
        let server = server.clone();
        move |source| KubeError::Api {
            what,
            server,
            source,
        }
    };
    let pod = async {
        pods.get(name)
            .await
            .map_err(api_err(format!("pod {namespace}/{name}")))
    };
    let ns = async {
        namespaces
            .get(namespace)
            .await
            .map_err(api_err(format!("namespace {namespace}")))
    };
    tokio::try_join!(pod, ns)
}

/// `err` and its sources, `: `-separated (kube's top-level messages hide the cause, e.g. a refused
/// connection).
fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        let text = e.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = e.source();
    }
    out
}

/// The rules' facts of `pod`. `namespace`, `name` and `uid` (from `CNI_ARGS`) fill in what the
/// object lacks; `fallback_ips` (from prevResult) are used when the status has no IP yet, which is
/// normal at ADD time (spec §3.4). Unparseable status IPs are skipped.
pub fn pod_facts(
    pod: &Pod,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
    fallback_ips: &[IpAddr],
) -> PodFacts {
    let mut facts = PodFacts::from_pod(pod);
    if facts.name.is_empty() {
        facts.name = name.to_owned();
    }
    if facts.namespace.is_empty() {
        facts.namespace = namespace.to_owned();
    }
    if facts.uid.as_str().is_empty()
        && let Some(uid) = uid
    {
        facts.uid = PodUid::new(uid);
    }
    if facts.ips.is_empty() {
        facts.ips = fallback_ips.to_vec();
    }
    facts
}

/// The rules' facts of namespace `ns`; `name` fills in a missing `metadata.name`.
pub fn namespace_facts(ns: &Namespace, name: &str) -> NamespaceFacts {
    NamespaceFacts::from_namespace(Some(ns), ns.metadata.name.as_deref().unwrap_or(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::enroll::PodPhase;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).expect("pod")
    }

    #[test]
    fn facts_from_a_full_pod() {
        let p = pod(json!({
            "metadata": {"name": "web", "namespace": "app", "uid": "u-1",
                         "labels": {"istio.io/dataplane-mode": "ambient"},
                         "annotations": {"sidecar.istio.io/status": "{}"}},
            "spec": {"containers": [], "hostNetwork": true, "serviceAccountName": "sa",
                     "nodeName": "node-1"},
            "status": {"phase": "Running", "podIP": "10.0.0.9",
                       "podIPs": [{"ip": "10.0.0.9"}, {"ip": "fd00::9"}, {"ip": "junk"}]}
        }));
        let f = pod_facts(
            &p,
            "x",
            "y",
            Some("other"),
            &["10.9.9.9".parse().expect("ip")],
        );
        assert_eq!((f.name.as_str(), f.namespace.as_str()), ("web", "app"));
        assert_eq!(f.uid.as_str(), "u-1");
        assert_eq!(f.labels["istio.io/dataplane-mode"], "ambient");
        assert!(f.annotations.contains_key("sidecar.istio.io/status"));
        assert!(f.host_network);
        assert_eq!(
            (f.service_account.as_str(), f.node_name.as_str()),
            ("sa", "node-1")
        );
        let want: Vec<IpAddr> = vec![
            "10.0.0.9".parse().expect("ip"),
            "fd00::9".parse().expect("ip"),
        ];
        assert_eq!(f.ips, want);
        assert_eq!(f.phase, PodPhase::Running);
    }

    #[test]
    fn bare_pod_takes_cni_args_and_prev_result_ips() {
        let fallback: Vec<IpAddr> = vec!["10.244.1.7".parse().expect("ip")];
        let f = pod_facts(
            &pod(json!({"metadata": {}})),
            "app",
            "web",
            Some("u-2"),
            &fallback,
        );
        assert_eq!(
            (f.name.as_str(), f.namespace.as_str(), f.uid.as_str()),
            ("web", "app", "u-2")
        );
        assert_eq!(f.ips, fallback);
        assert!(!f.host_network);
        assert_eq!(f.phase, PodPhase::Unknown);

        let only_pod_ip =
            pod(json!({"metadata": {}, "status": {"podIP": "fd00::1", "phase": "Pending"}}));
        let f = pod_facts(&only_pod_ip, "app", "web", None, &fallback);
        assert_eq!(f.ips, vec!["fd00::1".parse::<IpAddr>().expect("ip")]);
        assert_eq!(f.phase, PodPhase::Pending);
        assert_eq!(f.uid.as_str(), "");
    }

    #[test]
    fn namespace_labels() {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "app",
            "labels": {"istio.io/dataplane-mode": "ambient"}}}))
        .expect("ns");
        let f = namespace_facts(&ns, "ignored");
        assert_eq!(f.name, "app");
        assert_eq!(f.labels["istio.io/dataplane-mode"], "ambient");
        let f = namespace_facts(&Namespace::default(), "app");
        assert_eq!(f.name, "app");
        assert!(f.labels.is_empty());
    }

    #[test]
    fn missing_kubeconfig_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ztnode-cni-kubeconfig");
        let err = fetch(&path, "app", "web", Duration::from_secs(1)).expect_err("missing");
        assert!(matches!(err, KubeError::Kubeconfig { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }

    #[test]
    fn refused_api_server_is_an_api_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("kc");
        // Port 1 on loopback: nothing listens there.
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:1\n\
             users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
             current-context: x\n",
        )
        .expect("write");
        let err = fetch(&path, "app", "web", Duration::from_secs(3)).expect_err("refused");
        assert!(matches!(err, KubeError::Api { .. }), "{err:?}");
    }
}
