//! xDS resources → the local-config shapes ([`LocalWorkload`], [`LocalService`],
//! [`LocalPolicy`]), so xDS and `LOCAL_XDS_PATH` feed one state model (`proxy::state`).
//!
//! Defaults are ztunnel's for unset fields: capacity 1, status healthy, `NONE` tunnel = TCP,
//! `DEPLOYMENT` type, automatic IP families, public visibility; an empty service account or
//! trust domain becomes `default` / `cluster.local` when the state is built. Invalid input is a
//! [`ConvertError`] naming the field: an IP that is not 4 or 16 bytes, an enum number the proto
//! does not define, a port above 65535, an `Address` with neither workload nor service, a
//! gateway without destination, a string match without a match type.
//!
//! Not representable in our model, and so dropped: CIDR VIPs of a service (`NetworkAddress` with a
//! `length` shorter than the address), `weighted_waypoints`, `ingress_use_waypoint`, app
//! protocols and `extensions`. `LEGACY_ISTIO_MTLS` (a sidecar) is treated as plain TCP.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use prost::Message;

use super::proto::security::{self as sec, string_match::MatchType};
use super::proto::workload::{
    self as wl, address, application_tunnel, gateway_address, load_balancing,
};
use crate::proxy::config::{
    AppTunnelProtocol, ApplicationTunnel, Cidr, ConfigError, GatewayAddress, GatewayDestination,
    HealthStatus, IpFamily, LoadBalancer, LoadBalancerHealthPolicy, LoadBalancerMode,
    LoadBalancerScope, LocalPolicy, LocalService, LocalWorkload, Locality, NamespacedHostname,
    NetworkAddress, NetworkMode, PolicyAction, PolicyMatch, PolicyScope, Protocol,
    ServiceAccountMatch, StringMatch, Visibility, fail_closed_rules,
};

/// Why a resource could not be converted. `field` is the proto path, e.g. `workload.addresses`.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The bytes are not a valid protobuf message of the type.
    #[error("decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The resource carries no value, or a value of another type than the response's.
    #[error("resource type {got:?}, expected {want}")]
    TypeUrl {
        /// The `Any`'s type URL (empty: no value at all).
        got: String,
        /// The response's type URL.
        want: &'static str,
    },
    /// An `Address` with neither `workload` nor `service` set.
    #[error("Address has neither workload nor service")]
    EmptyAddress,
    /// An IP that is not 4 or 16 bytes long.
    #[error("{field}: failed to parse address, had {len} bytes")]
    AddressLength {
        /// The field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// An enum number the proto does not define.
    #[error("{field}: unknown enumeration value {value}")]
    UnknownEnum {
        /// The field.
        field: &'static str,
        /// The number received.
        value: i32,
    },
    /// A port number above 65535.
    #[error("{field}: port {value} is out of range")]
    Port {
        /// The field.
        field: &'static str,
        /// The number received.
        value: u32,
    },
    /// A CIDR prefix length longer than the address.
    #[error("{field}: prefix length {length} is too long for {addr}")]
    PrefixLength {
        /// The field.
        field: &'static str,
        /// The address.
        addr: IpAddr,
        /// The prefix length received.
        length: u32,
    },
    /// A required sub-message or oneof is missing.
    #[error("{field}: missing")]
    Missing {
        /// The field.
        field: &'static str,
    },
    /// A string in the wrong shape (e.g. a `services` key that is not `namespace/hostname`).
    #[error("{field}: {source}")]
    Value {
        /// The field.
        field: &'static str,
        /// Why the value is refused.
        #[source]
        source: ConfigError,
    },
}

/// One `istio.workload.Address` resource, converted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddressResource {
    /// A workload (pod).
    Workload(Box<LocalWorkload>),
    /// A service.
    Service(Box<LocalService>),
}

/// Decodes and converts the bytes of an `istio.workload.Address`.
///
/// # Errors
/// [`ConvertError::Decode`] for bytes that are no such message, else see [`address()`].
pub fn decode_address(bytes: &[u8]) -> Result<AddressResource, ConvertError> {
    address(&wl::Address::decode(bytes)?)
}

/// Decodes and converts the bytes of an `istio.security.Authorization`.
///
/// # Errors
/// [`ConvertError::Decode`] for bytes that are no such message, else see [`authorization`].
pub fn decode_authorization(bytes: &[u8]) -> Result<LocalPolicy, ConvertError> {
    authorization(&sec::Authorization::decode(bytes)?)
}

/// Converts an `Address` (the workload or the service it holds).
///
/// # Errors
/// [`ConvertError::EmptyAddress`], or the error of [`workload`] / [`service`].
pub fn address(a: &wl::Address) -> Result<AddressResource, ConvertError> {
    match &a.r#type {
        Some(address::Type::Workload(w)) => {
            workload(w).map(|w| AddressResource::Workload(Box::new(w)))
        }
        Some(address::Type::Service(s)) => {
            service(s).map(|s| AddressResource::Service(Box::new(s)))
        }
        None => Err(ConvertError::EmptyAddress),
    }
}

/// Converts a `Workload`.
///
/// # Errors
/// Bad addresses, unknown enums, bad ports or service keys, a gateway without destination.
pub fn workload(w: &wl::Workload) -> Result<LocalWorkload, ConvertError> {
    let workload_ips = w
        .addresses
        .iter()
        .map(|a| ip(a, "workload.addresses"))
        .collect::<Result<Vec<_>, _>>()?;
    let protocol = match known::<wl::TunnelProtocol>(w.tunnel_protocol, "workload.tunnel_protocol")?
    {
        wl::TunnelProtocol::Hbone => Protocol::Hbone,
        wl::TunnelProtocol::None | wl::TunnelProtocol::LegacyIstioMtls => Protocol::Tcp,
    };
    let status = match known::<wl::WorkloadStatus>(w.status, "workload.status")? {
        wl::WorkloadStatus::Healthy => HealthStatus::Healthy,
        wl::WorkloadStatus::Unhealthy => HealthStatus::Unhealthy,
    };
    let workload_type = match known::<wl::WorkloadType>(w.workload_type, "workload.workload_type")?
    {
        wl::WorkloadType::Deployment => "deployment",
        wl::WorkloadType::Cronjob => "cronjob",
        wl::WorkloadType::Pod => "pod",
        wl::WorkloadType::Job => "job",
    };
    let network_mode = match known::<wl::NetworkMode>(w.network_mode, "workload.network_mode")? {
        wl::NetworkMode::Standard => NetworkMode::Standard,
        wl::NetworkMode::HostNetwork => NetworkMode::HostNetwork,
    };
    let mut services = BTreeMap::new();
    for (key, list) in &w.services {
        let key: NamespacedHostname = key.parse().map_err(|source| ConvertError::Value {
            field: "workload.services",
            source,
        })?;
        services.insert(key, port_map(&list.ports, "workload.services.ports")?);
    }
    Ok(LocalWorkload {
        uid: w.uid.clone(),
        name: w.name.clone(),
        namespace: w.namespace.clone(),
        service_account: w.service_account.clone(),
        workload_ips,
        protocol,
        network_mode,
        node: w.node.clone(),
        network: w.network.clone(),
        trust_domain: w.trust_domain.clone(),
        hostname: w.hostname.clone(),
        waypoint: w
            .waypoint
            .as_ref()
            .map(|g| gateway(g, "workload.waypoint"))
            .transpose()?,
        network_gateway: w
            .network_gateway
            .as_ref()
            .map(|g| gateway(g, "workload.network_gateway"))
            .transpose()?,
        native_tunnel: w.native_tunnel,
        application_tunnel: w.application_tunnel.as_ref().map(app_tunnel).transpose()?,
        authorization_policies: w.authorization_policies.clone(),
        canonical_name: w.canonical_name.clone(),
        canonical_revision: w.canonical_revision.clone(),
        workload_name: w.workload_name.clone(),
        workload_type: workload_type.to_owned(),
        cluster_id: w.cluster_id.clone(),
        locality: w
            .locality
            .as_ref()
            .map(|l| Locality {
                region: l.region.clone(),
                zone: l.zone.clone(),
                subzone: l.subzone.clone(),
            })
            .unwrap_or_default(),
        status,
        capacity: w.capacity.unwrap_or(1),
        services,
    })
}

/// Converts a `Service`; its endpoints come from the workloads' `services` maps.
///
/// # Errors
/// Bad VIP addresses, ports or enums, a waypoint without destination.
pub fn service(s: &wl::Service) -> Result<LocalService, ConvertError> {
    let mut vips = Vec::new();
    for a in &s.addresses {
        let address = ip(&a.address, "service.addresses")?;
        let full = if address.is_ipv4() { 32 } else { 128 };
        match a.length {
            None => {}
            Some(l) if l == full => {}
            Some(l) if l > full => {
                return Err(ConvertError::PrefixLength {
                    field: "service.addresses",
                    addr: address,
                    length: l,
                });
            }
            // A CIDR VIP: not representable as one VIP.
            Some(_) => continue,
        }
        vips.push(NetworkAddress {
            network: a.network.clone(),
            address,
        });
    }
    let ip_families = match known::<wl::IpFamilies>(s.ip_families, "service.ip_families")? {
        wl::IpFamilies::Automatic => None,
        wl::IpFamilies::Ipv4Only => Some(IpFamily::IPv4),
        wl::IpFamilies::Ipv6Only => Some(IpFamily::IPv6),
        wl::IpFamilies::Dual => Some(IpFamily::Dual),
    };
    let visibility = match known::<wl::Visibility>(s.visibility, "service.visibility")? {
        wl::Visibility::Public => Visibility::Public,
        wl::Visibility::Namespace => Visibility::Namespace,
    };
    Ok(LocalService {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        hostname: s.hostname.clone(),
        vips,
        ports: port_map(&s.ports, "service.ports")?,
        subject_alt_names: s.subject_alt_names.clone(),
        waypoint: s
            .waypoint
            .as_ref()
            .map(|g| gateway(g, "service.waypoint"))
            .transpose()?,
        load_balancer: s.load_balancing.as_ref().map(load_balancer).transpose()?,
        ip_families,
        canonical: s.canonical,
        visibility,
        endpoints: BTreeMap::new(),
    })
}

/// Converts an `Authorization` policy.
///
/// # Errors
/// Unknown scope or action, bad CIDRs or ports, a string match without a match type.
pub fn authorization(p: &sec::Authorization) -> Result<LocalPolicy, ConvertError> {
    let scope = match known::<sec::Scope>(p.scope, "authorization.scope")? {
        sec::Scope::Global => PolicyScope::Global,
        sec::Scope::Namespace => PolicyScope::Namespace,
        sec::Scope::WorkloadSelector => PolicyScope::WorkloadSelector,
    };
    let action = match known::<sec::Action>(p.action, "authorization.action")? {
        sec::Action::Allow => PolicyAction::Allow,
        sec::Action::Deny => PolicyAction::Deny,
    };
    let rules: Result<_, ConvertError> = p
        .rules
        .iter()
        .map(|r| {
            r.clauses
                .iter()
                .map(|c| c.matches.iter().map(policy_match).collect())
                .collect()
        })
        .collect();
    // Rules that do not convert (a bad CIDR, a port over 65535) leave a policy whose scope and
    // action are known: it stands in fail-closed, as an unparsable local-config policy does (a
    // DENY denies everything in its scope, an ALLOW allows nothing), instead of vanishing.
    let (rules, invalid) = match rules {
        Ok(r) => (r, None),
        Err(e) => {
            tracing::warn!(policy = %format!("{}/{}", p.namespace, p.name), error = %e, "authorization rules do not convert: the policy stands in fail-closed");
            (fail_closed_rules(action), Some(e.to_string()))
        }
    };
    Ok(LocalPolicy {
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        scope,
        action,
        rules,
        dry_run: p.dry_run,
        invalid,
    })
}

// === helpers ===

fn known<E: TryFrom<i32>>(value: i32, field: &'static str) -> Result<E, ConvertError> {
    E::try_from(value).map_err(|_| ConvertError::UnknownEnum { field, value })
}

fn ip(bytes: &[u8], field: &'static str) -> Result<IpAddr, ConvertError> {
    if let Ok(v4) = <[u8; 4]>::try_from(bytes) {
        Ok(IpAddr::V4(Ipv4Addr::from(v4)))
    } else if let Ok(v6) = <[u8; 16]>::try_from(bytes) {
        Ok(IpAddr::V6(Ipv6Addr::from(v6)))
    } else {
        Err(ConvertError::AddressLength {
            field,
            len: bytes.len(),
        })
    }
}

fn port(value: u32, field: &'static str) -> Result<u16, ConvertError> {
    u16::try_from(value).map_err(|_| ConvertError::Port { field, value })
}

fn port_map(ports: &[wl::Port], field: &'static str) -> Result<BTreeMap<u16, u16>, ConvertError> {
    ports
        .iter()
        .map(|p| Ok((port(p.service_port, field)?, port(p.target_port, field)?)))
        .collect()
}

/// A gateway; an unset `hbone_mtls_port` means the HBONE port (15008), as in the local config.
fn gateway(g: &wl::GatewayAddress, field: &'static str) -> Result<GatewayAddress, ConvertError> {
    let destination = match &g.destination {
        Some(gateway_address::Destination::Address(a)) => {
            GatewayDestination::Address(NetworkAddress {
                network: a.network.clone(),
                address: ip(&a.address, field)?,
            })
        }
        Some(gateway_address::Destination::Hostname(h)) => {
            GatewayDestination::Hostname(NamespacedHostname {
                namespace: h.namespace.clone(),
                hostname: h.hostname.clone(),
            })
        }
        None => return Err(ConvertError::Missing { field }),
    };
    let hbone_mtls_port = match port(g.hbone_mtls_port, field)? {
        0 => crate::mesh::HBONE_PORT,
        p => p,
    };
    Ok(GatewayAddress {
        destination,
        hbone_mtls_port,
    })
}

fn app_tunnel(t: &wl::ApplicationTunnel) -> Result<ApplicationTunnel, ConvertError> {
    let field = "workload.application_tunnel";
    let protocol = match known::<application_tunnel::Protocol>(t.protocol, field)? {
        application_tunnel::Protocol::None => AppTunnelProtocol::None,
        application_tunnel::Protocol::Proxy => AppTunnelProtocol::Proxy,
    };
    let port = match port(t.port, field)? {
        0 => None,
        p => Some(p),
    };
    Ok(ApplicationTunnel { protocol, port })
}

fn load_balancer(lb: &wl::LoadBalancing) -> Result<LoadBalancer, ConvertError> {
    use load_balancing::{HealthPolicy, Mode, Scope};
    let field = "service.load_balancing";
    let mut routing_preferences = Vec::new();
    for &s in &lb.routing_preference {
        routing_preferences.push(match known::<Scope>(s, field)? {
            Scope::UnspecifiedScope => continue,
            Scope::Region => LoadBalancerScope::Region,
            Scope::Zone => LoadBalancerScope::Zone,
            Scope::Subzone => LoadBalancerScope::Subzone,
            Scope::Node => LoadBalancerScope::Node,
            Scope::Cluster => LoadBalancerScope::Cluster,
            Scope::Network => LoadBalancerScope::Network,
        });
    }
    let mode = match known::<Mode>(lb.mode, field)? {
        Mode::UnspecifiedMode => LoadBalancerMode::Standard,
        Mode::Strict => LoadBalancerMode::Strict,
        Mode::Failover => LoadBalancerMode::Failover,
        Mode::Passthrough => LoadBalancerMode::Passthrough,
    };
    let health_policy = match known::<HealthPolicy>(lb.health_policy, field)? {
        HealthPolicy::OnlyHealthy => LoadBalancerHealthPolicy::OnlyHealthy,
        HealthPolicy::AllowAll => LoadBalancerHealthPolicy::AllowAll,
    };
    Ok(LoadBalancer {
        routing_preferences,
        mode,
        health_policy,
    })
}

fn policy_match(m: &sec::Match) -> Result<PolicyMatch, ConvertError> {
    let accounts = |v: &[sec::ServiceAccountMatch]| {
        v.iter()
            .map(|s| ServiceAccountMatch {
                namespace: s.namespace.clone(),
                service_account: s.service_account.clone(),
            })
            .collect()
    };
    Ok(PolicyMatch {
        namespaces: all(&m.namespaces, |s| string_match(s, "match.namespaces"))?,
        not_namespaces: all(&m.not_namespaces, |s| {
            string_match(s, "match.not_namespaces")
        })?,
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: all(&m.principals, |s| string_match(s, "match.principals"))?,
        not_principals: all(&m.not_principals, |s| {
            string_match(s, "match.not_principals")
        })?,
        source_ips: all(&m.source_ips, |a| cidr(a, "match.source_ips"))?,
        not_source_ips: all(&m.not_source_ips, |a| cidr(a, "match.not_source_ips"))?,
        destination_ips: all(&m.destination_ips, |a| cidr(a, "match.destination_ips"))?,
        not_destination_ips: all(&m.not_destination_ips, |a| {
            cidr(a, "match.not_destination_ips")
        })?,
        destination_ports: all(&m.destination_ports, |&p| {
            port(p, "match.destination_ports")
        })?,
        not_destination_ports: all(&m.not_destination_ports, |&p| {
            port(p, "match.not_destination_ports")
        })?,
        // istiod leaves HTTP attributes out of what it sends ztunnel (a DENY's HTTP-only match
        // arrives empty); see `proxy::authz` for how that counts.
        l7_attributes: Vec::new(),
    })
}

fn all<T, U>(
    items: &[T],
    f: impl Fn(&T) -> Result<U, ConvertError>,
) -> Result<Vec<U>, ConvertError> {
    items.iter().map(f).collect()
}

fn string_match(s: &sec::StringMatch, field: &'static str) -> Result<StringMatch, ConvertError> {
    Ok(match &s.match_type {
        Some(MatchType::Exact(v)) => StringMatch::Exact(v.clone()),
        Some(MatchType::Prefix(v)) => StringMatch::Prefix(v.clone()),
        Some(MatchType::Suffix(v)) => StringMatch::Suffix(v.clone()),
        Some(MatchType::Presence(())) => StringMatch::Presence(),
        None => return Err(ConvertError::Missing { field }),
    })
}

fn cidr(a: &sec::Address, field: &'static str) -> Result<Cidr, ConvertError> {
    let addr = ip(&a.address, field)?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    match u8::try_from(a.length) {
        Ok(prefix_len) if prefix_len <= max => Ok(Cidr { addr, prefix_len }),
        _ => Err(ConvertError::PrefixLength {
            field,
            addr,
            length: a.length,
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
