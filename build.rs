//! Build info: embeds the git commit (ZTNODE_GIT_SHA: from that env when set, as the Containerfile
//! does, else `git rev-parse`) and build profile; warns, never fails, without git.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=ZTNODE_GIT_SHA");
    // An image build has no .git in its context: the Containerfile passes the commit in.
    if let Some(sha) = std::env::var("ZTNODE_GIT_SHA")
        .ok()
        .filter(|s| !s.is_empty())
    {
        println!("cargo:rustc-env=ZTNODE_GIT_SHA={sha}");
        println!(
            "cargo:rustc-env=ZTNODE_PROFILE={}",
            std::env::var("PROFILE").unwrap_or_default()
        );
        return;
    }
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
