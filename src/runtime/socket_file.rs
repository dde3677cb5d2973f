//! A unix socket file this process bound, removed on the way out only while it is still the one
//! this process bound: during an upgrade the new process binds the same path (replacing the
//! file) while the old one still runs, and the old one's exit must not delete the new socket.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The socket file at a path, as bound by this process (device and inode at claim time).
#[derive(Debug, Clone)]
pub struct SocketFile {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl SocketFile {
    /// Remembers which file is at `path` now (right after binding it).
    pub fn claim(path: &Path) -> SocketFile {
        SocketFile {
            path: path.to_owned(),
            id: file_id(path),
        }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file at the path is still the one claimed (no other process has bound the
    /// path since). Blocking (one `lstat`).
    pub fn is_ours(&self) -> bool {
        self.id.is_some() && self.id == file_id(&self.path)
    }

    /// Removes the file if it is still the one claimed; a file another process put there since
    /// (or none) is left alone.
    pub fn remove(&self) {
        match (self.id, file_id(&self.path)) {
            (Some(ours), Some(now)) if ours == now => {
                let _ = std::fs::remove_file(&self.path);
            }
            (_, Some(_)) => {
                tracing::info!(path = %self.path.display(), "socket taken over by another process: left in place");
            }
            _ => {}
        }
    }
}

fn file_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_claimed_socket_is_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let _first = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let old = SocketFile::claim(&path);
        // a new process binds the same path (replacing the file)
        std::fs::remove_file(&path).expect("unlink");
        let _second = std::os::unix::net::UnixListener::bind(&path).expect("bind again");
        let new = SocketFile::claim(&path);
        assert!(!old.is_ours(), "the old claim sees the takeover");
        assert!(new.is_ours());
        old.remove();
        assert!(path.exists(), "the old process leaves the new socket");
        new.remove();
        assert!(!path.exists(), "the new process removes its own");
        assert!(!new.is_ours(), "a removed socket is nobody's");
        new.remove();
    }
}
