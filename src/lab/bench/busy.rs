//! How busy the machine was before the bench started: every figure assumes the bench has the
//! CPUs to itself, and on a 2-CPU VM one stray process (a client loop left running, a build)
//! moves the figures by tens of percent without anything else showing it.
//!
//! Two readings of `/proc/stat` (the `cpu` line: user, nice, system, idle, iowait, irq, softirq,
//! steal, in clock ticks; proc(5)) and of every `/proc/<pid>/stat` (utime + stime, fields 14 and
//! 15), [`SAMPLE`] apart.

use std::collections::HashMap;
use std::time::Duration;

/// Time between the two readings.
pub(super) const SAMPLE: Duration = Duration::from_millis(500);
/// Busy share of the machine above which the bench warns, percent.
pub(super) const WARN_PCT: f64 = 15.0;

/// What was using the CPUs while the bench was about to start.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Busy {
    /// Non-idle time of all CPUs over the sample, percent of the machine (0–100); `None` when
    /// `/proc/stat` could not be read.
    pub(super) pct: Option<f64>,
    /// The processes that used the most, as `(pid, name, percent of one CPU)`, largest first
    /// (at most three, each at least 5 % of a CPU).
    pub(super) top: Vec<(u32, String, f64)>,
}

impl Busy {
    /// Samples the machine for [`SAMPLE`] (this process excluded from `top`). The `cpu` line is
    /// read inside the process scans, so the scans' own CPU time stays out of the share.
    pub(super) fn sample() -> Busy {
        let procs0 = read_procs();
        let cpu0 = read_cpu_line();
        std::thread::sleep(SAMPLE);
        let cpu1 = read_cpu_line();
        let procs1 = read_procs();
        let ticks_per_sec = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .map_or(100.0, |t| t as f64);
        Busy {
            pct: cpu0.zip(cpu1).map(|(a, b)| busy_pct(&a, &b)),
            top: top_consumers(
                &procs0,
                &procs1,
                ticks_per_sec * SAMPLE.as_secs_f64(),
                std::process::id(),
            ),
        }
    }

    /// The share as `<p> %`, or `unknown`.
    pub(super) fn describe_pct(&self) -> String {
        self.pct
            .map_or_else(|| "unknown".to_owned(), |p| format!("{p:.0} %"))
    }

    /// A warning line when the machine was busier than [`WARN_PCT`], naming the top processes.
    pub(super) fn warning(&self) -> Option<String> {
        let pct = self.pct.filter(|p| *p > WARN_PCT)?;
        let who = self
            .top
            .iter()
            .map(|(pid, name, pct)| format!("{name} (pid {pid}) {pct:.0} % of a CPU"))
            .collect::<Vec<_>>()
            .join(", ");
        Some(format!(
            "bench: warning: the machine was {pct:.0} % busy before the run{}{who}; the figures \
             assume it idle",
            if who.is_empty() { "" } else { ": " }
        ))
    }
}

impl Busy {
    /// Sets the report keys `busy_before_pct` (percent of the machine) and `busy_before_top`
    /// (`[{pid, name, cpu_pct}]`, percent of one CPU) in the object `doc`.
    pub(super) fn add_to(&self, doc: &mut serde_json::Value) {
        doc["busy_before_pct"] = serde_json::json!(self.pct.map(|p| (p * 10.0).round() / 10.0));
        doc["busy_before_top"] = self
            .top
            .iter()
            .map(|(pid, name, pct)| {
                serde_json::json!({"pid": pid, "name": name, "cpu_pct": (pct * 10.0).round() / 10.0})
            })
            .collect();
    }
}

/// The `cpu` line's tick counters (all CPUs), in proc(5) order.
fn read_cpu_line() -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_cpu_line(&stat)
}

fn parse_cpu_line(stat: &str) -> Option<Vec<u64>> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map_while(|v| v.parse().ok())
        .collect();
    (ticks.len() >= 4).then_some(ticks)
}

/// Non-idle share of the ticks between two `cpu` lines, percent: all but idle and iowait
/// (fields 4 and 5), so steal counts (the CPU was not the bench's then either).
fn busy_pct(before: &[u64], after: &[u64]) -> f64 {
    let d = tick_deltas(before, after);
    let total: u64 = d.iter().sum();
    if total == 0 {
        return 0.0;
    }
    100.0 * (total - d[3] - d[4]) as f64 / total as f64
}

/// The first eight fields' increase between two `cpu` lines (user, nice, system, idle, iowait,
/// irq, softirq, steal); `guest` time (fields 9 and 10) is already inside `user`, so it is left
/// out. A field missing from `before` counts 0 there (an empty `before`: since boot), one
/// missing from `after` adds nothing.
fn tick_deltas(before: &[u64], after: &[u64]) -> [u64; 8] {
    std::array::from_fn(|i| {
        after
            .get(i)
            .map_or(0, |a| a.saturating_sub(before.get(i).copied().unwrap_or(0)))
    })
}

/// Ticks of work in a `cpu` line's increase: user, nice, system, irq and softirq (fields 1–3, 6,
/// 7); not idle or iowait, nor steal (time the hypervisor gave to another guest).
fn work_ticks(before: &[u64], after: &[u64]) -> u64 {
    let d = tick_deltas(before, after);
    d[0] + d[1] + d[2] + d[5] + d[6]
}

/// The machine's work so far ([`work_ticks`] since boot), in ticks (`CLK_TCK`) summed over all
/// CPUs: the user, system, irq and softirq time of every process and kernel thread (proc(5)).
/// Compare two readings.
pub(super) fn machine_work_ticks() -> anyhow::Result<u64> {
    let line = read_cpu_line().ok_or_else(|| anyhow::anyhow!("no cpu line in /proc/stat"))?;
    Ok(work_ticks(&[], &line))
}

/// What the bench reads of a process's `/proc/<pid>/stat`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ProcStat {
    /// `comm`, the name (field 2).
    pub(super) name: String,
    /// The parent's pid (field 4).
    pub(super) ppid: u32,
    /// utime + stime, clock ticks (fields 14 and 15).
    pub(super) cpu_ticks: u64,
}

/// [`ProcStat`] of every process, by pid.
pub(super) fn read_procs() -> HashMap<u32, ProcStat> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some(v) = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|s| parse_proc_stat(&s))
        {
            out.insert(pid, v);
        }
    }
    out
}

/// Parses a `/proc/<pid>/stat` line (proc(5)): `pid (comm) state ppid ...`, where comm may hold
/// spaces and parentheses (so the last `)` ends it).
pub(super) fn parse_proc_stat(stat: &str) -> Option<ProcStat> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?.to_owned();
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    // after comm: state (3), ppid (4) ... utime (14), stime (15)
    let ppid: u32 = rest.nth(1)?.parse().ok()?;
    let utime: u64 = rest.nth(9)?.parse().ok()?;
    let stime: u64 = rest.next()?.parse().ok()?;
    Some(ProcStat {
        name,
        ppid,
        cpu_ticks: utime + stime,
    })
}

/// The up to three processes but `exclude` with the most CPU time between two readings (only
/// those present in both), each at least 5 % of one CPU; `ticks` is one CPU's ticks over the
/// interval.
fn top_consumers(
    before: &HashMap<u32, ProcStat>,
    after: &HashMap<u32, ProcStat>,
    ticks: f64,
    exclude: u32,
) -> Vec<(u32, String, f64)> {
    if ticks <= 0.0 {
        return Vec::new();
    }
    let mut used: Vec<(u32, String, f64)> = after
        .iter()
        .filter(|(pid, _)| **pid != exclude)
        .filter_map(|(pid, now)| {
            let then = before.get(pid)?;
            let pct = 100.0 * now.cpu_ticks.saturating_sub(then.cpu_ticks) as f64 / ticks;
            (pct >= 5.0).then(|| (*pid, now.name.clone(), pct))
        })
        .collect();
    used.sort_by(|a, b| b.2.total_cmp(&a.2));
    used.truncate(3);
    used
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_share_counts_all_but_idle_and_iowait_and_work_also_leaves_out_steal() {
        let before =
            parse_cpu_line("cpu  100 0 50 1000 10 0 5 0 0 0\ncpu0 1 2 3 4\n").expect("cpu line");
        // +60 user, +20 system, +100 idle, +10 iowait, +10 softirq: 90 busy of 200
        let after = parse_cpu_line("cpu  160 0 70 1100 20 0 15 0 7 0\n").expect("cpu line");
        let stolen = parse_cpu_line("cpu  160 0 70 1100 20 0 15 40 7 0\n").expect("cpu line");
        assert!((busy_pct(&before, &after) - 45.0).abs() < 1e-9);
        assert_eq!(busy_pct(&before, &before), 0.0);
        assert_eq!(
            work_ticks(&before, &after),
            90,
            "user 60 + system 20 + softirq 10"
        );
        assert_eq!(work_ticks(&before, &stolen), 90, "steal is not work");
        assert!(
            (busy_pct(&before, &stolen) - 100.0 * 130.0 / 240.0).abs() < 1e-9,
            "steal keeps the CPU from the bench"
        );
        assert_eq!(work_ticks(&[], &after), 160 + 70 + 15, "since boot");
        assert_eq!(parse_cpu_line("cpu0 1 2 3 4\n"), None);
    }

    #[test]
    fn a_process_name_with_spaces_and_parentheses_parses() {
        let line = "4242 (my (odd) proc) R 1 4242 4242 0 -1 4194304 100 0 0 0 70 30 0 0 20 0 1 0";
        assert_eq!(
            parse_proc_stat(line),
            Some(ProcStat {
                name: "my (odd) proc".to_owned(),
                ppid: 1,
                cpu_ticks: 100
            })
        );
        assert_eq!(parse_proc_stat("4242 (short) R 1"), None);
    }

    #[test]
    fn the_top_consumers_are_the_busiest_three_above_five_percent() {
        let p = |v: &[(u32, &str, u64)]| {
            v.iter()
                .map(|(pid, n, t)| {
                    let stat = ProcStat {
                        name: n.to_string(),
                        ppid: 1,
                        cpu_ticks: *t,
                    };
                    (*pid, stat)
                })
                .collect::<HashMap<_, _>>()
        };
        let before = p(&[
            (1, "a", 0),
            (2, "b", 0),
            (3, "c", 0),
            (4, "d", 0),
            (5, "e", 0),
        ]);
        // 50 ticks = one CPU over the interval; pid 6 is new and not counted
        let after = p(&[
            (1, "a", 40),
            (2, "b", 2),
            (3, "c", 10),
            (4, "d", 25),
            (5, "e", 5),
            (6, "f", 50),
        ]);
        let top = top_consumers(&before, &after, 50.0, 0);
        let names: Vec<&str> = top.iter().map(|(_, n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "d", "c"]);
        assert!((top[0].2 - 80.0).abs() < 1e-9);
        // the excluded pid leaves room for the next; below 5 % (b: 4 %) never counts
        let top = top_consumers(&before, &after, 50.0, 1);
        let names: Vec<&str> = top.iter().map(|(_, n, _)| n.as_str()).collect();
        assert_eq!(names, ["d", "c", "e"]);
        let top = top_consumers(&before, &after, 600.0, 0);
        let names: Vec<&str> = top.iter().map(|(_, n, _)| n.as_str()).collect();
        assert_eq!(names, ["a"]);
    }

    #[test]
    fn this_machine_s_proc_files_parse() {
        assert!(read_cpu_line().is_some_and(|t| t.len() >= 8));
        let t0 = machine_work_ticks().expect("work ticks");
        assert!(t0 > 0, "a booted machine has worked");
        assert!(machine_work_ticks().expect("work ticks") >= t0);
        let me = std::process::id();
        assert!(read_procs().contains_key(&me));
        let busy = Busy::sample();
        assert!(
            busy.pct.is_some_and(|p| (0.0..=100.0).contains(&p)),
            "{busy:?}"
        );
        assert!(busy.top.iter().all(|(pid, _, _)| *pid != me), "{busy:?}");
    }

    #[test]
    fn the_warning_names_the_processes_only_above_the_threshold() {
        let quiet = Busy {
            pct: Some(10.0),
            top: vec![(7, "x".into(), 12.0)],
        };
        assert_eq!(quiet.warning(), None);
        assert_eq!(Busy::default().warning(), None);
        let busy = Busy {
            pct: Some(47.0),
            top: vec![(25116, "python3".into(), 87.0)],
        };
        let w = busy.warning().expect("a warning");
        assert!(w.contains("47 % busy"), "{w}");
        assert!(w.contains("python3 (pid 25116) 87 % of a CPU"), "{w}");
    }
}
