//! `ztnode bench --soak MINUTES`: the node under a steady mixed load for a long time, watched for
//! growth and failures.
//!
//! On the bench's main lab ([`super::setup::start`]), all through the mesh (the enrolled
//! `m-client` to `m-server`, over HBONE), for the given time:
//!
//! - connection churn: a new connection, one 1 KiB round trip (the echo checked) and close, at
//!   `--soak-rate` per second from one thread in the client's netns ([`load::churn`]);
//! - long streams: `--soak-streams` connections held for the whole run, each echoing a 64 KiB
//!   block every 100 ms, every byte checked; a stream that breaks is a failed connection
//!   ([`load::stream`]);
//! - pod churn: every [`CYCLE`] a pod (`c0`..`c3` in turn) is added through the CNI chain, a
//!   connection made from it to the server and one from the client to it, and it is deleted
//!   [`control::POD_CYCLES`] cycles later; its workload is in the local config from before its
//!   ADD until its DEL ([`control::Control`]);
//! - policy pushes: every [`PUSH_CYCLES`] cycles the local config is rewritten with a changed
//!   namespace-wide ALLOW policy (it allows the soak's clients, with a harmless second rule that
//!   names the push) and, every other push, an extra DENY nothing matches; each push is waited for
//!   in `/config_dump`.
//!
//! Every `--soak-sample-secs` (60) one line: the node's RSS, fds, threads, its
//! `istio_tcp_sockets_open` and `workload_manager_active_proxy_count`, and the load's counts. A
//! sample is taken at the same point of the control cycle each time (after the expired pod went,
//! before the next is added), so the pods alive are the same. The verdict ([`sample::judge`])
//! compares the last sample with the warm-up one (after the first interval or a tenth of the run,
//! whichever is later): more than 10 % growth of RSS or fds, any failed connection or other error
//! fails the run (exit 1). The samples go to the JSON report.

mod control;
mod load;
mod sample;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use super::busy::Busy;
use super::measure::echo_server;
use super::options::{BenchOptions, SoakOptions};
use super::report::{self, Machine};
use super::setup;
use crate::lab::http;
use crate::mesh::METRICS_PORT;
use crate::netns::Netns;
use control::Control;
use load::Tally;
use sample::{Sample, Verdict};

/// One control cycle: a pod is added each cycle, samples are taken at a cycle's start.
pub const CYCLE: Duration = Duration::from_secs(5);
/// Cycles from one policy push to the next.
pub const PUSH_CYCLES: u64 = 2;
/// The server's one-shot echo port (the churn's and the added pods' connections).
const CHURN_PORT: u16 = 7400;
/// The server's echo port of the long streams.
const STREAM_PORT: u16 = 7401;
/// Failure reasons printed with the verdict.
const PRINTED_REASONS: usize = 5;

/// Runs the soak on the main lab; returns whether it passed. Errors are failures to set up.
pub(super) fn run(opts: &BenchOptions, soak: &SoakOptions, busy: &Busy) -> anyhow::Result<bool> {
    anyhow::ensure!(
        !soak.duration.is_zero(),
        "--soak must be more than 0 minutes"
    );
    anyhow::ensure!(soak.rate >= 1, "--soak-rate must be at least 1");
    anyhow::ensure!(
        soak.sample >= Duration::from_secs(1),
        "--soak-sample-secs must be at least 1"
    );
    let started = time::OffsetDateTime::now_utc();
    let bed = setup::start(opts)?;
    let [_, _, client, server] = bed.pods();
    let churn_echo = echo_server(server, CHURN_PORT, true)?;
    let stream_echo = echo_server(server, STREAM_PORT, false)?;
    let t0 = Instant::now();
    let tally = Tally::new(t0);
    let mut control = Control::new(
        &bed.mesh.lab,
        &tally,
        &opts.lab_prefix,
        bed.mesh.config.clone(),
        [client, server],
        churn_echo.addr,
    )?;
    // the soak's own config (its policy, no other workloads) before any load
    control.push_policy();
    anyhow::ensure!(
        Tally::get(&tally.pushes_seen) == 1,
        "the node did not take the soak's config: {:?}",
        tally.reasons()
    );
    let machine = Machine::read(started, busy);
    print_header(soak, &machine);
    let client_ns = Netns::open(&client.netns_path)?;
    let stop = AtomicBool::new(false);
    let samples = std::thread::scope(|s| {
        let (ns, stop, tally) = (&client_ns, &stop, &tally);
        let churn_to = churn_echo.addr;
        s.spawn(move || match ns.enter() {
            Ok(()) => load::churn(churn_to, soak.rate, stop, tally),
            Err(e) => tally.error(format!("churn: enter the client netns: {e}")),
        });
        for id in 0..soak.streams as u64 {
            let to = stream_echo.addr;
            s.spawn(move || match ns.enter() {
                Ok(()) => load::stream(to, id, stop, tally),
                Err(e) => tally.error(format!("stream {id}: enter the client netns: {e}")),
            });
        }
        let samples = control_loop(&mut control, &bed.mesh.lab, bed.pid(), soak, tally, t0);
        stop.store(true, Ordering::Relaxed);
        samples
    });
    control.remove_expired(None);
    drop((churn_echo, stream_echo));
    let verdict = sample::judge(&samples, soak.duration, soak.sample, soak.growth_limit_pct);
    print_verdict(&samples, &verdict, &tally);
    write_json(opts, soak, &machine, &samples, &verdict, &tally)?;
    report::keep_log(&opts.json, &bed.mesh.log);
    Ok(verdict.passed())
}

/// The soak's cycles until its time is up: each removes the expired pod, samples when one is due
/// (and at the end), pushes a policy every [`PUSH_CYCLES`] and adds a pod. Stops early when the
/// node cannot be read any more (it exited).
fn control_loop(
    control: &mut Control<'_>,
    lab: &crate::lab::Lab,
    pid: u32,
    soak: &SoakOptions,
    tally: &Tally,
    t0: Instant,
) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut next_sample = soak.sample;
    let mut due = t0;
    for cycle in 0u64.. {
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        due += CYCLE;
        control.remove_expired(Some(cycle));
        let elapsed = t0.elapsed();
        let last = elapsed >= soak.duration;
        if elapsed >= next_sample || last {
            match take_sample(lab.node(), pid, tally, elapsed) {
                Ok(s) => {
                    print_sample(&s);
                    samples.push(s);
                }
                Err(e) => {
                    tally.error(format!("read the node process {pid}: {e}"));
                    break;
                }
            }
            while next_sample <= elapsed {
                next_sample += soak.sample;
            }
        }
        if last {
            break;
        }
        if cycle % PUSH_CYCLES == PUSH_CYCLES - 1 {
            control.push_policy();
        }
        control.add_pod(cycle);
    }
    samples
}

/// The node's readings (its process, its `/metrics` from inside `node_ns`) and the tally's counts.
fn take_sample(
    node_ns: &Netns,
    pid: u32,
    tally: &Tally,
    elapsed: Duration,
) -> std::io::Result<Sample> {
    let p = sample::read_process(pid)?;
    let metrics = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), METRICS_PORT);
    let text = match http::get_text(node_ns, metrics, "/metrics") {
        Ok((200, text)) => text,
        _ => String::new(),
    };
    Ok(Sample {
        secs: elapsed.as_secs_f64(),
        rss_kib: p.rss_kib,
        fds: p.fds,
        threads: p.threads,
        sockets_open: sample::metric_sum(&text, "istio_tcp_sockets_open"),
        proxies: sample::metric_sum(&text, "workload_manager_active_proxy_count"),
        conns_ok: Tally::get(&tally.conns_ok),
        conns_failed: Tally::get(&tally.conns_failed),
        stream_blocks: Tally::get(&tally.stream_blocks),
        errors: Tally::get(&tally.errors),
        pods_added: Tally::get(&tally.pods_added),
        pods_removed: Tally::get(&tally.pods_removed),
        pushes: Tally::get(&tally.pushes),
        pushes_seen: Tally::get(&tally.pushes_seen),
    })
}

fn print_header(soak: &SoakOptions, machine: &Machine) {
    println!(
        "\nztnode bench --soak: {:.1} min, {} conn/s, {} long streams, a pod every {:?} (lives {:?}), \
         a policy push every {:?}, a sample every {:?}",
        soak.duration.as_secs_f64() / 60.0,
        soak.rate,
        soak.streams,
        CYCLE,
        CYCLE * control::POD_CYCLES as u32,
        CYCLE * PUSH_CYCLES as u32,
        soak.sample
    );
    println!(
        "(fds: the least of 20 readings over a second; sockets: istio_tcp_sockets_open; proxies: \
         workload_manager_active_proxy_count; blocks: 64 KiB echoes of the long streams)"
    );
    println!("{}", machine.describe());
    println!(
        "{:>6} {:>8} {:>5} {:>7} {:>7} {:>7} {:>9} {:>6} {:>8} {:>11} {:>11} {:>6}",
        "min",
        "RSS MiB",
        "fds",
        "threads",
        "sockets",
        "proxies",
        "conns ok",
        "failed",
        "blocks",
        "pods +/-",
        "pushes/seen",
        "errors"
    );
}

fn print_sample(s: &Sample) {
    let opt = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    println!(
        "{:>6.1} {:>8.1} {:>5} {:>7} {:>7} {:>7} {:>9} {:>6} {:>8} {:>11} {:>11} {:>6}",
        s.secs / 60.0,
        s.rss_kib as f64 / 1024.0,
        s.fds,
        s.threads,
        opt(s.sockets_open),
        opt(s.proxies),
        s.conns_ok,
        s.conns_failed,
        s.stream_blocks,
        format!("{}/{}", s.pods_added, s.pods_removed),
        format!("{}/{}", s.pushes, s.pushes_seen),
        s.errors
    );
}

fn print_verdict(samples: &[Sample], verdict: &Verdict, tally: &Tally) {
    let at = |s: &Sample| {
        format!(
            "{:.1} min: RSS {:.1} MiB, {} fds, {} threads",
            s.secs / 60.0,
            s.rss_kib as f64 / 1024.0,
            s.fds,
            s.threads
        )
    };
    if let Some(w) = verdict.warmup.and_then(|w| samples.get(w)) {
        println!("\nwarm-up sample at {}", at(w));
    }
    if let Some(last) = samples.last() {
        println!("last sample at {}", at(last));
    }
    for n in &verdict.notes {
        println!("note: {n}");
    }
    if verdict.passed() {
        println!("soak PASSED");
        return;
    }
    println!("soak FAILED:");
    for p in &verdict.problems {
        println!("  {p}");
    }
    let reasons = tally.reasons();
    if !reasons.is_empty() {
        println!("first failures:");
        for r in reasons.iter().take(PRINTED_REASONS) {
            println!("  {r}");
        }
    }
}

/// Writes the JSON report: the settings, the machine, every sample, the verdict and the first
/// failures.
fn write_json(
    opts: &BenchOptions,
    soak: &SoakOptions,
    machine: &Machine,
    samples: &[Sample],
    verdict: &Verdict,
    tally: &Tally,
) -> anyhow::Result<()> {
    let mut doc = json!({
        "soak_minutes": soak.duration.as_secs_f64() / 60.0,
        "soak_rate": soak.rate,
        "soak_streams": soak.streams,
        "sample_secs": soak.sample.as_secs_f64(),
        "cycle_secs": CYCLE.as_secs_f64(),
        "samples": samples,
        "warmup_index": verdict.warmup,
        "growth_limit_pct": soak.growth_limit_pct,
        "passed": verdict.passed(),
        "problems": verdict.problems,
        "notes": verdict.notes,
        "failures": tally.reasons(),
    });
    machine.add_to(&mut doc);
    std::fs::write(&opts.json, serde_json::to_vec_pretty(&doc)?)?;
    println!("\nJSON written to {}", opts.json.display());
    Ok(())
}
