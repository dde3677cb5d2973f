//! `ztnode bench`: what the mesh costs, measured in one run against the direct path.
//!
//! One lab node (see [`super::Lab`]) holds two pairs of pods on the same bridge: `d-client`/`d-server`
//! (not enrolled: the direct path) and `m-client`/`m-server` (enrolled: traffic through ztnode HBONE),
//! with a release `ztnode node` running in the node netns. Measured:
//! throughput of 1 and 8 TCP streams (iperf3), 1 KiB request/response round trips on one connection
//! (p50/p99), new connection + 1 KiB round trip + close per second, the node process's RSS (idle with 2
//! and with `pods` enrolled pods, with `idle_conns` open idle connections, after they close), and the
//! exec time of the `ztnode-cni` plugin in CNI ADD. Two sections build labs of their own: Kubernetes
//! mode (`kube`: enrollment of running pods, ADD through the API server) and istiod (`xds`: push to
//! ACK and to `/config_dump` with a large world, the RSS holding it). Prints a table with ratios
//! (ztnode / direct) and writes the same figures as JSON. With `--peer PATH` it measures ztnode's
//! proxy and another (the real ztunnel) side by side instead ([`peer`]). Benchmarks are not tests: nothing here asserts a timing.

mod busy;
mod kube;
mod measure;
mod options;
mod peer;
mod placement;
mod report;
mod sections;
mod setup;
mod soak;
mod xds;

pub use options::{
    BenchOptions, DEFAULT_LAB_PREFIX, DEFAULT_SOAK_GROWTH_LIMIT_PCT, Section, SoakOptions,
};

use report::{Figures, Machine};

/// Runs the benchmark; returns the exit status.
pub fn run(opts: BenchOptions) -> i32 {
    let result = run_inner(&opts);
    if setup::stopping() {
        // a signal handler is tearing the lab down and exits the process when done
        loop {
            std::thread::park();
        }
    }
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench failed: {e:#}");
            1
        }
    }
}

/// The bench's steps in order: checks, the lab with the node and pods, the extra pods, the
/// selected sections, the report. The lab goes away when `bed` drops, after the node stopped.
fn run_inner(opts: &BenchOptions) -> anyhow::Result<()> {
    let started = time::OffsetDateTime::now_utc();
    let _lock = setup::preflight(opts)?;
    let busy = busy::Busy::sample();
    if let Some(warning) = busy.warning() {
        eprintln!("{warning}");
    }
    if let Some(peer) = &opts.peer {
        return peer::run(opts, peer, &busy);
    }
    if let Some(soak) = &opts.soak {
        anyhow::ensure!(
            soak::run(opts, soak, &busy)?,
            "the soak failed (the verdict above)"
        );
        return Ok(());
    }
    let mut figures = Figures::default();
    if opts.wants(Section::Kube) {
        kube::measure(opts, &mut figures)?;
    }
    if opts.wants(Section::Xds) {
        xds::measure(opts, &mut figures)?;
    }
    if !options::MAIN_LAB_SECTIONS.iter().any(|s| opts.wants(*s)) {
        let machine = Machine::read(started, &busy);
        let secs = opts.duration.as_secs().max(1);
        report::print_table(secs, opts.round_trips, &machine, &figures);
        return report::write_json(opts, secs, 0, &machine, &figures);
    }
    let bed = setup::start(opts)?;
    let enrolled = setup::enroll(&bed, opts)?;
    setup::hold(&bed, opts);
    let secs = opts.duration.as_secs().max(1);
    if opts.wants(Section::Throughput) {
        sections::throughput(&bed, secs, &mut figures)?;
    }
    if opts.wants(Section::Latency) {
        sections::latency(&bed, opts.round_trips, &mut figures)?;
    }
    if opts.wants(Section::Rate) {
        sections::rate(&bed, secs, &mut figures)?;
    }
    if opts.wants(Section::Memory) {
        sections::memory(&bed, opts, &enrolled, &mut figures)?;
    }
    if opts.wants(Section::Cni) {
        sections::cni(&enrolled, &mut figures);
    }
    let machine = Machine::read(started, &busy);
    report::print_table(secs, opts.round_trips, &machine, &figures);
    let cni_add_samples = enrolled.plugin_ms.len();
    report::write_json(opts, secs, cni_add_samples, &machine, &figures)?;
    report::keep_log(&opts.json, &bed.mesh.log);
    Ok(())
}
