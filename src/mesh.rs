//! The node's mesh facts, defined once: the proxy's in-pod ports, the packet and connection marks
//! the redirection rules and the proxy's sockets agree on, the policy routing table, the node-level
//! endpoints and the default host directories.
//!
//! Values are Istio ambient's (`../shared/spec/ztunnel.md` §2 and §7, `../shared/spec/istio-cni.md`
//! §4.2 and §4.9): an Istio plugin, agent or ztunnel on the same node sees the same numbers.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// In-pod outbound capture port: the app's TCP connections are redirected here.
pub const OUTBOUND_PORT: u16 = 15001;
/// In-pod inbound plaintext capture port: inbound TCP that is not HBONE is redirected here.
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// In-pod HBONE port (mTLS + HTTP/2 CONNECT); never redirected.
pub const HBONE_PORT: u16 = 15008;
/// In-pod DNS proxy port (UDP and TCP); DNS capture redirects port 53 here.
pub const DNS_PORT: u16 = 15053;
/// Ports that are never a connection's target (ztunnel's `illegal_ports`): a request for one of them,
/// inbound or outbound, is refused, so the proxy cannot be made to loop into itself.
pub const NEVER_TARGET_PORTS: [u16; 3] = [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT];

/// Admin endpoint port (`/config_dump`), on localhost.
pub const ADMIN_PORT: u16 = 15000;
/// Metrics endpoint port (`/metrics`).
pub const METRICS_PORT: u16 = 15020;
/// Readiness endpoint port (`/healthz/ready`).
pub const READINESS_PORT: u16 = 15021;
/// Default admin address: `127.0.0.1:15000`.
pub const DEFAULT_ADMIN_ADDR: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), ADMIN_PORT);
/// Default metrics address: `0.0.0.0:15020`.
pub const DEFAULT_METRICS_ADDR: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), METRICS_PORT);
/// Default readiness address: `0.0.0.0:15021`.
pub const DEFAULT_READINESS_ADDR: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), READINESS_PORT);

/// Mask of the mark bits the mesh owns (`0xfff`): marks are compared and set under it, the
/// upper bits stay the node's.
pub const MARK_MASK: u32 = 0xfff;
/// Connection mark of connections the proxy accepted in-pod (`0x111`, Istio's `InpodTProxyMark`),
/// under [`MARK_MASK`]; its replies are routed back to the proxy by table [`ROUTE_TABLE`].
pub const CONNMARK: u32 = 0x111;
/// Policy routing table that holds the local default route for connmarked replies.
pub const ROUTE_TABLE: u32 = 100;
/// Priority (`pref`) of the `fwmark 0x111/0xfff lookup 100` rule.
pub const RULE_PRIORITY: u32 = 32764;

/// Default agent run dir (plugin socket `pluginevent.sock`, built-in CA, enrolled-pod state).
pub const DEFAULT_RUN_DIR: &str = "/var/run/ztnode";
/// Default ZDS socket (istio-cni `ZTUNNEL_UDS_ADDRESS`, ztunnel `INPOD_UDS`).
pub const DEFAULT_ZDS_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
/// Default host CNI binary dir.
pub const DEFAULT_CNI_BIN_DIR: &str = "/opt/cni/bin";
/// Default host CNI network config dir.
pub const DEFAULT_CNI_CONF_DIR: &str = "/etc/cni/net.d";
/// Namespaces never enrolled unless configured otherwise (istio-cni `EXCLUDE_NAMESPACES`), for
/// plugin and agent alike.
pub const DEFAULT_EXCLUDED_NAMESPACES: &[&str] = &["kube-system"];

/// The packet mark (`SO_MARK`) of every socket the proxy opens in a pod, and the mark the in-pod
/// rules exclude from capture: one value for both, or the proxy's own traffic is captured again.
///
/// Default `0x539` (1337, ztunnel's `PACKET_MARK`, Istio's `InpodMark`). It must be non-zero, fit in
/// [`MARK_MASK`] (the rules compare `mark & 0xfff`) and differ from [`CONNMARK`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PacketMark(u32);

/// Why a packet mark was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketMarkError {
    /// Not a number (decimal, or hex with `0x`).
    #[error("packet mark {0:?} is not a number (decimal, or hex with 0x)")]
    NotANumber(String),
    /// Zero marks nothing.
    #[error("packet mark must not be 0")]
    Zero,
    /// Bits outside the mesh's mask would be ignored by the rules.
    #[error("packet mark {0:#x} has bits outside the mesh mask {MARK_MASK:#x}")]
    OutsideMask(u32),
    /// The connection mark is taken.
    #[error("packet mark {0:#x} is the connection mark {CONNMARK:#x}")]
    IsConnmark(u32),
}

impl PacketMark {
    /// `0x539`.
    pub const DEFAULT: PacketMark = PacketMark(0x539);

    /// A checked mark (see the type's docs).
    pub fn new(mark: u32) -> Result<PacketMark, PacketMarkError> {
        if mark == 0 {
            Err(PacketMarkError::Zero)
        } else if mark & !MARK_MASK != 0 {
            Err(PacketMarkError::OutsideMask(mark))
        } else if mark == CONNMARK {
            Err(PacketMarkError::IsConnmark(mark))
        } else {
            Ok(PacketMark(mark))
        }
    }

    /// The mark's value.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for PacketMark {
    fn default() -> PacketMark {
        PacketMark::DEFAULT
    }
}

impl fmt::Debug for PacketMark {
    /// Hex, as the CLI and the rules spell it: `PacketMark(0x539)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PacketMark({:#x})", self.0)
    }
}

impl fmt::Display for PacketMark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl FromStr for PacketMark {
    type Err = PacketMarkError;

    /// Decimal (`1337`, as ztunnel's `PACKET_MARK`) or hex with `0x` (`0x539`).
    fn from_str(s: &str) -> Result<PacketMark, PacketMarkError> {
        let t = s.trim();
        let n = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => t.parse(),
        };
        PacketMark::new(n.map_err(|_| PacketMarkError::NotANumber(s.to_owned()))?)
    }
}

/// Default kubelet probe SNAT address (istio-cni `HOST_PROBE_SNAT_IP`): probes from it bypass capture.
pub const DEFAULT_PROBE_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// Default kubelet probe SNAT address for IPv6 (istio-cni `HOST_PROBE_SNAT_IPV6`).
pub const DEFAULT_PROBE_V6: Ipv6Addr = Ipv6Addr::new(
    0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_parse_in_decimal_and_hex_and_are_checked() {
        assert_eq!("1337".parse(), Ok(PacketMark::DEFAULT));
        assert_eq!("0x539".parse(), Ok(PacketMark::DEFAULT));
        assert_eq!(
            "0x540".parse::<PacketMark>().map(PacketMark::get),
            Ok(0x540)
        );
        assert_eq!("0".parse::<PacketMark>(), Err(PacketMarkError::Zero));
        assert_eq!(
            "0x1539".parse::<PacketMark>(),
            Err(PacketMarkError::OutsideMask(0x1539))
        );
        assert_eq!(
            "273".parse::<PacketMark>(),
            Err(PacketMarkError::IsConnmark(0x111))
        );
        assert!(matches!(
            "mark".parse::<PacketMark>(),
            Err(PacketMarkError::NotANumber(_))
        ));
        assert_eq!(PacketMark::DEFAULT.to_string(), "0x539");
    }

    #[test]
    fn default_endpoints_are_istios() {
        assert_eq!(DEFAULT_ADMIN_ADDR.to_string(), "127.0.0.1:15000");
        assert_eq!(DEFAULT_METRICS_ADDR.to_string(), "0.0.0.0:15020");
        assert_eq!(DEFAULT_READINESS_ADDR.to_string(), "0.0.0.0:15021");
    }
}
