//! Per-connection access log (tracing target `access`), which also feeds the connection counters
//! ([`Metrics`]).
//!
//! Fields follow ztunnel (`../shared/spec/ztunnel.md` §7): `src.addr`, `src.identity`, `dst.addr`,
//! `dst.hbone_addr`, `dst.identity`, `direction`, `bytes_sent`, `bytes_recv`, `duration` (`"<n>ms"`).
//!
//! The access log keeps ztunnel's unflipped view from the proxy: `bytes_sent` is what the proxy
//! forwarded towards its remote side (the server when outbound, the client when inbound) and
//! `bytes_recv` what came back from it (the counters flip it, see [`crate::proxy::metrics`]).

use std::net::SocketAddr;
use std::time::Instant;

use crate::proxy::identity::Identity;
use crate::proxy::metrics::{ByteCounts, Direction, Metrics};

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
        metrics.connection_opened(direction);
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
        metrics.connection_closed(self.direction, bytes);
        let enabled = match error {
            None => tracing::enabled!(target: "access", tracing::Level::INFO),
            Some(_) => tracing::enabled!(target: "access", tracing::Level::ERROR),
        };
        if !enabled {
            // Nothing to format (the counters above are all a disabled log needs).
            return;
        }
        let (bytes_sent, bytes_recv) = proxy_view(bytes, self.direction);
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
        metrics.connection_failed(self.direction);
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

/// `(bytes_sent, bytes_recv)` of the access log for a connection in `direction` (unflipped: what
/// the proxy sent towards, and received from, its remote side).
fn proxy_view(bytes: ByteCounts, direction: Direction) -> (u64, u64) {
    match direction {
        Direction::Outbound => (bytes.client_to_server, bytes.server_to_client),
        Direction::Inbound => (bytes.server_to_client, bytes.client_to_server),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::proxy::copy::Transferred;
    use crate::proxy::metrics::tests::{assert_byte_counters, counter};

    pub(crate) fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
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
}
