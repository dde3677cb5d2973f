//! Hand-written prost messages for the protobuf types the delta xDS client speaks, with the
//! field numbers of ztunnel's `proto/{workload,authorization,xds}.proto` (spec §5 and §6) and
//! of `google.rpc.Status`. No code generation: each struct names the message it encodes.
//!
//! Enum fields are kept as `i32` (prost's open-enum form), so an unknown value decodes and the
//! conversion in `convert.rs` can reject it with a typed error.

use std::collections::HashMap;

pub use prost_types::{Any, Struct, Value};

/// Type URL of `istio.workload.Address` resources.
pub const ADDRESS_TYPE_URL: &str = "type.googleapis.com/istio.workload.Address";
/// Type URL of `istio.security.Authorization` resources.
pub const AUTHORIZATION_TYPE_URL: &str = "type.googleapis.com/istio.security.Authorization";

/// `istio.workload.*` (proto/workload.proto).
pub mod workload {
    use super::HashMap;

    /// `istio.workload.Address`: one workload or one service.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Address {
        /// `oneof type { Workload workload = 1; Service service = 2; }`.
        #[prost(oneof = "address::Type", tags = "1, 2")]
        pub r#type: Option<address::Type>,
    }

    /// The oneof of [`Address`].
    pub mod address {
        /// `Address.type`. Unboxed like prost-build's output; a decoded message is short-lived.
        #[derive(Clone, PartialEq, prost::Oneof)]
        #[allow(clippy::large_enum_variant)]
        pub enum Type {
            /// `workload = 1`.
            #[prost(message, tag = "1")]
            Workload(super::Workload),
            /// `service = 2`.
            #[prost(message, tag = "2")]
            Service(super::Service),
        }
    }

    /// `istio.workload.Workload` (field 15 is reserved).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Workload {
        /// `uid = 20`: the resource name, e.g. `Kubernetes//v1/Pod/ns/name`.
        #[prost(string, tag = "20")]
        pub uid: String,
        /// `name = 1`.
        #[prost(string, tag = "1")]
        pub name: String,
        /// `namespace = 2`.
        #[prost(string, tag = "2")]
        pub namespace: String,
        /// `addresses = 3`: IPs as 4 or 16 raw bytes.
        #[prost(bytes = "vec", repeated, tag = "3")]
        pub addresses: Vec<Vec<u8>>,
        /// `hostname = 21`.
        #[prost(string, tag = "21")]
        pub hostname: String,
        /// `network = 4`.
        #[prost(string, tag = "4")]
        pub network: String,
        /// `tunnel_protocol = 5` ([`TunnelProtocol`]).
        #[prost(enumeration = "TunnelProtocol", tag = "5")]
        pub tunnel_protocol: i32,
        /// `trust_domain = 6`.
        #[prost(string, tag = "6")]
        pub trust_domain: String,
        /// `service_account = 7`.
        #[prost(string, tag = "7")]
        pub service_account: String,
        /// `waypoint = 8`.
        #[prost(message, optional, tag = "8")]
        pub waypoint: Option<GatewayAddress>,
        /// `network_gateway = 19`.
        #[prost(message, optional, tag = "19")]
        pub network_gateway: Option<GatewayAddress>,
        /// `node = 9`.
        #[prost(string, tag = "9")]
        pub node: String,
        /// `canonical_name = 10`.
        #[prost(string, tag = "10")]
        pub canonical_name: String,
        /// `canonical_revision = 11`.
        #[prost(string, tag = "11")]
        pub canonical_revision: String,
        /// `workload_type = 12` ([`WorkloadType`]).
        #[prost(enumeration = "WorkloadType", tag = "12")]
        pub workload_type: i32,
        /// `workload_name = 13`.
        #[prost(string, tag = "13")]
        pub workload_name: String,
        /// `native_tunnel = 14`.
        #[prost(bool, tag = "14")]
        pub native_tunnel: bool,
        /// `application_tunnel = 23`.
        #[prost(message, optional, tag = "23")]
        pub application_tunnel: Option<ApplicationTunnel>,
        /// `services = 22`: `"namespace/hostname"` -> ports.
        #[prost(map = "string, message", tag = "22")]
        pub services: HashMap<String, PortList>,
        /// `authorization_policies = 16`: selector policies as `namespace/name`.
        #[prost(string, repeated, tag = "16")]
        pub authorization_policies: Vec<String>,
        /// `status = 17` ([`WorkloadStatus`]).
        #[prost(enumeration = "WorkloadStatus", tag = "17")]
        pub status: i32,
        /// `cluster_id = 18`.
        #[prost(string, tag = "18")]
        pub cluster_id: String,
        /// `locality = 24`.
        #[prost(message, optional, tag = "24")]
        pub locality: Option<Locality>,
        /// `network_mode = 25` ([`NetworkMode`]).
        #[prost(enumeration = "NetworkMode", tag = "25")]
        pub network_mode: i32,
        /// `extensions = 26`.
        #[prost(message, repeated, tag = "26")]
        pub extensions: Vec<Extension>,
        /// `capacity = 27` (`google.protobuf.UInt32Value`; unset = 1 in ztunnel).
        #[prost(message, optional, tag = "27")]
        pub capacity: Option<u32>,
    }

    /// `istio.workload.Service`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Service {
        /// `name = 1`.
        #[prost(string, tag = "1")]
        pub name: String,
        /// `namespace = 2`.
        #[prost(string, tag = "2")]
        pub namespace: String,
        /// `hostname = 3`.
        #[prost(string, tag = "3")]
        pub hostname: String,
        /// `addresses = 4`: the VIPs.
        #[prost(message, repeated, tag = "4")]
        pub addresses: Vec<NetworkAddress>,
        /// `ports = 5`.
        #[prost(message, repeated, tag = "5")]
        pub ports: Vec<Port>,
        /// `subject_alt_names = 6`.
        #[prost(string, repeated, tag = "6")]
        pub subject_alt_names: Vec<String>,
        /// `waypoint = 7`.
        #[prost(message, optional, tag = "7")]
        pub waypoint: Option<GatewayAddress>,
        /// `load_balancing = 8`.
        #[prost(message, optional, tag = "8")]
        pub load_balancing: Option<LoadBalancing>,
        /// `ip_families = 9` ([`IpFamilies`]).
        #[prost(enumeration = "IpFamilies", tag = "9")]
        pub ip_families: i32,
        /// `extensions = 10`.
        #[prost(message, repeated, tag = "10")]
        pub extensions: Vec<Extension>,
        /// `canonical = 11`.
        #[prost(bool, tag = "11")]
        pub canonical: bool,
        /// `ingress_use_waypoint = 12`.
        #[prost(bool, tag = "12")]
        pub ingress_use_waypoint: bool,
        /// `weighted_waypoints = 13`.
        #[prost(message, repeated, tag = "13")]
        pub weighted_waypoints: Vec<WeightedWaypoint>,
        /// `visibility = 14` ([`Visibility`]).
        #[prost(enumeration = "Visibility", tag = "14")]
        pub visibility: i32,
    }

    /// `istio.workload.Port`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Port {
        /// `service_port = 1`.
        #[prost(uint32, tag = "1")]
        pub service_port: u32,
        /// `target_port = 2`.
        #[prost(uint32, tag = "2")]
        pub target_port: u32,
        /// `app_protocol = 3` ([`AppProtocol`]).
        #[prost(enumeration = "AppProtocol", tag = "3")]
        pub app_protocol: i32,
    }

    /// `istio.workload.PortList`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PortList {
        /// `ports = 1`.
        #[prost(message, repeated, tag = "1")]
        pub ports: Vec<Port>,
    }

    /// `istio.workload.NetworkAddress`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NetworkAddress {
        /// `network = 1`.
        #[prost(string, tag = "1")]
        pub network: String,
        /// `address = 2`: 4 or 16 bytes.
        #[prost(bytes = "vec", tag = "2")]
        pub address: Vec<u8>,
        /// `optional length = 3`: prefix length of a CIDR VIP.
        #[prost(uint32, optional, tag = "3")]
        pub length: Option<u32>,
    }

    /// `istio.workload.NamespacedHostname`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NamespacedHostname {
        /// `namespace = 1`.
        #[prost(string, tag = "1")]
        pub namespace: String,
        /// `hostname = 2`.
        #[prost(string, tag = "2")]
        pub hostname: String,
    }

    /// `istio.workload.GatewayAddress` (field 4 is reserved).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GatewayAddress {
        /// `oneof destination { hostname = 1; address = 2; }`.
        #[prost(oneof = "gateway_address::Destination", tags = "1, 2")]
        pub destination: Option<gateway_address::Destination>,
        /// `hbone_mtls_port = 3`.
        #[prost(uint32, tag = "3")]
        pub hbone_mtls_port: u32,
    }

    /// The oneof of [`GatewayAddress`].
    pub mod gateway_address {
        /// `GatewayAddress.destination`.
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Destination {
            /// `hostname = 1`.
            #[prost(message, tag = "1")]
            Hostname(super::NamespacedHostname),
            /// `address = 2`.
            #[prost(message, tag = "2")]
            Address(super::NetworkAddress),
        }
    }

    /// `istio.workload.WeightedWaypoint`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WeightedWaypoint {
        /// `destination = 1`.
        #[prost(message, optional, tag = "1")]
        pub destination: Option<GatewayAddress>,
        /// `weight = 2`.
        #[prost(uint32, tag = "2")]
        pub weight: u32,
    }

    /// `istio.workload.ApplicationTunnel`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ApplicationTunnel {
        /// `protocol = 1` ([`application_tunnel::Protocol`]).
        #[prost(enumeration = "application_tunnel::Protocol", tag = "1")]
        pub protocol: i32,
        /// `port = 2` (0 = unset).
        #[prost(uint32, tag = "2")]
        pub port: u32,
    }

    /// The nested enum of [`ApplicationTunnel`].
    pub mod application_tunnel {
        /// `ApplicationTunnel.Protocol`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
        #[repr(i32)]
        pub enum Protocol {
            /// `NONE = 0`.
            None = 0,
            /// `PROXY = 1`.
            Proxy = 1,
        }
    }

    /// `istio.workload.LoadBalancing`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LoadBalancing {
        /// `routing_preference = 1` ([`load_balancing::Scope`]).
        #[prost(enumeration = "load_balancing::Scope", repeated, tag = "1")]
        pub routing_preference: Vec<i32>,
        /// `mode = 2` ([`load_balancing::Mode`]).
        #[prost(enumeration = "load_balancing::Mode", tag = "2")]
        pub mode: i32,
        /// `health_policy = 3` ([`load_balancing::HealthPolicy`]).
        #[prost(enumeration = "load_balancing::HealthPolicy", tag = "3")]
        pub health_policy: i32,
    }

    /// The nested enums of [`LoadBalancing`].
    pub mod load_balancing {
        /// `LoadBalancing.Scope`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
        #[repr(i32)]
        pub enum Scope {
            /// `UNSPECIFIED_SCOPE = 0`.
            UnspecifiedScope = 0,
            /// `REGION = 1`.
            Region = 1,
            /// `ZONE = 2`.
            Zone = 2,
            /// `SUBZONE = 3`.
            Subzone = 3,
            /// `NODE = 4`.
            Node = 4,
            /// `CLUSTER = 5`.
            Cluster = 5,
            /// `NETWORK = 6`.
            Network = 6,
        }

        /// `LoadBalancing.Mode`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
        #[repr(i32)]
        pub enum Mode {
            /// `UNSPECIFIED_MODE = 0`.
            UnspecifiedMode = 0,
            /// `STRICT = 1`.
            Strict = 1,
            /// `FAILOVER = 2`.
            Failover = 2,
            /// `PASSTHROUGH = 3`.
            Passthrough = 3,
        }

        /// `LoadBalancing.HealthPolicy`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
        #[repr(i32)]
        pub enum HealthPolicy {
            /// `ONLY_HEALTHY = 0`.
            OnlyHealthy = 0,
            /// `ALLOW_ALL = 1`.
            AllowAll = 1,
        }
    }

    /// `istio.workload.Locality`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Locality {
        /// `region = 1`.
        #[prost(string, tag = "1")]
        pub region: String,
        /// `zone = 2`.
        #[prost(string, tag = "2")]
        pub zone: String,
        /// `subzone = 3`.
        #[prost(string, tag = "3")]
        pub subzone: String,
    }

    /// `istio.workload.Extension`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Extension {
        /// `name = 1`.
        #[prost(string, tag = "1")]
        pub name: String,
        /// `config = 2`.
        #[prost(message, optional, tag = "2")]
        pub config: Option<super::Any>,
    }

    /// `istio.workload.TunnelProtocol`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum TunnelProtocol {
        /// `NONE = 0`: plain TCP.
        None = 0,
        /// `HBONE = 1`.
        Hbone = 1,
        /// `LEGACY_ISTIO_MTLS = 2`: a sidecar's mTLS.
        LegacyIstioMtls = 2,
    }

    /// `istio.workload.WorkloadStatus`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum WorkloadStatus {
        /// `HEALTHY = 0`.
        Healthy = 0,
        /// `UNHEALTHY = 1`.
        Unhealthy = 1,
    }

    /// `istio.workload.WorkloadType`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum WorkloadType {
        /// `DEPLOYMENT = 0`.
        Deployment = 0,
        /// `CRONJOB = 1`.
        Cronjob = 1,
        /// `POD = 2`.
        Pod = 2,
        /// `JOB = 3`.
        Job = 3,
    }

    /// `istio.workload.NetworkMode`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum NetworkMode {
        /// `STANDARD = 0`.
        Standard = 0,
        /// `HOST_NETWORK = 1`.
        HostNetwork = 1,
    }

    /// `istio.workload.IPFamilies`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum IpFamilies {
        /// `AUTOMATIC = 0`.
        Automatic = 0,
        /// `IPV4_ONLY = 1`.
        Ipv4Only = 1,
        /// `IPV6_ONLY = 2`.
        Ipv6Only = 2,
        /// `DUAL = 3`.
        Dual = 3,
    }

    /// `istio.workload.Service.Visibility`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Visibility {
        /// `PUBLIC = 0`.
        Public = 0,
        /// `NAMESPACE = 1`.
        Namespace = 1,
    }

    /// `istio.workload.AppProtocol`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum AppProtocol {
        /// `UNKNOWN = 0`.
        Unknown = 0,
        /// `HTTP11 = 1`.
        Http11 = 1,
        /// `HTTP2 = 2`.
        Http2 = 2,
        /// `GRPC = 3`.
        Grpc = 3,
        /// `TCP = 4`.
        Tcp = 4,
        /// `TLS = 5`.
        Tls = 5,
    }
}

/// `istio.security.*` (proto/authorization.proto).
pub mod security {
    /// `istio.security.Authorization`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Authorization {
        /// `name = 1`.
        #[prost(string, tag = "1")]
        pub name: String,
        /// `namespace = 2`.
        #[prost(string, tag = "2")]
        pub namespace: String,
        /// `scope = 3` ([`Scope`]).
        #[prost(enumeration = "Scope", tag = "3")]
        pub scope: i32,
        /// `action = 4` ([`Action`]).
        #[prost(enumeration = "Action", tag = "4")]
        pub action: i32,
        /// `rules = 5`.
        #[prost(message, repeated, tag = "5")]
        pub rules: Vec<Rule>,
        /// `dry_run = 6`.
        #[prost(bool, tag = "6")]
        pub dry_run: bool,
        /// `extensions = 7`.
        #[prost(message, repeated, tag = "7")]
        pub extensions: Vec<super::workload::Extension>,
    }

    /// `istio.security.Rule`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Rule {
        /// `clauses = 1`.
        #[prost(message, repeated, tag = "1")]
        pub clauses: Vec<Clause>,
    }

    /// `istio.security.Clause`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Clause {
        /// `matches = 2`.
        #[prost(message, repeated, tag = "2")]
        pub matches: Vec<Match>,
    }

    /// `istio.security.Match`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Match {
        /// `namespaces = 1`.
        #[prost(message, repeated, tag = "1")]
        pub namespaces: Vec<StringMatch>,
        /// `not_namespaces = 2`.
        #[prost(message, repeated, tag = "2")]
        pub not_namespaces: Vec<StringMatch>,
        /// `service_accounts = 11`.
        #[prost(message, repeated, tag = "11")]
        pub service_accounts: Vec<ServiceAccountMatch>,
        /// `not_service_accounts = 12`.
        #[prost(message, repeated, tag = "12")]
        pub not_service_accounts: Vec<ServiceAccountMatch>,
        /// `principals = 3`.
        #[prost(message, repeated, tag = "3")]
        pub principals: Vec<StringMatch>,
        /// `not_principals = 4`.
        #[prost(message, repeated, tag = "4")]
        pub not_principals: Vec<StringMatch>,
        /// `source_ips = 5`.
        #[prost(message, repeated, tag = "5")]
        pub source_ips: Vec<Address>,
        /// `not_source_ips = 6`.
        #[prost(message, repeated, tag = "6")]
        pub not_source_ips: Vec<Address>,
        /// `destination_ips = 7`.
        #[prost(message, repeated, tag = "7")]
        pub destination_ips: Vec<Address>,
        /// `not_destination_ips = 8`.
        #[prost(message, repeated, tag = "8")]
        pub not_destination_ips: Vec<Address>,
        /// `destination_ports = 9`.
        #[prost(uint32, repeated, tag = "9")]
        pub destination_ports: Vec<u32>,
        /// `not_destination_ports = 10`.
        #[prost(uint32, repeated, tag = "10")]
        pub not_destination_ports: Vec<u32>,
        /// `extensions = 13`.
        #[prost(message, repeated, tag = "13")]
        pub extensions: Vec<super::workload::Extension>,
    }

    /// `istio.security.Address`: a CIDR.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Address {
        /// `address = 1`: 4 or 16 bytes.
        #[prost(bytes = "vec", tag = "1")]
        pub address: Vec<u8>,
        /// `length = 2`: prefix length.
        #[prost(uint32, tag = "2")]
        pub length: u32,
    }

    /// `istio.security.ServiceAccountMatch`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ServiceAccountMatch {
        /// `namespace = 1`.
        #[prost(string, tag = "1")]
        pub namespace: String,
        /// `serviceAccount = 2`.
        #[prost(string, tag = "2")]
        pub service_account: String,
    }

    /// `istio.security.StringMatch`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StringMatch {
        /// `oneof match_type { exact = 1; prefix = 2; suffix = 3; presence = 4; }`.
        #[prost(oneof = "string_match::MatchType", tags = "1, 2, 3, 4")]
        pub match_type: Option<string_match::MatchType>,
    }

    /// The oneof of [`StringMatch`].
    pub mod string_match {
        /// `StringMatch.match_type`.
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum MatchType {
            /// `exact = 1`.
            #[prost(string, tag = "1")]
            Exact(String),
            /// `prefix = 2`.
            #[prost(string, tag = "2")]
            Prefix(String),
            /// `suffix = 3`.
            #[prost(string, tag = "3")]
            Suffix(String),
            /// `presence = 4` (`google.protobuf.Empty`).
            #[prost(message, tag = "4")]
            Presence(()),
        }
    }

    /// `istio.security.Scope`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Scope {
        /// `GLOBAL = 0`.
        Global = 0,
        /// `NAMESPACE = 1`.
        Namespace = 1,
        /// `WORKLOAD_SELECTOR = 2`.
        WorkloadSelector = 2,
    }

    /// `istio.security.Action`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Action {
        /// `ALLOW = 0`.
        Allow = 0,
        /// `DENY = 1`.
        Deny = 1,
    }
}

/// `Node` (`envoy.service.discovery.v3.Node` in the xds.proto ztunnel ships; the fields ztunnel sets).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Node {
    /// `id = 1`.
    #[prost(string, tag = "1")]
    pub id: String,
    /// `cluster = 2`.
    #[prost(string, tag = "2")]
    pub cluster: String,
    /// `metadata = 3`.
    #[prost(message, optional, tag = "3")]
    pub metadata: Option<Struct>,
}

/// `google.rpc.Status` (the `error_detail` of a NACK).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    /// `code = 1`: a gRPC status code (3 = `INVALID_ARGUMENT`).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// `message = 2`.
    #[prost(string, tag = "2")]
    pub message: String,
    /// `details = 3`.
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `envoy.service.discovery.v3.DeltaDiscoveryRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaDiscoveryRequest {
    /// `node = 1`: only on the first request of a stream.
    #[prost(message, optional, tag = "1")]
    pub node: Option<Node>,
    /// `type_url = 2`.
    #[prost(string, tag = "2")]
    pub type_url: String,
    /// `resource_names_subscribe = 3`.
    #[prost(string, repeated, tag = "3")]
    pub resource_names_subscribe: Vec<String>,
    /// `resource_names_unsubscribe = 4`.
    #[prost(string, repeated, tag = "4")]
    pub resource_names_unsubscribe: Vec<String>,
    /// `initial_resource_versions = 5`: name -> version held, on a new stream.
    #[prost(map = "string, string", tag = "5")]
    pub initial_resource_versions: HashMap<String, String>,
    /// `response_nonce = 6`: the nonce of the response being ACKed / NACKed.
    #[prost(string, tag = "6")]
    pub response_nonce: String,
    /// `error_detail = 7`: set on a NACK.
    #[prost(message, optional, tag = "7")]
    pub error_detail: Option<Status>,
}

/// `envoy.service.discovery.v3.DeltaDiscoveryResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaDiscoveryResponse {
    /// `system_version_info = 1`.
    #[prost(string, tag = "1")]
    pub system_version_info: String,
    /// `resources = 2`.
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<Resource>,
    /// `type_url = 4`.
    #[prost(string, tag = "4")]
    pub type_url: String,
    /// `removed_resources = 6`.
    #[prost(string, repeated, tag = "6")]
    pub removed_resources: Vec<String>,
    /// `nonce = 5`.
    #[prost(string, tag = "5")]
    pub nonce: String,
}

/// `envoy.service.discovery.v3.Resource`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    /// `name = 3`.
    #[prost(string, tag = "3")]
    pub name: String,
    /// `aliases = 4`.
    #[prost(string, repeated, tag = "4")]
    pub aliases: Vec<String>,
    /// `version = 1`.
    #[prost(string, tag = "1")]
    pub version: String,
    /// `resource = 2`.
    #[prost(message, optional, tag = "2")]
    pub resource: Option<Any>,
    /// `ttl = 6`.
    #[prost(message, optional, tag = "6")]
    pub ttl: Option<prost_types::Duration>,
    /// `cache_control = 7`.
    #[prost(message, optional, tag = "7")]
    pub cache_control: Option<resource::CacheControl>,
}

/// The nested message of [`Resource`].
pub mod resource {
    /// `Resource.CacheControl`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CacheControl {
        /// `do_not_cache = 1`.
        #[prost(bool, tag = "1")]
        pub do_not_cache: bool,
    }
}

#[cfg(test)]
mod tests;
