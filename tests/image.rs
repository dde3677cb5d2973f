//! The image build as written in `Containerfile`, `.containerignore` and `.dockerignore`
//! (no container engine runs here): the build context is exactly what the Containerfile copies
//! (target/ and .git/ out), the dependency layer builds from the manifest with stub sources
//! (checked with `cargo metadata` on such a copy), the final image carries the OCI labels with
//! the crate's version and license, and the build picks the musl target of the platform it runs
//! on (arm64 under `--platform linux/arm64`).

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(name: &str) -> Result<String> {
    fs::read_to_string(Path::new(ROOT).join(name)).with_context(|| name.to_owned())
}

/// The patterns of an ignore file (comments and blank lines dropped).
fn patterns(name: &str) -> Result<Vec<String>> {
    Ok(read(name)?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect())
}

/// The paths `COPY <src>... <dest>` takes from the context (not `--from=` stages).
fn copied_paths(containerfile: &str) -> Vec<String> {
    containerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .filter(|rest| !rest.starts_with("--from"))
        .flat_map(|rest| {
            let words: Vec<&str> = rest.split_whitespace().collect();
            words[..words.len().saturating_sub(1)]
                .iter()
                .map(|w| w.trim_end_matches('/').to_owned())
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn build_context_is_what_the_containerfile_copies() -> Result<()> {
    let file = read("Containerfile")?;
    let copied: BTreeSet<String> = copied_paths(&file).into_iter().collect();
    ensure!(
        copied
            == BTreeSet::from(
                ["Cargo.toml", "Cargo.lock", "build.rs", "layout", "src"].map(String::from)
            ),
        "COPY takes {copied:?}"
    );
    let ignore = patterns(".containerignore")?;
    ensure!(
        patterns(".dockerignore")? == ignore,
        ".dockerignore differs from .containerignore"
    );
    ensure!(
        ignore.first().map(String::as_str) == Some("*"),
        "not everything is excluded first: {ignore:?}"
    );
    let included: BTreeSet<String> = ignore
        .iter()
        .filter_map(|p| p.strip_prefix('!'))
        .map(|p| p.trim_end_matches('/').to_owned())
        .collect();
    ensure!(
        included == copied,
        "context {included:?} is not what COPY takes {copied:?}"
    );
    for p in ["target", ".git", "tests", "deploy"] {
        ensure!(!included.contains(p), "{p} is in the build context");
    }
    Ok(())
}

#[test]
fn dependency_layer_builds_from_the_manifest_alone() -> Result<()> {
    let file = read("Containerfile")?;
    let deps = file
        .find("COPY Cargo.toml Cargo.lock build.rs ./")
        .context("no manifest-only COPY")?;
    let sources = file.find("COPY src ./src").context("no COPY of src")?;
    ensure!(
        deps < sources,
        "the sources are copied before the dependency build"
    );
    let between = &file[deps..sources];
    ensure!(
        between.contains("cargo build --release --locked"),
        "no dependency build before the sources"
    );
    ensure!(
        between.contains(".fingerprint/ztnode-"),
        "the stub crate's fingerprint is kept: the real sources (older mtimes) would not rebuild"
    );
    // The stubs the Containerfile writes are enough for cargo to take the manifest.
    let tmp = tempfile::tempdir()?;
    for f in ["Cargo.toml", "Cargo.lock", "build.rs"] {
        fs::copy(Path::new(ROOT).join(f), tmp.path().join(f))?;
    }
    fs::create_dir(tmp.path().join("src"))?;
    fs::write(tmp.path().join("src/main.rs"), "fn main() {}\n")?;
    fs::write(tmp.path().join("src/lib.rs"), "")?;
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--locked",
            "--offline",
            "--no-deps",
            "--format-version",
            "1",
        ])
        .current_dir(tmp.path())
        .output()?;
    ensure!(
        out.status.success(),
        "cargo metadata on the stub context: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn image_has_the_oci_labels() -> Result<()> {
    let file = read("Containerfile")?;
    let last_stage = file.rsplit("\nFROM ").next().context("no stage")?;
    ensure!(
        last_stage.starts_with("scratch"),
        "final stage is {last_stage:.20}"
    );
    for key in [
        "title",
        "description",
        "version",
        "revision",
        "created",
        "licenses",
        "source",
    ] {
        let label = format!("org.opencontainers.image.{key}=");
        ensure!(last_stage.contains(&label), "no label {label}");
    }
    let version = format!("ARG VERSION={}", env!("CARGO_PKG_VERSION"));
    ensure!(
        last_stage.contains(&version),
        "the version label's default is not Cargo's ({version})"
    );
    ensure!(
        last_stage.contains("org.opencontainers.image.licenses=\"Apache-2.0\""),
        "license label is not Cargo.toml's"
    );
    ensure!(
        file.contains("ZTNODE_GIT_SHA=\"$REVISION\""),
        "the binary's commit is not the revision label's"
    );
    Ok(())
}

#[test]
fn build_targets_the_platform_it_runs_on() -> Result<()> {
    let file = read("Containerfile")?;
    ensure!(
        file.contains("\"$(uname -m)-unknown-linux-musl\""),
        "the musl target is not derived from the build platform"
    );
    ensure!(
        !file.contains("x86_64-unknown-linux-musl"),
        "an x86_64 target is hard-coded"
    );
    Ok(())
}
