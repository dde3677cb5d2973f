//! Per-connection access log (tracing target `access`), which also feeds the connection metrics
//! ([`Metrics`]).
//!
//! Fields follow ztunnel (`src/proxy/metrics.rs`; `../shared/spec/ztunnel.md` §7), in its order:
//! `src.addr`, `src.workload` (the pod's name, else its canonical service), `src.namespace`,
//! `src.identity` (mTLS only), `src.cluster`, `dst.addr` (the address connected to: the HBONE
//! address `pod:15008` when tunnelled, else the target), `dst.hbone_addr` (the CONNECT target),
//! `dst.service`, `dst.workload`, `dst.namespace`, `dst.identity` (mTLS only), `dst.cluster`,
//! `direction` (`outbound`/`inbound`), `bytes_sent`, `bytes_recv`, `duration` (`"<n>ms"`) and
//! `error`. A field whose value is unknown is left out. "connection opened" is logged at debug,
//! "connection complete" at info (error with `error`), a connection that never carried data
//! "connection failed" at warn.
//!
//! The access log keeps ztunnel's unflipped view from the proxy: `bytes_sent` is what the proxy
//! forwarded towards its remote side (the server when outbound, the client when inbound) and
//! `bytes_recv` what came back from it (the counters flip it, see [`crate::proxy::metrics`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::metrics::gauge::Gauge;

use crate::proxy::identity::Identity;
use crate::proxy::metrics::labels::{ResponseFlags, SecurityPolicy, TrafficLabels};
use crate::proxy::metrics::{ByteCounts, Direction, Metrics, Series};
use crate::proxy::state::Workload;

/// One access-log event at `level` with the [`Fields`] `f`, then `rest` (more fields, message).
macro_rules! access_event {
    ($level:expr, $f:ident, $($rest:tt)*) => {
        tracing::event!(
            target: "access",
            $level,
            "src.addr" = %$f.src_addr,
            "src.workload" = $f.src_workload.as_deref(),
            "src.namespace" = $f.src_namespace.as_deref(),
            "src.identity" = $f.src_identity.as_deref(),
            "src.cluster" = $f.src_cluster.as_deref(),
            "dst.addr" = %$f.dst_addr,
            "dst.hbone_addr" = $f.dst_hbone_addr.map(tracing::field::display),
            "dst.service" = $f.dst_service.as_deref(),
            "dst.workload" = $f.dst_workload.as_deref(),
            "dst.namespace" = $f.dst_namespace.as_deref(),
            "dst.identity" = $f.dst_identity.as_deref(),
            "dst.cluster" = $f.dst_cluster.as_deref(),
            direction = $f.direction,
            $($rest)*
        )
    };
}

/// One connection being logged; [`ConnectionLog::finish`] or [`ConnectionLog::failed`] ends it.
///
/// One pointer wide: a relaying task keeps it for the connection's life (see
/// [`crate::proxy::task`]).
#[derive(Debug)]
pub struct ConnectionLog(Box<Record>);

#[derive(Debug)]
struct Record {
    /// The labels and their counters, shared with every connection of the same labels
    /// ([`Metrics::intern`]).
    series: Arc<Series>,
    src: SocketAddr,
    src_workload: Option<Arc<Workload>>,
    dst: SocketAddr,
    hbone_addr: Option<SocketAddr>,
    dst_workload: Option<Arc<Workload>>,
    start: Instant,
    /// The `istio_tcp_sockets_open` series, once counted as opened.
    socket: Option<Gauge>,
}

/// What the access log names a workload: its pod name, else its canonical service.
fn workload_name(w: Option<&Workload>, labels_service: Option<&str>) -> Option<String> {
    w.map(|w| w.name.as_str())
        .filter(|n| !n.is_empty())
        .or(labels_service)
        .map(str::to_owned)
}

impl ConnectionLog {
    /// Starts a record of a connection from `src` to `dst` (not counted yet: see
    /// [`ConnectionLog::opened`]).
    pub fn new(
        metrics: &Metrics,
        direction: Direction,
        src: SocketAddr,
        dst: SocketAddr,
    ) -> ConnectionLog {
        ConnectionLog(Box::new(Record {
            series: metrics.undescribed(direction),
            src,
            src_workload: None,
            dst,
            hbone_addr: None,
            dst_workload: None,
            start: Instant::now(),
            socket: None,
        }))
    }

    /// Sets the labels (interned in `metrics`), and the source and destination workloads the log
    /// names.
    pub fn describe(
        &mut self,
        metrics: &Metrics,
        labels: TrafficLabels,
        src: Option<Arc<Workload>>,
        dst: Option<Arc<Workload>>,
    ) {
        let r = &mut *self.0;
        r.series = metrics.intern(labels);
        r.src_workload = src;
        r.dst_workload = dst;
    }

    /// Sets the `response_flags` the connection ends with (see [`ConnectionLog::finish`]).
    pub fn set_flags(&mut self, metrics: &Metrics, flags: ResponseFlags) {
        if self.0.series.labels().response_flags != flags {
            let mut l = self.0.series.labels().clone();
            l.response_flags = flags;
            self.0.series = metrics.intern(l);
        }
    }

    /// The labels so far.
    pub fn labels(&self) -> &TrafficLabels {
        self.0.series.labels()
    }

    /// Sets the address connected to (`dst.addr`).
    pub fn set_dst(&mut self, dst: SocketAddr) {
        self.0.dst = dst;
    }

    /// Sets the HBONE CONNECT target (`dst.hbone_addr`).
    pub fn set_hbone_target(&mut self, target: SocketAddr) {
        self.0.hbone_addr = Some(target);
    }

    /// Counts the connection as opened (once) and logs "connection opened" (debug).
    pub fn opened(&mut self) {
        if self.0.socket.is_some() {
            return;
        }
        self.0.socket = Some(self.0.series.connection_opened());
        if tracing::enabled!(target: "access", tracing::Level::DEBUG) {
            let f = Fields::of(&self.0);
            access_event!(tracing::Level::DEBUG, f, "connection opened");
        }
    }

    /// Logs "connection complete" (info) or, with `error`, the same at error level with
    /// `response_flags` `CONNECT` (unless [`ConnectionLog::set_flags`] set others), and counts it (byte counters flipped, log fields unflipped;
    /// see the module docs).
    pub fn finish(
        mut self,
        metrics: &Metrics,
        bytes: ByteCounts,
        error: Option<&dyn std::fmt::Display>,
    ) {
        self.opened();
        if error.is_some() && self.labels().response_flags == ResponseFlags::None {
            self.set_flags(metrics, ResponseFlags::Connect);
        }
        self.0.series.connection_closed(bytes);
        let enabled = match error {
            None => tracing::enabled!(target: "access", tracing::Level::INFO),
            Some(_) => tracing::enabled!(target: "access", tracing::Level::ERROR),
        };
        if !enabled {
            // Nothing to format (the counters above are all a disabled log needs).
            return;
        }
        let (bytes_sent, bytes_recv) = proxy_view(bytes, self.labels().reporter);
        let duration = format!("{}ms", self.0.start.elapsed().as_millis());
        let f = Fields::of(&self.0);
        match error {
            None => access_event!(
                tracing::Level::INFO,
                f,
                bytes_sent,
                bytes_recv,
                duration = %duration,
                "connection complete"
            ),
            Some(e) => access_event!(
                tracing::Level::ERROR,
                f,
                bytes_sent,
                bytes_recv,
                duration = %duration,
                error = %e,
                "connection complete"
            ),
        }
    }

    /// Ends a connection the proxy closed itself (its pod stopped, the drain deadline): logged as
    /// complete with `why` as its error, counted as closed with `bytes` and no failure flag (ztunnel
    /// counts a drained connection as closed, not failed).
    pub fn finish_closed_by_proxy(mut self, bytes: ByteCounts, why: &str) {
        self.opened();
        self.0.series.connection_closed(bytes);
        if !tracing::enabled!(target: "access", tracing::Level::INFO) {
            return;
        }
        let (bytes_sent, bytes_recv) = proxy_view(bytes, self.labels().reporter);
        let duration = format!("{}ms", self.0.start.elapsed().as_millis());
        let f = Fields::of(&self.0);
        access_event!(
            tracing::Level::INFO,
            f,
            bytes_sent,
            bytes_recv,
            duration = %duration,
            error = %why,
            "connection complete"
        );
    }

    /// Logs "connection failed" (warn) for a connection that never carried data, and counts it
    /// (opened, closed and failed, with `flags`).
    pub fn failed(
        mut self,
        metrics: &Metrics,
        flags: ResponseFlags,
        error: &dyn std::fmt::Display,
    ) {
        self.opened();
        self.set_flags(
            metrics,
            match flags {
                ResponseFlags::None => ResponseFlags::Connect,
                f => f,
            },
        );
        self.0.series.connection_closed(ByteCounts::default());
        if !tracing::enabled!(target: "access", tracing::Level::WARN) {
            return;
        }
        let f = Fields::of(&self.0);
        access_event!(tracing::Level::WARN, f, error = %error, "connection failed");
    }
}

impl Drop for ConnectionLog {
    fn drop(&mut self) {
        // an open socket until the record goes, however the connection ended
        if let Some(g) = self.0.socket.take() {
            g.dec();
        }
    }
}

/// The identity fields of one record, as the access log writes them.
struct Fields {
    src_addr: SocketAddr,
    src_workload: Option<String>,
    src_namespace: Option<String>,
    src_identity: Option<String>,
    src_cluster: Option<String>,
    dst_addr: SocketAddr,
    dst_hbone_addr: Option<SocketAddr>,
    dst_service: Option<String>,
    dst_workload: Option<String>,
    dst_namespace: Option<String>,
    dst_identity: Option<String>,
    dst_cluster: Option<String>,
    direction: &'static str,
}

impl Fields {
    fn of(r: &Record) -> Fields {
        let l = r.series.labels();
        let mtls = l.connection_security_policy == SecurityPolicy::MutualTls;
        let id = |p: &Option<Identity>| p.as_ref().filter(|_| mtls).map(ToString::to_string);
        let own = |v: &crate::proxy::metrics::labels::Value| v.get().map(str::to_owned);
        Fields {
            src_addr: r.src,
            src_workload: workload_name(
                r.src_workload.as_deref(),
                l.source_canonical_service.get(),
            ),
            src_namespace: own(&l.source_workload_namespace),
            src_identity: id(&l.source_principal.0),
            src_cluster: own(&l.source_cluster),
            dst_addr: r.dst,
            dst_hbone_addr: r.hbone_addr,
            dst_service: own(&l.destination_service),
            dst_workload: workload_name(
                r.dst_workload.as_deref(),
                l.destination_canonical_service.get(),
            ),
            dst_namespace: own(&l.destination_workload_namespace),
            dst_identity: id(&l.destination_principal.0),
            dst_cluster: own(&l.destination_cluster),
            direction: l.reporter.as_str(),
        }
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

    /// A record of a connection in `direction` from 10.0.0.1:5 to 10.0.0.2:80, counted as opened.
    pub(crate) fn opened(m: &Metrics, direction: Direction) -> ConnectionLog {
        let mut log = ConnectionLog::new(m, direction, addr("10.0.0.1:5"), addr("10.0.0.2:80"));
        log.opened();
        log
    }

    #[test]
    fn counters_render_with_istio_names() {
        let m = Metrics::default();
        let log = opened(&m, Direction::Inbound);
        let text = m.render();
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"destination\"} 1\n"),
            "{text}"
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
        assert_eq!(
            counter(&text, "istio_tcp_connections_failed_total", "destination"),
            0
        );
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"destination\"} 0\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn a_failure_is_counted_opened_closed_and_failed_with_its_flag() {
        let m = Metrics::default();
        let log = ConnectionLog::new(
            &m,
            Direction::Inbound,
            addr("10.0.0.1:5"),
            addr("10.0.0.2:80"),
        );
        let ((), logs) =
            capture_logs(|| log.failed(&m, ResponseFlags::Denied, &"denied by policy"));
        let text = m.render();
        for name in [
            "istio_tcp_connections_opened_total",
            "istio_tcp_connections_closed_total",
            "istio_tcp_connections_failed_total",
        ] {
            assert_eq!(counter(&text, name, "destination"), 1, "{name}: {text}");
        }
        assert!(text.contains("response_flags=\"DENY\""), "{text}");
        assert!(logs.contains("connection failed"), "{logs}");
        assert!(logs.contains("error=denied by policy"), "{logs}");
    }

    #[test]
    fn a_record_dropped_unfinished_closes_its_socket() {
        let m = Metrics::default();
        drop(opened(&m, Direction::Outbound));
        let text = m.render();
        assert!(
            text.contains("istio_tcp_sockets_open{reporter=\"source\"} 0\n"),
            "{text}"
        );
    }

    /// The fields ztunnel logs, in its order, with their values: workload names, namespaces,
    /// identities (mTLS), the service, `dst.addr` the HBONE address and `dst.hbone_addr` the
    /// target.
    #[test]
    fn the_log_line_has_ztunnels_fields() {
        let yaml = r#"
workloads:
- {uid: a, name: client-pod, namespace: ns1, serviceAccount: alice, workloadIps: ["10.0.0.1"], protocol: HBONE, canonicalName: client}
- {uid: b, name: server-pod, namespace: ns2, serviceAccount: bob, workloadIps: ["10.0.0.2"], protocol: HBONE, services: {"ns2/svc.example": {80: 8080}}}
services:
- {name: svc, namespace: ns2, hostname: svc.example, vips: ["/10.96.0.1"], ports: {80: 8080}}
"#;
        let cfg = crate::proxy::config::parse_local_config(yaml).expect("config");
        let st = crate::proxy::state::ProxyState::from_config(&cfg).expect("state");
        let src = st
            .workload_by_ip("10.0.0.1".parse().expect("ip"))
            .expect("src");
        let dst = st
            .workload_by_ip("10.0.0.2".parse().expect("ip"))
            .expect("dst");
        let route = crate::proxy::route::Route {
            target: addr("10.0.0.2:8080"),
            hbone: Some(crate::proxy::route::Hbone {
                addr: addr("10.0.0.2:15008"),
                authority: addr("10.0.0.2:8080"),
                identity: dst.identity(),
                service_host: None,
            }),
        };
        let (labels, dest) = crate::proxy::metrics::labels::outbound(
            &st,
            &src,
            &src.identity(),
            addr("10.96.0.1:80"),
            &route,
        );
        let m = Metrics::default();
        let mut log = ConnectionLog::new(
            &m,
            Direction::Outbound,
            addr("10.0.0.1:5"),
            addr("10.96.0.1:80"),
        );
        log.describe(&m, labels, Some(src.clone()), dest);
        log.set_dst(addr("10.0.0.2:15008"));
        log.set_hbone_target(addr("10.0.0.2:8080"));
        let ((), logs) = capture_logs(|| {
            log.finish(
                &m,
                ByteCounts {
                    client_to_server: 3,
                    server_to_client: 4,
                },
                None,
            )
        });
        let line = logs
            .lines()
            .find(|l| l.contains("connection complete"))
            .expect("line");
        let want = "src.addr=10.0.0.1:5 src.workload=\"client-pod\" src.namespace=\"ns1\" \
                    src.identity=\"spiffe://cluster.local/ns/ns1/sa/alice\" \
                    dst.addr=10.0.0.2:15008 dst.hbone_addr=10.0.0.2:8080 \
                    dst.service=\"svc.example\" dst.workload=\"server-pod\" \
                    dst.namespace=\"ns2\" dst.identity=\"spiffe://cluster.local/ns/ns2/sa/bob\" \
                    direction=\"outbound\" bytes_sent=3 bytes_recv=4 duration=";
        assert!(line.contains(want), "{line}\nwant {want}");
        assert!(line.contains("ms"), "{line}");
        assert!(line.contains(" access: "), "{line}");
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
            let out = opened(&m, Direction::Outbound);
            let t = Transferred {
                sent: 100,
                received: 7,
            };
            out.finish(&m, ByteCounts::client_side(t), None);
            // inbound HBONE: relay_h2(app tcp, ..) => sent = server -> client
            let inb = opened(&m, Direction::Inbound);
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
