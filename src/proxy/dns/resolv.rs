//! The node's upstream resolvers, read once from a `resolv.conf` (the proxy's own, i.e. the
//! node netns's `/etc/resolv.conf`, as ztunnel's `SystemForwarder` reads it; the path is
//! overridable).
//!
//! Only what forwarding needs is taken: `nameserver` lines (port 53) and `options timeout:N
//! attempts:N` with glibc's defaults and caps (resolv.conf(5): timeout 5 s, at most 30;
//! attempts 2, at most 5). `search`/`domain` are not used: a pod's search domains are its
//! namespace's (ztunnel's per-pod `SearchDomains::Dynamic`), and the forwarded query already has
//! them applied by the pod's own resolver.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The port upstream DNS servers listen on.
pub const UPSTREAM_PORT: u16 = 53;
/// glibc's default per-try timeout (`RES_TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// glibc's default number of rounds over the servers (`RES_DFLRETRY`).
pub const DEFAULT_ATTEMPTS: u32 = 2;
/// glibc's cap on `timeout:` (`RES_MAXRETRANS`).
const MAX_TIMEOUT_SECS: u64 = 30;
/// glibc's cap on `attempts:` (`RES_MAXRETRY`).
const MAX_ATTEMPTS: u32 = 5;

/// Reading the resolver config failed.
#[derive(Debug, thiserror::Error)]
#[error("reading the upstream DNS servers from {path}: {source}")]
pub struct ResolvConfError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// Where forwarded queries go, and how patiently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstreams {
    /// Servers in file order (each on port 53).
    pub servers: Vec<SocketAddr>,
    /// Wait for one server's answer before trying the next.
    pub timeout: Duration,
    /// Rounds over all servers (UDP).
    pub attempts: u32,
}

impl Upstreams {
    /// `servers` with glibc's default timeout and attempts.
    pub fn new(servers: Vec<SocketAddr>) -> Upstreams {
        Upstreams {
            servers,
            timeout: DEFAULT_TIMEOUT,
            attempts: DEFAULT_ATTEMPTS,
        }
    }

    /// Reads `path`.
    pub fn read(path: &Path) -> Result<Upstreams, ResolvConfError> {
        std::fs::read_to_string(path)
            .map(|text| Upstreams::parse(&text))
            .map_err(|source| ResolvConfError {
                path: path.to_owned(),
                source,
            })
    }

    /// Parses resolv.conf text; lines it does not understand are skipped (as glibc does).
    pub fn parse(text: &str) -> Upstreams {
        let mut up = Upstreams::new(Vec::new());
        for line in text.lines() {
            let line = line.split(['#', ';']).next().unwrap_or_default();
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    if let Some(ip) = words.next().and_then(nameserver_ip) {
                        up.servers.push(SocketAddr::new(ip, UPSTREAM_PORT));
                    }
                }
                Some("options") => {
                    for opt in words {
                        if let Some(n) = opt.strip_prefix("timeout:").and_then(|n| n.parse().ok()) {
                            up.timeout = Duration::from_secs(u64::min(n, MAX_TIMEOUT_SECS).max(1));
                        } else if let Some(n) =
                            opt.strip_prefix("attempts:").and_then(|n| n.parse().ok())
                        {
                            up.attempts = u32::min(n, MAX_ATTEMPTS).max(1);
                        }
                    }
                }
                _ => {}
            }
        }
        up
    }
}

/// A `nameserver` address; a v6 zone (`fe80::1%eth0`) cannot be used from a pod netns (the
/// interface is the node's), so such entries are skipped.
fn nameserver_ip(word: &str) -> Option<IpAddr> {
    if word.contains('%') {
        return None;
    }
    word.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nameservers_and_options_as_glibc_reads_them() {
        let up = Upstreams::parse(
            "# generated\nsearch default.svc.cluster.local svc.cluster.local\n\
             nameserver 10.96.0.10\nnameserver fd00::a ; second\nnameserver fe80::1%eth0\n\
             nameserver bogus\noptions ndots:5 timeout:3 attempts:9\n",
        );
        assert_eq!(
            up.servers,
            vec![
                "10.96.0.10:53".parse::<SocketAddr>().expect("addr"),
                "[fd00::a]:53".parse().expect("addr"),
            ]
        );
        assert_eq!(up.timeout, Duration::from_secs(3));
        assert_eq!(up.attempts, MAX_ATTEMPTS, "capped as glibc does");
    }

    #[test]
    fn defaults_without_options_and_an_unreadable_file_names_itself() {
        let up = Upstreams::parse("nameserver 127.0.0.53\n");
        assert_eq!(
            (up.timeout, up.attempts),
            (DEFAULT_TIMEOUT, DEFAULT_ATTEMPTS)
        );
        let err = Upstreams::read(Path::new("/nonexistent/resolv.conf")).expect_err("missing");
        assert!(
            err.to_string()
                .starts_with("reading the upstream DNS servers from /nonexistent/resolv.conf: "),
            "{err}"
        );
    }
}
