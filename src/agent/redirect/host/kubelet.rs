//! Finding the kubelet's UID for the host probe rule's `skuid` match (spec §4.7): istio-cni scans
//! the host's procfs (`/host/proc` in its pod) for the process hosting the kubelet and takes its
//! real UID, because nft has no `--socket-exists` and the probes are told apart by socket owner.
//!
//! A process hosts the kubelet when its `comm` is
//! - `kubelet` (plain Kubernetes) or `kubelite` (MicroK8s) and some argv element contains
//!   "kubelet" (case-insensitive), or
//! - `k3s` (kubelet embedded in `k3s server` / `k3s agent`, no kubelet in argv).
//!
//! With several candidates the lowest PID wins (procfs order, as istio-cni). Processes that vanish
//! or cannot be read while scanning are skipped.

use std::path::{Path, PathBuf};

/// The procfs root of a process running in the host's PID namespace (istio-cni mounts the host's
/// as `/host/proc`).
pub const DEFAULT_PROC_ROOT: &str = "/proc";

/// `comm` values of kubelet-hosting processes and whether argv must mention "kubelet".
const KUBELET_PROCESSES: [(&str, bool); 3] =
    [("kubelet", true), ("kubelite", true), ("k3s", false)];

/// Why no kubelet UID could be determined.
#[derive(Debug, thiserror::Error)]
pub enum KubeletUidError {
    /// The procfs root could not be listed.
    #[error("list processes in {}: {source}", path.display())]
    ReadProc {
        /// The procfs root.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// No process looks like a kubelet: host probe rules cannot be created (istio-cni fails its
    /// startup the same way).
    #[error(
        "no kubelet process (comm kubelet or kubelite with \"kubelet\" in argv, or k3s) in {}; \
         set the kubelet UID explicitly if the kubelet runs elsewhere",
        path.display()
    )]
    NotFound {
        /// The procfs root scanned.
        path: PathBuf,
    },
}

/// The real UID of the kubelet-hosting process found under `proc_root` (a procfs mount, normally
/// [`DEFAULT_PROC_ROOT`]). Blocking (reads procfs).
pub fn find_kubelet_uid(proc_root: &Path) -> Result<u32, KubeletUidError> {
    let dir = std::fs::read_dir(proc_root).map_err(|source| KubeletUidError::ReadProc {
        path: proc_root.to_owned(),
        source,
    })?;
    let mut pids: Vec<u32> = dir
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.into_iter()
        .find_map(|pid| kubelet_uid_of(&proc_root.join(pid.to_string())))
        .ok_or_else(|| KubeletUidError::NotFound {
            path: proc_root.to_owned(),
        })
}

/// `configured` when set (configuration or tests naming the UID), else [`find_kubelet_uid`] in
/// `proc_root`.
pub fn resolve_kubelet_uid(
    configured: Option<u32>,
    proc_root: &Path,
) -> Result<u32, KubeletUidError> {
    match configured {
        Some(uid) => Ok(uid),
        None => find_kubelet_uid(proc_root),
    }
}

/// The real UID of process dir `dir` if it hosts the kubelet; `None` otherwise or when unreadable.
fn kubelet_uid_of(dir: &Path) -> Option<u32> {
    let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
    let comm = comm.trim_end_matches('\n');
    let (_, need_argv) = KUBELET_PROCESSES.iter().find(|(name, _)| *name == comm)?;
    if *need_argv {
        let cmdline = std::fs::read(dir.join("cmdline")).ok()?;
        let mentions = cmdline.split(|b| *b == 0).any(|arg| {
            String::from_utf8_lossy(arg)
                .to_lowercase()
                .contains("kubelet")
        });
        if !mentions {
            return None;
        }
    }
    real_uid(&std::fs::read_to_string(dir.join("status")).ok()?)
}

/// The real UID: first field of the `Uid:` line of `/proc/<pid>/status`.
fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a fake `/proc/<pid>` with `comm`, NUL-separated `argv` and a status with `uid`.
    fn proc_entry(root: &Path, pid: u32, comm: &str, argv: &[&str], uid: u32) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("comm"), format!("{comm}\n")).expect("comm");
        let mut cmdline = argv.join("\0");
        cmdline.push('\0');
        std::fs::write(dir.join("cmdline"), cmdline).expect("cmdline");
        let status = format!(
            "Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t{uid}\t{e}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n",
            e = uid + 1
        );
        std::fs::write(dir.join("status"), status).expect("status");
    }

    fn fake_proc() -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("tempdir");
        proc_entry(root.path(), 1, "systemd", &["/sbin/init"], 0);
        proc_entry(root.path(), 50, "containerd", &["/usr/bin/containerd"], 0);
        // Non-process entries of a real procfs.
        std::fs::create_dir_all(root.path().join("sys")).expect("mkdir");
        std::fs::write(root.path().join("uptime"), "1.0 1.0\n").expect("file");
        root
    }

    fn found(root: &tempfile::TempDir) -> Result<u32, KubeletUidError> {
        find_kubelet_uid(root.path())
    }

    #[test]
    fn kubelet_is_found_with_its_real_uid() {
        let root = fake_proc();
        proc_entry(
            root.path(),
            700,
            "kubelet",
            &["/usr/bin/kubelet", "--config=/var/lib/kubelet/config.yaml"],
            1000,
        );
        assert_eq!(found(&root).expect("uid"), 1000, "real, not effective uid");
    }

    #[test]
    fn kubelite_needs_kubelet_in_argv() {
        let root = fake_proc();
        proc_entry(root.path(), 600, "kubelite", &["/snap/bin/kubelite"], 3000);
        assert!(matches!(
            found(&root),
            Err(KubeletUidError::NotFound { .. })
        ));
        proc_entry(
            root.path(),
            601,
            "kubelite",
            &[
                "/snap/microk8s/current/kubelite",
                "--kubelet-args-file=/x/KUBELET",
            ],
            3001,
        );
        assert_eq!(found(&root).expect("uid"), 3001);
    }

    #[test]
    fn plain_kubelet_comm_without_kubelet_argv_is_not_one() {
        let root = fake_proc();
        proc_entry(root.path(), 700, "kubelet", &["/opt/other"], 5);
        assert!(matches!(
            found(&root),
            Err(KubeletUidError::NotFound { .. })
        ));
    }

    #[test]
    fn k3s_is_found_without_kubelet_in_argv() {
        let root = fake_proc();
        proc_entry(root.path(), 900, "k3s", &["/usr/local/bin/k3s", "agent"], 0);
        assert_eq!(found(&root).expect("uid"), 0);
    }

    #[test]
    fn no_kubelet_is_a_clear_error() {
        let root = fake_proc();
        proc_entry(
            root.path(),
            700,
            "kubectl",
            &["kubectl", "get", "kubelet"],
            1000,
        );
        let err = found(&root).expect_err("none");
        assert!(matches!(err, KubeletUidError::NotFound { .. }));
        assert!(err.to_string().contains("no kubelet process"), "{err}");
    }

    #[test]
    fn lowest_pid_wins_among_several() {
        let root = fake_proc();
        proc_entry(root.path(), 1200, "kubelet", &["/usr/bin/kubelet"], 12);
        proc_entry(root.path(), 900, "k3s", &["k3s", "server"], 9);
        proc_entry(root.path(), 80, "kubelet", &["kubelet"], 8);
        assert_eq!(found(&root).expect("uid"), 8);
    }

    #[test]
    fn unreadable_candidates_are_skipped() {
        let root = fake_proc();
        let half = root.path().join("300");
        std::fs::create_dir_all(&half).expect("mkdir");
        std::fs::write(half.join("comm"), "kubelet\n").expect("comm");
        std::fs::write(half.join("cmdline"), "kubelet\0").expect("cmdline");
        proc_entry(root.path(), 400, "kubelet", &["kubelet"], 77);
        assert_eq!(found(&root).expect("uid"), 77, "pid 300 has no status");
    }

    #[test]
    fn missing_proc_root_is_an_error() {
        let err = find_kubelet_uid(Path::new("/nonexistent/proc")).expect_err("missing");
        assert!(matches!(err, KubeletUidError::ReadProc { .. }), "{err}");
    }

    #[test]
    fn configured_uid_overrides_the_scan() {
        let root = fake_proc();
        assert_eq!(
            resolve_kubelet_uid(Some(4242), root.path()).expect("uid"),
            4242
        );
        assert!(resolve_kubelet_uid(None, root.path()).is_err());
    }

    #[test]
    fn this_machines_proc_parses() {
        // The real procfs: our own status has a Uid line (whether a kubelet runs here varies).
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        assert_eq!(real_uid(&status), Some(nix::unistd::getuid().as_raw()));
    }
}
