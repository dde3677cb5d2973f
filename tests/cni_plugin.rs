//! The CNI plugin end to end: JSON and env in, exit code, stdout and stderr out, across spec versions,
//! with a fake node agent on a unix socket.

#[path = "common/plugin_agent.rs"]
mod plugin_agent;

use std::io::Read;
use std::path::Path;
use std::process::Command;

use anyhow::Context;
use serde_json::{Value, json};
use ztnode::plugin::{MapEnv, run};

use plugin_agent::FakeAgent;

const VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
const NETNS: &str = "/var/run/netns/cni-3f2a9c1e-test";
const POD_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;\
                        K8S_POD_INFRA_CONTAINER_ID=ctr-1;K8S_POD_UID=0b2c9d1e-uid";

struct Outcome {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Outcome {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }

    /// Asserts a CNI error with `code` and returns the error object.
    fn expect_error(&self, code: u64) -> Value {
        assert_eq!(self.code, 1, "exit status; stderr: {}", self.stderr);
        let v = self.json();
        assert_eq!(v["code"], code, "error object {v}");
        assert!(v["msg"].is_string(), "{v}");
        v
    }

    fn expect_silent_success(&self) {
        assert_eq!(
            self.code, 0,
            "stdout {} stderr {}",
            self.stdout, self.stderr
        );
        assert_eq!(self.stdout, "", "no output on success");
    }
}

fn invoke(env: &MapEnv, stdin: &str) -> Outcome {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run(env, &mut stdin.as_bytes(), &mut out, &mut err);
    Outcome {
        code,
        stdout: String::from_utf8(out).expect("utf8 stdout"),
        stderr: String::from_utf8(err).expect("utf8 stderr"),
    }
}

/// Env as libcni sets it for `cmd`, without CNI_ARGS.
fn env(cmd: &str) -> MapEnv {
    MapEnv::from_pairs([
        ("CNI_COMMAND", cmd),
        ("CNI_CONTAINERID", "ctr-1"),
        ("CNI_NETNS", NETNS),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ])
}

/// Env of a Kubernetes pod `default/web-0`.
fn pod_env(cmd: &str) -> MapEnv {
    let mut e = env(cmd);
    e.set("CNI_ARGS", POD_ARGS);
    e
}

fn conf(version: &str, run_dir: &Path) -> Value {
    json!({"cniVersion": version, "name": "k8s-pod-network", "type": "ztnode-cni",
           "cni_agent_run_dir": run_dir, "capabilities": {"portMappings": true}})
}

fn conf_with_prev(version: &str, run_dir: &Path, prev: Value) -> String {
    let mut c = conf(version, run_dir);
    c["prevResult"] = prev;
    c.to_string()
}

/// A bridge + host-local result as that version's Go library prints it (dual stack).
fn bridge_result(version: &str) -> Value {
    let legacy = version.starts_with("0.");
    let mut ips = json!([
        {"interface": 2, "address": "10.244.1.7/24", "gateway": "10.244.1.1"},
        {"interface": 2, "address": "fd00:10:244:1::7/64", "gateway": "fd00:10:244:1::1"}
    ]);
    if legacy {
        ips[0]["version"] = json!("4");
        ips[1]["version"] = json!("6");
    }
    let mut r = json!({
        "cniVersion": version,
        "interfaces": [
            {"name": "cni0", "mac": "0a:58:0a:f4:01:01"},
            {"name": "veth5c1a2b3d", "mac": "6e:1f:3a:aa:01:02"},
            {"name": "eth0", "mac": "0a:58:0a:f4:01:07", "sandbox": NETNS}
        ],
        "ips": ips,
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}, {"dst": "::/0", "gw": "fd00:10:244:1::1"}],
        "dns": {"nameservers": ["10.96.0.10"], "domain": "cluster.local",
                "search": ["default.svc.cluster.local", "svc.cluster.local"], "options": ["ndots:5"]}
    });
    if version == "1.1.0" {
        r["interfaces"][1]["mtu"] = json!(1450);
        r["interfaces"][2]["mtu"] = json!(1450);
        r["interfaces"][2]["socketPath"] = json!("/run/vhost-user/eth0.sock");
        r["routes"][0]["table"] = json!(254);
        r["routes"][0]["scope"] = json!(0);
    }
    r
}

fn empty_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

// --- VERSION, about, command and env errors ---

#[test]
fn version_lists_exactly_the_five_versions() {
    let supported = json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]);
    for v in VERSIONS {
        let out = invoke(&env("VERSION"), &json!({"cniVersion": v}).to_string());
        assert_eq!(out.code, 0);
        assert_eq!(
            out.json(),
            json!({"cniVersion": v, "supportedVersions": supported})
        );
    }
    // libcni's probe shape, an unsupported input version and no stdin at all.
    let probe = MapEnv::from_pairs([("CNI_COMMAND", "VERSION")]);
    for stdin in [r#"{"cniVersion":"1.1.0"}"#, r#"{"cniVersion":"0.2.0"}"#, ""] {
        let out = invoke(&probe, stdin);
        assert_eq!(out.code, 0);
        assert_eq!(out.json()["cniVersion"], "1.1.0", "stdin {stdin:?}");
        assert_eq!(out.json()["supportedVersions"], supported);
    }
}

#[test]
fn no_command_prints_about_on_stderr() {
    let out = invoke(&MapEnv::default(), "");
    assert_eq!(out.code, 0);
    assert_eq!(out.stdout, "");
    assert!(
        out.stderr
            .contains("CNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0")
    );
}

#[test]
fn unknown_command_is_code_4() {
    let out = invoke(&env("UPDATE"), &conf("1.0.0", Path::new("/x")).to_string());
    let err = out.expect_error(4);
    assert_eq!(err["msg"], "unknown CNI_COMMAND: UPDATE");
    assert_eq!(err["cniVersion"], "1.1.0");
}

#[test]
fn missing_env_vars_are_code_4_and_named() {
    let stdin = conf("0.4.0", Path::new("/x")).to_string();
    let cases = [
        (
            "ADD",
            vec!["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"],
            "CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME",
        ),
        ("ADD", vec!["CNI_NETNS"], "CNI_NETNS"),
        ("CHECK", vec!["CNI_IFNAME"], "CNI_IFNAME"),
        (
            "DEL",
            vec!["CNI_CONTAINERID", "CNI_IFNAME"],
            "CNI_CONTAINERID,CNI_IFNAME",
        ),
        ("GC", vec!["CNI_PATH"], "CNI_PATH"),
    ];
    for (cmd, remove, listed) in cases {
        let mut e = env(cmd);
        for k in remove {
            e.remove(k);
        }
        let err = invoke(&e, &stdin).expect_error(4);
        assert_eq!(
            err["msg"],
            format!("required env variables [{listed}] missing"),
            "{cmd}"
        );
        assert_eq!(
            err["cniVersion"], "0.4.0",
            "error tagged with the config version"
        );
    }
    let mut e = env("ADD");
    e.set("CNI_NETNS", "");
    invoke(&e, &stdin).expect_error(4);
}

#[test]
fn malformed_stdin_is_code_6() {
    for stdin in ["", "{", "not json", "[1,2]", r#""name""#] {
        let out = invoke(&env("ADD"), stdin);
        let err = out.expect_error(6);
        assert_eq!(err["cniVersion"], "1.1.0", "{stdin:?}");
        assert!(out.stderr.contains("code 6"), "logged: {}", out.stderr);
    }
}

#[test]
fn stdin_read_error_is_code_5() {
    struct Broken;
    impl Read for Broken {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("pipe broke"))
        }
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run(&env("ADD"), &mut Broken, &mut out, &mut err);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(v["code"], 5);
    assert!(v["msg"].as_str().expect("msg").contains("pipe broke"));
}

#[test]
fn invalid_config_is_code_7() {
    let dir = empty_dir();
    let mut bad_excl = conf("1.0.0", dir.path());
    bad_excl["exclude_namespaces"] = json!(5);
    let err = invoke(&pod_env("ADD"), &bad_excl.to_string()).expect_error(7);
    assert!(
        err["msg"]
            .as_str()
            .expect("msg")
            .contains("exclude_namespaces"),
        "{err}"
    );
    assert_eq!(err["cniVersion"], "1.0.0");

    let mut no_name = conf("0.3.1", dir.path());
    no_name.as_object_mut().expect("obj").remove("name");
    let err = invoke(&pod_env("ADD"), &no_name.to_string()).expect_error(7);
    assert_eq!(err["msg"], "missing network name");
    assert_eq!(err["cniVersion"], "0.3.1");

    let mut bad_name = conf("1.1.0", dir.path());
    bad_name["name"] = json!("bad name");
    invoke(&pod_env("CHECK"), &bad_name.to_string()).expect_error(7);

    let mut bad_dir = conf("1.1.0", dir.path());
    bad_dir["cni_agent_run_dir"] = json!(["/run"]);
    invoke(&pod_env("STATUS"), &bad_dir.to_string()).expect_error(7);
}

#[test]
fn unsupported_config_versions_are_code_1() {
    for version in [json!("0.1.0"), json!("0.2.0"), json!("1.2.0"), json!("1.0")] {
        for cmd in ["ADD", "DEL", "CHECK", "STATUS", "GC"] {
            let stdin = json!({"cniVersion": version, "name": "net"}).to_string();
            let err = invoke(&env(cmd), &stdin).expect_error(1);
            assert_eq!(err["msg"], "incompatible CNI versions", "{cmd} {version}");
            assert_eq!(
                err["details"],
                format!(
                    r#"config is {version}, plugin supports ["0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#
                )
            );
        }
    }
    let err = invoke(&env("ADD"), r#"{"name":"net"}"#).expect_error(1);
    assert!(
        err["details"]
            .as_str()
            .expect("details")
            .contains(r#""0.1.0""#)
    );
}

// --- every verb at every version ---

#[test]
fn every_verb_at_every_version() {
    let agent = FakeAgent::start(200, "");
    let dead = empty_dir();
    for v in VERSIONS {
        let live = conf(v, agent.run_dir()).to_string();
        let gone = conf(v, dead.path()).to_string();
        let version = version_index(v);

        let add = invoke(&env("ADD"), &gone);
        assert_eq!(add.code, 0, "ADD {v}: {}", add.stderr);
        let mut empty = json!({"cniVersion": v, "interfaces": [], "ips": []});
        if v.starts_with("0.") {
            empty["dns"] = json!({});
        }
        assert_eq!(add.json(), empty, "ADD {v} without prevResult");

        invoke(&pod_env("DEL"), &gone).expect_silent_success();

        let check = invoke(&pod_env("CHECK"), &live);
        if version < 2 {
            assert_eq!(
                check.expect_error(1)["msg"],
                "config version does not allow CHECK"
            );
        } else {
            check.expect_silent_success();
        }

        let ver = invoke(&env("VERSION"), &live);
        assert_eq!(
            ver.json()["supportedVersions"].as_array().map(Vec::len),
            Some(5)
        );

        for cmd in ["STATUS", "GC"] {
            let out = invoke(&env(cmd), &live);
            if v == "1.1.0" {
                out.expect_silent_success();
            } else {
                let err = out.expect_error(1);
                assert_eq!(err["msg"], format!("config version does not allow {cmd}"));
                assert_eq!(err["cniVersion"], v);
            }
        }
    }
    assert!(
        agent.requests().is_empty(),
        "no pod args: the agent is never contacted"
    );
}

fn version_index(v: &str) -> usize {
    VERSIONS
        .iter()
        .position(|x| *x == v)
        .expect("known version")
}

// --- prevResult passthrough and conversion ---

#[test]
fn prev_result_passthrough_is_equal_as_json() {
    let agent = FakeAgent::start(200, "");
    for v in VERSIONS {
        let prev = bridge_result(v);
        let out = invoke(
            &pod_env("ADD"),
            &conf_with_prev(v, agent.run_dir(), prev.clone()),
        );
        assert_eq!(out.code, 0, "{v}: {}", out.stderr);
        assert_eq!(out.json(), prev, "passthrough at {v}");
        assert!(out.stdout.ends_with('\n') && out.stdout.lines().count() == 1);
    }
    assert_eq!(agent.requests().len(), VERSIONS.len());
}

#[test]
fn v110_prev_result_under_040_conf() {
    let dir = empty_dir();
    let out = invoke(
        &env("ADD"),
        &conf_with_prev("0.4.0", dir.path(), bridge_result("1.1.0")),
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut want = bridge_result("0.4.0");
    // Route extras are kept, as libcni's 1.x -> 0.x converter keeps them.
    want["routes"][0]["table"] = json!(254);
    want["routes"][0]["scope"] = json!(0);
    assert_eq!(out.json(), want);
}

#[test]
fn v040_prev_result_under_110_conf() {
    let dir = empty_dir();
    let out = invoke(
        &env("ADD"),
        &conf_with_prev("1.1.0", dir.path(), bridge_result("0.4.0")),
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut want = bridge_result("1.0.0");
    want["cniVersion"] = json!("1.1.0");
    assert_eq!(out.json(), want);
}

#[test]
fn more_cross_version_pairs() {
    let dir = empty_dir();
    for from in VERSIONS {
        for to in VERSIONS {
            let out = invoke(
                &env("ADD"),
                &conf_with_prev(to, dir.path(), bridge_result(from)),
            );
            assert_eq!(out.code, 0, "{from}->{to}: {}", out.stderr);
            let got = out.json();
            assert_eq!(got["cniVersion"], to);
            for ip in got["ips"].as_array().expect("ips") {
                assert_eq!(
                    ip.get("version").is_some(),
                    to.starts_with("0."),
                    "{from}->{to} {ip}"
                );
            }
            let keeps_mtu = got["interfaces"][2].get("mtu").is_some();
            assert_eq!(keeps_mtu, from == "1.1.0" && to == "1.1.0", "{from}->{to}");
            assert_eq!(got["dns"], bridge_result(from)["dns"], "{from}->{to}");
        }
    }
}

#[test]
fn prev_result_without_version_and_with_unknown_keys() {
    let dir = empty_dir();
    let prev = json!({"ips": [{"address": "10.0.0.9/32"}], "vendor-extension": {"k": [1, 2]}});
    let out = invoke(&env("ADD"), &conf_with_prev("0.3.1", dir.path(), prev));
    assert_eq!(
        out.json(),
        json!({"cniVersion": "0.3.1", "ips": [{"address": "10.0.0.9/32", "version": "4"}],
               "vendor-extension": {"k": [1, 2]}})
    );
}

#[test]
fn bad_prev_results() {
    let dir = empty_dir();
    let out = invoke(
        &env("ADD"),
        &conf_with_prev(
            "1.0.0",
            dir.path(),
            json!({"cniVersion": "1.2.0", "ips": []}),
        ),
    );
    let err = out.expect_error(7);
    assert!(
        err["msg"].as_str().expect("msg").contains(r#""1.2.0""#),
        "{err}"
    );
    for prev in [
        json!({"ips": [{"address": "nope"}]}),
        json!([1]),
        json!({"interfaces": 3}),
    ] {
        invoke(
            &pod_env("ADD"),
            &conf_with_prev("1.0.0", dir.path(), prev.clone()),
        )
        .expect_error(6);
        invoke(
            &pod_env("CHECK"),
            &conf_with_prev("1.0.0", dir.path(), prev),
        )
        .expect_error(6);
    }
    // CHECK with a good prevResult succeeds.
    invoke(
        &pod_env("CHECK"),
        &conf_with_prev("1.1.0", dir.path(), bridge_result("0.4.0")),
    )
    .expect_silent_success();
}

// --- the agent ---

#[test]
fn add_sends_the_pod_to_the_agent() {
    let agent = FakeAgent::start(200, "");
    let out = invoke(
        &pod_env("ADD"),
        &conf_with_prev("1.0.0", agent.run_dir(), bridge_result("1.0.0")),
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let reqs = agent.requests();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/cmdadd"));
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    assert_eq!(
        r.json(),
        json!({"Netns": NETNS, "PodName": "web-0", "PodNamespace": "default", "PodUid": "0b2c9d1e-uid",
               "ContainerId": "ctr-1", "IfName": "eth0",
               "IPs": [{"Interface": 2, "Address": {"IP": "10.244.1.7", "Prefix": 24}, "Gateway": "10.244.1.1"},
                       {"Interface": 2, "Address": {"IP": "fd00:10:244:1::7", "Prefix": 64},
                        "Gateway": "fd00:10:244:1::1"}]})
    );
    let ev: ztnode::podevent::PodAddEvent = serde_json::from_slice(&r.body).expect("typed event");
    assert_eq!(ev.ips.len(), 2);
}

#[test]
fn add_without_prev_result_sends_no_ips_and_tolerates_odd_args() {
    let agent = FakeAgent::start(200, "");
    let mut e = env("ADD");
    e.set(
        "CNI_ARGS",
        ";FOO=bar;K8S_POD_NAME=db-1;junk;K8S_POD_NAMESPACE=prod;X=a=b;",
    );
    let out = invoke(&e, &conf("0.3.0", agent.run_dir()).to_string());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let ev = agent.requests()[0].json();
    assert_eq!(
        (ev["PodNamespace"].as_str(), ev["PodName"].as_str()),
        (Some("prod"), Some("db-1"))
    );
    assert_eq!(ev["PodUid"], "", "missing UID is unknown, not an error");
    assert_eq!(ev["IPs"], json!([]));
}

#[test]
fn agent_down_fails_add_but_not_del() {
    let dir = empty_dir();
    let stdin = conf_with_prev("1.0.0", dir.path(), bridge_result("1.0.0"));
    let err = invoke(&pod_env("ADD"), &stdin).expect_error(11);
    let msg = err["msg"].as_str().expect("msg");
    let socket = dir.path().join("pluginevent.sock");
    assert!(msg.contains(&socket.display().to_string()), "{msg}");
    assert!(msg.contains("default/web-0"), "{msg}");
    assert_eq!(err["cniVersion"], "1.0.0");

    let del = invoke(&pod_env("DEL"), &stdin);
    del.expect_silent_success();
    assert!(
        del.stderr.contains("could not notify the node agent"),
        "{}",
        del.stderr
    );
}

#[test]
fn agent_error_answer_fails_add_with_its_text() {
    let agent = FakeAgent::start(500, "failed to enroll pod: netns vanished\n");
    let stdin = conf_with_prev("0.4.0", agent.run_dir(), bridge_result("0.4.0"));
    let err = invoke(&pod_env("ADD"), &stdin).expect_error(11);
    let msg = err["msg"].as_str().expect("msg");
    assert!(
        msg.contains("failed to enroll pod: netns vanished"),
        "{msg}"
    );
    assert!(msg.contains("500"), "{msg}");
    // DEL with the same agent still succeeds.
    invoke(&pod_env("DEL"), &stdin).expect_silent_success();
    assert_eq!(agent.requests().len(), 2);
}

#[test]
fn excluded_namespaces_never_reach_the_agent() {
    let dead = empty_dir();
    let prev = bridge_result("1.1.0");
    let mut e = env("ADD");
    e.set(
        "CNI_ARGS",
        "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1",
    );
    let out = invoke(&e, &conf_with_prev("1.1.0", dead.path(), prev.clone()));
    assert_eq!(out.code, 0, "default exclusion: {}", out.stderr);
    assert_eq!(out.json(), prev);

    let mut c = conf("1.1.0", dead.path());
    c["exclude_namespaces"] = json!(["default", "istio-system"]);
    let out = invoke(&pod_env("ADD"), &c.to_string());
    assert_eq!(out.code, 0, "custom exclusion: {}", out.stderr);

    // With the list emptied, kube-system is no longer excluded, so the dead agent fails ADD.
    let mut c = conf("1.1.0", dead.path());
    c["exclude_namespaces"] = Value::Null;
    invoke(&e, &c.to_string()).expect_error(11);
}

#[test]
fn non_kubernetes_pods_pass_through() {
    let dead = empty_dir();
    let prev = bridge_result("0.3.1");
    let mut e = env("ADD");
    e.set("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=only-name");
    let out = invoke(&e, &conf_with_prev("0.3.1", dead.path(), prev.clone()));
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json(), prev);
}

#[test]
fn del_is_best_effort_and_needs_no_netns_or_prev_result() {
    let agent = FakeAgent::start(200, "");
    let mut e = pod_env("DEL");
    e.remove("CNI_NETNS");
    for _ in 0..2 {
        invoke(&e, &conf("1.0.0", agent.run_dir()).to_string()).expect_silent_success();
    }
    let reqs = agent.requests();
    assert_eq!(reqs.len(), 2, "repeated DEL succeeds each time");
    assert_eq!(reqs[0].path, "/cmddel");
    assert_eq!(
        reqs[0].json(),
        json!({"Netns": "", "PodName": "web-0", "PodNamespace": "default",
               "PodUid": "0b2c9d1e-uid", "ContainerId": "ctr-1"})
    );
    // Invalid plugin keys or a bad prevResult never fail DEL.
    let mut c = conf("1.0.0", agent.run_dir());
    c["exclude_namespaces"] = json!(5);
    c["prevResult"] = json!({"cniVersion": "9.9.9"});
    let out = invoke(&e, &c.to_string());
    out.expect_silent_success();
    assert!(out.stderr.contains("exclude_namespaces"), "{}", out.stderr);
}

#[test]
fn status_with_and_without_agent() {
    let agent = FakeAgent::start(200, "");
    invoke(&env("STATUS"), &conf("1.1.0", agent.run_dir()).to_string()).expect_silent_success();
    // STATUS needs no CNI_CONTAINERID/NETNS/IFNAME; stdin is just name + version + our keys.
    let bare = MapEnv::from_pairs([("CNI_COMMAND", "STATUS")]);
    invoke(&bare, &conf("1.1.0", agent.run_dir()).to_string()).expect_silent_success();

    let dead = empty_dir();
    let err = invoke(&bare, &conf("1.1.0", dead.path()).to_string()).expect_error(50);
    let socket = dead.path().join("pluginevent.sock");
    assert!(
        err["msg"]
            .as_str()
            .expect("msg")
            .contains(&socket.display().to_string()),
        "{err}"
    );
    assert!(agent.requests().is_empty(), "STATUS only connects");
}

#[test]
fn gc_accepts_both_attachment_keys() {
    let dead = empty_dir();
    let e = MapEnv::from_pairs([("CNI_COMMAND", "GC"), ("CNI_PATH", "/opt/cni/bin")]);
    for key in ["cni.dev/valid-attachments", "cni.dev/attachments"] {
        let mut c = conf("1.1.0", dead.path());
        c[key] = json!([{"containerID": "ctr-1", "ifname": "eth0"}, {"containerID": "ctr-2", "ifname": "eth0"}]);
        c["plugin_log_level"] = json!("info");
        let out = invoke(&e, &c.to_string());
        out.expect_silent_success();
        assert!(
            out.stderr.contains("2 valid attachments"),
            "{key}: {}",
            out.stderr
        );
    }
    invoke(&e, &conf("1.1.0", dead.path()).to_string()).expect_silent_success();
}

#[test]
fn host_netns_is_refused_unless_overridden() {
    let dead = empty_dir();
    let mut e = env("ADD");
    e.set("CNI_NETNS", "/proc/self/ns/net");
    let err = invoke(&e, &conf("1.0.0", dead.path()).to_string()).expect_error(8);
    assert!(
        err["msg"]
            .as_str()
            .expect("msg")
            .contains("/proc/self/ns/net")
    );
    e.set("CNI_NETNS_OVERRIDE", "true");
    assert_eq!(invoke(&e, &conf("1.0.0", dead.path()).to_string()).code, 0);
}

#[test]
fn debug_logs_go_to_stderr_only() {
    let agent = FakeAgent::start(200, "");
    let mut c = conf("1.0.0", agent.run_dir());
    c["plugin_log_level"] = json!("debug");
    c["prevResult"] = bridge_result("1.0.0");
    let out = invoke(&pod_env("ADD"), &c.to_string());
    assert_eq!(out.code, 0);
    assert_eq!(out.json(), bridge_result("1.0.0"));
    assert!(out.stderr.contains("ztnode-cni debug:"), "{}", out.stderr);
    assert!(
        out.stderr.contains("enrolled by the node agent"),
        "{}",
        out.stderr
    );
}

// --- the real binary ---

#[test]
fn real_binary_dispatches_on_argv0() -> anyhow::Result<()> {
    let bin_dir = tempfile::tempdir()?;
    let link = bin_dir.path().join("ztnode-cni");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ztnode"), &link)?;
    let agent = FakeAgent::start(200, "");

    let exec = |cmd: &str, args: &str, stdin: &str| -> anyhow::Result<std::process::Output> {
        use std::io::Write;
        let mut child = Command::new(&link)
            .env_clear()
            .env("CNI_COMMAND", cmd)
            .env("CNI_CONTAINERID", "ctr-1")
            .env("CNI_NETNS", NETNS)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", bin_dir.path())
            .env("CNI_ARGS", args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("spawn ztnode-cni")?;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(stdin.as_bytes())?;
        Ok(child.wait_with_output()?)
    };

    let out = exec("VERSION", "", r#"{"cniVersion":"1.1.0"}"#)?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        v,
        json!({"cniVersion": "1.1.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
    );

    let prev = bridge_result("0.4.0");
    let out = exec(
        "ADD",
        POD_ARGS,
        &conf_with_prev("0.4.0", agent.run_dir(), prev.clone()),
    )?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout)?, prev);
    assert_eq!(agent.requests().len(), 1);
    assert_eq!(agent.requests()[0].json()["Netns"], NETNS);

    let out = exec("ADD", POD_ARGS, "{")?;
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout)?["code"], 6);
    Ok(())
}
