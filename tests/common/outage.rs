//! Control-plane outages for the end-to-end tests: a network partition (every packet to or from
//! a TCP port dropped, no reset, as when a route or a host goes away) and a load balancer whose
//! backends are all down (every request answered 503).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// The nftables table a [`Partition`] adds.
const TABLE: &str = "ztnode-test-partition";

/// Drops every TCP segment to or from `port` as it arrives in the given network namespaces, until
/// dropped. Nothing is reset and the senders see no local error (a drop on the way out would make
/// the kernel retry every 500 ms instead of backing off): peers see silence, as when a route or a
/// host goes away.
pub struct Partition {
    netns: Vec<String>,
}

impl Partition {
    /// Starts dropping (an nftables input chain in each of `netns_names`).
    pub fn start(netns_names: &[&str], port: u16) -> Partition {
        let rules = format!(
            "table inet {TABLE} {{\n chain in {{\n  type filter hook input priority -300; policy accept;\n  \
             tcp dport {port} drop\n  tcp sport {port} drop\n }}\n}}\n"
        );
        for netns in netns_names {
            let mut nft = Command::new("ip")
                .args(["netns", "exec", netns, "nft", "-f", "-"])
                .stdin(Stdio::piped())
                .spawn()
                .expect("spawn nft");
            nft.stdin
                .take()
                .expect("nft stdin")
                .write_all(rules.as_bytes())
                .expect("write the partition rules");
            assert!(nft.wait().expect("nft").success(), "nft -f: {rules}");
        }
        Partition {
            netns: netns_names.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    /// Ends the partition.
    pub fn heal(self) {}
}

impl Drop for Partition {
    fn drop(&mut self) {
        for netns in &self.netns {
            let _ = Command::new("ip")
                .args([
                    "netns", "exec", netns, "nft", "delete", "table", "inet", TABLE,
                ])
                .status();
        }
    }
}

/// Answers every HTTP request on `addr` with `503 Service Unavailable` and a Kubernetes `Status`
/// body, then closes the connection (an API server load balancer with no healthy backend), until
/// dropped.
pub struct Unavailable {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Unavailable {
    /// Listens on `addr` inside `netns`.
    pub fn start(netns: &Netns, addr: SocketAddr) -> Unavailable {
        let listener = Lab::listen_in(netns, addr).expect("listen for the 503 answers");
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || serve_unavailable(&listener, &stop)
        });
        Unavailable {
            stop,
            thread: Some(thread),
        }
    }
}

fn serve_unavailable(listener: &TcpListener, stop: &AtomicBool) {
    let body = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"no healthy API server behind the load balancer","reason":"ServiceUnavailable","code":503}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    while !stop.load(Ordering::Relaxed) {
        let mut conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => continue,
        };
        let _ = conn.set_nonblocking(false);
        let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
        // read the request head (a GET has no body), then answer and close
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let _ = conn.write_all(answer.as_bytes());
    }
}

impl Drop for Unavailable {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
