//! `ztnode bench --peer PATH`: ztnode's proxy and another proxy (the real ztunnel) side by side on
//! the same lab, agent, rules and pods, only the proxy swapped.
//!
//! The lab holds the bench's four pods (`d-client`/`d-server` outside the mesh, `m-client`/
//! `m-server` enrolled) and runs `ztnode agent`, which serves ZDS on `<run dir>/ztunnel.sock`. Each
//! round starts one proxy in the node netns, waits until it serves both enrolled pods, measures,
//! and stops it; the proxies alternate (ztnode, peer, ztnode, peer, ...), so both see the same
//! spells of a VM whose speed drifts. ztnode runs as `ztnode proxy`; the peer as ztunnel is run
//! standalone (`INPOD_UDS`, `LOCAL_XDS_PATH` with the same local config, `FAKE_CA=true`, no xDS
//! or CA address, `NODE_NAME`, `PROXY_MODE=shared`): a ztunnel built with its `testing` feature.
//!
//! Per round and proxy: iperf3 throughput of 1 and 8 streams with the proxy's CPU time and the
//! whole node's busy CPU time per GB carried, connections per second (connect, 1 KiB round trip,
//! close) with the p99 time per connection (again with idle CPUs polling, [`PollingIdle`], when
//! the machine has that state: the share of the rate that is the VM's cost of waking a halted
//! CPU), the 1 KiB round trip the mesh adds over the direct pair (p99(mesh) − p99(direct) for the
//! p99; all threads on one CPU, and unpinned), and the proxy's RSS idle (read first) and per held
//! idle connection. The proxy's CPU time is its user + system time: kernel threads' work is not
//! in it, and interrupt and softirq work (TCP receive, pacing timers) is in it only when it ran
//! while a proxy thread was on the CPU (without IRQ time accounting in effect, as on this
//! bench's VMs), so a busier proxy is charged more of the node's packets; the node's figure
//! counts all of it. Both proxies protect
//! records in user space. The report gives each figure's mean per proxy, the ratio ztnode /
//! peer with the lowest and highest single-round ratio, and the target; JSON too.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use super::busy::Busy;
use super::measure::{self, conn_rate_timed, cpu_seconds, iperf, machine_cpu_seconds, settle_rss};
use super::options::BenchOptions;
use super::placement::{Placement, PollingIdle};
use crate::lab::node::{
    Lab, LabOptions, Pod, ProcessGuard, local_config, local_config_with_protocol,
};

const SUBNET: &str = "10.251.0.0/16";

/// Which proxy serves the pods in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proxy {
    Ztnode,
    Peer,
    /// The plain-relay reference: ztnode's proxy with both workloads on protocol TCP, so two
    /// user-space relays in the same places (outbound capture in the client pod, inbound capture
    /// in the server pod) move the bytes in plain TCP, without TLS or HTTP/2 (with ztnode's TCP
    /// relay, and a TCP connection more per connection than HBONE over a pooled one).
    Plain,
}

impl Proxy {
    fn name(self) -> &'static str {
        match self {
            Proxy::Ztnode => "ztnode",
            Proxy::Peer => "peer",
            Proxy::Plain => "plain",
        }
    }
}

/// One figure: its label, JSON key, unit, whether more is better, the target ratio ztnode / peer
/// (from the performance issue), and the samples of each proxy, one per round.
struct Figure {
    label: &'static str,
    key: &'static str,
    unit: &'static str,
    higher_is_better: bool,
    target: Option<f64>,
    ztnode: Vec<f64>,
    peer: Vec<f64>,
    plain: Vec<f64>,
}

impl Figure {
    fn new(
        label: &'static str,
        key: &'static str,
        unit: &'static str,
        higher_is_better: bool,
        target: Option<f64>,
    ) -> Figure {
        Figure {
            label,
            key,
            unit,
            higher_is_better,
            target,
            ztnode: Vec::new(),
            peer: Vec::new(),
            plain: Vec::new(),
        }
    }

    fn push(&mut self, proxy: Proxy, v: f64) {
        match proxy {
            Proxy::Ztnode => self.ztnode.push(v),
            Proxy::Peer => self.peer.push(v),
            Proxy::Plain => self.plain.push(v),
        }
    }

    /// ztnode's mean over the peer's (0 when the peer's is 0).
    fn ratio(&self) -> f64 {
        ratio(&self.ztnode, &self.peer)
    }

    /// ztnode's sample over the peer's, round by round (rounds where the peer's is not 0; every
    /// round measures the same figures, so the i-th samples are one round's). The spread shows
    /// how far the VM's drift moves a ratio: a target inside it is not settled by one run. For
    /// the added round trips (differences to the direct path) a small peer figure makes a wide
    /// spread.
    fn round_ratios(&self) -> Vec<f64> {
        self.ztnode
            .iter()
            .zip(&self.peer)
            .filter(|(_, p)| **p != 0.0)
            .map(|(z, p)| z / p)
            .collect()
    }

    /// The median of [`Figure::round_ratios`] (the mean of the middle two for an even count;
    /// `None` without rounds): the pairs' typical ratio, which a round caught in one of the VM's
    /// slow spells moves less than it moves the ratio of the means.
    fn median_round_ratio(&self) -> Option<f64> {
        let mut r = self.round_ratios();
        if r.is_empty() {
            return None;
        }
        r.sort_by(f64::total_cmp);
        let mid = r.len() / 2;
        Some(if r.len().is_multiple_of(2) {
            (r[mid - 1] + r[mid]) / 2.0
        } else {
            r[mid]
        })
    }

    /// The lowest and highest of [`Figure::round_ratios`] as `lo–hi` (`-` without rounds).
    fn spread(&self) -> String {
        let r = self.round_ratios();
        let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if r.is_empty() {
            "-".into()
        } else {
            format!("{lo:.2}–{hi:.2}")
        }
    }

    /// The plain relays' mean over the peer's (0 without samples).
    fn plain_ratio(&self) -> f64 {
        ratio(&self.plain, &self.peer)
    }

    /// Whether the ratio meets the target (`None` without a target).
    fn met(&self) -> Option<bool> {
        let t = self.target?;
        let r = self.ratio();
        Some(if self.higher_is_better {
            r >= t
        } else {
            r <= t
        })
    }
}

/// `mean(a) / mean(b)`; 0 when `b`'s mean is 0.
fn ratio(a: &[f64], b: &[f64]) -> f64 {
    let d = mean(b);
    if d == 0.0 { 0.0 } else { mean(a) / d }
}

/// The mean of `v`; 0 when empty.
fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The figures in report order (indices used by [`measure_round`]).
fn figures() -> Vec<Figure> {
    vec![
        Figure::new(
            "throughput 1 stream",
            "throughput_1_gbps",
            "Gbit/s",
            true,
            Some(1.5),
        ),
        Figure::new(
            "throughput 8 streams",
            "throughput_8_gbps",
            "Gbit/s",
            true,
            Some(1.5),
        ),
        Figure::new(
            "proxy CPU per GB, 1 stream",
            "cpu_s_per_gb_1",
            "s",
            false,
            Some(0.7),
        ),
        Figure::new(
            "proxy CPU per GB, 8 streams",
            "cpu_s_per_gb_8",
            "s",
            false,
            Some(0.7),
        ),
        Figure::new(
            "connect + 1 KiB RTT + close",
            "conn_per_sec",
            "conn/s",
            true,
            Some(1.5),
        ),
        Figure::new(
            "  p99 per connection",
            "conn_p99_ms",
            "ms",
            false,
            Some(1.0),
        ),
        Figure::new(
            "added RTT p50, one CPU",
            "added_rtt_p50_one_cpu_us",
            "µs",
            false,
            Some(0.8),
        ),
        Figure::new(
            "added RTT p99, one CPU",
            "added_rtt_p99_one_cpu_us",
            "µs",
            false,
            Some(0.8),
        ),
        Figure::new(
            "added RTT p50, unpinned",
            "added_rtt_p50_us",
            "µs",
            false,
            None,
        ),
        Figure::new(
            "added RTT p99, unpinned",
            "added_rtt_p99_us",
            "µs",
            false,
            None,
        ),
        Figure::new(
            "proxy RSS idle, 2 pods",
            "rss_idle_mib",
            "MiB",
            false,
            Some(0.5),
        ),
        Figure::new(
            "proxy RSS per idle connection",
            "rss_per_idle_conn_kib",
            "KiB",
            false,
            Some(0.5),
        ),
        Figure::new(
            "  of RSS idle: anonymous",
            "rss_idle_anon_mib",
            "MiB",
            false,
            None,
        ),
        // how much of the connection rate is this VM's cost of waking a halted CPU
        Figure::new(
            "conn/s, idle CPUs polling",
            "conn_per_sec_polling_idle",
            "conn/s",
            true,
            None,
        ),
        // what the node pays, wherever the kernel's network work ran
        Figure::new(
            "node CPU per GB, 1 stream",
            "node_cpu_s_per_gb_1",
            "s",
            false,
            None,
        ),
        Figure::new(
            "node CPU per GB, 8 streams",
            "node_cpu_s_per_gb_8",
            "s",
            false,
            None,
        ),
        // many connections' small messages at once: where serving one IO event per driver turn
        // (runtime.rs) costs a busy proxy its batching
        Figure::new(
            "1 KiB RTTs, 8 conns at once",
            "parallel_rtt_8_per_sec",
            "RTT/s",
            true,
            None,
        ),
        Figure::new(
            "1 KiB RTTs, 32 conns at once",
            "parallel_rtt_32_per_sec",
            "RTT/s",
            true,
            None,
        ),
    ]
}

/// Runs the side-by-side bench against the proxy at `peer`.
pub(super) fn run(opts: &BenchOptions, peer: &Path, busy: &Busy) -> anyhow::Result<()> {
    anyhow::ensure!(
        peer.is_file(),
        "--peer {}: no such file (a ztunnel built with `--features testing`)",
        peer.display()
    );
    let exe = std::env::current_exe()?;
    let prefix = opts.lab_prefix.as_str();
    let base = std::env::temp_dir().join(format!("ztnode-lab-{prefix}"));
    let run_dir = base.join("run");
    let _ = std::fs::remove_dir_all(&run_dir);
    let lab = Lab::new(LabOptions {
        prefix: prefix.into(),
        ztnode_binary: Some(exe.clone()),
        run_dir: run_dir.clone(),
        subnet: SUBNET.into(),
        cni_version: "1.0.0".into(),
    })?;
    let ip = |n: u8| std::net::IpAddr::from([10, 251, 0, n]);
    let workloads = [
        ("m-client", "bench", "m-client", ip(4)),
        ("m-server", "bench", "m-server", ip(5)),
    ];
    let config = lab.dir().join("local-config.yaml");
    std::fs::write(&config, local_config(lab.node_name(), &workloads))?;
    let plain_config = lab.dir().join("local-config-plain.yaml");
    std::fs::write(
        &plain_config,
        local_config_with_protocol(lab.node_name(), &workloads, "TCP"),
    )?;
    let zds = run_dir.join("ztunnel.sock");
    let lab_ctx = Ctx {
        lab: &lab,
        exe: &exe,
        peer,
        config: &config,
        plain_config: &plain_config,
        run_dir: &run_dir,
        zds: &zds,
    };
    let _agent = lab_ctx.start_agent()?;
    // A proxy must take the enrolled pods' ADDs.
    let mut running = Some((Proxy::Ztnode, lab_ctx.start(Proxy::Ztnode)?));
    let pods = ["d-client", "d-server", "m-client", "m-server"]
        .map(|n| lab.add_pod(n, "bench"))
        .into_iter()
        .collect::<Result<Vec<Pod>, _>>()?;
    let pods: [Pod; 4] = pods.try_into().map_err(|_| anyhow::anyhow!("four pods"))?;
    anyhow::ensure!(
        pods[2].ip == ip(4) && pods[3].ip == ip(5),
        "unexpected pod IPs"
    );
    let mut figs = figures();
    let rounds = opts.rounds.max(1);
    // decided once, so every round has the same figures and rounds pair up
    let polling = PollingIdle::check().is_ok();
    for round in 0..rounds {
        // A B C, then C B A: a drift within a round does not always favour the same proxy
        let order = if round % 2 == 0 {
            [Proxy::Ztnode, Proxy::Peer, Proxy::Plain]
        } else {
            [Proxy::Plain, Proxy::Peer, Proxy::Ztnode]
        };
        for proxy in order {
            // A fresh process for every measurement, also when the same proxy ran just before
            // (the end of one round and the start of the next): its idle RSS is read first.
            let process = match running.take() {
                Some((p, process)) if p == proxy && round == 0 => process,
                other => {
                    if let Some((_, old)) = other {
                        stop(old);
                    }
                    lab_ctx.start(proxy)?
                }
            };
            wait_serving(&pods).with_context(|| {
                let log = lab.dir().join(format!("{}.log", proxy.name()));
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                format!(
                    "{} does not serve the pods; the end of its log:\n{}",
                    proxy.name(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })?;
            eprintln!("bench: round {}/{rounds}, {}", round + 1, proxy.name());
            if !opts.hold.is_zero() {
                eprintln!(
                    "bench: holding {:?}: {} pid {}",
                    opts.hold,
                    proxy.name(),
                    process.0.id()
                );
                std::thread::sleep(opts.hold);
            }
            measure_round(opts, &pods, process.0.id(), proxy, polling, &mut figs)?;
            running = Some((proxy, process));
        }
    }
    if let Some((_, p)) = running.take() {
        stop(p);
    }
    print(&figs, rounds, peer);
    // again under the table, where the figures it disturbed are read
    if let Some(warning) = busy.warning() {
        println!("{warning}");
    }
    write_json(opts, &figs, rounds, peer, busy)
}

/// What starting a process of the lab needs.
struct Ctx<'a> {
    lab: &'a Lab,
    exe: &'a Path,
    peer: &'a Path,
    config: &'a Path,
    plain_config: &'a Path,
    run_dir: &'a Path,
    zds: &'a Path,
}

impl Ctx<'_> {
    /// `ztnode agent` serving ZDS on `zds`, once its plugin socket is up.
    fn start_agent(&self) -> anyhow::Result<ProcessGuard> {
        let log = self.lab.dir().join("agent.log");
        let mut cmd = Command::new(self.exe);
        cmd.arg("agent")
            .arg("--config")
            .arg(self.config)
            .arg("--run-dir")
            .arg(self.run_dir)
            .arg("--no-install")
            .env("ZTUNNEL_UDS_ADDRESS", self.zds)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let agent = ProcessGuard(self.lab.spawn_in_node(cmd)?);
        let socket = crate::podevent::plugin_socket_path(self.run_dir);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(socket.exists() && self.zds.exists()) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "ztnode agent did not start; see {}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(agent)
    }

    /// Starts `proxy` in the node netns, connected to the agent's ZDS socket.
    fn start(&self, proxy: Proxy) -> anyhow::Result<ProcessGuard> {
        let log = self.lab.dir().join(format!("{}.log", proxy.name()));
        let mut cmd = match proxy {
            Proxy::Ztnode | Proxy::Plain => {
                let config = if proxy == Proxy::Plain {
                    self.plain_config
                } else {
                    self.config
                };
                let mut c = Command::new(self.exe);
                c.arg("proxy")
                    .arg("--config")
                    .arg(config)
                    .arg("--run-dir")
                    .arg(self.run_dir);
                c
            }
            Proxy::Peer => {
                let mut c = Command::new(self.peer);
                c.env("LOCAL_XDS_PATH", self.config)
                    .env("FAKE_CA", "true")
                    .env("XDS_ADDRESS", "")
                    .env("CA_ADDRESS", "")
                    .env("PROXY_MODE", "shared")
                    .env("NODE_NAME", self.lab.node_name());
                c
            }
        };
        cmd.env("INPOD_UDS", self.zds)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        Ok(ProcessGuard(self.lab.spawn_in_node(cmd)?))
    }
}

/// Stops a proxy (SIGTERM; SIGKILL after 3 s) and waits until it is gone, so its in-pod
/// listeners are closed before the next proxy binds its own.
fn stop(process: ProcessGuard) {
    drop(process);
}

/// Waits until both enrolled pods have an HBONE listener and a connection through the mesh
/// completes (up to 30 s).
fn wait_serving(pods: &[Pod; 4]) -> anyhow::Result<()> {
    let [_, _, m_client, m_server] = pods;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listening = [m_client, m_server].iter().all(|p| {
            Lab::exec_in(&p.netns_name, "ss")
                .args(["-ltnH", "sport", "=", ":15008"])
                .output()
                .is_ok_and(|o| !o.stdout.is_empty())
        });
        if listening
            // one connection: a burst here would grow the heap before the idle reading
            && conn_rate_timed(m_client, m_server, Duration::from_millis(1))
                .is_ok_and(|r| !r.each_ms.is_empty())
        {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "not serving after 30 s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Measures every figure once with `proxy` (process `pid`) serving the pods; the connection
/// rate with idle CPUs polling only when `polling` ([`PollingIdle::check`]).
fn measure_round(
    opts: &BenchOptions,
    pods: &[Pod; 4],
    pid: u32,
    proxy: Proxy,
    polling: bool,
    figs: &mut [Figure],
) -> anyhow::Result<()> {
    let [d_client, d_server, m_client, m_server] = pods;
    let secs = opts.duration.as_secs().max(1);
    // idle: before any load grew the allocator's heap (the plain reference is for speed only)
    if proxy != Proxy::Plain {
        figs[10].push(proxy, settle_rss(pid)? as f64 / 1024.0);
        figs[12].push(proxy, measure::rss_anon_kib(pid)? as f64 / 1024.0);
    }
    for (i, streams) in [(0usize, 1usize), (1, 8)] {
        let cpu = cpu_seconds(pid)?;
        let node_cpu = machine_cpu_seconds()?;
        let (gbps, bytes) = iperf(m_client, m_server, streams, secs)?;
        let node_cpu = machine_cpu_seconds()? - node_cpu;
        let cpu = cpu_seconds(pid)? - cpu;
        let per_gb = |s: f64| if bytes > 0.0 { s / (bytes / 1e9) } else { 0.0 };
        figs[i].push(proxy, gbps);
        figs[i + 2].push(proxy, per_gb(cpu));
        figs[i + 14].push(proxy, per_gb(node_cpu));
    }
    let rate = conn_rate_timed(m_client, m_server, Duration::from_secs(secs))?;
    figs[4].push(proxy, rate.per_sec);
    figs[5].push(proxy, measure::percentile(&rate.each_ms, 0.99));
    let dur = Duration::from_secs(secs);
    for (i, conns) in [(16usize, 8usize), (17, 32)] {
        figs[i].push(
            proxy,
            measure::parallel_round_trips(m_client, m_server, conns, dur)?,
        );
    }
    if polling {
        let _polling = PollingIdle::hold()?;
        let rate = conn_rate_timed(m_client, m_server, Duration::from_secs(secs))?;
        figs[13].push(proxy, rate.per_sec);
    }
    for (i, placement) in [(6usize, Placement::OneCpu), (8, Placement::Free)] {
        let l = measure::latency(
            [d_client, d_server, m_client, m_server],
            opts.round_trips,
            7100,
            placement,
            pid,
        )?;
        figs[i].push(proxy, l.mesh_p50 - l.direct_p50);
        figs[i + 1].push(proxy, l.mesh_p99 - l.direct_p99);
    }
    if proxy != Proxy::Plain {
        let idle = measure::idle_connections(m_client, m_server, opts.idle_conns, pid)?;
        figs[11].push(proxy, idle.per_conn(opts.idle_conns));
    }
    Ok(())
}

fn print(figs: &[Figure], rounds: usize, peer: &Path) {
    println!(
        "\nztnode bench --peer {} ({rounds} rounds, proxies alternating; means)",
        peer.display()
    );
    println!(
        "{:<34} {:>10} {:>10} {:>8} {:>8} {:>11} {:>8} {:>10} {:>8}  unit",
        "figure", "ztnode", "peer", "ratio", "median", "per round", "target", "plain", "plain/p"
    );
    for f in figs {
        let target = match (f.target, f.met()) {
            (Some(t), Some(true)) => {
                format!("{}{t} ok", if f.higher_is_better { ">=" } else { "<=" })
            }
            (Some(t), _) => format!("{}{t} no", if f.higher_is_better { ">=" } else { "<=" }),
            _ => "-".into(),
        };
        let median = f
            .median_round_ratio()
            .map_or_else(|| "-".to_string(), |m| format!("{m:.2}x"));
        println!(
            "{:<34} {:>10.2} {:>10.2} {:>7.2}x {:>8} {:>11} {:>8} {:>10.2} {:>7.2}x  {}",
            f.label,
            mean(&f.ztnode),
            mean(&f.peer),
            f.ratio(),
            median,
            f.spread(),
            target,
            mean(&f.plain),
            f.plain_ratio(),
            f.unit
        );
    }
    println!(
        "ratio: of the means; median and per round: of each round's own ratio (ztnode's sample \
         over the peer's, up to minutes apart), the median and the lowest and highest (the \
         VM's drift; a target inside that range is not settled by this run)"
    );
    println!(
        "node CPU: the whole machine's busy time (every process and the kernel's softirq work, \
         iperf3 included) per GB; proxy CPU holds only what ran in the proxy's threads"
    );
    println!(
        "plain: ztnode's proxy with the workloads on protocol TCP (two relays in the same places, \
         no TLS, no HTTP/2): a reference for what TLS and HTTP/2 cost, not a strict bound"
    );
}

fn write_json(
    opts: &BenchOptions,
    figs: &[Figure],
    rounds: usize,
    peer: &Path,
    busy: &Busy,
) -> anyhow::Result<()> {
    let mut report = json!({
        "peer": peer.display().to_string(),
        "rounds": rounds,
        "duration_secs": opts.duration.as_secs(),
        "round_trips": opts.round_trips,
        "idle_conns": opts.idle_conns,
        "figures": figs.iter().map(|f| json!({
            "key": f.key,
            "name": f.label.trim(),
            "unit": f.unit,
            "ztnode": f.ztnode,
            "peer": f.peer,
            "plain": f.plain,
            "ztnode_mean": mean(&f.ztnode),
            "peer_mean": mean(&f.peer),
            "plain_mean": mean(&f.plain),
            "ratio": f.ratio(),
            "round_ratios": f.round_ratios(),
            "median_round_ratio": f.median_round_ratio(),
            "plain_ratio": f.plain_ratio(),
            "target": f.target,
            "met": f.met(),
        })).collect::<Vec<_>>(),
    });
    busy.add_to(&mut report);
    std::fs::write(&opts.json, serde_json::to_vec_pretty(&report)?)?;
    println!("\nJSON written to {}", opts.json.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_and_targets_follow_the_direction_of_the_figure() {
        let mut faster = Figure::new("t", "t", "Gbit/s", true, Some(1.5));
        for (z, p) in [(9.0, 6.0), (10.0, 6.0)] {
            faster.push(Proxy::Ztnode, z);
            faster.push(Proxy::Peer, p);
        }
        assert!((faster.ratio() - 9.5 / 6.0).abs() < 1e-9);
        assert_eq!(faster.met(), Some(true));
        let mut cpu = Figure::new("c", "c", "s", false, Some(0.7));
        cpu.push(Proxy::Ztnode, 1.4);
        cpu.push(Proxy::Peer, 1.6);
        assert_eq!(cpu.met(), Some(false), "0.875 is over 0.7");
        let empty = Figure::new("e", "e", "s", false, None);
        assert_eq!((empty.ratio(), empty.met()), (0.0, None));
        assert_eq!(faster.round_ratios(), vec![1.5, 10.0 / 6.0]);
        let mut zero = Figure::new("z", "z", "µs", false, None);
        for (z, p) in [(5.0, 0.0), (5.0, 10.0)] {
            zero.push(Proxy::Ztnode, z);
            zero.push(Proxy::Peer, p);
        }
        assert_eq!(
            zero.round_ratios(),
            vec![0.5],
            "a round without a peer figure has no ratio"
        );
        assert_eq!(faster.spread(), "1.50–1.67");
        assert!(
            (faster.median_round_ratio().unwrap_or(0.0) - (1.5 + 10.0 / 6.0) / 2.0).abs() < 1e-9
        );
        assert_eq!(zero.median_round_ratio(), Some(0.5));
        assert_eq!(empty.median_round_ratio(), None);
        let mut odd = Figure::new("o", "o", "conn/s", true, Some(1.5));
        for (z, p) in [(30.0, 10.0), (12.0, 10.0), (16.0, 10.0)] {
            odd.push(Proxy::Ztnode, z);
            odd.push(Proxy::Peer, p);
        }
        assert_eq!(
            odd.median_round_ratio(),
            Some(1.6),
            "the middle ratio, not the mean's 1.93 that one fast round lifts"
        );
        assert_eq!(empty.spread(), "-");
        faster.push(Proxy::Plain, 12.0);
        assert!((faster.plain_ratio() - 12.0 / 6.0).abs() < 1e-9);
        assert_eq!(empty.plain_ratio(), 0.0);
    }
}
