//! The shape of a connection task, which decides what an idle connection costs.
//!
//! A task first runs its setup: original destination, routing, the HBONE CONNECT or the app
//! connect, with their timers and error paths. That setup is boxed and freed when it ends. For the
//! rest of the connection's life the task holds only a [`Logged`] relay: the relay, its access-log
//! record and the shared context its counters live in. An `async fn` doing both would keep the
//! setup's locals, and a copy of its arguments, in every relaying task.
//!
//! Measured with `-Zprint-type-sizes`: the task of an outbound HBONE connection took 1,024 bytes
//! that way and takes 512 in this shape, the inbound stream's 896 and now 512 (tokio rounds task
//! cells up to 128 bytes; the `size` tests hold the futures to the 408 bytes that keep them at
//! 512).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures::FutureExt;
use futures::future::OptionFuture;

use crate::proxy::accesslog::ConnectionLog;
use crate::proxy::copy::{CopyError, Transferred};
use crate::proxy::live::LateRejection;
use crate::proxy::live::SoFar;
use crate::proxy::metrics::ByteCounts;
use crate::proxy::metrics::labels::ResponseFlags;
use crate::proxy::pod::ProxyContext;

/// A relay whose end is logged and counted (`finish` on the connection's [`ConnectionLog`]), once:
/// polled again after it ended, it is `Ready` without polling the relay.
///
/// `F` is the relay, resolving to the bytes moved, or to the first I/O error with the bytes moved
/// until then ([`CopyError`]): an error-ended connection is logged and counted with what it moved. `LOCAL_IS_CLIENT` says
/// whether the relay's TCP side (the [`Transferred`] orientation) is the connection's client
/// ([`ByteCounts::client_side`]) or the app server ([`ByteCounts::server_side`]); a type parameter
/// rather than a field, so it costs no bytes in every relaying task.
pub struct Logged<F: SoFar, const LOCAL_IS_CLIENT: bool> {
    relay: F,
    /// Taken when the relay ends.
    log: Option<ConnectionLog>,
    ctx: Arc<ProxyContext>,
}

/// A relay whose TCP side is the client: outbound, inbound plaintext.
pub type ClientSide<F> = Logged<F, true>;
/// A relay whose TCP side is the app server: inbound HBONE.
pub type ServerSide<F> = Logged<F, false>;

/// A failed relay, as its access-log line gives it.
#[derive(Debug, thiserror::Error)]
#[error("relay: {0}")]
pub struct RelayError(#[source] pub io::Error);

impl<F: SoFar, const LOCAL_IS_CLIENT: bool> Logged<F, LOCAL_IS_CLIENT> {
    /// `relay` logged into `log` and counted in `ctx`'s metrics when it ends.
    pub fn new(ctx: Arc<ProxyContext>, log: ConnectionLog, relay: F) -> Self {
        Logged {
            relay,
            log: Some(log),
            ctx,
        }
    }
}

impl<F: SoFar, const LOCAL_IS_CLIENT: bool> Future for Logged<F, LOCAL_IS_CLIENT>
where
    F: Future<Output = Result<Transferred, CopyError>> + SoFar + Unpin,
{
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if this.log.is_none() {
            // Ended (and logged) already: the relay is not polled again.
            return Poll::Ready(());
        }
        let result = ready!(Pin::new(&mut this.relay).poll(cx));
        if let Some(log) = this.log.take() {
            let metrics = &this.ctx.metrics;
            let counts = if LOCAL_IS_CLIENT {
                ByteCounts::client_side
            } else {
                ByteCounts::server_side
            };
            match result {
                Ok(t) => log.finish(metrics, counts(t), None),
                Err(CopyError { error, transferred }) => {
                    let mut log = log;
                    if error.get_ref().is_some_and(|e| e.is::<LateRejection>()) {
                        // closed because a policy now denies it (ztunnel's late rejection)
                        log.set_flags(metrics, ResponseFlags::Denied);
                    }
                    log.finish(metrics, counts(transferred), Some(&RelayError(error)))
                }
            }
        }
        Poll::Ready(())
    }
}

impl<F: SoFar, const LOCAL_IS_CLIENT: bool> Drop for Logged<F, LOCAL_IS_CLIENT> {
    /// A relay dropped before it ended (its pod stopped, the drain deadline) is logged with why
    /// and counted as closed with the bytes it moved and no failure flag, as ztunnel records a
    /// connection closed by its drain.
    fn drop(&mut self) {
        if let Some(log) = self.log.take() {
            let t = self.relay.so_far();
            let counts = if LOCAL_IS_CLIENT {
                ByteCounts::client_side(t)
            } else {
                ByteCounts::server_side(t)
            };
            log.finish_closed_by_proxy(
                counts,
                "connection closed by the proxy (pod stopped or drained)",
            );
        }
    }
}

/// The connection task: `setup` boxed, then the relay it returned, if any (`None`: setup failed
/// and has logged why).
pub fn run<S, F, const LOCAL_IS_CLIENT: bool>(setup: S) -> impl Future<Output = ()> + Send + 'static
where
    S: Future<Output = Option<Logged<F, LOCAL_IS_CLIENT>>> + Send + 'static,
    F: Future<Output = Result<Transferred, CopyError>> + SoFar + Unpin + Send + 'static,
{
    Box::pin(setup).then(OptionFuture::from).map(drop)
}

#[cfg(test)]
mod tests {
    use std::future::{Ready, ready};

    use super::*;
    use crate::proxy::accesslog::tests::capture_logs;
    use crate::proxy::identity::{Ca, CertManager};
    use crate::proxy::metrics::tests::{assert_byte_counters, counter};
    use crate::proxy::metrics::{Direction, Metrics};
    use crate::proxy::state::{ProxyState, StateHandle};

    fn ctx() -> Arc<ProxyContext> {
        let ca = Ca::load_or_generate(None).expect("CA");
        Arc::new(ProxyContext {
            state: StateHandle::new(ProxyState::default()),
            certs: CertManager::new(ca, std::time::Duration::from_secs(3600)),
            metrics: Metrics::default(),
            mark: crate::mesh::PacketMark::DEFAULT,
            local: Default::default(),
            pool: crate::proxy::pool::PoolConfig::default(),
            dns: None,
            trust_domain: "cluster.local".into(),
        })
    }

    fn log(ctx: &ProxyContext, direction: Direction) -> ConnectionLog {
        crate::proxy::accesslog::tests::opened(&ctx.metrics, direction)
    }

    type Outcome = Ready<Result<Transferred, CopyError>>;

    fn done(sent: u64, received: u64) -> Outcome {
        ready(Ok(Transferred { sent, received }))
    }

    /// One connection, the client sent 100 bytes and the server answered 7, as a client-side and
    /// a server-side relay see it. (Which side each path's relay is, is checked end to end by
    /// `tests/e2e_node.rs` through the access-log byte counts.)
    #[test]
    fn each_side_counts_the_request_direction_as_received() {
        let ctx = ctx();
        let out = ClientSide::new(ctx.clone(), log(&ctx, Direction::Outbound), done(100, 7));
        let inb = ServerSide::new(ctx.clone(), log(&ctx, Direction::Inbound), done(7, 100));
        assert_eq!(run(ready(Some(out))).now_or_never(), Some(()));
        assert_eq!(run(ready(Some(inb))).now_or_never(), Some(()));
        let text = ctx.metrics.render();
        assert_byte_counters(&text, 100, 7);
        for reporter in ["source", "destination"] {
            assert_eq!(
                counter(&text, "istio_tcp_connections_closed_total", reporter),
                1,
                "{text}"
            );
        }
    }

    /// A relay dropped before it ended (its pod stopped, the drain deadline) is counted closed
    /// with the bytes it moved and no failure (ztunnel counts a drained connection as closed).
    #[test]
    fn a_dropped_relay_is_counted_closed_with_its_bytes_and_not_failed() {
        let ctx = ctx();
        let idle: ClientSide<std::future::Pending<Result<Transferred, CopyError>>> = Logged::new(
            ctx.clone(),
            log(&ctx, Direction::Outbound),
            std::future::pending(),
        );
        let (_, logs) = capture_logs(|| drop(idle));
        let text = ctx.metrics.render();
        assert_eq!(
            counter(&text, "istio_tcp_connections_closed_total", "source"),
            1,
            "{text}"
        );
        assert_eq!(
            counter(&text, "istio_tcp_connections_failed_total", "source"),
            0,
            "{text}"
        );
        // the idle relay moved 7 bytes from the client and 3 back (`live` tests' stand-in)
        assert_eq!(
            counter(&text, "istio_tcp_received_bytes_total", "source"),
            7,
            "{text}"
        );
        assert_eq!(
            counter(&text, "istio_tcp_sent_bytes_total", "source"),
            3,
            "{text}"
        );
        assert!(logs.contains("connection closed by the proxy"), "{logs}");
    }

    /// An error-ended relay is logged with its error and the bytes it moved before, and counted
    /// with them (a transfer reset at the end was logged and counted as 0 bytes).
    #[test]
    fn a_failed_relay_is_logged_with_its_error_and_its_bytes() {
        let ctx = ctx();
        let failed: ClientSide<Outcome> = Logged::new(
            ctx.clone(),
            log(&ctx, Direction::Outbound),
            ready(Err(CopyError {
                error: io::Error::other("peer reset"),
                transferred: Transferred {
                    sent: 4_800_000,
                    received: 12,
                },
            })),
        );
        let (ended, logs) = capture_logs(|| run(ready(Some(failed))).now_or_never());
        assert_eq!(ended, Some(()));
        assert!(logs.contains("relay: peer reset"), "{logs}");
        assert!(logs.contains("bytes_sent=4800000 bytes_recv=12"), "{logs}");
        let text = ctx.metrics.render();
        assert_eq!(
            counter(&text, "istio_tcp_connections_closed_total", "source"),
            1,
            "{text}"
        );
        assert_eq!(
            counter(&text, "istio_tcp_received_bytes_total", "source"),
            4_800_000,
            "{text}"
        );
        assert_eq!(
            counter(&text, "istio_tcp_sent_bytes_total", "source"),
            12,
            "{text}"
        );
    }

    #[test]
    fn a_relay_closed_by_a_policy_change_is_counted_denied() {
        let ctx = ctx();
        let denied = crate::proxy::authz::Denied::NotAllowed;
        let closed: ClientSide<Outcome> = Logged::new(
            ctx.clone(),
            log(&ctx, Direction::Inbound),
            ready(Err(CopyError {
                error: io::Error::other(LateRejection(denied)),
                transferred: Transferred::default(),
            })),
        );
        assert_eq!(run(ready(Some(closed))).now_or_never(), Some(()));
        let text = ctx.metrics.render();
        assert!(text.contains("response_flags=\"DENY\""), "{text}");
        assert_eq!(
            counter(&text, "istio_tcp_connections_failed_total", "destination"),
            1,
            "{text}"
        );
    }

    #[test]
    fn an_ended_relay_is_logged_once_and_not_polled_again() {
        let ctx = ctx();
        // `Ready` panics when polled after it completed.
        let mut relay = ClientSide::new(ctx.clone(), log(&ctx, Direction::Outbound), done(5, 6));
        assert_eq!((&mut relay).now_or_never(), Some(()));
        assert_eq!((&mut relay).now_or_never(), Some(()));
        let text = ctx.metrics.render();
        assert_eq!(
            counter(&text, "istio_tcp_connections_closed_total", "source"),
            1,
            "{text}"
        );
    }

    #[test]
    fn a_failed_setup_ends_the_task_without_a_relay() {
        let none: Option<ClientSide<Outcome>> = None;
        assert_eq!(run(ready(none)).now_or_never(), Some(()));
    }
}

/// Size checks of the relaying tasks (see the module docs): each spawned future must stay within
/// [`MAX_TASK_FUTURE`] bytes so that its tokio task cell stays at 512 bytes.
#[cfg(test)]
pub(crate) mod size {
    /// Header (32) + scheduler and id (16) + stage + trailer (48) fit 512 bytes while the stage,
    /// this future plus tokio's tag, takes at most 416 (the layout of tokio 1.x's task cell without
    /// `tokio_unstable`, read with `-Zprint-type-sizes`).
    pub(crate) const MAX_TASK_FUTURE: usize = 408;

    use std::future::Future;

    use crate::proxy::scope::spawned_size;

    /// The size of the future a [`TaskScope`](crate::proxy::scope::TaskScope) member spawned
    /// with what `f` returns runs, without calling `f`.
    pub(crate) fn returned3<A, B, C, R: Future<Output = ()>>(_: fn(A, B, C) -> R) -> usize {
        spawned_size::<R>()
    }

    /// [`returned3`] for five arguments.
    pub(crate) fn returned5<A, B, C, D, E, R: Future<Output = ()>>(
        _: fn(A, B, C, D, E) -> R,
    ) -> usize {
        spawned_size::<R>()
    }

    #[test]
    fn outbound_and_plaintext_tasks_stay_small() {
        for (what, size) in [
            ("outbound", returned3(crate::proxy::outbound::handle)),
            (
                "inbound plaintext",
                returned3(crate::proxy::inbound::handle_plaintext),
            ),
        ] {
            assert!(size <= MAX_TASK_FUTURE, "{what} task future: {size} bytes");
        }
    }
}
