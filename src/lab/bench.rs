//! `ztnode bench`: what the mesh costs, measured in one run against the direct path.
//!
//! One lab node (see [`crate::lab::Lab`]) holds two pairs of pods on the same bridge: `d-client`/`d-server`
//! (not enrolled: the direct path) and `m-client`/`m-server` (enrolled: traffic through ztnode HBONE),
//! with a release `ztnode node` running in the node netns. Measured:
//! throughput of 1 and 8 TCP streams (iperf3), 1 KiB request/response round trips on one connection
//! (p50/p99), new connection + 1 KiB round trip + close per second, the node process's RSS (idle with 2
//! and with `pods` enrolled pods, with `idle_conns` open idle connections, after they close), and the
//! exec time of the `ztnode-cni` plugin in CNI ADD. Prints a table with ratios (ztnode / direct) and
//! writes the same figures as JSON. Benchmarks are not tests: nothing here asserts a timing.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use super::node::{Lab, LabOptions, Pod, ProcessGuard, local_config};
use crate::netns::Netns;

mod placement;

use placement::{OneCpu, Placement, PollingIdle};

/// Options of a bench run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Length of each throughput and connection-rate measurement.
    pub duration: Duration,
    /// Number of 1 KiB round trips for the latency figures.
    pub round_trips: usize,
    /// Enrolled pods for the "idle with N pods" RSS and the CNI ADD samples (≥ 2).
    pub pods: usize,
    /// Idle connections per batch held open through the tunnel: RSS is read after each of three
    /// batches; the slope from the first to the third is the per-connection figure.
    pub idle_conns: usize,
    /// Where to write the JSON report.
    pub json: PathBuf,
    /// Keep the lab up this long before measuring (for attaching a profiler by hand).
    pub hold: Duration,
    /// Sections to run; empty means all.
    pub only: Vec<Section>,
    /// Name prefix of the lab's namespaces, bridge and directories ([`DEFAULT_LAB_PREFIX`]).
    pub lab_prefix: String,
}

/// A part of the benchmark that `--only` can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// iperf3 throughput, 1 and 8 streams.
    Throughput,
    /// 1 KiB round trips on one kept connection.
    Latency,
    /// New connection + 1 KiB round trip + close per second.
    Rate,
    /// RSS: idle with N pods, with the idle connections held, after they close.
    Memory,
    /// CNI ADD exec time over the extra pods.
    Cni,
}

/// Default name prefix of the lab (netns `ztbench-node`, `ztbench-m-client`, ...).
pub const DEFAULT_LAB_PREFIX: &str = "ztbench";
const SUBNET: &str = "10.250.0.0/16";
const MSG: usize = 1024;

fn pod_ip(index: usize) -> IpAddr {
    // host-local hands out addresses in order from .2 (gateway .1).
    let n = index + 2;
    IpAddr::from([10, 250, (n / 256) as u8, (n % 256) as u8])
}

/// Runs the benchmark; returns the exit status.
pub fn run(opts: BenchOptions) -> i32 {
    match run_inner(&opts) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench failed: {e:#}");
            1
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS")
}

/// CPU time (user + system) the process `pid` has used, seconds (`/proc/<pid>/stat` fields 14
/// and 15, in clock ticks).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // fields after the command name, which is in parentheses and may hold spaces
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("no comm")?;
    let mut fields = rest.split_whitespace().skip(11);
    let mut tick = || -> anyhow::Result<u64> { Ok(fields.next().context("short stat")?.parse()?) };
    let ticks = tick()? + tick()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?
        .filter(|&hz| hz > 0)
        .context("no CLK_TCK")?;
    Ok(ticks as f64 / hz as f64)
}

fn settle_rss(pid: u32) -> anyhow::Result<u64> {
    std::thread::sleep(Duration::from_millis(1500));
    rss_kib(pid)
}

fn run_inner(opts: &BenchOptions) -> anyhow::Result<()> {
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the benchmark builds network namespaces: run it as root"
    );
    anyhow::ensure!(opts.pods >= 2, "--pods must be at least 2");
    let started = time::OffsetDateTime::now_utc();
    crate::raise_nofile_limit();
    let prefix = opts.lab_prefix.as_str();
    // Short (interface names like `<prefix>-br` have 15 characters at most) and without `-`, so
    // the leftover cleanup below cannot match another lab's names.
    anyhow::ensure!(
        (1..=8).contains(&prefix.len())
            && prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
        "--lab-prefix must be 1 to 8 characters of a-z and 0-9, not {prefix:?}"
    );
    // Namespaces an interrupted earlier run may have left.
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for name in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if name.starts_with(&format!("{prefix}-")) {
                let _ = Command::new("ip").args(["netns", "del", name]).output();
            }
        }
    }
    let exe = std::env::current_exe()?;
    let run_dir = std::env::temp_dir()
        .join(format!("ztnode-lab-{prefix}"))
        .join("run");
    let lab = Lab::new(LabOptions {
        prefix: prefix.into(),
        ztnode_binary: Some(exe.clone()),
        run_dir: run_dir.clone(),
        subnet: SUBNET.into(),
        cni_version: "1.0.0".into(),
    })?;
    // pods in allocation order: d-client, d-server, m-client, m-server, p002..
    let mut mesh: Vec<(String, IpAddr)> = vec![
        ("m-client".into(), pod_ip(2)),
        ("m-server".into(), pod_ip(3)),
    ];
    for i in 2..opts.pods {
        mesh.push((format!("p{i:03}"), pod_ip(i + 2)));
    }
    let entries: Vec<(&str, &str, &str, IpAddr)> = mesh
        .iter()
        .map(|(n, ip)| (n.as_str(), "bench", n.as_str(), *ip))
        .collect();
    let config = lab.dir().join("local-config.yaml");
    std::fs::write(&config, local_config(prefix, &entries))?;
    let level = std::env::var("ZTNODE_BENCH_LOG").unwrap_or_else(|_| "warn".into());
    let (node, log) = lab.start_node(&exe, &config, &run_dir, &level, &["--no-install".into()])?;
    let pid = node.0.id();
    eprintln!("bench: node up (pid {pid}); adding pods");
    let d_client = lab.add_pod("d-client", "bench")?;
    let d_server = lab.add_pod("d-server", "bench")?;
    let m_client = lab.add_pod("m-client", "bench")?;
    let m_server = lab.add_pod("m-server", "bench")?;
    anyhow::ensure!(
        m_client.ip == pod_ip(2) && m_server.ip == pod_ip(3),
        "unexpected pod IPs"
    );
    let rss_2 = settle_rss(pid)?;
    let wants = |s: Section| opts.only.is_empty() || opts.only.contains(&s);
    let extra_pods = wants(Section::Memory) || wants(Section::Cni);

    let mut plugin_ms = Vec::new();
    let mut chain_ms = Vec::new();
    for (name, _) in mesh.iter().skip(2).filter(|_| extra_pods) {
        let pod = lab.add_pod(name, "bench")?;
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
    let rss_n = settle_rss(pid)?;
    eprintln!("bench: {} pods enrolled; measuring", opts.pods);

    if !opts.hold.is_zero() {
        eprintln!(
            "bench: holding {:?}: node pid {pid}, pods {} {} (mesh) and {} {} (direct)",
            opts.hold,
            m_client.netns_name,
            m_server.netns_name,
            d_client.netns_name,
            d_server.netns_name
        );
        std::thread::sleep(opts.hold);
    }
    let secs = opts.duration.as_secs().max(1);
    let mut rows = Vec::new();
    let mut values: Vec<Value> = Vec::new();
    if wants(Section::Throughput) {
        for streams in [1usize, 8] {
            let (mut mesh_bytes, mut cpu) = (0.0, 0.0);
            let (direct, mesh_v) = interleaved(
                secs,
                |slice| Ok(iperf(&d_client, &d_server, streams, slice)?.0),
                |slice| {
                    let cpu_before = cpu_seconds(pid)?;
                    let (gbps, bytes) = iperf(&m_client, &m_server, streams, slice)?;
                    cpu += cpu_seconds(pid)? - cpu_before;
                    mesh_bytes += bytes;
                    Ok(gbps)
                },
            )?;
            rows.push(Row::new(
                format!("throughput {streams} stream(s)"),
                "Gbit/s",
                direct,
                mesh_v,
            ));
            values.push(Value::new(
                &format!("ztnode CPU per GB, {streams} stream(s) (ms)"),
                if streams == 1 {
                    "cpu_ms_per_gb_1_stream"
                } else {
                    "cpu_ms_per_gb_8_streams"
                },
                if mesh_bytes > 0.0 {
                    cpu * 1e3 / (mesh_bytes / 1e9)
                } else {
                    0.0
                },
                0,
            ));
        }
    }
    if wants(Section::Latency) {
        let mut placements = vec![Placement::Free, Placement::OneCpu];
        match PollingIdle::check() {
            Ok(()) => placements.push(Placement::PollingIdle),
            Err(e) => eprintln!("bench: {e:#}; the polling-idle latency rows are left out"),
        }
        for (i, placement) in placements.into_iter().enumerate() {
            let l = latency(
                [&d_client, &d_server, &m_client, &m_server],
                opts.round_trips,
                7100 + 10 * i as u16,
                placement,
                pid,
            )?;
            let (what, key) = placement.label();
            rows.push(Row::new(
                format!("1 KiB round trip p50{what}"),
                "µs",
                l.direct_p50,
                l.mesh_p50,
            ));
            rows.push(Row::new(
                format!("1 KiB round trip p99{what}"),
                "µs",
                l.direct_p99,
                l.mesh_p99,
            ));
            values.push(Value::new(
                &format!("added RTT p50{what} (µs)"),
                &format!("added_rtt_p50{key}_us"),
                l.mesh_p50 - l.direct_p50,
                2,
            ));
            values.push(Value::new(
                &format!("added RTT p99{what} (µs)"),
                &format!("added_rtt_p99{key}_us"),
                l.mesh_p99 - l.direct_p99,
                2,
            ));
        }
    }
    if wants(Section::Rate) {
        let (dc, mc) = interleaved(
            secs,
            |slice| conn_rate(&d_client, &d_server, Duration::from_secs(slice)),
            |slice| conn_rate(&m_client, &m_server, Duration::from_secs(slice)),
        )?;
        rows.push(Row::new(
            "connect + 1 KiB RTT + close".into(),
            "conn/s",
            dc,
            mc,
        ));
    }
    let mib = |kib: u64| kib as f64 / 1024.0;
    if wants(Section::Memory) {
        let idle = idle_connections(&m_client, &m_server, opts.idle_conns, pid)?;
        values.push(Value::new(
            "RSS idle, 2 pods (MiB)",
            "rss_idle_2_pods_mib",
            mib(rss_2),
            1,
        ));
        values.push(Value::new(
            &format!("RSS idle, {} pods (MiB)", opts.pods),
            "rss_idle_pods_mib",
            mib(rss_n),
            1,
        ));
        for (i, rss) in idle.held.iter().enumerate() {
            values.push(Value::new(
                &format!("RSS, {} idle conns (MiB)", (i + 1) * opts.idle_conns),
                &match i {
                    0 => "rss_idle_conns_mib".to_owned(),
                    i => format!("rss_{}x_idle_conns_mib", i + 1),
                },
                mib(*rss),
                1,
            ));
        }
        values.push(Value::new(
            "per idle connection (KiB)",
            "per_idle_conn_kib",
            idle.per_conn(opts.idle_conns),
            2,
        ));
        values.push(Value::new(
            "RSS after they closed (MiB)",
            "rss_after_close_mib",
            mib(idle.after),
            1,
        ));
    }
    if wants(Section::Cni) {
        values.push(Value::new(
            "ztnode-cni ADD p50 (ms)",
            "ztnode_cni_add_p50_ms",
            percentile(&plugin_ms, 0.5),
            2,
        ));
        values.push(Value::new(
            "ztnode-cni ADD p99 (ms)",
            "ztnode_cni_add_p99_ms",
            percentile(&plugin_ms, 0.99),
            2,
        ));
        values.push(Value::new(
            "whole chain ADD p50 (ms)",
            "chain_add_p50_ms",
            percentile(&chain_ms, 0.5),
            2,
        ));
    }

    let machine = Machine::read(started);
    println!(
        "\nztnode bench ({}s per path per throughput/rate figure, {} round trips, {} CPUs shared by everything)",
        secs, opts.round_trips, machine.cpus
    );
    println!(
        "ztnode {}, started {}, cpuidle {}",
        machine.version, machine.started_at, machine.cpuidle
    );
    println!(
        "{:<40} {:>12} {:>12} {:>10}",
        "figure", "direct", "ztnode", "ratio"
    );
    for r in &rows {
        println!(
            "{:<40} {:>12.2} {:>12.2} {:>9.2}x  {}",
            r.name, r.direct, r.mesh, r.ratio, r.unit
        );
    }
    for v in &values {
        println!(
            "{:<40} {:>12} {:>12.prec$} {:>10}",
            v.label,
            "",
            v.value,
            "",
            prec = v.precision
        );
    }

    let mut report = json!({
        "duration_secs": secs,
        "round_trips": opts.round_trips,
        "pods": opts.pods,
        "idle_conns": opts.idle_conns,
        "cni_add_samples": plugin_ms.len(),
        "ztnode_version": machine.version,
        "started_at": machine.started_at,
        "cpus": machine.cpus,
        "cpuidle": machine.cpuidle,
        "figures": rows.iter().map(|r| json!({"name": r.name, "unit": r.unit, "direct": r.direct, "ztnode": r.mesh, "ratio": r.ratio})).collect::<Vec<_>>(),
    });
    for v in &values {
        report[v.key.as_str()] = json!(v.value);
    }
    std::fs::write(&opts.json, serde_json::to_vec_pretty(&report)?)?;
    println!("\nJSON written to {}", opts.json.display());
    let kept_log = opts.json.with_extension("node.log");
    if std::fs::copy(&log, &kept_log).is_ok() {
        println!("node log kept at {}", kept_log.display());
    }
    drop(node);
    Ok(())
}

/// One single-valued figure: table label, JSON key, value, printed decimals.
struct Value {
    label: String,
    key: String,
    value: f64,
    precision: usize,
}

impl Value {
    fn new(label: &str, key: &str, value: f64, precision: usize) -> Value {
        Value {
            label: label.to_owned(),
            key: key.to_owned(),
            value,
            precision,
        }
    }
}

struct Row {
    name: String,
    unit: &'static str,
    direct: f64,
    mesh: f64,
    ratio: f64,
}

impl Row {
    fn new(name: String, unit: &'static str, direct: f64, mesh: f64) -> Row {
        let ratio = if direct > 0.0 { mesh / direct } else { 0.0 };
        Row {
            name,
            unit,
            direct,
            mesh,
            ratio,
        }
    }
}

/// Slices a throughput or connection-rate figure is taken in, the paths alternating.
const SLICES: u64 = 5;

/// Measures `direct` and `mesh` over `secs` seconds each, in [`SLICES`] alternating slices (each
/// closure gets the slice length, whole seconds, and returns its rate), and returns the mean rate
/// of each path. Alternating makes both paths see the same spells of a VM whose speed drifts
/// within a minute, which one run after the other did not.
fn interleaved(
    secs: u64,
    mut direct: impl FnMut(u64) -> anyhow::Result<f64>,
    mut mesh: impl FnMut(u64) -> anyhow::Result<f64>,
) -> anyhow::Result<(f64, f64)> {
    let (slices, slice) = slicing(secs);
    let (mut d, mut m) = (0.0, 0.0);
    for _ in 0..slices {
        d += direct(slice)?;
        m += mesh(slice)?;
    }
    Ok((d / slices as f64, m / slices as f64))
}

/// `(slices, seconds per slice)` for `secs` seconds per path: up to [`SLICES`] slices of whole
/// seconds, at least one of a second; they cover `secs` rounded down to a multiple of the slice.
fn slicing(secs: u64) -> (u64, u64) {
    let slices = SLICES.min(secs).max(1);
    (slices, (secs / slices).max(1))
}

/// Runs iperf3 from `client` to `server`; returns Gbit/s and the bytes received.
fn iperf(client: &Pod, server: &Pod, streams: usize, secs: u64) -> anyhow::Result<(f64, f64)> {
    let port = "5201";
    let srv = Command::new("ip")
        .args([
            "netns",
            "exec",
            &server.netns_name,
            "iperf3",
            "-s",
            "-1",
            "-p",
            port,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start iperf3 (install the iperf3 package)")?;
    let _srv = ProcessGuard(srv);
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &client.netns_name,
            "iperf3",
            "-c",
            &server.ip.to_string(),
            "-p",
            port,
            "-J",
        ])
        .args(["-t", &secs.to_string(), "-P", &streams.to_string()])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("iperf3 JSON")?;
    let sum = &v["end"]["sum_received"];
    let bps = sum["bits_per_second"].as_f64().context("iperf3 result")?;
    let bytes = sum["bytes"].as_f64().context("iperf3 result")?;
    Ok((bps / 1e9, bytes))
}

/// An echo server's accept loop on its own thread. Stopping it (dropping it) shuts the listener
/// down, which wakes the blocked `accept`, and joins the thread: the port can then be listened on
/// again, whatever state the path to it is in.
struct EchoServer {
    addr: SocketAddr,
    /// The listening socket, shared with the thread.
    listener: std::net::TcpListener,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Listens on `server`'s IP and `port` and echoes [`MSG`]-byte messages: one message per
/// connection, then close (`close_after_reply`), or until the client closes (a thread each).
fn echo_server(server: &Pod, port: u16, close_after_reply: bool) -> anyhow::Result<EchoServer> {
    let ns = Netns::open(&server.netns_path)?;
    let listener = Lab::listen_in(&ns, SocketAddr::new(server.ip, port))?;
    serve_echo(listener, close_after_reply)
}

/// Runs [`echo_server`]'s accept loop on `listener`.
fn serve_echo(
    listener: std::net::TcpListener,
    close_after_reply: bool,
) -> anyhow::Result<EchoServer> {
    listener.set_nonblocking(false)?;
    let addr = listener.local_addr()?;
    let accepting = listener.try_clone()?;
    let thread = std::thread::spawn(move || {
        // Ends with the error `accept` returns once the listener is shut down.
        while let Ok((mut s, _)) = accepting.accept() {
            let _ = s.set_nodelay(true);
            let mut buf = [0u8; MSG];
            if close_after_reply {
                if s.read_exact(&mut buf).is_ok() {
                    let _ = s.write_all(&buf);
                }
                continue;
            }
            std::thread::spawn(move || {
                while s.read_exact(&mut buf).is_ok() {
                    if s.write_all(&buf).is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(EchoServer {
        addr,
        listener,
        thread: Some(thread),
    })
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        let _ = socket2::SockRef::from(&self.listener).shutdown(std::net::Shutdown::Both);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What a report needs to be compared with another one: the build, when it ran, and the
/// machine facts that move the figures (CPU count; the cpuidle driver and whether idle vCPUs poll
/// before halting, which sets the cost of a wake-up across CPUs).
struct Machine {
    /// `<crate version> (<git sha>)`.
    version: String,
    /// UTC start of the run, RFC 3339.
    started_at: String,
    cpus: usize,
    /// `<driver>, guest_halt_poll_ns=<n>` as far as sysfs tells (`unknown` parts otherwise).
    cpuidle: String,
}

impl Machine {
    fn read(started: time::OffsetDateTime) -> Machine {
        let sys = |path: &str| {
            std::fs::read_to_string(path)
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "unknown".to_owned())
        };
        Machine {
            version: format!("{} ({})", env!("CARGO_PKG_VERSION"), env!("ZTNODE_GIT_SHA")),
            started_at: started
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_else(|_| "unknown".to_owned()),
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpuidle: format!(
                "{}, guest_halt_poll_ns={}",
                sys("/sys/devices/system/cpu/cpuidle/current_driver"),
                sys("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
            ),
        }
    }
}

/// Round-trip percentiles of both paths, µs.
struct Latency {
    direct_p50: f64,
    direct_p99: f64,
    mesh_p50: f64,
    mesh_p99: f64,
}

/// 1 KiB round trips on one kept connection per path (`pods`: direct client, direct server, mesh
/// client, mesh server). The two paths alternate sample by sample, so both see the same machine
/// (CPU wake-up latency on this VM moves the direct p50 by tens of µs between runs; measuring the
/// paths one after the other would put that drift into the difference).
fn latency(
    pods: [&Pod; 4],
    n: usize,
    port: u16,
    placement: Placement,
    node_pid: u32,
) -> anyhow::Result<Latency> {
    let [d_client, d_server, m_client, m_server] = pods;
    // Pinned before the echo servers start, so their threads inherit the one CPU.
    let _pinned = (placement == Placement::OneCpu)
        .then(|| OneCpu::pin(node_pid))
        .transpose()?;
    let _polling = (placement == Placement::PollingIdle)
        .then(PollingIdle::hold)
        .transpose()?;
    let d_echo = echo_server(d_server, port, false)?;
    let m_echo = echo_server(m_server, port, false)?;
    let (d_addr, m_addr) = (d_echo.addr, m_echo.addr);
    let d_ns = Netns::open(&d_client.netns_path)?;
    let m_ns = Netns::open(&m_client.netns_path)?;
    let mut d = Lab::connect_from(&d_ns, d_addr)?;
    let mut m = Lab::connect_from(&m_ns, m_addr)?;
    d.set_nodelay(true)?;
    m.set_nodelay(true)?;
    let buf = [7u8; MSG];
    let mut back = [0u8; MSG];
    let mut round_trip = |s: &mut std::net::TcpStream| -> std::io::Result<f64> {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut back)?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    };
    for _ in 0..n / 10 {
        round_trip(&mut d)?;
        round_trip(&mut m)?;
    }
    let mut direct = Vec::with_capacity(n);
    let mut mesh = Vec::with_capacity(n);
    for _ in 0..n {
        direct.push(round_trip(&mut d)?);
        mesh.push(round_trip(&mut m)?);
    }
    drop((d, m));
    drop((d_echo, m_echo));
    direct.sort_by(f64::total_cmp);
    mesh.sort_by(f64::total_cmp);
    Ok(Latency {
        direct_p50: percentile(&direct, 0.5),
        direct_p99: percentile(&direct, 0.99),
        mesh_p50: percentile(&mesh, 0.5),
        mesh_p99: percentile(&mesh, 0.99),
    })
}

fn conn_rate(client: &Pod, server: &Pod, dur: Duration) -> anyhow::Result<f64> {
    let echo = echo_server(server, 7200, true)?;
    let addr = echo.addr;
    let ns = Netns::open(&client.netns_path)?;
    let buf = [9u8; MSG];
    let (count, elapsed) = ns.run(move || -> std::io::Result<(u64, f64)> {
        let start = Instant::now();
        let mut count = 0u64;
        let mut back = [0u8; MSG];
        while start.elapsed() < dur {
            let mut s = std::net::TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            s.write_all(&buf)?;
            s.read_exact(&mut back)?;
            let mut rest = [0u8; 1];
            let _ = s.read(&mut rest);
            count += 1;
        }
        Ok((count, start.elapsed().as_secs_f64()))
    })??;
    drop(echo);
    Ok(count as f64 / elapsed)
}

/// RSS of the node process while idle connections are held through the tunnel, KiB: after each
/// of [`IDLE_BATCHES`] batches of `n` connections (`held[i]` with `(i + 1) * n` open), and after
/// all closed.
///
/// The per-connection figure is the slope from `n` to `IDLE_BATCHES * n`: the first `n` also pay
/// one-time costs (code pages first touched by the data path, the first pooled HBONE connections
/// and their buffers, allocator pages), which are not a cost per held connection. Two batches past
/// the first halve the RSS noise per connection (how much freed memory of earlier sections a batch
/// happens to reuse moves each reading by about a MiB).
fn idle_connections(client: &Pod, server: &Pod, n: usize, pid: u32) -> anyhow::Result<IdleRss> {
    let ns = Netns::open(&client.netns_path)?;
    let sns = Netns::open(&server.netns_path)?;
    let addr = SocketAddr::new(server.ip, 7300);
    let listener = Lab::listen_in(&sns, addr)?;
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    let acceptor = std::thread::spawn(move || {
        let mut held = Vec::new();
        while held.len() < IDLE_BATCHES * n {
            match listener.accept() {
                Ok((s, _)) => {
                    held.push(s);
                    count.store(held.len(), std::sync::atomic::Ordering::Release);
                }
                Err(_) => break,
            }
        }
        held
    });
    // A client connect returns once ztnode's listener answered; the tunnel behind it is complete
    // when the app accepted it.
    let wait_accepted = |want: usize| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while accepted.load(std::sync::atomic::Ordering::Acquire) < want {
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {} of {want} idle connections reached the app",
                accepted.load(std::sync::atomic::Ordering::Acquire)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    let open = |count: usize| {
        ns.run(move || -> std::io::Result<Vec<std::net::TcpStream>> {
            (0..count)
                .map(|_| std::net::TcpStream::connect(addr))
                .collect()
        })
    };
    let mut clients = Vec::with_capacity(IDLE_BATCHES * n);
    let mut held = Vec::with_capacity(IDLE_BATCHES);
    for batch in 1..=IDLE_BATCHES {
        clients.extend(open(n)??);
        wait_accepted(batch * n)?;
        held.push(settle_rss(pid)?);
    }
    let accepted = acceptor
        .join()
        .map_err(|_| anyhow::anyhow!("acceptor panicked"))?;
    drop((clients, accepted));
    std::thread::sleep(Duration::from_secs(2));
    let after = settle_rss(pid)?;
    Ok(IdleRss { held, after })
}

/// Batches of idle connections [`idle_connections`] opens.
const IDLE_BATCHES: usize = 3;

/// RSS readings of [`idle_connections`], KiB.
struct IdleRss {
    /// After each batch (`held[i]`: `(i + 1) * n` connections open).
    held: Vec<u64>,
    /// After all closed.
    after: u64,
}

impl IdleRss {
    /// KiB per connection from the first batch to the last.
    fn per_conn(&self, n: usize) -> f64 {
        let (Some(first), Some(last)) = (self.held.first(), self.held.last()) else {
            return 0.0;
        };
        let conns = (self.held.len().saturating_sub(1) * n).max(1);
        last.saturating_sub(*first) as f64 / conns as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_alternate_and_average_each_path() {
        assert_eq!(slicing(10), (5, 2));
        assert_eq!(slicing(3), (3, 1));
        assert_eq!(slicing(0), (1, 1));
        let order = std::cell::RefCell::new(Vec::new());
        let (d, m) = interleaved(
            10,
            |s| {
                order.borrow_mut().push('d');
                Ok(s as f64 * (order.borrow().len() as f64))
            },
            |s| {
                order.borrow_mut().push('m');
                Ok(s as f64)
            },
        )
        .expect("measured");
        assert_eq!(order.into_inner().iter().collect::<String>(), "dmdmdmdmdm");
        // direct slices returned 2, 6, 10, 14 and 18
        assert_eq!((d, m), (10.0, 2.0));
    }

    #[test]
    fn a_stopped_echo_server_frees_its_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let echo = serve_echo(listener, true).expect("serve");
        let addr = echo.addr;
        let mut c = std::net::TcpStream::connect(addr).expect("connect");
        c.write_all(&[5u8; MSG]).expect("write");
        let mut back = [0u8; MSG];
        c.read_exact(&mut back).expect("echo");
        assert_eq!(back, [5u8; MSG]);
        drop(echo);
        std::net::TcpListener::bind(addr).expect("the port is free again");
    }

    #[test]
    fn per_connection_slope_runs_from_the_first_batch_to_the_last() {
        let idle = IdleRss {
            held: vec![10_000, 14_000, 16_000],
            after: 0,
        };
        // (16,000 - 10,000) KiB over the 2 × 1,000 connections past the first batch
        assert_eq!(idle.per_conn(1000), 3.0);
        // RSS that fell is no cost
        let fell = IdleRss {
            held: vec![10_000, 9_000, 9_500],
            after: 0,
        };
        assert_eq!(fell.per_conn(1000), 0.0);
        let one = IdleRss {
            held: vec![10_000],
            after: 0,
        };
        assert_eq!(one.per_conn(1000), 0.0);
    }
}
