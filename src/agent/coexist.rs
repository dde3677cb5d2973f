//! Refusing to start beside Istio's own node components. ztnode replaces istio-cni-node and
//! ztunnel; running next to them, it would chain its plugin after Istio's and both agents would
//! program the same `istio-ambient-*` tables in the same pods. So `ztnode node` and `ztnode agent`
//! stop at start when:
//! - a CNI config in the conf dir holds Istio's `istio-cni` plugin (its installer's entry, a
//!   standalone `istio-cni.conf`, or inside a Multus delegate), or
//! - something serves the ZDS socket (`/var/run/ztunnel/ztunnel.sock`, istio-cni's
//!   `ZTUNNEL_UDS_ADDRESS`): a listening SOCK_SEQPACKET socket bound to that path is in
//!   `/proc/net/unix`, so Istio's istio-cni agent (or another ztnode agent) is running and
//!   ztunnel talks to it. The check does not connect to a listener of its own netns (a live
//!   agent would take the probe for its newest proxy connection); only a socket file that table
//!   does not list (a listener in another netns) is probed by a connect. A socket file nobody
//!   listens on is a leftover and fine.

use std::io;
use std::path::{Path, PathBuf};

use socket2::{Domain, SockAddr, Socket, Type};

use super::install::{self, InstallError};

/// Why the agent must not start here. The messages say what to remove.
#[derive(Debug, thiserror::Error)]
pub enum CoexistError {
    /// Istio's CNI plugin is configured on this node.
    #[error(
        "Istio's istio-cni is installed on this node: {files} in {dir} configure the `istio-cni` plugin. \
         ztnode replaces it and will not chain after it: remove Istio's CNI (`helm uninstall istio-cni`, \
         or delete the istio-cni-node DaemonSet) and make sure its entry is gone from those files, then start ztnode"
    )]
    IstioCni {
        /// The conf dir.
        dir: PathBuf,
        /// The files holding the entry, comma-separated.
        files: String,
    },
    /// Something serves the ZDS socket.
    #[error(
        "the ZDS socket {socket} is in use: Istio's istio-cni agent (with ztunnel) or another ztnode agent runs on \
         this node. ztnode replaces both: remove Istio's istio-cni-node and ztunnel DaemonSets (or stop the other \
         ztnode agent), then start ztnode"
    )]
    ZdsInUse {
        /// The socket path.
        socket: PathBuf,
    },
    /// The conf dir could not be read.
    #[error(transparent)]
    Install(#[from] InstallError),
}

/// Checks `cni_conf_dir` and `zds_socket` as the module doc says. Errors: [`CoexistError`].
pub fn check(cni_conf_dir: &Path, zds_socket: &Path) -> Result<(), CoexistError> {
    let files = install::istio_cni_files(cni_conf_dir)?;
    if !files.is_empty() {
        return Err(CoexistError::IstioCni {
            dir: cni_conf_dir.to_owned(),
            files: files.join(", "),
        });
    }
    if zds_in_use(zds_socket) {
        return Err(CoexistError::ZdsInUse {
            socket: zds_socket.to_owned(),
        });
    }
    Ok(())
}

/// The kernel's table of the unix sockets of this network namespace.
const PROC_NET_UNIX: &str = "/proc/net/unix";

/// `__SO_ACCEPTCON` in the table's `Flags`: the socket listens.
const ACCEPTCON: u32 = 0x10000;

/// `SOCK_SEQPACKET` in the table's `Type`.
const SEQPACKET: u32 = 5;

/// Whether a SOCK_SEQPACKET socket listens at `path`. A listener of this network namespace (where
/// the host's agents run) is found in [`PROC_NET_UNIX`], without connecting. Only when the table
/// does not list one while a socket file is there (a listener in another netns is not in this
/// netns's table, or there is no procfs) does a non-blocking connect decide: a full backlog
/// (`EAGAIN`) still means someone listens, a refused connect means a leftover file.
fn zds_in_use(path: &Path) -> bool {
    let listed = match std::fs::read_to_string(PROC_NET_UNIX) {
        Ok(table) => listening_at(&table, path),
        Err(e) => {
            tracing::debug!(error = %e, file = PROC_NET_UNIX, "cannot read the unix socket table");
            false
        }
    };
    let socket_file = std::fs::symlink_metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
    listed || (socket_file && connects(path))
}

/// Whether `table` (the text of `/proc/net/unix`: `Num RefCount Protocol Flags Type St Inode
/// Path`) lists a listening SOCK_SEQPACKET socket bound to `path`. Paths compare with their
/// directory resolved (`/var/run` is often a link to `/run`); abstract sockets (`@...`) never
/// match.
fn listening_at(table: &str, path: &Path) -> bool {
    let want = resolved(path);
    table.lines().skip(1).any(|line| {
        let mut rest = line.trim_start();
        let mut fields = [""; 7];
        for f in &mut fields {
            let end = rest.find(' ').unwrap_or(rest.len());
            *f = &rest[..end];
            rest = rest[end..].trim_start();
        }
        let hex = |s: &str| u32::from_str_radix(s, 16).ok();
        let listening = hex(fields[3]).is_some_and(|flags| flags & ACCEPTCON != 0);
        let seqpacket = hex(fields[4]) == Some(SEQPACKET);
        listening && seqpacket && rest.starts_with('/') && resolved(Path::new(rest)) == want
    })
}

/// `path` with its parent directory canonicalised (the file itself may be gone).
fn resolved(path: &Path) -> PathBuf {
    match (path.parent().map(std::fs::canonicalize), path.file_name()) {
        (Some(Ok(dir)), Some(name)) => dir.join(name),
        _ => path.to_owned(),
    }
}

/// Whether a non-blocking SOCK_SEQPACKET connect to `path` is taken (or the backlog is full).
fn connects(path: &Path) -> bool {
    let connect = || -> io::Result<()> {
        let sock = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
        sock.set_nonblocking(true)?;
        sock.connect(&SockAddr::unix(path)?)
    };
    match connect() {
        Ok(()) => true,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_in_use_a_leftover_file_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ztunnel.sock");
        assert!(!zds_in_use(&path), "missing");
        let l = Socket::new(Domain::UNIX, Type::SEQPACKET, None).unwrap();
        l.bind(&SockAddr::unix(&path).unwrap()).unwrap();
        l.listen(1).unwrap();
        assert!(zds_in_use(&path), "listening");
        l.set_nonblocking(true).unwrap();
        assert!(
            l.accept()
                .is_err_and(|e| e.kind() == io::ErrorKind::WouldBlock),
            "the check connected to the listener"
        );
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(
            zds_in_use(&link.join("ztunnel.sock")),
            "through a linked dir"
        );
        let stream = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        let stream_path = dir.path().join("stream.sock");
        stream.bind(&SockAddr::unix(&stream_path).unwrap()).unwrap();
        stream.listen(1).unwrap();
        assert!(!zds_in_use(&stream_path), "a stream listener is not ZDS");
        assert!(matches!(
            check(dir.path(), &path),
            Err(CoexistError::ZdsInUse { .. })
        ));
        drop(l);
        assert!(path.exists());
        assert!(!zds_in_use(&path), "stale file");
        check(dir.path(), &path).unwrap();
    }

    #[test]
    fn the_socket_table_is_read_as_the_kernel_writes_it() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
            0000000000000000: 00000002 00000000 00010000 0005 01 4242 /tmp/zt x/ztunnel.sock\n\
            0000000000000000: 00000003 00000000 00000000 0005 03 4243 /tmp/zt x/ztunnel.sock\n\
            0000000000000000: 00000002 00000000 00010000 0001 01 4244 /tmp/zt y/ztunnel.sock\n\
            0000000000000000: 00000002 00000000 00010000 0005 01 4245 @/tmp/zt z/ztunnel.sock\n\
            0000000000000000: 00000002 00000000 00010000 0005 01 4246\n";
        assert!(listening_at(table, Path::new("/tmp/zt x/ztunnel.sock")));
        assert!(
            !listening_at(table, Path::new("/tmp/zt y/ztunnel.sock")),
            "stream"
        );
        assert!(
            !listening_at(table, Path::new("/tmp/zt z/ztunnel.sock")),
            "abstract"
        );
        assert!(
            !listening_at(table, Path::new("/tmp/zt w/ztunnel.sock")),
            "other path"
        );
        assert!(!listening_at("", Path::new("/tmp/zt x/ztunnel.sock")));
    }

    #[test]
    fn an_istio_cni_entry_is_refused_with_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("none.sock");
        std::fs::write(
            dir.path().join("10-flannel.conflist"),
            r#"{"name": "cbr0", "plugins": [{"type": "flannel"}, {"type": "istio-cni"}]}"#,
        )
        .unwrap();
        let err = check(dir.path(), &sock).unwrap_err().to_string();
        assert!(err.contains("10-flannel.conflist"), "{err}");
        assert!(err.contains("istio-cni-node DaemonSet"), "{err}");
    }
}
