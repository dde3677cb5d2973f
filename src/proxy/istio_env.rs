//! ztunnel's environment, as Istio's ztunnel chart passes it (spec ztunnel.md §4-§5,
//! istio-deploy.md §6): where istiod's xDS and CA are, how to authenticate, and who this proxy
//! is. `ztnode node`, `ztnode proxy` and the `ztunnel` name all read it through
//! [`IstioEnv::from_vars`].
//!
//! Defaults follow ztunnel (`src/config.rs`) with one difference: xDS is on only when
//! `XDS_ADDRESS` is set (not empty), as Istio's chart always sets it. ztunnel would dial
//! `istiod.istio-system.svc:15012` in any cluster; ztnode's Kubernetes mode without istiod (pods
//! served with their handoff identities) and standalone mode keep working without a control plane. Names ztunnel reads but ztnode does not implement are reported by
//! [`IstioEnv::unsupported`] so the caller can warn once.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::control::{CallAuth, ControlEndpoint, ControlError, RootSource};
use super::identity::DEFAULT_TRUST_DOMAIN;
use super::pool::PoolConfig;

/// Default bearer token file (ztunnel `AUTH_TOKEN` default, relative to the working dir `/`).
pub const DEFAULT_TOKEN_FILE: &str = "./var/run/secrets/tokens/istio-token";
/// Default control-plane root (ztunnel `XDS_ROOT_CA` / `CA_ROOT_CA` default).
pub const DEFAULT_ROOT_FILE: &str = "./var/run/secrets/istio/root-cert.pem";
/// Default cluster id (`clusterid` header, node metadata).
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";
/// ztunnel's default `INSTANCE_IP` in its node id when none is given.
pub const DEFAULT_INSTANCE_IP: &str = "1.1.1.1";

/// Env names ztunnel reads that ztnode does not implement (yet): each set one is warned about
/// once. The names ztnode implements are read in [`IstioEnv::from_vars`] or by clap in `main`.
const UNSUPPORTED: &[&str] = &[
    "PROXY_MODE",
    "PROXY_WORKLOAD_INFO",
    "LOCAL_XDS",
    "ZTUNNEL_WORKER_THREADS",
    "HTTP2_STREAM_WINDOW_SIZE",
    "HTTP2_CONNECTION_WINDOW_SIZE",
    "HTTP2_FRAME_SIZE",
    "ENABLE_ORIG_SRC",
    "IPV6_ENABLED",
    "KEEPALIVE_TIME",
    "KEEPALIVE_INTERVAL",
    "KEEPALIVE_RETRIES",
    "KEEPALIVE_ENABLED",
    "USER_TIMEOUT_ENABLED",
    "LOCALHOST_APP_TUNNEL",
    "ENABLE_RESPONSE_BAGGAGE",
    "UNSTABLE_ENABLE_SOCKS5",
    "PROXY_CONFIG",
    "CRL_PATH",
    "TLS12_ENABLED",
    "COMPLIANCE_POLICY",
    "AUTHZ_POLICY_INFO_LOGGING",
    "DNS_PROXY_ADDR",
];

/// ztunnel's drain deadline when neither `CONNECTION_TERMINATION_DEADLINE` nor
/// `TERMINATION_GRACE_PERIOD_SECONDS` is set (`DEFAULT_CONNECTION_TERMINATION_DEADLINE`).
pub const DEFAULT_TERMINATION_DEADLINE: Duration = Duration::from_secs(5);

/// How long open connections may run on after a shutdown began, as ztunnel computes its
/// `self_termination_deadline` (`src/config.rs`): `CONNECTION_TERMINATION_DEADLINE` when set,
/// else from Kubernetes' `TERMINATION_GRACE_PERIOD_SECONDS` minus 5 s (minus 1 s when it is 10 s
/// or less), at least 1 s, so that the rest is closed before the kubelet's SIGKILL; else
/// [`DEFAULT_TERMINATION_DEADLINE`]. Unlike ztunnel, an explicit deadline longer than a set grace
/// period is cut to the grace period (the SIGKILL would end it there anyway), and no deadline is
/// longer than [`MAX_TERMINATION_DEADLINE`].
pub fn termination_deadline(explicit: Option<Duration>, grace_secs: Option<u64>) -> Duration {
    let deadline = match (explicit, grace_secs) {
        (Some(d), Some(g)) => d.min(Duration::from_secs(g)),
        (Some(d), None) => d,
        (None, Some(g)) => {
            let left = if g > 10 { g - 5 } else { g.saturating_sub(1) };
            Duration::from_secs(left.max(1))
        }
        (None, None) => DEFAULT_TERMINATION_DEADLINE,
    };
    deadline.min(MAX_TERMINATION_DEADLINE)
}

/// The longest drain deadline taken from the env: a larger value (a typo such as `5000h`, or
/// a grace period of years) is cut to this.
pub const MAX_TERMINATION_DEADLINE: Duration = Duration::from_secs(3600);

/// What [`IstioEnv::from_vars`] rejects.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// A duration (`SECRET_TTL`, `POOL_UNUSED_RELEASE_TIMEOUT`) does not parse or is too short.
    #[error("{name}={value:?} is not a duration{} like `24h`, `5m` or `90s`", at_least(*.min))]
    Duration {
        /// The env name.
        name: &'static str,
        /// The value.
        value: String,
        /// The shortest one accepted.
        min: Duration,
    },
    /// A count (`POOL_MAX_STREAMS_PER_CONNECTION`) is not a number in its range.
    #[error("{name}={value:?} is not a whole number from {min} to {max}")]
    Number {
        /// The env name.
        name: &'static str,
        /// The value.
        value: String,
        /// Smallest accepted.
        min: u64,
        /// Largest accepted.
        max: u64,
    },
    /// A boolean does not parse.
    #[error("{name}={value:?} is not a boolean (true/false)")]
    Bool {
        /// The env name.
        name: &'static str,
        /// The value.
        value: String,
    },
    /// An address is invalid.
    #[error("{name}: {source}")]
    Address {
        /// The env name.
        name: &'static str,
        /// What is wrong.
        #[source]
        source: ControlError,
    },
}

/// The lower bound of [`EnvError::Duration`]'s message.
fn at_least(min: Duration) -> String {
    if min.is_zero() {
        String::new()
    } else {
        format!(" of at least {min:?}")
    }
}

/// One control-plane service as configured: endpoint and call metadata.
#[derive(Clone, Debug)]
pub struct ControlService {
    /// Address, roots and verified name.
    pub endpoint: ControlEndpoint,
    /// Token, cluster id and extra headers of every call.
    pub auth: CallAuth,
}

/// The proxy's settings from ztunnel's env.
#[derive(Clone, Debug)]
pub struct IstioEnv {
    /// istiod's delta xDS, when on.
    pub xds: Option<ControlService>,
    /// istiod's CA, when on (`None` with `FAKE_CA=true` or without xDS: the built-in CA).
    pub ca: Option<ControlService>,
    /// `CLUSTER_ID` (`ISTIO_META_CLUSTER_ID` wins), default `Kubernetes`.
    pub cluster_id: String,
    /// `TRUST_DOMAIN`, default `cluster.local`.
    pub trust_domain: String,
    /// `SECRET_TTL` when set: the requested workload certificate lifetime (ztunnel's default
    /// is 24 h, [`DEFAULT_CERT_LIFETIME`](super::identity::DEFAULT_CERT_LIFETIME); ztnode's `--cert-lifetime-secs` applies when unset).
    pub secret_ttl: Option<Duration>,
    /// `NODE_NAME`.
    pub node_name: String,
    /// `POD_NAME` of the proxy itself.
    pub pod_name: String,
    /// `POD_NAMESPACE` of the proxy itself.
    pub pod_namespace: String,
    /// `INSTANCE_IP` (default `1.1.1.1`, as ztunnel's node id).
    pub instance_ip: String,
    /// `NETWORK`.
    pub network: String,
    /// `XDS_ON_DEMAND` (ztnode subscribes to everything regardless; see [`IstioEnv::unsupported`]).
    pub xds_on_demand: bool,
    /// `FAKE_CA`: the built-in CA even with xDS on.
    pub fake_ca: bool,
    /// `ISTIO_META_*` (prefix stripped) for the xDS node metadata.
    pub proxy_metadata: BTreeMap<String, String>,
    /// `POOL_MAX_STREAMS_PER_CONNECTION` (1..=65535, a `u16` as in ztunnel; default 100),
    /// `POOL_UNUSED_RELEASE_TIMEOUT` (a duration, default `5m`) and `HBONE_EARLY_DATA` (ztnode's,
    /// default true): the outbound HBONE pool.
    pub pool: PoolConfig,
    /// How long a shutdown lets open connections finish before closing them
    /// ([`termination_deadline`] of `CONNECTION_TERMINATION_DEADLINE` and
    /// `TERMINATION_GRACE_PERIOD_SECONDS`).
    pub termination_deadline: Duration,
    /// `INPOD_PORT_REUSE` (default true): the in-pod listeners get `SO_REUSEPORT`, so a new
    /// proxy process can take a pod over while the old one drains.
    pub port_reuse: bool,
    unsupported: Vec<String>,
}

impl IstioEnv {
    /// Reads the env from `vars` (e.g. `std::env::vars()`).
    ///
    /// # Errors
    /// Unparsable durations, booleans or addresses ([`EnvError`]).
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<IstioEnv, EnvError> {
        let vars: BTreeMap<String, String> = vars.into_iter().collect();
        let get = |k: &str| vars.get(k).map(String::as_str);
        let boolean = |name: &'static str| -> Result<bool, EnvError> {
            match get(name).map(str::to_ascii_lowercase).as_deref() {
                None | Some("") => Ok(false),
                Some("true" | "1") => Ok(true),
                Some("false" | "0") => Ok(false),
                Some(v) => Err(EnvError::Bool {
                    name,
                    value: v.to_owned(),
                }),
            }
        };
        let cluster_id = get("ISTIO_META_CLUSTER_ID")
            .or(get("CLUSTER_ID"))
            .filter(|v| !v.is_empty())
            .unwrap_or(DEFAULT_CLUSTER_ID)
            .to_owned();
        // Set but empty counts as unset, for every name below.
        let duration = |name: &'static str, min: Duration| -> Result<Option<Duration>, EnvError> {
            get(name)
                .filter(|v| !v.is_empty())
                .map(|v| {
                    parse_duration(v)
                        .filter(|d| *d >= min)
                        .ok_or_else(|| EnvError::Duration {
                            name,
                            value: v.to_owned(),
                            min,
                        })
                })
                .transpose()
        };
        let secret_ttl = duration("SECRET_TTL", Duration::from_secs(1))?;
        // ztunnel: `parse_default(POOL_MAX_STREAMS_PER_CONNECTION, 100)` as a u16 (an error when it
        // does not parse); 0 is refused here (no stream could ever be opened).
        let max_streams = match get("POOL_MAX_STREAMS_PER_CONNECTION").filter(|v| !v.is_empty()) {
            None => PoolConfig::default().max_streams_per_connection,
            Some(v) => match v.trim().parse::<u16>() {
                Ok(n) if n > 0 => usize::from(n),
                _ => {
                    return Err(EnvError::Number {
                        name: "POOL_MAX_STREAMS_PER_CONNECTION",
                        value: v.to_owned(),
                        min: 1,
                        max: u64::from(u16::MAX),
                    });
                }
            },
        };
        // ztunnel falls back to its default when the value does not parse; ztnode says so
        // instead, as for SECRET_TTL.
        let release = duration("POOL_UNUSED_RELEASE_TIMEOUT", Duration::ZERO)?;
        let early_data = match get("HBONE_EARLY_DATA").filter(|v| !v.is_empty()) {
            None => true,
            Some(_) => boolean("HBONE_EARLY_DATA")?,
        };
        let pool = PoolConfig {
            max_streams_per_connection: max_streams,
            unused_release_timeout: release.unwrap_or(PoolConfig::default().unused_release_timeout),
            early_data,
        };
        let fake_ca = boolean("FAKE_CA")?;
        let explicit_deadline = duration("CONNECTION_TERMINATION_DEADLINE", Duration::ZERO)?;
        let grace = match get("TERMINATION_GRACE_PERIOD_SECONDS").filter(|v| !v.is_empty()) {
            None => None,
            Some(v) => Some(v.trim().parse::<u64>().map_err(|_| EnvError::Number {
                name: "TERMINATION_GRACE_PERIOD_SECONDS",
                value: v.to_owned(),
                min: 0,
                max: u64::MAX,
            })?),
        };
        let port_reuse = match get("INPOD_PORT_REUSE").filter(|v| !v.is_empty()) {
            None => true,
            Some(_) => boolean("INPOD_PORT_REUSE")?,
        };
        let xds_address = get("XDS_ADDRESS")
            .filter(|a| !a.is_empty())
            .map(str::to_owned);
        let token_file = PathBuf::from(get("AUTH_TOKEN").unwrap_or(DEFAULT_TOKEN_FILE));
        let service = |name: &'static str,
                       address: &str,
                       root_env: &str,
                       alt_env: &str,
                       header_prefix: &str|
         -> Result<ControlService, EnvError> {
            let roots = RootSource::parse(get(root_env).unwrap_or(DEFAULT_ROOT_FILE));
            let alt = get(alt_env).map(str::to_owned);
            let endpoint = ControlEndpoint::new(address, roots, alt)
                .map_err(|source| EnvError::Address { name, source })?;
            let headers = vars
                .iter()
                .filter_map(|(k, v)| {
                    let h = k.strip_prefix(header_prefix)?;
                    Some((h.to_ascii_lowercase().replace('_', "-"), v.clone()))
                })
                .collect();
            Ok(ControlService {
                endpoint,
                auth: CallAuth {
                    token_file: Some(token_file.clone()),
                    cluster_id: cluster_id.clone(),
                    headers,
                },
            })
        };
        let xds = xds_address
            .as_deref()
            .map(|a| {
                service(
                    "XDS_ADDRESS",
                    a,
                    "XDS_ROOT_CA",
                    "ALT_XDS_HOSTNAME",
                    "XDS_HEADER_",
                )
            })
            .transpose()?;
        let ca_address = match get("CA_ADDRESS") {
            Some("") => None,
            Some(a) => Some(a.to_owned()),
            None => xds_address.clone(),
        };
        let ca = if fake_ca {
            None
        } else {
            ca_address
                .as_deref()
                .map(|a| {
                    service(
                        "CA_ADDRESS",
                        a,
                        "CA_ROOT_CA",
                        "ALT_CA_HOSTNAME",
                        "CA_HEADER_",
                    )
                })
                .transpose()?
        };
        let mut unsupported: Vec<String> = UNSUPPORTED
            .iter()
            .filter(|n| get(n).is_some())
            .map(|n| (*n).to_owned())
            .collect();
        unsupported.extend(
            vars.keys()
                .filter(|k| k.starts_with("ISTIO_METAJSON_"))
                .cloned(),
        );
        let xds_on_demand = boolean("XDS_ON_DEMAND")?;
        if xds_on_demand {
            unsupported.push("XDS_ON_DEMAND (ztnode subscribes to every resource)".into());
        }
        if get("PROXY_MODE").is_some_and(|m| m == "shared") {
            unsupported.retain(|n| n != "PROXY_MODE");
        }
        Ok(IstioEnv {
            xds,
            ca,
            cluster_id,
            trust_domain: get("TRUST_DOMAIN")
                .filter(|v| !v.is_empty())
                .unwrap_or(DEFAULT_TRUST_DOMAIN)
                .to_owned(),
            secret_ttl,
            node_name: get("NODE_NAME").unwrap_or_default().to_owned(),
            pod_name: get("POD_NAME").unwrap_or_default().to_owned(),
            pod_namespace: get("POD_NAMESPACE").unwrap_or_default().to_owned(),
            instance_ip: get("INSTANCE_IP")
                .filter(|v| !v.is_empty())
                .unwrap_or(DEFAULT_INSTANCE_IP)
                .to_owned(),
            network: get("NETWORK").unwrap_or_default().to_owned(),
            xds_on_demand,
            fake_ca,
            proxy_metadata: vars
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("ISTIO_META_")?.to_owned(), v.clone())))
                .collect(),
            pool,
            termination_deadline: termination_deadline(explicit_deadline, grace),
            port_reuse,
            unsupported,
        })
    }

    /// Set env names that ztunnel reads and ztnode ignores (to warn about once at start).
    pub fn unsupported(&self) -> &[String] {
        &self.unsupported
    }

    /// Logs one warning per [`IstioEnv::unsupported`] name.
    pub fn warn_unsupported(&self) {
        for name in &self.unsupported {
            tracing::warn!(env = %name, "ztunnel setting not supported by ztnode; ignored");
        }
    }
}

/// Parses a Go-style duration as ztunnel's `SECRET_TTL` and `POOL_UNUSED_RELEASE_TIMEOUT` take it: one or more `<number><unit>`
/// with units `ms`, `s`, `m`, `h`, `d` (e.g. `24h`, `1h30m`, `90s`); a bare number is seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .filter(|&i| i > 0)?;
        let n: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total = total.checked_add(Duration::try_from_secs_f64(n * unit).ok()?)?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<IstioEnv, EnvError> {
        IstioEnv::from_vars(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        )
    }

    #[test]
    fn durations_parse_as_go_writes_them() {
        assert_eq!(parse_duration("24h"), Some(Duration::from_secs(86400)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("3600"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        for bad in ["", "h", "10x", "1.5.2h", "-1h"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_charts_env_turns_on_xds_and_the_ca_with_https_added() {
        let e = env(&[
            ("XDS_ADDRESS", "istiod.istio-system.svc:15012"),
            ("CA_ROOT_CA", "/ca/root.pem"),
            ("ISTIO_META_CLUSTER_ID", "c1"),
            ("CLUSTER_ID", "ignored"),
            ("SECRET_TTL", "60s"),
            ("NODE_NAME", "node-1"),
            ("POD_NAME", "ztunnel-abc"),
            ("POD_NAMESPACE", "istio-system"),
            ("INSTANCE_IP", "10.0.0.5"),
            ("XDS_HEADER_X_TENANT", "t1"),
        ])
        .expect("env");
        let xds = e.xds.expect("xds on");
        assert_eq!(
            xds.endpoint.address.to_string(),
            "https://istiod.istio-system.svc:15012/"
        );
        assert_eq!(
            xds.endpoint.roots,
            RootSource::File(DEFAULT_ROOT_FILE.into())
        );
        assert_eq!(xds.auth.cluster_id, "c1");
        assert_eq!(xds.auth.token_file, Some(PathBuf::from(DEFAULT_TOKEN_FILE)));
        assert_eq!(xds.auth.headers, [("x-tenant".to_owned(), "t1".to_owned())]);
        let ca = e.ca.expect("ca on");
        assert_eq!(
            ca.endpoint.address, xds.endpoint.address,
            "CA_ADDRESS defaults to XDS_ADDRESS"
        );
        assert_eq!(ca.endpoint.roots, RootSource::File("/ca/root.pem".into()));
        assert!(ca.auth.headers.is_empty());
        assert_eq!(e.secret_ttl, Some(Duration::from_secs(60)));
        assert_eq!(e.cluster_id, "c1");
        assert_eq!(
            e.proxy_metadata.get("CLUSTER_ID").map(String::as_str),
            Some("c1")
        );
        assert_eq!(
            (e.node_name.as_str(), e.instance_ip.as_str()),
            ("node-1", "10.0.0.5")
        );
    }

    #[test]
    fn xds_is_on_only_with_an_xds_address() {
        let e = env(&[]).expect("env");
        assert!(e.xds.is_none() && e.ca.is_none());
        assert_eq!(e.cluster_id, DEFAULT_CLUSTER_ID);
        assert_eq!(
            e.secret_ttl, None,
            "unset: ztnode's flag (default 24 h) applies"
        );
        let e = env(&[("KUBERNETES_SERVICE_HOST", "10.96.0.1")]).expect("env");
        assert!(e.xds.is_none(), "no implicit istiod in a cluster");
        let e = env(&[("XDS_ADDRESS", "")]).expect("env");
        assert!(e.xds.is_none(), "an empty XDS_ADDRESS disables xDS");
        let e = env(&[("XDS_ADDRESS", "https://127.0.0.1:1"), ("FAKE_CA", "true")]).expect("env");
        assert!(
            e.xds.is_some() && e.ca.is_none(),
            "FAKE_CA keeps the built-in CA"
        );
        let e = env(&[("XDS_ADDRESS", "127.0.0.1:1"), ("CA_ADDRESS", "")]).expect("env");
        assert!(
            e.xds.is_some() && e.ca.is_none(),
            "an empty CA_ADDRESS disables the CA"
        );
    }

    #[test]
    fn bad_values_are_clear_errors_and_unsupported_names_are_listed() {
        let err = env(&[("SECRET_TTL", "soon")]).expect_err("bad ttl");
        assert!(env(&[("SECRET_TTL", "500ms")]).is_err(), "below 1 s");
        assert_eq!(parse_duration("99999999999999999999h"), None, "overflow");
        assert_eq!(
            parse_duration("9000000000000000000h9000000000000000000h"),
            None,
            "sum overflow"
        );
        assert!(err.to_string().contains("SECRET_TTL=\"soon\""), "{err}");
        let err = env(&[("FAKE_CA", "yes please")]).expect_err("bad bool");
        assert!(err.to_string().contains("FAKE_CA"), "{err}");
        let err = env(&[("XDS_ADDRESS", "http://istiod:15010")]).expect_err("plaintext");
        assert!(err.to_string().contains("XDS_ADDRESS"), "{err}");
        let e = env(&[
            ("HTTP2_FRAME_SIZE", "65536"),
            ("PROXY_MODE", "shared"),
            ("XDS_ON_DEMAND", "true"),
        ])
        .expect("env");
        assert_eq!(e.unsupported().len(), 2, "{:?}", e.unsupported());
        assert_eq!(e.unsupported()[0], "HTTP2_FRAME_SIZE");
        assert!(e.unsupported()[1].starts_with("XDS_ON_DEMAND"));
    }

    #[test]
    fn the_drain_deadline_and_port_reuse_follow_ztunnels_env() {
        let e = env(&[]).expect("env");
        assert_eq!(e.termination_deadline, Duration::from_secs(5));
        assert!(e.port_reuse, "INPOD_PORT_REUSE defaults to true");
        let e = env(&[
            ("CONNECTION_TERMINATION_DEADLINE", "2500ms"),
            ("INPOD_PORT_REUSE", "false"),
        ])
        .expect("env");
        assert_eq!(e.termination_deadline, Duration::from_millis(2500));
        assert!(!e.port_reuse);
        assert!(e.unsupported().is_empty(), "{:?}", e.unsupported());
        // from Kubernetes' grace period: 5 s (1 s when short) left for the forced close
        for (grace, want) in [
            ("30", 25),
            ("11", 6),
            ("10", 9),
            ("2", 1),
            ("1", 1),
            ("0", 1),
        ] {
            let e = env(&[("TERMINATION_GRACE_PERIOD_SECONDS", grace)]).expect("env");
            assert_eq!(e.termination_deadline, Duration::from_secs(want), "{grace}");
        }
        // an explicit deadline wins, but never beyond the grace period
        let e = env(&[
            ("CONNECTION_TERMINATION_DEADLINE", "3s"),
            ("TERMINATION_GRACE_PERIOD_SECONDS", "30"),
        ])
        .expect("env");
        assert_eq!(e.termination_deadline, Duration::from_secs(3));
        let e = env(&[
            ("CONNECTION_TERMINATION_DEADLINE", "60s"),
            ("TERMINATION_GRACE_PERIOD_SECONDS", "30"),
        ])
        .expect("env");
        assert_eq!(e.termination_deadline, Duration::from_secs(30));
        // huge values are cut to an hour (a drain must be able to compute its end)
        for vars in [
            &[("CONNECTION_TERMINATION_DEADLINE", "2562047788015215h")][..],
            &[("TERMINATION_GRACE_PERIOD_SECONDS", "18446744073709551615")],
            &[
                ("CONNECTION_TERMINATION_DEADLINE", "100000h"),
                ("TERMINATION_GRACE_PERIOD_SECONDS", "99999999999"),
            ],
        ] {
            let e = env(vars).expect("env");
            assert_eq!(e.termination_deadline, MAX_TERMINATION_DEADLINE, "{vars:?}");
        }
        for (name, bad) in [
            ("CONNECTION_TERMINATION_DEADLINE", "soon"),
            ("TERMINATION_GRACE_PERIOD_SECONDS", "-1"),
            ("INPOD_PORT_REUSE", "maybe"),
        ] {
            let err = env(&[(name, bad)]).expect_err(name);
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    #[test]
    fn pool_settings_follow_ztunnels_env() {
        let e = env(&[]).expect("env");
        assert_eq!(e.pool, PoolConfig::default());
        assert_eq!(
            (
                e.pool.max_streams_per_connection,
                e.pool.unused_release_timeout
            ),
            (100, Duration::from_secs(300)),
            "ztunnel's defaults"
        );
        let e = env(&[
            ("POOL_MAX_STREAMS_PER_CONNECTION", "20"),
            ("POOL_UNUSED_RELEASE_TIMEOUT", "1m30s"),
        ])
        .expect("env");
        assert_eq!(
            e.pool,
            PoolConfig {
                max_streams_per_connection: 20,
                unused_release_timeout: Duration::from_secs(90),
                early_data: true,
            }
        );
        let e = env(&[("HBONE_EARLY_DATA", "false")]).expect("env");
        assert!(!e.pool.early_data);
        assert!(env(&[("HBONE_EARLY_DATA", "sometimes")]).is_err());
        assert!(e.unsupported().is_empty(), "{:?}", e.unsupported());
        let e = env(&[
            ("POOL_MAX_STREAMS_PER_CONNECTION", ""),
            ("POOL_UNUSED_RELEASE_TIMEOUT", "0s"),
        ])
        .expect("env");
        assert_eq!(e.pool.max_streams_per_connection, 100, "empty = unset");
        assert_eq!(e.pool.unused_release_timeout, Duration::ZERO);
        for bad in ["0", "65536", "-1", "lots"] {
            let err = env(&[("POOL_MAX_STREAMS_PER_CONNECTION", bad)]).expect_err(bad);
            assert!(
                err.to_string()
                    .contains(&format!("POOL_MAX_STREAMS_PER_CONNECTION=\"{bad}\"")),
                "{err}"
            );
        }
        let err = env(&[("POOL_UNUSED_RELEASE_TIMEOUT", "later")]).expect_err("bad timeout");
        assert_eq!(
            err.to_string(),
            "POOL_UNUSED_RELEASE_TIMEOUT=\"later\" is not a duration like `24h`, `5m` or `90s`"
        );
        let err = env(&[("SECRET_TTL", "1ms")]).expect_err("short ttl");
        assert!(err.to_string().contains("of at least 1s"), "{err}");
    }
}
