//! Refusing to start beside Istio's own node components. ztnode replaces istio-cni-node and
//! ztunnel; running next to them, it would chain its plugin after Istio's and both agents would
//! program the same `istio-ambient-*` tables in the same pods. So `ztnode node` and `ztnode agent`
//! stop at start when:
//! - a CNI config in the conf dir holds Istio's `istio-cni` plugin (its installer's entry, a
//!   standalone `istio-cni.conf`, or inside a Multus delegate), or
//! - something serves the ZDS socket (`/var/run/ztunnel/ztunnel.sock`, istio-cni's
//!   `ZTUNNEL_UDS_ADDRESS`): a SOCK_SEQPACKET connect succeeds, so Istio's istio-cni agent (or
//!   another ztnode agent) is running and ztunnel talks to it. A socket file nobody listens on is
//!   a leftover and fine.

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

/// Whether a SOCK_SEQPACKET listener answers at `path`. Non-blocking: a full backlog (`EAGAIN`)
/// still means someone listens. A missing file, a refused connect or any other error says no.
fn zds_in_use(path: &Path) -> bool {
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
