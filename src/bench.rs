//! `ztnode bench`: what the mesh costs, measured in one run against the direct path.
//!
//! One lab node (see [`crate::lab`]) holds two pairs of pods on the same bridge: `d-client`/`d-server`
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

use crate::lab::{self, Lab, LabOptions, Pod, ProcessGuard};
use crate::netns::Netns;

/// Options of a bench run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Length of each throughput and connection-rate measurement.
    pub duration: Duration,
    /// Number of 1 KiB round trips for the latency figures.
    pub round_trips: usize,
    /// Enrolled pods for the "idle with N pods" RSS and the CNI ADD samples (≥ 2).
    pub pods: usize,
    /// Idle connections held open through the tunnel for the per-connection memory figure.
    pub idle_conns: usize,
    /// Where to write the JSON report.
    pub json: PathBuf,
    /// Keep the lab up this long before measuring (for attaching a profiler by hand).
    pub hold: Duration,
}

const PREFIX: &str = "ztbench";
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
    crate::raise_nofile_limit();
    // Namespaces an interrupted earlier run may have left.
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for name in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if name.starts_with(&format!("{PREFIX}-")) {
                let _ = Command::new("ip").args(["netns", "del", name]).output();
            }
        }
    }
    let exe = std::env::current_exe()?;
    let run_dir = std::env::temp_dir()
        .join(format!("ztnode-lab-{PREFIX}"))
        .join("run");
    let lab = Lab::new(LabOptions {
        prefix: PREFIX.into(),
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
    std::fs::write(&config, lab::local_config(PREFIX, &entries))?;
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

    let mut plugin_ms = Vec::new();
    let mut chain_ms = Vec::new();
    for (name, _) in mesh.iter().skip(2) {
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
    for streams in [1usize, 8] {
        let direct = iperf(&d_client, &d_server, streams, secs)?;
        let mesh_v = iperf(&m_client, &m_server, streams, secs)?;
        rows.push(Row::new(
            format!("throughput {streams} stream(s)"),
            "Gbit/s",
            direct,
            mesh_v,
            true,
        ));
    }
    let (d50, d99) = latency(&d_client, &d_server, opts.round_trips)?;
    let (m50, m99) = latency(&m_client, &m_server, opts.round_trips)?;
    rows.push(Row::new(
        "1 KiB round trip p50".into(),
        "µs",
        d50,
        m50,
        false,
    ));
    rows.push(Row::new(
        "1 KiB round trip p99".into(),
        "µs",
        d99,
        m99,
        false,
    ));
    let dc = conn_rate(&d_client, &d_server, opts.duration)?;
    let mc = conn_rate(&m_client, &m_server, opts.duration)?;
    rows.push(Row::new(
        "connect + 1 KiB RTT + close".into(),
        "conn/s",
        dc,
        mc,
        true,
    ));

    let (rss_conns, rss_after) = idle_connections(&m_client, &m_server, opts.idle_conns, pid)?;
    let per_conn =
        (rss_conns.saturating_sub(rss_n)) as f64 * 1024.0 / opts.idle_conns.max(1) as f64;

    println!(
        "\nztnode bench ({}s per throughput/rate figure, {} round trips, 2 cores shared by everything)",
        secs, opts.round_trips
    );
    println!(
        "{:<32} {:>12} {:>12} {:>10}",
        "figure", "direct", "ztnode", "ratio"
    );
    for r in &rows {
        println!(
            "{:<32} {:>12.2} {:>12.2} {:>9.2}x  {}",
            r.name, r.direct, r.mesh, r.ratio, r.unit
        );
    }
    println!(
        "{:<32} {:>12} {:>12.2} {:>10}",
        "added RTT p50 (µs)",
        "",
        m50 - d50,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.2} {:>10}",
        "added RTT p99 (µs)",
        "",
        m99 - d99,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.1} {:>10}",
        "RSS idle, 2 pods (MiB)",
        "",
        rss_2 as f64 / 1024.0,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.1} {:>10}",
        format!("RSS idle, {} pods (MiB)", opts.pods),
        "",
        rss_n as f64 / 1024.0,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.1} {:>10}",
        format!("RSS, {} idle conns (MiB)", opts.idle_conns),
        "",
        rss_conns as f64 / 1024.0,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.2} {:>10}",
        "per idle connection (KiB)",
        "",
        per_conn / 1024.0,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.1} {:>10}",
        "RSS after they closed (MiB)",
        "",
        rss_after as f64 / 1024.0,
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.2} {:>10}",
        "ztnode-cni ADD p50 (ms)",
        "",
        percentile(&plugin_ms, 0.5),
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.2} {:>10}",
        "ztnode-cni ADD p99 (ms)",
        "",
        percentile(&plugin_ms, 0.99),
        ""
    );
    println!(
        "{:<32} {:>12} {:>12.2} {:>10}",
        "whole chain ADD p50 (ms)",
        "",
        percentile(&chain_ms, 0.5),
        ""
    );

    let report = json!({
        "duration_secs": secs,
        "round_trips": opts.round_trips,
        "figures": rows.iter().map(|r| json!({"name": r.name, "unit": r.unit, "direct": r.direct, "ztnode": r.mesh, "ratio": r.ratio})).collect::<Vec<_>>(),
        "added_rtt_p50_us": m50 - d50,
        "added_rtt_p99_us": m99 - d99,
        "rss_kib": {"idle_2_pods": rss_2, "idle_pods": rss_n, "pods": opts.pods, "idle_conns": rss_conns, "conns": opts.idle_conns, "after_close": rss_after},
        "per_idle_conn_bytes": per_conn,
        "cni_add_ms": {"ztnode_cni_p50": percentile(&plugin_ms, 0.5), "ztnode_cni_p99": percentile(&plugin_ms, 0.99),
                       "chain_p50": percentile(&chain_ms, 0.5), "chain_p99": percentile(&chain_ms, 0.99), "samples": plugin_ms.len()},
    });
    std::fs::write(&opts.json, serde_json::to_vec_pretty(&report)?)?;
    println!("\nJSON written to {}", opts.json.display());
    let kept_log = opts.json.with_extension("node.log");
    if std::fs::copy(&log, &kept_log).is_ok() {
        println!("node log kept at {}", kept_log.display());
    }
    drop(node);
    Ok(())
}

struct Row {
    name: String,
    unit: &'static str,
    direct: f64,
    mesh: f64,
    ratio: f64,
}

impl Row {
    fn new(
        name: String,
        unit: &'static str,
        direct: f64,
        mesh: f64,
        higher_is_better: bool,
    ) -> Row {
        let _ = higher_is_better;
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

fn iperf(client: &Pod, server: &Pod, streams: usize, secs: u64) -> anyhow::Result<f64> {
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
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 result")?;
    Ok(bps / 1e9)
}

fn echo_server(
    server: &Pod,
    port: u16,
    close_after_reply: bool,
) -> anyhow::Result<(SocketAddr, std::thread::JoinHandle<()>)> {
    let ns = Netns::open(&server.netns_path)?;
    let addr = SocketAddr::new(server.ip, port);
    let listener = Lab::listen_in(&ns, addr)?;
    listener.set_nonblocking(false)?;
    let handle = std::thread::spawn(move || {
        while let Ok((mut s, _)) = listener.accept() {
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
    Ok((addr, handle))
}

/// Unblocks an accept loop by connecting once and sending nothing (the server drops it).
fn stop_server(client: &Netns, addr: SocketAddr, listener_thread: std::thread::JoinHandle<()>) {
    drop(listener_thread);
    let _ = Lab::connect_from(client, addr);
}

fn latency(client: &Pod, server: &Pod, n: usize) -> anyhow::Result<(f64, f64)> {
    let (addr, handle) = echo_server(server, 7100, false)?;
    let ns = Netns::open(&client.netns_path)?;
    let mut s = Lab::connect_from(&ns, addr)?;
    s.set_nodelay(true)?;
    let buf = [7u8; MSG];
    let mut back = [0u8; MSG];
    for _ in 0..n / 10 {
        s.write_all(&buf)?;
        s.read_exact(&mut back)?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut back)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(s);
    stop_server(&ns, addr, handle);
    samples.sort_by(f64::total_cmp);
    Ok((percentile(&samples, 0.5), percentile(&samples, 0.99)))
}

fn conn_rate(client: &Pod, server: &Pod, dur: Duration) -> anyhow::Result<f64> {
    let (addr, handle) = echo_server(server, 7200, true)?;
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
    stop_server(&ns, addr, handle);
    Ok(count as f64 / elapsed)
}

fn idle_connections(client: &Pod, server: &Pod, n: usize, pid: u32) -> anyhow::Result<(u64, u64)> {
    let ns = Netns::open(&client.netns_path)?;
    let sns = Netns::open(&server.netns_path)?;
    let addr = SocketAddr::new(server.ip, 7300);
    let listener = Lab::listen_in(&sns, addr)?;
    let acceptor = std::thread::spawn(move || {
        let mut held = Vec::new();
        while held.len() < n {
            match listener.accept() {
                Ok((s, _)) => held.push(s),
                Err(_) => break,
            }
        }
        held
    });
    let conns = ns.run(move || -> std::io::Result<Vec<std::net::TcpStream>> {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(std::net::TcpStream::connect(addr)?);
        }
        Ok(v)
    })??;
    let held = acceptor
        .join()
        .map_err(|_| anyhow::anyhow!("acceptor panicked"))?;
    let rss = settle_rss(pid)?;
    drop(conns);
    drop(held);
    std::thread::sleep(Duration::from_secs(2));
    let after = settle_rss(pid)?;
    Ok((rss, after))
}
