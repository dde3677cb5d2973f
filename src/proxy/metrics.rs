//! Istio-named TCP connection counters of the whole proxy, rendered for `/metrics`.
//!
//! The counters are exported as `istio_tcp_connections_opened_total`,
//! `istio_tcp_connections_closed_total`, `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`
//! and `istio_tcp_connections_failed_total`, labelled by `reporter` (source = outbound, destination =
//! inbound).
//!
//! Byte counters follow Istio's flipped convention (istio/istio#32399): for both reporters,
//! `istio_tcp_received_bytes_total` counts the request direction (client → server) and
//! `istio_tcp_sent_bytes_total` the response direction (server → client), so the source and the
//! destination report the same numbers for one connection. The access log
//! ([`crate::proxy::accesslog`]) records each connection and feeds these counters.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::proxy::copy::Transferred;
use crate::proxy::dns::metrics::DnsMetrics;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the pod's app to somewhere (reporter `source`).
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

    fn idx(self) -> usize {
        match self {
            Direction::Outbound => 0,
            Direction::Inbound => 1,
        }
    }
}

/// Connection counters of the whole proxy.
#[derive(Debug, Default)]
pub struct Metrics {
    opened: [AtomicU64; 2],
    closed: [AtomicU64; 2],
    failed: [AtomicU64; 2],
    sent: [AtomicU64; 2],
    received: [AtomicU64; 2],
    /// The DNS proxy's counters (rendered after the TCP ones).
    pub dns: DnsMetrics,
}

impl Metrics {
    /// Prometheus text exposition of the counters.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, help, v) in [
            (
                "istio_tcp_connections_opened_total",
                "Total TCP connections opened",
                &self.opened,
            ),
            (
                "istio_tcp_connections_closed_total",
                "Total TCP connections closed",
                &self.closed,
            ),
            (
                "istio_tcp_connections_failed_total",
                "Total TCP connections that failed",
                &self.failed,
            ),
            (
                "istio_tcp_sent_bytes_total",
                "Bytes sent in the response direction (server to client)",
                &self.sent,
            ),
            (
                "istio_tcp_received_bytes_total",
                "Bytes received in the request direction (client to server)",
                &self.received,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} counter");
            for (i, reporter) in ["source", "destination"].iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}{{reporter=\"{reporter}\",request_protocol=\"tcp\"}} {}",
                    v[i].load(Ordering::Relaxed)
                );
            }
        }
        self.dns.render(&mut out);
        out
    }

    /// Total opened connections in `direction` (for tests and the demo).
    pub fn opened(&self, direction: Direction) -> u64 {
        self.opened[direction.idx()].load(Ordering::Relaxed)
    }

    /// Counts a connection opened in `direction`.
    pub fn connection_opened(&self, direction: Direction) {
        self.opened[direction.idx()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a connection in `direction` that ended after carrying `bytes` (closed, and the byte
    /// counters in the flipped convention of the module docs).
    pub fn connection_closed(&self, direction: Direction, bytes: ByteCounts) {
        let i = direction.idx();
        self.closed[i].fetch_add(1, Ordering::Relaxed);
        self.sent[i].fetch_add(bytes.server_to_client, Ordering::Relaxed);
        self.received[i].fetch_add(bytes.client_to_server, Ordering::Relaxed);
    }

    /// Counts a connection in `direction` that failed before carrying data (failed and closed).
    pub fn connection_failed(&self, direction: Direction) {
        self.failed[direction.idx()].fetch_add(1, Ordering::Relaxed);
        self.closed[direction.idx()].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The value of counter `name` for `reporter` in rendered metrics `text`.
    pub(crate) fn counter(text: &str, name: &str, reporter: &str) -> u64 {
        let prefix = format!("{name}{{reporter=\"{reporter}\",request_protocol=\"tcp\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {text}"))
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
