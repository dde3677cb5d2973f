//! deploy/: the kustomize base and each overlay render with `kubectl kustomize`, every object in
//! the output parses as its typed k8s-openapi struct (an unknown kind, a wrong apiVersion or a
//! field the type does not know fails), and the facts that make the node work hold per platform:
//! the host CNI dirs each overlay names are mounted and passed to the binary, the RBAC is exactly
//! the listed verbs, the downward-API env, /host/proc read-only, hostNetwork, the readiness probe.
//! Each overlay composes with the istiod component (istiod's xDS and CA, wired as Istio's ztunnel
//! chart wires ztunnel) and with the standalone one (a local config), each picking the one
//! workload source as ztnode's own `IstioEnv` decides it, and both together are refused by the
//! binary. Every env name set is one ztnode's sources read or list as ztunnel's.
//! `checks_catch_broken_manifests` and the component tests break each fact in turn and require
//! the checks to fail.
//!
//! Needs kubectl (scripts/setup.sh installs it); without it the kubectl tests fail under `CI` and
//! skip loudly otherwise.

use std::process::Command;

use anyhow::{Context, Result, ensure};

use checks::{check, check_standalone, pod_spec};
use mutations::{assert_caught, assert_caught_by};
use render::{Rendered, kubectl, parse, render, render_dir, render_with};
use source::{Source, check_env_names, check_istiod, check_source, process_env, source_names};

#[path = "deploy/checks.rs"]
mod checks;
#[path = "deploy/mutations.rs"]
mod mutations;
#[path = "deploy/render.rs"]
mod render;
#[path = "deploy/source.rs"]
mod source;

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");

/// istiod trusts `istio-system/ztunnel` as the node proxy's identity (CA_TRUSTED_NODE_ACCOUNTS).
const NAMESPACE: &str = "istio-system";
const SERVICE_ACCOUNT: &str = "ztunnel";
/// The agent skips its own pods by `app=ztnode` or a `ztnode-` name (agent::enroll).
const DAEMONSET: &str = "ztnode";

/// The capabilities of Istio's charts (istio-cni's set, which includes ztunnel's).
const CAPABILITIES: [&str; 5] = [
    "DAC_OVERRIDE",
    "NET_ADMIN",
    "NET_RAW",
    "SYS_ADMIN",
    "SYS_PTRACE",
];

/// What one kustomization must render.
struct Platform {
    /// Kustomization dir under deploy/.
    dir: &'static str,
    /// Host CNI binary dir.
    cni_bin: &'static str,
    /// Host CNI config dir.
    cni_conf: &'static str,
    image: &'static str,
    /// OpenShift: the `privileged` SCC, SELinux type spc_t, Multus's standalone conf and the
    /// NetworkAttachmentDefinition naming it.
    openshift: bool,
    /// GKE: the ResourceQuota that admits system-node-critical outside kube-system.
    gke_quota: bool,
}

const BASE: Platform = Platform {
    dir: "base",
    cni_bin: "/opt/cni/bin",
    cni_conf: "/etc/cni/net.d",
    image: concat!("ghcr.io/ztnode/ztnode:", env!("CARGO_PKG_VERSION")),
    openshift: false,
    gke_quota: false,
};
const KIND: Platform = Platform {
    dir: "overlays/kind",
    image: "ztnode:dev",
    ..BASE
};
const K3S: Platform = Platform {
    dir: "overlays/k3s",
    cni_bin: "/var/lib/rancher/k3s/data/cni",
    cni_conf: "/var/lib/rancher/k3s/agent/etc/cni/net.d",
    ..BASE
};
const GKE: Platform = Platform {
    dir: "overlays/gke",
    cni_bin: "/home/kubernetes/bin",
    gke_quota: true,
    ..BASE
};
const OPENSHIFT: Platform = Platform {
    dir: "overlays/openshift",
    cni_bin: "/var/lib/cni/bin",
    cni_conf: "/etc/cni/multus/net.d",
    openshift: true,
    ..BASE
};
const PLATFORMS: [&Platform; 5] = [&BASE, &KIND, &K3S, &GKE, &OPENSHIFT];

/// The components, as dirs under deploy/.
const STANDALONE: &str = "components/standalone";
const ISTIOD: &str = "components/istiod";
/// What a user adds to an overlay: nothing, or one component.
const CHOICES: [&[&str]; 3] = [&[], &[STANDALONE], &[ISTIOD]];

#[test]
fn base_renders_with_the_facts() -> Result<()> {
    let Some(k) = kubectl("base_renders_with_the_facts") else {
        return Ok(());
    };
    check(&render(&k, &BASE)?, &BASE)
}

#[test]
fn kind_overlay_uses_the_default_paths_and_a_loaded_image() -> Result<()> {
    let Some(k) = kubectl("kind_overlay_uses_the_default_paths_and_a_loaded_image") else {
        return Ok(());
    };
    let r = render(&k, &KIND)?;
    check(&r, &KIND)?;
    let c = &pod_spec(&r.daemon_sets[0])?.containers[0];
    ensure!(
        c.image_pull_policy.as_deref() == Some("IfNotPresent"),
        "a kind-loaded image is never pulled"
    );
    Ok(())
}

#[test]
fn k3s_overlay_mounts_the_k3s_cni_dirs() -> Result<()> {
    let Some(k) = kubectl("k3s_overlay_mounts_the_k3s_cni_dirs") else {
        return Ok(());
    };
    check(&render(&k, &K3S)?, &K3S)
}

#[test]
fn gke_overlay_mounts_home_kubernetes_bin_with_a_quota() -> Result<()> {
    let Some(k) = kubectl("gke_overlay_mounts_home_kubernetes_bin_with_a_quota") else {
        return Ok(());
    };
    check(&render(&k, &GKE)?, &GKE)
}

#[test]
fn openshift_overlay_uses_multus_dirs_scc_and_spc_t() -> Result<()> {
    let Some(k) = kubectl("openshift_overlay_uses_multus_dirs_scc_and_spc_t") else {
        return Ok(());
    };
    check(&render(&k, &OPENSHIFT)?, &OPENSHIFT)
}

#[test]
fn standalone_component_composes_with_every_overlay() -> Result<()> {
    let Some(k) = kubectl("standalone_component_composes_with_every_overlay") else {
        return Ok(());
    };
    let mut k3s = None;
    for p in PLATFORMS {
        let mut r =
            render_with(&k, p, &[STANDALONE]).with_context(|| format!("{} + standalone", p.dir))?;
        check_standalone(&r).with_context(|| format!("{} + standalone", p.dir))?;
        check_env_names(&r).with_context(|| format!("{} + standalone", p.dir))?;
        if p.dir == K3S.dir {
            k3s = Some(r.clone());
        }
        // Everything else is the overlay's own rendering.
        r.config_maps.clear();
        check(&r, p).with_context(|| format!("{} + standalone", p.dir))?;
    }
    assert_caught_by(
        &k3s.context("k3s rendering")?,
        &mutations::standalone(),
        check_standalone,
    )
}

#[test]
fn istiod_component_composes_with_every_overlay() -> Result<()> {
    let Some(k) = kubectl("istiod_component_composes_with_every_overlay") else {
        return Ok(());
    };
    let mut k3s = None;
    for p in PLATFORMS {
        let what = || format!("{} + istiod", p.dir);
        let overlay = render(&k, p)?;
        let r = render_with(&k, p, &[ISTIOD]).with_context(what)?;
        check_istiod(&r, &overlay).with_context(what)?;
        // Everything else is the overlay's own rendering.
        check(&r, p).with_context(what)?;
        if p.dir == K3S.dir {
            k3s = Some((r, overlay));
        }
    }
    let (r, overlay) = k3s.context("k3s rendering")?;
    assert_caught_by(&r, &mutations::istiod(), |r| check_istiod(r, &overlay))
}

/// An overlay alone has no workload source (Kubernetes mode, the built-in CA), each component
/// picks one, and with both `ztnode node` refuses to start.
#[test]
fn each_component_picks_the_one_workload_source() -> Result<()> {
    let Some(k) = kubectl("each_component_picks_the_one_workload_source") else {
        return Ok(());
    };
    for p in PLATFORMS {
        let picks: [(&[&str], Source); 3] = [
            (&[], Source::Empty),
            (&[STANDALONE], Source::LocalConfig),
            (&[ISTIOD], Source::Istiod),
        ];
        for (components, want) in picks {
            let r = render_with(&k, p, components)?;
            check_source(&r, want).with_context(|| format!("{} + {components:?}", p.dir))?;
        }
        for both in [[STANDALONE, ISTIOD], [ISTIOD, STANDALONE]] {
            let what = || format!("{} + {both:?}", p.dir);
            let r = render_with(&k, p, &both).with_context(what)?;
            check_source(&r, Source::Both).with_context(what)?;
            refused_by_the_binary(&r).with_context(what)?;
        }
    }
    let base = render(&k, &BASE)?;
    check_env_names(&base)?;
    assert_caught_by(&base, &mutations::source(), |r| {
        check_source(r, Source::Empty)
    })
}

/// `ztnode node` with the rendering's args and env exits at once, naming both sources. Without
/// KUBERNETES_SERVICE_HOST it stays out of Kubernetes mode, and it refuses before touching the host.
fn refused_by_the_binary(r: &Rendered) -> Result<()> {
    let c = &pod_spec(&r.daemon_sets[0])?.containers[0];
    let mut env = process_env(c)?;
    env.remove("KUBERNETES_SERVICE_HOST");
    let out = Command::new(env!("CARGO_BIN_EXE_ztnode"))
        .env_clear()
        .envs(env)
        .args(c.args.iter().flatten())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.contains("both a local config"),
        "ztnode did not refuse a local config with XDS_ADDRESS: {}\n{stderr}",
        out.status
    );
    Ok(())
}

/// deploy/examples/: each renders as the overlay and component it names, and none is untested.
#[test]
fn examples_are_an_overlay_plus_a_component() -> Result<()> {
    let Some(k) = kubectl("examples_are_an_overlay_plus_a_component") else {
        return Ok(());
    };
    let examples: [(&str, &Platform, &[&str]); 1] = [("kind-istiod", &KIND, &[ISTIOD])];
    let dir = std::path::Path::new(DEPLOY).join("examples");
    let mut found = std::fs::read_dir(&dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<Vec<_>>>()?;
    found.sort();
    let listed: Vec<&str> = examples.iter().map(|(n, _, _)| *n).collect();
    ensure!(
        found == listed,
        "deploy/examples has {found:?}, tested {listed:?}"
    );
    for (name, p, components) in examples {
        let r = render_dir(&k, &dir.join(name))?;
        ensure!(
            r == render_with(&k, p, components)?,
            "{name} is not {} + {components:?}",
            p.dir
        );
    }
    Ok(())
}

/// The env-name lists come out of ztnode's sources as the checks expect.
#[test]
fn env_names_come_from_the_sources() {
    let n = source_names();
    for name in [
        "XDS_ADDRESS",
        "CA_ADDRESS",
        "ISTIO_META_CLUSTER_ID",
        "INSTANCE_IP",
        "TERMINATION_GRACE_PERIOD_SECONDS",
        "CONNECTION_TERMINATION_DEADLINE",
        "INPOD_PORT_REUSE",
    ] {
        assert!(n.read_by_istio_env(name), "{name}");
    }
    assert!(n.read_by_istio_env("ISTIO_META_ENABLE_HBONE"), "by prefix");
    assert!(!n.read_by_istio_env("ISTIO_META_"), "the prefix alone");
    for name in [
        "HOST_PROC",
        "AMBIENT_DNS_CAPTURE",
        "POD_NAMESPACE",
        "RUST_LOG",
    ] {
        assert!(n.read_by_ztnode(name), "{name}");
    }
    for name in ["HTTP2_FRAME_SIZE", "CRL_PATH"] {
        assert!(n.ztunnel_ignored(name), "{name}");
        assert!(!n.read_by_istio_env(name), "{name} is listed, not read");
    }
    for name in ["SERVICE_ACCOUNT", "ISTIOD_ADDRESS", "CHAINED_CNI_PLUGIN"] {
        assert!(
            !n.read_by_ztnode(name) && !n.ztunnel_ignored(name),
            "{name}"
        );
    }
}

/// The container's args are flags `ztnode node` has: an unknown one would crash-loop every node.
#[test]
fn rendered_args_are_flags_of_the_binary() -> Result<()> {
    let Some(k) = kubectl("rendered_args_are_flags_of_the_binary") else {
        return Ok(());
    };
    let accepts = |args: &[String]| -> Result<bool> {
        // clap parses every argument before `--help`, then prints help without requiring --config.
        let out = Command::new(env!("CARGO_BIN_EXE_ztnode"))
            .env_clear()
            .args(args)
            .arg("--help")
            .output()?;
        Ok(out.status.success())
    };
    for p in PLATFORMS {
        for components in CHOICES {
            let what = format!("{} + {components:?}", p.dir);
            let r = render_with(&k, p, components)?;
            let args = pod_spec(&r.daemon_sets[0])?.containers[0]
                .args
                .clone()
                .unwrap_or_default();
            ensure!(accepts(&args)?, "{what}: ztnode rejects {args:?}");
            let mut bad = args.clone();
            bad.push("--no-such-flag".into());
            ensure!(!accepts(&bad)?, "{what}: the check accepts an unknown flag");
        }
    }
    Ok(())
}

#[test]
fn parse_rejects_unknown_kinds_versions_and_fields() {
    let sa = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: a, namespace: b}\n";
    let r = parse(&format!("{sa}---\n{sa}")).expect("two ServiceAccounts parse");
    assert_eq!(r.service_accounts.len(), 2);
    let cases = [
        (
            "unknown kind",
            "apiVersion: v1\nkind: Secret\nmetadata: {name: a}\n",
        ),
        ("no kind", "apiVersion: v1\nmetadata: {name: a}\n"),
        (
            "wrong apiVersion",
            "apiVersion: apps/v1beta2\nkind: DaemonSet\nmetadata: {name: a}\n",
        ),
        (
            "unknown field",
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: a}\nautomount: true\n",
        ),
        (
            "misspelt nested field",
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: a, lables: {x: y}}\n",
        ),
        (
            "unknown NetworkAttachmentDefinition field",
            "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata: {name: a}\nspec: {confg: x}\n",
        ),
    ];
    for (what, yaml) in cases {
        assert!(parse(&format!("{sa}---\n{yaml}")).is_err(), "{what} parsed");
    }
}

/// Each fact the checks assert, broken one at a time in the base's rendering, fails them.
#[test]
fn checks_catch_broken_manifests() -> Result<()> {
    let Some(k) = kubectl("checks_catch_broken_manifests") else {
        return Ok(());
    };
    let base = render(&k, &BASE)?;
    for p in PLATFORMS {
        check_env_names(&render(&k, p)?).with_context(|| p.dir)?;
    }
    assert_caught(&base, &BASE, &mutations::base())?;
    assert_caught(&render(&k, &GKE)?, &GKE, &mutations::gke())?;
    assert_caught(
        &render(&k, &OPENSHIFT)?,
        &OPENSHIFT,
        &mutations::openshift(),
    )?;
    // The platform-specific facts fail on the wrong platform's rendering.
    for p in [&K3S, &GKE, &OPENSHIFT, &KIND] {
        ensure!(check(&base, p).is_err(), "the base passes as {}", p.dir);
        ensure!(
            check(&render(&k, p)?, &BASE).is_err(),
            "{} passes as the base",
            p.dir
        );
    }
    Ok(())
}

/// `ztnode ca init --secret-yaml` prints the Secret the standalone component mounts as the CA
/// dir (its name, the DaemonSet's namespace), holding exactly the two files the proxy loads; two
/// nodes given its contents load the same root. `--out` writes the same files into a dir.
#[test]
fn ca_init_writes_the_secret_the_standalone_component_mounts() -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    use ztnode::proxy::identity::{CA_KEY_FILE, Ca, ROOT_CERT_FILE};
    let Some(k) = kubectl("ca_init_writes_the_secret_the_standalone_component_mounts") else {
        return Ok(());
    };
    let out = Command::new(env!("CARGO_BIN_EXE_ztnode"))
        .args(["ca", "init", "--secret-yaml"])
        .output()?;
    ensure!(
        out.status.success(),
        "ca init: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secret: Secret = serde_yaml_ng::from_slice(&out.stdout).context("a Secret")?;
    let r = render_with(&k, &K3S, &[STANDALONE])?;
    let ds = &r.daemon_sets[0];
    let pod = pod_spec(ds)?;
    let mounted = pod
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.secret.as_ref())
        .context("no Secret volume")?;
    ensure!(secret.metadata.name == mounted.secret_name, "Secret name");
    ensure!(
        secret.metadata.namespace == ds.metadata.namespace,
        "Secret namespace"
    );
    let data = secret.data.context("no data")?;
    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    ensure!(keys == [CA_KEY_FILE, ROOT_CERT_FILE], "keys {keys:?}");
    let tmp = tempfile::tempdir()?;
    let mut roots = Vec::new();
    for node in ["node-a", "node-b"] {
        let dir = tmp.path().join(node);
        std::fs::create_dir(&dir)?;
        for (file, bytes) in &data {
            std::fs::write(dir.join(file), &bytes.0)?;
        }
        roots.push(Ca::load_or_generate(Some(&dir))?.root_pem());
    }
    ensure!(roots[0] == roots[1], "the nodes load different roots");
    ensure!(roots[0].as_bytes() == data[ROOT_CERT_FILE].0.as_slice());

    let dir = tmp.path().join("out");
    let status = Command::new(env!("CARGO_BIN_EXE_ztnode"))
        .args(["ca", "init", "--out"])
        .arg(&dir)
        .status()?;
    ensure!(status.success(), "ca init --out");
    Ca::load_or_generate(Some(&dir))?;
    let again = Command::new(env!("CARGO_BIN_EXE_ztnode"))
        .args(["ca", "init", "--out"])
        .arg(&dir)
        .output()?;
    ensure!(
        again.status.code() == Some(1)
            && String::from_utf8_lossy(&again.stderr).contains("not overwriting"),
        "a second --out overwrote the CA"
    );
    Ok(())
}
