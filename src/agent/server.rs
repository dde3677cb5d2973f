//! The plugin event server: HTTP/1.1 over the unix socket `<run_dir>/pluginevent.sock`.
//!
//! Routes (`crate::podevent`): `POST /cmdadd` → [`PodManager::add`], `POST /cmddel` →
//! [`PodManager::del`]. Answers 200 on success, 400 for an unparseable body, 404 for other paths, 500
//! with the error text when the flow failed (istio-cni `cni-watcher.go` codes). The socket is created
//! with mode 0600 and only peers with uid 0 (checked with SO_PEERCRED) are served.

use std::convert::Infallible;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::UnixListener;

use crate::agent::pods::{AddOutcome, PodManager};
use crate::podevent::{PATH_CMDADD, PATH_CMDDEL, PodAddEvent, PodDelEvent};

/// Largest accepted request body, bytes.
const MAX_BODY: usize = 1 << 20;

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Creating the run dir or socket failed.
    #[error("plugin socket {path}: {source}")]
    Socket {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Binds the plugin socket at `path` (removing a stale one; parent created 0750; socket 0600).
pub fn bind(path: &Path) -> Result<UnixListener, ServerError> {
    let err = |source| ServerError::Socket {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(err)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// Serves plugin events until `shutdown` resolves.
pub async fn serve(
    listener: UnixListener,
    pods: Arc<PodManager>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "plugin socket accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == 0 => {}
            Ok(cred) => {
                tracing::warn!(
                    uid = cred.uid(),
                    "refusing plugin connection from non-root peer"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read plugin peer credentials");
                continue;
            }
        }
        let pods = pods.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(pods.clone(), req));
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "plugin connection ended");
            }
        });
    }
}

fn reply(code: StatusCode, body: impl Into<Bytes>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    Ok(r)
}

async fn handle(
    pods: Arc<PodManager>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let resp = answer(&pods, req).await;
    if let Ok(r) = &resp {
        pods.metrics.plugin_request(r.status());
    }
    resp
}

async fn answer(
    pods: &PodManager,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    if parts.method != Method::POST {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "POST only\n");
    }
    let body = match http_body_util::Limited::new(body, MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("read body: {e}\n")),
    };
    match parts.uri.path() {
        PATH_CMDADD => {
            let ev: PodAddEvent = match serde_json::from_slice(&body) {
                Ok(ev) => ev,
                Err(e) => return reply(StatusCode::BAD_REQUEST, format!("bad add event: {e}\n")),
            };
            match pods.add(ev).await {
                Ok(AddOutcome::Enrolled) => reply(StatusCode::OK, "enrolled\n"),
                Ok(AddOutcome::NotInMesh) => reply(StatusCode::OK, "not in mesh\n"),
                Err(e) => {
                    tracing::warn!(error = %e, "enrollment failed");
                    reply(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n"))
                }
            }
        }
        PATH_CMDDEL => {
            let ev: PodDelEvent = match serde_json::from_slice(&body) {
                Ok(ev) => ev,
                Err(e) => return reply(StatusCode::BAD_REQUEST, format!("bad del event: {e}\n")),
            };
            match pods.del(ev).await {
                Ok(()) => reply(StatusCode::OK, "removed\n"),
                Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, "unknown path\n"),
    }
}
