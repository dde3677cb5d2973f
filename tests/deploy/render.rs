//! Rendering with `kubectl kustomize` and parsing the output into typed k8s-openapi objects.

use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::Resource;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ResourceQuota, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{DEPLOY, Platform};

/// `k8s.cni.cncf.io/v1` NetworkAttachmentDefinition (a Multus CRD, not in k8s-openapi).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkAttachmentDefinition {
    api_version: String,
    kind: String,
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spec: Option<NetworkAttachmentSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkAttachmentSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    config: Option<String>,
}

/// One rendering, by kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rendered {
    pub namespaces: Vec<Namespace>,
    pub service_accounts: Vec<ServiceAccount>,
    pub cluster_roles: Vec<ClusterRole>,
    pub cluster_role_bindings: Vec<ClusterRoleBinding>,
    pub roles: Vec<Role>,
    pub role_bindings: Vec<RoleBinding>,
    pub daemon_sets: Vec<DaemonSet>,
    pub config_maps: Vec<ConfigMap>,
    pub resource_quotas: Vec<ResourceQuota>,
    pub network_attachments: Vec<NetworkAttachmentDefinition>,
}

/// The kubectl to use (`KUBECTL`, else `kubectl` on PATH); `None` after printing why the test
/// skips. Panics under `CI`: there the deploy tests must run.
pub fn kubectl(test: &str) -> Option<PathBuf> {
    let k = std::env::var_os("KUBECTL").map_or_else(|| PathBuf::from("kubectl"), PathBuf::from);
    let works = Command::new(&k)
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if works {
        return Some(k);
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "{test}: no working {} and CI is set: failing instead of skipping (scripts/setup.sh installs kubectl)",
            k.display()
        );
    }
    eprintln!(
        "SKIP {test}: no working {} (set CI=1 to make this a failure)",
        k.display()
    );
    None
}

pub fn render_dir(kubectl: &Path, dir: &Path) -> Result<Rendered> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .with_context(|| format!("run {} kustomize", kubectl.display()))?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8(out.stdout)?;
    parse(&yaml).with_context(|| format!("rendering of {}", dir.display()))
}

pub fn render(kubectl: &Path, p: &Platform) -> Result<Rendered> {
    render_dir(kubectl, &Path::new(DEPLOY).join(p.dir))
}

/// Renders `p` with `components` (dirs under deploy/, in that order) added, as the components'
/// comments tell users to: a kustomization of their own naming the overlay and the components.
pub fn render_with(kubectl: &Path, p: &Platform, components: &[&str]) -> Result<Rendered> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().canonicalize()?;
    // kustomize refuses absolute paths for resources and components.
    let up = root
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count();
    let deploy = Path::new(DEPLOY).canonicalize()?;
    let rel = |sub: &str| -> Result<String> {
        let from_root = deploy.join(sub);
        let from_root = from_root.strip_prefix("/")?;
        Ok(format!("{}{}", "../".repeat(up), from_root.display()))
    };
    let components = components
        .iter()
        .map(|c| rel(c))
        .collect::<Result<Vec<_>>>()?;
    let kustomization = format!(
        "resources: [{}]\ncomponents: [{}]\n",
        rel(p.dir)?,
        components.join(", ")
    );
    std::fs::write(root.join("kustomization.yaml"), kustomization)?;
    render_dir(kubectl, &root)
}

/// Splits a multi-document YAML stream and parses each object as its typed struct.
pub fn parse(yaml: &str) -> Result<Rendered> {
    let mut r = Rendered::default();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(yaml).enumerate() {
        let value = Value::deserialize(doc).with_context(|| format!("document {i}"))?;
        if value.is_null() {
            continue;
        }
        let kind = value["kind"]
            .as_str()
            .with_context(|| format!("document {i} has no kind"))?;
        let what = format!("document {i} ({kind} {})", value["metadata"]["name"]);
        match kind {
            "Namespace" => r.namespaces.push(typed(&value).context(what)?),
            "ServiceAccount" => r.service_accounts.push(typed(&value).context(what)?),
            "ClusterRole" => r.cluster_roles.push(typed(&value).context(what)?),
            "ClusterRoleBinding" => r.cluster_role_bindings.push(typed(&value).context(what)?),
            "Role" => r.roles.push(typed(&value).context(what)?),
            "RoleBinding" => r.role_bindings.push(typed(&value).context(what)?),
            "DaemonSet" => r.daemon_sets.push(typed(&value).context(what)?),
            "ConfigMap" => r.config_maps.push(typed(&value).context(what)?),
            "ResourceQuota" => r.resource_quotas.push(typed(&value).context(what)?),
            "NetworkAttachmentDefinition" => {
                ensure!(
                    value["apiVersion"] == "k8s.cni.cncf.io/v1",
                    "{what}: apiVersion"
                );
                r.network_attachments
                    .push(round_trip(&value).context(what)?);
            }
            other => bail!("{what}: unknown kind {other:?}"),
        }
    }
    Ok(r)
}

/// `value` as `T`, which must be its apiVersion and lose no field.
fn typed<T: Resource + Serialize + DeserializeOwned>(value: &Value) -> Result<T> {
    ensure!(
        value["apiVersion"] == T::API_VERSION,
        "apiVersion {} is not {}",
        value["apiVersion"],
        T::API_VERSION
    );
    round_trip(value)
}

/// Parses `value` as `T` and requires the typed value to serialize back to the same document:
/// k8s-openapi ignores fields it does not know, so a misspelt or misplaced key shows up here.
fn round_trip<T: Serialize + DeserializeOwned>(value: &Value) -> Result<T> {
    let t: T = serde_json::from_value(value.clone())?;
    let back = serde_json::to_value(&t)?;
    if back != *value {
        bail!(
            "fields lost or changed in the typed parse:\nrendered: {}\ntyped:    {}",
            serde_json::to_string(value)?,
            serde_json::to_string(&back)?
        );
    }
    Ok(t)
}
