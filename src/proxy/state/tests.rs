use std::time::Duration;

use super::*;
use crate::proxy::config::{PolicyAction, parse_local_config};

const LOCALHOST_YAML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/testdata/ztunnel/localhost.yaml"
);

fn state(yaml: &str) -> Result<ProxyState, ConfigError> {
    ProxyState::from_config(&parse_local_config(yaml).expect("yaml parses"))
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn localhost_example_indexes() {
    let st = load_config_file(std::path::Path::new(LOCALHOST_YAML)).expect("load");
    let local = st.workload_by_ip(ip("127.0.0.1")).expect("127.0.0.1");
    assert_eq!(local.name, "local");
    assert_eq!(local.protocol, Protocol::Hbone);
    assert_eq!(
        local.identity().to_string(),
        "spiffe://cluster.local/ns/default/sa/default"
    );
    assert_eq!(local.trust_domain, "cluster.local");
    // v4-mapped v6 finds the same workload.
    let mapped = st.workload_by_ip(ip("::ffff:127.0.0.2")).expect("mapped");
    assert_eq!(mapped.name, "local-tcp");
    assert_eq!(mapped.protocol, Protocol::Tcp);
    assert!(st.workload_by_ip(ip("127.0.0.3")).is_none());

    assert_eq!(
        st.workload_by_name("default", "local-tcp").unwrap().uid,
        mapped.uid
    );
    assert!(st.workload_by_name("other", "local").is_none());
    assert_eq!(
        st.workload_by_uid("cluster1//v1/Pod/default/local")
            .unwrap()
            .name,
        "local"
    );

    let svc = st.service_by_vip(ip("127.10.0.1")).expect("vip");
    assert_eq!(svc.key(), "default/example.com");
    assert_eq!(svc.vips, vec![(String::new(), ip("127.10.0.1"))]);
    assert_eq!(
        svc.san_identities(),
        vec![
            "spiffe://cluster.local/ns/default/sa/local"
                .parse()
                .unwrap()
        ]
    );
    let eps: Vec<_> = st.endpoints(&svc).iter().map(|w| w.name.clone()).collect();
    assert_eq!(eps, vec!["local", "local-tcp"]);
    let remote = st.service_by_vip(ip("127.10.0.2")).expect("remote vip");
    assert_eq!(remote.vips[0].0, "remote");
    assert!(st.service_by_key("default/example2.com").is_some());

    assert_eq!(st.workloads().count(), 2);
    assert_eq!(st.services().count(), 2);
    assert_eq!(st.policies().count(), 1);
}

#[test]
fn defaults_are_applied() {
    let st =
        state("workloads:\n- name: a\n  namespace: ns\n  workloadIps: [\"::ffff:10.0.0.1\"]\n")
            .unwrap();
    let w = st.workload_by_name("ns", "a").unwrap();
    assert_eq!(w.service_account, "default");
    assert_eq!(w.trust_domain, "cluster.local");
    assert_eq!(w.protocol, Protocol::Tcp);
    assert_eq!(w.workload_ips, vec![ip("10.0.0.1")]);
    assert_eq!(
        w.identity(),
        Identity::new("cluster.local", "ns", "default")
    );
    let custom = state(
        "workloads:\n- name: a\n  namespace: ns\n  serviceAccount: sa\n  trustDomain: example.org\n",
    )
    .unwrap();
    assert_eq!(
        custom.workloads().next().unwrap().identity().to_string(),
        "spiffe://example.org/ns/ns/sa/sa"
    );
}

#[test]
fn duplicate_workload_ip_names_both() {
    let err = state(
        "workloads:\n- name: a\n  namespace: ns\n  workloadIps: [\"10.0.0.1\"]\n- name: b\n  namespace: ns\n  workloadIps: [\"10.0.0.2\", \"::ffff:10.0.0.1\"]\n",
    )
    .unwrap_err();
    let t = err.to_string();
    assert!(
        matches!(err, ConfigError::DuplicateWorkloadIp { .. }),
        "{t}"
    );
    for needle in ["10.0.0.1", "workloads[0] (ns/a)", "workloads[1] (ns/b)"] {
        assert!(t.contains(needle), "{t:?} lacks {needle:?}");
    }
}

#[test]
fn host_network_workloads_may_share_ips() {
    let st = state(
        "workloads:\n- name: a\n  namespace: ns\n  networkMode: HostNetwork\n  workloadIps: [\"10.0.0.1\"]\n- name: b\n  namespace: ns\n  networkMode: HostNetwork\n  workloadIps: [\"10.0.0.1\"]\n",
    )
    .unwrap();
    assert!(st.workload_by_ip(ip("10.0.0.1")).is_none());
}

#[test]
fn other_duplicates_are_rejected() {
    let e =
        state("workloads:\n- uid: u\n  namespace: ns\n- uid: u\n  namespace: ns\n").unwrap_err();
    assert!(matches!(e, ConfigError::DuplicateWorkloadUid { .. }), "{e}");
    let e =
        state("workloads:\n- name: a\n  namespace: ns\n- name: a\n  namespace: ns\n").unwrap_err();
    assert!(
        matches!(e, ConfigError::DuplicateWorkloadName { .. }),
        "{e}"
    );
    let svc = |name: &str, host: &str, vip: &str| {
        format!("- name: {name}\n  namespace: ns\n  hostname: {host}\n  vips: [\"{vip}\"]\n")
    };
    let e = state(&format!(
        "services:\n{}{}",
        svc("a", "a.example", "/10.96.0.1"),
        svc("b", "a.example", "/10.96.0.2")
    ))
    .unwrap_err();
    assert!(e.to_string().contains("ns/a.example"), "{e}");
    assert!(matches!(e, ConfigError::DuplicateService { .. }), "{e}");
    let e = state(&format!(
        "services:\n{}{}",
        svc("a", "a.example", "/10.96.0.1"),
        svc("b", "b.example", "net2/10.96.0.1")
    ))
    .unwrap_err();
    assert!(matches!(e, ConfigError::DuplicateVip { .. }), "{e}");
    assert!(e.to_string().contains("services[1] (ns/b.example)"), "{e}");
    // one service listing a VIP twice (found by the local_config fuzz target: the lenient build
    // indexed the service before it was stored)
    let twice = "services:\n- name: a\n  namespace: ns\n  hostname: a.example\n  vips: [\"/10.96.0.1\", \"/10.96.0.1\"]\n";
    let e = state(twice).unwrap_err();
    assert!(e.to_string().contains("services[0] (ns/a.example)"), "{e}");
    let cfg = crate::proxy::config::parse_local_config(twice).expect("parse");
    let (lenient, conflicts) = ProxyState::from_config_lenient(&cfg);
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    assert_eq!(lenient.services.len(), 1);
    let policy =
        |ns: &str| format!("- {{name: p, namespace: {ns}, scope: Namespace, action: Deny}}\n");
    let e = state(&format!("policies:\n{}{}", policy("ns"), policy("ns"))).unwrap_err();
    assert!(matches!(e, ConfigError::DuplicatePolicy { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "policies[1]: policy ns/p is already defined by policies[0]"
    );
    // the same name in another namespace is another policy
    let st = state(&format!("policies:\n{}{}", policy("ns"), policy("other"))).unwrap();
    assert_eq!(st.policies().count(), 2);
}

#[test]
fn explicit_endpoints_count() {
    let st = state(
        "workloads:\n- uid: u1\n  name: a\n  namespace: ns\n- uid: u2\n  name: b\n  namespace: ns\nservices:\n- name: s\n  namespace: ns\n  hostname: s.example\n  endpoints:\n    u2: {workloadUid: u2}\n",
    )
    .unwrap();
    let svc = st.service_by_key("ns/s.example").unwrap();
    let eps: Vec<_> = st.endpoints(&svc).iter().map(|w| w.uid.clone()).collect();
    assert_eq!(eps, vec!["u2"]);
}

#[test]
fn handle_swaps_and_notifies() {
    let h = StateHandle::new(ProxyState::default());
    let mut rx = h.subscribe();
    assert_eq!(*rx.borrow_and_update(), 0);
    let clone = h.clone();
    clone.store(state("workloads:\n- name: a\n  namespace: ns\n").unwrap());
    assert!(rx.has_changed().unwrap());
    assert_eq!(*rx.borrow_and_update(), 1);
    assert_eq!(h.load().workloads().count(), 1);
    assert_eq!(h.version(), 1);
}

/// Waits (bounded) until the handle's state satisfies `pred`, re-checking on every store.
async fn wait_for_state(
    handle: &StateHandle,
    rx: &mut watch::Receiver<u64>,
    pred: impl Fn(&ProxyState) -> bool,
) {
    let wait = async {
        while !pred(&handle.load()) {
            rx.changed().await.expect("sender alive");
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("expected state change in time");
}

/// Replaces the file in one step so the watcher never reads a half-written file.
fn replace(path: &std::path::Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn watcher_reloads_and_keeps_last_good_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("local.yaml");
    let one = "workloads:\n- name: a\n  namespace: ns\n  workloadIps: [\"10.0.0.1\"]\n";
    std::fs::write(&path, one).unwrap();
    let handle = StateHandle::new(load_config_file(&path).unwrap());
    let mut rx = handle.subscribe();
    let task = tokio::spawn(watch_config_file(
        path.clone(),
        handle.clone(),
        Duration::from_millis(20),
    ));

    // A valid edit is picked up.
    let two = format!("{one}- name: b\n  namespace: ns\n  workloadIps: [\"10.0.0.2\"]\n");
    replace(&path, &two);
    wait_for_state(&handle, &mut rx, |st| {
        st.workload_by_ip(ip("10.0.0.2")).is_some()
    })
    .await;

    // A bad edit (duplicate IP) keeps the last good state; a later good edit applies.
    let bad = format!("{two}- name: c\n  namespace: ns\n  workloadIps: [\"10.0.0.1\"]\n");
    replace(&path, &bad);
    replace(&path, "workloads: [\n");
    std::fs::remove_file(&path).unwrap();
    let three = format!("{one}- name: d\n  namespace: ns\n  workloadIps: [\"10.0.0.4\"]\n");
    replace(&path, &three);
    wait_for_state(&handle, &mut rx, |st| {
        st.workload_by_ip(ip("10.0.0.4")).is_some()
    })
    .await;
    let st = handle.load();
    assert!(st.workload_by_ip(ip("10.0.0.2")).is_none());
    assert!(
        st.workload_by_name("ns", "c").is_none(),
        "bad edit never applied"
    );
    assert_eq!(st.workloads().count(), 2);
    task.abort();
}

#[tokio::test]
async fn watcher_ignores_invalid_edits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("local.yaml");
    let good = "workloads:\n- name: a\n  namespace: ns\n";
    std::fs::write(&path, good).unwrap();
    let handle = StateHandle::new(load_config_file(&path).unwrap());
    let mut rx = handle.subscribe();
    let task = tokio::spawn(watch_config_file(
        path.clone(),
        handle.clone(),
        Duration::from_millis(10),
    ));
    replace(
        &path,
        "workloads:\n- name: a\n  namespace: ns\n  bogus: 1\n",
    );
    // Let the watcher see the bad file several times; then a marker edit proves it is alive.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(handle.version(), 0, "invalid edit must not be stored");
    assert_eq!(handle.load().workloads().next().unwrap().name, "a");
    replace(&path, "workloads:\n- name: z\n  namespace: ns\n");
    wait_for_state(&handle, &mut rx, |st| {
        st.workload_by_name("ns", "z").is_some()
    })
    .await;
    assert_eq!(handle.version(), 1);
    task.abort();
}

#[test]
fn lenient_build_lets_the_later_duplicate_win_and_reports_it() {
    let cfg = parse_local_config(
        "workloads:\n- name: a\n  namespace: ns\n  workloadIps: [\"10.0.0.1\"]\n- name: b\n  namespace: ns\n  workloadIps: [\"10.0.0.1\"]\n\
         services:\n- {name: s, namespace: ns, hostname: h1, vips: [\"/10.96.0.1\"]}\n- {name: t, namespace: ns, hostname: h2, vips: [\"/10.96.0.1\"]}\n\
         policies:\n- {name: p, namespace: ns, scope: Namespace, action: Allow}\n- {name: p, namespace: ns, scope: Namespace, action: Deny}\n",
    )
    .expect("yaml parses");
    assert!(ProxyState::from_config(&cfg).is_err());
    let (st, conflicts) = ProxyState::from_config_lenient(&cfg);
    assert_eq!(conflicts.len(), 3, "{conflicts:?}");
    assert_eq!(st.workload_by_ip(ip("10.0.0.1")).unwrap().name, "b");
    assert_eq!(st.service_by_vip(ip("10.96.0.1")).unwrap().hostname, "h2");
    let policies: Vec<_> = st.policies().collect();
    assert_eq!(policies.len(), 1);
    assert_eq!(policies[0].action, PolicyAction::Deny);
}

#[test]
fn lenient_build_replaces_each_duplicate_policy_in_place() {
    // two duplicate pairs, the second after a distinct policy: [a, a', b, c, b']
    let cfg = parse_local_config(
        "policies:\n\
         - {name: a, namespace: ns, scope: Namespace, action: Allow}\n\
         - {name: a, namespace: ns, scope: Namespace, action: Deny}\n\
         - {name: b, namespace: ns, scope: Namespace, action: Allow}\n\
         - {name: c, namespace: ns, scope: Namespace, action: Deny}\n\
         - {name: b, namespace: ns, scope: Namespace, action: Deny}\n",
    )
    .expect("yaml parses");
    let (st, conflicts) = ProxyState::from_config_lenient(&cfg);
    assert_eq!(conflicts.len(), 2, "{conflicts:?}");
    let got: Vec<_> = st.policies().map(|p| (p.name.as_str(), p.action)).collect();
    assert_eq!(
        got,
        [
            ("a", PolicyAction::Deny),
            ("b", PolicyAction::Deny),
            ("c", PolicyAction::Deny)
        ]
    );
}
