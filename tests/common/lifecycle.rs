//! Helpers of the drain and upgrade tests: a many-connection echo app, long-lived streams, a
//! client opening connections in a loop, SIGTERM and exit status of a process, readiness.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use ztnode::lab::{Lab, ProcessGuard};
use ztnode::netns::Netns;

/// An echo app on `addr` inside `ns` serving any number of connections, each in its own thread
/// (read, write back, until EOF; then a clean close). Runs until the test process ends.
pub fn echo_server(ns: &Netns, addr: SocketAddr) {
    let listener = Lab::listen_in(ns, addr).expect("listen");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = s.shutdown(std::net::Shutdown::Write);
            });
        }
    });
}

/// A connection through the mesh to an [`echo_server`], exchanged message by message.
pub struct Stream {
    conn: std::net::TcpStream,
    sent: usize,
}

impl Stream {
    /// Connects from `ns` to `to`.
    pub fn open(ns: &Netns, to: SocketAddr) -> Stream {
        let conn = Lab::connect_from(ns, to).expect("connect");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Stream { conn, sent: 0 }
    }

    /// A stream over an already connected socket.
    pub fn from_connected(conn: std::net::TcpStream) -> Stream {
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        Stream { conn, sent: 0 }
    }

    /// Sends one numbered message and reads its echo; an error when the connection failed or the
    /// echo differs.
    pub fn exchange(&mut self, tag: &str) -> Result<(), String> {
        let msg = format!("{tag}-{:06}\n", self.sent);
        self.sent += 1;
        self.conn
            .write_all(msg.as_bytes())
            .map_err(|e| format!("write: {e}"))?;
        let mut back = vec![0u8; msg.len()];
        self.conn
            .read_exact(&mut back)
            .map_err(|e| format!("read: {e}"))?;
        if back != msg.as_bytes() {
            return Err(format!(
                "echo {:?} != {msg:?}",
                String::from_utf8_lossy(&back)
            ));
        }
        Ok(())
    }

    /// Half-closes and reads to EOF: the app's clean close must arrive, with nothing more.
    pub fn finish(mut self) -> Result<(), String> {
        self.conn
            .shutdown(std::net::Shutdown::Write)
            .map_err(|e| format!("half close: {e}"))?;
        let mut rest = Vec::new();
        self.conn
            .read_to_end(&mut rest)
            .map_err(|e| format!("read to EOF: {e}"))?;
        if rest.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected bytes before EOF", rest.len()))
        }
    }
}

/// What a [`ConnectLoop`] saw.
#[derive(Debug, Default)]
pub struct LoopReport {
    /// Connections that echoed their message and closed cleanly.
    pub ok: usize,
    /// The failures, with their errors.
    pub failed: Vec<String>,
}

/// A client opening a fresh connection every `every` (one message, echo, clean close).
pub struct ConnectLoop {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<Mutex<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl ConnectLoop {
    /// Starts the loop from `ns` to `to`; each message carries `secret` (to look for on the
    /// bridge).
    pub fn start(ns: &Netns, to: SocketAddr, every: Duration, secret: &'static str) -> ConnectLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let (s, o, f) = (stop.clone(), ok.clone(), failed.clone());
        let ns = ns.clone();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let mut n = 0u32;
            while !s.load(Ordering::SeqCst) {
                let at = started + every * n;
                n += 1;
                if let Some(wait) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let res = (|| -> Result<(), String> {
                    let conn = Lab::connect_from(&ns, to).map_err(|e| format!("connect: {e}"))?;
                    let mut s = Stream::from_connected(conn);
                    s.exchange(secret)?;
                    s.finish()
                })();
                match res {
                    Ok(()) => {
                        o.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => {
                        let at = started.elapsed();
                        f.lock()
                            .expect("failures")
                            .push(format!("#{n} at {at:?}: {e}"));
                    }
                }
            }
        });
        ConnectLoop {
            stop,
            ok,
            failed,
            thread: Some(thread),
        }
    }

    /// Connections that succeeded so far.
    pub fn ok(&self) -> usize {
        self.ok.load(Ordering::SeqCst)
    }

    /// Waits until `n` more connections succeeded than now.
    pub fn wait_for_more(&self, n: usize, timeout: Duration) {
        let want = self.ok() + n;
        let deadline = Instant::now() + timeout;
        while self.ok() < want {
            assert!(
                Instant::now() < deadline,
                "the loop made {} connections, wanted {want}; failures: {:?}",
                self.ok(),
                self.failed.lock().expect("failures")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the loop and returns what it saw.
    pub fn stop(mut self) -> LoopReport {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("loop thread");
        }
        LoopReport {
            ok: self.ok(),
            failed: std::mem::take(&mut *self.failed.lock().expect("failures")),
        }
    }
}

impl Drop for ConnectLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Sends SIGTERM to `p`.
pub fn sigterm(p: &ProcessGuard) {
    let pid = i32::try_from(p.0.id()).expect("pid");
    kill(Pid::from_raw(pid), Signal::SIGTERM).expect("SIGTERM");
}

/// Waits up to `timeout` for `p` to exit; returns its exit status and when it exited.
pub fn wait_exit(p: &mut ProcessGuard, timeout: Duration) -> (std::process::ExitStatus, Instant) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = p.0.try_wait().expect("try_wait") {
            return (status, Instant::now());
        }
        assert!(
            Instant::now() < deadline,
            "the process did not exit within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `GET /healthz/ready` on `127.0.0.1:15021` from inside the lab node: the status line and the
/// body.
pub fn readiness(lab: &Lab) -> Result<(String, String), String> {
    let addr: SocketAddr = "127.0.0.1:15021".parse().expect("addr");
    let mut s = Lab::connect_from(lab.node(), addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
    let status = resp.lines().next().unwrap_or_default().to_owned();
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    Ok((status, body))
}

/// `POST /quitquitquit` on the admin port (`127.0.0.1:15000`) from inside the lab node: the
/// status line.
pub fn quitquitquit(lab: &Lab) -> Result<String, String> {
    let addr: SocketAddr = "127.0.0.1:15000".parse().expect("addr");
    let mut s = Lab::connect_from(lab.node(), addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(
        b"POST /quitquitquit HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .map_err(|e| e.to_string())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
    Ok(resp.lines().next().unwrap_or_default().to_owned())
}
