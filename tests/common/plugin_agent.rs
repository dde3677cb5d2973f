//! A fake node agent for plugin tests: a hyper HTTP/1.1 server on `<tempdir>/pluginevent.sock` that
//! records every request and answers with a fixed status and body.

use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// One request as the fake agent saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

impl Received {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("agent received JSON")
    }
}

/// A running fake agent; stops when dropped.
pub struct FakeAgent {
    dir: tempfile::TempDir,
    received: Arc<Mutex<Vec<Received>>>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeAgent {
    /// Starts an agent answering every request with `status` and `answer` as body.
    pub fn start(status: u16, answer: &'static str) -> FakeAgent {
        let dir = tempfile::tempdir().expect("tempdir");
        let std_listener =
            StdUnixListener::bind(dir.path().join("pluginevent.sock")).expect("bind agent socket");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let received = Arc::new(Mutex::new(Vec::new()));
        let (tx, mut rx) = oneshot::channel::<()>();
        let log = received.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener =
                    tokio::net::UnixListener::from_std(std_listener).expect("tokio listener");
                loop {
                    let stream = tokio::select! {
                        _ = &mut rx => return,
                        accepted = listener.accept() => match accepted {
                            Ok((stream, _)) => stream,
                            Err(_) => return,
                        },
                    };
                    let log = log.clone();
                    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let log = log.clone();
                        async move {
                            let method = req.method().to_string();
                            let path = req.uri().path().to_owned();
                            let content_type = req
                                .headers()
                                .get(http::header::CONTENT_TYPE)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned);
                            let body = req.into_body().collect().await?.to_bytes().to_vec();
                            log.lock().expect("lock").push(Received {
                                method,
                                path,
                                content_type,
                                body,
                            });
                            let mut resp =
                                Response::new(Full::new(Bytes::from_static(answer.as_bytes())));
                            *resp.status_mut() = StatusCode::from_u16(status).expect("status");
                            Ok::<_, hyper::Error>(resp)
                        }
                    });
                    tokio::spawn(async move {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        });
        FakeAgent {
            dir,
            received,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// The run dir to put in `cni_agent_run_dir`.
    pub fn run_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Requests received so far.
    pub fn requests(&self) -> Vec<Received> {
        self.received.lock().expect("lock").clone()
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
