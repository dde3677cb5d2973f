//! Wire checks: hand-encoded bytes with the field numbers of the spec (§5, §6) decode into the
//! expected fields, and encoding gives those bytes back.

use prost::Message;

use super::security::{Authorization, Match, StringMatch, string_match::MatchType};
use super::workload::{Address, NetworkAddress, PortList, Workload, address};
use super::*;

fn decode<M: Message + Default>(bytes: &[u8]) -> M {
    M::decode(bytes).expect("decodes")
}

#[test]
fn workload_uid_is_field_20_and_addresses_field_3() {
    // uid = 20 (tag 0xa2 0x01, length-delimited) "u1"; addresses = 3 (tag 0x1a) 10.0.0.1.
    let bytes = [0xa2, 0x01, 2, b'u', b'1', 0x1a, 4, 10, 0, 0, 1];
    let w: Workload = decode(&bytes);
    assert_eq!(w.uid, "u1");
    assert_eq!(w.addresses, vec![vec![10, 0, 0, 1]]);
    // prost writes fields in tag order.
    assert_eq!(
        w.encode_to_vec(),
        [0x1a, 4, 10, 0, 0, 1, 0xa2, 0x01, 2, b'u', b'1']
    );
}

#[test]
fn workload_scalar_and_wrapper_fields_have_their_numbers() {
    let w = Workload {
        name: "n".into(),                           // 1 -> 0x0a
        namespace: "ns".into(),                     // 2 -> 0x12
        tunnel_protocol: 1,                         // 5 -> 0x28
        service_account: "sa".into(),               // 7 -> 0x3a
        node: "x".into(),                           // 9 -> 0x4a
        workload_type: 2,                           // 12 -> 0x60
        native_tunnel: true,                        // 14 -> 0x70
        authorization_policies: vec!["a/b".into()], // 16 -> 0x82 0x01
        status: 1,                                  // 17 -> 0x88 0x01
        cluster_id: "c".into(),                     // 18 -> 0x92 0x01
        network_mode: 1,                            // 25 -> 0xc8 0x01
        capacity: Some(7),                          // 27 -> 0xda 0x01, UInt32Value{value = 1}
        ..Workload::default()
    };
    let expect: &[u8] = &[
        0x0a, 1, b'n', 0x12, 2, b'n', b's', 0x28, 1, 0x3a, 2, b's', b'a', 0x4a, 1, b'x', 0x60, 2,
        0x70, 1, 0x82, 0x01, 3, b'a', b'/', b'b', 0x88, 0x01, 1, 0x92, 0x01, 1, b'c', 0xc8, 0x01,
        1, 0xda, 0x01, 2, 0x08, 7,
    ];
    assert_eq!(w.encode_to_vec(), expect);
    assert_eq!(decode::<Workload>(expect), w);
}

#[test]
fn workload_services_map_is_field_22() {
    // services = 22 (0xb2 0x01): entry {key = 1 "a/h", value = 2 PortList{ports = 1 Port{1: 80, 2: 8080}}}
    let port = [0x08, 80, 0x10, 0x90, 0x3f];
    let list = [&[0x0a, port.len() as u8][..], &port].concat();
    let entry = [
        &[0x0a, 3, b'a', b'/', b'h', 0x12, list.len() as u8][..],
        &list,
    ]
    .concat();
    let bytes = [&[0xb2, 0x01, entry.len() as u8][..], &entry].concat();
    let w: Workload = decode(&bytes);
    let ports: &PortList = w.services.get("a/h").expect("service key");
    assert_eq!(ports.ports.len(), 1);
    assert_eq!(
        (ports.ports[0].service_port, ports.ports[0].target_port),
        (80, 8080)
    );
}

#[test]
fn address_oneof_is_workload_1_or_service_2() {
    let a: Address = decode(&[0x0a, 3, 0xa2, 0x01, 0]);
    assert!(matches!(a.r#type, Some(address::Type::Workload(_))));
    // Service{hostname = 3 "h", addresses = 4 NetworkAddress{network = 1 "", address = 2 .., length = 3}}
    let na = [0x12, 4, 10, 96, 0, 1, 0x18, 32];
    let svc = [&[0x1a, 1, b'h', 0x22, na.len() as u8][..], &na].concat();
    let bytes = [&[0x12, svc.len() as u8][..], &svc].concat();
    let a: Address = decode(&bytes);
    let Some(address::Type::Service(s)) = a.r#type else {
        panic!("service expected: {a:?}")
    };
    assert_eq!(s.hostname, "h");
    assert_eq!(
        s.addresses,
        vec![NetworkAddress {
            network: String::new(),
            address: vec![10, 96, 0, 1],
            length: Some(32)
        }]
    );
    assert_eq!(decode::<Address>(&[]).r#type, None, "empty = neither");
}

#[test]
fn authorization_fields_have_their_numbers() {
    // name = 1, namespace = 2, scope = 3, action = 4, rules = 5 [Rule{clauses = 1 [Clause{matches = 2
    // [Match{principals = 3 [exact "p"], destination_ports = 9 packed [9999], presence in not_namespaces = 2}]}]}]
    let m = [
        0x1a, 3, 0x0a, 1, b'p', 0x4a, 2, 0x8f, 0x4e, 0x12, 2, 0x22, 0,
    ];
    let clause = [&[0x12, m.len() as u8][..], &m].concat();
    let rule = [&[0x0a, clause.len() as u8][..], &clause].concat();
    let bytes = [
        &[
            0x0a, 1, b'n', 0x12, 2, b'n', b's', 0x18, 1, 0x20, 1, 0x30, 1,
        ][..],
        &[0x2a, rule.len() as u8],
        &rule,
    ]
    .concat();
    let p: Authorization = decode(&bytes);
    assert_eq!((p.name.as_str(), p.namespace.as_str()), ("n", "ns"));
    assert_eq!((p.scope, p.action, p.dry_run), (1, 1, true));
    let got: &Match = &p.rules[0].clauses[0].matches[0];
    assert_eq!(
        got.principals,
        vec![StringMatch {
            match_type: Some(MatchType::Exact("p".into()))
        }]
    );
    assert_eq!(got.destination_ports, vec![9999]);
    assert_eq!(
        got.not_namespaces[0].match_type,
        Some(MatchType::Presence(()))
    );
    assert_eq!(decode::<Authorization>(&p.encode_to_vec()), p);
}

#[test]
fn delta_request_and_response_have_their_numbers() {
    let req = DeltaDiscoveryRequest {
        type_url: "t".into(),
        response_nonce: "n".into(),
        initial_resource_versions: [("a".to_owned(), "v".to_owned())].into(),
        error_detail: Some(Status {
            code: 3,
            message: "m".into(),
            details: vec![],
        }),
        ..DeltaDiscoveryRequest::default()
    };
    // type_url = 2, initial_resource_versions = 5 {1: "a", 2: "v"}, response_nonce = 6,
    // error_detail = 7 {code = 1, message = 2}.
    let expect: &[u8] = &[
        0x12, 1, b't', 0x2a, 6, 0x0a, 1, b'a', 0x12, 1, b'v', 0x32, 1, b'n', 0x3a, 5, 0x08, 3,
        0x12, 1, b'm',
    ];
    assert_eq!(req.encode_to_vec(), expect);
    let node = DeltaDiscoveryRequest {
        node: Some(Node {
            id: "i".into(),
            ..Node::default()
        }),
        ..DeltaDiscoveryRequest::default()
    };
    assert_eq!(node.encode_to_vec(), [0x0a, 3, 0x0a, 1, b'i']);

    // Resource{version = 1 "v", resource = 2 Any{type_url = 1 "t", value = 2 ""}, name = 3 "r"};
    // response: resources = 2, type_url = 4, nonce = 5, removed_resources = 6, system_version_info = 1.
    let res = [0x0a, 1, b'v', 0x12, 3, 0x0a, 1, b't', 0x1a, 1, b'r'];
    let bytes = [
        &[0x0a, 1, b's', 0x12, res.len() as u8][..],
        &res,
        &[0x22, 1, b't', 0x2a, 1, b'n', 0x32, 1, b'x'],
    ]
    .concat();
    let resp: DeltaDiscoveryResponse = decode(&bytes);
    assert_eq!(resp.system_version_info, "s");
    assert_eq!((resp.type_url.as_str(), resp.nonce.as_str()), ("t", "n"));
    assert_eq!(resp.removed_resources, ["x"]);
    let r = &resp.resources[0];
    assert_eq!((r.name.as_str(), r.version.as_str()), ("r", "v"));
    assert_eq!(r.resource.as_ref().map(|a| a.type_url.as_str()), Some("t"));
}
