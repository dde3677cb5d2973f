//! Build info: embeds the git commit (ZTNODE_GIT_SHA) and build profile; warns, never fails, without git.

use std::process::Command;

fn main() {
    let sha = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| {
            println!("cargo:warning=git sha unavailable; version shows 'unknown'");
            "unknown".to_owned()
        });
    println!("cargo:rustc-env=ZTNODE_GIT_SHA={sha}");
    println!(
        "cargo:rustc-env=ZTNODE_PROFILE={}",
        std::env::var("PROFILE").unwrap_or_default()
    );
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
}
