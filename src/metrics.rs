//! The process's metrics registry and its exposition on `:15020/metrics` (ztunnel's
//! `src/metrics/server.rs`; `../shared/spec/ztunnel.md` §7).
//!
//! The roles register their families into one prometheus-client [`Registry`] (the proxy's
//! `istio_tcp_*`, `istio_dns_*`, `istio_xds_*`, `workload_manager_*`; the agent's), this module
//! adds `istio_build{component="ztunnel",tag=<version>}`, the `process_*` figures and the
//! allocator's ([`ProcessCollector`], read from `/proc/self` and mimalloc at each scrape), and [`Exposition::answer`]
//! renders the OpenMetrics text (ending `# EOF`). The content type is
//! `application/openmetrics-text; version=1.0.0; charset=utf-8` when the `Accept` header asks for
//! OpenMetrics, else `text/plain; charset=utf-8` (as ztunnel); the body is gzipped when
//! `Accept-Encoding` allows gzip.

use std::io::Write as _;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::{Registry, Unit};

/// Content type of an OpenMetrics answer.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of a plain-text answer (the default).
pub const PLAIN_TEXT: &str = "text/plain; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    component: String,
    tag: String,
}

/// Registers `istio_build{component="ztunnel",tag=<version>} 1` (ztunnel's build gauge; ztnode
/// stands in for ztunnel, so Istio's dashboards find it under that component).
pub fn register_build(registry: &mut Registry, version: &str) {
    let build: Family<BuildLabels, Gauge> = Family::default();
    build
        .get_or_create(&BuildLabels {
            component: "ztunnel".into(),
            tag: version.into(),
        })
        .set(1);
    registry.sub_registry_with_prefix("istio").register(
        "build",
        "Istio component build info",
        build,
    );
}

/// The whole registry, ready to serve.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
}

/// One `/metrics` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The body (gzipped when [`Answer::gzip`]).
    pub body: Vec<u8>,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Whether the body is gzip (`Content-Encoding: gzip`).
    pub gzip: bool,
}

impl Exposition {
    /// Serves `registry`, with the process figures added.
    pub fn new(mut registry: Registry) -> Exposition {
        registry.register_collector(Box::new(ProcessCollector));
        Exposition { registry }
    }

    /// The OpenMetrics text of every registered family.
    pub fn text(&self) -> String {
        let mut out = String::new();
        // writing into a String does not fail; a family that fails to encode is left out
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The answer to a request with these `Accept` and `Accept-Encoding` header values.
    pub fn answer<'a>(
        &self,
        accept: impl IntoIterator<Item = &'a str>,
        accept_encoding: impl IntoIterator<Item = &'a str>,
    ) -> Answer {
        let text = self.text();
        let content_type = if wants_openmetrics(accept) {
            OPENMETRICS
        } else {
            PLAIN_TEXT
        };
        if accepts_gzip(accept_encoding)
            && let Some(body) = gzip(text.as_bytes())
        {
            return Answer {
                body,
                content_type,
                gzip: true,
            };
        }
        Answer {
            body: text.into_bytes(),
            content_type,
            gzip: false,
        }
    }
}

/// Whether an `Accept` list names `application/openmetrics-text` (any parameters, any q).
fn wants_openmetrics<'a>(accept: impl IntoIterator<Item = &'a str>) -> bool {
    accept
        .into_iter()
        .flat_map(|v| v.split(','))
        .filter_map(|m| m.split(';').next())
        .any(|m| {
            m.trim()
                .eq_ignore_ascii_case("application/openmetrics-text")
        })
}

/// Whether an `Accept-Encoding` list allows gzip (`gzip` or `*`, not with `q=0`).
fn accepts_gzip<'a>(accept_encoding: impl IntoIterator<Item = &'a str>) -> bool {
    accept_encoding
        .into_iter()
        .flat_map(|v| v.split(','))
        .any(|e| {
            let mut parts = e.split(';');
            let coding = parts.next().unwrap_or_default().trim();
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && !refused
        })
}

fn gzip(data: &[u8]) -> Option<Vec<u8>> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).ok()?;
    enc.finish().ok()
}

/// The Prometheus process figures of this process, read from procfs at each scrape:
/// `process_resident_memory_bytes`, `process_virtual_memory_bytes`, `process_open_fds`,
/// `process_max_fds`, `process_threads`, `process_cpu_seconds_total` and
/// `process_start_time_seconds`, and the allocator's `ztnode_allocator_committed_bytes` and
/// `ztnode_allocator_peak_committed_bytes`. A figure that cannot be read is left out.
#[derive(Debug)]
pub struct ProcessCollector;

/// What `/proc/self/stat` gives (fields after the command name).
#[derive(Debug, Default, PartialEq)]
struct Stat {
    threads: u64,
    cpu_ticks: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

/// Parses `/proc/self/stat`; `None` when malformed.
fn parse_stat(text: &str) -> Option<Stat> {
    // the command name is in parentheses and may hold spaces: fields start after the last ')'
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // field n of proc(5) is f[n - 3]
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        cpu_ticks: num(14)? + num(15)?,
        threads: num(20)?,
        start_ticks: num(22)?,
        vsize: num(23)?,
        rss_pages: num(24)?,
    })
}

fn gauge(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: f64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, unit, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .unwrap_or(4096) as f64;
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100) as f64;
        if let Some(st) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .as_deref()
            .and_then(parse_stat)
        {
            let bytes = Some(&Unit::Bytes);
            gauge(
                &mut e,
                "process_resident_memory",
                "Resident memory size in bytes",
                bytes,
                st.rss_pages as f64 * page,
            )?;
            gauge(
                &mut e,
                "process_virtual_memory",
                "Virtual memory size in bytes",
                bytes,
                st.vsize as f64,
            )?;
            gauge(
                &mut e,
                "process_threads",
                "Number of OS threads in the process",
                None,
                st.threads as f64,
            )?;
            let cpu = ConstCounter::new(st.cpu_ticks as f64 / ticks);
            cpu.encode(e.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent in seconds",
                Some(&Unit::Seconds),
                cpu.metric_type(),
            )?)?;
            if let Some(boot) = boot_time() {
                gauge(
                    &mut e,
                    "process_start_time",
                    "Start time of the process since unix epoch in seconds",
                    Some(&Unit::Seconds),
                    boot + st.start_ticks as f64 / ticks,
                )?;
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            // less the descriptor reading the directory
            let open = dir.count().saturating_sub(1);
            gauge(
                &mut e,
                "process_open_fds",
                "Number of open file descriptors",
                None,
                open as f64,
            )?;
        }
        let (committed, peak) = allocator_commit();
        gauge(
            &mut e,
            "ztnode_allocator_committed",
            "Memory the allocator (mimalloc) holds committed, in bytes",
            Some(&Unit::Bytes),
            committed as f64,
        )?;
        gauge(
            &mut e,
            "ztnode_allocator_peak_committed",
            "Peak of the memory the allocator (mimalloc) held committed, in bytes",
            Some(&Unit::Bytes),
            peak as f64,
        )?;
        if let Ok((soft, _)) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        {
            gauge(
                &mut e,
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                soft as f64,
            )?;
        }
        Ok(())
    }
}

/// mimalloc's committed memory now and at its peak (`mi_process_info`; on Linux its estimate of
/// the read/write memory it reserved), in bytes.
#[allow(unsafe_code)]
fn allocator_commit() -> (usize, usize) {
    let mut v = [0usize; 8];
    let [
        elapsed,
        user,
        system,
        rss,
        peak_rss,
        commit,
        peak_commit,
        faults,
    ] = &mut v;
    // SAFETY: every argument points to a distinct, live, writable usize; mi_process_info only
    // writes through them and may be called from any thread.
    unsafe {
        libmimalloc_sys::mi_process_info(
            elapsed,
            user,
            system,
            rss,
            peak_rss,
            commit,
            peak_commit,
            faults,
        )
    };
    (v[5], v[6])
}

/// Boot time in seconds since the epoch (`btime` of `/proc/stat`).
fn boot_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;

    #[test]
    fn stat_fields_are_read_after_the_command_name() {
        let line = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 5 0 1234 \
                    10485760 256 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                threads: 5,
                cpu_ticks: 10,
                start_ticks: 1234,
                vsize: 10_485_760,
                rss_pages: 256,
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) S 1"), None);
    }

    #[test]
    fn build_and_process_figures_are_exposed() {
        let mut r = Registry::default();
        register_build(&mut r, "1.2.3");
        let text = Exposition::new(r).text();
        assert!(
            text.contains("istio_build{component=\"ztunnel\",tag=\"1.2.3\"} 1\n"),
            "{text}"
        );
        for name in [
            "process_resident_memory_bytes ",
            "process_virtual_memory_bytes ",
            "process_threads ",
            "process_cpu_seconds_total ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "process_max_fds ",
            "ztnode_allocator_committed_bytes ",
            "ztnode_allocator_peak_committed_bytes ",
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in {text}"));
            let v: f64 = line[name.len()..].parse().expect("number");
            assert!(v >= 0.0, "{line}");
        }
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .and_then(|v| v.parse::<f64>().ok())
            .expect("rss");
        assert!(
            rss > 1e6,
            "a test process has more than 1 MB resident: {rss}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn openmetrics_when_asked_and_gzip_when_allowed() {
        let e = Exposition::new(Registry::default());
        let plain = e.answer([], []);
        assert_eq!(plain.content_type, PLAIN_TEXT);
        assert!(!plain.gzip);
        let om = e.answer(
            ["application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3"],
            ["deflate, gzip;q=0.8"],
        );
        assert_eq!(om.content_type, OPENMETRICS);
        assert!(om.gzip);
        let mut text = String::new();
        flate2::read::GzDecoder::new(&om.body[..])
            .read_to_string(&mut text)
            .expect("gunzip");
        assert!(text.contains("process_open_fds"), "{text}");
        assert!(!e.answer([], ["gzip;q=0"]).gzip);
        assert!(!e.answer([], ["br"]).gzip);
        assert!(e.answer([], ["*"]).gzip);
    }
}
