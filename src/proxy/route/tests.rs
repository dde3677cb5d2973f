use super::*;
use crate::proxy::config::parse_local_config;

/// Workloads: client (10.0.0.2), server (10.0.0.3, behind service `default/svc` at 10.96.0.1:80,
/// its own port map 80 -> 8080 over the service's 80 -> 9090), waypoint (10.0.0.9, hostname
/// `wp-host.example`, behind service `default/wp` at 10.96.0.9) and a second replica of it
/// (10.0.0.10, same identity), plain (10.0.0.5, TCP), and `guarded` (10.0.0.6, behind service
/// `default/guarded` at 10.96.0.6) with a workload waypoint; `svc_waypoint` is inserted into
/// service `svc`.
fn state(svc_waypoint: &str) -> ProxyState {
    let yaml = format!(
        r#"
workloads:
- {{uid: u-client, name: client, namespace: default, serviceAccount: alice, workloadIps: ["10.0.0.2"], protocol: HBONE}}
- uid: u-server
  name: server
  namespace: default
  serviceAccount: bob
  workloadIps: ["10.0.0.3"]
  protocol: HBONE
  services: {{"default/svc.example": {{80: 8080}}}}
- uid: u-wp
  name: waypoint
  namespace: default
  serviceAccount: waypoint
  workloadIps: ["10.0.0.9"]
  protocol: HBONE
  hostname: wp-host.example
  services: {{"default/wp.example": {{15008: 15008}}}}
- {{uid: u-wp2, name: waypoint-2, namespace: default, serviceAccount: waypoint, workloadIps: ["10.0.0.10"], protocol: HBONE}}
- {{uid: u-plain, name: plain, namespace: default, serviceAccount: p, workloadIps: ["10.0.0.5"], protocol: TCP}}
- uid: u-guarded
  name: guarded
  namespace: default
  serviceAccount: carol
  workloadIps: ["10.0.0.6"]
  protocol: HBONE
  waypoint: {{destination: "/10.0.0.9", hboneMtlsPort: 15008}}
  services: {{"default/guarded.example": {{80: 9000}}}}
services:
- name: svc
  namespace: default
  hostname: svc.example
  vips: ["/10.96.0.1"]
  ports: {{80: 9090}}
{svc_waypoint}- name: wp
  namespace: default
  hostname: wp.example
  vips: ["/10.96.0.9"]
  ports: {{15008: 15008}}
- name: guarded
  namespace: default
  hostname: guarded.example
  vips: ["/10.96.0.6"]
  ports: {{80: 9000}}
- name: empty
  namespace: default
  hostname: empty.example
  vips: ["/10.96.0.2"]
  ports: {{80: 80}}
  waypoint: {{destination: "default/nowhere.example", hboneMtlsPort: 15008}}
"#
    );
    let cfg = parse_local_config(&yaml).expect("config");
    ProxyState::from_config(&cfg).expect("state")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("addr")
}

fn workload(st: &ProxyState, name: &str) -> Arc<Workload> {
    st.workload_by_name("default", name).expect("workload")
}

fn id(sa: &str) -> Identity {
    Identity {
        trust_domain: "cluster.local".into(),
        namespace: "default".into(),
        service_account: sa.into(),
    }
}

const CLIENT: &str = "10.0.0.2:40000";

/// A route over HBONE to `to` for `authority`, expecting service account `sa`; logged as `target`.
fn hbone_route(target: &str, to: &str, authority: &str, sa: &str) -> Route {
    Route {
        target: addr(target),
        hbone: Some(Hbone {
            addr: addr(to),
            authority: addr(authority),
            identity: id(sa),
            service_host: None,
        }),
    }
}

/// [`hbone_route`] for a connection addressed to service `host`.
fn service_route(target: &str, to: &str, authority: &str, sa: &str, host: &str) -> Route {
    let mut r = hbone_route(target, to, authority, sa);
    if let Some(h) = &mut r.hbone {
        h.service_host = Some(host.into());
    }
    r
}

/// [`route`] from the named workload (client port 40000) to `dst`.
fn route_from(st: &ProxyState, name: &str, dst: &str) -> Result<Route, RouteError> {
    route(st, &workload(st, name), addr(dst), addr(CLIENT))
}

#[test]
fn a_service_without_waypoint_goes_to_an_endpoint_over_hbone() {
    let st = state("");
    let r = route_from(&st, "client", "10.96.0.1:80");
    assert_eq!(
        r,
        Ok(service_route(
            "10.0.0.3:8080",
            "10.0.0.3:15008",
            "10.0.0.3:8080",
            "bob",
            "svc.example"
        ))
    );
}

#[test]
fn a_service_with_a_waypoint_goes_to_the_waypoint_with_the_vip_as_authority() {
    for waypoint in [
        "  waypoint: {destination: \"default/wp.example\", hboneMtlsPort: 15008}\n",
        "  waypoint: {destination: \"/10.96.0.9\", hboneMtlsPort: 15008}\n",
        "  waypoint: {destination: \"/10.0.0.9\", hboneMtlsPort: 15008}\n",
    ] {
        let st = state(waypoint);
        let r = route_from(&st, "client", "10.96.0.1:80");
        assert_eq!(
            r,
            Ok(service_route(
                "10.96.0.1:80",
                "10.0.0.9:15008",
                "10.96.0.1:80",
                "waypoint",
                "svc.example"
            )),
            "{waypoint}"
        );
        // the waypoint's own traffic to the service goes to the endpoint
        let from_wp = route_from(&st, "waypoint", "10.96.0.1:80").expect("route");
        assert_eq!(from_wp.target, addr("10.0.0.3:8080"), "{waypoint}");
    }
}

#[test]
fn a_workload_with_a_waypoint_is_reached_through_it() {
    let st = state("");
    let r = route_from(&st, "client", "10.0.0.6:9000");
    assert_eq!(
        r,
        Ok(hbone_route(
            "10.0.0.6:9000",
            "10.0.0.9:15008",
            "10.0.0.6:9000",
            "waypoint"
        ))
    );
    let from_wp = route_from(&st, "waypoint", "10.0.0.6:9000").expect("route");
    assert_eq!(from_wp.hbone.map(|h| h.addr), Some(addr("10.0.0.6:15008")));
}

#[test]
fn an_unresolvable_waypoint_fails_instead_of_bypassing() {
    let st = state("");
    assert_eq!(
        route_from(&st, "client", "10.96.0.2:80"),
        Err(RouteError::NoWaypoint {
            of: "default/empty.example".into(),
            waypoint: "default/nowhere.example".into(),
        })
    );
}

#[test]
fn plain_tcp_and_unknown_destinations_pass_through() {
    let st = state("");
    for dst in ["10.0.0.5:80", "192.0.2.1:443"] {
        assert_eq!(
            route_from(&st, "client", dst),
            Ok(Route {
                target: addr(dst),
                hbone: None
            })
        );
    }
}

#[test]
fn a_service_without_endpoints_has_no_route() {
    let st = state("");
    let wp_less = ProxyState::from_config(
        &parse_local_config(
            "services:\n- {name: s, namespace: ns, hostname: s.example, vips: [\"/10.96.1.1\"], ports: {80: 80}}\n",
        )
        .expect("config"),
    )
    .expect("state");
    assert_eq!(
        route(
            &wp_less,
            &workload(&st, "client"),
            addr("10.96.1.1:80"),
            addr(CLIENT)
        ),
        Err(RouteError::NoEndpoints("ns/s.example".into()))
    );
}

#[test]
fn a_waypoint_named_by_workload_hostname_and_its_replicas() {
    let st =
        state("  waypoint: {destination: \"default/wp-host.example\", hboneMtlsPort: 15008}\n");
    assert_eq!(
        route_from(&st, "client", "10.96.0.1:80"),
        Ok(service_route(
            "10.96.0.1:80",
            "10.0.0.9:15008",
            "10.96.0.1:80",
            "waypoint",
            "svc.example"
        ))
    );
    // another replica of the waypoint (same identity, not named) is not sent back to it
    let from_replica = route_from(&st, "waypoint-2", "10.96.0.1:80").expect("route");
    assert_eq!(from_replica.target, addr("10.0.0.3:8080"));
}

#[test]
fn service_traffic_ignores_the_endpoints_own_waypoint() {
    let st = state("");
    assert_eq!(
        route_from(&st, "client", "10.96.0.6:80"),
        Ok(service_route(
            "10.0.0.6:9000",
            "10.0.0.6:15008",
            "10.0.0.6:9000",
            "carol",
            "guarded.example"
        ))
    );
}

#[test]
fn unhealthy_endpoints_are_skipped_unless_the_service_allows_all() {
    let yaml = |policy: &str| {
        format!(
            r#"
workloads:
- {{uid: u-a, name: a, namespace: ns, serviceAccount: a, workloadIps: ["10.0.1.1"], protocol: HBONE, status: Unhealthy, services: {{"ns/s.example": {{80: 8080}}}}}}
- {{uid: u-b, name: b, namespace: ns, serviceAccount: b, workloadIps: ["10.0.1.2"], protocol: HBONE, services: {{"ns/s.example": {{80: 7777}}}}}}
- {{uid: u-c, name: c, namespace: ns, serviceAccount: c, workloadIps: ["10.0.1.3"], protocol: HBONE, status: Unhealthy}}
services:
- name: s
  namespace: ns
  hostname: s.example
  vips: ["/10.96.1.1"]
  ports: {{80: 8080}}
  {policy}
  endpoints:
    u-b: {{workloadUid: u-b, port: {{80: 9999}}, status: Unhealthy}}
    u-c: {{workloadUid: u-c, status: Healthy}}
"#
        )
    };
    let st =
        ProxyState::from_config(&parse_local_config(&yaml("")).expect("config")).expect("state");
    let src = workload(&state(""), "client");
    // a is unhealthy itself, b through its explicit endpoint; c's explicit status wins over its
    // workload's
    for p in 0..3 {
        let r = route(
            &st,
            &src,
            addr("10.96.1.1:80"),
            SocketAddr::new(addr(CLIENT).ip(), p),
        )
        .expect("route");
        assert_eq!(r.target, addr("10.0.1.3:8080"));
    }
    let st = ProxyState::from_config(
        &parse_local_config(&yaml("loadBalancer: {healthPolicy: AllowAll}")).expect("config"),
    )
    .expect("state");
    // endpoints are picked at random: 300 connections reach all three
    let mut targets: Vec<SocketAddr> = (0..300)
        .map(|p| {
            route(
                &st,
                &src,
                addr("10.96.1.1:80"),
                SocketAddr::new(addr(CLIENT).ip(), p),
            )
            .expect("route")
            .target
        })
        .collect();
    targets.sort();
    targets.dedup();
    // b's explicit endpoint port wins over its workload's port map and the service's
    assert_eq!(
        targets,
        [
            addr("10.0.1.1:8080"),
            addr("10.0.1.2:9999"),
            addr("10.0.1.3:8080")
        ]
    );
}

#[test]
fn a_passthrough_service_without_endpoints_goes_to_the_original_destination() {
    let yaml = |mode: &str| {
        format!(
            "services:\n- {{name: s, namespace: ns, hostname: s.example, vips: [\"/10.96.1.1\"], ports: {{80: 80}}, loadBalancer: {{mode: {mode}}}}}\n"
        )
    };
    let src = workload(&state(""), "client");
    let st = ProxyState::from_config(&parse_local_config(&yaml("Passthrough")).expect("config"))
        .expect("state");
    assert_eq!(
        route(&st, &src, addr("10.96.1.1:80"), addr(CLIENT)),
        Ok(Route {
            target: addr("10.96.1.1:80"),
            hbone: None
        })
    );
    let st = ProxyState::from_config(&parse_local_config(&yaml("Standard")).expect("config"))
        .expect("state");
    assert_eq!(
        route(&st, &src, addr("10.96.1.1:80"), addr(CLIENT)),
        Err(RouteError::NoEndpoints("ns/s.example".into()))
    );
}

/// A client in zone `z1` of region `r1` and three endpoints of service `lb` (10.96.0.7:80): one in
/// the client's zone, one in another zone of the region, one in another region; the service's
/// load balancer is `lb`.
fn zoned(lb: &str) -> ProxyState {
    let ep = |name: &str, ip: &str, region: &str, zone: &str| {
        format!(
            "- {{uid: u-{name}, name: {name}, namespace: default, serviceAccount: {name}, workloadIps: [\"{ip}\"], \
             protocol: HBONE, locality: {{region: {region}, zone: {zone}}}, services: {{\"default/lb.example\": {{80: 8080}}}}}}\n"
        )
    };
    let yaml = format!(
        "workloads:\n\
         - {{uid: u-c, name: c, namespace: default, serviceAccount: c, workloadIps: [\"10.1.0.1\"], protocol: HBONE, locality: {{region: r1, zone: z1}}}}\n\
         {}{}{}\
         services:\n\
         - {{name: lb, namespace: default, hostname: lb.example, vips: [\"/10.96.0.7\"], ports: {{80: 8080}}{lb}}}\n",
        ep("same-zone", "10.1.0.2", "r1", "z1"),
        ep("same-region", "10.1.0.3", "r1", "z2"),
        ep("far", "10.1.0.4", "r2", "z9"),
    );
    ProxyState::from_config(&parse_local_config(&yaml).expect("config")).expect("state")
}

/// The endpoints 300 connections from `c` to the service land on.
fn landings(st: &ProxyState) -> std::collections::BTreeSet<String> {
    (0..300)
        .filter_map(|_| route_from(st, "c", "10.96.0.7:80").ok())
        .map(|r| r.target.ip().to_string())
        .collect()
}

#[test]
fn endpoints_are_picked_at_random_not_by_source_port() {
    let st = zoned("");
    // one client port every time: a source-port choice would always land on the same endpoint
    assert_eq!(
        landings(&st).into_iter().collect::<Vec<_>>(),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4"]
    );
}

#[test]
fn failover_prefers_the_closest_endpoints_and_strict_keeps_only_matching_ones() {
    let failover = zoned(", loadBalancer: {routingPreferences: [Region, Zone], mode: Failover}");
    assert_eq!(
        landings(&failover).into_iter().collect::<Vec<_>>(),
        ["10.1.0.2"]
    );
    let region_only = zoned(", loadBalancer: {routingPreferences: [Region], mode: Failover}");
    assert_eq!(
        landings(&region_only).into_iter().collect::<Vec<_>>(),
        ["10.1.0.2", "10.1.0.3"]
    );
    let strict = zoned(", loadBalancer: {routingPreferences: [Region, Zone, Node], mode: Strict}");
    // (no workload here names a node, so all share the empty one: only region and zone decide)
    assert_eq!(
        landings(&strict).into_iter().collect::<Vec<_>>(),
        ["10.1.0.2"]
    );
    let strict_far = zoned(", loadBalancer: {routingPreferences: [Cluster, Region], mode: Strict}");
    assert_eq!(
        landings(&strict_far).into_iter().collect::<Vec<_>>(),
        ["10.1.0.2", "10.1.0.3"]
    );
    // failover falls back when nothing is close
    let st = zoned(", loadBalancer: {routingPreferences: [Zone], mode: Failover}");
    assert_eq!(landings(&st).into_iter().collect::<Vec<_>>(), ["10.1.0.2"]);
    let standard = zoned(", loadBalancer: {routingPreferences: [Zone], mode: Standard}");
    assert_eq!(
        landings(&standard).len(),
        3,
        "Standard ignores the preference"
    );
}
