//! DNS proxy metrics with ztunnel's names and labels (`src/dns/metrics.rs`; spec ztunnel.md §7):
//! `istio_dns_requests_total` (every request, answered or forwarded),
//! `istio_dns_upstream_requests_total`, `istio_dns_upstream_failures_total` and the histogram
//! `istio_dns_upstream_request_duration_seconds` (forwarded requests), each labelled
//! `request_query_type` (`a`, `aaaa`, `srv`, ...), `request_protocol` (`udp`, `tcp`),
//! `source_canonical_service` and `source_canonical_revision` (the pod's; `unknown` when unset).
//! A label set shows up in a metric once that metric counted it (as prometheus-client families do).
//! The histogram's buckets are ztunnel's (0.001 … 5 s).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Upper bounds of the duration histogram's buckets, in seconds (ztunnel's, sorted).
pub const BUCKETS: [f64; 6] = [0.001, 0.005, 0.01, 0.1, 1.0, 5.0];

/// Transport of a DNS request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Transport {
    /// UDP.
    Udp,
    /// TCP.
    Tcp,
}

impl Transport {
    /// `udp` / `tcp`, as the `request_protocol` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// The labels of one DNS request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DnsLabels {
    /// `request_query_type`.
    pub query_type: String,
    /// `request_protocol`.
    pub protocol: Transport,
    /// `source_canonical_service`.
    pub canonical_service: String,
    /// `source_canonical_revision`.
    pub canonical_revision: String,
}

#[derive(Debug, Default, Clone)]
struct Counts {
    requests: u64,
    upstream_requests: u64,
    upstream_failures: u64,
    /// Observations per bucket (not cumulative), their sum of seconds and their number.
    duration_buckets: [u64; BUCKETS.len()],
    duration_sum: f64,
    duration_count: u64,
}

/// The DNS counters of the whole proxy.
#[derive(Debug, Default)]
pub struct DnsMetrics {
    by_labels: Mutex<BTreeMap<DnsLabels, Counts>>,
}

impl DnsMetrics {
    fn with(&self, labels: &DnsLabels, f: impl FnOnce(&mut Counts)) {
        let mut map = self
            .by_labels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match map.get_mut(labels) {
            Some(c) => f(c),
            None => f(map.entry(labels.clone()).or_default()),
        }
    }

    /// Counts a request.
    pub fn request(&self, labels: &DnsLabels) {
        self.with(labels, |c| c.requests += 1);
    }

    /// Counts a request forwarded upstream.
    pub fn upstream_request(&self, labels: &DnsLabels) {
        self.with(labels, |c| c.upstream_requests += 1);
    }

    /// Counts a forwarded request that got no answer.
    pub fn upstream_failure(&self, labels: &DnsLabels) {
        self.with(labels, |c| c.upstream_failures += 1);
    }

    /// Records how long the upstream took for one forwarded request.
    pub fn upstream_duration(&self, labels: &DnsLabels, took: Duration) {
        let secs = took.as_secs_f64();
        self.with(labels, |c| {
            c.duration_sum += secs;
            c.duration_count += 1;
            // observations above the last bound are only in +Inf (the count)
            if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
                c.duration_buckets[i] += 1;
            }
        });
    }

    /// Prometheus text exposition of the DNS metrics.
    pub fn render(&self, out: &mut String) {
        let map = self
            .by_labels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for (name, help, pick) in [
            (
                "istio_dns_requests_total",
                "Total number of DNS requests (unstable)",
                (|c: &Counts| c.requests) as fn(&Counts) -> u64,
            ),
            (
                "istio_dns_upstream_requests_total",
                "Total number of DNS requests forwarded to upstream (unstable)",
                |c: &Counts| c.upstream_requests,
            ),
            (
                "istio_dns_upstream_failures_total",
                "Total number of DNS requests that failed to forward upstream (unstable)",
                |c: &Counts| c.upstream_failures,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} counter");
            for (l, c) in map.iter().filter(|(_, c)| pick(c) > 0) {
                let _ = writeln!(out, "{name}{{{}}} {}", label_text(l), pick(c));
            }
        }
        let name = "istio_dns_upstream_request_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Total time in seconds Istio takes to get DNS response from upstream \
             (unstable).\n# TYPE {name} histogram"
        );
        for (l, c) in map.iter().filter(|(_, c)| c.duration_count > 0) {
            let labels = label_text(l);
            let count = c.duration_count;
            let mut cumulative = 0;
            for (bound, n) in BUCKETS.iter().zip(c.duration_buckets) {
                cumulative += n;
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
            }
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", c.duration_sum);
            let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
        }
    }
}

/// `k="v",...` in ztunnel's label order, values escaped.
fn label_text(l: &DnsLabels) -> String {
    format!(
        "request_query_type=\"{}\",request_protocol=\"{}\",source_canonical_service=\"{}\",\
         source_canonical_revision=\"{}\"",
        escape(&l.query_type),
        l.protocol.as_str(),
        escape(or_unknown(&l.canonical_service)),
        escape(or_unknown(&l.canonical_revision)),
    )
}

fn or_unknown(s: &str) -> &str {
    if s.is_empty() { "unknown" } else { s }
}

/// Escapes a label value (Prometheus text format: backslash, quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(t: &str) -> DnsLabels {
        DnsLabels {
            query_type: t.into(),
            protocol: Transport::Udp,
            canonical_service: "client".into(),
            canonical_revision: String::new(),
        }
    }

    #[test]
    fn counters_and_the_histogram_render_with_ztunnels_names_and_labels() {
        let m = DnsMetrics::default();
        m.request(&labels("a"));
        m.request(&labels("srv"));
        m.upstream_request(&labels("srv"));
        m.upstream_duration(&labels("srv"), Duration::from_millis(3));
        let mut text = String::new();
        m.render(&mut text);
        let a = "request_query_type=\"a\",request_protocol=\"udp\",\
                 source_canonical_service=\"client\",source_canonical_revision=\"unknown\"";
        let srv = a.replace("\"a\"", "\"srv\"");
        assert!(
            text.contains(&format!("istio_dns_requests_total{{{a}}} 1\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("istio_dns_requests_total{{{srv}}} 1\n")),
            "{text}"
        );
        assert!(text.contains(&format!("istio_dns_upstream_requests_total{{{srv}}} 1\n")));
        assert!(!text.contains(&format!("istio_dns_upstream_requests_total{{{a}}}")));
        assert!(text.contains("# TYPE istio_dns_upstream_failures_total counter"));
        let h = "istio_dns_upstream_request_duration_seconds";
        assert!(
            text.contains(&format!("{h}_bucket{{{srv},le=\"0.001\"}} 0\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{h}_bucket{{{srv},le=\"0.005\"}} 1\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{h}_bucket{{{srv},le=\"+Inf\"}} 1\n")),
            "{text}"
        );
        assert!(text.contains(&format!("{h}_count{{{srv}}} 1\n")), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
