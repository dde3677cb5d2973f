//! Build info: embeds the git commit (ZTNODE_GIT_SHA: from that env when set, as the Containerfile
//! does, else `git rev-parse`) and build profile; warns, never fails, without git.
//!
//! Code layout: a release build for a musl target links the binary with the toolchain's
//! `rust-lld` and `layout/symbol-order.txt` (`--symbol-ordering-file`), which puts the functions
//! the running proxy uses next to each other, then the start-up ones (see that file's header and
//! `scripts/symbol-order.sh`). The file names the symbols of one toolchain, `Cargo.lock` and
//! profile; another build's missing ones are skipped (default order for them). Without `rust-lld`,
//! with a linker configured for the target (`RUSTC_LINKER`, maybe not a `cc` driver that takes
//! `-fuse-ld`), or with `ZTNODE_CODE_LAYOUT=off`, the default link is used and a warning says so.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The symbol ordering file, relative to the package root.
const SYMBOL_ORDER: &str = "layout/symbol-order.txt";

/// The directory holding the toolchain's `ld.lld` wrapper for `cc -fuse-ld=lld`
/// (`<sysroot>/lib/rustlib/<host>/bin/gcc-ld`), when it exists.
fn rust_lld_dir() -> Option<PathBuf> {
    let rustc = std::env::var("RUSTC").ok()?;
    let host = std::env::var("HOST").ok()?;
    let out = Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let dir = sysroot.join("lib/rustlib").join(host).join("bin/gcc-ld");
    dir.join("ld.lld").is_file().then_some(dir)
}

/// Links the release binary of a musl target with [`SYMBOL_ORDER`] (module docs).
fn code_layout() {
    println!("cargo:rerun-if-env-changed=ZTNODE_CODE_LAYOUT");
    let target = std::env::var("TARGET").unwrap_or_default();
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    if !(release && target.contains("linux-musl")) {
        return;
    }
    if std::env::var("ZTNODE_CODE_LAYOUT").is_ok_and(|v| v == "off") {
        return;
    }
    if std::env::var_os("RUSTC_LINKER").is_some() {
        println!("cargo:warning=a linker is configured for {target}: default code layout");
        return;
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let order = root.join(SYMBOL_ORDER);
    // the directory, not the file: a file named here that does not exist would rerun the script
    // (and relink) on every build, and a directory that appears later is seen
    if let Some(dir) = Path::new(SYMBOL_ORDER).parent() {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    if !Path::new(&order).is_file() {
        println!("cargo:warning={SYMBOL_ORDER} missing: default code layout");
        return;
    }
    println!("cargo:rerun-if-changed={SYMBOL_ORDER}");
    let Some(lld) = rust_lld_dir() else {
        println!("cargo:warning=no rust-lld in the toolchain: default code layout");
        return;
    };
    for arg in [
        format!("-B{}", lld.display()),
        "-fuse-ld=lld".to_owned(),
        format!("-Wl,--symbol-ordering-file={}", order.display()),
        // the file names the symbols of one build; others' are skipped without a word
        "-Wl,--no-warn-symbol-ordering".to_owned(),
    ] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
}

fn main() {
    code_layout();
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
