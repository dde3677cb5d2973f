//! Admin, readiness and metrics endpoints of the proxy process (ztunnel ports, `../shared/spec/ztunnel.md` §7).
//!
//! - admin `127.0.0.1:15000` (ztunnel's `src/admin.rs`): `GET /` lists the endpoints;
//!   `GET /config_dump` → JSON in ztunnel's shape ([`dump`]); `POST /logging` shows the log
//!   filter, `POST /logging?level=<level>|<target>=<level>,...` adds to it and `?reset` goes back
//!   to the start-up default first, without a restart ([`crate::runtime::logging`]; `GET` shows it
//!   too); `POST /quitquitquit` answers `shutdown now` and stops the process the way SIGTERM does;
//!   `/debug/pprof/profile` and `/debug/pprof/heap` answer 501 (no profiler is built in);
//! - readiness `:15021`: `GET /healthz/ready` → `200 ready\n` once no start-up task is pending
//!   ([`crate::ready`]), else `500 not ready, pending: ["task", ...]\n`;
//! - stats `:15020`: `GET /metrics` (and `/stats/prometheus`) → the OpenMetrics text of the
//!   process's registry ([`crate::metrics::Exposition`]: OpenMetrics content type when asked,
//!   gzip when accepted).

pub mod dump;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::agent::pods::PodManager;
use crate::metrics::Exposition;
use crate::proxy::manager::ProxyManager;
use crate::proxy::state::StateHandle;
use crate::ready::Readiness;
use crate::runtime::logging;

/// What the endpoints read.
#[derive(Clone)]
pub struct Admin {
    /// Workload state.
    pub state: StateHandle,
    /// Pod proxies.
    pub proxies: Arc<ProxyManager>,
    /// Enrolled pods (`None` in a proxy-only process: `enrolledPods` is then null). The endpoints
    /// are up before the agent has restored its pods, so the agent's table is set here once it
    /// started (an empty list until then).
    pub pods: Option<Arc<std::sync::OnceLock<Arc<PodManager>>>>,
    /// Start-up tasks `/healthz/ready` waits for.
    pub ready: Readiness,
    /// Every metric of the process, served on `/metrics`.
    pub metrics: Arc<Exposition>,
    /// The settings `/config_dump` shows as `config` (and its `staticConfig` source).
    pub config: Arc<dump::RunConfig>,
    /// Set to true by `POST /quitquitquit`: the process stops as on SIGTERM.
    pub quit: tokio::sync::watch::Sender<bool>,
}

/// The admin endpoints and what they do, for `/` (ztunnel's list).
pub const ADMIN_ENDPOINTS: &[(&str, &str)] = &[
    (
        "config_dump",
        "dump the current ztnode (ztunnel) configuration",
    ),
    (
        "logging",
        "query/changing logging levels: POST ?level=<level> or ?level=<target>=<level>,...; ?reset",
    ),
    ("quitquitquit", "shut down the server (POST)"),
    (
        "debug/pprof/profile",
        "CPU profile: not built into ztnode (501)",
    ),
    (
        "debug/pprof/heap",
        "heap profile: not built into ztnode (501)",
    ),
];

/// `/logging` usage, as ztunnel's help.
const LOGGING_HELP: &str = "usage: POST /logging\t\t\t\t(to list the current level)\n\
usage: POST /logging?level=<level>\t\t(to change the global level)\n\
usage: POST /logging?level=<target>=<level>,...\t(to change targets' levels)\n\
usage: POST /logging?reset[&level=...]\t(back to the start-up default first)\n\
hint: level: error|warn|info|debug|trace|off; target: a module path, e.g. ztnode::proxy, or access\n";

#[derive(Clone, Copy)]
enum Kind {
    Admin,
    Ready,
    Stats,
}

/// Binds the three listeners and serves them until `stop` turns true. With `reuse_port`
/// (`INPOD_PORT_REUSE`) they get `SO_REUSEPORT` and take new connections from an older process
/// still bound to them ([`crate::proxy::socket::node_listener`]), so a new process starts while
/// the old one drains.
pub async fn spawn(
    admin: Admin,
    addrs: [SocketAddr; 3],
    reuse_port: bool,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let [admin_addr, ready_addr, stats_addr] = addrs;
    for (addr, kind) in [
        (admin_addr, Kind::Admin),
        (ready_addr, Kind::Ready),
        (stats_addr, Kind::Stats),
    ] {
        let listener: TcpListener = crate::proxy::socket::node_listener(addr, reuse_port)
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
    tracing::info!(
        admin = %admin_addr,
        readiness = %ready_addr,
        stats = %stats_addr,
        pending = ?admin.ready.pending_tasks(),
        "admin, readiness and metrics endpoints listening"
    );
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
    if let Kind::Admin = kind {
        tracing::debug!(method = %req.method(), path = req.uri().path(), "admin request");
    }
    match (kind, req.uri().path()) {
        (Kind::Admin, "/") => text(StatusCode::OK, index(), "text/html; charset=utf-8"),
        (Kind::Admin, "/config_dump") => {
            let body = serde_json::to_vec_pretty(&dump::config_dump(admin)).unwrap_or_default();
            text(StatusCode::OK, body, "application/json")
        }
        (Kind::Admin, "/logging") => match *req.method() {
            http::Method::POST => {
                let (code, body) = change_logging(req.uri().query());
                text(code, body, "text/plain")
            }
            // a GET only shows the level (a link or a crawler never changes it)
            http::Method::GET => {
                let (code, body) = change_logging(None);
                text(code, body, "text/plain")
            }
            _ => text(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("Invalid HTTP method\n{LOGGING_HELP}"),
                "text/plain",
            ),
        },
        (Kind::Admin, "/quitquitquit") => {
            if req.method() != http::Method::POST {
                return text(StatusCode::METHOD_NOT_ALLOWED, "use POST\n", "text/plain");
            }
            tracing::info!("shutdown requested on /quitquitquit");
            let _ = admin.quit.send(true);
            text(StatusCode::OK, "shutdown now\n", "text/plain")
        }
        (Kind::Admin, p) if p.starts_with("/debug/pprof/") => text(
            StatusCode::NOT_IMPLEMENTED,
            "profiling is not built into ztnode: no maintained profiler crate serves pprof on a static musl build without a heavy dependency tree; use perf on the node\n",
            "text/plain",
        ),
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
            let values = |name| {
                req.headers()
                    .get_all(name)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .collect::<Vec<_>>()
            };
            let answer = admin.metrics.answer(
                values(http::header::ACCEPT),
                values(http::header::ACCEPT_ENCODING),
            );
            let gzip = answer.gzip;
            let mut resp = text(StatusCode::OK, answer.body, answer.content_type);
            if let Ok(r) = &mut resp
                && gzip
            {
                r.headers_mut().insert(
                    http::header::CONTENT_ENCODING,
                    http::HeaderValue::from_static("gzip"),
                );
            }
            resp
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n", "text/plain"),
    }
}

/// The `/` page: a table of [`ADMIN_ENDPOINTS`].
fn index() -> String {
    let rows: String = ADMIN_ENDPOINTS
        .iter()
        .map(|(path, what)| {
            format!("<tr><td><a href=\"{path}\">/{path}</a></td><td>{what}</td></tr>\n")
        })
        .collect();
    format!(
        "<!DOCTYPE html>\n<html><head><title>ztnode admin</title></head><body>\n<h1>ztnode admin</h1>\n<table>\n{rows}</table>\n</body></html>\n"
    )
}

/// `/logging` with `query`: without `level` or `reset`, the filter in force; else the change
/// ([`logging::set_level`]) and then the new filter. 400 with the usage on a bad level.
fn change_logging(query: Option<&str>) -> (StatusCode, String) {
    let mut level = None;
    let mut reset = false;
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match &*k {
            "level" => level = Some(v.into_owned()),
            "reset" => reset = true,
            _ => {}
        }
    }
    let result = match (&level, reset) {
        (None, false) => logging::current_level(),
        _ => logging::set_level(reset, level.as_deref().unwrap_or_default()),
    };
    match result {
        Ok(filter) => (StatusCode::OK, format!("current log level is {filter}\n")),
        Err(e @ (logging::LogError::InvalidLevel(_) | logging::LogError::Parse(_))) => (
            StatusCode::BAD_REQUEST,
            format!("Invalid level provided: {e}\n{LOGGING_HELP}"),
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("failed to get or set the log level: {e}\n"),
        ),
    }
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

    pub(crate) fn admin(ready: Readiness) -> Admin {
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
            pods: Some(Arc::new(std::sync::OnceLock::from(Arc::new(
                PodManager::new(policy, zds, RedirectPlan::default()),
            )))),
            ready,
            metrics: Arc::new(Exposition::new(
                prometheus_client::registry::Registry::default(),
            )),
            config: Arc::new(dump::RunConfig::default()),
            quit: tokio::sync::watch::channel(false).0,
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

    async fn call(admin: &Admin, method: &str, path: &str) -> (StatusCode, String) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .expect("request");
        let resp = handle(admin, Kind::Admin, req).expect("infallible");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn admin_lists_its_endpoints_quits_on_post_and_says_profiling_is_not_built_in() {
        let a = admin(Readiness::new());
        let (code, index) = call(&a, "GET", "/").await;
        assert_eq!(code, StatusCode::OK);
        for (path, _) in ADMIN_ENDPOINTS {
            assert!(index.contains(&format!("href=\"{path}\"")), "{index}");
        }
        for p in ["/debug/pprof/profile", "/debug/pprof/heap"] {
            assert_eq!(call(&a, "GET", p).await.0, StatusCode::NOT_IMPLEMENTED);
        }
        let quit = a.quit.subscribe();
        assert_eq!(
            call(&a, "GET", "/quitquitquit").await.0,
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert!(!*quit.borrow());
        assert_eq!(
            call(&a, "POST", "/quitquitquit").await,
            (StatusCode::OK, "shutdown now\n".to_owned())
        );
        assert!(*quit.borrow());
        assert_eq!(call(&a, "GET", "/nope").await.0, StatusCode::NOT_FOUND);
        assert_eq!(
            call(&a, "PUT", "/logging").await.0,
            StatusCode::METHOD_NOT_ALLOWED
        );
        let (code, body) = call(&a, "POST", "/logging?level=loud").await;
        assert_eq!(code, StatusCode::BAD_REQUEST);
        assert!(
            body.contains("Invalid level provided") && body.contains("usage:"),
            "{body}"
        );
        let (code, _) = call(
            &a,
            "POST",
            "/logging?level=ztnode%3A%3Aproxy%3Ddebug%2Cnope",
        )
        .await;
        assert_eq!(code, StatusCode::BAD_REQUEST);
    }
}
