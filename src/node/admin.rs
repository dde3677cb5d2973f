//! Admin, readiness and metrics endpoints of the proxy process (ztunnel ports, `../shared/spec/ztunnel.md` §7).
//!
//! - admin `127.0.0.1:15000`: `GET /config_dump` → JSON `{workloads, services, policies, certificates,
//!   workloadState, enrolledPods, version}`;
//! - readiness `:15021`: `GET /healthz/ready` → `200 ready\n` once no start-up task is pending
//!   ([`crate::ready`]), else `500 not ready, pending: ["task", ...]\n`;
//! - stats `:15020`: `GET /metrics` (and `/stats/prometheus`) → Prometheus text.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use crate::agent::pods::PodManager;
use crate::proxy::manager::ProxyManager;
use crate::proxy::state::StateHandle;
use crate::ready::Readiness;

/// What the endpoints read.
#[derive(Clone)]
pub struct Admin {
    /// Workload state.
    pub state: StateHandle,
    /// Pod proxies.
    pub proxies: Arc<ProxyManager>,
    /// Enrolled pods (`None` in a proxy-only process: `enrolledPods` is then null).
    pub pods: Option<Arc<PodManager>>,
    /// Start-up tasks `/healthz/ready` waits for.
    pub ready: Readiness,
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

fn handle<B>(
    admin: &Admin,
    kind: Kind,
    req: Request<B>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    match (kind, req.uri().path()) {
        (Kind::Admin, "/config_dump") => {
            let dump = config_dump(admin);
            let body = serde_json::to_vec_pretty(&dump).unwrap_or_default();
            text(StatusCode::OK, body, "application/json")
        }
        (Kind::Ready, "/healthz/ready") => {
            if admin.ready.is_ready() {
                text(StatusCode::OK, "ready\n", "text/plain")
            } else {
                let pending = admin.ready.pending_tasks();
                let body = format!("not ready, pending: {pending:?}\n");
                text(StatusCode::INTERNAL_SERVER_ERROR, body, "text/plain")
            }
        }
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

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::agent::redirect::RedirectPlan;
    use crate::proxy::identity::{Ca, CertManager};
    use crate::proxy::metrics::Metrics;
    use crate::proxy::pod::ProxyContext;
    use crate::proxy::state::ProxyState;

    fn admin(ready: Readiness) -> Admin {
        let state = StateHandle::new(ProxyState::default());
        let ca = Ca::load_or_generate(None).expect("CA");
        let ctx = Arc::new(ProxyContext {
            state: state.clone(),
            certs: CertManager::new(ca, std::time::Duration::from_secs(3600)),
            metrics: Metrics::default(),
            mark: crate::mesh::PacketMark::DEFAULT,
            local: Default::default(),
            pool: crate::proxy::pool::PoolConfig::default(),
            dns: None,
            trust_domain: "cluster.local".into(),
        });
        let (zds, _rx) = crate::zds::in_process();
        let policy: Arc<dyn crate::agent::enroll::EnrollmentPolicy> =
            Arc::new(|_: &str, _: &str| None);
        Admin {
            state,
            proxies: ProxyManager::new(ctx),
            pods: Some(Arc::new(PodManager::new(
                policy,
                zds,
                RedirectPlan::default(),
            ))),
            ready,
        }
    }

    async fn get(admin: &Admin, kind: Kind, path: &str) -> (StatusCode, String) {
        let req = Request::builder().uri(path).body(()).expect("request");
        let resp = handle(admin, kind, req).expect("infallible");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn ready_only_when_nothing_is_pending_and_names_what_is_missing() {
        let ready = Readiness::new();
        let config = ready.register("local config");
        let socket = ready.register("plugin socket");
        let install = ready.register("cni plugin install");
        let a = admin(ready);
        let (code, body) = get(&a, Kind::Ready, "/healthz/ready").await;
        assert_eq!(code, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            body,
            "not ready, pending: [\"cni plugin install\", \"local config\", \"plugin socket\"]\n"
        );
        config.done();
        socket.done();
        let (code, body) = get(&a, Kind::Ready, "/healthz/ready").await;
        assert_eq!(code, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body, "not ready, pending: [\"cni plugin install\"]\n");
        install.set_ready(true);
        assert_eq!(
            get(&a, Kind::Ready, "/healthz/ready").await,
            (StatusCode::OK, "ready\n".to_owned())
        );
        install.set_ready(false);
        assert_eq!(
            get(&a, Kind::Ready, "/healthz/ready").await.0,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        // the path is served on the readiness listener only
        assert_eq!(
            get(&a, Kind::Admin, "/healthz/ready").await.0,
            StatusCode::NOT_FOUND
        );
    }
}
