//! The bench's report: the table on stdout and the same figures as JSON.

use std::path::Path;

use serde_json::json;

use super::busy::Busy;
use super::options::BenchOptions;

/// One single-valued figure: table label, JSON key, value, printed decimals.
pub(super) struct Value {
    label: String,
    key: String,
    value: f64,
    precision: usize,
}

impl Value {
    pub(super) fn new(label: &str, key: &str, value: f64, precision: usize) -> Value {
        Value {
            label: label.to_owned(),
            key: key.to_owned(),
            value,
            precision,
        }
    }
}

/// One figure of both paths: table label, unit, direct and ztnode values, their ratio.
pub(super) struct Row {
    name: String,
    unit: &'static str,
    direct: f64,
    mesh: f64,
    ratio: f64,
}

impl Row {
    pub(super) fn new(name: String, unit: &'static str, direct: f64, mesh: f64) -> Row {
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

/// What a report needs to be compared with another one: the build, when it ran, and the
/// machine facts that move the figures (CPU count; the cpuidle driver and whether idle vCPUs poll
/// before halting, which sets the cost of a wake-up across CPUs).
pub(super) struct Machine {
    /// `<crate version> (<git sha>)`.
    version: String,
    /// UTC start of the run, RFC 3339.
    started_at: String,
    cpus: usize,
    /// `<driver>, guest_halt_poll_ns=<n>` as far as sysfs tells (`unknown` parts otherwise).
    cpuidle: String,
    /// How busy the machine was just before the run.
    busy: Busy,
}

impl Machine {
    /// The facts of this build and machine, for a run that started at `started`.
    pub(super) fn read(started: time::OffsetDateTime, busy: &Busy) -> Machine {
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
            busy: busy.clone(),
        }
    }
}

impl Machine {
    /// `ztnode <version>, started <time>, <n> CPUs, cpuidle <setup>, <p %> busy before`: the
    /// table's heading line.
    pub(super) fn describe(&self) -> String {
        format!(
            "ztnode {}, started {}, {} CPUs, cpuidle {}, {} busy before",
            self.version,
            self.started_at,
            self.cpus,
            self.cpuidle,
            self.busy.describe_pct()
        )
    }

    /// Sets the report keys `ztnode_version`, `started_at`, `cpus`, `cpuidle` and the
    /// [`Busy`] keys in the object `doc`.
    pub(super) fn add_to(&self, doc: &mut serde_json::Value) {
        doc["ztnode_version"] = json!(self.version);
        doc["started_at"] = json!(self.started_at);
        doc["cpus"] = json!(self.cpus);
        doc["cpuidle"] = json!(self.cpuidle);
        self.busy.add_to(doc);
    }
}

/// The figures of a run in table order: rows of both paths, then single values.
#[derive(Default)]
pub(super) struct Figures {
    /// Figures of both paths, with their ratio.
    pub(super) rows: Vec<Row>,
    /// Single-valued figures.
    pub(super) values: Vec<Value>,
}

/// Prints the table: the run's settings and machine, then every figure.
pub(super) fn print_table(secs: u64, round_trips: usize, machine: &Machine, figures: &Figures) {
    println!(
        "\nztnode bench ({}s per path per throughput/rate figure, {} round trips, {} CPUs shared by everything)",
        secs, round_trips, machine.cpus
    );
    println!(
        "ztnode {}, started {}, cpuidle {}, {} busy before",
        machine.version,
        machine.started_at,
        machine.cpuidle,
        machine.busy.describe_pct()
    );
    if let Some(warning) = machine.busy.warning() {
        println!("{warning}");
    }
    // The label column fits the longest label (40 at least).
    let w = figures
        .rows
        .iter()
        .map(|r| r.name.chars().count())
        .chain(figures.values.iter().map(|v| v.label.chars().count()))
        .fold(40, usize::max);
    println!(
        "{:<w$} {:>12} {:>12} {:>10}",
        "figure", "direct", "ztnode", "ratio"
    );
    for r in &figures.rows {
        println!(
            "{:<w$} {:>12.2} {:>12.2} {:>9.2}x  {}",
            r.name, r.direct, r.mesh, r.ratio, r.unit
        );
    }
    for v in &figures.values {
        println!(
            "{:<w$} {:>12} {:>12.prec$} {:>10}",
            v.label,
            "",
            v.value,
            "",
            prec = v.precision
        );
    }
}

/// Writes the JSON report to `opts.json`: the run's settings and machine, the rows under
/// `figures`, each single value under its key.
pub(super) fn write_json(
    opts: &BenchOptions,
    secs: u64,
    cni_add_samples: usize,
    machine: &Machine,
    figures: &Figures,
) -> anyhow::Result<()> {
    let mut report = json!({
        "duration_secs": secs,
        "round_trips": opts.round_trips,
        "pods": opts.pods,
        "idle_conns": opts.idle_conns,
        "cni_add_samples": cni_add_samples,
        "xds_workloads": opts.xds_workloads,
        "xds_policies": opts.xds_policies,
        "xds_pushes": opts.xds_pushes,
        "figures": figures.rows.iter().map(|r| json!({"name": r.name, "unit": r.unit, "direct": r.direct, "ztnode": r.mesh, "ratio": r.ratio})).collect::<Vec<_>>(),
    });
    machine.add_to(&mut report);
    for v in &figures.values {
        report[v.key.as_str()] = json!(v.value);
    }
    std::fs::write(&opts.json, serde_json::to_vec_pretty(&report)?)?;
    println!("\nJSON written to {}", opts.json.display());
    Ok(())
}

/// Copies the node's `log` next to the JSON report (`<json>.node.log`), when it can.
pub(super) fn keep_log(json: &Path, log: &Path) {
    let kept_log = json.with_extension("node.log");
    if std::fs::copy(log, &kept_log).is_ok() {
        println!("node log kept at {}", kept_log.display());
    }
}
