//! The pod table on disk: `<run_dir>/pods.json`, so an agent restart does not strand enrolled pods
//! (istio-cni rebuilds the same knowledge from its informer snapshot, `../shared/spec/istio-cni.md`
//! §3.2, §5 "Agent restart").
//!
//! Format: `{"version": 1, "pods": [PodRecord...]}`. Every write goes to `pods.json.tmp` (mode
//! 0600), then is renamed over `pods.json`, so a crash leaves the old or the new table, never a
//! torn one; a write that fails (disk full) removes its temp file and leaves the old table. Writes
//! carry a generation number; a write older than the last one is skipped, so concurrent ADD/DEL
//! persist in table order. A table torn anyway (a copy cut short, a file system without atomic
//! rename) is read by [`Store::recover`]: the complete records are kept, the file is copied aside
//! as `pods.json.torn`.

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

/// What [`Store::recover`] read.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The records read: all of them, or those complete before the damage.
    pub pods: Vec<PodRecord>,
    /// Set when the file did not parse: why, and where the original was kept.
    pub damage: Option<Damage>,
}

/// A table file that did not parse as a whole.
#[derive(Debug)]
pub struct Damage {
    /// The parse error of the whole file.
    pub error: StoreError,
    /// Where the file was copied (`pods.json.torn`), or `None` when it could not be copied.
    pub kept: Option<PathBuf>,
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

    /// Reads the table like [`Store::load`], but a file that does not parse is not lost: it is
    /// copied to `pods.json.torn` (replacing an older one) and the records complete before the
    /// damage are returned with it ([`Damage`]); the next [`Store::save`] replaces the file. Errors: [`StoreError::Io`] when the file cannot be
    /// read, [`StoreError::Version`] for a whole file of another version. Blocking.
    pub fn recover(&self) -> Result<Recovered, StoreError> {
        match self.load() {
            Ok(pods) => Ok(Recovered { pods, damage: None }),
            Err(error @ StoreError::Parse { .. }) => {
                let bytes = fs::read(&self.path).unwrap_or_default();
                let pods = salvage(&bytes);
                // a copy: the torn file stays in place until a whole table replaces it, so a
                // failed write now (disk full) loses nothing for the next start either
                let torn = self.path.with_extension("json.torn");
                let kept = fs::copy(&self.path, &torn).ok().map(|_| torn);
                Ok(Recovered {
                    pods,
                    damage: Some(Damage { error, kept }),
                })
            }
            Err(e) => Err(e),
        }
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
        let written = f
            .set_permissions(fs::Permissions::from_mode(MODE))
            .map_err(io("chmod", &tmp))
            .and_then(|()| {
                f.write_all(bytes)
                    .and_then(|()| f.metadata())
                    .map_err(io("write", &tmp))
            });
        drop(f);
        // Disk full: a partial temp file would only hold the space.
        let meta = written.inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })?;
        // No fsync: the run dir is tmpfs on nodes (/var/run) and the table only has to survive an
        // agent restart, not a reboot (after a reboot the pods' netns are gone anyway). The rename
        // keeps readers from ever seeing a half-written file.
        fs::rename(&tmp, &self.path)
            .map_err(io("rename", &tmp))
            .inspect_err(|_| {
                let _ = fs::remove_file(&tmp);
            })?;
        Ok((meta.dev(), meta.ino()))
    }
}

/// The records of a table file cut short: every `PodRecord` complete before the damage, when the
/// file starts as this version writes it (`{"version": 1, "pods": [`). Empty otherwise.
fn salvage(bytes: &[u8]) -> Vec<PodRecord> {
    let mut pods = Vec::new();
    let Some(at) = find(bytes, b"\"pods\"") else {
        return pods;
    };
    if !version_is_current(&bytes[..at]) {
        return pods;
    }
    let mut rest = skip_ws(&bytes[at + b"\"pods\"".len()..]);
    for token in [b':', b'['] {
        match rest.split_first() {
            Some((c, tail)) if *c == token => rest = skip_ws(tail),
            _ => return pods,
        }
    }
    loop {
        rest = skip_ws(rest);
        if let Some((b',', tail)) = rest.split_first() {
            rest = tail;
            continue;
        }
        let mut records = serde_json::Deserializer::from_slice(rest).into_iter::<PodRecord>();
        match records.next() {
            Some(Ok(rec)) => {
                let used = records.byte_offset();
                pods.push(rec);
                rest = &rest[used..];
            }
            _ => return pods,
        }
    }
}

/// Whether `head` (the file before `"pods"`) is `{ "version": <VERSION>,` with any spacing.
fn version_is_current(head: &[u8]) -> bool {
    let Some(at) = find(head, b"\"version\"") else {
        return false;
    };
    let rest = skip_ws(&head[at + b"\"version\"".len()..]);
    let Some((b':', rest)) = rest.split_first() else {
        return false;
    };
    let rest = skip_ws(rest);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits])
        .ok()
        .and_then(|d| d.parse::<u32>().ok())
        == Some(VERSION)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn skip_ws(bytes: &[u8]) -> &[u8] {
    let n = bytes.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &bytes[n..]
}
