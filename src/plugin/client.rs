//! HTTP/1.1 client for the node agent's plugin event socket (`crate::podevent`, istio-cni §1.5).
//!
//! Each call builds a current-thread tokio runtime inside the plugin process, connects the unix
//! socket, sends one `POST` with a JSON body and reads the answer; a total timeout bounds the whole
//! exchange. Only status 200 counts as success; otherwise up to 1 MiB of the answer body is kept for
//! the error message.

use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::UnixStream;

use crate::podevent::plugin_socket_path;

/// Most bytes of an error answer kept for the message (1 MiB, as istio-cni).
pub const MAX_ERROR_BODY: usize = 1 << 20;

/// Why an exchange with the agent failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The plugin could not start its async runtime.
    #[error("starting the tokio runtime: {source}")]
    Runtime {
        /// Underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The event could not be serialised.
    #[error("encoding the event: {source}")]
    Encode {
        /// serde error.
        #[source]
        source: serde_json::Error,
    },
    /// The HTTP request could not be built.
    #[error("building the request: {source}")]
    Request {
        /// http crate error.
        #[source]
        source: http::Error,
    },
    /// The socket did not accept a connection (agent not running, socket missing).
    #[error("connect: {source}")]
    Connect {
        /// Underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed after connecting.
    #[error("HTTP exchange: {source}")]
    Http {
        /// hyper error.
        #[source]
        source: hyper::Error,
    },
    /// The agent answered with a status other than 200.
    #[error("agent answered {status}: {body}")]
    Status {
        /// HTTP status.
        status: StatusCode,
        /// Answer body (at most [`MAX_ERROR_BODY`] bytes, lossy UTF-8, trimmed).
        body: String,
    },
    /// No complete answer within the timeout.
    #[error("no answer within {} ms", .after.as_millis())]
    Timeout {
        /// The total timeout.
        after: Duration,
    },
}

/// Client for `<run_dir>/pluginevent.sock`.
#[derive(Debug, Clone)]
pub struct AgentClient {
    socket: PathBuf,
}

impl AgentClient {
    /// Client for the socket inside `run_dir`.
    pub fn new(run_dir: &Path) -> AgentClient {
        AgentClient {
            socket: plugin_socket_path(run_dir),
        }
    }

    /// Path of the socket, for messages.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends `event` as JSON in `POST <path>` and waits for a 200, at most `timeout` in total.
    pub fn post<T: Serialize>(
        &self,
        path: &str,
        event: &T,
        timeout: Duration,
    ) -> Result<(), AgentError> {
        let body = serde_json::to_vec(event).map_err(|source| AgentError::Encode { source })?;
        let request = Request::post(path)
            .header(header::HOST, "unix")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|source| AgentError::Request { source })?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| AgentError::Runtime { source })?;
        runtime.block_on(async {
            tokio::time::timeout(timeout, exchange(&self.socket, request))
                .await
                .unwrap_or(Err(AgentError::Timeout { after: timeout }))
        })
    }

    /// Checks that the socket accepts a connection (for STATUS); sends nothing.
    pub fn probe(&self) -> Result<(), AgentError> {
        StdUnixStream::connect(&self.socket)
            .map(drop)
            .map_err(|source| AgentError::Connect { source })
    }
}

async fn exchange(socket: &Path, request: Request<Full<Bytes>>) -> Result<(), AgentError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| AgentError::Connect { source })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|source| AgentError::Http { source })?;
    // The connection task ends when the exchange is over; its errors surface through `send_request`.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let response = sender
        .send_request(request)
        .await
        .map_err(|source| AgentError::Http { source })?;
    let status = response.status();
    if status == StatusCode::OK {
        return Ok(());
    }
    let body = read_capped(response.into_body(), MAX_ERROR_BODY).await?;
    Err(AgentError::Status {
        status,
        body: String::from_utf8_lossy(&body).trim().to_owned(),
    })
}

async fn read_capped(mut body: hyper::body::Incoming, cap: usize) -> Result<Vec<u8>, AgentError> {
    let mut out = Vec::new();
    while out.len() < cap {
        let Some(frame) = body.frame().await else {
            break;
        };
        let frame = frame.map_err(|source| AgentError::Http { source })?;
        if let Ok(data) = frame.into_data() {
            let take = data.len().min(cap - out.len());
            out.extend_from_slice(&data[..take]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    /// Serves one connection on a fresh socket with `answer` (raw HTTP), or holds it open if `None`.
    fn one_shot(answer: Option<Vec<u8>>) -> (tempfile::TempDir, std::thread::JoinHandle<Vec<u8>>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let listener = UnixListener::bind(plugin_socket_path(dir.path())).expect("bind");
        let handle = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let req = read_request(&mut conn);
            match answer {
                // The client may stop reading early (capped body), so a write error is fine.
                Some(bytes) => drop(conn.write_all(&bytes)),
                // Never answer; wait for the client to give up and close.
                None => while conn.read(&mut [0u8; 64]).map(|n| n > 0).unwrap_or(false) {},
            }
            req
        });
        (dir, handle)
    }

    /// Reads one request: headers, then `content-length` bytes of body.
    fn read_request(conn: &mut impl Read) -> Vec<u8> {
        let mut req = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&req[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().expect("length"))
                    .unwrap_or(0);
                if req.len() >= end + 4 + len {
                    return req;
                }
            }
            let n = conn.read(&mut chunk).expect("read request");
            assert!(n > 0, "client closed mid-request");
            req.extend_from_slice(&chunk[..n]);
        }
    }

    #[test]
    fn ok_answer_and_request_shape() {
        let (dir, server) = one_shot(Some(
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_vec(),
        ));
        let client = AgentClient::new(dir.path());
        client
            .post(
                "/cmdadd",
                &serde_json::json!({"a": 1}),
                Duration::from_secs(5),
            )
            .expect("200 is success");
        let req = String::from_utf8(server.join().expect("server")).expect("utf8");
        assert!(req.starts_with("POST /cmdadd HTTP/1.1\r\n"), "{req}");
        let lower = req.to_ascii_lowercase();
        assert!(lower.contains("content-type: application/json"), "{req}");
        assert!(lower.contains("host: unix"), "{req}");
        assert!(req.ends_with(r#"{"a":1}"#), "{req}");
    }

    #[test]
    fn error_body_is_capped_at_1_mib() {
        let big = "x".repeat(MAX_ERROR_BODY + 4096);
        let mut answer = format!(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-length: {}\r\n\r\n",
            big.len()
        )
        .into_bytes();
        answer.extend_from_slice(big.as_bytes());
        let (dir, server) = one_shot(Some(answer));
        let err = AgentClient::new(dir.path())
            .post("/cmdadd", &(), Duration::from_secs(5))
            .expect_err("500");
        match err {
            AgentError::Status { status, body } => {
                assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
                assert_eq!(body.len(), MAX_ERROR_BODY);
            }
            other => panic!("{other:?}"),
        }
        server.join().expect("server");
    }

    #[test]
    fn silent_agent_times_out() {
        let (dir, server) = one_shot(None);
        let err = AgentClient::new(dir.path())
            .post("/cmddel", &(), Duration::from_millis(200))
            .expect_err("no answer");
        assert!(matches!(err, AgentError::Timeout { .. }), "{err:?}");
        server.join().expect("server");
    }

    #[test]
    fn missing_socket_is_a_connect_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let client = AgentClient::new(dir.path());
        let err = client
            .post("/cmdadd", &(), Duration::from_secs(1))
            .expect_err("no socket");
        assert!(matches!(err, AgentError::Connect { .. }), "{err:?}");
        assert!(matches!(client.probe(), Err(AgentError::Connect { .. })));
    }
}
