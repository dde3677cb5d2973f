//! Per-connection access log (tracing target `access`) and Istio-named TCP counters.
//!
//! Fields follow ztunnel (`../shared/spec/ztunnel.md` §7): `src.addr`, `src.identity`, `dst.addr`,
//! `dst.hbone_addr`, `dst.identity`, `direction`, `bytes_sent`, `bytes_recv`, `duration` ("<n>ms").
//! The counters are exported as `istio_tcp_connections_opened_total`,
//! `istio_tcp_connections_closed_total`, `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`
//! and `istio_tcp_connections_failed_total`, labelled by `reporter` (source = outbound, destination =
//! inbound).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::proxy::copy::Transferred;
use crate::proxy::identity::Identity;

/// Direction of a proxied connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the pod's app to somewhere (reporter `source`).
    Outbound,
    /// Towards the pod's app (reporter `destination`).
    Inbound,
}

impl Direction {
    fn as_str(self) -> &'static str {
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
                "Bytes sent to the peer",
                &self.sent,
            ),
            (
                "istio_tcp_received_bytes_total",
                "Bytes received from the peer",
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
        out
    }

    /// Total opened connections in `direction` (for tests and the demo).
    pub fn opened(&self, direction: Direction) -> u64 {
        self.opened[direction.idx()].load(Ordering::Relaxed)
    }
}

/// One connection being logged; call [`ConnectionLog::finish`] or [`ConnectionLog::failed`] once.
#[derive(Debug)]
pub struct ConnectionLog {
    /// Direction.
    pub direction: Direction,
    /// Client address.
    pub src: SocketAddr,
    /// Client identity (mTLS peers only).
    pub src_identity: Option<Identity>,
    /// Final destination.
    pub dst: SocketAddr,
    /// HBONE address used, if tunnelled.
    pub hbone_addr: Option<SocketAddr>,
    /// Destination identity, if known.
    pub dst_identity: Option<Identity>,
    start: Instant,
}

impl ConnectionLog {
    /// Starts a record and counts the connection as opened.
    pub fn open(
        metrics: &Metrics,
        direction: Direction,
        src: SocketAddr,
        dst: SocketAddr,
    ) -> ConnectionLog {
        metrics.opened[direction.idx()].fetch_add(1, Ordering::Relaxed);
        ConnectionLog {
            direction,
            src,
            src_identity: None,
            dst,
            hbone_addr: None,
            dst_identity: None,
            start: Instant::now(),
        }
    }

    /// Logs "connection complete" (info) or, with `error`, the same at error level, and counts it.
    pub fn finish(
        self,
        metrics: &Metrics,
        bytes: Transferred,
        error: Option<&dyn std::fmt::Display>,
    ) {
        let i = self.direction.idx();
        metrics.closed[i].fetch_add(1, Ordering::Relaxed);
        metrics.sent[i].fetch_add(bytes.sent, Ordering::Relaxed);
        metrics.received[i].fetch_add(bytes.received, Ordering::Relaxed);
        let duration = format!("{}ms", self.start.elapsed().as_millis());
        let src_id = self.src_identity.as_ref().map(ToString::to_string);
        let dst_id = self.dst_identity.as_ref().map(ToString::to_string);
        let hbone = self.hbone_addr.map(|a| a.to_string());
        match error {
            None => tracing::info!(
                target: "access",
                direction = self.direction.as_str(),
                "src.addr" = %self.src,
                "src.identity" = src_id.as_deref(),
                "dst.addr" = %self.dst,
                "dst.hbone_addr" = hbone.as_deref(),
                "dst.identity" = dst_id.as_deref(),
                bytes_sent = bytes.sent,
                bytes_recv = bytes.received,
                duration = %duration,
                "connection complete"
            ),
            Some(e) => tracing::error!(
                target: "access",
                direction = self.direction.as_str(),
                "src.addr" = %self.src,
                "src.identity" = src_id.as_deref(),
                "dst.addr" = %self.dst,
                "dst.hbone_addr" = hbone.as_deref(),
                "dst.identity" = dst_id.as_deref(),
                bytes_sent = bytes.sent,
                bytes_recv = bytes.received,
                duration = %duration,
                error = %e,
                "connection complete"
            ),
        }
    }

    /// Logs "connection failed" (warn) for a connection that never carried data, and counts it.
    pub fn failed(self, metrics: &Metrics, error: &dyn std::fmt::Display) {
        metrics.failed[self.direction.idx()].fetch_add(1, Ordering::Relaxed);
        metrics.closed[self.direction.idx()].fetch_add(1, Ordering::Relaxed);
        let src_id = self.src_identity.as_ref().map(ToString::to_string);
        let dst_id = self.dst_identity.as_ref().map(ToString::to_string);
        tracing::warn!(
            target: "access",
            direction = self.direction.as_str(),
            "src.addr" = %self.src,
            "src.identity" = src_id.as_deref(),
            "dst.addr" = %self.dst,
            "dst.identity" = dst_id.as_deref(),
            error = %error,
            "connection failed"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_with_istio_names() {
        let m = Metrics::default();
        let log = ConnectionLog::open(
            &m,
            Direction::Inbound,
            "10.0.0.1:5".parse().expect("a"),
            "10.0.0.2:80".parse().expect("a"),
        );
        log.finish(
            &m,
            Transferred {
                sent: 11,
                received: 22,
            },
            None,
        );
        let text = m.render();
        assert!(text.contains("istio_tcp_connections_opened_total{reporter=\"destination\",request_protocol=\"tcp\"} 1"), "{text}");
        assert!(
            text.contains(
                "istio_tcp_sent_bytes_total{reporter=\"destination\",request_protocol=\"tcp\"} 11"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "istio_tcp_connections_opened_total{reporter=\"source\",request_protocol=\"tcp\"} 0"
            ),
            "{text}"
        );
        assert_eq!(m.opened(Direction::Inbound), 1);
    }
}
