//! The per-response logic: ACK/NACK with the nonce, last good state, removals, versions.

use prost::Message;

use super::*;
use crate::proxy::xds::proto::security::Authorization;
use crate::proxy::xds::proto::workload::{self as wl, Address, address};

fn workload_bytes(name: &str, ip: &[u8]) -> Vec<u8> {
    Address {
        r#type: Some(address::Type::Workload(wl::Workload {
            uid: name.into(),
            name: name.into(),
            namespace: "ns".into(),
            addresses: vec![ip.to_vec()],
            ..wl::Workload::default()
        })),
    }
    .encode_to_vec()
}

fn service_bytes(host: &str) -> Vec<u8> {
    Address {
        r#type: Some(address::Type::Service(wl::Service {
            name: "s".into(),
            namespace: "ns".into(),
            hostname: host.into(),
            ..wl::Service::default()
        })),
    }
    .encode_to_vec()
}

fn res(name: &str, version: &str, type_url: &str, value: Vec<u8>) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(Any {
            type_url: type_url.into(),
            value,
        }),
        ..Resource::default()
    }
}

fn addr(name: &str, version: &str, value: Vec<u8>) -> Resource {
    res(name, version, ADDRESS_TYPE_URL, value)
}

fn response(
    t: ResourceType,
    nonce: &str,
    resources: Vec<Resource>,
    removed: &[&str],
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: t.type_url().into(),
        nonce: nonce.into(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
        ..DeltaDiscoveryResponse::default()
    }
}

fn names(cfg: &LocalConfig) -> (Vec<String>, Vec<String>, Vec<String>) {
    (
        cfg.workloads.iter().map(|w| w.name.clone()).collect(),
        cfg.services.iter().map(|s| s.hostname.clone()).collect(),
        cfg.policies.iter().map(|p| p.name.clone()).collect(),
    )
}

#[test]
fn the_first_request_is_a_wildcard_with_the_held_versions() {
    let mut held = Held::new();
    let node = Node {
        id: "n".into(),
        ..Node::default()
    };
    let first = held.initial_request(ResourceType::Address, Some(node.clone()));
    assert_eq!(first.type_url, ADDRESS_TYPE_URL);
    assert_eq!(first.node, Some(node));
    assert!(
        first.resource_names_subscribe.is_empty() && first.resource_names_unsubscribe.is_empty()
    );
    assert!(first.initial_resource_versions.is_empty() && first.response_nonce.is_empty());

    held.apply(&response(
        ResourceType::Address,
        "n1",
        vec![addr("a", "v1", workload_bytes("a", &[10, 0, 0, 1]))],
        &[],
    ));
    let again = held.initial_request(ResourceType::Address, None);
    assert_eq!(again.node, None);
    assert_eq!(
        again.initial_resource_versions,
        HashMap::from([("a".into(), "v1".into())])
    );
    let authz = held.initial_request(ResourceType::Authorization, None);
    assert_eq!(authz.type_url, AUTHORIZATION_TYPE_URL);
    assert!(authz.initial_resource_versions.is_empty());
}

#[test]
fn a_valid_response_is_acked_with_its_nonce_and_applied() {
    let mut held = Held::new();
    let out = held.apply(&response(
        ResourceType::Address,
        "nonce-1",
        vec![
            addr("b", "1", workload_bytes("b", &[10, 0, 0, 2])),
            addr("a", "1", workload_bytes("a", &[10, 0, 0, 1])),
            addr("ns/h", "1", service_bytes("h")),
        ],
        &[],
    ));
    assert!(out.is_ack() && out.changed());
    assert_eq!(out.reply.response_nonce, "nonce-1");
    assert_eq!(out.reply.type_url, ADDRESS_TYPE_URL);
    assert_eq!(out.reply.error_detail, None);
    assert_eq!(out.resource_type, Some(ResourceType::Address));
    assert_eq!(out.updated, ["b", "a", "ns/h"]);
    assert_eq!(
        names(&held.local_config()),
        (vec!["b".into(), "a".into()], vec!["h".into()], vec![]),
        "in the order they arrived"
    );

    // The same values again (new versions): no change, but the versions follow.
    let out = held.apply(&response(
        ResourceType::Address,
        "nonce-2",
        vec![addr("a", "2", workload_bytes("a", &[10, 0, 0, 1]))],
        &[],
    ));
    assert!(out.is_ack() && !out.changed());
    assert_eq!(held.versions(ResourceType::Address)["a"], "2");

    // An empty response (e.g. the first one of an empty world) is an ACK without change.
    let out = held.apply(&response(
        ResourceType::Authorization,
        "nonce-3",
        vec![],
        &[],
    ));
    assert!(out.is_ack() && !out.changed());
    assert_eq!(out.reply.response_nonce, "nonce-3");
}

#[test]
fn an_invalid_resource_is_nacked_and_its_last_good_version_kept() {
    let mut held = Held::new();
    held.apply(&response(
        ResourceType::Address,
        "n1",
        vec![
            addr("a", "1", workload_bytes("a", &[10, 0, 0, 1])),
            addr("b", "1", workload_bytes("b", &[10, 0, 0, 2])),
        ],
        &[],
    ));
    let before = held.clone();
    let out = held.apply(&response(
        ResourceType::Address,
        "n2",
        vec![
            addr("a", "2", workload_bytes("a", &[10, 0, 0])),
            addr("bad-undecodable", "1", vec![0xff]),
            addr("no-type", "1", Vec::new()),
            addr("b", "2", workload_bytes("b", &[10, 0, 0, 9])),
        ],
        &[],
    ));
    assert!(!out.is_ack());
    assert_eq!(out.reply.response_nonce, "n2");
    let nack = out.reply.error_detail.as_ref().unwrap();
    assert_eq!(nack.code, INVALID_ARGUMENT);
    assert!(
        nack.message.starts_with(
            "a: workload.addresses: failed to parse address, had 3 bytes; bad-undecodable: decode: "
        ),
        "{}",
        nack.message
    );
    assert!(
        nack.message
            .ends_with("; no-type: Address has neither workload nor service"),
        "{}",
        nack.message
    );
    let rejected: Vec<&str> = out.rejected.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(rejected, ["a", "bad-undecodable", "no-type"]);
    // The valid one is applied, the bad one keeps its previous version and value.
    assert_eq!(out.updated, ["b"]);
    assert_eq!(held.versions(ResourceType::Address)["a"], "1");
    assert_eq!(held.versions(ResourceType::Address)["b"], "2");
    assert_eq!(
        held.len(ResourceType::Address),
        2,
        "never-valid names are not held"
    );
    let cfg = held.local_config();
    assert_eq!(cfg.workloads[0], before.local_config().workloads[0]);
    assert_eq!(
        cfg.workloads[1].workload_ips,
        ["10.0.0.9".parse::<std::net::IpAddr>().unwrap()]
    );
}

#[test]
fn removed_resources_are_dropped_and_unknown_ones_ignored() {
    let mut held = Held::new();
    held.apply(&response(
        ResourceType::Address,
        "n1",
        vec![
            addr("a", "1", workload_bytes("a", &[10, 0, 0, 1])),
            addr("ns/h", "1", service_bytes("h")),
        ],
        &[],
    ));
    let out = held.apply(&response(
        ResourceType::Address,
        "n2",
        vec![],
        &["a", "never-held"],
    ));
    assert!(out.is_ack() && out.changed());
    assert_eq!(out.removed, ["a"]);
    assert_eq!(
        names(&held.local_config()),
        (vec![], vec!["h".into()], vec![])
    );
    // A removal and a re-add in one response: the resource stays.
    let out = held.apply(&response(
        ResourceType::Address,
        "n3",
        vec![addr("ns/h", "2", service_bytes("h2"))],
        &["ns/h"],
    ));
    assert_eq!((out.removed.len(), out.updated.len()), (1, 1));
    assert_eq!(held.local_config().services[0].hostname, "h2");
}

#[test]
fn policies_are_held_apart_from_addresses() {
    let mut held = Held::new();
    let good = Authorization {
        name: "allow".into(),
        namespace: "app".into(),
        ..Authorization::default()
    };
    let bad = Authorization {
        name: "bad-enum".into(),
        namespace: "app".into(),
        scope: 99,
        ..Authorization::default()
    };
    let out = held.apply(&response(
        ResourceType::Authorization,
        "p1",
        vec![
            res(
                "app/allow",
                "1",
                AUTHORIZATION_TYPE_URL,
                good.encode_to_vec(),
            ),
            res(
                "app/bad-enum",
                "1",
                AUTHORIZATION_TYPE_URL,
                bad.encode_to_vec(),
            ),
        ],
        &[],
    ));
    assert_eq!(
        out.reply.error_detail.map(|s| s.message),
        Some("app/bad-enum: authorization.scope: unknown enumeration value 99".into())
    );
    assert_eq!(names(&held.local_config()).2, ["allow"]);
    assert_eq!(held.len(ResourceType::Address), 0);
    assert!(held.versions(ResourceType::Address).is_empty());
    assert_eq!(held.versions(ResourceType::Authorization).len(), 1);
}

#[test]
fn wrong_types_and_missing_values_are_rejected() {
    let mut held = Held::new();
    let mut no_value = addr("x", "1", Vec::new());
    no_value.resource = None;
    let out = held.apply(&response(
        ResourceType::Address,
        "n1",
        vec![
            res("y", "1", AUTHORIZATION_TYPE_URL, Vec::new()),
            no_value,
            // An empty Any type URL is taken as the response's type.
            res("z", "1", "", workload_bytes("z", &[10, 0, 0, 3])),
        ],
        &[],
    ));
    assert_eq!(out.rejected.len(), 2);
    assert!(matches!(out.rejected[0].1, ConvertError::TypeUrl { .. }));
    assert_eq!(out.updated, ["z"]);

    let out = held.apply(&DeltaDiscoveryResponse {
        type_url: "type.googleapis.com/other".into(),
        nonce: "o1".into(),
        ..DeltaDiscoveryResponse::default()
    });
    assert_eq!(out.resource_type, None);
    assert!(!out.is_ack());
    assert_eq!(out.reply.response_nonce, "o1");
}

#[test]
fn where_records_overlap_the_most_recent_change_wins() {
    let mut held = Held::new();
    // "z-old" has the IP first; "a-new" gets the same IP later (the old pod's removal is late)
    held.apply(&response(
        ResourceType::Address,
        "n1",
        vec![addr("z-old", "1", workload_bytes("z-old", &[10, 0, 0, 9]))],
        &[],
    ));
    held.apply(&response(
        ResourceType::Address,
        "n2",
        vec![addr("a-new", "1", workload_bytes("a-new", &[10, 0, 0, 9]))],
        &[],
    ));
    let (st, conflicts) =
        crate::proxy::state::ProxyState::from_config_lenient(&held.local_config());
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    let owner = st
        .workload_by_ip("10.0.0.9".parse().expect("ip"))
        .expect("owner");
    assert_eq!(
        owner.name, "a-new",
        "the later record wins, whatever the names' order"
    );
    // an unchanged re-send (new version, same value) keeps the order
    held.apply(&response(
        ResourceType::Address,
        "n3",
        vec![addr("z-old", "2", workload_bytes("z-old", &[10, 0, 0, 9]))],
        &[],
    ));
    let (st, _) = crate::proxy::state::ProxyState::from_config_lenient(&held.local_config());
    assert_eq!(
        st.workload_by_ip("10.0.0.9".parse().expect("ip"))
            .expect("owner")
            .name,
        "a-new"
    );
}
