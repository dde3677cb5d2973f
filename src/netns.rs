//! Network namespace handles.
//!
//! A [`Netns`] holds an open fd of a network namespace (`/var/run/netns/<name>`, `/proc/<pid>/ns/net`)
//! and its identity ([`NetnsId`]: inode and device of the nsfs file, as istio-cni and ztunnel compare
//! them). [`Netns::run`] executes a closure inside the namespace on a dedicated OS thread, so `setns`
//! never runs on an async worker thread; sockets created inside the closure stay in that namespace.
//! [`Netns::enter`] moves a thread of the caller's own into the namespace for good. These two are
//! the crate's only `setns` calls.

use std::fs::File;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sched::{CloneFlags, setns};

/// Errors opening or entering a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened or inspected.
    #[error("open netns {path}: {source}")]
    Open {
        /// Path given by the caller.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `setns(2)` failed (needs CAP_SYS_ADMIN).
    #[error("setns into netns {id}: {source}")]
    Enter {
        /// Identity of the namespace.
        id: NetnsId,
        /// Errno from the kernel.
        #[source]
        source: nix::Error,
    },
    /// The helper thread could not be spawned or panicked.
    #[error("netns helper thread failed: {0}")]
    Thread(String),
    /// Listing the interface addresses inside failed (`getifaddrs(3)`).
    #[error("list interface addresses in netns {id}: {source}")]
    Addrs {
        /// Identity of the namespace.
        id: NetnsId,
        /// Errno.
        #[source]
        source: nix::Error,
    },
}

/// Identity of a network namespace: (inode, device) of its nsfs file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NetnsId {
    /// `st_ino` of the namespace file.
    pub inode: u64,
    /// `st_dev` of the namespace file.
    pub dev: u64,
}

impl std::fmt::Display for NetnsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.dev, self.inode)
    }
}

/// An open network namespace. Cheap to clone (shared fd); compares by [`NetnsId`].
#[derive(Debug, Clone)]
pub struct Netns {
    file: Arc<File>,
    id: NetnsId,
}

impl PartialEq for Netns {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl Eq for Netns {}

impl Netns {
    /// Opens the namespace at `path` (e.g. `/var/run/netns/pod-a` or `/proc/123/ns/net`).
    pub fn open(path: impl AsRef<Path>) -> Result<Netns, NetnsError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_owned(),
            source,
        })?;
        Self::from_file(file).map_err(|source| NetnsError::Open {
            path: path.to_owned(),
            source,
        })
    }

    /// The namespace of the calling thread (`/proc/thread-self/ns/net`).
    pub fn current() -> Result<Netns, NetnsError> {
        Self::open("/proc/thread-self/ns/net")
    }

    /// Wraps an already open namespace fd (for example one received over SCM_RIGHTS).
    pub fn from_file(file: File) -> std::io::Result<Netns> {
        let meta = file.metadata()?;
        Ok(Netns {
            id: NetnsId {
                inode: meta.ino(),
                dev: meta.dev(),
            },
            file: Arc::new(file),
        })
    }

    /// The namespace identity.
    pub fn id(&self) -> NetnsId {
        self.id
    }

    /// The IPv4 and IPv6 addresses of the namespace's interfaces (loopback included), via
    /// `getifaddrs(3)` inside it. Blocking; needs CAP_SYS_ADMIN.
    pub fn interface_addrs(&self) -> Result<Vec<IpAddr>, NetnsError> {
        let listed = self.run(|| -> Result<Vec<IpAddr>, nix::Error> {
            Ok(nix::ifaddrs::getifaddrs()?
                .filter_map(|ifa| {
                    let a = ifa.address?;
                    a.as_sockaddr_in()
                        .map(|v4| IpAddr::V4(v4.ip()))
                        .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                })
                .collect())
        })?;
        listed.map_err(|source| NetnsError::Addrs {
            id: self.id(),
            source,
        })
    }

    /// Runs `f` inside this namespace on a fresh OS thread and returns its result.
    ///
    /// The thread is dedicated to the call and exits afterwards, so the caller's namespace is never
    /// changed. Blocking: call it from a blocking context (`spawn_blocking`) in async code.
    pub fn run<F, R>(&self, f: F) -> Result<R, NetnsError>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        std::thread::scope(|s| {
            let handle = std::thread::Builder::new()
                .name("netns".into())
                .spawn_scoped(s, move || {
                    self.enter()?;
                    Ok(f())
                })
                .map_err(|e| NetnsError::Thread(e.to_string()))?;
            handle
                .join()
                .map_err(|_| NetnsError::Thread("panicked".into()))?
        })
    }

    /// Moves the calling thread into this namespace (`setns(2)`), for the rest of the thread's life.
    ///
    /// Only for a thread dedicated to the namespace (never an async worker or a pooled thread):
    /// everything it does afterwards, sockets it creates included, happens inside. [`Netns::run`]
    /// is the scoped form.
    ///
    /// # Errors
    /// [`NetnsError::Enter`] with the kernel's errno (EPERM without CAP_SYS_ADMIN).
    pub fn enter(&self) -> Result<(), NetnsError> {
        setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter {
            id: self.id,
            source,
        })
    }

    /// Borrowed fd of the namespace (to pass over SCM_RIGHTS).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Raw fd number, for logs.
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_netns_has_identity_and_runs_closures() {
        let ns = Netns::current().expect("open own netns");
        let again = Netns::current().expect("open own netns twice");
        assert_eq!(ns, again);
        assert_ne!(ns.id().inode, 0);
        let inner = ns.run(|| Netns::current().map(|n| n.id())).expect("run");
        assert_eq!(inner.expect("inner netns"), ns.id());
    }

    #[test]
    fn open_missing_path_names_it() {
        let err = Netns::open("/nonexistent/netns").expect_err("must fail");
        assert!(err.to_string().contains("/nonexistent/netns"), "{err}");
    }
}
