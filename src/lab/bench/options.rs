//! What `ztnode bench` is asked to do.

use std::path::PathBuf;
use std::time::Duration;

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
    /// The xDS section's world: workloads istiod serves ([`Section::Xds`]).
    pub xds_workloads: usize,
    /// The xDS section's world: authorization policies istiod serves.
    pub xds_policies: usize,
    /// Another proxy (a ztunnel binary) to measure side by side with ztnode's instead of the
    /// sections ([`super::peer`]).
    pub peer: Option<PathBuf>,
    /// Rounds of the side-by-side run, each measuring both proxies.
    pub rounds: usize,
    /// Pushes timed by the xDS section in each of its two series (until the ACK, until
    /// `/config_dump` shows the change).
    pub xds_pushes: usize,
    /// Run the soak instead of the sections ([`SoakOptions`]).
    pub soak: Option<SoakOptions>,
}

/// Default of [`SoakOptions::growth_limit_pct`], percent.
pub const DEFAULT_SOAK_GROWTH_LIMIT_PCT: u64 = 10;

/// What `ztnode bench --soak` runs (see `lab::bench::soak`).
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// How long the load runs.
    pub duration: Duration,
    /// New connections (connect, 1 KiB round trip, close) per second.
    pub rate: u32,
    /// Long streams held for the whole run.
    pub streams: usize,
    /// Time between samples (a minute; shorter for tests).
    pub sample: Duration,
    /// Percent the node's RSS and fds may grow from the warm-up sample to the last before the
    /// soak fails (10 by default).
    pub growth_limit_pct: u64,
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
    /// Kubernetes mode: enrollment of `--pods` running labelled pods from the node's start, and
    /// the plugin's ADD time when it asks the API server (needs the fake API server).
    Kube,
    /// Workloads and policies from istiod (the fake istiod's delta xDS): initial sync, time from
    /// a push to its ACK and to `/config_dump`, and the node's RSS holding the world.
    Xds,
}

/// The sections that use the main lab (all but [`Section::Kube`] and [`Section::Xds`], which build
/// their own).
pub(super) const MAIN_LAB_SECTIONS: [Section; 5] = [
    Section::Throughput,
    Section::Latency,
    Section::Rate,
    Section::Memory,
    Section::Cni,
];

/// Default name prefix of the lab (netns `ztbench-node`, `ztbench-m-client`, ...).
pub const DEFAULT_LAB_PREFIX: &str = "ztbench";

impl BenchOptions {
    /// Whether the run measures `section` (all sections when `only` is empty).
    pub(super) fn wants(&self, section: Section) -> bool {
        self.only.is_empty() || self.only.contains(&section)
    }
}
