//! File system side of the installer: reading the config dir, atomic writes (temp file in the same
//! dir, fsync, rename, like Istio's `pkg/file` `AtomicWrite`), the plugin binary copy, removals.

use std::fs::{self, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::InstallError;
use super::conflist;
use super::plan::{Action, ConfFile};

/// Mode of the installed plugin binary.
pub(crate) const BINARY_MODE: u32 = 0o755;
/// Marker in the names of our temp files in the config dir (`<file>.ztnode-tmp.<random>`).
const CONF_TMP_MARKER: &str = ".ztnode-tmp.";

/// (device, inode, size, mtime) of the installed binary, to notice cheaply that it changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

/// Reads every `.conf`/`.conflist` regular file (or symlink to one) in `dir`, sorted by name (byte
/// order, as kubelet/libcni). Files that vanish while reading are skipped; names that are not UTF-8
/// are ignored.
pub(crate) fn scan_conf_dir(dir: &Path) -> Result<Vec<ConfFile>, InstallError> {
    let read_dir_err = |source| InstallError::ReadDir {
        dir: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for dirent in fs::read_dir(dir).map_err(read_dir_err)? {
        let dirent = dirent.map_err(read_dir_err)?;
        let Some(name) = dirent.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !conflist::has_conf_ext(&name) {
            continue;
        }
        let path = dir.join(&name);
        let read = fs::metadata(&path).and_then(|md| match md.is_file() {
            true => Ok(Some((md, fs::read(&path)?))),
            false => Ok(None),
        });
        let (md, bytes) = match read {
            Ok(Some(found)) => found,
            Ok(None) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(InstallError::ReadFile { path, source }),
        };
        files.push(ConfFile {
            name,
            value: serde_json::from_slice(&bytes).ok(),
            mode: md.mode() & 0o7777,
        });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(files)
}

/// Applies planned actions to `dir` in order. Writes through a symlink land in its target.
pub(crate) fn apply(dir: &Path, actions: &[Action]) -> Result<(), InstallError> {
    for action in actions {
        match action {
            Action::Write { name, value, mode } => {
                let path = dir.join(name);
                let text = conflist::render(value).map_err(|source| InstallError::Render {
                    path: path.clone(),
                    source,
                })?;
                let target = match fs::symlink_metadata(&path) {
                    Ok(md) if md.file_type().is_symlink() => {
                        fs::canonicalize(&path).map_err(|source| InstallError::Write {
                            path: path.clone(),
                            source,
                        })?
                    }
                    _ => path,
                };
                atomic_write(&target, text.as_bytes(), *mode).map_err(|source| {
                    InstallError::Write {
                        path: target.clone(),
                        source,
                    }
                })?;
            }
            Action::Remove { name } => remove_if_exists(&dir.join(name))?,
        }
    }
    Ok(())
}

/// Removes our leftover temp files in the config dir (from a crash between write and rename).
pub(crate) fn remove_stale_conf_tmp(dir: &Path) -> Result<(), InstallError> {
    remove_matching(dir, |name| name.contains(CONF_TMP_MARKER))
}

/// Removes leftover `<name>.tmp.*` files of an interrupted [`atomic_write`] of `dir/name`.
pub(crate) fn remove_stale_tmp(dir: &Path, name: &str) -> Result<(), InstallError> {
    let prefix = format!("{name}.tmp.");
    remove_matching(dir, |n| n.starts_with(&prefix))
}

/// Copies `source` to `bin_dir/name` with mode 0755 unless the target already has the same content
/// (then only its mode is fixed). Returns whether the content was written. Stale `name.tmp.*` files
/// are removed first; the write is atomic, so a running plugin keeps its old inode.
pub(crate) fn install_binary(
    source: &Path,
    bin_dir: &Path,
    name: &str,
) -> Result<bool, InstallError> {
    let target = bin_dir.join(name);
    let copy_err = |source_err| InstallError::CopyBinary {
        from: source.to_owned(),
        to: target.clone(),
        source: source_err,
    };
    fs::create_dir_all(bin_dir).map_err(copy_err)?;
    remove_stale_tmp(bin_dir, name)?;
    if same_content(source, &target).map_err(copy_err)? {
        let md = fs::metadata(&target).map_err(copy_err)?;
        if md.mode() & 0o7777 != BINARY_MODE {
            fs::set_permissions(&target, fs::Permissions::from_mode(BINARY_MODE))
                .map_err(copy_err)?;
        }
        return Ok(false);
    }
    let mut from = File::open(source).map_err(copy_err)?;
    atomic_write_with(&target, BINARY_MODE, |f| io::copy(&mut from, f).map(drop))
        .map_err(copy_err)?;
    Ok(true)
}

/// Whether `target` is a regular file with the same bytes as `source` (and mode 0755).
pub(crate) fn binary_current(source: &Path, target: &Path) -> Result<bool, InstallError> {
    let current = same_content(source, target)
        .and_then(|same| Ok(same && fs::metadata(target)?.mode() & 0o7777 == BINARY_MODE));
    current.map_err(|e| InstallError::CopyBinary {
        from: source.to_owned(),
        to: target.to_owned(),
        source: e,
    })
}

/// Fingerprint of the file at `path` (not following symlinks); `None` if it does not exist.
pub(crate) fn fingerprint(path: &Path) -> Option<Fingerprint> {
    let md = fs::symlink_metadata(path).ok()?;
    Some(Fingerprint {
        dev: md.dev(),
        ino: md.ino(),
        size: md.size(),
        mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
    })
}

/// Removes `path`; a missing file is fine.
pub(crate) fn remove_if_exists(path: &Path) -> Result<(), InstallError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(InstallError::Remove {
            path: path.to_owned(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Writes `bytes` to `path` atomically with permission bits `mode`.
pub(crate) fn atomic_write(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    atomic_write_with(path, mode, |f| f.write_all(bytes))
}

/// Creates `<dir>/<name><marker><random>` (`.tmp.` for binaries, `.ztnode-tmp.` for configs), sets
/// `mode` (regardless of umask), lets `fill` write it, fsyncs, renames it over `path`, fsyncs the dir.
fn atomic_write_with(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let marker = if conflist::has_conf_ext(&name) {
        CONF_TMP_MARKER
    } else {
        ".tmp."
    };
    let (tmp, mut file) = create_tmp(dir, &format!("{name}{marker}"), mode)?;
    let written = (|| {
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        fill(&mut file)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    File::open(dir)?.sync_all()
}

/// Creates a new file `<dir>/<prefix><random hex>` that did not exist before.
fn create_tmp(dir: &Path, prefix: &str, mode: u32) -> io::Result<(PathBuf, File)> {
    let mut last_err = None;
    for _ in 0..8 {
        let path = dir.join(format!("{prefix}{:016x}", random_u64()));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
        {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last_err = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)))
}

/// A random number from std's per-process randomly keyed hasher (enough for temp file names).
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// Whether `target` exists as a regular file with exactly the bytes of `source`.
fn same_content(source: &Path, target: &Path) -> io::Result<bool> {
    let target_md = match fs::symlink_metadata(target) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if !target_md.is_file() || target_md.len() != fs::metadata(source)?.len() {
        return Ok(false);
    }
    let (mut a, mut b) = (File::open(source)?, File::open(target)?);
    let (mut buf_a, mut buf_b) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let n = read_full(&mut a, &mut buf_a)?;
        let m = read_full(&mut b, &mut buf_b)?;
        if n != m || buf_a[..n] != buf_b[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or EOF; returns the number of bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Removes the files in `dir` whose (UTF-8) name matches; a missing dir is fine.
fn remove_matching(dir: &Path, matches: impl Fn(&str) -> bool) -> Result<(), InstallError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(InstallError::ReadDir {
                dir: dir.to_owned(),
                source,
            });
        }
    };
    for dirent in entries.flatten() {
        if dirent.file_name().to_str().is_some_and(&matches) {
            remove_if_exists(&dirent.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_sets_mode_and_leaves_no_tmp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.conflist");
        atomic_write(&path, b"{}\n", 0o600).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"{}\n");
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o7777, 0o600);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn same_content_compares_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        fs::write(&a, vec![7u8; 200_000]).unwrap();
        assert!(!same_content(&a, &b).unwrap());
        let mut other = vec![7u8; 200_000];
        other[150_000] = 8;
        fs::write(&b, &other).unwrap();
        assert!(!same_content(&a, &b).unwrap());
        fs::write(&b, vec![7u8; 200_000]).unwrap();
        assert!(same_content(&a, &b).unwrap());
    }

    #[test]
    fn scan_skips_other_names_and_sorts_bytewise() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "87-b.conflist",
            "100-a.conf",
            "10-c.conflist",
            "x.json",
            "bad.conf",
        ] {
            fs::write(dir.path().join(name), "{}").unwrap();
        }
        fs::write(dir.path().join("bad.conf"), "not json").unwrap();
        fs::create_dir(dir.path().join("sub.conf")).unwrap();
        let files = scan_conf_dir(dir.path()).unwrap();
        let names: Vec<_> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["10-c.conflist", "100-a.conf", "87-b.conflist", "bad.conf"]
        );
        assert!(files[3].value.is_none());
    }

    #[test]
    fn write_through_symlink_keeps_link() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        fs::create_dir(&real).unwrap();
        fs::write(real.join("a.conflist"), "{}").unwrap();
        let link = dir.path().join("a.conflist");
        std::os::unix::fs::symlink(real.join("a.conflist"), &link).unwrap();
        let action = Action::Write {
            name: "a.conflist".into(),
            value: serde_json::json!({"k": 1}),
            mode: 0o644,
        };
        apply(dir.path(), &[action]).unwrap();
        assert!(
            fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            fs::read_to_string(real.join("a.conflist")).unwrap(),
            "{\n  \"k\": 1\n}\n"
        );
    }
}
