//! The HTTP stack of ztnode's Kubernetes API clients (the agent's watches, reconciler and ADD
//! lookups; the plugin's lookups): kube-rs' own layers (base URI, auth, extra headers, rustls)
//! over a TCP connector that notices a vanished API server within seconds.
//!
//! Two differences from `kube::Client::try_from`, both for an API server that is unreachable for
//! minutes (issue 20, "Faults"):
//! - TCP keepalive and `TCP_USER_TIMEOUT` on every connection. A watch is a long HTTP/1.1 response
//!   the client never writes to; after a partition its connection can stay silent long after the
//!   network is back (the server's retransmissions have backed off to a minute or more), and
//!   kube-rs only gives up on it after its 295 s idle timeout. With keepalive probes every
//!   [`KEEPALIVE_INTERVAL`] after [`KEEPALIVE_IDLE`] of silence, an unanswered connection is
//!   dropped after about [`USER_TIMEOUT`] and the watch starts again with its own backoff
//!   ([`crate::backoff::WATCH_RETRY`]). client-go gets the same from HTTP/2 pings (30 s idle, 15 s
//!   timeout); kube-rs speaks HTTP/1.1.
//! - No retry layer. kube-rs' default retries 429/503/504 up to 15 times from 5 ms doubling (with
//!   jitter) to 1000 s, inside one call: while a load balancer answers 503 a watch would sit in
//!   that backoff for minutes and miss the API server's return. Every caller here retries on its
//!   own terms: the watches with [`crate::backoff::WATCH_RETRY`] (at most 5 s), the reconciler
//!   with [`crate::backoff::RECONCILE_RETRY`], a failed ADD lookup by the runtime's retry.
//!
//! The connect timeout is [`CONNECT_TIMEOUT`] instead of kube-rs' 30 s, so an attempt that started
//! during a partition does not hold the next one back for long once it heals; TCP connect plus TLS
//! handshake together get [`HANDSHAKE_TIMEOUT`] (kube-rs bounds both with its connect timeout), so
//! an endpoint that accepts TCP and stalls TLS cannot hold a watch. A proxy (a kubeconfig
//! `proxy-url`, or `HTTPS_PROXY` in the environment, which kube-rs reads into the config) is
//! refused, as kube-rs without its proxy features refuses it.

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use kube::client::ConfigExt;

/// TCP connect timeout (kube-rs: 30 s; ztunnel's to istiod: 5 s).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP connect plus TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Silence on a connection before the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the kernel drops the connection.
pub const KEEPALIVE_PROBES: u32 = 3;
/// Longest time sent data (or probes) may stay unacknowledged before the kernel drops the
/// connection (`TCP_USER_TIMEOUT`): idle + probes × interval.
pub const USER_TIMEOUT: Duration = Duration::from_secs(25);

/// A client for `config` with the stack described in the module docs. Nothing is sent until the
/// first request.
///
/// # Errors
/// kube-rs' errors for a config it cannot serve: TLS settings, auth, headers, a proxy URL.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        // kube-rs reports the proxy it cannot use (no proxy features are built in)
        return kube::Client::try_from(config);
    }
    // boxed: hyper's connector futures must be `Unpin`, a timeout's is not
    let https =
        tower::ServiceBuilder::new()
            .map_future(Box::pin)
            .service(tower::timeout::Timeout::new(
                config.rustls_https_connector_with_connector(connector())?,
                HANDSHAKE_TIMEOUT,
            ));
    let hyper = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// The TCP connector: plain and TLS URLs, the timeouts and keepalive of the module docs.
fn connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_keepalive(Some(KEEPALIVE_IDLE));
    http.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(KEEPALIVE_PROBES));
    http.set_tcp_user_timeout(Some(USER_TIMEOUT));
    http
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn config_for(addr: std::net::SocketAddr) -> kube::Config {
        let mut config = kube::Config::new(format!("http://{addr}").parse().expect("url"));
        config.root_cert = Some(Vec::new());
        config
    }

    /// Reads one request head from `s`.
    async fn read_head(s: &mut tokio::net::TcpStream) {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    }

    #[tokio::test]
    async fn a_503_is_returned_at_once_not_retried() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let mut requests = 0;
            // count requests until none comes for a while
            while let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_millis(500), listener.accept()).await
            {
                read_head(&mut s).await;
                requests += 1;
                let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"down","reason":"ServiceUnavailable","code":503}"#;
                let answer = format!(
                    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            }
            requests
        });
        let client = client(config_for(addr)).expect("client");
        let pods: kube::Api<Pod> = kube::Api::namespaced(client, "default");
        let err = pods.get("p").await.expect_err("503");
        assert!(err.to_string().contains("down"), "{err}");
        assert_eq!(server.await.expect("server"), 1, "one request, no retries");
    }

    #[tokio::test]
    async fn connections_carry_a_keepalive_timer_of_at_most_ten_seconds() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        // the server takes the connection and never answers
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.expect("accept");
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        });
        let client = client(config_for(addr)).expect("client");
        let pods: kube::Api<Pod> = kube::Api::namespaced(client, "default");
        let call = tokio::spawn(async move { pods.get("p").await });
        // /proc/net/tcp: the client's socket (remote = the server) has timer 2 (keepalive) armed
        // for at most KEEPALIVE_IDLE (in clock ticks of 1/100 s)
        let remote = format!("0100007F:{:04X}", addr.port());
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let timer = loop {
            let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
            let found = table.lines().skip(1).find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2) == Some(&remote.as_str()) && f.get(3) == Some(&"01"))
                    .then(|| f.get(5).map(|t| (*t).to_owned()))
                    .flatten()
            });
            if let Some(t) = found.as_ref().filter(|t| t.starts_with("02:")) {
                break t.clone();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no keepalive timer on the client's connection: {found:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let ticks = u64::from_str_radix(&timer[3..], 16).expect("hex ticks");
        assert!(ticks <= 1000, "keepalive in {ticks} ticks");
        call.abort();
        server.abort();
    }

    #[tokio::test]
    async fn a_tls_handshake_that_stalls_fails_within_the_handshake_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        // TCP is accepted, the ClientHello is never answered
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let mut config = kube::Config::new(format!("https://{addr}").parse().expect("url"));
        config.accept_invalid_certs = true;
        let pods: kube::Api<Pod> =
            kube::Api::namespaced(client(config).expect("client"), "default");
        let started = std::time::Instant::now();
        let res = tokio::time::timeout(HANDSHAKE_TIMEOUT * 2, pods.get("p")).await;
        assert!(
            matches!(res, Ok(Err(_))),
            "the call must fail, not hang: {:?} after {:?}",
            res.map(|r| r.map(|_| ())),
            started.elapsed()
        );
        server.abort();
    }
}
