//! The facts each rendering must hold; every check returns the first that does not.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec, Volume, VolumeMount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Subject};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

use super::render::Rendered;
use super::{CAPABILITIES, DAEMONSET, NAMESPACE, Platform, SERVICE_ACCOUNT};

/// An RBAC grant, one verb on one resource (and name): (group, resource, resourceName, verb).
type Grant = (String, String, Option<String>, String);

pub fn check(r: &Rendered, p: &Platform) -> Result<()> {
    check_kinds(r, p)?;
    check_namespace(r)?;
    check_rbac(r, p)?;
    check_daemonset(r, p).context("DaemonSet")?;
    if p.gke_quota {
        check_quota(r)?;
    }
    if p.openshift {
        check_network_attachment(r)?;
    }
    Ok(())
}

fn check_kinds(r: &Rendered, p: &Platform) -> Result<()> {
    let mut want = BTreeMap::from([
        ("ClusterRole", 1),
        ("ClusterRoleBinding", 1),
        ("DaemonSet", 1),
        ("Namespace", 1),
        ("Role", 1),
        ("RoleBinding", 1),
        ("ServiceAccount", 1),
    ]);
    if p.gke_quota {
        want.insert("ResourceQuota", 1);
    }
    if p.openshift {
        want.insert("NetworkAttachmentDefinition", 1);
    }
    let got: BTreeMap<&str, usize> = [
        ("ClusterRole", r.cluster_roles.len()),
        ("ClusterRoleBinding", r.cluster_role_bindings.len()),
        ("ConfigMap", r.config_maps.len()),
        ("DaemonSet", r.daemon_sets.len()),
        ("Namespace", r.namespaces.len()),
        ("NetworkAttachmentDefinition", r.network_attachments.len()),
        ("ResourceQuota", r.resource_quotas.len()),
        ("Role", r.roles.len()),
        ("RoleBinding", r.role_bindings.len()),
        ("ServiceAccount", r.service_accounts.len()),
    ]
    .into_iter()
    .filter(|(_, n)| *n > 0)
    .collect();
    ensure!(got == want, "objects by kind: {got:?}, want {want:?}");
    Ok(())
}

fn check_namespace(r: &Rendered) -> Result<()> {
    let ns = &r.namespaces[0].metadata;
    ensure!(
        ns.name.as_deref() == Some(NAMESPACE),
        "Namespace is {:?}",
        ns.name
    );
    let sa = &r.service_accounts[0].metadata;
    ensure!(
        sa.name.as_deref() == Some(SERVICE_ACCOUNT) && sa.namespace.as_deref() == Some(NAMESPACE),
        "ServiceAccount is {:?}/{:?}, istiod trusts {NAMESPACE}/{SERVICE_ACCOUNT}",
        sa.namespace,
        sa.name
    );
    Ok(())
}

fn grants(rules: &[PolicyRule]) -> Result<BTreeSet<Grant>> {
    let mut out = BTreeSet::new();
    for rule in rules {
        ensure!(
            rule.non_resource_urls.is_none(),
            "nonResourceURLs in {rule:?}"
        );
        let names: Vec<Option<String>> = match &rule.resource_names {
            Some(n) => n.iter().cloned().map(Some).collect(),
            None => vec![None],
        };
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for name in &names {
                    for verb in &rule.verbs {
                        out.insert((group.clone(), resource.clone(), name.clone(), verb.clone()));
                    }
                }
            }
        }
    }
    Ok(out)
}

fn grant(group: &str, resource: &str, name: Option<&str>, verb: &str) -> Grant {
    (
        group.into(),
        resource.into(),
        name.map(Into::into),
        verb.into(),
    )
}

/// A binding's roleRef group and its one subject, the node's ServiceAccount.
fn check_binding(api_group: &str, subjects: Option<&Vec<Subject>>) -> Result<()> {
    ensure!(
        api_group == "rbac.authorization.k8s.io",
        "roleRef apiGroup {api_group}"
    );
    let subjects = subjects.context("no subjects")?;
    ensure!(subjects.len() == 1, "subjects {subjects:?}");
    let s = &subjects[0];
    ensure!(
        s.kind == "ServiceAccount"
            && s.name == SERVICE_ACCOUNT
            && s.namespace.as_deref() == Some(NAMESPACE),
        "subject {s:?} is not ServiceAccount {NAMESPACE}/{SERVICE_ACCOUNT}"
    );
    Ok(())
}

fn check_rbac(r: &Rendered, p: &Platform) -> Result<()> {
    // Cluster-wide: the node's pods and the namespaces' labels, the enrollment annotation.
    let cr = &r.cluster_roles[0];
    ensure!(cr.aggregation_rule.is_none(), "ClusterRole aggregates");
    let mut want: BTreeSet<Grant> = ["get", "list", "watch"]
        .iter()
        .flat_map(|v| [grant("", "pods", None, v), grant("", "namespaces", None, v)])
        .collect();
    want.insert(grant("", "pods/status", None, "patch"));
    // On SIGTERM: does the DaemonSet's node selection still take this node?
    want.insert(grant("", "nodes", None, "get"));
    if p.openshift {
        let scc = "securitycontextconstraints";
        want.insert(grant(
            "security.openshift.io",
            scc,
            Some("privileged"),
            "use",
        ));
    }
    let got = grants(cr.rules.as_deref().unwrap_or_default())?;
    ensure!(got == want, "ClusterRole grants {got:?}\nwant {want:?}");

    let crb = &r.cluster_role_bindings[0];
    let rr = &crb.role_ref;
    ensure!(
        rr.kind == "ClusterRole" && Some(&rr.name) == cr.metadata.name.as_ref(),
        "ClusterRoleBinding refers to {} {}",
        rr.kind,
        rr.name
    );
    check_binding(&rr.api_group, crb.subjects.as_ref()).context("ClusterRoleBinding")?;

    // Namespaced: its own DaemonSet, by name, in its own namespace.
    let role = &r.roles[0];
    ensure!(
        role.metadata.namespace.as_deref() == Some(NAMESPACE),
        "Role namespace"
    );
    let got = grants(role.rules.as_deref().unwrap_or_default())?;
    let want = BTreeSet::from([grant("apps", "daemonsets", Some(DAEMONSET), "get")]);
    ensure!(got == want, "Role grants {got:?}\nwant {want:?}");
    let rb = &r.role_bindings[0];
    ensure!(
        rb.metadata.namespace == role.metadata.namespace,
        "RoleBinding namespace"
    );
    let rr = &rb.role_ref;
    ensure!(
        rr.kind == "Role" && Some(&rr.name) == role.metadata.name.as_ref(),
        "RoleBinding refers to {} {}",
        rr.kind,
        rr.name
    );
    check_binding(&rr.api_group, rb.subjects.as_ref()).context("RoleBinding")
}

pub fn pod_spec(ds: &DaemonSet) -> Result<&PodSpec> {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("no pod spec")
}

/// The value of `--flag V` or `--flag=V`, which must be given once.
fn flag<'a>(args: &'a [String], name: &str) -> Result<&'a str> {
    let mut found = Vec::new();
    for (i, a) in args.iter().enumerate() {
        if a == name {
            found.push(
                args.get(i + 1)
                    .with_context(|| format!("{name} without a value"))?
                    .as_str(),
            );
        } else if let Some(v) = a.strip_prefix(name).and_then(|v| v.strip_prefix('=')) {
            found.push(v);
        }
    }
    ensure!(
        found.len() == 1,
        "{name} given {} times in {args:?}",
        found.len()
    );
    Ok(found[0])
}

/// The one hostPath volume of `host` and its one mount in `c`.
fn host_mount<'a>(
    pod: &'a PodSpec,
    c: &'a Container,
    host: &str,
) -> Result<(&'a Volume, &'a VolumeMount)> {
    let vols: Vec<&Volume> = pod
        .volumes
        .iter()
        .flatten()
        .filter(|v| v.host_path.as_ref().is_some_and(|h| h.path == host))
        .collect();
    ensure!(vols.len() == 1, "{} hostPath volumes of {host}", vols.len());
    let mounts: Vec<&VolumeMount> = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.name == vols[0].name)
        .collect();
    ensure!(
        mounts.len() == 1,
        "host {host}: {} mounts of volume {}",
        mounts.len(),
        vols[0].name
    );
    Ok((vols[0], mounts[0]))
}

/// The one env var `name` of `c`, as (value, fieldRef path).
pub fn env<'a>(c: &'a Container, name: &str) -> Result<(Option<&'a str>, Option<&'a str>)> {
    let vars: Vec<_> = c.env.iter().flatten().filter(|e| e.name == name).collect();
    ensure!(vars.len() == 1, "env {name} set {} times", vars.len());
    let field = vars[0]
        .value_from
        .as_ref()
        .and_then(|f| f.field_ref.as_ref());
    Ok((
        vars[0].value.as_deref(),
        field.map(|f| f.field_path.as_str()),
    ))
}

fn check_daemonset(r: &Rendered, p: &Platform) -> Result<()> {
    let ds = &r.daemon_sets[0];
    ensure!(
        ds.metadata.name.as_deref() == Some(DAEMONSET)
            && ds.metadata.namespace.as_deref() == Some(NAMESPACE),
        "is {:?}/{:?}",
        ds.metadata.namespace,
        ds.metadata.name
    );
    let spec = ds.spec.as_ref().context("no spec")?;
    let labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref());
    let labels = labels.context("no pod labels")?;
    for (k, v) in spec.selector.match_labels.iter().flatten() {
        ensure!(
            labels.get(k) == Some(v),
            "selector {k}={v} does not match the pod labels"
        );
    }
    ensure!(
        labels.get("app").map(String::as_str) == Some(DAEMONSET),
        "pod label app"
    );
    let never = labels.get("istio.io/dataplane-mode").map(String::as_str);
    ensure!(
        never == Some("none"),
        "pod label istio.io/dataplane-mode is {never:?}"
    );

    let strategy = spec.update_strategy.as_ref().context("no updateStrategy")?;
    ensure!(
        strategy.type_.as_deref() == Some("RollingUpdate"),
        "updateStrategy {strategy:?}"
    );
    // Istio's ztunnel chart: surge one new pod beside the old, which stays until the new one is
    // ready (the hand-over needs both processes at once).
    let unavailable = strategy
        .rolling_update
        .as_ref()
        .and_then(|r| r.max_unavailable.as_ref());
    ensure!(
        unavailable == Some(&IntOrString::Int(0)),
        "maxUnavailable {unavailable:?}"
    );
    let surge = strategy
        .rolling_update
        .as_ref()
        .and_then(|r| r.max_surge.as_ref());
    ensure!(surge == Some(&IntOrString::Int(1)), "maxSurge {surge:?}");

    let pod = pod_spec(ds)?;
    ensure!(
        pod.host_network == Some(true),
        "hostNetwork {:?}",
        pod.host_network
    );
    let dns = pod.dns_policy.as_deref();
    ensure!(
        dns == Some("ClusterFirstWithHostNet"),
        "dnsPolicy {dns:?} (istiod's name from the host netns)"
    );
    let sa = pod.service_account_name.as_deref();
    ensure!(sa == Some(SERVICE_ACCOUNT), "serviceAccountName {sa:?}");
    ensure!(
        pod.automount_service_account_token == Some(true),
        "the pod does not ask for its API token: {:?}",
        pod.automount_service_account_token
    );
    let sa = r.service_accounts.first().context("no ServiceAccount")?;
    ensure!(
        sa.automount_service_account_token == Some(false),
        "the ServiceAccount mounts its token into every pod: {:?}",
        sa.automount_service_account_token
    );
    let prio = pod.priority_class_name.as_deref();
    ensure!(
        prio == Some("system-node-critical"),
        "priorityClassName {prio:?}"
    );
    let all =
        pod.tolerations.iter().flatten().any(|t| {
            t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()
        });
    ensure!(all, "no toleration of every taint in {:?}", pod.tolerations);
    let grace = pod.termination_grace_period_seconds;
    ensure!(grace == Some(30), "terminationGracePeriodSeconds {grace:?}");
    let os = pod
        .node_selector
        .as_ref()
        .and_then(|s| s.get("kubernetes.io/os"));
    ensure!(
        os.map(String::as_str) == Some("linux"),
        "nodeSelector kubernetes.io/os {os:?}"
    );

    ensure!(
        pod.containers.len() == 1,
        "{} containers",
        pod.containers.len()
    );
    ensure!(pod.init_containers.is_none(), "init containers");
    let c = &pod.containers[0];
    ensure!(
        c.image.as_deref() == Some(p.image),
        "image {:?}, want {}",
        c.image,
        p.image
    );
    ensure!(
        !p.image.ends_with(":latest") && p.image.contains(':'),
        "image {} is not pinned to a version",
        p.image
    );
    let pull = c.image_pull_policy.as_deref();
    ensure!(pull == Some("IfNotPresent"), "imagePullPolicy {pull:?}");
    // hostNetwork makes every declared containerPort a host port, which the old pod holds: the
    // surge pod would never be scheduled.
    ensure!(
        c.ports.as_ref().is_none_or(|p| p.is_empty()),
        "ports declared ({:?}): host ports under hostNetwork block the surge pod",
        c.ports
    );
    let annotations = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref());
    let apparmor = annotations.and_then(|a| {
        a.get(&format!(
            "container.apparmor.security.beta.kubernetes.io/{}",
            c.name
        ))
    });
    ensure!(
        apparmor.map(String::as_str) == Some("unconfined"),
        "AppArmor annotation for {} is {apparmor:?} (istio-cni's chart: unconfined)",
        c.name
    );
    check_resources(c)?;
    check_host_mounts(pod, c, p)?;
    check_env(c, p)?;
    check_probe(c)?;
    check_security(c, p)?;
    Ok(())
}

fn check_host_mounts(pod: &PodSpec, c: &Container, p: &Platform) -> Result<()> {
    let hosts: BTreeSet<&str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.as_str()))
        .collect();
    let want = BTreeSet::from([
        p.cni_bin,
        p.cni_conf,
        "/var/run/ztnode",
        "/var/run/netns",
        "/proc",
        "/var/run/ztunnel",
    ]);
    ensure!(hosts == want, "hostPath volumes {hosts:?}, want {want:?}");

    let args = c.args.as_deref().context("no args")?;
    ensure!(
        c.command.is_none(),
        "command overrides the image's entrypoint"
    );
    ensure!(
        args.first().map(String::as_str) == Some("node"),
        "args {args:?} do not run `ztnode node`"
    );
    // The host dirs the overlay names, mounted writable, at the paths the binary is given.
    for (flag_name, host) in [("--cni-bin-dir", p.cni_bin), ("--cni-conf-dir", p.cni_conf)] {
        let (_, m) = host_mount(pod, c, host)?;
        let arg = flag(args, flag_name)?;
        ensure!(
            arg == m.mount_path,
            "{flag_name} {arg}, but host {host} is mounted at {}",
            m.mount_path
        );
        ensure!(m.read_only != Some(true), "{host} mounted read-only");
    }
    // The plugin on the host dials <run dir>/pluginevent.sock: same path on both sides.
    let (_, m) = host_mount(pod, c, "/var/run/ztnode")?;
    ensure!(
        m.mount_path == "/var/run/ztnode",
        "run dir mounted at {}",
        m.mount_path
    );
    ensure!(flag(args, "--run-dir")? == "/var/run/ztnode", "--run-dir");
    ensure!(m.read_only != Some(true), "run dir read-only");
    // Pod netns are opened by the runtime's path; new ones must propagate in.
    let (_, m) = host_mount(pod, c, "/var/run/netns")?;
    ensure!(
        m.mount_path == "/var/run/netns",
        "netns dir mounted at {}",
        m.mount_path
    );
    let prop = m.mount_propagation.as_deref();
    ensure!(
        prop == Some("HostToContainer"),
        "netns dir mountPropagation {prop:?}"
    );
    // The netns finder reads the host's processes, and only reads.
    let (v, m) = host_mount(pod, c, "/proc")?;
    ensure!(
        m.mount_path == "/host/proc",
        "host /proc mounted at {}",
        m.mount_path
    );
    ensure!(
        m.read_only == Some(true),
        "/host/proc readOnly {:?}",
        m.read_only
    );
    let ty = v.host_path.as_ref().and_then(|h| h.type_.as_deref());
    ensure!(ty == Some("Directory"), "host /proc hostPath type {ty:?}");
    let (_, m) = host_mount(pod, c, "/var/run/ztunnel")?;
    ensure!(
        m.mount_path == "/var/run/ztunnel",
        "ZDS dir mounted at {}",
        m.mount_path
    );
    Ok(())
}

fn check_env(c: &Container, p: &Platform) -> Result<()> {
    let names: Vec<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
    let unique: BTreeSet<&str> = names.iter().copied().collect();
    ensure!(
        unique.len() == names.len(),
        "an env var is set twice: {names:?}"
    );
    for (name, path) in [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        let (value, field) = env(c, name)?;
        ensure!(
            value.is_none() && field == Some(path),
            "{name} is {value:?} / fieldRef {field:?}, want {path}"
        );
    }
    // DNS capture is opt-in in the shipped manifests (the DNS proxy on 15053 is always served).
    ensure!(
        env(c, "AMBIENT_DNS_CAPTURE")?.0 == Some("false"),
        "AMBIENT_DNS_CAPTURE"
    );
    if p.openshift {
        ensure!(
            env(c, "CHAINED_CNI_PLUGIN")?.0 == Some("false"),
            "CHAINED_CNI_PLUGIN"
        );
        ensure!(
            env(c, "CNI_CONF_NAME")?.0 == Some("istio-cni.conf"),
            "CNI_CONF_NAME"
        );
    } else {
        ensure!(
            !unique.contains("CHAINED_CNI_PLUGIN"),
            "CHAINED_CNI_PLUGIN off OpenShift"
        );
    }
    Ok(())
}

fn check_resources(c: &Container) -> Result<()> {
    let res = c.resources.as_ref().context("no resources")?;
    let requests = res.requests.as_ref().context("no resource requests")?;
    for r in ["cpu", "memory"] {
        ensure!(requests.contains_key(r), "no {r} request");
    }
    ensure!(
        res.limits.as_ref().is_none_or(|l| l.is_empty()),
        "limits {:?}: a throttled or killed proxy cuts every pod's traffic",
        res.limits
    );
    Ok(())
}

fn check_probe(c: &Container) -> Result<()> {
    let get = c.readiness_probe.as_ref().and_then(|p| p.http_get.as_ref());
    let get = get.context("no readiness httpGet")?;
    ensure!(
        get.path.as_deref() == Some("/healthz/ready"),
        "readiness path {:?}",
        get.path
    );
    ensure!(
        get.port == IntOrString::Int(15021),
        "readiness port {:?}",
        get.port
    );
    ensure!(
        get.host.is_none() && get.scheme.is_none(),
        "readiness host/scheme {get:?}"
    );
    let live = c.liveness_probe.as_ref().context("no liveness probe")?;
    let get = live
        .http_get
        .as_ref()
        .context("liveness is not an httpGet")?;
    ensure!(
        get.path.as_deref() == Some("/metrics") && get.port == IntOrString::Int(15020),
        "liveness {get:?}: want the stats port, which answers from start to exit"
    );
    ensure!(
        get.host.is_none() && get.scheme.is_none(),
        "liveness host/scheme {get:?}"
    );
    let within = live.timeout_seconds.unwrap_or(1);
    ensure!(
        within >= 2,
        "liveness timeout {within} s: a busy proxy would be restarted"
    );
    Ok(())
}

fn check_security(c: &Container, p: &Platform) -> Result<()> {
    let sc = c.security_context.as_ref().context("no securityContext")?;
    ensure!(
        sc.privileged != Some(true),
        "privileged: the capabilities below are the grant"
    );
    ensure!(sc.run_as_user == Some(0), "runAsUser {:?}", sc.run_as_user);
    let caps = sc.capabilities.as_ref().context("no capabilities")?;
    let drop: Vec<&str> = caps.drop.iter().flatten().map(String::as_str).collect();
    ensure!(drop == ["ALL"], "capabilities drop {drop:?}");
    let add: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    ensure!(
        add == BTreeSet::from(CAPABILITIES),
        "capabilities add {add:?}, want {CAPABILITIES:?}"
    );
    let apparmor = sc.app_armor_profile.as_ref().map(|a| a.type_.as_str());
    ensure!(
        apparmor == Some("Unconfined"),
        "appArmorProfile {apparmor:?} (must agree with the annotation)"
    );
    let selinux = sc
        .se_linux_options
        .as_ref()
        .and_then(|s| s.type_.as_deref());
    let want = p.openshift.then_some("spc_t");
    ensure!(
        selinux == want,
        "seLinuxOptions type {selinux:?}, want {want:?}"
    );
    Ok(())
}

fn check_quota(r: &Rendered) -> Result<()> {
    let q = &r.resource_quotas[0];
    ensure!(
        q.metadata.namespace.as_deref() == Some(NAMESPACE),
        "ResourceQuota namespace"
    );
    let spec = q.spec.as_ref().context("ResourceQuota spec")?;
    let exprs = spec
        .scope_selector
        .as_ref()
        .and_then(|s| s.match_expressions.as_ref());
    let ok = exprs.iter().copied().flatten().any(|e| {
        e.scope_name == "PriorityClass"
            && e.operator == "In"
            && e.values.as_deref() == Some(&["system-node-critical".to_owned()])
    });
    ensure!(
        ok,
        "ResourceQuota does not scope PriorityClass system-node-critical: {spec:?}"
    );
    ensure!(
        spec.hard.as_ref().is_some_and(|h| h.contains_key("pods")),
        "ResourceQuota hard pods"
    );
    Ok(())
}

fn check_network_attachment(r: &Rendered) -> Result<()> {
    let n = &r.network_attachments[0];
    ensure!(
        n.metadata.name.as_deref() == Some("istio-cni")
            && n.metadata.namespace.as_deref() == Some("default"),
        "NetworkAttachmentDefinition {:?}",
        n.metadata
    );
    Ok(())
}

/// The standalone component: a local config in a ConfigMap, read from where it is mounted.
pub fn check_standalone(r: &Rendered) -> Result<()> {
    ensure!(
        r.config_maps.len() == 1,
        "{} ConfigMaps",
        r.config_maps.len()
    );
    let cm = &r.config_maps[0];
    ensure!(
        cm.metadata.namespace.as_deref() == Some(NAMESPACE),
        "ConfigMap namespace"
    );
    let pod = pod_spec(&r.daemon_sets[0])?;
    let c = &pod.containers[0];
    let (path, _) = env(c, "LOCAL_XDS_PATH")?;
    let path = Path::new(path.context("LOCAL_XDS_PATH has no value")?);
    let (dir, key) = (
        path.parent().context("path")?,
        path.file_name().context("path")?,
    );
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir);
    let m = m.with_context(|| format!("nothing mounted at {}", dir.display()))?;
    ensure!(
        m.read_only == Some(true),
        "local config mount readOnly {:?}",
        m.read_only
    );
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == m.name)
        .context("mount's volume")?;
    let src = v
        .config_map
        .as_ref()
        .context("local config volume is not a ConfigMap")?;
    ensure!(
        Some(&src.name) == cm.metadata.name.as_ref(),
        "volume names ConfigMap {}",
        src.name
    );
    let text = cm
        .data
        .as_ref()
        .and_then(|d| d.get(&*key.to_string_lossy()));
    let text = text.with_context(|| format!("ConfigMap has no key {key:?}"))?;
    let config: Value = serde_yaml_ng::from_str(text)?;
    for field in ["workloads", "services", "policies"] {
        ensure!(config[field].is_array(), "local config {field}");
    }
    check_ca_secret(pod, c)
}

/// The proxy's `--ca-dir` is the Secret `ztnode ca init` writes, read-only and required: every
/// node loads the same root.
fn check_ca_secret(pod: &PodSpec, c: &Container) -> Result<()> {
    let args = c.args.as_deref().unwrap_or_default();
    let dir = flag(args, "--ca-dir")?;
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == dir);
    let m = m.with_context(|| format!("nothing mounted at the CA dir {dir}"))?;
    ensure!(
        m.read_only == Some(true),
        "CA mount readOnly {:?}",
        m.read_only
    );
    ensure!(m.sub_path.is_none(), "CA mount has a subPath");
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == m.name)
        .context("CA mount's volume")?;
    let secret = v.secret.as_ref().context("the CA dir is not a Secret")?;
    ensure!(
        secret.secret_name.as_deref() == Some(ztnode::node::ca_init::CA_SECRET_NAME),
        "CA Secret {:?}, `ztnode ca init` writes {}",
        secret.secret_name,
        ztnode::node::ca_init::CA_SECRET_NAME
    );
    ensure!(
        secret.optional != Some(true),
        "CA Secret optional: a node without it would make its own root"
    );
    ensure!(secret.items.is_none(), "CA Secret items select keys");
    Ok(())
}
