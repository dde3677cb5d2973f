//! Process set-up shared by the long-running roles: logging, the tokio runtime (with the heap
//! trim that returns freed memory to the OS), the file-descriptor limit and the shutdown signal.
//! Logging is [`logging`]; releasing the executable's start-up pages once ready is [`image`].

use std::time::Duration;

/// Default data-plane worker threads when `ZTUNNEL_WORKER_THREADS` is unset or invalid.
pub const DEFAULT_WORKER_THREADS: usize = 2;

/// IO events a worker takes from the driver per turn (tokio's default: 1,024). A turn that wakes
/// two tasks wakes the other worker too, to steal one; on this path that hand-off is a futex wake
/// and often a halted CPU's wake-up (15–20 µs on a VM), while the task it takes runs for
/// microseconds. With one event per turn, the worker that took an event runs its task and takes
/// the next event itself; the other worker still joins when a task wakes another one (an HBONE
/// connection's task waking its streams, and back). Side by side (`ztnode bench --peer`, the
/// same build with and without): +11 % connections per second, the same HBONE throughput and CPU
/// per GB. Plain relays wake no other task: their bulk copies yield to bring the other worker in
/// (`proxy::copy`), else one worker would carry all of them. The price is tokio's batching when
/// many connections' small messages keep the proxy busy: one `epoll_wait` per event instead of
/// one per about 25, and plain relays' small messages stay on one worker. 1 KiB round trips over
/// 32 plain connections at once lost 13 % (8 connections and HBONE: 3–4 %); `ztnode bench --peer`
/// reports the case against the peer (`parallel_rtt_8_per_sec`, `parallel_rtt_32_per_sec`).
/// Yielding after small reads once a worker's parks kept returning at once (work already waiting)
/// balanced the workers but won nothing back: the extra wake-ups cost what the second worker
/// added.
pub const MAX_IO_EVENTS_PER_TICK: usize = 1;

/// How often the heap-trim timer task collects: mimalloc's purge delay (`purge_delay`, 1 s).
pub const HEAP_TRIM_INTERVAL: Duration = Duration::from_secs(1);

pub mod image;
pub mod logging;
pub mod socket_file;

/// Installs the logging of the long-running roles ([`logging::init`]): ztunnel's plain or JSON
/// lines on stderr (`LOG_FORMAT=json`), filter from `RUST_LOG` (default `info`) after the
/// built-in quieting of noisy crates, changeable at run time through the admin `/logging`.
pub fn init_tracing() {
    logging::init();
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (as ztunnel does at start): a proxy holds two
/// sockets per proxied connection.
pub fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// Resolves on SIGTERM or SIGINT (never, if the SIGTERM handler cannot be installed).
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

/// Resolves once `rx` turns true (or its sender is gone): the shutdown future each background
/// task of a role gets from one `watch` channel.
pub async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Data-plane worker threads: `ZTUNNEL_WORKER_THREADS` (ztunnel's name), default
/// [`DEFAULT_WORKER_THREADS`].
pub fn worker_threads() -> usize {
    std::env::var("ZTUNNEL_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_WORKER_THREADS)
}

/// The multi-thread runtime of `node`, `agent` and `proxy`: [`worker_threads`] workers named
/// `ztnode`, [`MAX_IO_EVENTS_PER_TICK`], each worker collecting its heap when it parks (at most
/// once a second), and the heap-trim timer task. Errors: the runtime could not be built (threads,
/// epoll).
pub fn build() -> std::io::Result<tokio::runtime::Runtime> {
    let rt = scheduler().build()?;
    rt.spawn(trim_heap());
    Ok(rt)
}

/// [`build`]'s runtime without its timer task.
fn scheduler() -> tokio::runtime::Builder {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.on_thread_park(collect_idle_heap)
        .worker_threads(worker_threads())
        .max_io_events_per_tick(MAX_IO_EVENTS_PER_TICK)
        .thread_name("ztnode")
        .enable_all();
    b
}

thread_local!(static LAST_COLLECT: std::cell::Cell<Option<std::time::Instant>> =
    const { std::cell::Cell::new(None) });

/// Returns freed memory to the OS when a worker goes idle, at most once per second per thread:
/// mimalloc keeps freed pages for reuse and only purges them (about 1 s after a burst's first
/// free) during later allocations or collections, so without this and [`trim_heap`] an idle proxy
/// would hold the peak of its last burst (e.g. after many connections closed).
fn collect_idle_heap() {
    if LAST_COLLECT
        .get()
        .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
    {
        return;
    }
    collect_heap();
}

/// Collects this thread's heap and the purges that are due (process-wide), now.
#[allow(unsafe_code)]
fn collect_heap() {
    LAST_COLLECT.set(Some(std::time::Instant::now()));
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time; it
    // only frees memory mimalloc owns and no longer hands out.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

/// Collects on a timer too: the purges a burst's frees schedule are only due a second later, when
/// an idle worker may not park again for a long time.
async fn trim_heap() {
    let mut tick = tokio::time::interval(HEAP_TRIM_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        collect_heap();
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// The binary's allocator, so the trim is tested against the heap it trims.
    #[global_allocator]
    static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

    /// Resident set of this process, MiB.
    fn rss_mib() -> f64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        kib / 1024.0
    }

    /// Two sockets that turn readable in one wake-up (two descriptors of one socket) on an idle
    /// runtime: the worker holding the driver takes one event, runs its task (which holds that
    /// worker for a while) and only then takes the other; the other worker is not handed it. (No
    /// timer task: one falling due in the same turn would bring the other worker in.)
    #[test]
    fn sockets_ready_together_are_served_in_turn_by_one_worker() {
        use std::io::Write;
        let rt = scheduler().worker_threads(2).build().expect("runtime");
        let (std_a, mut peer) = std::os::unix::net::UnixStream::pair().expect("pair");
        let std_b = std_a.try_clone().expect("dup");
        let (tx, rx) = std::sync::mpsc::channel();
        let (registered_tx, registered) = std::sync::mpsc::channel();
        for s in [std_a, std_b] {
            s.set_nonblocking(true).expect("nonblocking");
            let tx = tx.clone();
            let registered_tx = registered_tx.clone();
            rt.spawn(async move {
                let s = tokio::net::UnixStream::from_std(s).expect("register");
                let _ = registered_tx.send(());
                s.readable().await.expect("readable");
                let _ = tx.send((std::thread::current().id(), std::time::Instant::now()));
                // holds this worker: a task the other worker were handed would run meanwhile
                std::thread::sleep(Duration::from_millis(100));
            });
        }
        for _ in 0..2 {
            registered
                .recv_timeout(Duration::from_secs(5))
                .expect("registered");
        }
        // both tasks wait for readiness, the runtime idles
        std::thread::sleep(Duration::from_millis(200));
        peer.write_all(b"x").expect("write");
        let first = rx.recv_timeout(Duration::from_secs(5)).expect("first task");
        let second = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("second task");
        assert_eq!(
            first.0, second.0,
            "the second event went to the other worker"
        );
        assert!(
            second.1 - first.1 >= Duration::from_millis(100),
            "the second task ran while the first held its worker"
        );
    }

    /// Assumes mimalloc's default purge delay (`MIMALLOC_PURGE_DELAY` unset). Covers the purge of
    /// freed arena memory (1 MiB objects go straight back to the arena); memory kept in another
    /// worker's own heap is the park hook's part.
    #[test]
    fn freed_memory_is_returned_while_the_runtime_idles() {
        let rt = build().expect("runtime");
        // Freed on a worker, which then parks before the purge is due.
        let peak = rt
            .block_on(rt.spawn(async {
                let held: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 1 << 20]).collect();
                let peak = rss_mib();
                drop(held);
                peak
            }))
            .expect("task");
        // A plain sleep: no tokio timer wakes a worker here except the trim task's.
        std::thread::sleep(HEAP_TRIM_INTERVAL * 3);
        let after = rss_mib();
        assert!(
            after < peak - 32.0,
            "64 MiB freed, RSS {peak:.1} MiB before and {after:.1} MiB after"
        );
    }
}
