//! The bench's lab: checks before it, the node with its two pairs of pods, the extra enrolled pods
//! (with their CNI ADD times), and the optional hold before measuring.

use std::io::Write;
use std::net::IpAddr;
use std::process::Command;

use anyhow::Context;

use super::measure::settle_rss;
use super::options::{BenchOptions, Section};
use crate::lab::mesh_lab::{MeshLab, MeshSpec, MeshStage};
use crate::lab::node::{LabError, LabOptions, Pod};

const SUBNET: &str = "10.250.0.0/16";

/// The address host-local gives the `index`-th pod of the lab.
fn pod_ip(index: usize) -> IpAddr {
    // host-local hands out addresses in order from .2 (gateway .1).
    let n = index + 2;
    IpAddr::from([10, 250, (n / 256) as u8, (n % 256) as u8])
}

/// Removes its directory when dropped (a section's own lab dir, also on failure).
pub(super) struct RemoveOnDrop(pub(super) std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Held for a whole run: an exclusive lock on `<tmp>/ztnode-lab-<prefix>.lock`, so a second bench
/// with the same `--lab-prefix` stops at once instead of deleting the first one's namespaces. The
/// file is removed when the lock is dropped.
pub(super) struct PrefixLock {
    path: std::path::PathBuf,
    _held: nix::fcntl::Flock<std::fs::File>,
}

impl Drop for PrefixLock {
    fn drop(&mut self) {
        // before the lock goes (with `_held`), so no other run can have taken it on this file
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Takes the [`PrefixLock`] of `prefix`.
fn lock_prefix(prefix: &str) -> anyhow::Result<PrefixLock> {
    let path = std::env::temp_dir().join(format!("ztnode-lab-{prefix}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(held) => Ok(PrefixLock { path, _held: held }),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => anyhow::bail!(
            "another bench with --lab-prefix {prefix} is running (it holds {}); pick another prefix",
            path.display()
        ),
        Err((_, e)) => Err(anyhow::anyhow!("lock {}: {e}", path.display())),
    }
}

/// Checks that the run can start (root, `--pods`, `--lab-prefix`), takes the prefix's
/// [`PrefixLock`], raises the open-file limit and deletes the namespaces an interrupted earlier run
/// with the same prefix may have left.
pub(super) fn preflight(opts: &BenchOptions) -> anyhow::Result<PrefixLock> {
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the benchmark builds network namespaces: run it as root"
    );
    anyhow::ensure!(opts.pods >= 2, "--pods must be at least 2");
    crate::runtime::raise_nofile_limit();
    let prefix = opts.lab_prefix.as_str();
    // Short (interface names like `<prefix>-k-br` have 15 characters at most) and without `-`,
    // so the leftover cleanup below (`<prefix>-*`, which holds the kube and xds labs'
    // `<prefix>-k-*` and `<prefix>-x-*`) cannot match another prefix's names.
    anyhow::ensure!(
        (1..=8).contains(&prefix.len())
            && prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
        "--lab-prefix must be 1 to 8 characters of a-z and 0-9, not {prefix:?}"
    );
    let lock = lock_prefix(prefix)?;
    // What an earlier run killed before it could clean up (SIGKILL, power loss) may have left.
    remove_leftovers(prefix);
    cleanup_on_signal(prefix.to_owned());
    Ok(lock)
}

/// The network namespaces named `<prefix>-*` (`ip netns list`).
fn lab_namespaces(prefix: &str) -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    let own = format!("{prefix}-");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| name.starts_with(&own))
        .map(str::to_owned)
        .collect()
}

/// Stops every process inside the lab's namespaces (SIGKILL: the node, agent and proxies, iperf3
/// and echo servers, clients), then deletes the namespaces. Deleting a namespace alone only
/// unmounts its name: the processes in it would run on, holding it.
fn remove_leftovers(prefix: &str) {
    for name in lab_namespaces(prefix) {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
    }
}

/// Set once a signal handler started stopping the run; see [`stopping`].
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a signal is stopping the run: the main thread must then leave the exit to the handler
/// (its measurement fails as the handler kills the lab; returning would exit with 1 before the
/// cleanup ends).
pub(super) fn stopping() -> bool {
    STOPPING.load(std::sync::atomic::Ordering::SeqCst)
}

/// Whether `signal`'s disposition is "ignore" (`nohup` ignores SIGHUP; a shell's `cmd &` without
/// job control ignores SIGINT): such a run is meant to survive that signal, so it keeps ignoring it.
/// Read from the `SigIgn` mask of `/proc/self/status` (hex, bit `signal - 1`; proc(5)).
fn ignored(signal: i32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| sig_ignored(&status, signal))
        .unwrap_or(false)
}

fn sig_ignored(status: &str, signal: i32) -> Option<bool> {
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:"))?;
    let mask = u64::from_str_radix(mask.trim(), 16).ok()?;
    let bit = u32::try_from(signal.checked_sub(1)?).ok()?;
    Some(bit < 64 && mask & (1 << bit) != 0)
}

/// Until the process exits, a SIGINT, SIGTERM or SIGHUP (those not ignored when the bench started)
/// ends the run cleanly instead of leaving the lab behind: [`stopping`] turns true, the processes
/// in the lab's namespaces (main, `-k` and `-x` labs) and the bench's own children are killed, the
/// namespaces, the lab dirs and the prefix lock file removed, and the bench exits with 128 + the
/// signal's number, as a shell reports a process killed by it. Returns once the handlers are in
/// place; a failure to install them is printed (the run goes on without them).
fn cleanup_on_signal(prefix: String) {
    use tokio::signal::unix::{SignalKind, signal};
    let kinds: Vec<SignalKind> = [
        SignalKind::interrupt(),
        SignalKind::terminate(),
        SignalKind::hangup(),
    ]
    .into_iter()
    .filter(|k| !ignored(k.as_raw_value()))
    .collect();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    let spawned = std::thread::Builder::new()
        .name("bench-signals".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let signo = rt.block_on(async {
                let mut streams = Vec::new();
                for kind in kinds {
                    match signal(kind) {
                        Ok(s) => streams.push((kind.as_raw_value(), s)),
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return None;
                        }
                    }
                }
                let _ = ready_tx.send(Ok(()));
                let waits = streams.iter_mut().map(|(signo, s)| {
                    let signo = *signo;
                    Box::pin(async move {
                        s.recv().await;
                        signo
                    })
                });
                Some(futures::future::select_all(waits).await.0)
            });
            let Some(signo) = signo else { return };
            STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
            // not `eprintln!`: with stderr closed (a reader that went away) it would panic here
            let _ = writeln!(
                std::io::stderr(),
                "bench: signal {signo}: stopping the lab {prefix}"
            );
            kill_children();
            remove_leftovers(&prefix);
            remove_lab_dirs(&prefix);
            std::process::exit(128 + signo);
        });
    let installed = match spawned {
        Ok(_) => ready_rx
            .recv()
            .unwrap_or_else(|_| Err("the handler thread ended".into())),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = installed {
        eprintln!("bench: no signal handler ({e}): an interrupted run leaves its lab behind");
    }
}

/// Removes the run's dirs in the temp dir: `ztnode-lab-<prefix>` and its lock file, and the
/// `ztnode-lab-<prefix>-*` and `ztnode-bench-<prefix>-*` dirs of the kube and xds labs.
fn remove_lab_dirs(prefix: &str) {
    let tmp = std::env::temp_dir();
    let main = format!("ztnode-lab-{prefix}");
    let _ = std::fs::remove_dir_all(tmp.join(&main));
    let _ = std::fs::remove_file(tmp.join(format!("{main}.lock")));
    let subs = [format!("{main}-"), format!("ztnode-bench-{prefix}-")];
    let Ok(dir) = std::fs::read_dir(&tmp) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if subs.iter().any(|s| name.starts_with(s.as_str())) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// SIGKILL to this process's children (those outside the lab's namespaces: the CNI plugin runs,
/// a fake API server or istiod).
fn kill_children() {
    let me = std::process::id();
    for (pid, stat) in super::busy::read_procs() {
        if stat.ppid == me
            && let Ok(pid) = i32::try_from(pid)
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// The lab node running a `ztnode node`, with the pods measured on: `[d-client, d-server,
/// m-client, m-server]`, the `d-` pair outside the mesh, the `m-` pair enrolled.
pub(super) struct Bed {
    /// The node process, the lab and the four pods.
    pub(super) mesh: MeshLab<4>,
    /// The enrolled pods [`enroll`] adds (`p002`, ...) and their IPs, in the node's config from the
    /// start.
    extra: Vec<(String, IpAddr)>,
}

impl Bed {
    /// Process id of the node.
    pub(super) fn pid(&self) -> u32 {
        self.mesh.node.0.id()
    }

    /// `[d-client, d-server, m-client, m-server]`.
    pub(super) fn pods(&self) -> &[Pod; 4] {
        &self.mesh.pods
    }
}

/// Builds the lab, starts the node (`RUST_LOG` from `ZTNODE_BENCH_LOG`, default `warn`) with every
/// enrolled pod of the run in its config, and adds the four measured pods.
pub(super) fn start(opts: &BenchOptions) -> anyhow::Result<Bed> {
    let prefix = opts.lab_prefix.as_str();
    let exe = std::env::current_exe()?;
    // pods in allocation order: d-client, d-server, m-client, m-server, p002..
    let extra: Vec<(String, IpAddr)> = (2..opts.pods)
        .map(|i| (format!("p{i:03}"), pod_ip(i + 2)))
        .collect();
    let mut workloads = vec![
        ("m-client", "bench", "m-client", pod_ip(2)),
        ("m-server", "bench", "m-server", pod_ip(3)),
    ];
    workloads.extend(
        extra
            .iter()
            .map(|(n, ip)| (n.as_str(), "bench", n.as_str(), *ip)),
    );
    let level = std::env::var("ZTNODE_BENCH_LOG").unwrap_or_else(|_| "warn".into());
    let spec = MeshSpec {
        lab: LabOptions {
            prefix: prefix.into(),
            ztnode_binary: Some(exe.clone()),
            run_dir: std::env::temp_dir()
                .join(format!("ztnode-lab-{prefix}"))
                .join("run"),
            subnet: SUBNET.into(),
            cni_version: "1.0.0".into(),
        },
        exe: &exe,
        workloads: &workloads,
        extra_config: "",
        log_level: &level,
        node_args: &["--no-install".into()],
        node_env: &[],
        pods: ["d-client", "d-server", "m-client", "m-server"].map(|name| (name, "bench")),
    };
    let mesh = MeshLab::start_observed(spec, |stage| {
        if let MeshStage::NodeStarted { pid, .. } = stage {
            eprintln!("bench: node up (pid {pid}); adding pods");
        }
        Ok::<(), LabError>(())
    })?;
    let [_, _, m_client, m_server] = &mesh.pods;
    anyhow::ensure!(
        m_client.ip == pod_ip(2) && m_server.ip == pod_ip(3),
        "unexpected pod IPs"
    );
    Ok(Bed { mesh, extra })
}

/// What [`enroll`] measured: the node's RSS and the CNI ADD exec times (sorted, ms).
pub(super) struct Enrolled {
    /// RSS with the first two enrolled pods, KiB.
    pub(super) rss_2: u64,
    /// RSS with all `--pods` enrolled pods (the first two when neither the memory nor the CNI
    /// section runs), KiB.
    pub(super) rss_n: u64,
    /// Exec time of `ztnode-cni` in each extra pod's ADD.
    pub(super) plugin_ms: Vec<f64>,
    /// Exec time of the whole chain in each extra pod's ADD.
    pub(super) chain_ms: Vec<f64>,
}

/// Reads the node's RSS, adds the extra enrolled pods when the memory or the CNI section runs
/// (timing each ADD), and reads the RSS again.
pub(super) fn enroll(bed: &Bed, opts: &BenchOptions) -> anyhow::Result<Enrolled> {
    let rss_2 = settle_rss(bed.pid())?;
    let extra_pods = opts.wants(Section::Memory) || opts.wants(Section::Cni);
    let mut plugin_ms = Vec::new();
    let mut chain_ms = Vec::new();
    for (name, _) in bed.extra.iter().filter(|_| extra_pods) {
        let pod = bed.mesh.lab.add_pod(name, "bench")?;
        for (plugin, d) in &pod.add_timings {
            if plugin == "ztnode-cni" {
                plugin_ms.push(d.as_secs_f64() * 1e3);
            }
        }
        chain_ms.push(
            pod.add_timings
                .iter()
                .map(|(_, d)| d.as_secs_f64() * 1e3)
                .sum::<f64>(),
        );
    }
    plugin_ms.sort_by(f64::total_cmp);
    chain_ms.sort_by(f64::total_cmp);
    let rss_n = settle_rss(bed.pid())?;
    eprintln!("bench: {} pods enrolled; measuring", opts.pods);
    Ok(Enrolled {
        rss_2,
        rss_n,
        plugin_ms,
        chain_ms,
    })
}

/// Keeps the lab up for `--hold` before measuring, naming the node and the pods.
pub(super) fn hold(bed: &Bed, opts: &BenchOptions) {
    if opts.hold.is_zero() {
        return;
    }
    let [d_client, d_server, m_client, m_server] = bed.pods();
    eprintln!(
        "bench: holding {:?}: node pid {}, pods {} {} (mesh) and {} {} (direct)",
        opts.hold,
        bed.pid(),
        m_client.netns_name,
        m_server.netns_name,
        d_client.netns_name,
        d_server.netns_name
    );
    std::thread::sleep(opts.hold);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ignored_signal_is_read_from_the_sigign_mask() {
        // SIGHUP (1) and SIGINT (2) ignored, as under `nohup` in a non-interactive `cmd &`
        let status = "Name:\tztnode\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000003\n";
        assert_eq!(sig_ignored(status, 1), Some(true));
        assert_eq!(sig_ignored(status, 2), Some(true));
        assert_eq!(sig_ignored(status, 15), Some(false));
        assert_eq!(sig_ignored("Name:\tx\n", 1), None);
        // our own process: SIGTERM is not ignored by the test harness
        assert!(!ignored(15));
    }

    #[test]
    fn a_second_run_with_the_same_prefix_is_refused_until_the_first_ends() {
        let prefix = format!("lk{}", std::process::id() % 100_000);
        let first = lock_prefix(&prefix).expect("first lock");
        let err = lock_prefix(&prefix).err().expect("second lock refused");
        assert!(err.to_string().contains("another bench"), "{err}");
        let path = first.path.clone();
        drop(first);
        assert!(!path.exists(), "the lock file is removed");
        drop(lock_prefix(&prefix).expect("free again"));
    }
}
