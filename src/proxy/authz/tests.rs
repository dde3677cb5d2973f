use std::sync::Arc;

use super::*;
use crate::proxy::config::parse_local_config;

const WORKLOADS: &str = r#"
workloads:
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: bob
  workloadIps: ["10.0.0.3"]
  protocol: HBONE
  authorizationPolicies: ["default/selected"]
- uid: cluster1//v1/Pod/other/elsewhere
  name: elsewhere
  namespace: other
  serviceAccount: carol
  workloadIps: ["10.0.0.4"]
  protocol: HBONE
"#;

/// A state with the two workloads above and `policies` (a YAML list).
fn state(policies: &str) -> ProxyState {
    let yaml = format!("{WORKLOADS}policies:\n{policies}");
    let cfg = parse_local_config(&yaml).expect("config");
    ProxyState::from_config(&cfg).expect("state")
}

fn workload(st: &ProxyState, name: &str) -> Arc<Workload> {
    st.workloads()
        .find(|w| w.name == name)
        .cloned()
        .expect("workload")
}

fn alice() -> Identity {
    Identity {
        trust_domain: "cluster.local".into(),
        namespace: "default".into(),
        service_account: "alice".into(),
    }
}

/// From alice (10.0.0.2) to the server's port `port`.
fn from_alice(id: &Identity, port: u16) -> Connection<'_> {
    Connection {
        src_identity: Some(id),
        src_ip: "10.0.0.2".parse().expect("ip"),
        dst: SocketAddr::new("10.0.0.3".parse().expect("ip"), port),
    }
}

/// From a plaintext client (no identity) at 10.9.0.1.
fn plaintext(port: u16) -> Connection<'static> {
    Connection {
        src_identity: None,
        src_ip: "10.9.0.1".parse().expect("ip"),
        dst: SocketAddr::new("10.0.0.3".parse().expect("ip"), port),
    }
}

#[test]
fn no_policies_allow_everything() {
    let st = state("  []\n");
    let server = workload(&st, "server");
    assert_eq!(check(&st, &server, &plaintext(80)), Ok(()));
}

#[test]
fn the_example_config_policy_allows_every_port_but_9999() {
    // ztunnel's examples/localhost.yaml policy
    let st = state(
        "- action: Allow\n  rules:\n  - - - notDestinationPorts: [9999]\n  name: deny-9999\n  namespace: default\n  scope: Namespace\n  dryRun: false\n",
    );
    let server = workload(&st, "server");
    let id = alice();
    assert_eq!(check(&st, &server, &from_alice(&id, 80)), Ok(()));
    assert_eq!(
        check(&st, &server, &from_alice(&id, 9999)),
        Err(Denied::NotAllowed)
    );
    // a Namespace policy of `default` does not apply in `other`
    let elsewhere = workload(&st, "elsewhere");
    let to_other = Connection {
        dst: SocketAddr::new("10.0.0.4".parse().expect("ip"), 9999),
        ..from_alice(&id, 9999)
    };
    assert_eq!(check(&st, &elsewhere, &to_other), Ok(()));
}

#[test]
fn a_matching_deny_wins_over_a_matching_allow() {
    let st = state(
        "- {name: allow-all, namespace: default, scope: Global, action: Allow, rules: [[[{namespaces: [{Prefix: def}]}]]]}\n\
         - {name: no-alice, namespace: default, scope: Global, action: Deny, rules: [[[{principals: [{Exact: cluster.local/ns/default/sa/alice}]}]]]}\n",
    );
    let server = workload(&st, "server");
    let id = alice();
    assert_eq!(
        check(&st, &server, &from_alice(&id, 80)),
        Err(Denied::Explicit("default/no-alice".into()))
    );
    let bob = Identity {
        service_account: "bob".into(),
        ..alice()
    };
    assert_eq!(check(&st, &server, &from_alice(&bob, 80)), Ok(()));
}

#[test]
fn identity_fields_never_match_a_plaintext_peer_and_their_negations_hold() {
    let st = state(
        "- {name: ns, namespace: default, scope: Namespace, action: Allow, rules: [[[{namespaces: [Presence]}]]]}\n",
    );
    let server = workload(&st, "server");
    assert_eq!(check(&st, &server, &plaintext(80)), Err(Denied::NotAllowed));
    let id = alice();
    assert_eq!(check(&st, &server, &from_alice(&id, 80)), Ok(()));

    let st = state(
        "- {name: not-alice, namespace: default, scope: Namespace, action: Deny, rules: [[[{notServiceAccounts: [{namespace: default, serviceAccount: alice}]}]]]}\n",
    );
    let server = workload(&st, "server");
    assert_eq!(
        check(&st, &server, &plaintext(80)),
        Err(Denied::Explicit("default/not-alice".into()))
    );
    assert_eq!(check(&st, &server, &from_alice(&id, 80)), Ok(()));
}

#[test]
fn clauses_are_anded_and_matches_ored() {
    // port 80 AND (source in 10.0.0.0/24 OR namespace other)
    let st = state(
        "- name: p\n  namespace: default\n  scope: Namespace\n  action: Allow\n  rules:\n  - - [{destinationPorts: [80]}]\n    - [{sourceIps: [10.0.0.0/24]}, {namespaces: [{Exact: other}]}]\n",
    );
    let server = workload(&st, "server");
    let id = alice();
    assert_eq!(check(&st, &server, &from_alice(&id, 80)), Ok(()));
    assert_eq!(
        check(&st, &server, &from_alice(&id, 81)),
        Err(Denied::NotAllowed)
    );
    assert_eq!(check(&st, &server, &plaintext(80)), Err(Denied::NotAllowed));
}

#[test]
fn empty_rules_and_empty_matches_never_match() {
    let st = state(
        "- {name: none, namespace: default, scope: Global, action: Deny, rules: []}\n\
         - {name: blank, namespace: default, scope: Global, action: Deny, rules: [[[{}]]]}\n",
    );
    let server = workload(&st, "server");
    assert_eq!(check(&st, &server, &plaintext(80)), Ok(()));
    // an empty clause holds
    let st =
        state("- {name: all, namespace: default, scope: Global, action: Deny, rules: [[[]]]}\n");
    let server = workload(&st, "server");
    assert_eq!(
        check(&st, &server, &plaintext(80)),
        Err(Denied::Explicit("default/all".into()))
    );
}

#[test]
fn selector_policies_apply_only_to_workloads_that_name_them() {
    let st = state(
        "- {name: selected, namespace: default, scope: WorkloadSelector, action: Deny, rules: [[[{destinationPorts: [80]}]]]}\n",
    );
    let server = workload(&st, "server");
    assert_eq!(
        check(&st, &server, &plaintext(80)),
        Err(Denied::Explicit("default/selected".into()))
    );
    let elsewhere = workload(&st, "elsewhere");
    let to_other = Connection {
        dst: SocketAddr::new("10.0.0.4".parse().expect("ip"), 80),
        ..plaintext(80)
    };
    assert_eq!(check(&st, &elsewhere, &to_other), Ok(()));
}

#[test]
fn dry_run_policies_are_not_enforced() {
    let st = state(
        "- {name: would-deny, namespace: default, scope: Global, action: Deny, dryRun: true, rules: [[[{destinationPorts: [80]}]]]}\n\
         - {name: would-allow-nothing, namespace: default, scope: Global, action: Allow, dryRun: true, rules: []}\n",
    );
    let server = workload(&st, "server");
    assert_eq!(check(&st, &server, &plaintext(80)), Ok(()));
}

#[test]
fn not_destination_ips_and_destination_ips() {
    let st = state(
        "- {name: p, namespace: default, scope: Global, action: Allow, rules: [[[{destinationIps: [10.0.0.0/8], notDestinationIps: [10.0.0.3]}]]]}\n",
    );
    let server = workload(&st, "server");
    assert_eq!(check(&st, &server, &plaintext(80)), Err(Denied::NotAllowed));
    let elsewhere = workload(&st, "elsewhere");
    let to_other = Connection {
        dst: SocketAddr::new("10.0.0.4".parse().expect("ip"), 80),
        ..plaintext(80)
    };
    assert_eq!(check(&st, &elsewhere, &to_other), Ok(()));
}
