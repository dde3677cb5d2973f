//! Shared helpers for the privileged (root + netns) integration tests.
#![allow(dead_code)]

/// Returns true when the test may run (root with netns support). Without it: fails under `CI`,
/// otherwise prints a loud SKIP and returns false.
pub fn privileged(test: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    let has_ip = std::process::Command::new("ip").arg("-V").output().is_ok();
    if root && has_ip {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{test}: needs root and iproute2, and CI is set: failing instead of skipping");
    }
    eprintln!("SKIP {test}: needs root and iproute2 (set CI=1 to make this a failure)");
    false
}

/// A short unique prefix for namespace names: `<tag><pid % 100000>`.
pub fn prefix(tag: &str) -> String {
    format!("{tag}{}", std::process::id() % 100_000)
}
pub mod capture;
pub mod istiod;
pub mod kube;
pub mod lifecycle;
pub mod node;
pub mod outage;

/// Connects from inside `ns` to `to`; `None` when the connection is reset before connect returns
/// (a proxy refusing it fast, with a RST, may do so before the client's connect completes).
/// Panics naming `what` on any other failure.
pub fn connect_unless_reset(
    ns: &ztnode::netns::Netns,
    to: std::net::SocketAddr,
    what: &str,
) -> Option<std::net::TcpStream> {
    match ztnode::lab::Lab::connect_from(ns, to) {
        Ok(c) => Some(c),
        Err(ztnode::lab::LabError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::ConnectionReset =>
        {
            None
        }
        Err(e) => panic!("{what}: connect to {to}: {e}"),
    }
}

/// Removes a directory (and what is in it) when dropped; declare it before the lab and the
/// processes that use the directory, so it goes after them.
pub struct RemoveOnDrop(pub std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
