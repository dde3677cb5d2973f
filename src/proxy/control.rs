//! The channel to Istio's control plane (istiod's xDS and CA, spec §4 "Control-plane TLS" and
//! "Auth headers"): gRPC over TLS (h2 only) with the roots and name ztunnel would use, and the
//! per-call `authorization` / `clusterid` metadata.
//!
//! - [`ControlEndpoint`]: address, trust roots (`XDS_ROOT_CA` / `CA_ROOT_CA`: a file, literal
//!   PEM or `SYSTEM`), the name to verify (`ALT_XDS_HOSTNAME` / `ALT_CA_HOSTNAME`). The root file is
//!   re-read on every [`ControlEndpoint::connect`], so a reconnect picks up a rotated root.
//! - [`CallAuth`]: the bearer token file (re-read on every call, as ztunnel does), the cluster
//!   id and extra headers (`XDS_HEADER_*` / `CA_HEADER_*`).
//! - [`unary`] / [`streaming`]: one gRPC call with prost messages on a connected channel.

use std::path::PathBuf;
use std::time::Duration;

use http::uri::PathAndQuery;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// TCP connect timeout to the control plane (ztunnel: 5 s).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 keepalive ping interval (ztunnel: 30 s).
pub const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// HTTP/2 keepalive ping timeout (ztunnel: 10 s).
pub const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive idle time (ztunnel: 300 s).
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(300);
/// Largest message accepted from the control plane (ztunnel: 200 MiB): istiod sends the whole
/// first wildcard Address response as one message, over tonic's 4 MiB default in a large mesh.
pub const MAX_MESSAGE_SIZE: usize = 200 * 1024 * 1024;

/// Where the trust roots for the control plane's server certificate come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootSource {
    /// A PEM file (re-read on every connect).
    File(PathBuf),
    /// PEM given inline (the env value starts with `-----BEGIN`).
    Pem(String),
    /// The system's roots (`SYSTEM`).
    System,
}

/// One control-plane service address with the TLS settings to reach it.
#[derive(Clone, Debug)]
pub struct ControlEndpoint {
    /// `https://host:port` (a missing scheme is added by [`ControlEndpoint::new`]).
    pub address: http::Uri,
    /// Trust roots for the server certificate.
    pub roots: RootSource,
    /// Name to verify instead of the address's host (`ALT_*_HOSTNAME`).
    pub alt_hostname: Option<String>,
}

/// Metadata sent with every control-plane call (spec §4, ztunnel `src/identity/auth.rs`).
/// `Debug` shows the header names only, never their values.
#[derive(Clone, Default)]
pub struct CallAuth {
    /// File holding the bearer token (`AUTH_TOKEN`); `None` sends no `authorization`.
    pub token_file: Option<PathBuf>,
    /// Value of the `clusterid` header (`CLUSTER_ID`, default `Kubernetes`).
    pub cluster_id: String,
    /// Extra headers, lower-case names (`XDS_HEADER_*` / `CA_HEADER_*`).
    pub headers: Vec<(String, String)>,
}

/// Errors reaching the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The address is not a valid URI.
    #[error("invalid control-plane address {address:?}: {reason}")]
    Address {
        /// The address as given.
        address: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The root file cannot be read.
    #[error("cannot read the control-plane root {}: {source}", path.display())]
    ReadRoots {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The root file holds no certificate.
    #[error("control-plane root {what} holds no PEM certificate")]
    NoRoots {
        /// The file path, or `inline PEM`.
        what: String,
    },
    /// The token file cannot be read.
    #[error("cannot read the token {}: {source}", path.display())]
    ReadToken {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A header name or value (token included) is not valid gRPC ASCII metadata.
    #[error("invalid gRPC metadata {name:?}")]
    Metadata {
        /// The header name.
        name: String,
    },
    /// The TLS or TCP connection failed.
    #[error("cannot connect to {address}: {source}")]
    Connect {
        /// The address.
        address: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
}

// === impl RootSource ===

impl RootSource {
    /// Parses ztunnel's root setting: `SYSTEM`, literal PEM, or a file path.
    pub fn parse(value: &str) -> RootSource {
        if value == "SYSTEM" {
            RootSource::System
        } else if value.trim_start().starts_with("-----BEGIN") {
            RootSource::Pem(value.to_owned())
        } else {
            RootSource::File(PathBuf::from(value))
        }
    }

    /// The roots as PEM (`None` for [`RootSource::System`]).
    ///
    /// # Errors
    /// An unreadable file, or PEM with no certificate in it.
    pub fn pem(&self) -> Result<Option<String>, ControlError> {
        let (pem, what) = match self {
            RootSource::System => return Ok(None),
            RootSource::Pem(p) => (p.clone(), "inline PEM".to_owned()),
            RootSource::File(path) => (
                std::fs::read_to_string(path).map_err(|source| ControlError::ReadRoots {
                    path: path.clone(),
                    source,
                })?,
                path.display().to_string(),
            ),
        };
        if !pem.contains("-----BEGIN CERTIFICATE-----") {
            return Err(ControlError::NoRoots { what });
        }
        Ok(Some(pem))
    }
}

// === impl ControlEndpoint ===

impl ControlEndpoint {
    /// An endpoint for `address` (`host:port` gets `https://` as ztunnel adds it).
    ///
    /// # Errors
    /// [`ControlError::Address`] when the address is not a URI with a host.
    pub fn new(
        address: &str,
        roots: RootSource,
        alt_hostname: Option<String>,
    ) -> Result<ControlEndpoint, ControlError> {
        let with_scheme = if address.contains("://") {
            address.to_owned()
        } else {
            format!("https://{address}")
        };
        let bad = |reason: String| ControlError::Address {
            address: address.to_owned(),
            reason,
        };
        let uri: http::Uri = with_scheme.parse().map_err(|e| bad(format!("{e}")))?;
        if uri.host().is_none() {
            return Err(bad("no host".into()));
        }
        if uri.scheme_str() != Some("https") {
            return Err(bad("only https is supported (istiod's TLS port)".into()));
        }
        Ok(ControlEndpoint {
            address: uri,
            roots,
            alt_hostname: alt_hostname.filter(|h| !h.is_empty()),
        })
    }

    /// Connects (TLS, h2) with ztunnel's timeouts and keepalives; the roots are read now.
    ///
    /// # Errors
    /// Unreadable roots, or a TCP/TLS failure within [`CONNECT_TIMEOUT`].
    pub async fn connect(&self) -> Result<Channel, ControlError> {
        let address = self.address.to_string();
        let connect_err = |source| ControlError::Connect {
            address: address.clone(),
            source,
        };
        let mut tls = ClientTlsConfig::new();
        tls = match self.roots.pem()? {
            Some(pem) => tls.ca_certificate(Certificate::from_pem(pem)),
            None => tls.with_native_roots(),
        };
        if let Some(name) = &self.alt_hostname {
            tls = tls.domain_name(name.clone());
        }
        Endpoint::from(self.address.clone())
            .tls_config(tls)
            .map_err(connect_err)?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(H2_KEEPALIVE_INTERVAL)
            .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_keepalive(Some(TCP_KEEPALIVE))
            .connect()
            .await
            .map_err(connect_err)
    }
}

// === impl CallAuth ===

impl std::fmt::Debug for CallAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<String> = self
            .headers
            .iter()
            .map(|(k, _)| format!("{k}: <set>"))
            .collect();
        f.debug_struct("CallAuth")
            .field("token_file", &self.token_file)
            .field("cluster_id", &self.cluster_id)
            .field("headers", &headers)
            .finish()
    }
}

impl CallAuth {
    /// Adds `authorization: Bearer <token>` (the file's bytes as they are, re-read now),
    /// `clusterid` and the extra headers to `req`.
    ///
    /// # Errors
    /// An unreadable token file or a value that is not ASCII metadata.
    pub fn apply<T>(&self, req: &mut tonic::Request<T>) -> Result<(), ControlError> {
        let md = req.metadata_mut();
        let value = |name: &str, v: &str| {
            AsciiMetadataValue::try_from(v)
                .map_err(|_| ControlError::Metadata { name: name.into() })
        };
        if let Some(path) = &self.token_file {
            let token =
                std::fs::read_to_string(path).map_err(|source| ControlError::ReadToken {
                    path: path.clone(),
                    source,
                })?;
            let mut bearer = value("authorization", &format!("Bearer {token}"))?;
            // never indexed by HPACK, hidden from Debug
            bearer.set_sensitive(true);
            md.insert("authorization", bearer);
        }
        if !self.cluster_id.is_empty() {
            md.insert("clusterid", value("clusterid", &self.cluster_id)?);
        }
        for (name, v) in &self.headers {
            let key = AsciiMetadataKey::from_bytes(name.as_bytes())
                .map_err(|_| ControlError::Metadata { name: name.clone() })?;
            md.insert(key, value(name, v)?);
        }
        Ok(())
    }
}

/// One unary gRPC call of `path` (e.g. `/istio.v1.auth.IstioCertificateService/CreateCertificate`).
///
/// # Errors
/// The call's gRPC status (transport failures are `UNAVAILABLE`/`UNKNOWN`).
pub async fn unary<Req, Resp>(
    channel: Channel,
    path: &'static str,
    req: tonic::Request<Req>,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("control plane not ready: {e}")))?;
    let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
    let resp = grpc
        .unary(req, PathAndQuery::from_static(path), codec)
        .await?;
    Ok(resp.into_inner())
}

/// One bidirectional streaming gRPC call of `path` (e.g. delta ADS); `requests` feeds the
/// request stream.
///
/// # Errors
/// The call's gRPC status when the stream cannot be opened.
pub async fn streaming<Req, Resp, S>(
    channel: Channel,
    path: &'static str,
    requests: tonic::Request<S>,
) -> Result<tonic::Streaming<Resp>, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
    S: futures::Stream<Item = Req> + Send + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("control plane not ready: {e}")))?;
    let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
    let resp = grpc
        .streaming(requests, PathAndQuery::from_static(path), codec)
        .await?;
    Ok(resp.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_without_scheme_gets_https_and_others_are_refused() {
        let e = ControlEndpoint::new("istiod.istio-system.svc:15012", RootSource::System, None)
            .expect("endpoint");
        assert_eq!(
            e.address.to_string(),
            "https://istiod.istio-system.svc:15012/"
        );
        assert!(ControlEndpoint::new("http://x:1", RootSource::System, None).is_err());
        assert!(ControlEndpoint::new("https://", RootSource::System, None).is_err());
        let alt = ControlEndpoint::new(
            "https://10.0.0.1:15012",
            RootSource::System,
            Some(String::new()),
        )
        .expect("endpoint");
        assert_eq!(alt.alt_hostname, None, "an empty alt name is no alt name");
    }

    #[test]
    fn roots_parse_as_ztunnel_reads_them() {
        assert_eq!(RootSource::parse("SYSTEM"), RootSource::System);
        assert_eq!(
            RootSource::parse("/var/run/secrets/istio/root-cert.pem"),
            RootSource::File("/var/run/secrets/istio/root-cert.pem".into())
        );
        assert!(matches!(
            RootSource::parse("-----BEGIN CERTIFICATE-----\nx"),
            RootSource::Pem(_)
        ));
        let missing = RootSource::File("/nonexistent/root.pem".into()).pem();
        assert!(
            matches!(missing, Err(ControlError::ReadRoots { .. })),
            "{missing:?}"
        );
        let empty = RootSource::Pem("-----BEGIN".into()).pem();
        assert!(
            matches!(empty, Err(ControlError::NoRoots { .. })),
            "{empty:?}"
        );
    }

    #[test]
    fn the_token_is_read_per_call_and_sent_as_a_bearer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token = dir.path().join("token");
        std::fs::write(&token, "tok-1").expect("write");
        let auth = CallAuth {
            token_file: Some(token.clone()),
            cluster_id: "Kubernetes".into(),
            headers: vec![("x-extra".into(), "v".into())],
        };
        let mut req = tonic::Request::new(());
        auth.apply(&mut req).expect("apply");
        let md = req.metadata();
        assert_eq!(
            md.get("authorization").map(|v| v.to_str().ok()),
            Some(Some("Bearer tok-1"))
        );
        assert_eq!(
            md.get("clusterid").map(|v| v.to_str().ok()),
            Some(Some("Kubernetes"))
        );
        assert_eq!(md.get("x-extra").map(|v| v.to_str().ok()), Some(Some("v")));
        std::fs::write(&token, "tok-2").expect("write");
        let mut req = tonic::Request::new(());
        auth.apply(&mut req).expect("apply");
        assert_eq!(
            req.metadata().get("authorization").map(|v| v.to_str().ok()),
            Some(Some("Bearer tok-2"))
        );
        assert!(
            req.metadata()
                .get("authorization")
                .is_some_and(|v| v.is_sensitive())
        );
        assert!(
            !format!("{auth:?}").contains("\"v\""),
            "header values are not in Debug: {auth:?}"
        );
        std::fs::remove_file(&token).expect("rm");
        let mut req = tonic::Request::new(());
        assert!(matches!(
            auth.apply(&mut req),
            Err(ControlError::ReadToken { .. })
        ));
    }
}
