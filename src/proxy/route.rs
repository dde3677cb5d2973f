//! Outbound routing: where a captured connection goes, following ztunnel's `build_request`
//! (`../shared/spec/ztunnel.md` §3 "Waypoints").
//!
//! - A service VIP with a waypoint goes over HBONE to the waypoint (`ip:hboneMtlsPort`), the
//!   `:authority` being the original `VIP:port` and the expected identity the waypoint's.
//! - Any other service VIP becomes one of its healthy endpoints (all with `healthPolicy:
//!   AllowAll`); the target port is the endpoint's explicit port, else its workload's port map,
//!   else the service's, else the original port. Without one, a `Passthrough` service sends the
//!   connection to the original destination as plain TCP; any other has no route.
//! - A workload addressed directly, with a waypoint of its own, goes to that waypoint likewise
//!   (authority = `pod IP:port`).
//! - An HBONE workload is reached at `pod IP:15008` with `:authority` = `pod IP:target port`;
//!   anything else is plain TCP to the target.
//!
//! Traffic from the waypoint itself (any workload with its identity) is not sent back to it. A
//! waypoint that cannot be resolved to a workload is an error: the connection fails rather than
//! bypassing the waypoint. The waypoint's `hboneMtlsPort` is used as given (no service port
//! mapping), and the network part of its address is not looked at (no multi-network yet).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::mesh::HBONE_PORT;
use crate::proxy::config::{
    GatewayAddress, GatewayDestination, HealthStatus, LoadBalancer, LoadBalancerHealthPolicy,
    LoadBalancerMode, LoadBalancerScope,
};
use crate::proxy::identity::Identity;
use crate::proxy::state::{Protocol, ProxyState, Service, Workload};

/// Where an outbound connection goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The destination as logged: the chosen endpoint (pod IP + target port), or the original
    /// destination when a waypoint takes it.
    pub target: SocketAddr,
    /// The HBONE leg; `None` = plain TCP to `target`.
    pub hbone: Option<Hbone>,
}

/// An HBONE CONNECT: to whom, for what, and which identity the peer must prove.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hbone {
    /// TCP address of the HBONE server: the pod's `ip:15008`, or the waypoint's.
    pub addr: SocketAddr,
    /// The CONNECT `:authority`.
    pub authority: SocketAddr,
    /// The identity the peer's certificate must carry.
    pub identity: Identity,
    /// Hostname of the destination service, when the connection was addressed to one (the
    /// `host=` of the `forwarded` header).
    pub service_host: Option<String>,
}

/// Why a connection has no route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// A service VIP without endpoints (`namespace/hostname`).
    #[error("service {0} has no endpoints")]
    NoEndpoints(String),
    /// The destination has a waypoint that resolves to no workload.
    #[error("{of} has waypoint {waypoint}, which resolves to no workload")]
    NoWaypoint {
        /// The service (`namespace/hostname`) or workload (`namespace/name`).
        of: String,
        /// The waypoint as configured.
        waypoint: String,
    },
}

/// Routes a connection from `src` (the pod's workload) to the original destination `dst`;
/// `client` (the app's address) spreads the choice among endpoints.
///
/// Errors: [`RouteError`].
pub fn route(
    state: &ProxyState,
    src: &Workload,
    dst: SocketAddr,
    client: SocketAddr,
) -> Result<Route, RouteError> {
    let mut target = dst;
    if let Some(svc) = state.service_by_vip(dst.ip()) {
        let key = format!("{}/{}", svc.namespace, svc.hostname);
        let host = Some(svc.hostname.clone());
        if let Some(wp) = &svc.waypoint
            && let Some(mut route) = via_waypoint(state, wp, src, dst, client, &key)?
        {
            if let Some(h) = &mut route.hbone {
                h.service_host = host;
            }
            return Ok(route);
        }
        let endpoints = eligible_endpoints(state, &svc);
        let Some(ep) = pick_endpoint(&endpoints, src, svc.load_balancer.as_ref()) else {
            let passthrough = svc
                .load_balancer
                .as_ref()
                .is_some_and(|lb| lb.mode == LoadBalancerMode::Passthrough);
            if passthrough {
                // no endpoint selection: the original destination, as plain TCP
                return Ok(Route {
                    target,
                    hbone: None,
                });
            }
            return Err(RouteError::NoEndpoints(key));
        };
        // the endpoint's explicit port, its workload's port map, the service's, the original
        let port = svc
            .endpoints
            .get(&ep.uid)
            .and_then(|e| e.port.get(&dst.port()).copied())
            .or_else(|| {
                ep.services
                    .get(&key)
                    .and_then(|m| m.get(&dst.port()).copied())
            })
            .or_else(|| svc.ports.get(&dst.port()).copied())
            .unwrap_or(dst.port());
        if let Some(ip) = ip_like(ep, dst) {
            target = SocketAddr::new(ip, port);
        }
        let mut hbone = direct_hbone(state, target);
        if let Some(h) = &mut hbone {
            h.service_host = host;
        }
        return Ok(Route { target, hbone });
    }
    if let Some(w) = state.workload_by_ip(dst.ip())
        && let Some(wp) = &w.waypoint
    {
        let of = format!("{}/{}", w.namespace, w.name);
        if let Some(route) = via_waypoint(state, wp, src, dst, client, &of)? {
            return Ok(route);
        }
    }
    Ok(Route {
        target,
        hbone: direct_hbone(state, target),
    })
}

/// HBONE straight to the workload owning `target`, if it speaks HBONE.
fn direct_hbone(state: &ProxyState, target: SocketAddr) -> Option<Hbone> {
    state
        .workload_by_ip(target.ip())
        .filter(|w| w.protocol == Protocol::Hbone)
        .map(|w| Hbone {
            addr: SocketAddr::new(target.ip(), HBONE_PORT),
            authority: target,
            identity: w.identity(),
            service_host: None,
        })
}

/// The service's endpoints that may take traffic: healthy ones (the explicit endpoint's status,
/// else the workload's), or all when the service's `loadBalancer.healthPolicy` is `AllowAll`.
fn eligible_endpoints(state: &ProxyState, svc: &Service) -> Vec<Arc<Workload>> {
    let allow_all = svc
        .load_balancer
        .as_ref()
        .is_some_and(|lb| lb.health_policy == LoadBalancerHealthPolicy::AllowAll);
    let mut endpoints = state.endpoints(svc);
    if !allow_all {
        endpoints.retain(|w| {
            let status = svc.endpoints.get(&w.uid).map_or(w.status, |e| e.status);
            status == HealthStatus::Healthy
        });
    }
    endpoints
}

/// The route through waypoint `wp` for traffic to `dst` (of service or workload `of`), or
/// `None` when `src` is that waypoint.
fn via_waypoint(
    state: &ProxyState,
    wp: &GatewayAddress,
    src: &Workload,
    dst: SocketAddr,
    client: SocketAddr,
    of: &str,
) -> Result<Option<Route>, RouteError> {
    let waypoints = waypoint_workloads(state, wp);
    // the waypoint itself, or another replica of it (same identity)
    let src_id = src.identity();
    if waypoints
        .iter()
        .any(|w| w.uid == src.uid || w.identity() == src_id)
    {
        return Ok(None);
    }
    let no_waypoint = || RouteError::NoWaypoint {
        of: of.to_owned(),
        waypoint: describe(wp),
    };
    let w = pick(&waypoints, client).ok_or_else(no_waypoint)?;
    let ip = ip_like(w, dst).ok_or_else(no_waypoint)?;
    Ok(Some(Route {
        target: dst,
        hbone: Some(Hbone {
            addr: SocketAddr::new(ip, wp.hbone_mtls_port),
            authority: dst,
            identity: w.identity(),
            service_host: None,
        }),
    }))
}

/// The workloads a waypoint reference stands for: the endpoints of its service (by VIP or
/// hostname), else the workload owning its address or, by hostname, the workloads of that
/// namespace and hostname.
fn waypoint_workloads(state: &ProxyState, wp: &GatewayAddress) -> Vec<Arc<Workload>> {
    match &wp.destination {
        GatewayDestination::Address(a) => match state.service_by_vip(a.address) {
            Some(svc) => state.endpoints(&svc),
            None => state.workload_by_ip(a.address).into_iter().collect(),
        },
        GatewayDestination::Hostname(h) => {
            match state.service_by_key(&format!("{}/{}", h.namespace, h.hostname)) {
                Some(svc) => state.endpoints(&svc),
                None => state
                    .workloads()
                    .filter(|w| w.namespace == h.namespace && w.hostname == h.hostname)
                    .cloned()
                    .collect(),
            }
        }
    }
}

fn describe(wp: &GatewayAddress) -> String {
    match &wp.destination {
        GatewayDestination::Address(a) => format!("{}/{}", a.network, a.address),
        GatewayDestination::Hostname(h) => format!("{}/{}", h.namespace, h.hostname),
    }
}

/// The workload's IP of `dst`'s family, else its first.
fn ip_like(w: &Workload, dst: SocketAddr) -> Option<std::net::IpAddr> {
    w.workload_ips
        .iter()
        .copied()
        .find(|i| i.is_ipv4() == dst.is_ipv4())
        .or(w.workload_ips.first().copied())
}

/// The endpoint of a service a connection from `src` goes to, as ztunnel chooses it: among the
/// endpoints the service's routing preference keeps, one uniformly at random.
///
/// With `routingPreferences` `[s1, s2, ...]` an endpoint's rank is how many of the leading scopes
/// it shares with `src` (region, zone, subzone, node, cluster, network). `Strict` keeps the
/// endpoints that share all of them (none: no endpoint); `Failover` keeps those of the highest
/// rank present; `Standard` (or no preference) keeps all.
fn pick_endpoint<'a>(
    endpoints: &'a [Arc<Workload>],
    src: &Workload,
    lb: Option<&LoadBalancer>,
) -> Option<&'a Arc<Workload>> {
    let rank = |ep: &Workload, scopes: &[LoadBalancerScope]| {
        scopes
            .iter()
            .take_while(|scope| same_scope(**scope, src, ep))
            .count()
    };
    let kept: Vec<&Arc<Workload>> = match lb {
        Some(lb) if !lb.routing_preferences.is_empty() => {
            let scopes = &lb.routing_preferences;
            match lb.mode {
                LoadBalancerMode::Strict => endpoints
                    .iter()
                    .filter(|ep| rank(ep, scopes) == scopes.len())
                    .collect(),
                LoadBalancerMode::Failover => {
                    let best = endpoints.iter().map(|ep| rank(ep, scopes)).max();
                    endpoints
                        .iter()
                        .filter(|ep| Some(rank(ep, scopes)) == best)
                        .collect()
                }
                LoadBalancerMode::Standard | LoadBalancerMode::Passthrough => {
                    endpoints.iter().collect()
                }
            }
        }
        _ => endpoints.iter().collect(),
    };
    if kept.is_empty() {
        return None;
    }
    kept.get(fastrand::usize(..kept.len())).copied()
}

/// Whether `a` and `b` share `scope` (an empty region/zone/subzone/cluster matches only empty).
fn same_scope(scope: LoadBalancerScope, a: &Workload, b: &Workload) -> bool {
    match scope {
        LoadBalancerScope::Region => a.locality.region == b.locality.region,
        LoadBalancerScope::Zone => a.locality.zone == b.locality.zone,
        LoadBalancerScope::Subzone => a.locality.subzone == b.locality.subzone,
        LoadBalancerScope::Node => a.node == b.node,
        LoadBalancerScope::Cluster => a.cluster_id == b.cluster_id,
        LoadBalancerScope::Network => a.network == b.network,
    }
}

/// One of `endpoints` by the client's source port (waypoint instances).
fn pick<T>(endpoints: &[T], client: SocketAddr) -> Option<&T> {
    if endpoints.is_empty() {
        return None;
    }
    endpoints.get(client.port() as usize % endpoints.len())
}

#[cfg(test)]
mod tests;
