//! The drain signal of one pod proxy (ztunnel's `DrainWatcher`, `src/drain.rs`): the manager
//! flips it when a shutdown begins; the pod's accept loop then closes its listeners and its
//! HBONE connections send GOAWAY, while open connections run on until they end or the manager's
//! deadline closes them ([`crate::proxy::manager::Draining`]).

use tokio::sync::watch;

/// The manager's end: [`DrainTrigger::start`] begins the drain.
#[derive(Debug)]
pub struct DrainTrigger(watch::Sender<bool>);

/// The pod's end, cloned into its connection tasks.
#[derive(Debug, Clone)]
pub struct DrainWatch(watch::Receiver<bool>);

/// A new pair, not draining.
pub fn channel() -> (DrainTrigger, DrainWatch) {
    let (tx, rx) = watch::channel(false);
    (DrainTrigger(tx), DrainWatch(rx))
}

impl DrainTrigger {
    /// Begins the drain (idempotent).
    pub fn start(&self) {
        self.0.send_replace(true);
    }
}

impl DrainWatch {
    /// A watch that never drains (its trigger is gone without having started a drain).
    pub fn never() -> DrainWatch {
        channel().1
    }

    /// Whether the drain has begun.
    pub fn is_draining(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the drain has begun; never when the trigger went away without starting
    /// one (the pod was stopped at once, its tasks aborted).
    pub async fn started(&mut self) {
        if self.0.wait_for(|d| *d).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_watch_resolves_once_the_drain_starts_and_never_without_it() {
        let (trigger, mut watch) = channel();
        let mut other = watch.clone();
        assert!(!watch.is_draining());
        assert!(
            tokio::time::timeout(Duration::from_secs(1), watch.started())
                .await
                .is_err()
        );
        trigger.start();
        watch.started().await;
        other.started().await;
        assert!(watch.is_draining());
        let mut never = DrainWatch::never();
        assert!(
            tokio::time::timeout(Duration::from_secs(60), never.started())
                .await
                .is_err()
        );
    }
}
