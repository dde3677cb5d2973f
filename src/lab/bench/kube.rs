//! The Kubernetes-mode figures (`--only kube`): how long a node takes from its start until every
//! labelled pod that already runs is enrolled and annotated, and the `ztnode-cni` ADD time when
//! the plugin asks the API server first (Istio's plugin flow).
//!
//! Its own lab (prefix `<lab prefix>-k`): the fake API server (`../shared/tools/fake-apiserver`, or
//! `ZTNODE_FAKE_APISERVER`) in the node netns, `--pods` pods added through the CNI chain while no
//! agent runs (their namespace is not labelled yet, so the plugin passes them), each seen as a
//! process in a fake procfs; then the namespace is labelled and the node started.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;

use super::measure;
use super::options::BenchOptions;
use super::report::{Figures, Value};
use super::setup::RemoveOnDrop;
use crate::lab::kube::{FAKE_APISERVER_SCRIPT, FakeApi, FakeProc};
use crate::lab::{Lab, LabOptions};

/// The kubelet UID the lab names (no process needs to have it).
const KUBELET_UID: &str = "4242";
/// How many pods are added once the node runs, for the ADD figures.
const ADD_SAMPLES: usize = 20;
/// How long the enrollment may take before the bench gives up.
const ENROLL_TIMEOUT: Duration = Duration::from_secs(300);

/// Creates pod `bench/<name>` in the API server (on `node`), then adds it through the CNI chain.
fn add_api_pod(
    lab: &Lab,
    api: &FakeApi,
    node: &str,
    name: &str,
) -> Result<crate::lab::Pod, crate::lab::LabError> {
    api.create_pod("bench", name, &lab.pod_uid(name), node, "bench", json!({}))?;
    lab.add_pod(name, "bench")
}

/// The fake API server's script, when it is on this machine.
fn script() -> Option<PathBuf> {
    std::env::var_os("ZTNODE_FAKE_APISERVER")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(FAKE_APISERVER_SCRIPT)))
        .filter(|p| p.is_file())
}

/// Measures the section into `figures`; without the fake API server it says so and adds nothing.
pub(super) fn measure(opts: &BenchOptions, figures: &mut Figures) -> anyhow::Result<()> {
    let Some(script) = script() else {
        eprintln!(
            "bench: kube skipped: no fake API server at {FAKE_APISERVER_SCRIPT} (set ZTNODE_FAKE_APISERVER)"
        );
        return Ok(());
    };
    let prefix = format!("{}-k", opts.lab_prefix);
    let dir = std::env::temp_dir().join(format!("ztnode-bench-{prefix}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // Declared first, so dropped last: after the node, the API server and the lab.
    let _dir = RemoveOnDrop(dir.clone());
    let exe = std::env::current_exe()?;
    let lab = Lab::new(LabOptions {
        prefix: prefix.clone(),
        ztnode_binary: Some(exe.clone()),
        run_dir: dir.join("run"),
        subnet: "10.252.0.0/16".into(),
        cni_version: "1.0.0".into(),
    })?;
    let api = FakeApi::start(&lab, &script, &dir, 0, None)?;
    let proc = FakeProc::new(dir.join("proc"))?;
    lab.set_plugin_key("kubeconfig", json!(api.kubeconfig));
    let node_name = lab.node_name().to_owned();
    api.create_namespace("bench", json!({}))?;
    let pods = opts.pods.max(1);
    for i in 0..pods {
        let name = format!("r{i:03}");
        let pod = add_api_pod(&lab, &api, &node_name, &name)?;
        api.set_pod_running("bench", &name, pod.ip)?;
        proc.pod(1000 + i as u32, &pod.uid, &pod.netns_name)?;
    }
    eprintln!(
        "bench: {pods} pods run outside the mesh; labelling their namespace and starting the node"
    );
    api.label_namespace("bench", json!({"istio.io/dataplane-mode": "ambient"}))?;
    let config = dir.join("local-config.yaml");
    std::fs::write(&config, "workloads: []\n")?;
    let level = std::env::var("ZTNODE_BENCH_LOG").unwrap_or_else(|_| "warn".into());
    let args: Vec<std::ffi::OsString> = vec![
        "--no-install".into(),
        "--kubeconfig".into(),
        api.kubeconfig.clone().into(),
        "--node-name".into(),
        node_name.clone().into(),
        "--proc-root".into(),
        proc.root.clone().into(),
        "--kubelet-uid".into(),
        KUBELET_UID.into(),
    ];
    let started = Instant::now();
    let (_node, log) = lab.start_node(&exe, &config, &dir.join("run"), &level, &args)?;
    let enrolled = loop {
        let annotated = api
            .pods("bench")?
            .iter()
            .filter(|p| p["metadata"]["annotations"]["ambient.istio.io/redirection"] == "enabled")
            .count();
        if annotated == pods {
            break started.elapsed();
        }
        anyhow::ensure!(
            started.elapsed() < ENROLL_TIMEOUT,
            "only {annotated} of {pods} pods enrolled after {ENROLL_TIMEOUT:?}; see {}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut add_ms = Vec::new();
    for i in 0..ADD_SAMPLES {
        let name = format!("a{i:03}");
        let pod = add_api_pod(&lab, &api, &node_name, &name)?;
        add_ms.extend(
            pod.add_timings
                .iter()
                .filter(|(plugin, _)| plugin == "ztnode-cni")
                .map(|(_, d)| d.as_secs_f64() * 1e3),
        );
    }
    add_ms.sort_by(f64::total_cmp);
    super::report::keep_log(&opts.json.with_extension("kube.json"), &log);
    figures.values.push(Value::new(
        &format!("kube: {pods} running pods enrolled + annotated (ms)"),
        "kube_enroll_running_pods_ms",
        enrolled.as_secs_f64() * 1e3,
        0,
    ));
    figures.values.push(Value::new(
        "kube: ztnode-cni ADD p50 (ms)",
        "kube_cni_add_p50_ms",
        measure::percentile(&add_ms, 0.5),
        2,
    ));
    figures.values.push(Value::new(
        "kube: ztnode-cni ADD p99 (ms)",
        "kube_cni_add_p99_ms",
        measure::percentile(&add_ms, 0.99),
        2,
    ));
    Ok(())
}
