//! Where the bench's latency measurement runs: all threads on one CPU ([`OneCpu`]) or both CPUs
//! with idle CPUs polling ([`PollingIdle`]), besides wherever the scheduler puts them.

use std::io::Write;

use anyhow::Context;

/// Where the latency measurement runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placement {
    /// Wherever the scheduler puts the threads (both CPUs).
    Free,
    /// The node, the client and the echo server all on one CPU ([`OneCpu`]).
    OneCpu,
    /// Both CPUs, with idle CPUs polling instead of halting ([`PollingIdle`]).
    PollingIdle,
}

impl Placement {
    /// Row suffix and JSON key infix.
    pub(super) fn label(self) -> (&'static str, &'static str) {
        match self {
            Placement::Free => ("", ""),
            Placement::OneCpu => (", one CPU", "_one_cpu"),
            Placement::PollingIdle => (", idle CPUs polling", "_polling_idle"),
        }
    }
}

/// The PM QoS CPU latency device (kernel `Documentation/power/pm_qos_interface.rst`).
const CPU_DMA_LATENCY: &str = "/dev/cpu_dma_latency";
/// Name of the first idle state; "POLL" when the cpuidle driver has a polling state.
const IDLE_STATE0: &str = "/sys/devices/system/cpu/cpu0/cpuidle/state0/name";

/// Holds a PM QoS CPU latency request of 0 µs ([`CPU_DMA_LATENCY`]) until dropped: the cpuidle
/// governor then keeps idle CPUs in their polling state instead of halting, so a wake-up on another
/// CPU costs no halt exit. This shows how much of the two-CPU round trip is the machine's wake-up
/// cost rather than the proxy's work. The request is system-wide (idle CPUs spin, which costs the
/// host CPU time, and another benchmark running at the same time is measured under it too) and ends
/// when the file is closed, also when the process dies. Needs root.
pub(super) struct PollingIdle {
    _request: std::fs::File,
}

impl PollingIdle {
    /// Whether [`PollingIdle::hold`] can work here: the cpuidle driver has a polling first state
    /// and the device opens for writing (opening alone sets no constraint).
    pub(super) fn check() -> anyhow::Result<()> {
        let state0 = std::fs::read_to_string(IDLE_STATE0)
            .with_context(|| format!("reading {IDLE_STATE0}"))?;
        anyhow::ensure!(
            state0.trim() == "POLL",
            "the first idle state is {:?}, not POLL",
            state0.trim()
        );
        Self::open().map(drop)
    }

    /// Starts the request.
    pub(super) fn hold() -> anyhow::Result<PollingIdle> {
        let mut f = Self::open()?;
        f.write_all(&0i32.to_ne_bytes())
            .with_context(|| format!("writing {CPU_DMA_LATENCY}"))?;
        Ok(PollingIdle { _request: f })
    }

    fn open() -> anyhow::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(CPU_DMA_LATENCY)
            .with_context(|| format!("opening {CPU_DMA_LATENCY}"))
    }
}

/// Keeps the calling thread and every thread of a process on one CPU until dropped (then back on
/// the masks they had). With everything on one CPU a wake-up is a context switch; across CPUs of
/// this VM it is an inter-processor interrupt that costs 15–20 µs per hop (seen with
/// `perf sched timehist`), and the mesh path has two more hops than the direct one.
pub(super) struct OneCpu {
    /// The node's pid and the masks in force before pinning: the bench thread (tid 0 = the
    /// calling thread) and every node thread.
    pid: u32,
    saved: Vec<(nix::unistd::Pid, nix::sched::CpuSet)>,
}

impl OneCpu {
    /// Pins the calling thread and every thread of `pid` to the first CPU the calling thread may
    /// use. On error, whatever was already pinned is restored (the guard exists before the first
    /// change).
    pub(super) fn pin(pid: u32) -> anyhow::Result<OneCpu> {
        use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
        let me = nix::unistd::Pid::from_raw(0);
        let mine = sched_getaffinity(me)?;
        let cpu = (0..CpuSet::count())
            .find(|&c| mine.is_set(c).unwrap_or(false))
            .context("the bench thread may run on no CPU")?;
        let mut one = CpuSet::new();
        one.set(cpu)?;
        let mut guard = OneCpu {
            pid,
            saved: vec![(me, mine)],
        };
        for tid in tasks(pid)? {
            // A thread may have exited since the listing.
            if let Ok(mask) = sched_getaffinity(tid) {
                guard.saved.push((tid, mask));
            }
        }
        sched_setaffinity(me, &one)?;
        for (tid, _) in &guard.saved[1..] {
            let _ = sched_setaffinity(*tid, &one);
        }
        Ok(guard)
    }
}

impl Drop for OneCpu {
    fn drop(&mut self) {
        use nix::sched::sched_setaffinity;
        for (tid, mask) in &self.saved {
            let _ = sched_setaffinity(*tid, mask);
        }
        // Threads the node started while pinned get its main thread's mask.
        let main = nix::unistd::Pid::from_raw(self.pid as i32);
        let Some((_, main_mask)) = self.saved.iter().find(|(t, _)| *t == main) else {
            return;
        };
        for tid in tasks(self.pid).unwrap_or_default() {
            if !self.saved.iter().any(|(t, _)| *t == tid) {
                let _ = sched_setaffinity(tid, main_mask);
            }
        }
    }
}

/// The thread ids of `pid`.
fn tasks(pid: u32) -> anyhow::Result<Vec<nix::unistd::Pid>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let tid: i32 = task?
            .file_name()
            .to_string_lossy()
            .parse()
            .context("task id")?;
        out.push(nix::unistd::Pid::from_raw(tid));
    }
    Ok(out)
}
