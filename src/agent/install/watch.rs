//! Keeping the installation in place while the agent runs (Istio's `install.go` `Run` loop,
//! `../shared/spec/istio-cni.md` §2.1): inotify on the conf and bin dirs (and, in Kubernetes mode,
//! the dir of the kubeconfig's source, e.g. the service-account dir, so a rotated token rewrites
//! the plugin's kubeconfig), re-validation on every change, throttled repair, and a warning when
//! another component keeps reverting our edit.
//!
//! Directory watches (not file watches) survive the atomic renames CNIs use. The watches are re-added
//! on every pass, so a dir that is created or replaced later gets watched then; while a dir cannot be
//! watched the loop polls every [`POLL_INTERVAL`]. A slow [`RESYNC_INTERVAL`] pass covers missed events.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::time::{Instant, sleep};

use super::files::{self, Fingerprint};
use super::{InstallConfig, InstallError};

/// Minimum time between two repair attempts.
pub(crate) const MIN_REPAIR_INTERVAL: Duration = Duration::from_secs(1);
/// Repairs closer together than this count as "fast" for the conflict warning.
pub(crate) const FAST_REPAIR_WINDOW: Duration = Duration::from_secs(5);
/// More consecutive fast repairs than this log the "conflicting component" warning.
pub(crate) const MAX_FAST_REPAIRS: u32 = 5;
/// Full re-check interval when both dirs are watched.
pub(crate) const RESYNC_INTERVAL: Duration = Duration::from_secs(30);
/// Re-check interval while a dir cannot be watched (e.g. it does not exist yet).
pub(crate) const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Pause after the first event so a writer can finish before we read.
const SETTLE: Duration = Duration::from_millis(100);

/// Rate limit for repairs and detector of a component that keeps reverting them.
#[derive(Debug, Default)]
pub(crate) struct Throttle {
    last: Option<Instant>,
    fast_streak: u32,
}

/// inotify fd adapter for [`AsyncFd`].
struct InotifyFd(Inotify);

/// inotify instance watching directories.
struct DirWatcher {
    fd: AsyncFd<InotifyFd>,
}

/// Keeps binary, kubeconfig and config installed until `shutdown` resolves: checks at start, then
/// after every change in the conf or bin dir or the kubeconfig source's dir (and every 30 s). A
/// removed or changed binary is copied again; the plugin's kubeconfig is rewritten when its content
/// would change (token rotation) or it was removed; a config without our (current) entry is
/// repaired, at most once per second; more than 5 repairs in a row, each within 5 s of the previous,
/// log a "conflicting component" warning (as Istio). With no primary config yet it waits for one.
///
/// Install errors are logged and retried on the next change (throttled the same way). Only a failing
/// inotify setup or read, or a panicking install task, ends the loop with an error. A write in
/// progress is finished before the loop returns on shutdown.
pub async fn watch_and_repair(
    cfg: InstallConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), InstallError> {
    let watcher = DirWatcher::new()?;
    let mut dirs = vec![cfg.cni_conf_dir.clone(), cfg.cni_bin_dir.clone()];
    dirs.extend(
        cfg.kube
            .as_ref()
            .and_then(|k| k.source.watched_dir())
            .map(Path::to_owned),
    );
    let mut state = Repairer {
        cfg: Arc::new(cfg),
        conf_throttle: Throttle::default(),
        binary_throttle: Throttle::default(),
        kube_throttle: Throttle::default(),
        binary_fp: None,
        waiting: false,
    };
    tokio::pin!(shutdown);
    loop {
        let all_watched = watcher.watch(&dirs);
        if !state.binary_pass(&mut shutdown).await?
            || !state.kube_pass(&mut shutdown).await?
            || !state.conf_pass(&mut shutdown).await?
        {
            return Ok(());
        }
        let recheck = if all_watched {
            RESYNC_INTERVAL
        } else {
            POLL_INTERVAL
        };
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            changed = watcher.changed() => changed?,
            _ = sleep(recheck) => {}
        }
    }
}

/// State of the repair loop.
struct Repairer {
    cfg: Arc<InstallConfig>,
    conf_throttle: Throttle,
    binary_throttle: Throttle,
    kube_throttle: Throttle,
    /// Fingerprint of the binary as we last installed or verified it.
    binary_fp: Option<Fingerprint>,
    /// Whether "no primary config" was already logged.
    waiting: bool,
}

impl Repairer {
    /// Copies the binary again if it changed since we last saw it. Returns `false` on shutdown.
    async fn binary_pass(
        &mut self,
        shutdown: &mut (impl Future<Output = ()> + Unpin),
    ) -> Result<bool, InstallError> {
        let target = self.cfg.installed_binary();
        if self.binary_fp.is_some() && files::fingerprint(&target) == self.binary_fp {
            return Ok(true);
        }
        if !pause(self.binary_throttle.delay(Instant::now()), shutdown).await {
            return Ok(false);
        }
        self.binary_throttle.record(Instant::now());
        let c = self.cfg.clone();
        match blocking(move || super::install_binary(&c)).await? {
            Ok(_) => self.binary_fp = files::fingerprint(&target),
            Err(e) => tracing::warn!(error = %e, "CNI plugin binary install failed; will retry"),
        }
        Ok(true)
    }

    /// Rewrites the plugin's kubeconfig if its content would change (Kubernetes mode only). Returns
    /// `false` on shutdown.
    async fn kube_pass(
        &mut self,
        shutdown: &mut (impl Future<Output = ()> + Unpin),
    ) -> Result<bool, InstallError> {
        if self.cfg.kube.is_none() {
            return Ok(true);
        }
        let c = self.cfg.clone();
        if let Ok(true) = blocking(move || super::kubeconfig_in_place(&c)).await? {
            return Ok(true);
        }
        if !pause(self.kube_throttle.delay(Instant::now()), shutdown).await {
            return Ok(false);
        }
        self.kube_throttle.record(Instant::now());
        let c = self.cfg.clone();
        if let Err(e) = blocking(move || super::install_kubeconfig(&c)).await? {
            tracing::warn!(error = %e, "CNI plugin kubeconfig write failed; will retry");
        }
        Ok(true)
    }

    /// Re-validates the config and repairs it if needed. Returns `false` on shutdown. In
    /// Kubernetes mode nothing is written while the plugin's kubeconfig does not exist (as
    /// [`super::install`]: the entry must not name a missing file; `kube_pass` logs why).
    async fn conf_pass(
        &mut self,
        shutdown: &mut (impl Future<Output = ()> + Unpin),
    ) -> Result<bool, InstallError> {
        if self.cfg.kube.is_some() && !super::kubeconfig_path(&self.cfg.run_dir).exists() {
            return Ok(true);
        }
        let c = self.cfg.clone();
        if let Ok(true) = blocking(move || super::conf_in_place(&c)).await? {
            return Ok(true);
        }
        if !pause(self.conf_throttle.delay(Instant::now()), shutdown).await {
            return Ok(false);
        }
        let fast = self.conf_throttle.record(Instant::now());
        let c = self.cfg.clone();
        match blocking(move || super::install_conf(&c)).await? {
            Ok(outcome) => {
                self.waiting = false;
                if outcome.changed && fast {
                    warn_conflict(&outcome.primary);
                }
            }
            Err(e @ InstallError::NoPrimaryConfig { .. }) => {
                if !self.waiting {
                    tracing::info!("{e}");
                }
                self.waiting = true;
            }
            Err(e) => tracing::warn!(error = %e, "CNI config install failed; will retry"),
        }
        Ok(true)
    }
}

/// Sleeps for `delay` unless `shutdown` resolves first; returns `false` on shutdown.
async fn pause(delay: Duration, shutdown: &mut (impl Future<Output = ()> + Unpin)) -> bool {
    if delay.is_zero() {
        return true;
    }
    tokio::select! {
        _ = shutdown => false,
        _ = sleep(delay) => true,
    }
}

/// Runs blocking file work off the async worker threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, InstallError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|source| InstallError::Task { source })
}

fn warn_conflict(primary: &Path) {
    let hint = if primary.to_string_lossy().contains("cilium") {
        " (Cilium: set cni.exclusive=false)"
    } else {
        ""
    };
    tracing::warn!(
        primary = %primary.display(),
        "a conflicting component is constantly reverting ztnode's CNI config{hint}"
    );
}

// === impl Throttle ===

impl Throttle {
    /// How long to wait at `now` before the next repair may run.
    pub(crate) fn delay(&self, now: Instant) -> Duration {
        self.last.map_or(Duration::ZERO, |last| {
            (last + MIN_REPAIR_INTERVAL).saturating_duration_since(now)
        })
    }

    /// Records a repair at `now`; returns whether it ended a run of more than [`MAX_FAST_REPAIRS`]
    /// fast repairs in a row.
    pub(crate) fn record(&mut self, now: Instant) -> bool {
        let fast = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < FAST_REPAIR_WINDOW);
        self.fast_streak = if fast { self.fast_streak + 1 } else { 0 };
        self.last = Some(now);
        self.fast_streak > MAX_FAST_REPAIRS
    }
}

/// Registers the inotify fd with the tokio reactor (read interest only).
#[allow(unsafe_code)]
fn register(fd: InotifyFd) -> io::Result<AsyncFd<InotifyFd>> {
    // SAFETY: `InotifyFd` owns its fd (nix's `Inotify` wraps an `OwnedFd`) and is moved into the
    // `AsyncFd`, so the fd stays open and unchanged until the `AsyncFd` is dropped; `as_raw_fd` always
    // returns that same fd.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(io::Error::from)
}

// === impl InotifyFd ===

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

// === impl DirWatcher ===

impl DirWatcher {
    fn new() -> Result<Self, InstallError> {
        let watch_err = |source: io::Error| InstallError::Watch { source };
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| watch_err(e.into()))?;
        let fd = register(InotifyFd(inotify)).map_err(watch_err)?;
        Ok(DirWatcher { fd })
    }

    /// (Re-)adds a watch on each dir; returns whether all of them are watched.
    fn watch(&self, dirs: &[PathBuf]) -> bool {
        let mask = AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_DELETE
            | AddWatchFlags::IN_MOVED_FROM
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_DELETE_SELF
            | AddWatchFlags::IN_MOVE_SELF
            | AddWatchFlags::IN_ONLYDIR;
        let inotify = &self.fd.get_ref().0;
        let mut all = true;
        for dir in dirs {
            all &= inotify.add_watch(dir.as_path(), mask).is_ok();
        }
        all
    }

    /// Waits for at least one event, lets the writer settle, then drops the queued events.
    async fn changed(&self) -> Result<(), InstallError> {
        loop {
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(|source| InstallError::Watch { source })?;
            let read = guard.try_io(|fd| fd.get_ref().0.read_events().map_err(io::Error::from));
            match read {
                Ok(Ok(_)) => break,
                Ok(Err(source)) => return Err(InstallError::Watch { source }),
                Err(_would_block) => continue,
            }
        }
        sleep(SETTLE).await;
        while self
            .fd
            .get_ref()
            .0
            .read_events()
            .is_ok_and(|events| !events.is_empty())
        {}
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_spaces_repairs() {
        let mut t = Throttle::default();
        let t0 = Instant::now();
        assert_eq!(t.delay(t0), Duration::ZERO);
        t.record(t0);
        assert_eq!(t.delay(t0), MIN_REPAIR_INTERVAL);
        assert_eq!(
            t.delay(t0 + Duration::from_millis(400)),
            Duration::from_millis(600)
        );
        assert_eq!(t.delay(t0 + Duration::from_secs(2)), Duration::ZERO);
    }

    #[test]
    fn throttle_flags_more_than_five_fast_repairs() {
        let mut t = Throttle::default();
        let t0 = Instant::now();
        let flags: Vec<bool> = (0..8)
            .map(|i| t.record(t0 + Duration::from_secs(i)))
            .collect();
        assert_eq!(
            flags,
            [false, false, false, false, false, false, true, true]
        );
        assert!(!t.record(t0 + Duration::from_secs(60)));
    }
}
