//! End to end with Istio's control plane: two lab nodes (two node netns joined by a link, pods
//! through the real CNI chain on each), one `ztnode node` per node, both fed by one fake istiod
//! (delta xDS + CA) and sharing no CA dir. Pods on different nodes talk over HBONE with
//! certificates from istiod's CA, and keep talking through two minutes without istiod.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::istiod::TwoNodes;
use common::node::{echo_once, serve_echo, try_round_trip};
use ztnode::lab::Lab;
use ztnode::netns::Netns;

const ALICE: &str = "spiffe://cluster.local/ns/default/sa/alice";
const BOB: &str = "spiffe://cluster.local/ns/default/sa/bob";

/// Sends `msg` from `from` to `to` and returns the echo (the server side echoes one connection).
fn round_trip(from: &Netns, to_ns: &Netns, to: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let echo = echo_once(to_ns, to);
    let mut c = Lab::connect_from(from, to).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    c.write_all(msg).expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    let (got, _) = echo.join().expect("echo thread");
    assert_eq!(got, msg);
    back
}

#[test]
fn pods_on_two_nodes_talk_over_hbone_with_certificates_from_istiods_ca() {
    if !common::privileged("pods_on_two_nodes_talk_over_hbone_with_certificates_from_istiods_ca") {
        return;
    }
    let t = TwoNodes::start("xc", "", &[]);
    let server_ns = Netns::open(&t.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&t.client.netns_path).expect("client netns");
    let app = SocketAddr::new(t.server.ip, 8080);
    let msg = b"across nodes, one root";
    assert_eq!(round_trip(&client_ns, &server_ns, app, msg), msg);

    // both sides logged the connection with both SPIFFE ids
    let out = t.b.wait_log(
        &["connection complete", "direction=\"outbound\""],
        Duration::from_secs(5),
    );
    let inb = t.a.wait_log(
        &["connection complete", "direction=\"inbound\""],
        Duration::from_secs(5),
    );
    for line in [&out, &inb] {
        assert!(line.contains(ALICE) && line.contains(BOB), "{line}");
    }
    // the certificates came from the fake CA, each node impersonating its own pod's identity
    for id in [ALICE, BOB] {
        let req = t
            .istiod
            .wait_event("ca_request", Duration::from_secs(5), |e| {
                e["identity"] == id
            })
            .expect("CSR");
        assert_eq!(req["result"], "OK", "{req}");
        assert_eq!(req["metadata"]["ImpersonatedIdentity"], id, "{req}");
    }
    // every xDS response was ACKed with its nonce
    let responses = t.istiod.events(Some("xds_response")).expect("events");
    assert!(
        responses.len() >= 4,
        "two streams, two types: {responses:?}"
    );
    let requests = t.istiod.events(Some("xds_request")).expect("events");
    for r in &responses {
        assert!(
            requests.iter().any(|q| q["response_nonce"] == r["nonce"]
                && q["kind"] == "ack"
                && q["nonce_matches"] == true),
            "response {r} not ACKed"
        );
    }
}

/// Polls `check` every 20 ms until it holds; panics naming `what` after `within`. Returns the time
/// it took.
fn within(what: &str, within: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let start = std::time::Instant::now();
    while !check() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

/// The workload uids in node `n`'s `/config_dump`.
fn dumped_uids(n: &common::istiod::IstiodNode) -> Vec<String> {
    let admin: SocketAddr = "127.0.0.1:15000".parse().expect("addr");
    let (code, dump) = ztnode::lab::http::request(n.lab.node(), admin, "GET", "/config_dump", None)
        .expect("config_dump");
    assert_eq!(code, 200, "{dump}");
    dump["workloads"]
        .as_array()
        .map(|w| {
            w.iter()
                .filter_map(|w| w["uid"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn pushes_take_effect_within_a_second_and_survive_an_istiod_restart() {
    if !common::privileged("pushes_take_effect_within_a_second_and_survive_an_istiod_restart") {
        return;
    }
    let t = TwoNodes::start("xp", "", &[]);
    let server_ns = Netns::open(&t.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&t.client.netns_path).expect("client netns");
    serve_echo(&server_ns, SocketAddr::new(t.server.ip, 8080));
    let app = SocketAddr::new(t.server.ip, 8080);
    assert_eq!(
        try_round_trip(&client_ns, app, b"hi").as_deref(),
        Some(&b"hi"[..])
    );

    // a service VIP added: the client reaches the server through it
    let vip: SocketAddr = "10.96.0.50:80".parse().expect("vip");
    let server_world = |extra: &str| {
        format!(
            "{{\"workloads\": [{{\"name\": \"server\", \"namespace\": \"default\", \"serviceAccount\": \"bob\", \
             \"workloadIps\": [\"10.61.1.2\"], \"protocol\": \"HBONE\", \"node\": \"{}\"{extra}}}]}}",
            t.a.lab.node_name().trim_end_matches("-node")
        )
    };
    let mut body: serde_json::Value = serde_json::from_str(&server_world(
        ", \"services\": {\"default/server.default.svc.cluster.local\": {\"80\": 8080}}",
    ))
    .expect("json");
    body["services"] = serde_json::json!([{
        "name": "server", "namespace": "default",
        "hostname": "server.default.svc.cluster.local",
        "vips": ["/10.96.0.50"], "ports": {"80": 8080}
    }]);
    t.istiod
        .ok("POST", "/apply", Some(&body))
        .expect("apply service");
    let took = within("VIP reachable", Duration::from_secs(1), || {
        try_round_trip(&client_ns, vip, b"vip").is_some()
    });
    eprintln!("service VIP in effect after {took:?}");

    // a DENY policy added: new connections from alice are refused
    let deny = serde_json::json!({"policies": [{
        "name": "deny-alice", "namespace": "default", "scope": "Namespace", "action": "Deny",
        "rules": [[[{"principals": [{"Exact": "cluster.local/ns/default/sa/alice"}]}]]]
    }]});
    t.istiod
        .ok("POST", "/apply", Some(&deny))
        .expect("apply policy");
    let took = within("DENY in effect", Duration::from_secs(1), || {
        try_round_trip(&client_ns, app, b"x").is_none()
    });
    eprintln!("DENY in effect after {took:?}");
    t.istiod
        .ok(
            "POST",
            "/delete",
            Some(&serde_json::json!({"policies": ["default/deny-alice"]})),
        )
        .expect("delete policy");
    within("DENY removed", Duration::from_secs(1), || {
        try_round_trip(&client_ns, app, b"x").is_some()
    });

    // a malformed resource is NACKed and the last good state kept
    let server_uid = "Kubernetes//v1/Pod/default/server";
    let bad =
        serde_json::json!({"raw": [{"type": "address", "name": server_uid, "preset": "bad-ip"}]});
    t.istiod
        .ok("POST", "/apply", Some(&bad))
        .expect("apply bad resource");
    let nack = t
        .istiod
        .wait_event("xds_request", Duration::from_secs(5), |e| {
            e["kind"] == "nack"
        })
        .expect("NACK");
    assert!(
        nack["error_detail"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(server_uid)),
        "{nack}"
    );
    assert!(
        dumped_uids(&t.b).contains(&server_uid.to_owned()),
        "last good state kept"
    );
    assert_eq!(
        try_round_trip(&client_ns, app, b"still").as_deref(),
        Some(&b"still"[..])
    );
    t.istiod
        .ok(
            "POST",
            "/delete",
            Some(&serde_json::json!({"raw": [{"type": "address", "name": server_uid}]})),
        )
        .expect("drop the bad resource");

    within("every response answered", Duration::from_secs(2), || {
        unanswered(&t.istiod).is_empty()
    });

    // istiod restarts: both nodes resync with what they hold, and later pushes still apply
    let mut t = t;
    let last_seq = |t: &TwoNodes| {
        t.istiod
            .events(None)
            .expect("events")
            .iter()
            .filter_map(|e| e["seq"].as_u64())
            .max()
    };
    let before = last_seq(&t).expect("events before the restart");
    t.istiod.restart().expect("restart istiod");
    t.istiod
        .wait_event("xds_request", Duration::from_secs(10), |e| {
            e["seq"].as_u64().is_some_and(|s| s > before)
                && e["kind"] == "initial"
                && e["initial_resource_versions"]
                    .as_object()
                    .is_some_and(|v| v.contains_key(server_uid))
        })
        .expect("resync with initial_resource_versions");
    t.istiod
        .ok(
            "POST",
            "/delete",
            Some(&serde_json::json!({"workloads": [server_uid]})),
        )
        .expect("remove the server workload");
    within("workload removed on node B", Duration::from_secs(1), || {
        !dumped_uids(&t.b).contains(&server_uid.to_owned())
    });
    within(
        "every response answered after the restart",
        Duration::from_secs(2),
        || unanswered(&t.istiod).is_empty(),
    );
}

/// The xDS responses of the fake istiod's log that no request ACKed or NACKed by nonce.
fn unanswered(istiod: &ztnode::lab::istiod::FakeIstiod) -> Vec<serde_json::Value> {
    let requests = istiod.events(Some("xds_request")).expect("events");
    istiod
        .events(Some("xds_response"))
        .expect("events")
        .into_iter()
        .filter(|r| !requests.iter().any(|q| q["response_nonce"] == r["nonce"]))
        .collect()
}

#[test]
fn a_refused_token_fails_adds_clearly_and_keeps_a_restarted_node_unready() {
    if !common::privileged("a_refused_token_fails_adds_clearly_and_keeps_a_restarted_node_unready")
    {
        return;
    }
    let extra = "- name: carol\n  namespace: default\n  serviceAccount: carol\n  workloadIps: [10.61.2.3]\n  protocol: HBONE\n  node: NODE_B\n";
    let t = TwoNodes::start_with_world("xt", |_, b| extra.replace("NODE_B", b), &[]);
    let ready: SocketAddr = "127.0.0.1:15021".parse().expect("addr");
    let status = |n: &common::istiod::IstiodNode| {
        ztnode::lab::http::request(n.lab.node(), ready, "GET", "/healthz/ready", None)
            .expect("readiness")
            .0
    };
    within("node B ready", Duration::from_secs(5), || {
        status(&t.b) == 200
    });
    // the token file is re-read on every call: from now on istiod refuses it
    std::fs::write(t.dir.join("istio-token"), "stolen").expect("token");
    let err =
        t.b.lab
            .add_pod("carol", "default")
            .expect_err("ADD must fail closed");
    let msg = err.to_string();
    assert!(msg.contains("CA refused the token"), "{msg}");
    let line =
        t.b.wait_log(&["CA refused the token", "carol"], Duration::from_secs(5));
    assert!(line.contains("UNAUTHENTICATED"), "{line}");
    let refused = t
        .istiod
        .wait_event("ca_request", Duration::from_secs(5), |e| {
            e["result"] != "OK"
        })
        .expect("the refused CSR");
    assert_eq!(refused["result"], "UNAUTHENTICATED", "{refused}");

    // a node restarted with the refused token gets neither workloads nor certificates: its
    // enrolled pod stays captured but unserved, and the node is not ready
    let mut t = t;
    t.b.start();
    t.b.wait_log(
        &["xds stream failed", "unknown bearer token"],
        Duration::from_secs(10),
    );
    for _ in 0..10 {
        assert_ne!(status(&t.b), 200, "an enrolled pod without a certificate");
        std::thread::sleep(Duration::from_millis(100));
    }
    // the token is good again: the retry brings the pod and the node back
    std::fs::write(t.dir.join("istio-token"), common::istiod::TOKEN).expect("token");
    within("node B ready again", Duration::from_secs(20), || {
        status(&t.b) == 200
    });
}

/// `ztunnel proxy ztunnel` as Istio's chart runs it: the binary under the name `ztunnel`, the
/// chart's env (addresses without scheme, `ISTIO_META_CLUSTER_ID`, the pod's own identity, the
/// token and root at their default paths under the working dir `/` of the container, here a
/// temp dir), the agent's ZDS socket; workloads and certificates from the fake istiod.
#[test]
fn ztunnel_proxy_ztunnel_with_the_charts_env_serves_pods_from_istiod() {
    if !common::privileged("ztunnel_proxy_ztunnel_with_the_charts_env_serves_pods_from_istiod") {
        return;
    }
    use std::process::{Command, Stdio};
    use ztnode::lab::istiod::{FAKE_ISTIOD_SCRIPT, FakeIstiod, FakeIstiodOptions};
    use ztnode::lab::{LabOptions, ProcessGuard};

    let prefix = common::prefix("xz");
    let dir = std::env::temp_dir().join(format!("ztnode-e2e-ztunnel-{prefix}"));
    let _ = std::fs::remove_dir_all(&dir);
    let _dir = common::RemoveOnDrop(dir.clone());
    let run_dir = dir.join("run");
    let lab = Lab::new(LabOptions {
        prefix: prefix.clone(),
        ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
        run_dir: run_dir.clone(),
        subnet: "10.62.0.0/24".into(),
        cni_version: "1.0.0".into(),
    })
    .expect("lab");
    let workloads = [
        ("server", "default", "bob", "10.62.0.2".parse().expect("ip")),
        (
            "client",
            "default",
            "alice",
            "10.62.0.3".parse().expect("ip"),
        ),
    ];
    let world = ztnode::lab::local_config(&prefix, &workloads);
    let istiod = FakeIstiod::start(
        lab.node_name(),
        FAKE_ISTIOD_SCRIPT.as_ref(),
        &dir.join("istiod"),
        FakeIstiodOptions {
            world: Some(world.clone()),
            args: vec![
                "--token".into(),
                "chart-token".into(),
                "--require-cluster-id".into(),
                "Kubernetes".into(),
            ],
            ..Default::default()
        },
    )
    .expect("fake istiod");
    // the container's `/`: the projected token and istiod's root at ztunnel's default paths
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("var/run/secrets/tokens")).expect("dirs");
    std::fs::create_dir_all(root.join("var/run/secrets/istio")).expect("dirs");
    std::fs::write(
        root.join("var/run/secrets/tokens/istio-token"),
        "chart-token",
    )
    .expect("token");
    std::fs::copy(
        &istiod.root_cert,
        root.join("var/run/secrets/istio/root-cert.pem"),
    )
    .expect("root");

    // the agent (enrollment from its local config), serving ZDS
    let config = dir.join("agent-config.yaml");
    std::fs::write(&config, &world).expect("config");
    let zds = run_dir.join("ztunnel.sock");
    let agent_log = dir.join("agent.log");
    let mut agent = Command::new(env!("CARGO_BIN_EXE_ztnode"));
    agent
        .args(["agent", "--no-install", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(&run_dir)
        .env("ZTUNNEL_UDS_ADDRESS", &zds)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&agent_log).expect("log"));
    let _agent = ProcessGuard(lab.spawn_in_node(agent).expect("agent"));
    common::node::MeshNode::wait_log_in(
        &agent_log,
        &["plugin event socket ready"],
        Duration::from_secs(15),
    );

    let ztunnel = dir.join("ztunnel");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ztnode"), &ztunnel).expect("ztunnel name");
    let proxy_log = dir.join("ztunnel.log");
    let address = istiod.grpc.to_string();
    let mut proxy = Command::new(&ztunnel);
    proxy
        .args(["proxy", "ztunnel"])
        .current_dir(&root)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs([
            ("CA_ADDRESS", address.as_str()),
            ("XDS_ADDRESS", address.as_str()),
            ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
            ("ISTIO_META_ENABLE_HBONE", "true"),
            ("RUST_LOG", "info"),
            ("RUST_BACKTRACE", "1"),
            ("INPOD_ENABLED", "true"),
            ("TERMINATION_GRACE_PERIOD_SECONDS", "30"),
            ("ENABLE_ORIG_SRC", "true"),
            ("POD_NAME", "ztunnel-x1"),
            ("POD_NAMESPACE", "istio-system"),
            ("NODE_NAME", prefix.as_str()),
            ("INSTANCE_IP", "10.62.0.1"),
            ("SERVICE_ACCOUNT", "ztunnel"),
        ])
        .env("INPOD_UDS", &zds)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&proxy_log).expect("log"));
    let _proxy = ProcessGuard(lab.spawn_in_node(proxy).expect("ztunnel"));
    let wait = |needles: &[&str]| {
        common::node::MeshNode::wait_log_in(&proxy_log, needles, Duration::from_secs(15))
    };
    wait(&["snapshot received"]);
    // a setting ztunnel reads and ztnode does not is named once, not silently dropped
    wait(&["not supported by ztnode", "ENABLE_ORIG_SRC"]);

    let server = lab.add_pod("server", "default").expect("server");
    let client = lab.add_pod("client", "default").expect("client");
    let server_ns = Netns::open(&server.netns_path).expect("netns");
    let client_ns = Netns::open(&client.netns_path).expect("netns");
    let app = SocketAddr::new(server.ip, 8080);
    assert_eq!(round_trip(&client_ns, &server_ns, app, b"chart"), b"chart");
    let line = wait(&["connection complete", "direction=\"inbound\""]);
    assert!(line.contains(ALICE) && line.contains(BOB), "{line}");
    let node = istiod
        .wait_event("xds_node", Duration::from_secs(5), |_| true)
        .expect("node");
    assert_eq!(
        node["node"]["id"],
        "ztunnel~10.62.0.1~ztunnel-x1.istio-system~istio-system.svc.cluster.local",
        "{node}"
    );
    assert_eq!(
        node["node"]["metadata"]["NODE_NAME"],
        prefix.as_str(),
        "{node}"
    );
    assert_eq!(node["node"]["metadata"]["ENABLE_HBONE"], "true", "{node}");
    let csr = istiod
        .wait_event("ca_request", Duration::from_secs(5), |e| {
            e["identity"] == BOB
        })
        .expect("CSR");
    assert_eq!(csr["clusterid"], "Kubernetes", "{csr}");
    assert_eq!(csr["result"], "OK", "{csr}");
}

/// Short-lived certificates signed by an intermediate: leaves rotate at half life while
/// connections keep being made, and none fails.
#[test]
fn short_lived_intermediate_signed_certificates_rotate_without_a_failed_connection() {
    if !common::privileged(
        "short_lived_intermediate_signed_certificates_rotate_without_a_failed_connection",
    ) {
        return;
    }
    let t = TwoNodes::start_with_env(
        "xr",
        |_, _| String::new(),
        &["--intermediate"],
        &[("SECRET_TTL", "4s")],
    );
    let server_ns = Netns::open(&t.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&t.client.netns_path).expect("client netns");
    let app = SocketAddr::new(t.server.ip, 8080);
    serve_echo(&server_ns, app);
    let start = std::time::Instant::now();
    let mut made = 0;
    while start.elapsed() < Duration::from_secs(9) {
        assert_eq!(
            try_round_trip(&client_ns, app, b"rotate").as_deref(),
            Some(&b"rotate"[..]),
            "connection {made} failed after {:?}",
            start.elapsed()
        );
        made += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let issued = |id: &str| {
        t.istiod
            .events(Some("ca_request"))
            .expect("events")
            .iter()
            .filter(|e| e["identity"] == id && e["result"] == "OK")
            .inspect(|e| assert_eq!(e["chain_len"], 3, "leaf, intermediate, root: {e}"))
            .count()
    };
    // 4 s leaves refresh every 2 s: 9 s of traffic sees at least 3 more per identity
    for id in [ALICE, BOB] {
        assert!(issued(id) >= 4, "{id}: {} certificates", issued(id));
    }
    assert!(made > 50, "{made} connections");
}

/// `GET /healthz/ready` on node `n`: the status code.
fn readiness(n: &common::istiod::IstiodNode) -> u16 {
    let ready: SocketAddr = "127.0.0.1:15021".parse().expect("addr");
    ztnode::lab::http::request(n.lab.node(), ready, "GET", "/healthz/ready", None)
        .map(|(code, _)| code)
        .unwrap_or(0)
}

/// Over two minutes istiod is unreachable two ways: partitioned (packets dropped, istiod still
/// up), then down (connections refused). Pods that have certificates keep talking over HBONE, on a
/// long-lived connection and on new ones, from the cached workloads and certificates; both nodes
/// stay ready; a new pod, whose certificate cannot be fetched, fails closed naming the CA. Once
/// istiod is back, both nodes reconnect within the backoff's cap, keep what they held, and a push
/// takes effect. No plaintext crosses the client's bridge meanwhile.
#[test]
fn two_minutes_without_istiod_keep_known_pods_talking_and_new_ones_closed() {
    if !common::privileged("two_minutes_without_istiod_keep_known_pods_talking_and_new_ones_closed")
    {
        return;
    }
    let extra = "- name: carol\n  namespace: default\n  serviceAccount: carol\n  workloadIps: [10.61.2.3]\n  protocol: HBONE\n  node: NODE_B\n";
    let t = TwoNodes::start_with_world("xo", |_, b| extra.replace("NODE_B", b), &[]);
    let server_ns = Netns::open(&t.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&t.client.netns_path).expect("client netns");
    let app = SocketAddr::new(t.server.ip, 8080);
    serve_echo(&server_ns, app);
    let mut secrets: Vec<Vec<u8>> = Vec::new();
    let mut long = Lab::connect_from(&client_ns, app).expect("long-lived connection");
    long.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let exchange = |long: &mut std::net::TcpStream, what: &str, secrets: &mut Vec<Vec<u8>>| {
        let msg = format!("{what}: long-lived payload {}", secrets.len()).into_bytes();
        long.write_all(&msg)
            .expect("write on the long-lived connection");
        let mut back = vec![0u8; msg.len()];
        long.read_exact(&mut back)
            .unwrap_or_else(|e| panic!("{what}: the long-lived connection: {e}"));
        assert_eq!(back, msg, "{what}");
        secrets.push(msg);
    };
    exchange(&mut long, "before", &mut secrets);
    let capture = common::capture::BridgeCapture::start(&t.b.lab, "istiod-outage");
    assert_eq!((readiness(&t.a), readiness(&t.b)), (200, 200));

    let ca = t.istiod.grpc.to_string();
    let phase = |t: &TwoNodes,
                 long: &mut std::net::TcpStream,
                 name: &str,
                 length: Duration,
                 secrets: &mut Vec<Vec<u8>>| {
        let start = std::time::Instant::now();
        let mut add_failed = false;
        while start.elapsed() < length {
            let msg = format!("{name}: payload {}", secrets.len()).into_bytes();
            assert_eq!(
                try_round_trip(&client_ns, app, &msg).as_deref(),
                Some(msg.as_slice()),
                "{name}: a new connection after {:?}",
                start.elapsed()
            );
            secrets.push(msg);
            exchange(long, name, secrets);
            assert_eq!(
                (readiness(&t.a), readiness(&t.b)),
                (200, 200),
                "{name}: a node is not ready"
            );
            if !add_failed && start.elapsed() > Duration::from_secs(10) {
                let err =
                    t.b.lab
                        .add_pod("carol", "default")
                        .expect_err("a pod without a certificate must not start")
                        .to_string();
                assert!(
                    err.contains("CA") && err.contains(&ca),
                    "{name}: the error must name the CA {ca}: {err}"
                );
                eprintln!("{name}: ADD failed with {err}");
                add_failed = true;
            }
            std::thread::sleep(Duration::from_secs(5));
        }
        assert!(add_failed, "{name}: no ADD tried");
    };
    let mut t = t;
    let port = t.istiod.grpc.port();
    let partition =
        common::outage::Partition::start(&[t.a.lab.node_name(), t.b.lab.node_name()], port);
    phase(
        &t,
        &mut long,
        "partitioned",
        Duration::from_secs(60),
        &mut secrets,
    );
    t.istiod.stop();
    partition.heal();
    phase(&t, &mut long, "down", Duration::from_secs(65), &mut secrets);

    // istiod is back: both nodes reconnect within the backoff's cap (15 s), with what they hold
    let before = t
        .istiod
        .events(None)
        .expect("events")
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .max()
        .unwrap_or(0);
    t.istiod.restart().expect("restart istiod");
    let back = std::time::Instant::now();
    let node_name = |n: &common::istiod::IstiodNode| {
        n.env
            .iter()
            .find(|(k, _)| k == "NODE_NAME")
            .map(|(_, v)| v.clone())
            .expect("NODE_NAME")
    };
    let names = [node_name(&t.a), node_name(&t.b)];
    let took = within("both nodes reconnected", Duration::from_secs(30), || {
        let nodes = t.istiod.events(Some("xds_node")).expect("events");
        names.iter().all(|n| {
            nodes.iter().any(|e| {
                e["seq"].as_u64().is_some_and(|s| s > before)
                    && e["node"]["metadata"]["NODE_NAME"] == *n
            })
        })
    });
    eprintln!("both nodes reconnected {took:?} after istiod came back");
    let carol_uid = "Kubernetes//v1/Pod/default/carol".to_owned();
    assert!(dumped_uids(&t.b).contains(&carol_uid), "state kept");
    exchange(&mut long, "after", &mut secrets);
    // a push after the return takes effect, on new connections and on the long-lived one
    let deny = serde_json::json!({"policies": [{
        "name": "deny-alice", "namespace": "default", "scope": "Namespace", "action": "Deny",
        "rules": [[[{"principals": [{"Exact": "cluster.local/ns/default/sa/alice"}]}]]]
    }]});
    t.istiod
        .ok("POST", "/apply", Some(&deny))
        .expect("apply policy");
    let took = within("DENY in effect", Duration::from_secs(5), || {
        try_round_trip(&client_ns, app, b"x").is_none()
    });
    eprintln!(
        "a push took effect {took:?} after the reconnect ({:?} after istiod came back)",
        back.elapsed()
    );
    let mut buf = [0u8; 64];
    let closed = match long.write_all(b"denied") {
        Err(_) => true,
        Ok(()) => match long.read(&mut buf) {
            Ok(n) => n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        },
    };
    assert!(closed, "the DENY must close the long-lived connection");
    t.istiod
        .ok(
            "POST",
            "/delete",
            Some(&serde_json::json!({"policies": ["default/deny-alice"]})),
        )
        .expect("delete policy");
    within("DENY removed", Duration::from_secs(5), || {
        try_round_trip(&client_ns, app, b"x").is_some()
    });
    // the pod that could not start gets its certificate now and talks over HBONE
    let carol = t.b.lab.add_pod("carol", "default").expect("carol starts");
    let carol_ns = Netns::open(&carol.netns_path).expect("carol netns");
    let msg = b"carol after the outage".to_vec();
    assert_eq!(
        try_round_trip(&carol_ns, app, &msg).as_deref(),
        Some(msg.as_slice())
    );
    secrets.push(msg);
    let secrets: Vec<&[u8]> = secrets.iter().map(Vec::as_slice).collect();
    capture.check(&[t.server.ip, t.client.ip, carol.ip], &secrets);
}
