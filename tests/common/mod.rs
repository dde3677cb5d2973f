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
pub mod istiod;
pub mod kube;
pub mod node;
