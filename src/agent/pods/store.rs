//! The pod table on disk: `<run_dir>/pods.json`, so an agent restart does not strand enrolled pods
//! (istio-cni rebuilds the same knowledge from its informer snapshot, `../shared/spec/istio-cni.md`
//! §3.2, §5 "Agent restart").
//!
//! Format: `{"version": 1, "pods": [PodRecord...]}`. Every write goes to `pods.json.tmp` (mode
//! 0600), is synced, then renamed over `pods.json`, so a crash leaves the old or the new table,
//! never a torn one. Writes carry a generation number; a write older than the last one is skipped,
//! so concurrent ADD/DEL persist in table order.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::agent::enroll::PodOptions;
use crate::netns::NetnsId;
use crate::zds::WorkloadInfo;

/// File name of the table inside the run dir.
pub const STATE_FILE: &str = "pods.json";
/// Format version written and accepted.
const VERSION: u32 = 1;
/// File mode of the table (it names pods and their netns paths).
const MODE: u32 = 0o600;

/// Errors reading or writing the table.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading, writing, syncing or renaming the file failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was done (`read`, `write`, `rename`, ...).
        op: &'static str,
        /// File or dir.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a table of a known version.
    #[error("parse {path}: {source}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// Encoding the table failed.
    #[error("encode the pod table: {0}")]
    Encode(#[source] serde_json::Error),
    /// The file has a version this binary does not know.
    #[error("{path}: unknown version {version}")]
    Version {
        /// File.
        path: PathBuf,
        /// Version found.
        version: u32,
    },
    /// `restore` was called twice.
    #[error("the pod table is already attached to {0}")]
    AlreadyAttached(PathBuf),
}

/// One enrolled pod as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRecord {
    /// Pod UID (ZDS uid).
    pub uid: String,
    /// Name, namespace and service account (flattened: `name`, `namespace`, `service_account`).
    #[serde(flatten)]
    pub info: WorkloadInfo,
    /// Redirection options the pod's rules were made with (absent in older files: none).
    #[serde(default)]
    pub options: PodOptions,
    /// netns path given by the runtime.
    pub netns: String,
    /// Sandbox id.
    pub container_id: String,
    /// Pod IPs.
    pub ips: Vec<IpAddr>,
    /// Identity of the netns at enrollment; a path that now names another namespace (the sandbox
    /// was replaced while the agent was down) is not restored. Absent in hand-written files.
    #[serde(default)]
    pub netns_id: Option<StoredNetnsId>,
}

/// [`NetnsId`] as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredNetnsId {
    /// `st_ino` of the nsfs file.
    pub inode: u64,
    /// `st_dev` of the nsfs file.
    pub dev: u64,
}

impl From<NetnsId> for StoredNetnsId {
    fn from(id: NetnsId) -> Self {
        StoredNetnsId {
            inode: id.inode,
            dev: id.dev,
        }
    }
}

impl From<StoredNetnsId> for NetnsId {
    fn from(id: StoredNetnsId) -> Self {
        NetnsId {
            inode: id.inode,
            dev: id.dev,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Document {
    version: u32,
    pods: Vec<PodRecord>,
}

/// The table file of one run dir.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    /// Generation of the last write.
    written: Mutex<u64>,
    /// Device and inode of the file the last write put in place (every write is a new file).
    last_file: Mutex<Option<(u64, u64)>>,
}

impl Store {
    /// The store at `<run_dir>/pods.json`.
    pub fn new(run_dir: &Path) -> Store {
        Store {
            path: run_dir.join(STATE_FILE),
            written: Mutex::new(0),
            last_file: Mutex::new(None),
        }
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the table; a missing file is an empty table. Blocking.
    pub fn load(&self) -> Result<Vec<PodRecord>, StoreError> {
        let bytes = match fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(StoreError::Io {
                    op: "read",
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let doc: Document = serde_json::from_slice(&bytes).map_err(|source| StoreError::Parse {
            path: self.path.clone(),
            source,
        })?;
        if doc.version != VERSION {
            return Err(StoreError::Version {
                path: self.path.clone(),
                version: doc.version,
            });
        }
        Ok(doc.pods)
    }

    /// Writes `pods` as generation `generation` (atomic replace, mode 0600); skipped when a newer
    /// generation was already written. Creates the run dir if needed. Blocking.
    pub fn save(&self, generation: u64, pods: Vec<PodRecord>) -> Result<(), StoreError> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if generation <= *written {
            return Ok(());
        }
        let doc = Document {
            version: VERSION,
            pods,
        };
        let bytes = serde_json::to_vec_pretty(&doc).map_err(StoreError::Encode)?;
        let id = self.replace(&bytes)?;
        *written = generation;
        *self.last_file.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
        Ok(())
    }

    /// Whether the file at the path is not the one this store wrote last: another process (a
    /// newer agent) has written the table since. A store that never wrote says whether a file
    /// is there. Blocking (one `lstat`).
    pub fn written_by_another(&self) -> bool {
        let last = *self.last_file.lock().unwrap_or_else(|p| p.into_inner());
        let now = fs::symlink_metadata(&self.path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        now.is_some() && now != last
    }

    /// Writes `bytes` as the new file; returns its device and inode.
    fn replace(&self, bytes: &[u8]) -> Result<(u64, u64), StoreError> {
        let io = |op, path: &Path| {
            let path = path.to_owned();
            move |source| StoreError::Io { op, path, source }
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir).map_err(io("create", dir))?;
        let tmp = self.path.with_extension("json.tmp");
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(MODE)
            .open(&tmp)
            .map_err(io("create", &tmp))?;
        // The mode only applies to a new file; a leftover temp file gets it here.
        f.set_permissions(fs::Permissions::from_mode(MODE))
            .map_err(io("chmod", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        let meta = f.metadata().map_err(io("stat", &tmp))?;
        drop(f);
        // No fsync: the run dir is tmpfs on nodes (/var/run) and the table only has to survive an
        // agent restart, not a reboot (after a reboot the pods' netns are gone anyway). The rename
        // keeps readers from ever seeing a half-written file.
        fs::rename(&tmp, &self.path).map_err(io("rename", &tmp))?;
        Ok((meta.dev(), meta.ino()))
    }
}
