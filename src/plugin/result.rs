//! CNI results: parsing `prevResult` by its own version and printing it in the config's version.
//!
//! The result stays a JSON object, so keys we do not know survive the round trip (Go plugins lose them).
//! Conversion follows libcni's converters (`../shared/spec/cni.md` §4): 0.x results carry
//! `ips[].version` ("4"/"6"), rebuilt from the address family; 1.x results have none; interface keys
//! `mtu`, `socketPath` and `pciID` exist only in 1.1.0 and are dropped below it; route extras are kept.
//! 0.x always prints `dns` (maybe `{}`), 1.x omits an empty one.

use std::net::IpAddr;

use serde_json::{Map, Value, json};

use crate::podevent::{IpNet, PodIp};

use super::netconf::json_kind;
use super::version::CniVersion;

/// Interface keys added in spec 1.1.0.
const IFACE_KEYS_1_1: [&str; 3] = ["mtu", "socketPath", "pciID"];

/// Why `prevResult` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ResultError {
    /// `prevResult` (or a part of it) has the wrong JSON shape.
    #[error("could not parse prevResult: {what} must be {expected}, got {found}")]
    Shape {
        /// JSON path of the offending part, e.g. `ips[1].gateway`.
        what: String,
        /// Expected type.
        expected: &'static str,
        /// Type or value found.
        found: String,
    },
    /// `prevResult.cniVersion` is not one this plugin can convert.
    #[error(
        "unsupported CNI result version {version:?} in prevResult (supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0)"
    )]
    UnsupportedVersion {
        /// The version found.
        version: String,
    },
}

/// A validated `prevResult` and the version it was written in.
#[derive(Debug, Clone, PartialEq)]
pub struct PrevResult {
    map: Map<String, Value>,
    version: CniVersion,
}

/// `address` of one `ips[]` entry: address (host bits kept) and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// The address.
    pub ip: IpAddr,
    /// Prefix length in bits.
    pub prefix: u8,
}

// === impl PrevResult ===

impl PrevResult {
    /// Parses `value` by its own `cniVersion`; a result without one is read as `conf_version` (as
    /// libcni does). Checks the parts the plugin reads or converts: `interfaces`, `ips` (CIDR
    /// `address`, IP `gateway`, integer `interface`), `routes`, `dns`.
    pub fn parse(value: &Value, conf_version: CniVersion) -> Result<PrevResult, ResultError> {
        let map = value
            .as_object()
            .ok_or_else(|| shape("prevResult", "an object", value))?;
        let version = match map.get("cniVersion") {
            None | Some(Value::Null) => conf_version,
            Some(Value::String(s)) => CniVersion::parse(s)
                .ok_or_else(|| ResultError::UnsupportedVersion { version: s.clone() })?,
            Some(other) => return Err(shape("cniVersion", "a string", other)),
        };
        for key in ["interfaces", "routes"] {
            for (i, item) in array(map, key)?.iter().enumerate() {
                if !item.is_object() {
                    return Err(shape(&format!("{key}[{i}]"), "an object", item));
                }
            }
        }
        if let Some(dns) = map.get("dns").filter(|d| !d.is_null() && !d.is_object()) {
            return Err(shape("dns", "an object", dns));
        }
        for (i, ip) in array(map, "ips")?.iter().enumerate() {
            parse_ip(i, ip)?;
        }
        Ok(PrevResult {
            map: map.clone(),
            version,
        })
    }

    /// The version the result was written in.
    pub fn version(&self) -> CniVersion {
        self.version
    }

    /// The result converted to `to`, ready to print.
    pub fn to_version(&self, to: CniVersion) -> Value {
        let mut map = self.map.clone();
        map.insert("cniVersion".into(), Value::String(to.as_str().into()));
        if let Some(Value::Array(ips)) = map.get_mut("ips") {
            for ip in ips.iter_mut().filter_map(Value::as_object_mut) {
                if to.is_legacy() {
                    let family = cidr_of(ip).map(|c| if c.ip.is_ipv4() { "4" } else { "6" });
                    if let Some(family) = family {
                        ip.insert("version".into(), Value::String(family.into()));
                    }
                } else {
                    ip.remove("version");
                }
            }
        }
        if to < CniVersion::V1_1_0
            && let Some(Value::Array(ifaces)) = map.get_mut("interfaces")
        {
            for iface in ifaces.iter_mut().filter_map(Value::as_object_mut) {
                for key in IFACE_KEYS_1_1 {
                    iface.remove(key);
                }
            }
        }
        match (self.version.is_legacy(), to.is_legacy()) {
            (false, true) if matches!(map.get("dns"), None | Some(Value::Null)) => {
                map.insert("dns".into(), json!({}));
            }
            (true, false) if map.get("dns").is_some_and(is_empty_object) => {
                map.remove("dns");
            }
            _ => {}
        }
        Value::Object(map)
    }

    /// The pod's IPs for the agent event (`ips[].address`, `gateway`, `interface`).
    pub fn pod_ips(&self) -> Vec<PodIp> {
        let Some(Value::Array(ips)) = self.map.get("ips") else {
            return Vec::new();
        };
        ips.iter()
            .enumerate()
            .filter_map(|(i, ip)| parse_ip(i, ip).ok())
            .collect()
    }
}

/// The result printed by ADD when there is no `prevResult`: no interfaces, no IPs (and `dns: {}` for
/// 0.x, which always prints it).
pub fn empty_result(version: CniVersion) -> Value {
    let mut v = json!({"cniVersion": version.as_str(), "interfaces": [], "ips": []});
    if version.is_legacy()
        && let Some(map) = v.as_object_mut()
    {
        map.insert("dns".into(), json!({}));
    }
    v
}

/// Parses a CIDR such as `10.1.0.5/16` or `fd00::5/64` (host bits kept).
pub fn parse_cidr(s: &str) -> Option<Cidr> {
    let (ip, prefix) = s.split_once('/')?;
    let ip: IpAddr = ip.parse().ok()?;
    if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let prefix: u8 = prefix.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (prefix <= max).then_some(Cidr { ip, prefix })
}

fn parse_ip(i: usize, ip: &Value) -> Result<PodIp, ResultError> {
    let obj = ip
        .as_object()
        .ok_or_else(|| shape(&format!("ips[{i}]"), "an object", ip))?;
    let address = match obj.get("address") {
        Some(Value::String(s)) => parse_cidr(s),
        _ => None,
    }
    .ok_or_else(|| {
        let found = obj.get("address").unwrap_or(&Value::Null);
        shape(&format!("ips[{i}].address"), "a CIDR string", found)
    })?;
    let gateway = match obj.get("gateway") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(g) => Some(
            g.as_str()
                .and_then(|s| s.parse::<IpAddr>().ok())
                .ok_or_else(|| shape(&format!("ips[{i}].gateway"), "an IP address", g))?,
        ),
    };
    let interface = match obj.get("interface") {
        None | Some(Value::Null) => None,
        Some(n) => Some(
            n.as_i64()
                .ok_or_else(|| shape(&format!("ips[{i}].interface"), "an integer", n))?,
        ),
    };
    Ok(PodIp {
        interface,
        address: IpNet {
            ip: address.ip,
            prefix: address.prefix,
        },
        gateway,
    })
}

fn cidr_of(ip: &Map<String, Value>) -> Option<Cidr> {
    ip.get("address")
        .and_then(Value::as_str)
        .and_then(parse_cidr)
}

fn array<'a>(map: &'a Map<String, Value>, key: &str) -> Result<&'a [Value], ResultError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(other) => Err(shape(key, "an array", other)),
    }
}

fn is_empty_object(v: &Value) -> bool {
    v.as_object().is_some_and(Map::is_empty)
}

fn shape(what: &str, expected: &'static str, found: &Value) -> ResultError {
    let found = match found {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => found.to_string(),
        other => json_kind(other).to_owned(),
    };
    ResultError::Shape {
        what: what.to_owned(),
        expected,
        found,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bridge_040() -> Value {
        json!({"cniVersion": "0.4.0",
            "interfaces": [{"name": "cni0", "mac": "0a:58:0a:f4:00:01"},
                           {"name": "veth1", "mac": "4e:0e:2f:59:0a:9c"},
                           {"name": "eth0", "mac": "0a:58:0a:f4:00:05", "sandbox": "/var/run/netns/cni-1"}],
            "ips": [{"version": "4", "interface": 2, "address": "10.244.0.5/24", "gateway": "10.244.0.1"},
                    {"version": "6", "interface": 2, "address": "fd00:10:244::5/64", "gateway": "fd00:10:244::1"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.0.1"}, {"dst": "::/0"}],
            "dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]}})
    }

    fn ptp_110() -> Value {
        json!({"cniVersion": "1.1.0",
            "interfaces": [{"name": "veth9", "mac": "aa:bb:cc:dd:ee:01", "mtu": 1450},
                           {"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "mtu": 1450, "sandbox": "/var/run/netns/x",
                            "socketPath": "/run/vhost.sock", "pciID": "0000:00:1f.0"}],
            "ips": [{"interface": 1, "address": "10.1.0.5/16", "gateway": "10.1.0.1"},
                    {"interface": 1, "address": "2001:db8::5/64"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1", "mtu": 1400, "table": 100, "scope": 0}],
            "dns": {}})
    }

    #[test]
    fn same_version_is_identity() {
        for v in [bridge_040(), ptp_110()] {
            let version = CniVersion::parse(v["cniVersion"].as_str().expect("str")).expect("known");
            let r = PrevResult::parse(&v, CniVersion::V0_3_0).expect("parses");
            assert_eq!(r.version(), version);
            assert_eq!(r.to_version(version), v);
        }
    }

    #[test]
    fn legacy_to_1x_drops_ip_version_and_empty_dns() {
        let mut v = bridge_040();
        v["dns"] = json!({});
        let out = PrevResult::parse(&v, CniVersion::V1_0_0)
            .expect("parses")
            .to_version(CniVersion::V1_1_0);
        assert_eq!(out["cniVersion"], "1.1.0");
        assert!(
            out["ips"]
                .as_array()
                .expect("ips")
                .iter()
                .all(|ip| ip.get("version").is_none())
        );
        assert!(out.get("dns").is_none());
        assert_eq!(out["routes"], v["routes"]);
        assert_eq!(out["interfaces"], v["interfaces"]);
    }

    #[test]
    fn v110_to_legacy_rebuilds_version_and_drops_iface_extras() {
        let out = PrevResult::parse(&ptp_110(), CniVersion::V0_4_0)
            .expect("parses")
            .to_version(CniVersion::V0_4_0);
        assert_eq!(out["cniVersion"], "0.4.0");
        assert_eq!(out["ips"][0]["version"], "4");
        assert_eq!(out["ips"][1]["version"], "6");
        for iface in out["interfaces"].as_array().expect("ifaces") {
            for key in IFACE_KEYS_1_1 {
                assert!(iface.get(key).is_none(), "{key} kept in {iface}");
            }
        }
        assert_eq!(out["interfaces"][1]["sandbox"], "/var/run/netns/x");
        assert_eq!(out["routes"][0]["table"], 100, "route extras are kept");
        assert_eq!(out["dns"], json!({}));
    }

    #[test]
    fn v110_to_100_drops_iface_extras_only() {
        let out = PrevResult::parse(&ptp_110(), CniVersion::V1_0_0)
            .expect("parses")
            .to_version(CniVersion::V1_0_0);
        assert!(out["interfaces"][0].get("mtu").is_none());
        assert!(out["ips"][0].get("version").is_none());
        assert_eq!(out["dns"], json!({}), "1.x to 1.x keeps dns as given");
    }

    #[test]
    fn missing_version_takes_conf_version_and_unknown_keys_survive() {
        let v = json!({"ips": [{"address": "10.0.0.2/8"}], "x-vendor": {"a": 1}});
        let r = PrevResult::parse(&v, CniVersion::V0_3_1).expect("parses");
        assert_eq!(r.version(), CniVersion::V0_3_1);
        let out = r.to_version(CniVersion::V0_3_1);
        assert_eq!(out["ips"][0]["version"], "4");
        assert_eq!(out["x-vendor"], json!({"a": 1}));
    }

    #[test]
    fn rejects_bad_results() {
        assert!(matches!(
            PrevResult::parse(&json!({"cniVersion": "1.2.0"}), CniVersion::V1_0_0),
            Err(ResultError::UnsupportedVersion { .. })
        ));
        for bad in [
            json!("x"),
            json!({"cniVersion": 1}),
            json!({"ips": {}}),
            json!({"ips": [{"address": "10.0.0.1"}]}),
            json!({"ips": [{"address": "10.0.0.1/33"}]}),
            json!({"ips": [{"address": "10.0.0.1/24", "gateway": "nope"}]}),
            json!({"ips": [{"address": "10.0.0.1/24", "interface": "1"}]}),
            json!({"interfaces": [1]}),
            json!({"dns": []}),
        ] {
            match PrevResult::parse(&bad, CniVersion::V1_0_0) {
                Err(e @ ResultError::Shape { .. }) => assert!(e.to_string().contains("prevResult")),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn pod_ips_from_result() {
        let ips = PrevResult::parse(&bridge_040(), CniVersion::V0_4_0)
            .expect("parses")
            .pod_ips();
        assert_eq!(ips.len(), 2);
        assert_eq!(
            ips[0].address,
            IpNet {
                ip: "10.244.0.5".parse().expect("ip"),
                prefix: 24
            }
        );
        assert_eq!(ips[0].gateway, Some("10.244.0.1".parse().expect("ip")));
        assert_eq!(ips[0].interface, Some(2));
        assert_eq!(ips[1].address.prefix, 64);
        let neg = json!({"ips": [{"address": "10.0.0.2/32", "interface": -1}]});
        let ips = PrevResult::parse(&neg, CniVersion::V1_0_0)
            .expect("parses")
            .pod_ips();
        assert_eq!(ips[0].interface, Some(-1));
        assert_eq!(ips[0].gateway, None);
    }

    #[test]
    fn empty_results() {
        assert_eq!(
            empty_result(CniVersion::V0_3_0),
            json!({"cniVersion": "0.3.0", "interfaces": [], "ips": [], "dns": {}})
        );
        assert_eq!(
            empty_result(CniVersion::V1_1_0),
            json!({"cniVersion": "1.1.0", "interfaces": [], "ips": []})
        );
    }

    #[test]
    fn cidrs() {
        assert_eq!(
            parse_cidr("10.1.0.5/16"),
            Some(Cidr {
                ip: "10.1.0.5".parse().expect("ip"),
                prefix: 16
            })
        );
        assert_eq!(parse_cidr("::1/128").map(|c| c.prefix), Some(128));
        for bad in [
            "10.0.0.1",
            "10.0.0.1/",
            "10.0.0.1/+8",
            "x/8",
            "::1/129",
            "10.0.0.1/-1",
        ] {
            assert_eq!(parse_cidr(bad), None, "{bad}");
        }
    }
}
