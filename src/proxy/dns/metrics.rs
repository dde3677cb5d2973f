//! DNS proxy metrics with ztunnel's names and labels (`src/dns/metrics.rs`; spec ztunnel.md §7):
//! `istio_dns_requests_total` (every request, answered or forwarded),
//! `istio_dns_upstream_requests_total`, `istio_dns_upstream_failures_total` and the histogram
//! `istio_dns_upstream_request_duration_seconds` (forwarded requests), each labelled
//! `request_query_type` (`a`, `aaaa`, `srv`, ...), `request_protocol` (`udp`, `tcp`),
//! `source_canonical_service` and `source_canonical_revision` (the pod's; `unknown` when unset).
//! A label set shows up in a family once that family counted it (prometheus-client families).
//! The histogram's buckets are ztunnel's (0.0005 … 5 s).

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Upper bounds of the duration histogram's buckets, in seconds (ztunnel's, sorted).
pub const BUCKETS: [f64; 6] = [0.0005, 0.001, 0.01, 0.1, 1.0, 5.0];

/// Transport of a DNS request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

impl EncodeLabelSet for DnsLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        for (k, v) in [
            ("request_query_type", or_unknown(&self.query_type)),
            ("request_protocol", self.protocol.as_str()),
            (
                "source_canonical_service",
                or_unknown(&self.canonical_service),
            ),
            (
                "source_canonical_revision",
                or_unknown(&self.canonical_revision),
            ),
        ] {
            (k, v).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

fn or_unknown(s: &str) -> &str {
    if s.is_empty() { "unknown" } else { s }
}

type DurationFamily = Family<DnsLabels, Histogram, fn() -> Histogram>;

/// The DNS metrics of the whole proxy.
#[derive(Debug)]
pub struct DnsMetrics {
    requests: Family<DnsLabels, Counter>,
    upstream_requests: Family<DnsLabels, Counter>,
    upstream_failures: Family<DnsLabels, Counter>,
    upstream_duration: DurationFamily,
}

impl Default for DnsMetrics {
    fn default() -> Self {
        DnsMetrics {
            requests: Family::default(),
            upstream_requests: Family::default(),
            upstream_failures: Family::default(),
            upstream_duration: Family::new_with_constructor(|| Histogram::new(BUCKETS)),
        }
    }
}

impl DnsMetrics {
    /// Registers the families into `istio` (the registry with the `istio` prefix).
    pub fn register(&self, istio: &mut Registry) {
        istio.register(
            "dns_requests",
            "Total number of DNS requests (unstable)",
            self.requests.clone(),
        );
        istio.register(
            "dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            self.upstream_requests.clone(),
        );
        istio.register(
            "dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream (unstable)",
            self.upstream_failures.clone(),
        );
        istio.register_with_unit(
            "dns_upstream_request_duration",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
            Unit::Seconds,
            self.upstream_duration.clone(),
        );
    }

    /// Counts a request.
    pub fn request(&self, labels: &DnsLabels) {
        self.requests.get_or_create(labels).inc();
    }

    /// Counts a request forwarded upstream.
    pub fn upstream_request(&self, labels: &DnsLabels) {
        self.upstream_requests.get_or_create(labels).inc();
    }

    /// Counts a forwarded request that got no answer.
    pub fn upstream_failure(&self, labels: &DnsLabels) {
        self.upstream_failures.get_or_create(labels).inc();
    }

    /// Records how long the upstream took for one forwarded request.
    pub fn upstream_duration(&self, labels: &DnsLabels, took: Duration) {
        self.upstream_duration
            .get_or_create(labels)
            .observe(took.as_secs_f64());
    }
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
        let text = render(&m);
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
        assert!(
            !text.contains("istio_dns_upstream_failures"),
            "nothing failed: {text}"
        );
        let h = "istio_dns_upstream_request_duration_seconds";
        assert!(
            text.contains(&format!("{h}_bucket{{le=\"0.001\",{srv}}} 0\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{h}_bucket{{le=\"0.01\",{srv}}} 1\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{h}_bucket{{le=\"+Inf\",{srv}}} 1\n")),
            "{text}"
        );
        assert!(text.contains(&format!("{h}_count{{{srv}}} 1\n")), "{text}");
    }

    fn render(m: &DnsMetrics) -> String {
        let mut registry = Registry::default();
        m.register(registry.sub_registry_with_prefix("istio"));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        text
    }

    #[test]
    fn label_values_are_escaped() {
        let m = DnsMetrics::default();
        m.request(&DnsLabels {
            canonical_service: "a\"b\\c\nd".into(),
            ..labels("a")
        });
        let text = render(&m);
        assert!(
            text.contains("source_canonical_service=\"a\\\"b\\\\c\\nd\""),
            "{text}"
        );
    }
}
