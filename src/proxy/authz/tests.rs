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
  authorizationPolicies: ["default/selected", "other/named"]
- uid: cluster1//v1/Pod/default/neighbour
  name: neighbour
  namespace: default
  serviceAccount: dave
  workloadIps: ["10.0.0.5"]
  protocol: HBONE
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

/// [`check`] of alice's connection (10.0.0.2) to the server's `port`.
fn alice_to_server(st: &ProxyState, port: u16) -> Result<(), Denied> {
    let id = alice();
    check(st, &workload(st, "server"), &from_alice(&id, port))
}

#[test]
fn no_policies_allow_everything() {
    let st = state("  []\n");
    assert_eq!(plaintext_to(&st, "server", 80), Ok(()));
}

#[test]
fn the_example_config_policy_allows_every_port_but_9999() {
    // ztunnel's examples/localhost.yaml policy
    let st = state(
        "- action: Allow\n  rules:\n  - - - notDestinationPorts: [9999]\n  name: deny-9999\n  namespace: default\n  scope: Namespace\n  dryRun: false\n",
    );
    let id = alice();
    assert_eq!(alice_to_server(&st, 80), Ok(()));
    assert_eq!(alice_to_server(&st, 9999), Err(Denied::NotAllowed));
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
    assert_eq!(
        alice_to_server(&st, 80),
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
    assert_eq!(plaintext_to(&st, "server", 80), Err(Denied::NotAllowed));
    assert_eq!(alice_to_server(&st, 80), Ok(()));

    let st = state(
        "- {name: not-alice, namespace: default, scope: Namespace, action: Deny, rules: [[[{notServiceAccounts: [{namespace: default, serviceAccount: alice}]}]]]}\n",
    );
    assert_eq!(
        plaintext_to(&st, "server", 80),
        Err(Denied::Explicit("default/not-alice".into()))
    );
    assert_eq!(alice_to_server(&st, 80), Ok(()));
}

#[test]
fn clauses_are_anded_and_matches_ored() {
    // port 80 AND (source in 10.0.0.0/24 OR namespace other)
    let st = state(
        "- name: p\n  namespace: default\n  scope: Namespace\n  action: Allow\n  rules:\n  - - [{destinationPorts: [80]}]\n    - [{sourceIps: [10.0.0.0/24]}, {namespaces: [{Exact: other}]}]\n",
    );
    assert_eq!(alice_to_server(&st, 80), Ok(()));
    assert_eq!(alice_to_server(&st, 81), Err(Denied::NotAllowed));
    assert_eq!(plaintext_to(&st, "server", 80), Err(Denied::NotAllowed));
}

#[test]
fn empty_rules_never_match_and_an_empty_clause_holds() {
    let st = state("- {name: none, namespace: default, scope: Global, action: Deny, rules: []}\n");
    assert_eq!(plaintext_to(&st, "server", 80), Ok(()));
    let st =
        state("- {name: all, namespace: default, scope: Global, action: Deny, rules: [[[]]]}\n");
    assert_eq!(
        plaintext_to(&st, "server", 80),
        Err(Denied::Explicit("default/all".into()))
    );
}

#[test]
fn a_deny_with_an_empty_match_denies_what_the_rest_of_its_rule_selects() {
    // issue 17: `rules: [[[{}]]]` allowed everything (the empty match was skipped, as in ztunnel)
    let st = state(
        "- {name: blank, namespace: default, scope: Namespace, action: Deny, rules: [[[{}]]]}\n",
    );
    assert_eq!(plaintext_to(&st, "server", 80), denied_by("default/blank"));
    assert_eq!(alice_to_server(&st, 80), denied_by("default/blank"));
    assert_eq!(
        plaintext_to(&st, "elsewhere", 80),
        Ok(()),
        "other namespace"
    );
    // port 9000 AND an empty match: only port 9000 is denied
    let st = state(
        "- {name: p9000, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [9000]}], [{}]]]}\n",
    );
    assert_eq!(
        plaintext_to(&st, "server", 9000),
        denied_by("default/p9000")
    );
    assert_eq!(plaintext_to(&st, "server", 80), Ok(()));
}

#[test]
fn a_deny_with_l7_attributes_denies_what_its_l4_parts_select() {
    // only L7 attributes: every connection in scope
    for m in [
        "{paths: [/admin]}",
        "{methods: [GET], hosts: [example.com]}",
        "{notPaths: [/healthz]}",
        "{headers: {x-user: [mallory]}}",
        "{requestPrincipals: [\"*\"]}",
    ] {
        let st = state(&format!(
            "- {{name: http, namespace: default, scope: Namespace, action: Deny, rules: [[[{m}]]]}}\n"
        ));
        assert_eq!(
            plaintext_to(&st, "server", 80),
            denied_by("default/http"),
            "{m}"
        );
        assert_eq!(alice_to_server(&st, 81), denied_by("default/http"), "{m}");
    }
    // L4 and L7 in one match: the L4 fields decide
    let st = state(
        "- {name: admin, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [9001], methods: [POST], paths: [/admin]}]]]}\n",
    );
    assert_eq!(
        plaintext_to(&st, "server", 9001),
        denied_by("default/admin")
    );
    assert_eq!(plaintext_to(&st, "server", 80), Ok(()));
    // an L7-only clause next to an L4 clause
    let st = state(
        "- {name: admin, namespace: default, scope: Namespace, action: Deny, rules: [[[{notNamespaces: [{Exact: default}]}], [{paths: [/admin]}]]]}\n",
    );
    assert_eq!(plaintext_to(&st, "server", 80), denied_by("default/admin"));
    assert_eq!(alice_to_server(&st, 80), Ok(()));
}

#[test]
fn an_allow_made_of_l7_or_empty_matches_allows_nothing() {
    for m in [
        "{}",
        "{paths: [/public]}",
        "{destinationPorts: [80], methods: [GET]}",
    ] {
        let st = state(&format!(
            "- {{name: http, namespace: default, scope: Namespace, action: Allow, rules: [[[{m}]]]}}\n"
        ));
        assert_eq!(
            plaintext_to(&st, "server", 80),
            Err(Denied::NotAllowed),
            "{m}"
        );
        assert_eq!(alice_to_server(&st, 80), Err(Denied::NotAllowed), "{m}");
    }
    // an L4 match next to an L7 one in the same clause still allows what it selects
    let st = state(
        "- {name: p, namespace: default, scope: Namespace, action: Allow, rules: [[[{paths: [/x]}, {destinationPorts: [80]}]]]}\n",
    );
    assert_eq!(plaintext_to(&st, "server", 80), Ok(()));
    assert_eq!(plaintext_to(&st, "server", 81), Err(Denied::NotAllowed));
}

#[test]
fn an_xds_deny_whose_http_rules_istiod_left_out_denies() {
    use crate::proxy::xds::convert::authorization;
    use crate::proxy::xds::proto::security as sec;
    // istiod's conversion of `to: [{operation: {methods: [GET]}}]` in a DENY: one clause with one
    // empty match (`authorization.go` `handleRule`)
    let xds = sec::Authorization {
        name: "no-get".into(),
        namespace: "default".into(),
        scope: sec::Scope::Namespace as i32,
        action: sec::Action::Deny as i32,
        rules: vec![sec::Rule {
            clauses: vec![sec::Clause {
                matches: vec![sec::Match::default()],
            }],
        }],
        dry_run: false,
        extensions: vec![],
    };
    let mut cfg = parse_local_config(WORKLOADS).expect("config");
    cfg.policies.push(authorization(&xds).expect("convert"));
    let st = ProxyState::from_config(&cfg).expect("state");
    assert_eq!(plaintext_to(&st, "server", 80), denied_by("default/no-get"));
    assert_eq!(plaintext_to(&st, "elsewhere", 80), Ok(()));
}

#[test]
fn a_policy_that_does_not_parse_fails_closed_in_its_scope_only() {
    let st = state(
        "- {name: typo, namespace: default, scope: Namespace, action: Deny, rules: [[[{sourceIp: [10.9.0.1]}]]]}\n\
         - {name: typo, namespace: other, scope: Namespace, action: Allow, rules: [[[{namespace: [{Exact: default}]}]]]}\n\
         - {name: dry, namespace: default, scope: Global, action: Deny, dryRun: true, rules: [[[{port: 80}]]]}\n\
         - {name: ok, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [81]}]]]}\n",
    );
    let invalid: Vec<_> = st
        .policies()
        .map(|p| (p.name.as_str(), p.invalid.is_some()))
        .collect();
    assert_eq!(
        invalid,
        [("typo", true), ("typo", true), ("dry", true), ("ok", false)]
    );
    let reason = st
        .policies()
        .find_map(|p| p.invalid.clone())
        .expect("invalid");
    assert!(
        reason.contains("policies[0].rules[0][0][0]")
            && reason.contains("unknown field `sourceIp`"),
        "{reason}"
    );
    // the invalid DENY denies everything in namespace default, the invalid ALLOW allows nothing in
    // namespace other, the dry-run one is still not enforced
    assert_eq!(plaintext_to(&st, "server", 80), denied_by("default/typo"));
    assert_eq!(alice_to_server(&st, 82), denied_by("default/typo"));
    assert_eq!(plaintext_to(&st, "elsewhere", 80), Err(Denied::NotAllowed));
}

#[test]
fn a_policy_without_a_readable_scope_or_action_fails_the_config() {
    let yaml = format!(
        "{WORKLOADS}policies:\n- {{name: ok, namespace: default, scope: Global, action: Deny, rules: []}}\n\
         - {{name: headless, namespace: default, scope: Global, action: Audit, rules: [[[{{paths: [1]}}]]]}}\n"
    );
    let e = parse_local_config(&yaml).expect_err("no action");
    assert!(e.to_string().contains("policies[1]"), "{e}");
}

#[test]
fn selector_policies_apply_only_to_workloads_that_name_them() {
    let st = state(
        "- {name: selected, namespace: default, scope: WorkloadSelector, action: Deny, rules: [[[{destinationPorts: [80]}]]]}\n",
    );
    assert_eq!(
        plaintext_to(&st, "server", 80),
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
    assert_eq!(plaintext_to(&st, "server", 80), Ok(()));
}

#[test]
fn not_destination_ips_and_destination_ips() {
    let st = state(
        "- {name: p, namespace: default, scope: Global, action: Allow, rules: [[[{destinationIps: [10.0.0.0/8], notDestinationIps: [10.0.0.3]}]]]}\n",
    );
    assert_eq!(plaintext_to(&st, "server", 80), Err(Denied::NotAllowed));
    let elsewhere = workload(&st, "elsewhere");
    let to_other = Connection {
        dst: SocketAddr::new("10.0.0.4".parse().expect("ip"), 80),
        ..plaintext(80)
    };
    assert_eq!(check(&st, &elsewhere, &to_other), Ok(()));
}

/// [`check`] of a plaintext connection (10.9.0.1) to the named workload's IP and `port`.
fn plaintext_to(st: &ProxyState, name: &str, port: u16) -> Result<(), Denied> {
    let w = workload(st, name);
    let conn = Connection {
        dst: SocketAddr::new(w.workload_ips[0], port),
        ..plaintext(port)
    };
    check(st, &w, &conn)
}

fn denied_by(key: &str) -> Result<(), Denied> {
    Err(Denied::Explicit(key.into()))
}

#[test]
fn global_policies_apply_in_every_namespace_and_selector_ones_only_where_named() {
    let st = state(
        "- {name: global, namespace: istio-system, scope: Global, action: Deny, rules: [[[{destinationPorts: [81]}]]]}\n\
         - {name: selected, namespace: default, scope: WorkloadSelector, action: Deny, rules: [[[{destinationPorts: [80]}]]]}\n",
    );
    assert_eq!(
        plaintext_to(&st, "elsewhere", 81),
        denied_by("istio-system/global")
    );
    assert_eq!(
        plaintext_to(&st, "server", 80),
        denied_by("default/selected")
    );
    // same namespace as the server, but it does not name the selector policy
    assert_eq!(plaintext_to(&st, "neighbour", 80), Ok(()));
}

#[test]
fn one_matching_allow_among_several_is_enough() {
    let st = state(
        "- {name: ports, namespace: default, scope: Namespace, action: Allow, rules: [[[{destinationPorts: [80]}]]]}\n\
         - {name: bob-only, namespace: default, scope: Namespace, action: Allow, rules: [[[{serviceAccounts: [{namespace: default, serviceAccount: bob}]}]]]}\n",
    );
    assert_eq!(alice_to_server(&st, 80), Ok(()));
    assert_eq!(alice_to_server(&st, 81), Err(Denied::NotAllowed));
}

#[test]
fn a_matching_dry_run_allow_does_not_allow() {
    let st = state(
        "- {name: dry, namespace: default, scope: Namespace, action: Allow, dryRun: true, rules: [[[{destinationPorts: [80]}]]]}\n\
         - {name: real, namespace: default, scope: Namespace, action: Allow, rules: [[[{destinationPorts: [81]}]]]}\n",
    );
    assert_eq!(plaintext_to(&st, "server", 80), Err(Denied::NotAllowed));
}

#[test]
fn principal_and_negated_identity_and_source_fields() {
    let cases: [(&str, bool, bool); 6] = [
        // (match, alice from 10.0.0.2 allowed, plaintext from 10.9.0.1 allowed)
        ("{principals: [{Suffix: /sa/alice}]}", true, false),
        (
            "{principals: [{Prefix: cluster.local/ns/other/}]}",
            false,
            false,
        ),
        (
            "{notPrincipals: [{Exact: cluster.local/ns/default/sa/alice}]}",
            false,
            true,
        ),
        ("{notNamespaces: [{Exact: default}]}", false, true),
        ("{notSourceIps: [10.0.0.0/24]}", false, true),
        ("{sourceIps: [10.9.0.0/16]}", false, true),
    ];
    for (m, alice_ok, plaintext_ok) in cases {
        let st = state(&format!(
            "- {{name: p, namespace: default, scope: Namespace, action: Allow, rules: [[[{m}]]]}}\n"
        ));
        assert_eq!(alice_to_server(&st, 80).is_ok(), alice_ok, "{m}: alice");
        assert_eq!(
            plaintext_to(&st, "server", 80).is_ok(),
            plaintext_ok,
            "{m}: plaintext"
        );
    }
}

#[test]
fn a_namespace_policy_without_namespace_and_a_named_one_apply_as_in_ztunnel() {
    // namespace "" is where ztunnel keeps global policies; a workload's named policies apply
    // whatever their scope
    let st = state(
        "- {name: rootless, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [82]}]]]}\n\
         - {name: named, namespace: other, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [83]}]]]}\n",
    );
    assert_eq!(plaintext_to(&st, "neighbour", 82), denied_by("/rootless"));
    // `other/named`: in its own namespace, and where a workload names it
    assert_eq!(plaintext_to(&st, "elsewhere", 83), denied_by("other/named"));
    assert_eq!(plaintext_to(&st, "server", 83), denied_by("other/named"));
    assert_eq!(plaintext_to(&st, "neighbour", 83), Ok(()));
}

#[test]
fn a_pod_without_its_record_is_refused_while_its_namespace_has_selector_policies() {
    let handoff = Workload::from_handoff(
        "cluster.local",
        "pod-uid",
        "late",
        "default",
        "erin",
        vec!["10.0.0.7".parse().expect("ip")],
    );
    let id = alice();
    let conn = from_alice(&id, 8080);
    // a selector policy in its namespace: only the missing record says whether it applies
    let st = state(
        "- {name: selected, namespace: default, scope: WorkloadSelector, action: Allow, rules: [[[{namespaces: [{Exact: other}]}]]]}\n",
    );
    assert_eq!(
        check_pod(&st, &handoff, &conn),
        Err(Denied::RecordPending("default".into()))
    );
    // a known workload goes through the normal check
    for name in ["server", "neighbour"] {
        let w = workload(&st, name);
        assert_eq!(check_pod(&st, &w, &conn), check(&st, &w, &conn), "{name}");
    }
    // no selector policy in its namespace: the namespace and global ones decide as usual
    let st = state(
        "- {name: ns-wide, namespace: default, scope: Namespace, action: Allow, rules: [[[{namespaces: [{Exact: default}]}]]]}\n",
    );
    assert_eq!(check_pod(&st, &handoff, &conn), Ok(()));
}
