//! A running `ztnode node` process in a lab node, with pods, for the end-to-end tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use ztnode::lab::{Lab, LabOptions, MeshLab, MeshSpec, Pod};

pub use ztnode::lab::ProcessGuard as NodeProcess;

/// A lab node running `ztnode node`, with two enrolled pods (`client` sa alice, `server` sa bob)
/// and one pod outside the mesh (`outsider`). Field order = drop order: process first, then the lab.
pub struct MeshNode {
    pub process: NodeProcess,
    pub lab: Lab,
    pub log: PathBuf,
    pub run_dir: PathBuf,
    pub client: Pod,
    pub server: Pod,
    pub outsider: Pod,
}

pub const SUBNET: &str = "10.249.0.0/24";

impl MeshNode {
    /// Builds the node; `prefix` must be unique per test and ≤ 10 chars.
    pub fn start(prefix: &str) -> MeshNode {
        MeshNode::start_with(prefix, "")
    }

    /// [`MeshNode::start`] with `extra` appended to the local config (e.g. a `policies:` list).
    pub fn start_with(prefix: &str, extra: &str) -> MeshNode {
        MeshNode::start_with_args(prefix, extra, &[])
    }

    /// [`MeshNode::start_with`] with `args` added to `ztnode node`'s command line.
    pub fn start_with_args(prefix: &str, extra: &str, args: &[&str]) -> MeshNode {
        MeshNode::start_with_env(prefix, extra, args, &[])
    }

    /// [`MeshNode::start_with_args`] with `env` added to the node's environment.
    pub fn start_with_env(
        prefix: &str,
        extra: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> MeshNode {
        let run_dir = std::env::temp_dir().join(format!("ztnode-e2e-run-{prefix}"));
        let _ = std::fs::remove_dir_all(&run_dir);
        let client_ip = "10.249.0.2".parse().expect("ip");
        let server_ip = "10.249.0.3".parse().expect("ip");
        let MeshLab {
            node: process,
            lab,
            log,
            pods: [client, server, outsider],
            ..
        } = MeshLab::start(MeshSpec {
            lab: LabOptions {
                prefix: prefix.into(),
                ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
                run_dir: run_dir.clone(),
                subnet: SUBNET.into(),
                cni_version: "1.0.0".into(),
            },
            exe: env!("CARGO_BIN_EXE_ztnode").as_ref(),
            workloads: &[
                ("client", "default", "alice", client_ip),
                ("server", "default", "bob", server_ip),
            ],
            extra_config: extra,
            log_level: "info",
            node_args: &std::iter::once("--no-install")
                .chain(args.iter().copied())
                .map(std::ffi::OsString::from)
                .collect::<Vec<_>>(),
            node_env: &env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<Vec<_>>(),
            pods: [
                ("client", "default"),
                ("server", "default"),
                ("outsider", "default"),
            ],
        })
        .expect("start ztnode node with its pods");
        assert_eq!(
            (client.ip, server.ip),
            (client_ip, server_ip),
            "host-local allocation order"
        );
        MeshNode {
            process,
            lab,
            log,
            run_dir,
            client,
            server,
            outsider,
        }
    }

    /// The node log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log has a line matching all `needles`; returns it.
    pub fn wait_log(&self, needles: &[&str], timeout: Duration) -> String {
        MeshNode::wait_log_in(&self.log, needles, timeout)
    }

    /// The first line of the log at `path` holding every needle, waiting up to `timeout`.
    pub fn wait_log_in(path: &std::path::Path, needles: &[&str], timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if let Some(l) = text
                .split_inclusive('\n')
                // only whole lines: the process may be halfway through writing the last one
                .filter(|l| l.ends_with('\n'))
                .map(|l| l.trim_end_matches('\n'))
                .find(|l| needles.iter().all(|n| l.contains(n)))
            {
                return l.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {needles:?}; log:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `nft list ruleset` inside a pod.
    pub fn ruleset(pod: &Pod) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &pod.netns_name, "nft", "list", "ruleset"])
            .output()
            .expect("nft");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for MeshNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// Echoes one connection on `addr` inside `ns` (reads to EOF, writes it back); returns what it read
/// and the peer address.
pub fn echo_once(
    ns: &ztnode::netns::Netns,
    addr: std::net::SocketAddr,
) -> std::thread::JoinHandle<(Vec<u8>, std::net::SocketAddr)> {
    answer_once(ns, addr, |got| got.to_vec())
}

/// Like [`echo_once`], but the answer is `answer(what was read)`.
pub fn answer_once(
    ns: &ztnode::netns::Netns,
    addr: std::net::SocketAddr,
    answer: impl FnOnce(&[u8]) -> Vec<u8> + Send + 'static,
) -> std::thread::JoinHandle<(Vec<u8>, std::net::SocketAddr)> {
    use std::io::{Read, Write};
    let listener = Lab::listen_in(ns, addr).expect("listen");
    std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().expect("accept");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("read");
        s.write_all(&answer(&buf)).expect("answer");
        (buf, peer)
    })
}

/// Echoes every connection on `addr` inside `ns`, chunk by chunk until the peer half-closes, for
/// the rest of the test process.
pub fn serve_echo(ns: &ztnode::netns::Netns, addr: std::net::SocketAddr) {
    use std::io::{Read, Write};
    let listener = Lab::listen_in(ns, addr).expect("listen");
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

/// One round trip to `to` from inside `from` (connect, send `msg`, half-close, read to EOF): the
/// echo, or `None` when the connection fails or closes without answering (within 500 ms of
/// silence).
pub fn try_round_trip(
    from: &ztnode::netns::Netns,
    to: std::net::SocketAddr,
    msg: &[u8],
) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    let mut c = Lab::connect_from(from, to).ok()?;
    c.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    c.write_all(msg).ok()?;
    c.shutdown(std::net::Shutdown::Write).ok()?;
    let mut back = Vec::new();
    c.read_to_end(&mut back).ok()?;
    (!back.is_empty()).then_some(back)
}
