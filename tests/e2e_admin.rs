//! End to end: ztunnel's admin endpoints and log shapes on a running `ztnode node` in a lab node,
//! and `ztnode doctor` run on that node (inside its netns), healthy and then broken three ways.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::node::{MeshNode, echo_once};
use serde_json::Value;
use ztnode::lab::Lab;
use ztnode::lab::http::{call_text, get_text};
use ztnode::netns::Netns;

const ADMIN: &str = "127.0.0.1:15000";
const READY: &str = "127.0.0.1:15021";

/// A service backed by the server pod and a namespace policy, so every part of the dump has
/// entries.
const EXTRA: &str = "services:
- name: server
  namespace: default
  hostname: server.default.svc.cluster.local
  vips: [\"/10.249.0.200\"]
  ports: {80: 8080}
  endpoints:
    server: {workloadUid: cluster1//v1/Pod/default/server}
policies:
- name: deny-nothing
  namespace: default
  scope: Namespace
  action: Deny
  rules: [[[{notNamespaces: [{Exact: default}]}]]]
";

fn admin() -> SocketAddr {
    ADMIN.parse().expect("admin addr")
}

/// Waits until the node answers `/healthz/ready` with 200.
fn wait_ready(node: &MeshNode) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = get_text(
            node.lab.node(),
            READY.parse().expect("addr"),
            "/healthz/ready",
        );
        if matches!(r, Ok((200, _))) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "node not ready: {r:?}\n{}",
            node.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn config_dump(node: &MeshNode) -> Value {
    let (code, text) = get_text(node.lab.node(), admin(), "/config_dump").expect("config_dump");
    assert_eq!(code, 200, "{text}");
    serde_json::from_str(&text).expect("config_dump is JSON")
}

/// One connection client → server:8080 through the mesh, echoed.
fn one_connection(node: &MeshNode) {
    use std::io::{Read, Write};
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let app = SocketAddr::new(node.server.ip, 8080);
    let echo = echo_once(&server_ns, app);
    let mut c = Lab::connect_from(&client_ns, app).expect("connect");
    c.write_all(b"ping").expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read");
    assert_eq!(back, b"ping");
    echo.join().expect("echo");
}

#[test]
fn config_dump_has_ztunnels_shape_with_the_pods_certificates() {
    if !common::privileged("config_dump_has_ztunnels_shape_with_the_pods_certificates") {
        return;
    }
    let node = MeshNode::start_with(&common::prefix("ad1"), EXTRA);
    wait_ready(&node);
    let dump = config_dump(&node);
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/ztunnel_config_dump.json")).expect("fixture");
    let errs = ztnode::lab::dump_shape::shape_errors(&dump, &fixture);
    assert!(errs.is_empty(), "{errs:#?}\n{dump:#}");

    let names = |k: &str, field: &str| -> Vec<String> {
        let mut v: Vec<String> = dump[k]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x[field].as_str().map(str::to_owned))
            .collect();
        v.sort();
        v
    };
    assert_eq!(names("workloads", "name"), ["client", "server"]);
    assert_eq!(
        names("services", "hostname"),
        ["server.default.svc.cluster.local"]
    );
    assert_eq!(names("policies", "name"), ["deny-nothing"]);
    assert_eq!(
        dump["services"][0]["endpoints"]["server"]["workloadUid"],
        "cluster1//v1/Pod/default/server"
    );
    // both enrolled pods' identities, each with its chain and the built-in root
    assert_eq!(
        names("certificates", "identity"),
        [
            "spiffe://cluster.local/ns/default/sa/alice",
            "spiffe://cluster.local/ns/default/sa/bob"
        ]
    );
    for c in dump["certificates"].as_array().expect("certificates") {
        assert_eq!(c["state"], "Available", "{c}");
        assert_eq!(c["certChain"].as_array().map(Vec::len), Some(1), "{c}");
        assert_eq!(c["rootCerts"].as_array().map(Vec::len), Some(1), "{c}");
    }
    let uids: Vec<&str> = dump["workloadState"]
        .as_object()
        .expect("workloadState")
        .values()
        .filter_map(|s| s["info"]["name"].as_str())
        .collect();
    assert_eq!(uids.len(), 2, "{:#}", dump["workloadState"]);
    assert_eq!(dump["staticConfig"]["services"][0]["name"], "server");
    assert_eq!(dump["config"]["adminAddr"], ADMIN);
    assert_eq!(dump["version"]["version"], env!("CARGO_PKG_VERSION"));

    let (code, index) = get_text(node.lab.node(), admin(), "/").expect("index");
    assert_eq!(code, 200);
    assert!(
        index.contains("config_dump") && index.contains("quitquitquit"),
        "{index}"
    );
}

#[test]
fn logging_level_changes_without_a_restart() {
    if !common::privileged("logging_level_changes_without_a_restart") {
        return;
    }
    let node = MeshNode::start(&common::prefix("ad2"));
    wait_ready(&node);
    let (code, body) = call_text(node.lab.node(), admin(), "POST", "/logging").expect("logging");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.starts_with("current log level is ") && body.trim_end().ends_with(",info"),
        "{body}"
    );
    assert!(body.contains("h2=warn"), "noisy crates stay quiet: {body}");

    config_dump(&node);
    let (code, body) =
        call_text(node.lab.node(), admin(), "POST", "/logging?level=loud").expect("logging");
    assert_eq!(code, 400, "{body}");
    let pid = node.process.0.id();
    let (code, body) =
        call_text(node.lab.node(), admin(), "POST", "/logging?level=debug").expect("logging");
    assert_eq!(code, 200, "{body}");
    assert!(body.trim_end().ends_with(",debug"), "{body}");
    config_dump(&node);
    let line = node.wait_log(&["admin request", "/config_dump"], Duration::from_secs(5));
    assert!(line.contains("\tdebug\t"), "{line}");
    let text = node.log_text();
    let first_debug = text.find("\tdebug\t").expect("a debug line");
    let changed = text.find("new log filter").expect("the change is logged");
    assert!(
        changed < first_debug,
        "no debug line before the change:\n{text}"
    );
    assert_eq!(node.process.0.id(), pid);

    let (code, body) =
        call_text(node.lab.node(), admin(), "POST", "/logging?reset").expect("logging");
    assert_eq!(code, 200, "{body}");
    assert!(body.trim_end().ends_with(",info"), "{body}");
}

#[test]
fn quitquitquit_stops_the_node_cleanly() {
    if !common::privileged("quitquitquit_stops_the_node_cleanly") {
        return;
    }
    let prefix = common::prefix("ad3");
    let mut node = MeshNode::start(&prefix);
    wait_ready(&node);
    let (code, _) = call_text(node.lab.node(), admin(), "GET", "/quitquitquit").expect("get");
    assert_eq!(code, 405, "GET must not stop the node");
    let (code, body) = call_text(node.lab.node(), admin(), "POST", "/quitquitquit").expect("quit");
    assert_eq!((code, body.as_str()), (200, "shutdown now\n"));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = node.process.0.try_wait().expect("wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "still running:\n{}",
            node.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}\n{}", node.log_text());
    assert!(node.log_text().contains("shutting down"));
    assert!(
        !ztnode::podevent::plugin_socket_path(&node.run_dir).exists(),
        "the plugin socket is removed"
    );
    drop(node);
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    let left = String::from_utf8_lossy(&out.stdout);
    assert!(!left.contains(&prefix), "netns left behind: {left}");
}

#[test]
fn json_log_lines_have_exactly_ztunnels_top_level_keys() {
    if !common::privileged("json_log_lines_have_exactly_ztunnels_top_level_keys") {
        return;
    }
    let node = MeshNode::start_with_env(&common::prefix("ad4"), "", &[], &[("LOG_FORMAT", "json")]);
    wait_ready(&node);
    one_connection(&node);
    node.wait_log(&["connection complete", "outbound"], Duration::from_secs(5));
    let text = node.log_text();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.len() > 3, "{text}");
    for l in &lines {
        let keys: Vec<&str> = l
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys[..3], ["level", "time", "scope"], "{l}");
        assert!(keys.contains(&"message"), "{l}");
        assert!(
            ["error", "warn", "info", "debug", "trace"]
                .contains(&l["level"].as_str().unwrap_or("")),
            "{l}"
        );
        for not_ours in ["fields", "target", "timestamp", "span", "spans"] {
            assert!(
                !keys.contains(&not_ours),
                "{not_ours} is not a ztunnel key: {l}"
            );
        }
    }
    let start = lines
        .iter()
        .find(|l| l["message"] == "starting ztnode node")
        .expect("start-up line");
    assert_eq!(start["scope"], "ztnode::node");
    assert_eq!(
        start["admin_addr"], ADMIN,
        "start-up settings are fields: {start}"
    );
    assert_eq!(start["packet_mark"], 1337, "{start}");
    let access = lines
        .iter()
        .find(|l| l["message"] == "connection complete" && l["direction"] == "outbound")
        .expect("access log line");
    assert_eq!(access["scope"], "access");
    assert!(
        access["src.addr"].is_string() && access["dst.addr"].is_string(),
        "{access}"
    );
}

/// `ztnode doctor` inside the node netns; (exit code, stdout).
fn doctor(node: &MeshNode, conf_dir: &std::path::Path, json: bool) -> (i32, String) {
    let mut cmd = Lab::exec_in(node.lab.node_name(), env!("CARGO_BIN_EXE_ztnode"));
    cmd.arg("doctor")
        .arg("--run-dir")
        .arg(&node.run_dir)
        .arg("--cni-conf-dir")
        .arg(conf_dir)
        .env_remove("XDS_ADDRESS")
        .env_remove("CA_ADDRESS");
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("doctor");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn doctor_passes_a_healthy_node_and_names_each_problem() {
    if !common::privileged("doctor_passes_a_healthy_node_and_names_each_problem") {
        return;
    }
    let dirs = tempfile::tempdir().expect("tmp");
    let node = MeshNode::start(&common::prefix("ad5"));
    let (bin, conf) = (dirs.path().join("bin"), dirs.path().join("net.d"));
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::create_dir_all(&conf).expect("conf");
    let primary = conf.join("10-bridge.conflist");
    std::fs::write(
        &primary,
        r#"{"cniVersion": "1.0.0", "name": "lab", "plugins": [{"type": "bridge", "bridge": "cni0"}, {"type": "portmap"}]}"#,
    )
    .expect("conflist");
    let icfg = ztnode::agent::install::InstallConfig {
        cni_bin_dir: bin,
        cni_conf_dir: conf.clone(),
        ..ztnode::agent::install::InstallConfig::new(
            env!("CARGO_BIN_EXE_ztnode").into(),
            node.run_dir.clone(),
        )
    };
    ztnode::agent::install::install(&icfg).expect("install");
    wait_ready(&node);

    let (code, out) = doctor(&node, &conf, false);
    assert_eq!(code, 0, "healthy node:\n{out}");
    assert!(
        out.contains("✓ cni: ztnode-cni is chained once and last"),
        "{out}"
    );
    assert!(
        out.contains("✓ pod-rules: default/client: rules as planned"),
        "{out}"
    );
    assert!(
        out.contains("✓ pod-rules: default/server: rules as planned"),
        "{out}"
    );
    assert!(out.contains("✓ readiness: ready"), "{out}");
    assert!(!out.contains('✗'), "{out}");

    // a process of the server pod runs as the proxy's UID
    let mut uid_1337 = common::node::NodeProcess(
        Lab::exec_in(&node.server.netns_name, "setpriv")
            .args([
                "--reuid=1337",
                "--regid=1337",
                "--clear-groups",
                "sleep",
                "60",
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("setpriv"),
    );
    let pid = uid_1337.0.id();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(format!("/proc/{pid}/status"))
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:\t1337")))
    {
        assert!(Instant::now() < deadline, "setpriv did not switch UID");
        assert!(
            uid_1337.0.try_wait().expect("wait").is_none(),
            "setpriv exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, out) = doctor(&node, &conf, false);
    assert_eq!(code, 2, "a warning only:\n{out}");
    assert!(
        out.contains("! pod-uid: default/server runs as UID 1337"),
        "{out}"
    );

    // our entry removed from the conflist, and the client's nat table flushed
    let mut list: Value =
        serde_json::from_str(&std::fs::read_to_string(&primary).expect("read")).expect("json");
    list["plugins"]
        .as_array_mut()
        .expect("plugins")
        .retain(|p| p["type"] != "ztnode-cni");
    std::fs::write(&primary, list.to_string()).expect("rewrite");
    let flushed = Lab::exec_in(&node.client.netns_name, "nft")
        .args(["flush", "table", "inet", "istio-ambient-nat"])
        .status()
        .expect("nft");
    assert!(flushed.success());

    let (code, out) = doctor(&node, &conf, false);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("✗ cni: 10-bridge.conflist (bridge → portmap) has no ztnode-cni entry"),
        "{out}"
    );
    assert!(
        out.contains("✗ pod-rules: default/client: its istio-ambient-* tables differ"),
        "{out}"
    );
    assert!(
        out.contains("✓ pod-rules: default/server: rules as planned"),
        "{out}"
    );
    assert!(
        out.contains("! pod-uid: default/server runs as UID 1337"),
        "{out}"
    );
    let (code, out) = doctor(&node, &conf, true);
    assert_eq!(code, 1);
    let report: Value = serde_json::from_str(&out).expect("doctor --json");
    assert_eq!(report["ok"], false);
    let failed: Vec<&str> = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["status"] == "fail")
        .filter_map(|c| c["check"].as_str())
        .collect();
    assert_eq!(failed, ["cni", "pod-rules"], "{report:#}");
    drop(uid_1337);
}
