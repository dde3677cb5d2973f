//! Per-connection access log (tracing target `access`) and Istio-named TCP counters.
//!
//! Fields follow ztunnel (`../shared/spec/ztunnel.md` §7): `src.addr`, `src.identity`, `dst.addr`,
//! `dst.hbone_addr`, `dst.identity`, `direction`, `bytes_sent`, `bytes_recv`, `duration` (`"<n>ms"`).
//! The counters are exported as `istio_tcp_connections_opened_total`,
//! `istio_tcp_connections_closed_total`, `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`
//! and `istio_tcp_connections_failed_total`, labelled by `reporter` (source = outbound, destination =
//! inbound).
//!
//! Byte counters follow Istio's flipped convention (istio/istio#32399): for both reporters,
//! `istio_tcp_received_bytes_total` counts the request direction (client → server) and
//! `istio_tcp_sent_bytes_total` the response direction (server → client), so the source and the
//! destination report the same numbers for one connection. The access log keeps ztunnel's unflipped
//! view from the proxy: `bytes_sent` is what the proxy forwarded towards its remote side (the server
//! when outbound, the client when inbound) and `bytes_recv` what came back from it.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::proxy::copy::Transferred;
use crate::proxy::identity::Identity;

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

    /// `(bytes_sent, bytes_recv)` of the access log for a connection in `direction` (unflipped: what
    /// the proxy sent towards, and received from, its remote side).
    fn proxy_view(self, direction: Direction) -> (u64, u64) {
        match direction {
            Direction::Outbound => (self.client_to_server, self.server_to_client),
            Direction::Inbound => (self.server_to_client, self.client_to_server),
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

    /// Logs "connection complete" (info) or, with `error`, the same at error level, and counts it
    /// (byte counters flipped, log fields unflipped; see the module docs).
    pub fn finish(
        self,
        metrics: &Metrics,
        bytes: ByteCounts,
        error: Option<&dyn std::fmt::Display>,
    ) {
        let i = self.direction.idx();
        metrics.closed[i].fetch_add(1, Ordering::Relaxed);
        metrics.sent[i].fetch_add(bytes.server_to_client, Ordering::Relaxed);
        metrics.received[i].fetch_add(bytes.client_to_server, Ordering::Relaxed);
        let enabled = match error {
            None => tracing::enabled!(target: "access", tracing::Level::INFO),
            Some(_) => tracing::enabled!(target: "access", tracing::Level::ERROR),
        };
        if !enabled {
            // Nothing to format (the counters above are all a disabled log needs).
            return;
        }
        let (bytes_sent, bytes_recv) = bytes.proxy_view(self.direction);
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
                bytes_sent,
                bytes_recv,
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
                bytes_sent,
                bytes_recv,
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
        if !tracing::enabled!(target: "access", tracing::Level::WARN) {
            return;
        }
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
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    pub(crate) fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

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

    /// Runs `f` with the fmt subscriber writing into a buffer; returns `f`'s result and the text.
    pub(crate) fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let r = tracing::subscriber::with_default(subscriber, f);
        let logs = String::from_utf8(buf.0.lock().expect("buf").clone()).expect("utf8");
        (r, logs)
    }

    #[test]
    fn counters_render_with_istio_names() {
        let m = Metrics::default();
        let log = ConnectionLog::open(
            &m,
            Direction::Inbound,
            addr("10.0.0.1:5"),
            addr("10.0.0.2:80"),
        );
        log.finish(
            &m,
            ByteCounts {
                client_to_server: 22,
                server_to_client: 11,
            },
            None,
        );
        let text = m.render();
        assert_eq!(
            counter(&text, "istio_tcp_connections_opened_total", "destination"),
            1
        );
        assert_eq!(
            counter(&text, "istio_tcp_sent_bytes_total", "destination"),
            11
        );
        assert_eq!(
            counter(&text, "istio_tcp_connections_opened_total", "source"),
            0
        );
        assert_eq!(m.opened(Direction::Inbound), 1);
    }

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buf").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// One connection, client sent 100 bytes and the server answered 7, seen by both proxies the
    /// way their relays report it.
    #[test]
    fn both_reporters_agree_on_flipped_byte_counters_and_logs_stay_unflipped() {
        let m = Metrics::default();
        let ((), logs) = capture_logs(|| {
            // outbound: relay_h2(client tcp, ..) => sent = client -> server
            let out = ConnectionLog::open(
                &m,
                Direction::Outbound,
                addr("10.0.0.1:5"),
                addr("10.0.0.2:80"),
            );
            let t = Transferred {
                sent: 100,
                received: 7,
            };
            out.finish(&m, ByteCounts::client_side(t), None);
            // inbound HBONE: relay_h2(app tcp, ..) => sent = server -> client
            let inb = ConnectionLog::open(
                &m,
                Direction::Inbound,
                addr("10.0.0.1:5"),
                addr("10.0.0.2:80"),
            );
            let t = Transferred {
                sent: 7,
                received: 100,
            };
            inb.finish(&m, ByteCounts::server_side(t), None);
        });
        assert_byte_counters(&m.render(), 100, 7);
        let line = |dir: &str| {
            logs.lines()
                .find(|l| l.contains(&format!("direction=\"{dir}\"")))
                .unwrap_or_else(|| panic!("no {dir} line in {logs}"))
                .to_owned()
        };
        let out = line("outbound");
        assert!(out.contains("bytes_sent=100 bytes_recv=7"), "{out}");
        let inb = line("inbound");
        assert!(inb.contains("bytes_sent=7 bytes_recv=100"), "{inb}");
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
