//! Admin, readiness and metrics endpoints of the proxy process (ztunnel ports, `../shared/spec/ztunnel.md` §7).
//!
//! - admin `127.0.0.1:15000`: `GET /config_dump` → JSON `{workloads, services, policies, certificates,
//!   workloadState, enrolledPods, version}`;
//! - readiness `:15021`: `GET /healthz/ready` → `200 ready\n`;
//! - stats `:15020`: `GET /metrics` (and `/stats/prometheus`) → Prometheus text.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use crate::agent::pods::PodManager;
use crate::proxy::pods::ProxyManager;
use crate::proxy::state::StateHandle;

/// What the endpoints read.
#[derive(Clone)]
pub struct Admin {
    /// Workload state.
    pub state: StateHandle,
    /// Pod proxies.
    pub proxies: Arc<ProxyManager>,
    /// Enrolled pods (`None` in a proxy-only process: `enrolledPods` is then null).
    pub pods: Option<Arc<PodManager>>,
}

#[derive(Clone, Copy)]
enum Kind {
    Admin,
    Ready,
    Stats,
}

/// Binds the three listeners and serves them until `stop` turns true.
pub async fn spawn(
    admin: Admin,
    admin_addr: SocketAddr,
    ready_addr: SocketAddr,
    stats_addr: SocketAddr,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    for (addr, kind) in [
        (admin_addr, Kind::Admin),
        (ready_addr, Kind::Ready),
        (stats_addr, Kind::Stats),
    ] {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind {addr}"))?;
        let admin = admin.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = stop.wait_for(|s| *s) => return,
                    r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                };
                let admin = admin.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let admin = admin.clone();
                        async move { handle(&admin, kind, req) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
    }
    Ok(())
}

fn text(
    code: StatusCode,
    body: impl Into<Bytes>,
    content_type: &str,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    Ok(r)
}

fn handle(
    admin: &Admin,
    kind: Kind,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    match (kind, req.uri().path()) {
        (Kind::Admin, "/config_dump") => {
            let dump = config_dump(admin);
            let body = serde_json::to_vec_pretty(&dump).unwrap_or_default();
            text(StatusCode::OK, body, "application/json")
        }
        (Kind::Ready, "/healthz/ready") => text(StatusCode::OK, "ready\n", "text/plain"),
        (Kind::Stats, "/metrics" | "/stats/prometheus") => {
            let body = admin.proxies.ctx().metrics.render();
            text(StatusCode::OK, body, "text/plain; version=0.0.4")
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n", "text/plain"),
    }
}

/// The `/config_dump` document.
pub fn config_dump(admin: &Admin) -> serde_json::Value {
    let state = admin.state.load();
    let certs: Vec<_> = admin
        .proxies
        .ctx()
        .certs
        .certificates()
        .iter()
        .map(|c| {
            json!({
                "identity": c.identity.to_string(),
                "notBefore": humantime(c.not_before),
                "notAfter": humantime(c.not_after),
            })
        })
        .collect();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "workloads": state.workloads().collect::<Vec<_>>(),
        "services": state.services().collect::<Vec<_>>(),
        "policies": state.policies().collect::<Vec<_>>(),
        "certificates": certs,
        "workloadState": admin.proxies.status(),
        "enrolledPods": admin.pods.as_ref().map(|p| p.enrolled()),
    })
}

fn humantime(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    time::OffsetDateTime::from_unix_timestamp(secs as i64)
        .ok()
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| secs.to_string())
}
