//! Readiness of `ztnode node`: a registry of named start-up tasks that block `/healthz/ready`
//! (ztunnel's readiness server, `../shared/spec/ztunnel.md` §7: 200 `ready\n`, else 500
//! `not ready, pending: [...]`; istio-cni's `/readyz` likewise waits for its installer, spec §3.9).
//!
//! A component [`Readiness::register`]s a [`Task`] before it starts and marks it done when ready. A
//! task can also turn pending again (the CNI install is re-checked by [`track`], so a removed
//! plugin makes the node unready until it is repaired).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How often [`track`] re-runs its check.
pub const RECHECK_INTERVAL: Duration = Duration::from_secs(10);

/// The registry; cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: AtomicU64,
    /// Pending tasks: id → name.
    pending: Mutex<BTreeMap<u64, String>>,
    /// Woken whenever a task turns ready.
    changed: tokio::sync::Notify,
}

/// One registered task. Dropping it leaves its state as it is (a task that never finished stays
/// pending, which is what readiness must report).
#[derive(Debug)]
pub struct Task {
    ready: Readiness,
    id: u64,
    name: String,
}

impl Readiness {
    /// An empty registry (ready).
    pub fn new() -> Readiness {
        Readiness::default()
    }

    /// Registers a pending task named `name` (shown in the not-ready answer).
    pub fn register(&self, name: impl Into<String>) -> Task {
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let name = name.into();
        self.pending().insert(id, name.clone());
        Task {
            ready: self.clone(),
            id,
            name,
        }
    }

    /// Names of the pending tasks, sorted, without duplicates.
    pub fn pending_tasks(&self) -> Vec<String> {
        let mut names: Vec<String> = self.pending().values().cloned().collect();
        names.sort();
        names.dedup();
        names
    }

    /// Whether no task is pending.
    pub fn is_ready(&self) -> bool {
        self.pending().is_empty()
    }

    /// Resolves once no task is pending (at once if none is).
    pub async fn wait_ready(&self) {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_ready() {
                return;
            }
            changed.await;
        }
    }

    fn pending(&self) -> MutexGuard<'_, BTreeMap<u64, String>> {
        self.inner.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Task {
    /// Marks the task ready or pending again.
    pub fn set_ready(&self, ready: bool) {
        let mut pending = self.ready.pending();
        if ready {
            if pending.remove(&self.id).is_some() {
                self.ready.inner.changed.notify_waiters();
            }
        } else {
            pending.insert(self.id, self.name.clone());
        }
    }

    /// Marks the task ready for good.
    pub fn done(self) {
        self.set_ready(true);
    }
}

/// Keeps `task` equal to the result of `check` (a blocking probe, run on the blocking pool)
/// every [`RECHECK_INTERVAL`], starting now, until `shutdown` resolves. A check error counts as
/// not ready and is logged.
pub async fn track<F, E>(task: Task, check: F, shutdown: impl Future<Output = ()>)
where
    F: Fn() -> Result<bool, E> + Send + Sync + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let check = Arc::new(check);
    tokio::pin!(shutdown);
    loop {
        let probe = check.clone();
        let ready = match tokio::task::spawn_blocking(move || probe()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(task = %task.name, error = %e, "readiness check failed");
                false
            }
            Err(_) => false,
        };
        task.set_ready(ready);
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(RECHECK_INTERVAL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    #[test]
    fn ready_once_every_task_is_done() {
        let r = Readiness::new();
        assert!(r.is_ready());
        let config = r.register("local config");
        let socket = r.register("plugin socket");
        assert_eq!(r.pending_tasks(), ["local config", "plugin socket"]);
        config.done();
        assert_eq!(r.pending_tasks(), ["plugin socket"]);
        socket.set_ready(true);
        assert!(r.is_ready());
        socket.set_ready(false);
        assert_eq!(r.pending_tasks(), ["plugin socket"]);
        drop(socket);
        assert!(!r.is_ready(), "dropping a pending task keeps it pending");
    }

    #[tokio::test]
    async fn wait_ready_resolves_when_the_last_task_is_done() {
        let r = Readiness::new();
        r.wait_ready().await;
        let config = r.register("local config");
        let socket = r.register("plugin socket");
        let waiter = tokio::spawn({
            let r = r.clone();
            async move { r.wait_ready().await }
        });
        config.done();
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one task is still pending");
        socket.set_ready(true);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("ready once the last task is done")
            .expect("waiter");
    }

    #[tokio::test(start_paused = true)]
    async fn track_follows_the_check() {
        let r = Readiness::new();
        let installed = Arc::new(AtomicBool::new(false));
        let probe = installed.clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let tracker = tokio::spawn(track(
            r.register("cni plugin install"),
            move || Ok::<_, std::io::Error>(probe.load(Ordering::SeqCst)),
            async move {
                let _ = stop_rx.await;
            },
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(r.pending_tasks(), ["cni plugin install"]);
        installed.store(true, Ordering::SeqCst);
        tokio::time::sleep(RECHECK_INTERVAL).await;
        assert!(r.is_ready());
        installed.store(false, Ordering::SeqCst);
        tokio::time::sleep(RECHECK_INTERVAL).await;
        assert!(
            !r.is_ready(),
            "a removed install makes the node unready again"
        );
        let _ = stop_tx.send(());
        tracker.await.expect("tracker ends on shutdown");
    }
}
