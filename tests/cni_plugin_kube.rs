//! The CNI plugin in Kubernetes mode, end to end: the real binary (as `ztnode-cni`), the shared fake
//! API server and a fake node agent. The plugin classifies each pod with the API server like
//! istio-cni (`../shared/spec/istio-cni.md` §1.4): pods that are not ambient pass through even when
//! the agent is down; ambient pods fail closed when the agent cannot enroll them.

#[path = "common/fake_apiserver.rs"]
mod fake_apiserver;
#[path = "common/plugin_agent.rs"]
mod plugin_agent;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::{Value, json};
use ztnode::agent::install::{self, InstallConfig, KubeconfigSource, PLUGIN_TYPE, PluginKube};

use fake_apiserver::FakeApiServer;
use plugin_agent::FakeAgent;

const NETNS: &str = "/var/run/netns/cni-7d1e2f3a-kube";
const AMBIENT: &str = "istio.io/dataplane-mode";

/// The plugin binary under its installed name, in a temp bin dir.
struct Plugin {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

/// One run of the plugin.
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Plugin {
    fn new() -> Plugin {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ztnode-cni");
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ztnode"), &path).expect("symlink");
        Plugin { _dir: dir, path }
    }

    /// Runs `cmd` for pod `namespace/name` with `stdin`.
    fn run(&self, cmd: &str, namespace: &str, name: &str, stdin: &str) -> Outcome {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};\
             K8S_POD_INFRA_CONTAINER_ID=ctr-1;K8S_POD_UID=uid-{name}"
        );
        let mut child = Command::new(&self.path)
            .env_clear()
            .env("CNI_COMMAND", cmd)
            .env("CNI_CONTAINERID", "ctr-1")
            .env("CNI_NETNS", NETNS)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/opt/cni/bin")
            .env("CNI_ARGS", args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ztnode-cni");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(stdin.as_bytes())
            .expect("write stdin");
        let out = child.wait_with_output().expect("wait");
        Outcome {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn add(&self, namespace: &str, name: &str, stdin: &str) -> Outcome {
        self.run("ADD", namespace, name, stdin)
    }
}

impl Outcome {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {:?} / {}",
                self.stdout, self.stderr
            )
        })
    }

    /// Asserts success with `prev` printed unchanged.
    fn expect_passthrough(&self, prev: &Value) {
        assert_eq!(
            self.code,
            Some(0),
            "stdout {} stderr {}",
            self.stdout,
            self.stderr
        );
        assert_eq!(&self.json(), prev, "prevResult unchanged");
    }

    /// Asserts a CNI error (exit 1, `code`, `msg` on stdout) and returns the message.
    fn expect_error(&self, code: u64) -> String {
        assert_eq!(
            self.code,
            Some(1),
            "stdout {} stderr {}",
            self.stdout,
            self.stderr
        );
        let v = self.json();
        assert_eq!(v["code"], code, "{v}");
        assert_eq!(v["cniVersion"], "1.0.0", "{v}");
        v["msg"].as_str().expect("msg is a string").to_owned()
    }
}

/// The bridge plugin's result for the pod, as prevResult.
fn prev_result() -> Value {
    json!({"cniVersion": "1.0.0",
           "interfaces": [{"name": "eth0", "mac": "0a:58:0a:f4:01:07", "sandbox": NETNS}],
           "ips": [{"interface": 0, "address": "10.244.1.7/24", "gateway": "10.244.1.1"}],
           "routes": [{"dst": "0.0.0.0/0"}], "dns": {}})
}

/// A Kubernetes-mode config for the plugin with `extra` keys.
fn conf(run_dir: &Path, kubeconfig: &Path, extra: Value) -> String {
    let mut c = json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": PLUGIN_TYPE,
                       "cni_agent_run_dir": run_dir, "exclude_namespaces": ["kube-system"],
                       "kubeconfig": kubeconfig, "ztnode_namespace": "ztnode-system",
                       "prevResult": prev_result()});
    if let (Some(c), Value::Object(e)) = (c.as_object_mut(), extra) {
        c.extend(e);
    }
    c.to_string()
}

/// A server with namespaces `plain` (no labels) and `mesh` (ambient), and pods in them.
fn cluster() -> FakeApiServer {
    let api = FakeApiServer::start();
    api.create_namespace("plain", json!({}));
    api.create_namespace("mesh", json!({AMBIENT: "ambient"}));
    api.create_pod("plain", "web", json!({}), json!({}));
    api.create_pod(
        "plain",
        "opted-in",
        json!({"labels": {AMBIENT: "ambient"}}),
        json!({}),
    );
    api.create_pod("mesh", "web", json!({}), json!({}));
    api.create_pod(
        "mesh",
        "opted-out",
        json!({"labels": {AMBIENT: "none"}}),
        json!({}),
    );
    api.create_pod(
        "mesh",
        "injected",
        json!({"annotations": {"sidecar.istio.io/status": "{}"}}),
        json!({}),
    );
    api.create_pod("mesh", "hostnet", json!({}), json!({"hostNetwork": true}));
    api.create_pod(
        "kube-system",
        "coredns",
        json!({"labels": {AMBIENT: "ambient"}}),
        json!({}),
    );
    api
}

fn empty_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

// (a)
#[test]
fn unlabelled_pod_passes_through_with_no_agent() {
    let api = cluster();
    let dead = empty_dir();
    let out = Plugin::new().add(
        "plain",
        "web",
        &conf(dead.path(), &api.kubeconfig(), json!({})),
    );
    out.expect_passthrough(&prev_result());
    let gets = api.requests_under("/api/v1/namespaces/plain");
    let paths: Vec<&str> = gets
        .iter()
        .filter(|r| r["method"] == "GET")
        .filter_map(|r| r["path"].as_str())
        .collect();
    assert!(
        paths.contains(&"/api/v1/namespaces/plain/pods/web"),
        "{paths:?}"
    );
    assert!(paths.contains(&"/api/v1/namespaces/plain"), "{paths:?}");
}

// (b)
#[test]
fn pod_in_ambient_namespace_fails_closed_with_no_agent() {
    let api = cluster();
    let dead = empty_dir();
    let out = Plugin::new().add(
        "mesh",
        "web",
        &conf(dead.path(), &api.kubeconfig(), json!({})),
    );
    let msg = out.expect_error(11);
    assert!(msg.contains("mesh/web"), "{msg}");
    let socket = dead.path().join("pluginevent.sock");
    assert!(msg.contains(&socket.display().to_string()), "{msg}");
}

// (c)
#[test]
fn ambient_pods_are_sent_to_the_agent() {
    let api = cluster();
    let agent = FakeAgent::start(200, "");
    let plugin = Plugin::new();
    let stdin = conf(agent.run_dir(), &api.kubeconfig(), json!({}));
    plugin
        .add("mesh", "web", &stdin)
        .expect_passthrough(&prev_result());
    // Pod label `ambient` enrolls in an unlabelled namespace too.
    plugin
        .add("plain", "opted-in", &stdin)
        .expect_passthrough(&prev_result());
    let reqs = agent.requests();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    let ev = reqs[0].json();
    assert_eq!(
        (reqs[0].method.as_str(), reqs[0].path.as_str()),
        ("POST", "/cmdadd")
    );
    assert_eq!(reqs[0].content_type.as_deref(), Some("application/json"));
    assert_eq!(
        (
            ev["PodNamespace"].as_str(),
            ev["PodName"].as_str(),
            ev["PodUid"].as_str()
        ),
        (Some("mesh"), Some("web"), Some("uid-web"))
    );
    assert_eq!(ev["Netns"], NETNS);
    assert_eq!(ev["IPs"][0]["Address"]["IP"], "10.244.1.7");
    assert_eq!(reqs[1].json()["PodName"], "opted-in");

    // The agent failing to enroll fails ADD (fail closed) with its text.
    let failing = FakeAgent::start(500, "no ztunnel connection");
    let stdin = conf(failing.run_dir(), &api.kubeconfig(), json!({}));
    let msg = plugin.add("mesh", "web", &stdin).expect_error(11);
    assert!(msg.contains("no ztunnel connection"), "{msg}");
}

// (d)
#[test]
fn opted_out_injected_and_host_network_pods_skip_the_agent() {
    let api = cluster();
    let agent = FakeAgent::start(200, "");
    let plugin = Plugin::new();
    let mut c = conf(agent.run_dir(), &api.kubeconfig(), json!({}));
    for name in ["opted-out", "injected", "hostnet"] {
        plugin
            .add("mesh", name, &c)
            .expect_passthrough(&prev_result());
    }
    assert_eq!(agent.requests().len(), 0, "the agent was never contacted");

    // An empty selector list (set but "") enrolls nothing, not even ambient namespaces.
    c = conf(
        agent.run_dir(),
        &api.kubeconfig(),
        json!({"ambient_enablement_selector": ""}),
    );
    plugin
        .add("mesh", "web", &c)
        .expect_passthrough(&prev_result());
    assert_eq!(agent.requests().len(), 0);
}

// (e)
#[test]
fn excluded_namespaces_and_own_pods_pass_before_any_api_call() {
    let api = cluster();
    let dead = empty_dir();
    let plugin = Plugin::new();
    let stdin = conf(dead.path(), &api.kubeconfig(), json!({}));
    plugin
        .add("kube-system", "coredns", &stdin)
        .expect_passthrough(&prev_result());
    let custom = conf(
        dead.path(),
        &api.kubeconfig(),
        json!({"exclude_namespaces": ["mesh"]}),
    );
    plugin
        .add("mesh", "web", &custom)
        .expect_passthrough(&prev_result());
    for prefix in ["/api/v1/namespaces/kube-system", "/api/v1/namespaces/mesh"] {
        let gets: Vec<Value> = api
            .requests_under(prefix)
            .into_iter()
            .filter(|r| r["method"] == "GET")
            .collect();
        assert!(gets.is_empty(), "no API call for excluded pods: {gets:?}");
    }

    // ztnode's own pods pass by name even when the kubeconfig is missing (node reboot, spec §1.4
    // step 3); with `ztnode_namespace` unset the agent's default namespace applies.
    let missing = dead.path().join("ztnode-cni-kubeconfig");
    let c = conf(
        dead.path(),
        &missing,
        json!({"ztnode_namespace": "mesh-system"}),
    );
    plugin
        .add("mesh-system", "ztnode-x7k2p", &c)
        .expect_passthrough(&prev_result());
    let mut v: Value = serde_json::from_str(&conf(dead.path(), &missing, json!({}))).expect("json");
    v.as_object_mut()
        .expect("object")
        .remove("ztnode_namespace");
    plugin
        .add(
            ztnode::agent::enroll::DEFAULT_OWN_NAMESPACE,
            "ztnode-abcde",
            &v.to_string(),
        )
        .expect_passthrough(&prev_result());
}

// (f)
#[test]
fn unreadable_kubeconfig_is_a_clear_error() {
    let dead = empty_dir();
    let plugin = Plugin::new();
    let missing = dead.path().join("ztnode-cni-kubeconfig");
    let msg = plugin
        .add("plain", "web", &conf(dead.path(), &missing, json!({})))
        .expect_error(11);
    assert!(msg.contains("kubeconfig"), "{msg}");
    assert!(msg.contains(&missing.display().to_string()), "{msg}");
    assert!(msg.contains("plain/web"), "{msg}");

    let garbage = dead.path().join("garbage");
    std::fs::write(&garbage, "clusters: [not: a kubeconfig").expect("write");
    let msg = plugin
        .add("plain", "web", &conf(dead.path(), &garbage, json!({})))
        .expect_error(11);
    assert!(msg.contains(&garbage.display().to_string()), "{msg}");

    // A selector that does not parse is a config error (code 7) naming the key.
    let api_less = conf(
        dead.path(),
        &missing,
        json!({"ambient_enablement_selector": "- podSelectr: {}"}),
    );
    let out = plugin.add("plain", "web", &api_less);
    let msg = out.expect_error(7);
    assert!(msg.contains("ambient_enablement_selector"), "{msg}");
}

// (g)
#[test]
fn api_server_down_fails_closed() {
    let mut api = FakeApiServer::start();
    let kubeconfig = api.kubeconfig();
    api.stop();
    let agent = FakeAgent::start(200, "");
    let plugin = Plugin::new();
    let stdin = conf(agent.run_dir(), &kubeconfig, json!({}));
    let started = Instant::now();
    let msg = plugin.add("plain", "web", &stdin).expect_error(11);
    assert!(msg.contains("API server"), "{msg}");
    assert!(msg.contains("plain/web"), "{msg}");
    assert!(
        started.elapsed().as_secs() < 5,
        "refused connections fail fast"
    );
    assert_eq!(agent.requests().len(), 0, "an unclassified pod is not sent");

    // DEL keeps today's behaviour: no API lookup, the agent is told, success.
    let del = plugin.run("DEL", "plain", "web", &stdin);
    assert_eq!(del.code, Some(0), "{}", del.stderr);
    assert_eq!(del.stdout, "");
    assert_eq!(agent.requests().len(), 1);
    assert_eq!(agent.requests()[0].path, "/cmddel");
}

/// The entry the installer chains, fed to the plugin as libcni would (list `cniVersion` and `name`
/// added, `prevResult` inserted): the keys written and read agree.
#[test]
fn installer_entry_drives_the_plugin() {
    let api = cluster();
    api.create_pod(
        "plain",
        "selected",
        json!({"labels": {"app": "web"}}),
        json!({}),
    );
    let tmp = empty_dir();
    let (bin, net_d, run) = (
        tmp.path().join("bin"),
        tmp.path().join("net.d"),
        tmp.path().join("run"),
    );
    std::fs::create_dir_all(&net_d).expect("mkdir");
    std::fs::write(
        net_d.join("10-bridge.conflist"),
        json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [{"type": "bridge"}]})
            .to_string(),
    )
    .expect("write primary");
    let source = tmp.path().join("ztnode");
    std::fs::write(&source, b"fake binary").expect("write");
    let cfg = InstallConfig {
        cni_bin_dir: bin,
        cni_conf_dir: net_d.clone(),
        exclude_namespaces: vec!["kube-system".into()],
        kube: Some(PluginKube {
            source: KubeconfigSource::Copy(api.kubeconfig()),
            enablement_selector: Some("- podSelector:\n    matchLabels:\n      app: web\n".into()),
            namespace: "ztnode-system".into(),
        }),
        ..InstallConfig::new(source, run.clone())
    };
    let outcome = install::install(&cfg).expect("install");
    assert!(outcome.kubeconfig_written);
    let written = install::kubeconfig_path(&run);
    assert_eq!(
        std::fs::read(&written).expect("kubeconfig"),
        std::fs::read(api.kubeconfig()).expect("source")
    );
    let mode = std::fs::metadata(&written)
        .expect("stat")
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o600);

    let list: Value =
        serde_json::from_slice(&std::fs::read(net_d.join("10-bridge.conflist")).expect("read"))
            .expect("json");
    let mut entry = list["plugins"][1].clone();
    assert_eq!(entry["kubeconfig"], written.display().to_string());
    assert_eq!(entry["ztnode_namespace"], "ztnode-system");
    entry["cniVersion"] = list["cniVersion"].clone();
    entry["name"] = list["name"].clone();
    entry["prevResult"] = prev_result();
    let stdin = entry.to_string();

    let plugin = Plugin::new();
    // The custom selector enrolls `app=web` only: with no agent that pod fails closed...
    plugin.add("plain", "selected", &stdin).expect_error(11);
    // ...and the ambient namespace of Istio's default selectors no longer enrolls anything.
    plugin
        .add("mesh", "web", &stdin)
        .expect_passthrough(&prev_result());

    install::uninstall(&cfg).expect("uninstall");
    assert!(!written.exists(), "uninstall removes the kubeconfig");
}

// (h)
#[test]
fn add_latency_of_a_pass_through_pod() {
    let api = cluster();
    let dead = empty_dir();
    let plugin = Plugin::new();
    let stdin = conf(dead.path(), &api.kubeconfig(), json!({}));
    plugin
        .add("plain", "web", &stdin)
        .expect_passthrough(&prev_result());
    let mut millis: Vec<f64> = (0..50)
        .map(|_| {
            let t = Instant::now();
            let out = plugin.add("plain", "web", &stdin);
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            assert_eq!(out.code, Some(0), "{}", out.stderr);
            ms
        })
        .collect();
    millis.sort_by(f64::total_cmp);
    eprintln!(
        "ztnode-cni ADD (pass-through, fake API server, {} build): p50 {:.2} ms, p90 {:.2} ms, max {:.2} ms over {} runs",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        millis[millis.len() / 2],
        millis[millis.len() * 9 / 10],
        millis[millis.len() - 1],
        millis.len()
    );
}
