//! The breakages `checks_catch_broken_manifests` and the standalone test apply, one at a time, to a
//! rendering that passes: each must make the checks fail.

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerPort, EnvVar, HTTPGetAction, PodSpec, SELinuxOptions,
    ServiceAccountTokenProjection, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::Platform;
use super::checks::check;
use super::render::Rendered;

pub type Mutation = (&'static str, fn(&mut Rendered));

fn pod_mut(r: &mut Rendered) -> &mut PodSpec {
    r.daemon_sets[0]
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .expect("pod spec")
}

fn container_mut(r: &mut Rendered) -> &mut Container {
    &mut pod_mut(r).containers[0]
}

fn volume_mut<'a>(r: &'a mut Rendered, name: &str) -> &'a mut Volume {
    pod_mut(r)
        .volumes
        .iter_mut()
        .flatten()
        .find(|v| v.name == name)
        .expect("volume")
}

fn mount_mut<'a>(r: &'a mut Rendered, name: &str) -> &'a mut VolumeMount {
    container_mut(r)
        .volume_mounts
        .iter_mut()
        .flatten()
        .find(|m| m.name == name)
        .expect("mount")
}

fn env_field_mut<'a>(r: &'a mut Rendered, name: &str) -> &'a mut String {
    let e = container_mut(r)
        .env
        .iter_mut()
        .flatten()
        .find(|e| e.name == name)
        .expect("env");
    &mut e
        .value_from
        .as_mut()
        .and_then(|v| v.field_ref.as_mut())
        .expect("fieldRef")
        .field_path
}

fn env_value_mut<'a>(r: &'a mut Rendered, name: &str) -> &'a mut Option<String> {
    &mut container_mut(r)
        .env
        .iter_mut()
        .flatten()
        .find(|e| e.name == name)
        .expect("env")
        .value
}

fn env_remove(r: &mut Rendered, name: &str) {
    container_mut(r)
        .env
        .as_mut()
        .expect("env")
        .retain(|e| e.name != name)
}

fn env_push(r: &mut Rendered, name: &str, value: &str) {
    container_mut(r).env.as_mut().expect("env").push(EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    })
}

fn token_mut(r: &mut Rendered) -> &mut ServiceAccountTokenProjection {
    let p = volume_mut(r, "istio-token")
        .projected
        .as_mut()
        .expect("projected");
    p.sources.as_mut().expect("sources")[0]
        .service_account_token
        .as_mut()
        .expect("token")
}

fn arg_mut<'a>(r: &'a mut Rendered, flag_name: &str) -> &'a mut String {
    let args = container_mut(r).args.as_mut().expect("args");
    let i = args.iter().position(|a| a == flag_name).expect("flag");
    &mut args[i + 1]
}

fn host_path_mut<'a>(r: &'a mut Rendered, name: &str) -> &'a mut String {
    &mut volume_mut(r, name)
        .host_path
        .as_mut()
        .expect("hostPath")
        .path
}

fn cluster_rule_mut(r: &mut Rendered, i: usize) -> &mut PolicyRule {
    &mut r.cluster_roles[0].rules.as_mut().expect("rules")[i]
}

fn role_rule_mut(r: &mut Rendered) -> &mut PolicyRule {
    &mut r.roles[0].rules.as_mut().expect("rules")[0]
}

fn caps_add_mut(r: &mut Rendered) -> &mut Vec<String> {
    let sc = container_mut(r)
        .security_context
        .as_mut()
        .expect("securityContext");
    sc.capabilities
        .as_mut()
        .and_then(|c| c.add.as_mut())
        .expect("capabilities add")
}

fn probe_get_mut(r: &mut Rendered) -> &mut HTTPGetAction {
    container_mut(r)
        .readiness_probe
        .as_mut()
        .and_then(|p| p.http_get.as_mut())
        .expect("httpGet")
}

/// Applies each mutation to a copy of `good` (which passes as `p`) and requires `check` to fail.
pub fn assert_caught(good: &Rendered, p: &Platform, mutations: &[Mutation]) -> Result<()> {
    assert_caught_by(good, mutations, |r| check(r, p)).with_context(|| p.dir)
}

pub fn assert_caught_by(
    good: &Rendered,
    mutations: &[Mutation],
    check: impl Fn(&Rendered) -> Result<()>,
) -> Result<()> {
    check(good).context("unbroken")?;
    let mut missed = Vec::new();
    for (what, mutate) in mutations {
        let mut r = good.clone();
        mutate(&mut r);
        if check(&r).is_ok() {
            missed.push(*what);
        }
    }
    ensure!(
        missed.is_empty(),
        "the checks pass with these manifests broken: {missed:?}"
    );
    Ok(())
}

/// Each fact of the base, broken.
pub fn base() -> Vec<Mutation> {
    let mutations: &[Mutation] = &[
        ("hostNetwork off", |r| pod_mut(r).host_network = Some(false)),
        ("hostNetwork unset", |r| pod_mut(r).host_network = None),
        ("NODE_NAME from metadata.name", |r| {
            *env_field_mut(r, "NODE_NAME") = "metadata.name".into()
        }),
        ("NODE_NAME missing", |r| {
            container_mut(r)
                .env
                .as_mut()
                .expect("env")
                .retain(|e| e.name != "NODE_NAME")
        }),
        ("POD_NAMESPACE from spec.nodeName", |r| {
            *env_field_mut(r, "POD_NAMESPACE") = "spec.nodeName".into()
        }),
        ("POD_NAME missing", |r| {
            container_mut(r)
                .env
                .as_mut()
                .expect("env")
                .retain(|e| e.name != "POD_NAME")
        }),
        ("NODE_NAME twice", |r| {
            let c = container_mut(r);
            let e = c
                .env
                .as_ref()
                .expect("env")
                .iter()
                .find(|e| e.name == "NODE_NAME")
                .expect("NODE_NAME")
                .clone();
            c.env.as_mut().expect("env").push(e);
        }),
        ("/host/proc writable", |r| {
            mount_mut(r, "cni-host-procfs").read_only = None
        }),
        ("/host/proc elsewhere", |r| {
            mount_mut(r, "cni-host-procfs").mount_path = "/proc-host".into()
        }),
        ("host /proc replaced", |r| {
            *host_path_mut(r, "cni-host-procfs") = "/run".into()
        }),
        ("CNI bin hostPath moved", |r| {
            *host_path_mut(r, "cni-bin-dir") = "/usr/lib/cni".into()
        }),
        ("CNI conf hostPath moved", |r| {
            *host_path_mut(r, "cni-net-dir") = "/etc/cni/conf.d".into()
        }),
        ("--cni-bin-dir not the mount", |r| {
            *arg_mut(r, "--cni-bin-dir") = "/opt/cni/bin".into()
        }),
        ("CNI conf mounted elsewhere", |r| {
            mount_mut(r, "cni-net-dir").mount_path = "/host/net.d".into()
        }),
        ("CNI conf read-only", |r| {
            mount_mut(r, "cni-net-dir").read_only = Some(true)
        }),
        ("--cni-conf-dir twice", |r| {
            let args = container_mut(r).args.as_mut().expect("args");
            args.extend(["--cni-conf-dir".into(), "/host/etc/cni/net.d".into()]);
        }),
        ("--run-dir elsewhere", |r| {
            *arg_mut(r, "--run-dir") = "/run/ztnode".into()
        }),
        ("not `ztnode node`", |r| {
            container_mut(r).args.as_mut().expect("args")[0] = "agent".into()
        }),
        ("netns without propagation", |r| {
            mount_mut(r, "cni-netns-dir").mount_propagation = None
        }),
        ("ZDS dir missing", |r| {
            pod_mut(r)
                .volumes
                .as_mut()
                .expect("volumes")
                .retain(|v| v.name != "cni-ztunnel-sock-dir")
        }),
        ("readiness path", |r| {
            probe_get_mut(r).path = Some("/healthz".into())
        }),
        ("readiness port", |r| {
            probe_get_mut(r).port = IntOrString::Int(15020)
        }),
        ("readiness port by name", |r| {
            probe_get_mut(r).port = IntOrString::String("15021".into())
        }),
        ("pods/status update too", |r| {
            cluster_rule_mut(r, 1).verbs.push("update".into())
        }),
        ("nodes too", |r| {
            cluster_rule_mut(r, 0)
                .resources
                .as_mut()
                .expect("resources")
                .push("nodes".into())
        }),
        ("no watch", |r| {
            cluster_rule_mut(r, 0).verbs.retain(|v| v != "watch")
        }),
        ("all resources", |r| {
            cluster_rule_mut(r, 0).resources = Some(vec!["*".into()])
        }),
        ("every DaemonSet", |r| {
            role_rule_mut(r).resource_names = None
        }),
        ("DaemonSet list", |r| {
            role_rule_mut(r).verbs.push("list".into())
        }),
        ("Role elsewhere", |r| {
            r.roles[0].metadata.namespace = Some("default".into())
        }),
        ("ClusterRoleBinding to another SA", |r| {
            r.cluster_role_bindings[0]
                .subjects
                .as_mut()
                .expect("subjects")[0]
                .name = "default".into()
        }),
        ("RoleBinding to a ClusterRole", |r| {
            r.role_bindings[0].role_ref.kind = "ClusterRole".into()
        }),
        ("SA renamed", |r| {
            r.service_accounts[0].metadata.name = Some("ztnode".into())
        }),
        ("SCC off OpenShift", |r| {
            r.cluster_roles[0]
                .rules
                .as_mut()
                .expect("rules")
                .push(PolicyRule {
                    api_groups: Some(vec!["security.openshift.io".into()]),
                    resources: Some(vec!["securitycontextconstraints".into()]),
                    resource_names: Some(vec!["privileged".into()]),
                    verbs: vec!["use".into()],
                    non_resource_urls: None,
                })
        }),
        ("SYS_MODULE", |r| caps_add_mut(r).push("SYS_MODULE".into())),
        ("no SYS_PTRACE", |r| {
            caps_add_mut(r).retain(|c| c != "SYS_PTRACE")
        }),
        ("privileged", |r| {
            container_mut(r)
                .security_context
                .as_mut()
                .expect("sc")
                .privileged = Some(true)
        }),
        ("no priorityClassName", |r| {
            pod_mut(r).priority_class_name = None
        }),
        ("tolerates one taint", |r| {
            let t = &mut pod_mut(r).tolerations.as_mut().expect("tolerations")[0];
            t.key = Some("node-role.kubernetes.io/control-plane".into());
        }),
        ("maxUnavailable 1", |r| {
            let s = r.daemon_sets[0]
                .spec
                .as_mut()
                .and_then(|s| s.update_strategy.as_mut())
                .expect("strategy");
            s.rolling_update
                .as_mut()
                .expect("rollingUpdate")
                .max_unavailable = Some(IntOrString::Int(1));
        }),
        ("a declared containerPort", |r| {
            container_mut(r).ports = Some(vec![ContainerPort {
                name: Some("ztunnel-stats".into()),
                container_port: 15020,
                protocol: Some("TCP".into()),
                ..Default::default()
            }])
        }),
        ("OnDelete", |r| {
            let s = r.daemon_sets[0]
                .spec
                .as_mut()
                .and_then(|s| s.update_strategy.as_mut())
                .expect("strategy");
            s.type_ = Some("OnDelete".into());
        }),
        ("grace 5 s", |r| {
            pod_mut(r).termination_grace_period_seconds = Some(5)
        }),
        ("DaemonSet in default", |r| {
            r.daemon_sets[0].metadata.namespace = Some("default".into())
        }),
        ("a second DaemonSet", |r| {
            let ds = r.daemon_sets[0].clone();
            r.daemon_sets.push(ds);
        }),
        ("an extra ConfigMap", |r| {
            r.config_maps.push(ConfigMap::default())
        }),
        ("image", |r| {
            container_mut(r).image = Some("ghcr.io/istio/ztunnel:latest".into())
        }),
        ("image always pulled", |r| {
            container_mut(r).image_pull_policy = Some("Always".into())
        }),
        ("no surge", |r| {
            let s = r.daemon_sets[0]
                .spec
                .as_mut()
                .and_then(|s| s.update_strategy.as_mut())
                .and_then(|s| s.rolling_update.as_mut())
                .expect("rollingUpdate");
            s.max_surge = Some(IntOrString::Int(0));
        }),
        ("no AppArmor annotation", |r| {
            let t = r.daemon_sets[0]
                .spec
                .as_mut()
                .and_then(|s| s.template.metadata.as_mut())
                .expect("meta");
            t.annotations
                .as_mut()
                .expect("annotations")
                .retain(|k, _| !k.starts_with("container.apparmor"));
        }),
        ("AppArmor field the runtime's default", |r| {
            let sc = container_mut(r).security_context.as_mut().expect("sc");
            sc.app_armor_profile
                .as_mut()
                .expect("appArmorProfile")
                .type_ = "RuntimeDefault".into();
        }),
        ("ServiceAccount token everywhere", |r| {
            r.service_accounts[0].automount_service_account_token = None
        }),
        ("pod token left to the ServiceAccount", |r| {
            pod_mut(r).automount_service_account_token = None
        }),
        ("no requests", |r| {
            container_mut(r)
                .resources
                .as_mut()
                .expect("resources")
                .requests = None
        }),
        ("no memory request", |r| {
            let res = container_mut(r).resources.as_mut().expect("resources");
            res.requests.as_mut().expect("requests").remove("memory");
        }),
        ("a memory limit", |r| {
            let res = container_mut(r).resources.as_mut().expect("resources");
            res.limits = Some([("memory".into(), Quantity("512Mi".into()))].into());
        }),
        ("no liveness probe", |r| {
            container_mut(r).liveness_probe = None
        }),
        ("liveness on readiness", |r| {
            let get = container_mut(r)
                .liveness_probe
                .as_mut()
                .and_then(|p| p.http_get.as_mut())
                .expect("httpGet");
            get.path = Some("/healthz/ready".into());
            get.port = IntOrString::Int(15021);
        }),
        ("liveness timeout 1 s", |r| {
            container_mut(r)
                .liveness_probe
                .as_mut()
                .expect("liveness")
                .timeout_seconds = None
        }),
        ("command overrides the entrypoint", |r| {
            container_mut(r).command = Some(vec!["/bin/sh".into()])
        }),
        ("pod label app renamed", |r| {
            let t = r.daemon_sets[0]
                .spec
                .as_mut()
                .and_then(|s| s.template.metadata.as_mut())
                .expect("meta");
            t.labels
                .as_mut()
                .expect("labels")
                .insert("app".into(), "ztunnel".into());
        }),
        ("pod may be enrolled", |r| {
            let t = r.daemon_sets[0]
                .spec
                .as_mut()
                .and_then(|s| s.template.metadata.as_mut())
                .expect("meta");
            t.labels
                .as_mut()
                .expect("labels")
                .remove("istio.io/dataplane-mode");
        }),
        ("dnsPolicy default", |r| pod_mut(r).dns_policy = None),
        ("no nodeSelector", |r| pod_mut(r).node_selector = None),
        ("no API token", |r| {
            pod_mut(r).automount_service_account_token = Some(false)
        }),
        ("run dir mounted elsewhere", |r| {
            mount_mut(r, "ztnode-run-dir").mount_path = "/run/ztnode".into()
        }),
        ("netns mounted elsewhere", |r| {
            mount_mut(r, "cni-netns-dir").mount_path = "/host/var/run/netns".into()
        }),
        ("ZDS dir mounted elsewhere", |r| {
            mount_mut(r, "cni-ztunnel-sock-dir").mount_path = "/run/ztunnel".into()
        }),
        ("host /proc may be created", |r| {
            volume_mut(r, "cni-host-procfs")
                .host_path
                .as_mut()
                .expect("hostPath")
                .type_ = Some("DirectoryOrCreate".into())
        }),
        ("readiness over TLS", |r| {
            probe_get_mut(r).scheme = Some("HTTPS".into())
        }),
        ("no readiness probe", |r| {
            container_mut(r).readiness_probe = None
        }),
        ("runs as a user", |r| {
            container_mut(r)
                .security_context
                .as_mut()
                .expect("sc")
                .run_as_user = Some(1000)
        }),
        ("keeps the default capabilities", |r| {
            let sc = container_mut(r).security_context.as_mut().expect("sc");
            sc.capabilities.as_mut().expect("caps").drop = None;
        }),
        ("spc_t off OpenShift", |r| {
            let sc = container_mut(r).security_context.as_mut().expect("sc");
            sc.se_linux_options = Some(SELinuxOptions {
                type_: Some("spc_t".into()),
                ..Default::default()
            });
        }),
        ("Namespace renamed", |r| {
            r.namespaces[0].metadata.name = Some("ztnode-system".into())
        }),
        ("DNS captured", |r| {
            let e = container_mut(r)
                .env
                .iter_mut()
                .flatten()
                .find(|e| e.name == "AMBIENT_DNS_CAPTURE")
                .expect("env");
            e.value = Some("true".into());
        }),
    ];
    mutations.to_vec()
}

/// The GKE overlay's own facts, broken.
pub fn gke() -> Vec<Mutation> {
    let mutations: &[Mutation] = &[
        ("no quota", |r| r.resource_quotas.clear()),
        ("quota for another class", |r| {
            let q = r.resource_quotas[0]
                .spec
                .as_mut()
                .and_then(|s| s.scope_selector.as_mut())
                .expect("scope");
            q.match_expressions.as_mut().expect("exprs")[0].values =
                Some(vec!["system-cluster-critical".into()]);
        }),
        ("quota elsewhere", |r| {
            r.resource_quotas[0].metadata.namespace = Some("kube-system".into())
        }),
        ("GKE bin dir lost", |r| {
            *host_path_mut(r, "cni-bin-dir") = "/opt/cni/bin".into()
        }),
    ];
    mutations.to_vec()
}

/// The OpenShift overlay's own facts, broken.
pub fn openshift() -> Vec<Mutation> {
    let mutations: &[Mutation] = &[
        ("no SCC", |r| {
            r.cluster_roles[0]
                .rules
                .as_mut()
                .expect("rules")
                .retain(|r| r.resource_names.is_none())
        }),
        ("no spc_t", |r| {
            container_mut(r)
                .security_context
                .as_mut()
                .expect("sc")
                .se_linux_options = None
        }),
        ("chained", |r| {
            container_mut(r)
                .env
                .as_mut()
                .expect("env")
                .retain(|e| e.name != "CHAINED_CNI_PLUGIN")
        }),
        ("NAD elsewhere", |r| {
            r.network_attachments[0].metadata.namespace = Some("istio-system".into())
        }),
        ("no NAD", |r| r.network_attachments.clear()),
        ("Multus conf dir lost", |r| {
            *host_path_mut(r, "cni-net-dir") = "/etc/kubernetes/cni/net.d".into()
        }),
    ];
    mutations.to_vec()
}

/// The standalone component's facts, broken (on the k3s composition).
pub fn standalone() -> Vec<Mutation> {
    let mutations: &[Mutation] = &[
        ("config path elsewhere", |r| {
            let e = container_mut(r)
                .env
                .iter_mut()
                .flatten()
                .find(|e| e.name == "LOCAL_XDS_PATH")
                .expect("env");
            e.value = Some("/etc/ztnode/config.yaml".into());
        }),
        ("config writable", |r| {
            mount_mut(r, "local-config").read_only = None
        }),
        ("another ConfigMap", |r| {
            volume_mut(r, "local-config")
                .config_map
                .as_mut()
                .expect("configMap")
                .name = "other".into()
        }),
        ("not YAML", |r| {
            let data = r.config_maps[0].data.as_mut().expect("data");
            data.insert("local-config.yaml".into(), "workloads: [".into());
        }),
        ("no ConfigMap", |r| r.config_maps.clear()),
        ("no --ca-dir", |r| {
            let args = container_mut(r).args.as_mut().expect("args");
            let i = args.iter().position(|a| a == "--ca-dir").expect("--ca-dir");
            args.drain(i..i + 2);
        }),
        ("CA dir elsewhere", |r| {
            let args = container_mut(r).args.as_mut().expect("args");
            let i = args.iter().position(|a| a == "--ca-dir").expect("--ca-dir");
            args[i + 1] = "/var/run/ztnode/ca".into();
        }),
        ("CA writable", |r| {
            mount_mut(r, "ca").read_only = Some(false)
        }),
        ("CA optional", |r| {
            volume_mut(r, "ca")
                .secret
                .as_mut()
                .expect("secret")
                .optional = Some(true)
        }),
        ("CA from another Secret", |r| {
            volume_mut(r, "ca")
                .secret
                .as_mut()
                .expect("secret")
                .secret_name = Some("istio-ca-secret".into())
        }),
        ("CA an emptyDir", |r| {
            let v = volume_mut(r, "ca");
            v.secret = None;
            v.empty_dir = Some(Default::default());
        }),
    ];
    mutations.to_vec()
}

/// The base's choice of no workload source, broken.
pub fn source() -> Vec<Mutation> {
    let mutations: &[Mutation] = &[
        ("XDS_ADDRESS set", |r| {
            *env_value_mut(r, "XDS_ADDRESS") = Some("istiod.istio-system.svc:15012".into())
        }),
        ("a local config", |r| {
            env_push(r, "LOCAL_XDS_PATH", "/etc/ztnode/local-config.yaml")
        }),
        ("--config", |r| {
            let args = container_mut(r).args.as_mut().expect("args");
            args.extend(["--config".into(), "/etc/ztnode/local-config.yaml".into()]);
        }),
    ];
    mutations.to_vec()
}

/// The istiod component's facts, broken (on the k3s composition).
pub fn istiod() -> Vec<Mutation> {
    let mutations: &[Mutation] = &[
        ("XDS_ADDRESS with a scheme", |r| {
            *env_value_mut(r, "XDS_ADDRESS") = Some("https://istiod.istio-system.svc:15012".into())
        }),
        ("XDS_ADDRESS a revisioned istiod", |r| {
            *env_value_mut(r, "XDS_ADDRESS") = Some("istiod-canary.istio-system.svc:15012".into())
        }),
        ("XDS_ADDRESS empty", |r| {
            *env_value_mut(r, "XDS_ADDRESS") = Some(String::new())
        }),
        ("CA_ADDRESS elsewhere", |r| {
            *env_value_mut(r, "CA_ADDRESS") = Some("istiod.istio-system.svc:15010".into())
        }),
        ("CA_ADDRESS missing", |r| env_remove(r, "CA_ADDRESS")),
        ("another cluster id", |r| {
            *env_value_mut(r, "ISTIO_META_CLUSTER_ID") = Some("cluster1".into())
        }),
        ("no ENABLE_HBONE", |r| {
            env_remove(r, "ISTIO_META_ENABLE_HBONE")
        }),
        ("INSTANCE_IP the host's", |r| {
            *env_field_mut(r, "INSTANCE_IP") = "status.hostIP".into()
        }),
        ("POD_NAME from spec.nodeName", |r| {
            *env_field_mut(r, "POD_NAME") = "spec.nodeName".into()
        }),
        ("SERVICE_ACCOUNT missing", |r| {
            env_remove(r, "SERVICE_ACCOUNT")
        }),
        ("token audience", |r| {
            token_mut(r).audience = Some("kubernetes".into())
        }),
        ("token for 1 h", |r| {
            token_mut(r).expiration_seconds = Some(3600)
        }),
        ("token file renamed", |r| token_mut(r).path = "token".into()),
        ("token mounted elsewhere", |r| {
            mount_mut(r, "istio-token").mount_path = "/var/run/secrets/istio-token".into()
        }),
        ("token not mounted", |r| {
            container_mut(r)
                .volume_mounts
                .as_mut()
                .expect("mounts")
                .retain(|m| m.name != "istio-token")
        }),
        ("AUTH_TOKEN the API token", |r| {
            env_push(
                r,
                "AUTH_TOKEN",
                "/var/run/secrets/kubernetes.io/serviceaccount/token",
            )
        }),
        ("root from another ConfigMap", |r| {
            volume_mut(r, "istiod-ca-cert")
                .config_map
                .as_mut()
                .expect("configMap")
                .name = "istio-root".into()
        }),
        ("root mounted elsewhere", |r| {
            mount_mut(r, "istiod-ca-cert").mount_path = "/etc/istio".into()
        }),
        ("XDS_ROOT_CA the system's", |r| {
            env_push(r, "XDS_ROOT_CA", "SYSTEM")
        }),
        ("CA_ROOT_CA the API server's", |r| {
            env_push(
                r,
                "CA_ROOT_CA",
                "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
            )
        }),
        ("no workingDir", |r| container_mut(r).working_dir = None),
        ("workingDir /tmp", |r| {
            container_mut(r).working_dir = Some("/tmp".into())
        }),
        ("a local config too", |r| {
            env_push(r, "LOCAL_XDS_PATH", "/etc/ztnode/local-config.yaml")
        }),
        ("an env name nothing reads", |r| {
            env_push(r, "ISTIOD_ADDRESS", "istiod.istio-system.svc:15012")
        }),
        ("a ztunnel setting ztnode ignores", |r| {
            env_push(r, "HTTP2_FRAME_SIZE", "65536")
        }),
        ("on-demand xDS", |r| env_push(r, "XDS_ON_DEMAND", "true")),
    ];
    mutations.to_vec()
}
