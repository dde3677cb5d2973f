//! The proxy's metrics with ztunnel's names and labels (`../shared/spec/ztunnel.md` §7), kept
//! in prometheus-client families that [`Metrics::register`] adds to the process's registry:
//!
//! - `istio_tcp_connections_opened_total`, `istio_tcp_connections_closed_total`,
//!   `istio_tcp_connections_failed_total` (closed with a failure flag), `istio_tcp_sent_bytes_total`
//!   and `istio_tcp_received_bytes_total`, labelled with ztunnel's traffic labels
//!   ([`labels::TrafficLabels`]: `reporter` source = outbound, destination = inbound, the source
//!   and destination workloads, the service, `connection_security_policy`, ...);
//! - `istio_tcp_sockets_open` (gauge, label `reporter`): connections open now;
//! - the DNS proxy's `istio_dns_*` ([`DnsMetrics`]);
//! - `workload_manager_active_proxy_count`, `workload_manager_pending_proxy_count`,
//!   `workload_manager_proxies_started_total`, `workload_manager_proxies_stopped_total`
//!   ([`WorkloadManagerMetrics`]).
//!
//! Byte counters follow Istio's flipped convention (istio/istio#32399): for both reporters,
//! `istio_tcp_received_bytes_total` counts the request direction (client → server) and
//! `istio_tcp_sent_bytes_total` the response direction (server → client), so the source and the
//! destination report the same numbers for one connection. The access log
//! ([`crate::proxy::accesslog`]) records each connection and feeds these counters.

pub mod labels;

use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::proxy::copy::Transferred;
use crate::proxy::dns::metrics::DnsMetrics;
use labels::{ResponseFlags, TrafficLabels};

/// Bytes of one finished connection, by direction of the original request.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ByteCounts {
    /// From the client (the side that opened the connection) to the server.
    pub client_to_server: u64,
    /// From the server back to the client.
    pub server_to_client: u64,
}

impl ByteCounts {
    /// Counts of a relay whose local TCP side (the `Transferred` orientation) is the client: the
    /// outbound paths and the inbound plaintext path (`relay_tcp(client, app)`).
    pub fn client_side(t: Transferred) -> ByteCounts {
        ByteCounts {
            client_to_server: t.sent,
            server_to_client: t.received,
        }
    }

    /// Counts of a relay whose local TCP side is the server (the app): inbound HBONE
    /// (`relay_h2(app, ..)`).
    pub fn server_side(t: Transferred) -> ByteCounts {
        ByteCounts {
            client_to_server: t.received,
            server_to_client: t.sent,
        }
    }
}

/// Direction of a proxied connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the pod's app to somewhere (reporter `source`).
    #[default]
    Outbound,
    /// Towards the pod's app (reporter `destination`).
    Inbound,
}

impl Direction {
    /// `outbound` or `inbound`, as the access log's `direction` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::Inbound => "inbound",
        }
    }

    /// `source` or `destination`, as the `reporter` label.
    pub fn reporter(self) -> &'static str {
        match self {
            Direction::Outbound => "source",
            Direction::Inbound => "destination",
        }
    }
}

/// The label of `istio_tcp_sockets_open`.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SocketLabels {
    /// `source` or `destination`.
    pub reporter: Direction,
}

/// The TCP families (clones share the series).
#[derive(Debug, Default, Clone)]
struct TcpFamilies {
    opened: Family<TrafficLabels, Counter>,
    closed: Family<TrafficLabels, Counter>,
    failed: Family<TrafficLabels, Counter>,
    sent: Family<TrafficLabels, Counter>,
    received: Family<TrafficLabels, Counter>,
    sockets_open: Family<SocketLabels, Gauge>,
}

/// The proxy's metric families (clones share the series: [`Metrics::register`] adds clones).
#[derive(Debug, Default)]
pub struct Metrics {
    tcp: TcpFamilies,
    /// One shared [`Series`] per label set in use (see [`Metrics::intern`]).
    interned: RwLock<foldhash::HashMap<TrafficLabels, Arc<Series>>>,
    /// The series of a connection not described yet, per direction ([`Metrics::undescribed`]).
    undescribed: [OnceLock<Arc<Series>>; 2],
    /// The DNS proxy's metrics.
    pub dns: DnsMetrics,
    /// The in-pod workload manager's metrics.
    pub workload_manager: WorkloadManagerMetrics,
}

impl Metrics {
    /// Registers every family into `registry`: the `istio_` ones under that prefix, the workload
    /// manager's under `workload_manager_` (as ztunnel's registry lays them out).
    pub fn register(&self, registry: &mut Registry) {
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register(
            "tcp_connections_opened",
            "The total number of TCP connections opened",
            self.tcp.opened.clone(),
        );
        istio.register(
            "tcp_connections_closed",
            "The total number of TCP connections closed",
            self.tcp.closed.clone(),
        );
        istio.register(
            "tcp_received_bytes",
            "The size of total bytes received during request in case of a TCP connection",
            self.tcp.received.clone(),
        );
        istio.register(
            "tcp_sent_bytes",
            "The size of total bytes sent during response in case of a TCP connection",
            self.tcp.sent.clone(),
        );
        istio.register(
            "tcp_connections_failed",
            "The total number of TCP connections that failed to establish (unstable)",
            self.tcp.failed.clone(),
        );
        istio.register(
            "tcp_sockets_open",
            "The current number of open TCP sockets (unstable)",
            self.tcp.sockets_open.clone(),
        );
        self.dns.register(istio);
        self.workload_manager
            .register(registry.sub_registry_with_prefix("workload_manager"));
    }

    /// The OpenMetrics text of these families alone (tests, the demo).
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut out = String::new();
        // writing into a String does not fail
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }

    /// The shared [`Series`] of `labels`: a connection keeps a pointer for its life instead of
    /// its own label set (about 400 bytes and a dozen strings), and counts into the series'
    /// counters without looking its labels up in each family again (one label-set hash per
    /// connection instead of one per counter it moves). Like the families, which keep every label
    /// set they counted, the table only grows (by the label sets interned, counted or not).
    pub fn intern(&self, labels: TrafficLabels) -> Arc<Series> {
        if let Some(s) = self
            .interned
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&labels)
        {
            return s.clone();
        }
        self.interned
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(labels.clone())
            .or_insert_with(|| {
                Arc::new(Series {
                    labels,
                    families: self.tcp.clone(),
                    opened: OnceLock::new(),
                    closed: OnceLock::new(),
                    failed: OnceLock::new(),
                    sent: OnceLock::new(),
                    received: OnceLock::new(),
                    socket: OnceLock::new(),
                })
            })
            .clone()
    }

    /// The series of a connection in `direction` that is not described yet (the labels
    /// `TrafficLabels::new(direction, false)`), interned once.
    pub fn undescribed(&self, direction: Direction) -> Arc<Series> {
        let slot = match direction {
            Direction::Outbound => &self.undescribed[0],
            Direction::Inbound => &self.undescribed[1],
        };
        slot.get_or_init(|| self.intern(TrafficLabels::new(direction, false)))
            .clone()
    }
}

/// The counters of one label set: handles to its series in each family of [`Metrics`] (a clone
/// of a prometheus-client metric shares its value), each looked up once, when the label set first
/// moves that counter (so a family shows a series only once it was counted, as before: no
/// `istio_tcp_connections_failed_total` line for labels that never failed). After that, counting
/// a connection needs no lookup.
#[derive(Debug)]
pub struct Series {
    labels: TrafficLabels,
    families: TcpFamilies,
    opened: OnceLock<Counter>,
    closed: OnceLock<Counter>,
    failed: OnceLock<Counter>,
    sent: OnceLock<Counter>,
    received: OnceLock<Counter>,
    /// `istio_tcp_sockets_open` of the labels' reporter.
    socket: OnceLock<Gauge>,
}

impl Series {
    /// The label set.
    pub fn labels(&self) -> &TrafficLabels {
        &self.labels
    }

    /// Counts a connection opened and one more open socket, whose series it returns (to
    /// decrement when the connection is gone).
    pub fn connection_opened(&self) -> Gauge {
        self.counter(&self.opened, &self.families.opened).inc();
        let socket = self.socket.get_or_init(|| {
            self.families
                .sockets_open
                .get_or_create_owned(&SocketLabels {
                    reporter: self.labels.reporter,
                })
        });
        socket.inc();
        socket.clone()
    }

    /// Counts a connection that ended after carrying `bytes` (closed, the byte counters in the
    /// flipped convention of the module docs, and failed when its `response_flags` say so).
    pub fn connection_closed(&self, bytes: ByteCounts) {
        let f = &self.families;
        self.counter(&self.closed, &f.closed).inc();
        self.counter(&self.sent, &f.sent)
            .inc_by(bytes.server_to_client);
        self.counter(&self.received, &f.received)
            .inc_by(bytes.client_to_server);
        if self.labels.response_flags != ResponseFlags::None {
            self.counter(&self.failed, &f.failed).inc();
        }
    }

    /// The series of these labels in `family`, looked up (and created) on first use.
    fn counter<'a>(
        &self,
        cell: &'a OnceLock<Counter>,
        family: &Family<TrafficLabels, Counter>,
    ) -> &'a Counter {
        cell.get_or_init(|| family.get_or_create_owned(&self.labels))
    }
}

/// The in-pod workload manager's figures, ztunnel's `src/inpod/metrics.rs`.
#[derive(Debug, Default)]
pub struct WorkloadManagerMetrics {
    /// Pods whose proxy is up.
    pub active: Gauge,
    /// Pods whose proxy is not up yet (retried).
    pub pending: Gauge,
    /// Proxies started.
    pub started: Counter,
    /// Proxies stopped.
    pub stopped: Counter,
}

impl WorkloadManagerMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "active_proxy_count",
            "The total number current workloads with active proxies (unstable)",
            self.active.clone(),
        );
        registry.register(
            "pending_proxy_count",
            "The total number current workloads with pending proxies (unstable)",
            self.pending.clone(),
        );
        registry.register(
            "proxies_started",
            "The total number of proxies that were started (unstable)",
            self.started.clone(),
        );
        registry.register(
            "proxies_stopped",
            "The total number of proxies that were stopped (unstable)",
            self.stopped.clone(),
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The sum of TCP counter `name`'s series for `reporter` in rendered metrics `text` (0 when
    /// the family has none: prometheus-client leaves out a family without series).
    pub(crate) fn counter(text: &str, name: &str, reporter: &str) -> u64 {
        assert!(
            [
                "istio_tcp_connections_opened_total",
                "istio_tcp_connections_closed_total",
                "istio_tcp_connections_failed_total",
                "istio_tcp_sent_bytes_total",
                "istio_tcp_received_bytes_total",
            ]
            .contains(&name),
            "not a TCP counter: {name}"
        );
        let reporter = format!("reporter=\"{reporter}\"");
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&reporter))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Asserts both reporters' byte counters: `received` in the request direction, `sent` in the
    /// response direction (the flipped convention of the module docs).
    pub(crate) fn assert_byte_counters(text: &str, received: u64, sent: u64) {
        for reporter in ["source", "destination"] {
            assert_eq!(
                counter(text, "istio_tcp_received_bytes_total", reporter),
                received,
                "{reporter}: received = request direction\n{text}"
            );
            assert_eq!(
                counter(text, "istio_tcp_sent_bytes_total", reporter),
                sent,
                "{reporter}: sent = response direction\n{text}"
            );
        }
    }

    #[test]
    fn equal_label_sets_share_one_copy() {
        let m = Metrics::default();
        let a = m.intern(TrafficLabels::new(Direction::Inbound, true));
        let b = m.intern(TrafficLabels::new(Direction::Inbound, true));
        let c = m.intern(TrafficLabels::new(Direction::Outbound, true));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.labels().reporter, Direction::Outbound);
    }

    #[test]
    fn series_of_equal_labels_count_into_the_same_family_series() {
        let m = Metrics::default();
        let opened = m.intern(TrafficLabels::new(Direction::Inbound, true));
        let socket = opened.connection_opened();
        m.intern(TrafficLabels::new(Direction::Inbound, true))
            .connection_closed(ByteCounts {
                client_to_server: 5,
                server_to_client: 7,
            });
        let mut failed = TrafficLabels::new(Direction::Inbound, true);
        failed.response_flags = ResponseFlags::Connect;
        m.intern(failed).connection_closed(ByteCounts::default());
        let text = m.render();
        let of = |name| counter(&text, name, "destination");
        assert_eq!(of("istio_tcp_connections_opened_total"), 1, "{text}");
        assert_eq!(of("istio_tcp_connections_closed_total"), 2, "{text}");
        assert_eq!(of("istio_tcp_connections_failed_total"), 1, "{text}");
        assert_eq!(of("istio_tcp_received_bytes_total"), 5, "{text}");
        assert_eq!(of("istio_tcp_sent_bytes_total"), 7, "{text}");
        assert_eq!(socket.get(), 1);
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"destination\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn a_label_set_shows_only_the_counters_it_moved() {
        let m = Metrics::default();
        let _undescribed = m.undescribed(Direction::Outbound);
        let s = m.intern(TrafficLabels::new(Direction::Inbound, true));
        let _socket = s.connection_opened();
        s.connection_closed(ByteCounts::default());
        let text = m.render();
        assert!(
            text.contains("istio_tcp_connections_closed_total{"),
            "{text}"
        );
        assert!(
            !text.contains("istio_tcp_connections_failed_total{"),
            "{text}"
        );
        assert!(!text.contains("reporter=\"source\""), "{text}");
    }

    #[test]
    fn client_and_server_side_relays_map_to_the_same_counts() {
        let c = ByteCounts::client_side(Transferred {
            sent: 3,
            received: 4,
        });
        let s = ByteCounts::server_side(Transferred {
            sent: 4,
            received: 3,
        });
        assert_eq!(c, s);
        assert_eq!(
            c,
            ByteCounts {
                client_to_server: 3,
                server_to_client: 4
            }
        );
    }
}
