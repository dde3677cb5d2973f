//! Finding a pod's network namespace from procfs, for pods the plugin did not report (pods that
//! predate the agent, agent restarts, label changes): spec §3.6, istio-cni's `podcgroupns_linux.go`.
//!
//! One scan of `<proc root>/<pid>` (default `/proc`; `/host/proc` in a container):
//! 1. the process's `cgroup` names the pod UID (cgroupfs `-` and systemd `_` spellings, cgroup
//!    v1 and v2 lines); processes naming several pods or containers are skipped;
//! 2. its `ns/net` is not the host's (istio#55139): identity ([`NetnsId`]) compared with
//!    `<proc root>/1/ns/net` or a given host identity;
//! 3. per netns the oldest process is kept (`starttime`, field 22 of `stat`; then lowest pid);
//! 4. netns are tried oldest first, opened and VERIFIED by an [`OwnershipCheck`]: an interface
//!    inside carries one of the pod's IPs (a foreign process may be transiting another pod's
//!    netns). The first verified netns wins; other netns of the pod are reported, not opened.
//!    Two verified netns whose owners started at the same tick are [`FindError::Ambiguous`]
//!    rather than a guess.
//!
//! Pods without IPs are deferred ([`FindError::NoPodIps`]): ownership cannot be checked yet. The
//! verification enters the netns ([`InterfaceAddrCheck`], via [`Netns::run`]); tests plug in a
//! fake check and a fake proc tree whose `ns/net` entries are symlinks to files they control.

mod cgroup;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::enroll::PodUid;
use crate::netns::{Netns, NetnsError, NetnsId};
use cgroup::{CgroupPod, UidKey};

/// The host's procfs.
pub const DEFAULT_PROC_ROOT: &str = "/proc";

/// What to look for: a pod's UID and its IPs (status IPs, v4-mapped v6 allowed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodQuery {
    /// `metadata.uid`.
    pub uid: PodUid,
    /// The pod's IPs; one must be on an interface inside the netns.
    pub ips: Vec<IpAddr>,
}

/// Whether the host netns is read from procfs or given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostNetns {
    /// Identity of `<proc root>/1/ns/net`, read at each scan.
    FromProc,
    /// This identity.
    Id(NetnsId),
}

/// Verifies that a netns belongs to a pod: true when an interface inside carries one of `ips`.
pub trait OwnershipCheck: Send + Sync {
    /// The check. Errors reject the candidate (reported in [`FindError::NotVerified`]).
    fn holds_any(&self, netns: &Netns, ips: &[IpAddr]) -> Result<bool, CheckError>;
}

/// The real check: enters the netns ([`Netns::run`]) and lists interface addresses
/// (`getifaddrs(3)`). Needs CAP_SYS_ADMIN.
#[derive(Debug, Clone, Copy, Default)]
pub struct InterfaceAddrCheck;

/// Why an ownership check could not answer.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Entering the netns or listing its addresses failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

/// Scans procfs for pods' netns.
#[derive(Debug, Clone)]
pub struct NetnsFinder<C = InterfaceAddrCheck> {
    proc_root: PathBuf,
    host: HostNetns,
    check: C,
}

/// A process of a pod: its pid, start time and netns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Process id (in the proc root's pid namespace).
    pub pid: u32,
    /// `starttime` (clock ticks since boot).
    pub start_time: u64,
    /// Identity of its netns.
    pub netns: NetnsId,
}

/// A pod's verified netns.
#[derive(Debug)]
pub struct FoundNetns {
    /// The open namespace (opened from `path` before it was verified).
    pub netns: Netns,
    /// `<proc root>/<pid>/ns/net` of the owning process.
    pub path: PathBuf,
    /// The oldest process of the pod in that netns.
    pub owner: Candidate,
    /// The pod's processes in its other netns that were not tried (younger than the owner, or
    /// started with it and not verified): for a warning ("more than one netns for the same pod").
    pub others: Vec<Candidate>,
    /// Older candidates that failed verification (e.g. a foreign process transiting the pod's
    /// cgroup in another pod's netns), oldest first.
    pub rejected: Vec<Rejected>,
}

/// A candidate that was not accepted.
#[derive(Debug)]
pub struct Rejected {
    /// The process.
    pub candidate: Candidate,
    /// Why.
    pub reason: Rejection,
}

/// Why a candidate was not accepted.
#[derive(Debug)]
pub enum Rejection {
    /// Its `ns/net` could not be opened.
    Open(NetnsError),
    /// The opened namespace is not the one scanned (the pid was reused meanwhile).
    Changed {
        /// What was opened.
        opened: NetnsId,
    },
    /// No interface inside carries a pod IP.
    NoPodIp,
    /// The ownership check failed.
    Check(CheckError),
}

/// Errors of a whole scan.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The proc root cannot be listed.
    #[error("list {path}: {source}")]
    ReadProc {
        /// The proc root.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: io::Error,
    },
    /// The host netns identity cannot be read (refusing to scan: the host's netns could be taken
    /// for a pod's).
    #[error("host netns {path}: {source}")]
    HostNetns {
        /// `<proc root>/1/ns/net`.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: io::Error,
    },
}

/// Why a pod's netns was not found.
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    /// The scan itself failed.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// The pod has no IPs yet, so a netns cannot be verified: retry when it has (spec §3.6).
    #[error("pod {uid} has no IPs yet; its netns cannot be verified")]
    NoPodIps {
        /// The pod.
        uid: PodUid,
    },
    /// The UID cannot appear in a cgroup path (not 32 hex digits in 8-4-4-4-12 groups).
    #[error("pod UID {uid:?} cannot be matched against cgroup paths")]
    BadUid {
        /// The pod.
        uid: PodUid,
    },
    /// No process outside the host netns names the pod in its cgroup.
    #[error("no process of pod {uid} outside the host netns ({in_host_netns} in the host netns)")]
    NotFound {
        /// The pod.
        uid: PodUid,
        /// Processes of the pod found in the host netns (a hostNetwork pod has only these).
        in_host_netns: usize,
    },
    /// Processes were found but no netns of theirs holds a pod IP.
    #[error("pod {uid}: no netns of its processes holds one of its IPs ({})", summary(.rejected))]
    NotVerified {
        /// The pod.
        uid: PodUid,
        /// Every candidate tried, oldest first.
        rejected: Vec<Rejected>,
    },
    /// Two verified netns whose owners started at the same tick: which is the pod's cannot be told.
    #[error("pod {uid}: processes {} and {} started together in different verified netns ({} and {})",
        .first.pid, .second.pid, .first.netns, .second.netns)]
    Ambiguous {
        /// The pod.
        uid: PodUid,
        /// One owner.
        first: Candidate,
        /// The other.
        second: Candidate,
    },
}

/// A pod's processes seen during a scan.
#[derive(Default)]
struct Seen {
    /// Oldest candidate per netns.
    by_netns: BTreeMap<NetnsId, Candidate>,
    in_host_netns: usize,
}

// === impl NetnsFinder ===

impl NetnsFinder<InterfaceAddrCheck> {
    /// A finder over `proc_root` (e.g. [`DEFAULT_PROC_ROOT`] or `/host/proc`), host netns read from
    /// `<proc_root>/1/ns/net`, verifying with [`InterfaceAddrCheck`].
    pub fn new(proc_root: impl Into<PathBuf>) -> NetnsFinder<InterfaceAddrCheck> {
        NetnsFinder::with_check(proc_root, HostNetns::FromProc, InterfaceAddrCheck)
    }
}

impl<C: OwnershipCheck> NetnsFinder<C> {
    /// A finder with a given host netns source and ownership check.
    pub fn with_check(proc_root: impl Into<PathBuf>, host: HostNetns, check: C) -> NetnsFinder<C> {
        NetnsFinder {
            proc_root: proc_root.into(),
            host,
            check,
        }
    }

    /// Finds one pod's netns (see the module docs).
    ///
    /// # Errors
    /// See [`FindError`].
    pub fn find(&self, pod: &PodQuery) -> Result<FoundNetns, FindError> {
        let mut all = self.find_all(std::slice::from_ref(pod))?;
        all.remove(&pod.uid).unwrap_or_else(|| {
            Err(FindError::NotFound {
                uid: pod.uid.clone(),
                in_host_netns: 0,
            })
        })
    }

    /// Finds the netns of several pods in one pass over procfs. Every queried UID has an entry.
    ///
    /// # Errors
    /// [`ScanError`] when procfs or the host netns cannot be read; per-pod outcomes otherwise.
    pub fn find_all(
        &self,
        pods: &[PodQuery],
    ) -> Result<BTreeMap<PodUid, Result<FoundNetns, FindError>>, ScanError> {
        let mut out = BTreeMap::new();
        let mut wanted: BTreeMap<UidKey, &PodQuery> = BTreeMap::new();
        for pod in pods {
            if pod.ips.is_empty() {
                out.insert(
                    pod.uid.clone(),
                    Err(FindError::NoPodIps {
                        uid: pod.uid.clone(),
                    }),
                );
            } else if let Some(key) = UidKey::of_uid(pod.uid.as_str()) {
                wanted.insert(key, pod);
            } else {
                out.insert(
                    pod.uid.clone(),
                    Err(FindError::BadUid {
                        uid: pod.uid.clone(),
                    }),
                );
            }
        }
        if wanted.is_empty() {
            return Ok(out);
        }
        let host = self.host_id()?;
        let mut seen: BTreeMap<UidKey, Seen> = BTreeMap::new();
        let entries = std::fs::read_dir(&self.proc_root).map_err(|source| ScanError::ReadProc {
            path: self.proc_root.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Some((key, candidate)) = self.examine(pid, &wanted) else {
                continue;
            };
            let s = seen.entry(key).or_default();
            if candidate.netns == host {
                s.in_host_netns += 1;
                continue;
            }
            let slot = s.by_netns.entry(candidate.netns).or_insert(candidate);
            if age(&candidate) < age(slot) {
                *slot = candidate;
            }
        }
        for (key, pod) in wanted {
            let result = self.choose(pod, seen.remove(&key).unwrap_or_default());
            out.insert(pod.uid.clone(), result);
        }
        Ok(out)
    }

    fn host_id(&self) -> Result<NetnsId, ScanError> {
        match self.host {
            HostNetns::Id(id) => Ok(id),
            HostNetns::FromProc => {
                let path = self.proc_root.join("1/ns/net");
                stat_id(&path).map_err(|source| ScanError::HostNetns { path, source })
            }
        }
    }

    /// The candidate of process `pid` if its cgroup names a wanted pod. Unreadable entries are
    /// skipped: processes come and go during a scan.
    fn examine(
        &self,
        pid: u32,
        wanted: &BTreeMap<UidKey, &PodQuery>,
    ) -> Option<(UidKey, Candidate)> {
        let dir = self.proc_root.join(pid.to_string());
        let cgroup = std::fs::read_to_string(dir.join("cgroup")).ok()?;
        let CgroupPod::Pod(key) = cgroup::pod_of(&cgroup) else {
            return None;
        };
        if !wanted.contains_key(&key) {
            return None;
        }
        let netns = stat_id(&dir.join("ns/net")).ok()?;
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        let start_time = start_time_of(&stat)?;
        Some((
            key,
            Candidate {
                pid,
                start_time,
                netns,
            },
        ))
    }

    /// Verifies the pod's netns oldest first; the first verified one wins.
    fn choose(&self, pod: &PodQuery, seen: Seen) -> Result<FoundNetns, FindError> {
        let mut candidates: Vec<Candidate> = seen.by_netns.into_values().collect();
        candidates.sort_by_key(age);
        if candidates.is_empty() {
            return Err(FindError::NotFound {
                uid: pod.uid.clone(),
                in_host_netns: seen.in_host_netns,
            });
        }
        let mut rejected = Vec::new();
        let mut winner: Option<(FoundNetns, usize)> = None;
        for (i, c) in candidates.iter().enumerate() {
            if let Some((found, _)) = &winner
                && c.start_time != found.owner.start_time
            {
                break;
            }
            match self.verify(c, &pod.ips) {
                Ok((netns, path)) => {
                    if let Some((found, _)) = winner {
                        return Err(FindError::Ambiguous {
                            uid: pod.uid.clone(),
                            first: found.owner,
                            second: *c,
                        });
                    }
                    let found = FoundNetns {
                        netns,
                        path,
                        owner: *c,
                        others: Vec::new(),
                        rejected: std::mem::take(&mut rejected),
                    };
                    winner = Some((found, i));
                }
                Err(reason) => rejected.push(Rejected {
                    candidate: *c,
                    reason,
                }),
            }
        }
        match winner {
            Some((mut found, i)) => {
                found.others = candidates[i + 1..].to_vec();
                Ok(found)
            }
            None => Err(FindError::NotVerified {
                uid: pod.uid.clone(),
                rejected,
            }),
        }
    }

    fn verify(&self, c: &Candidate, ips: &[IpAddr]) -> Result<(Netns, PathBuf), Rejection> {
        let path = self.proc_root.join(c.pid.to_string()).join("ns/net");
        let netns = Netns::open(&path).map_err(Rejection::Open)?;
        if netns.id() != c.netns {
            return Err(Rejection::Changed { opened: netns.id() });
        }
        match self.check.holds_any(&netns, ips) {
            Ok(true) => Ok((netns, path)),
            Ok(false) => Err(Rejection::NoPodIp),
            Err(e) => Err(Rejection::Check(e)),
        }
    }
}

/// Oldest first: start time, then pid.
fn age(c: &Candidate) -> (u64, u32) {
    (c.start_time, c.pid)
}

fn stat_id(path: &Path) -> io::Result<NetnsId> {
    let meta = std::fs::metadata(path)?;
    Ok(NetnsId {
        inode: meta.ino(),
        dev: meta.dev(),
    })
}

/// `starttime` from a `/proc/<pid>/stat` line: field 22, counted after the `(comm)` field, which
/// may itself contain spaces and parentheses.
fn start_time_of(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// True when an address in `found` equals one of `wanted`, v4-mapped v6 addresses compared as v4.
pub fn holds_any_ip(found: &[IpAddr], wanted: &[IpAddr]) -> bool {
    found
        .iter()
        .any(|f| wanted.iter().any(|w| f.to_canonical() == w.to_canonical()))
}

fn summary(rejected: &[Rejected]) -> String {
    rejected
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

// === impl InterfaceAddrCheck ===

impl OwnershipCheck for InterfaceAddrCheck {
    fn holds_any(&self, netns: &Netns, ips: &[IpAddr]) -> Result<bool, CheckError> {
        let found = netns.interface_addrs()?;
        Ok(holds_any_ip(&found, ips))
    }
}

impl<F> OwnershipCheck for F
where
    F: Fn(&Netns, &[IpAddr]) -> Result<bool, CheckError> + Send + Sync,
{
    fn holds_any(&self, netns: &Netns, ips: &[IpAddr]) -> Result<bool, CheckError> {
        self(netns, ips)
    }
}

// === impl Rejected ===

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.candidate;
        write!(f, "pid {} in netns {}: ", c.pid, c.netns)?;
        match &self.reason {
            Rejection::Open(e) => write!(f, "{e}"),
            Rejection::Changed { opened } => write!(f, "process replaced (now netns {opened})"),
            Rejection::NoPodIp => f.write_str("no interface holds a pod IP"),
            Rejection::Check(e) => write!(f, "ownership check failed: {e}"),
        }
    }
}
