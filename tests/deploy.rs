//! deploy/: the kustomize base and each overlay render with `kubectl kustomize`, every object in
//! the output parses as its typed k8s-openapi struct (an unknown kind, a wrong apiVersion or a
//! field the type does not know fails), and the facts that make the node work hold per platform:
//! the host CNI dirs each overlay names are mounted and passed to the binary, the RBAC is exactly
//! the listed verbs, the downward-API env, /host/proc read-only, hostNetwork, the readiness probe.
//! `checks_catch_broken_manifests` breaks each fact in turn and requires the checks to fail.
//!
//! Needs kubectl (scripts/setup.sh installs it); without it the kubectl tests fail under `CI` and
//! skip loudly otherwise.

use std::process::Command;

use anyhow::{Context, Result, ensure};

use checks::{check, check_standalone, pod_spec};
use mutations::{assert_caught, assert_caught_by};
use render::{kubectl, parse, render, render_standalone};

#[path = "deploy/checks.rs"]
mod checks;
#[path = "deploy/mutations.rs"]
mod mutations;
#[path = "deploy/render.rs"]
mod render;

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
    image: "ghcr.io/ztnode/ztnode:latest",
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
        let mut r = render_standalone(&k, p).with_context(|| format!("{} + standalone", p.dir))?;
        check_standalone(&r).with_context(|| format!("{} + standalone", p.dir))?;
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
        let r = render(&k, p)?;
        let args = pod_spec(&r.daemon_sets[0])?.containers[0]
            .args
            .clone()
            .unwrap_or_default();
        ensure!(accepts(&args)?, "{}: ztnode rejects {args:?}", p.dir);
        let mut bad = args.clone();
        bad.push("--no-such-flag".into());
        ensure!(
            !accepts(&bad)?,
            "{}: the check accepts an unknown flag",
            p.dir
        );
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
