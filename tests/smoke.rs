//! The user-facing commands run end to end: `ztnode demo`, a short `ztnode bench` and a short soak.

mod common;

use std::process::Command;

#[test]
fn demo_passes_and_cleans_up() {
    if !common::privileged("demo_passes_and_cleans_up") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ztnode"))
        .arg("demo")
        .output()
        .expect("run demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "spiffe://cluster.local/ns/default/sa/client",
        "spiffe://cluster.local/ns/default/sa/server",
        "all on port 15008",
        "Demo passed",
    ] {
        assert!(
            text.contains(needle),
            "demo output lacks {needle:?}:\n{text}"
        );
    }
    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns");
    assert!(
        !String::from_utf8_lossy(&netns.stdout).contains("ztdemo"),
        "demo left namespaces behind"
    );
}

/// Runs `ztnode bench` with `args` (plus its own lab prefix and a JSON path), asserting it passed;
/// returns its stdout and the JSON report.
fn bench_report(tag: &str, args: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_ztnode"))
        .arg("bench")
        .args(args)
        .args(["--lab-prefix", &common::prefix(tag), "--json"])
        .arg(&json)
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("json");
    (stdout, v)
}

/// Runs `ztnode bench` with `args` as [`bench_report`] does; returns the JSON report and the figure
/// names.
fn run_bench(tag: &str, args: &[&str]) -> (serde_json::Value, Vec<String>) {
    let (_, v) = bench_report(tag, args);
    let names = v["figures"]
        .as_array()
        .expect("figures")
        .iter()
        .map(|f| f["name"].as_str().unwrap_or("").to_owned())
        .collect();
    (v, names)
}

#[test]
fn bench_reports_every_figure() {
    if !common::privileged("bench_reports_every_figure") {
        return;
    }
    let (v, names) = run_bench(
        "zba",
        &[
            "--duration",
            "1",
            "--round-trips",
            "200",
            "--pods",
            "4",
            "--idle-conns",
            "20",
            "--xds-workloads",
            "50",
            "--xds-policies",
            "5",
            "--xds-pushes",
            "6",
        ],
    );
    for want in [
        "throughput 1 stream(s)",
        "throughput 8 stream(s)",
        "1 KiB round trip p50",
        "connect + 1 KiB RTT + close",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "missing figure {want}: {names:?}"
        );
    }
    for f in v["figures"].as_array().expect("figures") {
        assert!(
            f["direct"].as_f64().is_some_and(|x| x > 0.0)
                && f["ztnode"].as_f64().is_some_and(|x| x > 0.0),
            "{f}"
        );
    }
    assert!(v["rss_idle_pods_mib"].as_f64().is_some_and(|x| x > 0.0));
    for key in ["ztnode_version", "started_at", "cpuidle"] {
        assert!(v[key].as_str().is_some_and(|s| !s.is_empty()), "{key}: {v}");
    }
    assert!(v["cpus"].as_u64().is_some_and(|n| n > 0), "{v}");
    // how busy the machine was before the run (tests run beside each other: any share)
    assert!(
        v["busy_before_pct"]
            .as_f64()
            .is_some_and(|p| (0.0..=100.0).contains(&p)),
        "{v}"
    );
    assert!(v["busy_before_top"].is_array(), "{v}");
    for key in ["cpu_ms_per_gb_1_stream", "cpu_ms_per_gb_8_streams"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    assert!(v["per_idle_conn_kib"].as_f64().is_some());
    assert!(v["added_rtt_p99_us"].as_f64().is_some());
    assert_eq!(v["cni_add_samples"].as_u64(), Some(2));
    assert!(v["ztnode_cni_add_p50_ms"].as_f64().is_some_and(|x| x > 0.0));
    // Kubernetes mode (the fake API server of ../shared/tools is beside every checkout)
    for key in ["kube_enroll_running_pods_ms", "kube_cni_add_p50_ms"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    // istiod (the fake istiod of ../shared/tools too): pushes to their ACK and to config_dump
    for key in [
        "xds_initial_sync_ms",
        "xds_rss_empty_mib",
        "xds_rss_world_mib",
        "xds_push_ack_p50_ms",
        "xds_push_ack_max_ms",
        "xds_push_config_dump_p50_ms",
        "xds_config_dump_kib",
    ] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    assert!(v["xds_response_ack_p50_ms"].as_f64().is_some(), "{v}");
    assert_eq!(v["xds_workloads"].as_u64(), Some(50));
}

#[test]
fn bench_only_runs_the_selected_sections() {
    if !common::privileged("bench_only_runs_the_selected_sections") {
        return;
    }
    let (v, names) = run_bench("zbo", &["--only", "latency", "--round-trips", "100"]);
    let mut want = vec![
        "1 KiB round trip p50",
        "1 KiB round trip p99",
        "1 KiB round trip p50, one CPU",
        "1 KiB round trip p99, one CPU",
    ];
    // The polling-idle repetition needs a cpuidle driver with a polling state and the PM QoS
    // device; where they are missing the bench leaves its rows out.
    let polling = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpuidle/state0/name")
        .is_ok_and(|n| n.trim() == "POLL")
        && std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/cpu_dma_latency")
            .is_ok();
    if polling {
        want.extend([
            "1 KiB round trip p50, idle CPUs polling",
            "1 KiB round trip p99, idle CPUs polling",
        ]);
    }
    assert_eq!(names, want);
    for key in ["added_rtt_p50_us", "added_rtt_p50_one_cpu_us"] {
        assert!(v[key].as_f64().is_some(), "{key}: {v}");
    }
    assert_eq!(
        v["added_rtt_p99_polling_idle_us"].as_f64().is_some(),
        polling,
        "{v}"
    );
    assert!(v["per_idle_conn_kib"].is_null(), "{v}");
    assert!(v["xds_push_ack_p50_ms"].is_null(), "{v}");
    assert_eq!(v["cni_add_samples"].as_u64(), Some(0));
}

#[test]
fn a_short_soak_passes_and_reports_samples() {
    if !common::privileged("a_short_soak_passes_and_reports_samples") {
        return;
    }
    // 24 s of load sampled every 5 s: the warm-up sample at 5 s, four more after it
    let (stdout, v) = bench_report(
        "zbs",
        &[
            "--soak",
            "0.4",
            "--soak-sample-secs",
            "5",
            "--soak-rate",
            "20",
            "--soak-streams",
            "2",
            "--pods",
            "2",
            // the debug node's first sample, 5 s in, still holds start-up growth (a blocking
            // thread that starts later adds its heap): 8-11 % by the last one in CI runs
            "--soak-growth-limit",
            "25",
        ],
    );
    assert!(stdout.contains("soak PASSED"), "{stdout}");
    assert_eq!(v["passed"], true, "{v}");
    let samples = v["samples"].as_array().expect("samples");
    assert!(samples.len() >= 4, "{v}");
    assert_eq!(v["warmup_index"].as_u64(), Some(0), "{v}");
    assert_eq!(v["growth_limit_pct"].as_u64(), Some(25), "{v}");
    let last = samples.last().expect("a sample");
    for key in [
        "rss_kib",
        "fds",
        "threads",
        "conns_ok",
        "stream_blocks",
        "pods_added",
        "pods_removed",
        "pushes_seen",
    ] {
        assert!(last[key].as_u64().is_some_and(|n| n > 0), "{key}: {last}");
    }
    assert_eq!(last["conns_failed"].as_u64(), Some(0), "{last}");
    assert_eq!(last["errors"].as_u64(), Some(0), "{last}");
    // the node's gauges were read: the added pod and the two fixed ones run a proxy
    assert!(last["proxies"].as_u64().is_some_and(|n| n >= 2), "{last}");
    assert!(last["sockets_open"].as_u64().is_some(), "{last}");
}

/// A child process killed (and reaped) when dropped, also when an assertion fails first.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `ztnode bench <args> --lab-prefix <prefix>` and reads its stderr until a line holding
/// `until`; returns the bench, what it printed until then, and a thread collecting the rest (so
/// the bench's last words find a reader).
fn bench_until(
    prefix: &str,
    args: &[&str],
    until: &str,
) -> (KillOnDrop, String, std::thread::JoinHandle<String>) {
    use std::io::{BufRead, BufReader};
    let mut bench = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_ztnode"))
            .arg("bench")
            .args(args)
            .args(["--lab-prefix", prefix])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run bench"),
    );
    let mut lines = BufReader::new(bench.0.stderr.take().expect("stderr")).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.expect("bench stderr");
        seen.push_str(&line);
        seen.push('\n');
        if line.contains(until) {
            break;
        }
    }
    assert!(
        seen.contains(until),
        "the bench never printed {until:?}:\n{seen}"
    );
    let rest =
        std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
    (bench, seen, rest)
}

/// Sends SIGTERM to `bench` and asserts it exits with 128 + 15 within 20 s, saying it stopped
/// the lab and not that the run failed; then that nothing of the lab `prefix` is left: no
/// namespace, lab dir or lock file.
fn sigterm_leaves_nothing(
    prefix: &str,
    mut bench: KillOnDrop,
    rest: std::thread::JoinHandle<String>,
) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(bench.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = bench.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the bench did not exit within 20 s of SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let rest = rest.join().unwrap_or_default();
    assert_eq!(status.code(), Some(128 + 15), "{status}: {rest}");
    assert!(rest.contains("stopping the lab"), "{rest}");
    assert!(!rest.contains("bench failed"), "{rest}");
    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns");
    let left: Vec<String> = String::from_utf8_lossy(&netns.stdout)
        .lines()
        .filter(|l| l.starts_with(&format!("{prefix}-")))
        .map(str::to_owned)
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    let lab_dir = std::env::temp_dir().join(format!("ztnode-lab-{prefix}"));
    assert!(!lab_dir.exists(), "{} left behind", lab_dir.display());
    assert!(
        !lab_dir.with_extension("lock").exists(),
        "the prefix lock file left behind"
    );
}

#[test]
fn a_bench_stopped_by_sigterm_leaves_no_lab_behind() {
    if !common::privileged("a_bench_stopped_by_sigterm_leaves_no_lab_behind") {
        return;
    }
    let prefix = common::prefix("zbt");
    let (bench, seen, rest) = bench_until(
        &prefix,
        &["--only", "throughput", "--hold", "300"],
        "holding",
    );
    let node_pid = seen
        .split("node pid ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.trim().parse::<i32>().ok())
        .expect("node pid in the hold line");
    // a process in one of the lab's pods that is not the bench's child (as a user's shell in a
    // held lab would start): only the namespace says it belongs to the lab
    let mut stray = KillOnDrop(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("{prefix}-m-server"),
                "sleep",
                "600",
            ])
            .spawn()
            .expect("a process in the lab"),
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        stray.0.try_wait().expect("stray").is_none(),
        "the process in the lab did not start"
    );
    sigterm_leaves_nothing(&prefix, bench, rest);
    let stray_status = stray.0.try_wait().expect("stray");
    assert!(
        stray_status.is_some_and(|s| !s.success()),
        "the process in the lab's namespace was left running: {stray_status:?}"
    );
    // the node is killed, not orphaned (a zombie until reaped counts as gone)
    let node_state = std::fs::read_to_string(format!("/proc/{node_pid}/stat")).unwrap_or_default();
    assert!(
        node_state.is_empty() || node_state.contains(") Z "),
        "the node (pid {node_pid}) still runs: {node_state}"
    );
}

#[test]
fn a_bench_stopped_while_measuring_leaves_no_lab_behind() {
    if !common::privileged("a_bench_stopped_while_measuring_leaves_no_lab_behind") {
        return;
    }
    // the handler kills the node and the clients under the running measurement: the run still
    // ends by the signal, with its lab gone
    let prefix = common::prefix("zbm");
    let (bench, _, rest) = bench_until(
        &prefix,
        &["--only", "rate", "--duration", "30", "--pods", "2"],
        "measuring",
    );
    std::thread::sleep(std::time::Duration::from_millis(1500));
    sigterm_leaves_nothing(&prefix, bench, rest);
}
