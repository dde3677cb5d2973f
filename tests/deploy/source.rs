//! What the proxy half of `ztnode node` makes of a rendering's env and args, decided by ztnode's
//! own code (`IstioEnv::from_vars`, called as `main.rs` calls it, in a pod): the workload source,
//! istiod's address, the token and root files; and whether every env name set is one ztnode
//! reads or ztunnel documents, with both lists taken from ztnode's sources.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Container, PodSpec, Volume};
use ztnode::proxy::control::RootSource;
use ztnode::proxy::istio_env::IstioEnv;

use super::checks::{env, pod_spec};
use super::render::Rendered;
use super::{NAMESPACE, SERVICE_ACCOUNT};

/// What the kubelet gives each fieldRef, made distinct so that a swapped fieldPath shows.
const FIELD_VALUES: [(&str, &str); 5] = [
    ("spec.nodeName", "node-1"),
    ("metadata.name", "ztnode-x7k2p"),
    ("metadata.namespace", NAMESPACE),
    ("status.podIP", "10.0.0.5"),
    ("spec.serviceAccountName", SERVICE_ACCOUNT),
];

/// istiod's xDS and CA as Istio's ztunnel chart addresses them: `istiod.<istioNamespace>.svc:15012`,
/// no scheme (istio-deploy.md §6).
pub const ISTIOD: &str = "istiod.istio-system.svc:15012";

/// The fieldRefs of Istio's ztunnel chart (istio-deploy.md §6), which the istiod component relies
/// on the base for.
const ISTIOD_FIELD_REFS: [(&str, &str); 5] = [
    ("POD_NAME", "metadata.name"),
    ("POD_NAMESPACE", "metadata.namespace"),
    ("NODE_NAME", "spec.nodeName"),
    ("INSTANCE_IP", "status.podIP"),
    ("SERVICE_ACCOUNT", "spec.serviceAccountName"),
];

/// Env names the manifests set that ztnode does not read, each with why it is set anyway. A name
/// ztnode starts reading must leave this list (`check_env_names` fails until it does).
pub const SET_BUT_NOT_READ: [(&str, &str); 3] = [
    (
        "SERVICE_ACCOUNT",
        "ztunnel's own identity (ztunnel src/config.rs, set by Istio's ztunnel chart); ztnode has no self-proxy listener",
    ),
    (
        "CHAINED_CNI_PLUGIN",
        "istio-cni's Multus mode (its istio-cni-config ConfigMap, the openshift profile); the agent only chains so far",
    ),
    (
        "CNI_CONF_NAME",
        "istio-cni's standalone conf file name (openshift profile); the agent only chains so far",
    ),
];

/// Where `ztnode node` takes workloads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// None: Kubernetes mode with no workloads, the built-in CA (an overlay alone).
    Empty,
    /// The local config (the standalone component).
    LocalConfig,
    /// istiod's xDS (the istiod component).
    Istiod,
    /// A local config and XDS_ADDRESS: ztnode refuses to start.
    Both,
}

/// The container's env as the process sees it: values, fieldRefs resolved as the kubelet resolves
/// them, and `KUBERNETES_SERVICE_HOST`, which the kubelet sets in every pod.
pub fn process_env(c: &Container) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::from([("KUBERNETES_SERVICE_HOST".to_owned(), "10.96.0.1".to_owned())]);
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (v, None) => v.clone().unwrap_or_default(),
            (None, Some(from)) => {
                let path = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .with_context(|| format!("env {}: only fieldRef is expected", e.name))?;
                let (_, v) = FIELD_VALUES
                    .iter()
                    .find(|(p, _)| *p == path)
                    .with_context(|| {
                        format!("env {}: fieldRef {path} is not one of the chart's", e.name)
                    })?;
                (*v).to_owned()
            }
            (Some(_), Some(_)) => bail!("env {}: both value and valueFrom", e.name),
        };
        out.insert(e.name.clone(), value);
    }
    Ok(out)
}

fn field_value(path: &str) -> &'static str {
    FIELD_VALUES
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, v)| *v)
        .expect("a FIELD_VALUES path")
}

fn container(r: &Rendered) -> Result<(&PodSpec, &Container)> {
    let pod = pod_spec(r.daemon_sets.first().context("no DaemonSet")?)?;
    Ok((pod, pod.containers.first().context("no container")?))
}

/// The workload source and ztunnel env of `ztnode node` in the rendered pod, as `main.rs` decides
/// them: a local config is `--config` or `LOCAL_XDS_PATH` (clap), xDS is on per
/// `IstioEnv::from_vars`, and both together are refused.
pub fn workload_source(r: &Rendered) -> Result<(Source, IstioEnv)> {
    let (_, c) = container(r)?;
    let env = process_env(c)?;
    let args = c.args.as_deref().unwrap_or_default();
    let local = args
        .iter()
        .any(|a| a == "--config" || a.starts_with("--config="))
        || env.get("LOCAL_XDS_PATH").is_some_and(|p| !p.is_empty());
    let ie = IstioEnv::from_vars(env)?;
    let source = match (local, ie.xds.is_some()) {
        (false, false) => Source::Empty,
        (true, false) => Source::LocalConfig,
        (false, true) => Source::Istiod,
        (true, true) => Source::Both,
    };
    Ok((source, ie))
}

pub fn check_source(r: &Rendered, want: Source) -> Result<()> {
    let (got, _) = workload_source(r)?;
    ensure!(got == want, "workload source {got:?}, want {want:?}");
    Ok(())
}

/// `path` as the process opens it: relative paths against the container's workingDir.
fn resolve(c: &Container, path: &Path) -> Result<PathBuf> {
    let full = if path.is_absolute() {
        path.to_owned()
    } else {
        let wd = c.working_dir.as_deref().with_context(|| {
            format!(
                "{} is relative and the container has no workingDir: it would resolve against the image's WORKDIR",
                path.display()
            )
        })?;
        Path::new(wd).join(path)
    };
    Ok(full
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect())
}

/// The volume mounted at the deepest mountPath holding `file`, and `file` relative to it.
fn mounted<'a>(pod: &'a PodSpec, c: &Container, file: &Path) -> Result<(&'a Volume, PathBuf)> {
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| file.starts_with(&m.mount_path))
        .max_by_key(|m| Path::new(&m.mount_path).components().count())
        .with_context(|| format!("nothing mounted holds {}", file.display()))?;
    ensure!(m.sub_path.is_none(), "{} mounted with a subPath", m.name);
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == m.name)
        .with_context(|| format!("no volume {}", m.name))?;
    Ok((v, file.strip_prefix(&m.mount_path)?.to_owned()))
}

/// The projected token ztnode sends istiod: `file` is the `istio-token` projection of audience
/// `istio-ca`, 12 h, as the chart projects it.
fn check_token(pod: &PodSpec, c: &Container, file: &Path) -> Result<()> {
    let (v, rel) = mounted(pod, c, file)?;
    ensure!(
        v.name == "istio-token",
        "token {} is in volume {}",
        file.display(),
        v.name
    );
    let sources = v.projected.as_ref().and_then(|p| p.sources.as_ref());
    let tokens: Vec<_> = sources
        .into_iter()
        .flatten()
        .filter_map(|s| s.service_account_token.as_ref())
        .collect();
    ensure!(tokens.len() == 1, "projected istio-token volume: {v:?}");
    let t = tokens[0];
    ensure!(
        t.audience.as_deref() == Some("istio-ca")
            && t.path == "istio-token"
            && t.expiration_seconds == Some(43200),
        "istio-token projection {t:?}"
    );
    ensure!(
        rel == Path::new(&t.path),
        "ztnode reads the token at {}, the projection writes {}",
        file.display(),
        t.path
    );
    Ok(())
}

/// istiod's root as ztnode reads it: `root-cert.pem` of the ConfigMap istiod publishes in every
/// namespace (`istio-ca-root-cert`, Istio pkg/config/constants).
fn check_root(pod: &PodSpec, c: &Container, what: &str, roots: &RootSource) -> Result<()> {
    let RootSource::File(file) = roots else {
        bail!("{what} roots {roots:?}, not istiod's root file");
    };
    let file = resolve(c, file)?;
    let (v, rel) = mounted(pod, c, &file)?;
    let cm = v
        .config_map
        .as_ref()
        .with_context(|| format!("{what} root {} is not from a ConfigMap", file.display()))?;
    ensure!(
        cm.name == "istio-ca-root-cert" && cm.items.is_none(),
        "{what} root from ConfigMap {cm:?}"
    );
    ensure!(
        rel == Path::new("root-cert.pem"),
        "{what} root is key {}, istiod writes root-cert.pem",
        rel.display()
    );
    Ok(())
}

/// The istiod component on an overlay (`overlay` is that overlay's rendering): the chart's env
/// and fieldRefs, xDS and CA on istiod, the token and root where ztnode looks for them, no local
/// config, and every env name it sets one ztnode's `IstioEnv` reads.
pub fn check_istiod(r: &Rendered, overlay: &Rendered) -> Result<()> {
    let (pod, c) = container(r)?;
    for (name, want) in [
        ("XDS_ADDRESS", ISTIOD),
        ("CA_ADDRESS", ISTIOD),
        ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
        ("ISTIO_META_ENABLE_HBONE", "true"),
    ] {
        let (value, _) = env(c, name)?;
        ensure!(value == Some(want), "{name} is {value:?}, want {want}");
    }
    for (name, path) in ISTIOD_FIELD_REFS {
        let (value, field) = env(c, name)?;
        ensure!(
            value.is_none() && field == Some(path),
            "{name} is {value:?} / fieldRef {field:?}, want {path}"
        );
    }

    let (source, ie) = workload_source(r)?;
    ensure!(source == Source::Istiod, "workload source {source:?}");
    let https = format!("https://{ISTIOD}/");
    let xds = ie.xds.as_ref().context("xDS off")?;
    let ca = ie.ca.as_ref().context("istiod's CA off")?;
    for (what, s) in [("xDS", xds), ("CA", ca)] {
        let address = s.endpoint.address.to_string();
        ensure!(address == https, "{what} at {address}, want {https}");
        ensure!(s.endpoint.alt_hostname.is_none(), "{what} alt hostname");
        ensure!(
            s.auth.cluster_id == "Kubernetes",
            "{what} clusterid {}",
            s.auth.cluster_id
        );
        let token = s.auth.token_file.as_deref().context("no token")?;
        check_token(pod, c, &resolve(c, token)?).with_context(|| format!("{what} token"))?;
        check_root(pod, c, what, &s.endpoint.roots)?;
    }
    let hbone = ie.proxy_metadata.get("ENABLE_HBONE").map(String::as_str);
    ensure!(
        hbone == Some("true"),
        "node metadata ENABLE_HBONE {hbone:?}"
    );
    for (what, got, path) in [
        ("NODE_NAME", &ie.node_name, "spec.nodeName"),
        ("POD_NAME", &ie.pod_name, "metadata.name"),
        ("POD_NAMESPACE", &ie.pod_namespace, "metadata.namespace"),
        ("INSTANCE_IP", &ie.instance_ip, "status.podIP"),
    ] {
        let want = field_value(path);
        ensure!(got == want, "the proxy's {what} is {got:?}, want {want:?}");
    }

    // The names this component sets (or relies on the base for) are IstioEnv's own, and none
    // is one IstioEnv ignores with a warning.
    let (_, base) = container(overlay)?;
    let before: Vec<_> = base.env.iter().flatten().collect();
    let mut names: BTreeSet<&str> = c
        .env
        .iter()
        .flatten()
        .filter(|e| !before.contains(e))
        .map(|e| e.name.as_str())
        .collect();
    names.extend(ISTIOD_FIELD_REFS.map(|(n, _)| n));
    let n = source_names();
    for name in names {
        ensure!(
            n.read_by_istio_env(name) || not_read(name).is_some(),
            "the istiod component sets {name}, which src/proxy/istio_env.rs does not read"
        );
        ensure!(
            !ie.unsupported()
                .iter()
                .any(|u| u == name || u.starts_with(&format!("{name} "))),
            "the istiod component sets {name}, which ztnode ignores"
        );
    }
    check_env_names(r)
}

fn not_read(name: &str) -> Option<&'static str> {
    SET_BUT_NOT_READ
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, why)| *why)
}

/// Every env name of the container is one ztnode reads, one ztnode knows ztunnel reads and
/// ignores (`UNSUPPORTED` in src/proxy/istio_env.rs), or one of [`SET_BUT_NOT_READ`].
pub fn check_env_names(r: &Rendered) -> Result<()> {
    let (_, c) = container(r)?;
    let n = source_names();
    for e in c.env.iter().flatten() {
        let name = e.name.as_str();
        ensure!(
            n.read_by_ztnode(name) || n.ztunnel_ignored(name) || not_read(name).is_some(),
            "env {name} is neither read by ztnode nor a ztunnel setting it knows"
        );
    }
    for (name, _) in SET_BUT_NOT_READ {
        ensure!(
            !n.read_by_ztnode(name),
            "ztnode reads {name} now: remove it from SET_BUT_NOT_READ"
        );
    }
    Ok(())
}

/// Upper-case string literals (`"NAME"`, and prefixes like `"ISTIO_META_"`) in ztnode's sources.
pub struct SourceNames {
    /// src/proxy/istio_env.rs outside `UNSUPPORTED` and its tests.
    istio_env: BTreeSet<String>,
    /// The `UNSUPPORTED` list: names ztunnel reads and ztnode ignores.
    unsupported: BTreeSet<String>,
    /// All of src/ outside `UNSUPPORTED`, tests and the lab (which sets env for its children).
    all: BTreeSet<String>,
}

impl SourceNames {
    /// `name` is in `set`, or under a prefix in it; a prefix alone is no name.
    fn has(set: &BTreeSet<String>, name: &str) -> bool {
        !name.ends_with('_')
            && (set.contains(name)
                || set
                    .iter()
                    .any(|p| p.ends_with('_') && name.starts_with(p.as_str())))
    }

    /// Read by `IstioEnv::from_vars`, by name or by a prefix it strips.
    pub fn read_by_istio_env(&self, name: &str) -> bool {
        Self::has(&self.istio_env, name)
    }

    /// Read anywhere in ztnode (the agent's clap `env = ..`, the enrollment rules, `IstioEnv`),
    /// or the logging's variables (`runtime::logging`: the filter and the format).
    pub fn read_by_ztnode(&self, name: &str) -> bool {
        use ztnode::runtime::logging::{LOG_FORMAT_ENV, RUST_LOG_ENV};
        Self::has(&self.all, name) || name == RUST_LOG_ENV || name == LOG_FORMAT_ENV
    }

    pub fn ztunnel_ignored(&self, name: &str) -> bool {
        self.unsupported.contains(name)
    }
}

const UNSUPPORTED_START: &str = "const UNSUPPORTED: &[&str] = &[";

pub fn source_names() -> &'static SourceNames {
    static NAMES: OnceLock<SourceNames> = OnceLock::new();
    NAMES.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let istio_env =
            std::fs::read_to_string(src.join("proxy/istio_env.rs")).expect("istio_env.rs");
        let (outside, unsupported) = split_unsupported(&istio_env);
        let mut all = BTreeSet::new();
        let mut files = vec![src.clone()];
        while let Some(p) = files.pop() {
            if p.is_dir() {
                if p == src.join("lab") {
                    continue;
                }
                for e in std::fs::read_dir(&p).expect("read src") {
                    files.push(e.expect("dir entry").path());
                }
            } else if p.extension().is_some_and(|e| e == "rs") && !p.ends_with("tests.rs") {
                let text = std::fs::read_to_string(&p).expect("read source");
                let text = if p.ends_with("proxy/istio_env.rs") {
                    outside.clone()
                } else {
                    text
                };
                all.extend(literals(without_tests(&text)));
            }
        }
        SourceNames {
            istio_env: literals(without_tests(&outside)),
            unsupported: literals(&unsupported),
            all,
        }
    })
}

/// istio_env.rs without the `UNSUPPORTED` list, and the list.
fn split_unsupported(text: &str) -> (String, String) {
    let start = text
        .find(UNSUPPORTED_START)
        .expect("UNSUPPORTED in istio_env.rs");
    let len = text[start..].find("];").expect("end of UNSUPPORTED");
    let list = text[start..start + len].to_owned();
    (format!("{}{}", &text[..start], &text[start + len..]), list)
}

/// The part of a file before its `#[cfg(test)]` module.
fn without_tests(text: &str) -> &str {
    text.find("\n#[cfg(test)]").map_or(text, |i| &text[..i])
}

/// Every `"NAME"` literal of upper-case letters, digits and underscores (each quote is tried as an
/// opening one, so an odd quote elsewhere cannot hide a literal).
fn literals(text: &str) -> BTreeSet<String> {
    let name_char = |c: char| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_';
    text.match_indices('"')
        .filter_map(|(i, _)| {
            let rest = &text[i + 1..];
            let end = rest.find(|c: char| !name_char(c))?;
            let ok =
                rest.starts_with(|c: char| c.is_ascii_uppercase()) && rest[end..].starts_with('"');
            ok.then(|| rest[..end].to_owned())
        })
        .collect()
}
