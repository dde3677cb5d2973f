//! The delta xDS client against the real fake istiod (`../shared/tools/fake-istiod`): initial
//! sync, ACKs with the nonce, pushes, NACKs with the last good state kept, reconnects and a
//! restarted server.
//!
//! Everything runs in a network namespace each test makes: fake istiod is started inside it on
//! 127.0.0.1, and the client runs on a thread that entered it, with its own tokio runtime. The
//! fixture's drop stops the client, then the server, then deletes the namespace (also on panic).
//! Needs root; without it the tests SKIP loudly, or fail when `CI` is set.

mod common;

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use ztnode::lab::istiod::{FAKE_ISTIOD_SCRIPT, FakeIstiod, FakeIstiodOptions, ScratchNetns};
use ztnode::netns::Netns;
use ztnode::proxy::control::{CallAuth, ControlEndpoint, RootSource};
use ztnode::proxy::state::{ProxyState, StateHandle};
use ztnode::proxy::xds::{self, NodeIdentity, NodeParams, XdsConfig};
use ztnode::ready::Readiness;

const ADDRESS: &str = "type.googleapis.com/istio.workload.Address";
const AUTHORIZATION: &str = "type.googleapis.com/istio.security.Authorization";
const TOKEN: &str = "xds-test-token";
const WORLD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/tools/fake-istiod/examples/world.yaml"
);
const SERVER_1: &str = "Kubernetes//v1/Pod/app/server-1";
const SYNC: Duration = Duration::from_secs(10);
const PUSH: Duration = Duration::from_secs(1);

/// The xDS client on a thread inside the test's netns; stopped (shutdown future) and joined on drop.
struct ClientThread {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Field order = drop order: client, server, namespace, files.
struct Fixture {
    _client: ClientThread,
    istiod: FakeIstiod,
    _ns: ScratchNetns,
    state: StateHandle,
    ready: Readiness,
    metrics: std::sync::Arc<ztnode::proxy::xds::metrics::XdsMetrics>,
    _dir: tempfile::TempDir,
}

impl ClientThread {
    fn start(netns: &Netns, cfg: XdsConfig, state: StateHandle, ready: &Readiness) -> ClientThread {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = xds::run(cfg, state, ready, async move {
            let _ = stopped.await;
        });
        let netns = netns.clone();
        let thread = std::thread::Builder::new()
            .name("xds-client".into())
            .spawn(move || {
                netns.enter().expect("enter the test netns");
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(run);
            })
            .expect("spawn the client thread");
        ClientThread {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for ClientThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Fixture {
    /// A netns `<tag><pid>`, fake istiod in it serving examples/world.yaml (token and cluster id
    /// required), and the client connected to it. `None`: not privileged (loud SKIP).
    fn start(tag: &str) -> Option<Fixture> {
        if !common::privileged(tag) {
            return None;
        }
        let _ = tracing_subscriber::fmt()
            .with_env_filter("ztnode=debug")
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().expect("tempdir");
        let ns = ScratchNetns::new(&common::prefix(tag)).expect("netns");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(FAKE_ISTIOD_SCRIPT);
        let istiod = FakeIstiod::start(
            &ns.name,
            &script,
            &dir.path().join("istiod"),
            FakeIstiodOptions {
                world: Some(std::fs::read_to_string(WORLD).expect("world.yaml")),
                args: vec![
                    "--token".into(),
                    TOKEN.into(),
                    "--require-cluster-id".into(),
                    "Kubernetes".into(),
                ],
                ..FakeIstiodOptions::default()
            },
        )
        .expect("fake istiod");
        let token = dir.path().join("token");
        std::fs::write(&token, TOKEN).expect("token");
        let endpoint = ControlEndpoint::new(
            &istiod.address(),
            RootSource::File(istiod.root_cert.clone()),
            None,
        )
        .expect("endpoint");
        let auth = CallAuth {
            token_file: Some(token),
            cluster_id: "Kubernetes".into(),
            headers: Vec::new(),
        };
        let node = NodeIdentity::ztunnel(&NodeParams {
            instance_ip: "10.0.0.5".into(),
            pod_name: "ztunnel-test".into(),
            pod_namespace: "istio-system".into(),
            node_name: "node-1".into(),
            ..NodeParams::default()
        });
        let state = StateHandle::new(ProxyState::default());
        let ready = Readiness::new();
        let cfg = XdsConfig::new(endpoint, auth, node);
        let metrics = cfg.metrics.clone();
        let client = ClientThread::start(&ns.netns, cfg, state.clone(), &ready);
        Some(Fixture {
            _client: client,
            istiod,
            _ns: ns,
            state,
            ready,
            metrics,
            _dir: dir,
        })
    }

    /// Waits until `pred` holds for the current state; returns how long it took.
    fn wait_state(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&ProxyState) -> bool,
    ) -> Duration {
        let start = Instant::now();
        loop {
            if pred(&self.state.load()) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "{what}: not within {timeout:?}; state: {:?}",
                self.state.load()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The client's `istio_xds_*` metrics as text: `(series, value)` pairs.
    fn metrics(&self) -> Vec<(String, u64)> {
        let mut registry = prometheus_client::registry::Registry::default();
        self.metrics
            .register(registry.sub_registry_with_prefix("istio"));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, v) = l.rsplit_once(' ')?;
                Some((series.to_owned(), v.parse().ok()?))
            })
            .collect()
    }

    /// Waits for the world of examples/world.yaml in the state.
    fn wait_world(&self) {
        self.wait_state("initial sync", SYNC, |st| {
            st.workloads().count() == 3 && st.services().count() == 1 && st.policies().count() == 2
        });
    }

    fn post(&self, path: &str, body: Value) -> Value {
        self.istiod.ok("POST", path, Some(&body)).expect(path)
    }

    fn last_seq(&self) -> u64 {
        let events = self.istiod.events(None).expect("events");
        events.last().and_then(|e| e["seq"].as_u64()).unwrap_or(0)
    }

    /// The `xds_request` answering the `xds_response` with `nonce` (waits for it).
    fn reply_to(&self, nonce: &str) -> Value {
        self.istiod
            .wait_event("xds_request", SYNC, |e| e["response_nonce"] == nonce)
            .unwrap_or_else(|e| panic!("no reply to {nonce}: {e}"))
    }

    /// Every response after `since` (a seq), waiting for each one's reply: (response, reply).
    fn replies_since(&self, since: u64) -> Vec<(Value, Value)> {
        let responses: Vec<Value> = self
            .istiod
            .events(Some("xds_response"))
            .expect("events")
            .into_iter()
            .filter(|e| e["seq"].as_u64() > Some(since))
            .collect();
        responses
            .into_iter()
            .map(|r| {
                let reply = self.reply_to(r["nonce"].as_str().expect("nonce"));
                (r, reply)
            })
            .collect()
    }

    /// The first `initial` request of `type_url` after `since` (a new stream's; waits for it).
    fn initial_after(&self, since: u64, type_url: &str) -> Value {
        self.istiod
            .wait_event("xds_request", SYNC, |e| {
                e["seq"].as_u64() > Some(since)
                    && e["kind"] == "initial"
                    && e["type_url"] == type_url
            })
            .expect("initial request")
    }

    /// The first response of `type_url` after `since` that satisfies `pred` (waits for it).
    fn response_after(&self, since: u64, type_url: &str, pred: impl Fn(&Value) -> bool) -> Value {
        self.istiod
            .wait_event("xds_response", SYNC, |e| {
                e["seq"].as_u64() > Some(since) && e["type_url"] == type_url && pred(e)
            })
            .expect("response")
    }
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|r| r["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn initial_sync_is_acked_with_each_nonce_and_makes_the_client_ready() {
    let Some(f) = Fixture::start("xdsinit") else {
        return;
    };
    assert_eq!(f.ready.pending_tasks().len(), 2);
    f.wait_world();
    let st = f.state.load();
    let server0 = st
        .workload_by_uid("Kubernetes//v1/Pod/app/server-0")
        .expect("server-0");
    assert_eq!(
        server0.workload_ips,
        ["10.244.1.11".parse::<std::net::IpAddr>().expect("ip")]
    );
    assert_eq!(
        server0.identity().to_string(),
        "spiffe://cluster.local/ns/app/sa/server"
    );
    let svc = st
        .service_by_key("app/server.app.svc.cluster.local")
        .expect("service");
    assert_eq!(
        st.service_by_vip("10.96.0.20".parse().expect("ip"))
            .expect("vip")
            .key(),
        svc.key()
    );
    assert_eq!(st.endpoints(&svc).len(), 2);
    let mut policies: Vec<String> = st
        .policies()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .collect();
    policies.sort();
    assert_eq!(policies, ["app/allow-client", "app/deny-9999"]);

    // ztunnel's message counters, by type URL
    let metrics = f.metrics();
    for url in [ADDRESS, AUTHORIZATION] {
        let value = |name: &str| {
            metrics
                .iter()
                .find(|(s, _)| *s == format!("{name}{{url=\"{url}\"}}"))
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("no {name} for {url}: {metrics:?}"))
        };
        assert!(value("istio_xds_message_total") >= 1, "{metrics:?}");
        assert!(value("istio_xds_message_bytes_total") > 0, "{metrics:?}");
    }

    // Both initial requests are wildcards with no held versions; the node went on the first.
    let initial: Vec<Value> = f
        .istiod
        .events(Some("xds_request"))
        .expect("events")
        .into_iter()
        .filter(|e| e["kind"] == "initial")
        .collect();
    assert_eq!(initial.len(), 2, "{initial:?}");
    for e in &initial {
        assert_eq!(e["wildcard"], true);
        assert!(
            e.get("subscribe").is_none() && e.get("initial_resource_versions").is_none(),
            "{e}"
        );
    }
    let node = &f.istiod.events(Some("xds_node")).expect("events")[0]["node"];
    assert_eq!(
        node["id"],
        "ztunnel~10.0.0.5~ztunnel-test.istio-system~istio-system.svc.cluster.local"
    );
    assert_eq!(node["metadata"]["NODE_NAME"], "node-1");
    assert_eq!(node["metadata"]["CLUSTER_ID"], "Kubernetes");
    let opened = &f.istiod.events(Some("xds_stream_opened")).expect("events")[0];
    assert_eq!(opened["clusterid"], "Kubernetes");

    // Every response is ACKed with its nonce, and readiness follows.
    let replies = f.replies_since(0);
    assert_eq!(replies.len(), 2);
    for (resp, reply) in &replies {
        assert_eq!(reply["kind"], "ack", "{reply}");
        assert_eq!(reply["nonce_matches"], true);
        assert_eq!(reply["type_url"], resp["type_url"]);
    }
    let deadline = Instant::now() + SYNC;
    while !f.ready.is_ready() {
        assert!(
            Instant::now() < deadline,
            "pending: {:?}",
            f.ready.pending_tasks()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let clients = f.istiod.ok("GET", "/clients", None).expect("clients");
    for t in [ADDRESS, AUTHORIZATION] {
        let ts = &clients["streams"][0]["types"][t];
        assert_eq!(ts["acked_nonce"], ts["last_nonce"], "{t}: {ts}");
        assert_eq!(ts["pending"], json!([]));
    }
}

#[test]
fn pushes_take_effect_within_a_second_and_are_acked() {
    let Some(f) = Fixture::start("xdspush") else {
        return;
    };
    f.wait_world();
    let since = f.last_seq();
    f.post(
        "/apply",
        json!({"workloads": [{
            "uid": "Kubernetes//v1/Pod/app/server-2", "name": "server-2", "namespace": "app",
            "serviceAccount": "server", "workloadIps": ["10.244.1.12"], "protocol": "HBONE",
            "node": "node-1", "services": {"app/server.app.svc.cluster.local": {"80": 8080}}
        }]}),
    );
    let took = f.wait_state("added workload", PUSH, |st| {
        st.workload_by_ip("10.244.1.12".parse().expect("ip"))
            .is_some()
    });
    eprintln!("add took {took:?}");
    let st = f.state.load();
    let svc = st
        .service_by_key("app/server.app.svc.cluster.local")
        .expect("service");
    assert_eq!(st.endpoints(&svc).len(), 3);

    f.post("/delete", json!({"workloads": [SERVER_1]}));
    let took = f.wait_state("removed workload", PUSH, |st| {
        st.workload_by_uid(SERVER_1).is_none()
    });
    eprintln!("delete took {took:?}");

    f.post(
        "/apply",
        json!({"policies": [{"name": "deny-9999", "namespace": "app", "scope": "Namespace",
            "action": "Deny", "rules": [[[{"destinationPorts": [9998, 9999]}]]]}]}),
    );
    f.wait_state("changed policy", PUSH, |st| {
        st.policies()
            .any(|p| p.name == "deny-9999" && p.rules[0][0][0].destination_ports == [9998, 9999])
    });

    let replies = f.replies_since(since);
    assert_eq!(replies.len(), 3, "{replies:?}");
    for (resp, reply) in &replies {
        assert_eq!(resp["reason"], "push");
        assert_eq!(reply["kind"], "ack", "{reply}");
        assert_eq!(reply["nonce_matches"], true);
    }
    assert_eq!(replies[1].1["acked_removed"], json!([SERVER_1]));
}

#[test]
fn malformed_resources_are_nacked_and_the_last_good_state_kept() {
    let Some(f) = Fixture::start("xdsnack") else {
        return;
    };
    f.wait_world();
    let version = f.state.version();
    let since = f.last_seq();
    // bad-ip shadows server-1 (a 3-byte address); an undecodable one is new; bad-enum shadows a policy.
    f.post(
        "/apply",
        json!({"raw": [
            {"type": "address", "name": SERVER_1, "preset": "bad-ip"},
            {"type": "address", "name": "bad-undecodable", "preset": "undecodable"},
            {"type": "authorization", "name": "app/deny-9999", "preset": "bad-enum"},
        ]}),
    );
    let resp = f.response_after(since, ADDRESS, |_| true);
    let reply = f.reply_to(resp["nonce"].as_str().expect("nonce"));
    assert_eq!(reply["kind"], "nack", "{reply}");
    assert_eq!(reply["error_detail"]["code"], 3);
    let msg = reply["error_detail"]["message"].as_str().expect("message");
    assert!(
        msg.contains(&format!(
            "{SERVER_1}: workload.addresses: failed to parse address, had 3 bytes"
        )),
        "{msg}"
    );
    assert!(msg.contains("bad-undecodable: decode: "), "{msg}");
    let resp = f.response_after(since, AUTHORIZATION, |_| true);
    let reply = f.reply_to(resp["nonce"].as_str().expect("nonce"));
    assert_eq!(reply["kind"], "nack", "{reply}");
    let msg = reply["error_detail"]["message"].as_str().expect("message");
    assert_eq!(
        msg,
        "app/deny-9999: authorization.scope: unknown enumeration value 99"
    );

    // The last good state stays: server-1 with its IP, the deny policy, nothing new.
    assert_eq!(f.state.version(), version, "nothing was applied");
    let st = f.state.load();
    let s1 = st.workload_by_uid(SERVER_1).expect("server-1 kept");
    assert_eq!(
        s1.workload_ips,
        ["10.244.2.11".parse::<std::net::IpAddr>().expect("ip")]
    );
    assert!(st.workload_by_uid("bad-undecodable").is_none());
    assert!(st.policies().any(|p| p.name == "deny-9999"));

    // A valid push after the NACK is applied and ACKed.
    let since = f.last_seq();
    f.post(
        "/delete",
        json!({"raw": [{"type": "address", "name": SERVER_1}]}),
    );
    let resp = f.response_after(since, ADDRESS, |_| true);
    assert_eq!(
        f.reply_to(resp["nonce"].as_str().expect("nonce"))["kind"],
        "ack"
    );
    let clients = f.istiod.ok("GET", "/clients", None).expect("clients");
    let last_nack = &clients["streams"][0]["types"][AUTHORIZATION]["last_nack"];
    assert_eq!(last_nack["code"], 3, "{clients}");
}

#[test]
fn reconnects_and_a_restarted_server_resync_with_the_held_versions() {
    let Some(mut f) = Fixture::start("xdsrecon") else {
        return;
    };
    f.wait_world();
    let resources = f.istiod.ok("GET", "/resources", None).expect("resources");
    let mut address_names = names(&resources[ADDRESS]);
    address_names.sort();
    assert_eq!(address_names.len(), 4);
    let version = f.state.version();

    // 1. The server drops the stream: the client comes back announcing what it holds, and the
    //    server has nothing to send.
    let since = f.last_seq();
    f.post("/disconnect", json!({}));
    let initial = f.initial_after(since, ADDRESS);
    let ended: u64 = f
        .metrics()
        .iter()
        .filter(|(s, _)| s.starts_with("istio_xds_connection_terminations_total{reason="))
        .map(|(_, v)| v)
        .sum();
    assert!(
        ended >= 1,
        "the dropped stream is counted: {:?}",
        f.metrics()
    );
    let mut announced: Vec<String> = initial["initial_resource_versions"]
        .as_object()
        .expect("initial_resource_versions")
        .keys()
        .cloned()
        .collect();
    announced.sort();
    assert_eq!(announced, address_names);
    for r in resources[ADDRESS].as_array().expect("resources") {
        let name = r["name"].as_str().expect("name");
        assert_eq!(
            initial["initial_resource_versions"][name], r["version"],
            "{name}"
        );
    }
    assert_eq!(
        f.initial_after(since, AUTHORIZATION)["initial_resource_versions"]
            .as_object()
            .map(|m| m.len()),
        Some(2)
    );
    let resp = f.response_after(since, ADDRESS, |_| true);
    assert_eq!(
        (resp["unchanged"].as_u64(), names(&resp["resources"]).len()),
        (Some(4), 0)
    );
    for (_, reply) in f.replies_since(since) {
        assert_eq!(reply["kind"], "ack", "{reply}");
    }
    assert_eq!(
        f.state.version(),
        version,
        "a resync without changes stores nothing"
    );

    // 2. A change that lives only in the running server, then a restart from the world file:
    //    meanwhile the state is kept; after it the client resyncs and drops the lost workload.
    f.post(
        "/apply",
        json!({"workloads": [{"uid": "Kubernetes//v1/Pod/app/extra", "name": "extra",
            "namespace": "app", "workloadIps": ["10.244.1.99"], "protocol": "HBONE"}]}),
    );
    f.wait_state("extra added", PUSH, |st| st.workloads().count() == 4);
    f.istiod.stop();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        f.state.load().workloads().count(),
        4,
        "the state survives the outage"
    );
    let since = f.last_seq();
    f.istiod.restart().expect("restart");
    let initial = f.initial_after(since, ADDRESS);
    assert_eq!(
        initial["initial_resource_versions"]
            .as_object()
            .map(|m| m.len()),
        Some(5),
        "{initial}"
    );
    let resp = f.response_after(since, ADDRESS, |_| true);
    assert_eq!(
        resp["removed_resources"],
        json!(["Kubernetes//v1/Pod/app/extra"])
    );
    assert_eq!(resp["unchanged"].as_u64(), Some(4));
    f.wait_state("extra removed after the restart", PUSH, |st| {
        st.workloads().count() == 3 && st.workload_by_uid("Kubernetes//v1/Pod/app/extra").is_none()
    });
    f.wait_world();
    for (_, reply) in f.replies_since(since) {
        assert_eq!(reply["kind"], "ack", "{reply}");
    }
}
