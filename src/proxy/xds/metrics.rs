//! The xDS client's metrics with ztunnel's names (`src/xds/metrics.rs`; spec ztunnel.md §7):
//! `istio_xds_message_total{url}` and `istio_xds_message_bytes_total{url}` (responses received
//! and the bytes of their resources, by type URL) and
//! `istio_xds_connection_terminations_total{reason}` (ended streams).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::{Registry, Unit};

/// `reason` of `istio_xds_connection_terminations_total` (ztunnel's values).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum TerminationReason {
    /// The stream could not be opened (no connection).
    ConnectionError,
    /// The stream failed while open.
    Error,
    /// The server ended the stream.
    Complete,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Termination {
    reason: TerminationReason,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeUrl {
    url: String,
}

/// The xDS client's counters, ztunnel's `src/xds/metrics.rs`.
#[derive(Debug, Default)]
pub struct XdsMetrics {
    terminations: Family<Termination, Counter>,
    messages: Family<TypeUrl, Counter>,
    message_bytes: Family<TypeUrl, Counter>,
}

impl XdsMetrics {
    /// Registers the families into `istio` (the registry with the `istio` prefix).
    pub fn register(&self, istio: &mut Registry) {
        istio.register(
            "xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            self.terminations.clone(),
        );
        istio.register(
            "xds_message",
            "Total number of messages received (unstable)",
            self.messages.clone(),
        );
        istio.register_with_unit(
            "xds_message",
            "Total number of bytes received (unstable)",
            Unit::Bytes,
            self.message_bytes.clone(),
        );
    }

    /// Counts one response of `type_url` whose resources carry `bytes` bytes.
    pub fn message(&self, type_url: &str, bytes: u64) {
        let url = TypeUrl {
            url: type_url.to_owned(),
        };
        self.messages.get_or_create(&url).inc();
        self.message_bytes.get_or_create(&url).inc_by(bytes);
    }

    /// Counts an ended xDS stream.
    pub fn terminated(&self, reason: TerminationReason) {
        self.terminations
            .get_or_create(&Termination { reason })
            .inc();
    }
}
