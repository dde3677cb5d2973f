use std::net::IpAddr;

use super::*;

const LOCALHOST_YAML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/testdata/ztunnel/localhost.yaml"
);

fn err_text(yaml: &str) -> String {
    match parse_local_config(yaml) {
        Ok(cfg) => panic!("expected an error, parsed {cfg:?}"),
        Err(e) => {
            eprintln!("{e}");
            e.to_string()
        }
    }
}

fn assert_mentions(text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "error {text:?} does not mention {n:?}");
    }
}

const MINIMAL_WORKLOAD: &str = "workloads:\n- name: a\n  namespace: default\n";

#[test]
fn ztunnel_example_loads_unchanged() {
    let yaml = std::fs::read_to_string(LOCALHOST_YAML).expect("read localhost.yaml");
    let cfg = parse_local_config(&yaml).expect("parse localhost.yaml");

    assert_eq!(cfg.workloads.len(), 2);
    let w = &cfg.workloads[0];
    assert_eq!(w.uid, "cluster1//v1/Pod/default/local");
    assert_eq!(w.name, "local");
    assert_eq!(w.namespace, "default");
    assert_eq!(w.service_account, "default");
    assert_eq!(w.workload_ips, vec!["127.0.0.1".parse::<IpAddr>().unwrap()]);
    assert_eq!(w.protocol, Protocol::Hbone);
    assert_eq!(w.node, "local");
    assert_eq!(w.capacity, 1);
    let key: NamespacedHostname = "default/example.com".parse().unwrap();
    assert_eq!(w.services[&key].get(&80), Some(&8080));
    assert_eq!(w.services.len(), 2);
    assert_eq!(cfg.workloads[1].protocol, Protocol::Tcp);

    assert_eq!(cfg.services.len(), 2);
    let s = &cfg.services[0];
    assert_eq!(s.hostname, "example.com");
    assert_eq!(
        s.vips,
        vec![NetworkAddress {
            network: String::new(),
            address: "127.10.0.1".parse().unwrap()
        }]
    );
    assert_eq!(s.ports.get(&80), Some(&8080));
    assert_eq!(
        s.subject_alt_names,
        vec!["spiffe://cluster.local/ns/default/sa/local".to_owned()]
    );
    assert!(s.canonical);
    assert_eq!(cfg.services[1].vips[0].network, "remote");

    assert_eq!(cfg.policies.len(), 1);
    let p = &cfg.policies[0];
    assert_eq!(p.name, "deny-9999");
    assert_eq!(p.scope, PolicyScope::Namespace);
    assert_eq!(p.action, PolicyAction::Allow);
    assert!(!p.dry_run);
    assert_eq!(p.rules[0][0][0].not_destination_ports, vec![9999]);
}

#[test]
fn empty_document_is_empty_config() {
    assert_eq!(parse_local_config("").unwrap(), LocalConfig::default());
    assert_eq!(
        parse_local_config("# nothing\n").unwrap(),
        LocalConfig::default()
    );
}

#[test]
fn unknown_top_level_key_is_named() {
    let t = err_text("workloads: []\nworkload: []\n");
    assert_mentions(&t, &["unknown field `workload`"]);
}

#[test]
fn unknown_workload_key_is_named_with_place() {
    let yaml = format!("{MINIMAL_WORKLOAD}- name: b\n  namespace: default\n  fooBar: 1\n");
    let t = err_text(&yaml);
    assert_mentions(&t, &["workloads[1]", "unknown field `fooBar`"]);
}

#[test]
fn bad_protocol_is_named() {
    let yaml = format!("{MINIMAL_WORKLOAD}  protocol: HBONEX\n");
    let t = err_text(&yaml);
    assert_mentions(&t, &["workloads[0].protocol", "HBONEX"]);
}

#[test]
fn bad_workload_ip_is_named() {
    let yaml = format!("{MINIMAL_WORKLOAD}  workloadIps: [\"10.0.0.1\", \"10.0.0.300\"]\n");
    let t = err_text(&yaml);
    assert_mentions(&t, &["workloads[0].workloadIps[1]", "invalid IP address"]);
}

#[test]
fn bad_vip_is_named() {
    let base = "services:\n- name: s\n  namespace: default\n  hostname: s.example\n";
    let t = err_text(&format!("{base}  vips: [\"127.10.0.1\"]\n"));
    assert_mentions(&t, &["services[0].vips[0]", "network/ip"]);
    let t = err_text(&format!("{base}  vips: [\"net/127.10.0.x\"]\n"));
    assert_mentions(&t, &["services[0].vips[0]", "bad IP"]);
}

#[test]
fn bad_port_is_named() {
    let base = "services:\n- name: s\n  namespace: default\n  hostname: s.example\n";
    let t = err_text(&format!("{base}  ports:\n    80: 70000\n"));
    assert_mentions(&t, &["services[0].ports", "70000"]);
    let t = err_text(&format!(
        "{MINIMAL_WORKLOAD}  services:\n    \"default/x\":\n      -1: 80\n"
    ));
    assert_mentions(&t, &["workloads[0].services", "-1"]);
}

#[test]
fn wrong_type_is_named() {
    let t = err_text(&format!("{MINIMAL_WORKLOAD}  capacity: lots\n"));
    assert_mentions(&t, &["workloads[0].capacity", "invalid type"]);
    let t = err_text("workloads:\n  name: a\n");
    assert_mentions(&t, &["workloads", "invalid type"]);
}

#[test]
fn bad_service_key_is_named() {
    let t = err_text(&format!(
        "{MINIMAL_WORKLOAD}  services:\n    \"example.com\":\n      80: 8080\n"
    ));
    assert_mentions(&t, &["workloads[0].services", "namespace/hostname"]);
}

#[test]
fn missing_and_empty_required_fields_are_named() {
    let t = err_text("workloads:\n- name: a\n");
    assert_mentions(&t, &["workloads[0]", "missing field `namespace`"]);
    let t = err_text("workloads:\n- name: a\n  namespace: \"\"\n");
    assert_mentions(&t, &["workloads[0]", "`namespace` must not be empty"]);
    let t = err_text("services:\n- name: s\n  namespace: default\n  hostname: \"\"\n");
    assert_mentions(&t, &["services[0]", "`hostname`"]);
}

#[test]
fn unknown_keys_in_nested_records_are_named() {
    let t = err_text(&format!(
        "{MINIMAL_WORKLOAD}  locality:\n    region: r\n    planet: earth\n"
    ));
    assert_mentions(&t, &["workloads[0].locality", "unknown field `planet`"]);
    // in a policy body, an unknown key fails that policy only (kept as a fail-closed stand-in),
    // with the same place in its reason
    let cfg = parse_local_config(
        "policies:\n- name: p\n  scope: Global\n  action: Deny\n  rules: [[[{sourceIp: [\"1.2.3.4\"]}]]]\n\
         - {name: q, scope: Global, action: Allow, rules: [[[{destinationPorts: [80]}]]]}\n",
    )
    .unwrap();
    let p = &cfg.policies[0];
    assert_eq!(p.rules, fail_closed_rules(PolicyAction::Deny));
    let reason = p.invalid.as_deref().unwrap();
    assert_mentions(
        reason,
        &["policies[0].rules[0][0][0]", "unknown field `sourceIp`"],
    );
    assert_eq!(cfg.policies[1].invalid, None);
    assert_eq!(cfg.policies[1].rules[0][0][0].destination_ports, [80]);
    // outside a match, the reason names the key
    let cfg = parse_local_config(
        "policies:\n- {name: p, scope: Global, action: Allow, selector: {app: x}, rules: []}\n",
    )
    .unwrap();
    assert_eq!(
        cfg.policies[0].rules,
        fail_closed_rules(PolicyAction::Allow)
    );
    assert_mentions(
        cfg.policies[0].invalid.as_deref().unwrap(),
        &["policies[0]", "unknown field `selector`"],
    );
    // an error outside the policies still fails the config, with the parser's place
    let t = err_text(&format!(
        "{MINIMAL_WORKLOAD}  planet: earth\npolicies:\n- {{name: p, scope: Global, action: Allow, bogus: 1}}\n"
    ));
    assert_mentions(&t, &["workloads[0]", "unknown field `planet`", "line"]);
}

#[test]
fn l7_attributes_are_named_in_the_match_and_typed() {
    let cfg = parse_local_config(
        "policies:\n- {name: p, scope: Global, action: Deny, rules: [[[{destinationPorts: [80], paths: [/a], \
         notMethods: [GET], headers: {x-a: [b]}, hosts: []}]]]}\n",
    )
    .unwrap();
    let m = &cfg.policies[0].rules[0][0][0];
    assert_eq!(
        m.l7_attributes,
        [
            L7Attribute::NotMethods,
            L7Attribute::Paths,
            L7Attribute::Headers
        ],
        "in enum order, empty ones left out"
    );
    assert!(!m.is_l4_empty());
    let dump = serde_json::to_value(m).unwrap();
    assert_eq!(
        dump,
        serde_json::json!({"destinationPorts": [80], "l7Attributes": ["notMethods", "paths", "headers"]})
    );
    // a wrongly typed L7 value makes the policy invalid, like any other key
    let cfg = parse_local_config(
        "policies:\n- {name: p, scope: Global, action: Deny, rules: [[[{paths: /a}]]]}\n",
    )
    .unwrap();
    assert_mentions(
        cfg.policies[0].invalid.as_deref().unwrap(),
        &["policies[0].rules[0][0][0].paths", "expected a sequence"],
    );
}

#[test]
fn full_workload_and_service_fields_parse() {
    let yaml = r#"
workloads:
- uid: c//v1/Pod/ns1/p1
  name: p1
  namespace: ns1
  serviceAccount: sa1
  workloadIps: ["10.0.0.1", "fd00::1"]
  protocol: HBONE
  networkMode: Standard
  node: n1
  network: net1
  trustDomain: example.org
  hostname: p1.example
  waypoint:
    destination: ns1/waypoint.ns1.svc.cluster.local
    hboneMtlsPort: 15008
  networkGateway:
    destination: net1/10.9.9.9
  nativeTunnel: true
  applicationTunnel: {protocol: PROXY, port: 15088}
  authorizationPolicies: ["ns1/pol"]
  canonicalName: app
  canonicalRevision: v1
  workloadName: app-deploy
  workloadType: deployment
  clusterId: Kubernetes
  locality: {region: r, zone: z, subzone: s}
  status: Unhealthy
  capacity: 3
  services:
    "ns1/svc.example": {80: 8080, 443: 8443}
services:
- name: svc
  namespace: ns1
  hostname: svc.example
  vips: ["net1/10.96.0.1", "/fd00::96:1"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://example.org/ns/ns1/sa/sa1"]
  waypoint: {destination: "/10.0.0.99"}
  loadBalancer: {routingPreferences: [Zone, Node], mode: Failover, healthPolicy: AllowAll}
  ipFamilies: Dual
  canonical: true
  visibility: Namespace
  endpoints:
    c//v1/Pod/ns1/p1: {workloadUid: c//v1/Pod/ns1/p1, port: {80: 8080}, status: Healthy}
policies:
- name: pol
  namespace: ns1
  scope: WorkloadSelector
  action: Deny
  dryRun: true
  rules:
  - - - namespaces: [{Prefix: "ns"}]
        notPrincipals: [Presence, {Suffix: "/sa/bad"}, {Presence: {}}]
        principals: [!Exact "cluster.local/ns/ns1/sa/sa1", {Exact: x}]
        serviceAccounts: [{namespace: ns1, serviceAccount: sa1}]
        sourceIps: ["10.0.0.0/8", "fd00::/16"]
        destinationIps: ["10.1.2.3"]
        destinationPorts: [80]
"#;
    let cfg = parse_local_config(yaml).expect("parse");
    let w = &cfg.workloads[0];
    assert_eq!(
        w.waypoint.as_ref().unwrap().destination,
        GatewayDestination::Hostname("ns1/waypoint.ns1.svc.cluster.local".parse().unwrap())
    );
    assert_eq!(
        w.network_gateway.as_ref().unwrap(),
        &GatewayAddress {
            destination: GatewayDestination::Address("net1/10.9.9.9".parse().unwrap()),
            hbone_mtls_port: 15008,
        }
    );
    assert_eq!(
        w.application_tunnel,
        Some(ApplicationTunnel {
            protocol: AppTunnelProtocol::Proxy,
            port: Some(15088)
        })
    );
    assert_eq!(w.status, HealthStatus::Unhealthy);
    assert_eq!(w.capacity, 3);
    assert_eq!(w.locality.zone, "z");
    let s = &cfg.services[0];
    assert_eq!(s.vips[1].address, "fd00::96:1".parse::<IpAddr>().unwrap());
    assert_eq!(
        s.load_balancer.as_ref().unwrap().mode,
        LoadBalancerMode::Failover
    );
    assert_eq!(s.ip_families, Some(IpFamily::Dual));
    assert_eq!(s.visibility, Visibility::Namespace);
    assert_eq!(s.endpoints.len(), 1);
    let m = &cfg.policies[0].rules[0][0][0];
    assert_eq!(m.not_principals[0], StringMatch::Presence());
    assert_eq!(m.not_principals[1], StringMatch::Suffix("/sa/bad".into()));
    assert_eq!(m.not_principals[2], StringMatch::Presence());
    assert_eq!(
        m.principals,
        vec![
            StringMatch::Exact("cluster.local/ns/ns1/sa/sa1".into()),
            StringMatch::Exact("x".into())
        ]
    );
    assert_eq!(m.namespaces, vec![StringMatch::Prefix("ns".into())]);
    assert_eq!(m.source_ips[0].prefix_len, 8);
    assert_eq!(m.destination_ips[0].prefix_len, 32);
}

/// The reason the only policy of `yaml` is invalid (the config itself parses).
fn invalid_reason(yaml: &str) -> String {
    let cfg = parse_local_config(yaml).unwrap();
    cfg.policies[0].invalid.clone().expect("an invalid policy")
}

#[test]
fn bad_string_match_is_named() {
    let base = "policies:\n- name: p\n  scope: Global\n  action: Deny\n  rules: [[[{namespaces: ";
    let t = invalid_reason(&format!("{base}[{{Contains: x}}]}}]]]\n"));
    assert_mentions(
        &t,
        &["policies[0].rules[0][0][0].namespaces[0]", "Contains"],
    );
    let t = invalid_reason(&format!("{base}[{{Exact: x, Prefix: y}}]}}]]]\n"));
    assert_mentions(
        &t,
        &[
            "policies[0].rules[0][0][0].namespaces[0]",
            "exactly one key",
        ],
    );
    let t = invalid_reason(&format!("{base}[Presence, Absence]}}]]]\n"));
    assert_mentions(&t, &["namespaces[1]", "Absence"]);
}

#[test]
fn bad_cidr_is_named() {
    let t = invalid_reason(
        "policies:\n- name: p\n  scope: Global\n  action: Deny\n  rules: [[[{sourceIps: [\"10.0.0.0/8\", \"10.0.0.0/40\"]}]]]\n",
    );
    assert_mentions(&t, &["policies[0].rules[0][0][0].sourceIps[1]", "0..=32"]);
}

#[test]
fn bad_gateway_destination_is_named() {
    let t = err_text(&format!(
        "{MINIMAL_WORKLOAD}  waypoint:\n    destination: nowhere\n"
    ));
    assert_mentions(
        &t,
        &["workloads[0].waypoint.destination", "namespace/hostname"],
    );
}

#[test]
fn cidr_parse_and_contains() {
    let c: Cidr = "10.1.0.0/15".parse().unwrap();
    assert!(c.contains("10.1.255.1".parse().unwrap()));
    assert!(c.contains("10.0.0.1".parse().unwrap()));
    assert!(!c.contains("10.2.0.1".parse().unwrap()));
    assert!(c.contains("::ffff:10.0.0.1".parse().unwrap()));
    assert!(!c.contains("fd00::1".parse().unwrap()));
    let c6: Cidr = "fd00::/8".parse().unwrap();
    assert!(c6.contains("fdff::1".parse().unwrap()));
    let all: Cidr = "0.0.0.0/0".parse().unwrap();
    assert!(all.contains("1.2.3.4".parse().unwrap()));
    assert!(matches!(
        "10.0.0.0/33".parse::<Cidr>(),
        Err(ConfigError::CidrPrefix { max: 32, .. })
    ));
    assert!(matches!(
        "10.0.0/8".parse::<Cidr>(),
        Err(ConfigError::CidrIp { .. })
    ));
}

#[test]
fn string_match_semantics() {
    assert!(StringMatch::Exact("a".into()).matches("a"));
    assert!(!StringMatch::Exact("a".into()).matches("ab"));
    assert!(StringMatch::Prefix("a".into()).matches("ab"));
    assert!(StringMatch::Suffix("b".into()).matches("ab"));
    assert!(StringMatch::Presence().matches("x"));
    assert!(!StringMatch::Presence().matches(""));
}

/// `/config_dump` writes string matchers as ztunnel does, so `istioctl ztunnel-config` (Go,
/// `StringMatch` a struct) decodes them: `Presence` as `{"Presence":[]}`, never a bare string.
#[test]
fn string_matchers_serialize_as_ztunnels() {
    use crate::proxy::config::policy::StringMatch;
    assert_eq!(
        serde_json::to_value(StringMatch::Presence()).expect("json"),
        serde_json::json!({"Presence": []})
    );
    assert_eq!(
        serde_json::to_value(StringMatch::Exact("x".into())).expect("json"),
        serde_json::json!({"Exact": "x"})
    );
}
