//! Conversions: defaults of unset fields, every field of a full resource, and the errors.

use std::collections::HashMap;

use prost::Message;

use super::*;
use crate::proxy::xds::proto::security::{Clause, Match, Rule};
use crate::proxy::xds::proto::workload::{Address, Port, PortList};

fn sm(m: MatchType) -> sec::StringMatch {
    sec::StringMatch {
        match_type: Some(m),
    }
}

fn bare_workload() -> wl::Workload {
    wl::Workload {
        uid: "Kubernetes//v1/Pod/ns/p".into(),
        name: "p".into(),
        namespace: "ns".into(),
        ..wl::Workload::default()
    }
}

#[test]
fn an_unset_workload_gets_ztunnels_defaults() {
    let w = workload(&bare_workload()).unwrap();
    assert_eq!(w.protocol, Protocol::Tcp);
    assert_eq!(w.status, HealthStatus::Healthy);
    assert_eq!(w.capacity, 1);
    assert_eq!(w.workload_type, "deployment");
    assert_eq!(w.network_mode, NetworkMode::Standard);
    assert_eq!((w.waypoint, w.application_tunnel), (None, None));
    assert!(w.workload_ips.is_empty() && w.services.is_empty());
}

#[test]
fn a_full_workload_converts_every_field() {
    let w = wl::Workload {
        addresses: vec![vec![10, 0, 0, 1], [0u8; 16].to_vec()],
        hostname: "h".into(),
        network: "net".into(),
        tunnel_protocol: wl::TunnelProtocol::Hbone as i32,
        trust_domain: "td".into(),
        service_account: "sa".into(),
        waypoint: Some(wl::GatewayAddress {
            destination: Some(gateway_address::Destination::Hostname(
                wl::NamespacedHostname {
                    namespace: "ns".into(),
                    hostname: "wp.ns.svc".into(),
                },
            )),
            hbone_mtls_port: 0,
        }),
        network_gateway: Some(wl::GatewayAddress {
            destination: Some(gateway_address::Destination::Address(wl::NetworkAddress {
                network: "net2".into(),
                address: vec![1, 2, 3, 4],
                length: None,
            })),
            hbone_mtls_port: 15009,
        }),
        node: "node-1".into(),
        canonical_name: "cn".into(),
        canonical_revision: "v1".into(),
        workload_type: wl::WorkloadType::Job as i32,
        workload_name: "wn".into(),
        native_tunnel: true,
        application_tunnel: Some(wl::ApplicationTunnel {
            protocol: application_tunnel::Protocol::Proxy as i32,
            port: 15088,
        }),
        services: HashMap::from([(
            "ns/svc.ns.svc.cluster.local".to_owned(),
            PortList {
                ports: vec![Port {
                    service_port: 80,
                    target_port: 8080,
                    app_protocol: 0,
                }],
            },
        )]),
        authorization_policies: vec!["ns/p".into()],
        status: wl::WorkloadStatus::Unhealthy as i32,
        cluster_id: "c1".into(),
        locality: Some(wl::Locality {
            region: "r".into(),
            zone: "z".into(),
            subzone: "s".into(),
        }),
        network_mode: wl::NetworkMode::HostNetwork as i32,
        capacity: Some(3),
        ..bare_workload()
    };
    let got = workload(&w).unwrap();
    assert_eq!(
        got.workload_ips,
        vec!["10.0.0.1".parse::<IpAddr>().unwrap(), "::".parse().unwrap()]
    );
    assert_eq!(got.protocol, Protocol::Hbone);
    assert_eq!(
        (got.trust_domain.as_str(), got.service_account.as_str()),
        ("td", "sa")
    );
    let wp = got.waypoint.unwrap();
    assert_eq!(wp.hbone_mtls_port, 15008, "unset port = the HBONE port");
    assert_eq!(
        wp.destination,
        GatewayDestination::Hostname("ns/wp.ns.svc".parse().unwrap())
    );
    let gw = got.network_gateway.unwrap();
    assert_eq!(gw.hbone_mtls_port, 15009);
    assert_eq!(
        gw.destination,
        GatewayDestination::Address("net2/1.2.3.4".parse().unwrap())
    );
    assert_eq!(got.workload_type, "job");
    assert!(got.native_tunnel);
    assert_eq!(
        got.application_tunnel,
        Some(ApplicationTunnel {
            protocol: AppTunnelProtocol::Proxy,
            port: Some(15088)
        })
    );
    let key: NamespacedHostname = "ns/svc.ns.svc.cluster.local".parse().unwrap();
    assert_eq!(got.services[&key], BTreeMap::from([(80, 8080)]));
    assert_eq!(got.authorization_policies, ["ns/p"]);
    assert_eq!(got.status, HealthStatus::Unhealthy);
    assert_eq!(got.cluster_id, "c1");
    assert_eq!(got.locality.subzone, "s");
    assert_eq!(got.network_mode, NetworkMode::HostNetwork);
    assert_eq!(got.capacity, 3);
    assert_eq!((got.hostname.as_str(), got.network.as_str()), ("h", "net"));
}

#[test]
fn bad_workloads_are_typed_errors() {
    let bad_ip = wl::Workload {
        addresses: vec![vec![10, 0, 0]],
        ..bare_workload()
    };
    let e = workload(&bad_ip).unwrap_err();
    assert!(
        matches!(e, ConvertError::AddressLength { len: 3, .. }),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "workload.addresses: failed to parse address, had 3 bytes"
    );

    let bad_enum = wl::Workload {
        tunnel_protocol: 7,
        ..bare_workload()
    };
    assert!(matches!(
        workload(&bad_enum),
        Err(ConvertError::UnknownEnum {
            field: "workload.tunnel_protocol",
            value: 7
        })
    ));

    let bad_port = wl::Workload {
        services: HashMap::from([(
            "ns/h".to_owned(),
            PortList {
                ports: vec![Port {
                    service_port: 70000,
                    target_port: 1,
                    app_protocol: 0,
                }],
            },
        )]),
        ..bare_workload()
    };
    assert!(matches!(
        workload(&bad_port),
        Err(ConvertError::Port { value: 70000, .. })
    ));

    let bad_key = wl::Workload {
        services: HashMap::from([("no-slash".to_owned(), PortList::default())]),
        ..bare_workload()
    };
    assert!(matches!(
        workload(&bad_key),
        Err(ConvertError::Value {
            field: "workload.services",
            ..
        })
    ));

    let no_dest = wl::Workload {
        waypoint: Some(wl::GatewayAddress::default()),
        ..bare_workload()
    };
    assert!(matches!(
        workload(&no_dest),
        Err(ConvertError::Missing {
            field: "workload.waypoint"
        })
    ));
}

#[test]
fn addresses_decode_to_workload_or_service_and_refuse_neither() {
    let bytes = Address {
        r#type: Some(address::Type::Workload(bare_workload())),
    }
    .encode_to_vec();
    assert!(matches!(
        decode_address(&bytes).unwrap(),
        AddressResource::Workload(w) if w.name == "p"
    ));
    assert!(matches!(
        decode_address(&[]),
        Err(ConvertError::EmptyAddress)
    ));
    assert!(matches!(
        decode_address(&[0xff]),
        Err(ConvertError::Decode(_))
    ));
}

#[test]
fn services_convert_vips_ports_and_load_balancing() {
    let s = wl::Service {
        name: "svc".into(),
        namespace: "ns".into(),
        hostname: "svc.ns.svc.cluster.local".into(),
        addresses: vec![
            wl::NetworkAddress {
                network: String::new(),
                address: vec![10, 96, 0, 1],
                length: None,
            },
            wl::NetworkAddress {
                network: "n".into(),
                address: vec![10, 96, 0, 2],
                length: Some(32),
            },
            // A CIDR VIP is dropped.
            wl::NetworkAddress {
                network: String::new(),
                address: vec![10, 97, 0, 0],
                length: Some(16),
            },
        ],
        ports: vec![Port {
            service_port: 80,
            target_port: 8080,
            app_protocol: 0,
        }],
        subject_alt_names: vec!["spiffe://td/ns/ns/sa/x".into()],
        load_balancing: Some(wl::LoadBalancing {
            routing_preference: vec![0, 2, 4],
            mode: load_balancing::Mode::Failover as i32,
            health_policy: load_balancing::HealthPolicy::AllowAll as i32,
        }),
        ip_families: wl::IpFamilies::Dual as i32,
        canonical: true,
        visibility: wl::Visibility::Namespace as i32,
        ..wl::Service::default()
    };
    let got = service(&s).unwrap();
    assert_eq!(
        got.vips,
        vec![
            "/10.96.0.1".parse::<NetworkAddress>().unwrap(),
            "n/10.96.0.2".parse().unwrap()
        ]
    );
    assert_eq!(got.ports, BTreeMap::from([(80, 8080)]));
    assert_eq!(
        got.load_balancer,
        Some(LoadBalancer {
            routing_preferences: vec![LoadBalancerScope::Zone, LoadBalancerScope::Node],
            mode: LoadBalancerMode::Failover,
            health_policy: LoadBalancerHealthPolicy::AllowAll,
        })
    );
    assert_eq!(got.ip_families, Some(IpFamily::Dual));
    assert!(got.canonical);
    assert_eq!(got.visibility, Visibility::Namespace);

    let defaults = service(&wl::Service::default()).unwrap();
    assert_eq!(
        (
            defaults.ip_families,
            defaults.visibility,
            defaults.load_balancer
        ),
        (None, Visibility::Public, None)
    );
    let bad_vip = wl::Service {
        addresses: vec![wl::NetworkAddress {
            network: String::new(),
            address: vec![1; 5],
            length: None,
        }],
        ..wl::Service::default()
    };
    assert!(matches!(
        service(&bad_vip),
        Err(ConvertError::AddressLength { len: 5, .. })
    ));
    let bad_visibility = wl::Service {
        visibility: 9,
        ..wl::Service::default()
    };
    assert!(matches!(
        service(&bad_visibility),
        Err(ConvertError::UnknownEnum { value: 9, .. })
    ));
}

#[test]
fn authorizations_convert_rules_clauses_and_matches() {
    let m = Match {
        namespaces: vec![sm(MatchType::Prefix("a".into()))],
        not_namespaces: vec![sm(MatchType::Suffix("b".into()))],
        principals: vec![sm(MatchType::Exact("cluster.local/ns/a/sa/b".into()))],
        not_principals: vec![sm(MatchType::Presence(()))],
        service_accounts: vec![sec::ServiceAccountMatch {
            namespace: "a".into(),
            service_account: "b".into(),
        }],
        source_ips: vec![sec::Address {
            address: vec![10, 0, 0, 0],
            length: 8,
        }],
        destination_ips: vec![sec::Address {
            address: [0u8; 16].to_vec(),
            length: 128,
        }],
        destination_ports: vec![9999],
        not_destination_ports: vec![1],
        ..Match::default()
    };
    let p = sec::Authorization {
        name: "deny".into(),
        namespace: "app".into(),
        scope: sec::Scope::WorkloadSelector as i32,
        action: sec::Action::Deny as i32,
        rules: vec![Rule {
            clauses: vec![Clause { matches: vec![m] }],
        }],
        dry_run: true,
        extensions: vec![],
    };
    let got = decode_authorization(&p.encode_to_vec()).unwrap();
    assert_eq!(
        (got.scope, got.action),
        (PolicyScope::WorkloadSelector, PolicyAction::Deny)
    );
    assert!(got.dry_run);
    let gm = &got.rules[0][0][0];
    assert_eq!(gm.namespaces, [StringMatch::Prefix("a".into())]);
    assert_eq!(gm.not_namespaces, [StringMatch::Suffix("b".into())]);
    assert_eq!(gm.not_principals, [StringMatch::Presence()]);
    assert_eq!(gm.service_accounts[0].service_account, "b");
    assert_eq!(gm.source_ips, ["10.0.0.0/8".parse::<Cidr>().unwrap()]);
    assert_eq!(gm.destination_ips, ["::/128".parse::<Cidr>().unwrap()]);
    assert_eq!(
        (
            gm.destination_ports.as_slice(),
            gm.not_destination_ports.as_slice()
        ),
        (&[9999u16][..], &[1u16][..])
    );

    let defaults = authorization(&sec::Authorization::default()).unwrap();
    assert_eq!(
        (defaults.scope, defaults.action),
        (PolicyScope::Global, PolicyAction::Allow)
    );
    assert!(defaults.rules.is_empty());
}

#[test]
fn bad_authorizations_are_typed_errors() {
    let scope = sec::Authorization {
        scope: 99,
        ..sec::Authorization::default()
    };
    let e = authorization(&scope).unwrap_err();
    assert_eq!(
        e.to_string(),
        "authorization.scope: unknown enumeration value 99"
    );
    let with_match = |m: Match| sec::Authorization {
        rules: vec![Rule {
            clauses: vec![Clause { matches: vec![m] }],
        }],
        ..sec::Authorization::default()
    };
    let long_prefix = with_match(Match {
        source_ips: vec![sec::Address {
            address: vec![10, 0, 0, 0],
            length: 33,
        }],
        ..Match::default()
    });
    // rules that do not convert: the policy stands in fail-closed, with the reason
    let stand_in = |a: &sec::Authorization, reason: &str| {
        let p = authorization(a).expect("a stand-in, not an error");
        assert!(
            p.invalid.as_deref().is_some_and(|m| m.contains(reason)),
            "{:?} lacks {reason:?}",
            p.invalid
        );
        assert_eq!(p.rules, fail_closed_rules(p.action));
        p
    };
    stand_in(&long_prefix, "33");
    let empty_string_match = with_match(Match {
        principals: vec![sec::StringMatch { match_type: None }],
        ..Match::default()
    });
    stand_in(&empty_string_match, "match.principals");
    let big_port = with_match(Match {
        destination_ports: vec![65536],
        ..Match::default()
    });
    stand_in(&big_port, "65536");
    // an ALLOW stand-in allows nothing, a DENY one denies everything in its scope
    assert!(stand_in(&big_port, "65536").rules.is_empty());
    let deny = sec::Authorization {
        action: sec::Action::Deny as i32,
        ..big_port
    };
    assert_eq!(
        stand_in(&deny, "65536").rules,
        vec![Vec::<Vec<PolicyMatch>>::new()]
    );
}
