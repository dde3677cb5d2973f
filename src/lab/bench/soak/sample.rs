//! The soak's samples (what is read from the node process and its `/metrics`, with the load's
//! counts at that moment) and the verdict over them.

use std::time::Duration;

use serde::Serialize;

/// One sample of the soak.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(super) struct Sample {
    /// Seconds since the load started.
    pub(super) secs: f64,
    /// The node's resident set (`VmRSS`), KiB.
    pub(super) rss_kib: u64,
    /// Open file descriptors of the node (`/proc/<pid>/fd`), the least of a few readings.
    pub(super) fds: u64,
    /// Threads of the node (`/proc/<pid>/task`).
    pub(super) threads: u64,
    /// `istio_tcp_sockets_open`, summed over its reporters; `None` when `/metrics` lacked it.
    pub(super) sockets_open: Option<u64>,
    /// `workload_manager_active_proxy_count`: pods with a running proxy.
    pub(super) proxies: Option<u64>,
    /// Connections (churn, pod, finished streams) that passed so far.
    pub(super) conns_ok: u64,
    /// Connections that failed so far (a broken stream counts once).
    pub(super) conns_failed: u64,
    /// 64 KiB blocks the long streams echoed so far.
    pub(super) stream_blocks: u64,
    /// Other failures so far (a pod ADD or DEL, a config the node did not pick up, a reading).
    pub(super) errors: u64,
    /// Pods added through the CNI chain so far.
    pub(super) pods_added: u64,
    /// Pods deleted so far.
    pub(super) pods_removed: u64,
    /// Policy pushes (config rewrites with a changed policy) so far.
    pub(super) pushes: u64,
    /// Pushes whose policy `/config_dump` showed.
    pub(super) pushes_seen: u64,
}

/// What [`read_process`] reads of the node process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProcessReading {
    /// `VmRSS`, KiB.
    pub(super) rss_kib: u64,
    /// Open file descriptors.
    pub(super) fds: u64,
    /// Threads.
    pub(super) threads: u64,
}

/// Readings of the fd count [`read_process`] takes the least of, 50 ms apart. Connections in
/// flight come and go within milliseconds, and each pod's stock of ready sockets
/// (`proxy::socket::STOCK_TARGET`, refilled in batches once half of it is taken) moves the count by
/// up to 8 per pod with every few connections; over a second of churn the least reading is where
/// the stocks are low, while a leaked descriptor stays in every reading.
const FD_READINGS: usize = 20;

/// The node process's RSS, fds (the least of [`FD_READINGS`] readings) and threads.
///
/// # Errors
/// When `/proc/<pid>` cannot be read or has no `VmRSS` (the process exited or is a zombie).
pub(super) fn read_process(pid: u32) -> std::io::Result<ProcessReading> {
    let count = |dir: &str| -> std::io::Result<u64> {
        Ok(std::fs::read_dir(format!("/proc/{pid}/{dir}"))?.count() as u64)
    };
    let mut fds = u64::MAX;
    for i in 0..FD_READINGS {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        fds = fds.min(count("fd")?);
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib = vm_rss_kib(&status).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no VmRSS: the node exited")
    })?;
    Ok(ProcessReading {
        rss_kib,
        fds,
        threads: count("task")?,
    })
}

/// `VmRSS` of a `/proc/<pid>/status` text, KiB.
pub(super) fn vm_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The sum of every series of the metric `name` in a Prometheus/OpenMetrics text (`name 3` or
/// `name{labels} 3`); `None` when no series of it is there or a value does not parse.
pub(super) fn metric_sum(text: &str, name: &str) -> Option<u64> {
    let mut sum: Option<u64> = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if let Some(labelled) = rest.strip_prefix('{') {
            labelled.rsplit_once('}')?.1
        } else if rest.starts_with(' ') {
            rest
        } else {
            // another metric whose name starts with `name`
            continue;
        };
        let v: f64 = value.split_whitespace().next()?.parse().ok()?;
        if !v.is_finite() || v < 0.0 {
            return None;
        }
        sum = Some(sum.unwrap_or(0) + v.round() as u64);
    }
    sum
}

/// The soak's verdict over its samples.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Verdict {
    /// Index of the warm-up sample in the samples, if the run got that far.
    pub(super) warmup: Option<usize>,
    /// Why the soak failed; empty when it passed.
    pub(super) problems: Vec<String>,
    /// What grew but does not fail the run (threads, open sockets).
    pub(super) notes: Vec<String>,
}

impl Verdict {
    /// No problem found.
    pub(super) fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Seconds into the run of the warm-up sample: the first sample interval, or a tenth of the run
/// when that is longer.
pub(super) fn warmup_secs(duration: Duration, interval: Duration) -> f64 {
    interval.as_secs_f64().max(duration.as_secs_f64() / 10.0)
}

/// Judges `samples` (in time order) of a run of `duration` sampled every `interval`: it fails
/// when no sample follows the warm-up one ([`warmup_secs`]), when the last sample's RSS or fds
/// exceed the warm-up sample's by more than `limit_pct` % (`--soak-growth-limit`, default
/// [`DEFAULT_SOAK_GROWTH_LIMIT_PCT`](crate::lab::bench::DEFAULT_SOAK_GROWTH_LIMIT_PCT)), when any connection failed or
/// any other error happened, when no connection passed, or when the node never showed a policy
/// push. Threads and open sockets that grew as much are noted, not failed (tokio's blocking pool
/// and the connections in flight move them).
pub(super) fn judge(
    samples: &[Sample],
    duration: Duration,
    interval: Duration,
    limit_pct: u64,
) -> Verdict {
    let mut v = Verdict::default();
    let from = warmup_secs(duration, interval);
    // samples are taken at cycle boundaries at or after their due time; allow float dust
    v.warmup = samples.iter().position(|s| s.secs + 1e-6 >= from);
    let last = samples.last();
    match (v.warmup, last) {
        (Some(w), Some(last)) if w + 1 < samples.len() => {
            let warm = &samples[w];
            let mib = |kib: u64| format!("{:.1} MiB", kib as f64 / 1024.0);
            if let Some(p) = growth(warm.rss_kib, last.rss_kib, limit_pct) {
                v.problems.push(format!(
                    "RSS grew {p:.1} % since warm-up ({} -> {}; limit {limit_pct} %)",
                    mib(warm.rss_kib),
                    mib(last.rss_kib)
                ));
            }
            if let Some(p) = growth(warm.fds, last.fds, limit_pct) {
                v.problems.push(format!(
                    "fds grew {p:.1} % since warm-up ({} -> {}; limit {limit_pct} %)",
                    warm.fds, last.fds
                ));
            }
            if let Some(p) = growth(warm.threads, last.threads, limit_pct) {
                v.notes.push(format!(
                    "threads grew {p:.1} % since warm-up ({} -> {})",
                    warm.threads, last.threads
                ));
            }
            if let (Some(a), Some(b)) = (warm.sockets_open, last.sockets_open)
                && let Some(p) = growth(a, b, limit_pct)
            {
                v.notes.push(format!(
                    "open sockets grew {p:.1} % since warm-up ({a} -> {b})"
                ));
            }
        }
        _ => v.problems.push(format!(
            "the run ended before a sample after the warm-up one ({from:.0} s): nothing to compare"
        )),
    }
    if let Some(last) = last {
        if last.conns_failed > 0 {
            v.problems
                .push(format!("{} connection(s) failed", last.conns_failed));
        }
        if last.errors > 0 {
            v.problems.push(format!("{} other error(s)", last.errors));
        }
        if last.conns_ok == 0 {
            v.problems.push("no connection passed".into());
        }
        if last.pushes_seen == 0 {
            v.problems
                .push("the node never showed a pushed policy in /config_dump".into());
        }
    }
    v
}

/// How many percent `now` exceeds `base` by, when that is more than `limit_pct`.
fn growth(base: u64, now: u64, limit_pct: u64) -> Option<f64> {
    // now > base × (1 + limit/100), in integers
    (now.saturating_mul(100) > base.saturating_mul(100u64.saturating_add(limit_pct)))
        .then(|| (now as f64 / base.max(1) as f64 - 1.0) * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::bench::DEFAULT_SOAK_GROWTH_LIMIT_PCT as GROWTH_LIMIT_PCT;

    fn sample(secs: f64, rss_kib: u64, fds: u64) -> Sample {
        Sample {
            secs,
            rss_kib,
            fds,
            threads: 10,
            sockets_open: Some(8),
            conns_ok: 100,
            pushes_seen: 1,
            ..Sample::default()
        }
    }

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn warm_up_is_the_first_minute_or_a_tenth_of_the_run() {
        assert_eq!(warmup_secs(Duration::from_secs(30 * 60), MIN), 180.0);
        assert_eq!(warmup_secs(Duration::from_secs(5 * 60), MIN), 60.0);
        let samples: Vec<Sample> = (1..=30)
            .map(|m| sample(m as f64 * 60.0 + 0.3, 20_000, 50))
            .collect();
        let v = judge(
            &samples,
            Duration::from_secs(30 * 60),
            MIN,
            GROWTH_LIMIT_PCT,
        );
        // the sample of minute 3
        assert_eq!(v.warmup, Some(2));
        assert!(v.passed(), "{v:?}");
        assert!(v.notes.is_empty());
    }

    #[test]
    fn growth_beyond_ten_percent_after_warm_up_fails() {
        let dur = Duration::from_secs(10 * 60);
        // minute 1 is the warm-up; what grew before it does not count
        let mut s = vec![sample(60.0, 20_000, 50), sample(120.0, 21_000, 52)];
        s.push(sample(600.0, 22_000, 55));
        let v = judge(&s, dur, MIN, GROWTH_LIMIT_PCT);
        assert_eq!(v.warmup, Some(0));
        assert!(v.passed(), "exactly 10 % is within the limit: {v:?}");
        s.push(sample(660.0, 22_001, 56));
        let v = judge(&s, dur, MIN, GROWTH_LIMIT_PCT);
        assert_eq!(v.problems.len(), 2, "{v:?}");
        assert!(v.problems[0].starts_with("RSS grew 10.0 %"), "{v:?}");
        assert!(v.problems[1].starts_with("fds grew 12.0 % since warm-up (50 -> 56"));
        // growth between warm-up and the end that fell back again passes
        let s = vec![
            sample(60.0, 20_000, 50),
            sample(120.0, 40_000, 90),
            sample(180.0, 20_500, 51),
        ];
        assert!(judge(&s, dur, MIN, GROWTH_LIMIT_PCT).passed());
    }

    #[test]
    fn the_growth_limit_is_the_option_s() {
        let dur = Duration::from_secs(10 * 60);
        // RSS +20 %, fds +12 %
        let s = vec![sample(60.0, 20_000, 50), sample(600.0, 24_000, 56)];
        assert_eq!(judge(&s, dur, MIN, 10).problems.len(), 2);
        let v = judge(&s, dur, MIN, 15);
        assert_eq!(v.problems.len(), 1, "{v:?}");
        assert!(v.problems[0].contains("limit 15 %"), "{v:?}");
        assert!(judge(&s, dur, MIN, 20).passed());
    }

    #[test]
    fn a_failed_connection_or_error_fails_and_threads_are_only_noted() {
        let dur = Duration::from_secs(3 * 60);
        let mut s = vec![sample(60.0, 20_000, 50), sample(180.0, 20_000, 50)];
        s[1].threads = 40;
        let v = judge(&s, dur, MIN, GROWTH_LIMIT_PCT);
        assert!(v.passed());
        assert_eq!(v.notes, ["threads grew 300.0 % since warm-up (10 -> 40)"]);
        s[1].conns_failed = 2;
        s[1].errors = 1;
        s[1].pushes_seen = 0;
        let v = judge(&s, dur, MIN, GROWTH_LIMIT_PCT);
        assert_eq!(
            v.problems,
            [
                "2 connection(s) failed",
                "1 other error(s)",
                "the node never showed a pushed policy in /config_dump"
            ]
        );
    }

    #[test]
    fn a_run_without_a_sample_after_warm_up_fails() {
        let dur = Duration::from_secs(30 * 60);
        let s = vec![sample(60.0, 1, 1), sample(180.0, 1, 1)];
        let v = judge(&s, dur, MIN, GROWTH_LIMIT_PCT);
        assert_eq!(v.warmup, Some(1));
        assert!(!v.passed());
        assert!(v.problems[0].contains("before a sample after the warm-up one (180 s)"));
        let v = judge(&[], dur, MIN, GROWTH_LIMIT_PCT);
        assert_eq!(v.warmup, None);
        assert_eq!(v.problems.len(), 1);
    }

    #[test]
    fn proc_status_and_metrics_parse() {
        let status = "Name:\tztnode\nVmPeak:\t  99999 kB\nVmRSS:\t   18432 kB\nThreads:\t9\n";
        assert_eq!(vm_rss_kib(status), Some(18432));
        assert_eq!(vm_rss_kib("Name:\tztnode\nState:\tZ (zombie)\n"), None);
        let metrics = "# HELP istio_tcp_sockets_open Open sockets.\n\
            # TYPE istio_tcp_sockets_open gauge\n\
            istio_tcp_sockets_open{reporter=\"source\"} 4\n\
            istio_tcp_sockets_open{reporter=\"destination\"} 5\n\
            istio_tcp_sockets_open_other 100\n\
            workload_manager_active_proxy_count 3\n\
            # EOF\n";
        assert_eq!(metric_sum(metrics, "istio_tcp_sockets_open"), Some(9));
        assert_eq!(
            metric_sum(metrics, "workload_manager_active_proxy_count"),
            Some(3)
        );
        assert_eq!(metric_sum(metrics, "istio_tcp_connections_failed"), None);
        assert_eq!(metric_sum("m{a=\"}\"} x\n", "m"), None);
        assert_eq!(metric_sum("m -1\n", "m"), None);
        // a label value with a brace in it
        assert_eq!(metric_sum("m{a=\"{}\"} 2\n", "m"), Some(2));
    }

    #[test]
    fn a_process_reading_of_this_process() {
        let r = read_process(std::process::id()).expect("own /proc");
        assert!(r.rss_kib > 0 && r.fds >= 3 && r.threads >= 1, "{r:?}");
        assert!(read_process(u32::MAX).is_err());
    }
}
