//! A set of spawned tasks that ends them all when it is dropped, without waking its owner each
//! time one of them ends.
//!
//! A pod's accept loop owns its connection tasks and an HBONE connection owns its stream tasks,
//! so that ending the owner ends them. tokio's `JoinSet` gives that, but an owner that reaps it
//! (`join_next` in its `select!`) is woken by every task that ends: one more wake-up per
//! connection, and because it comes while the connection's own tasks are being woken, tokio's
//! scheduler often hands it to the other worker thread (a futex wake, and on a VM a halted CPU
//! woken). Members of a [`TaskScope`] remove themselves when they end instead; the owner is only
//! woken if it waits for the set to empty ([`TaskScope::wait_empty`], during a drain).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use slab::Slab;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

/// Tasks spawned on the current tokio runtime, aborted when the scope is dropped.
#[derive(Default)]
pub struct TaskScope {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The running members, by slab key (`None` while [`TaskScope::spawn`] is spawning it).
    tasks: Mutex<Slab<Option<AbortHandle>>>,
    /// Notified when the last member ended.
    emptied: Notify,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Slab<Option<AbortHandle>>> {
        // the slab is consistent after any panic: each operation on it is one call
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Held by a member task: removes its entry when the task ends or is aborted.
struct Member {
    inner: Arc<Inner>,
    key: usize,
}

impl Drop for Member {
    fn drop(&mut self) {
        let mut tasks = self.inner.lock();
        tasks.try_remove(self.key);
        let empty = tasks.is_empty();
        drop(tasks);
        if empty {
            // wakes only a `wait_empty` that is waiting: nobody, outside a drain
            self.inner.emptied.notify_waiters();
        }
    }
}

pin_project_lite::pin_project! {
    /// What a member runs: `task`, then its entry removed when this is dropped (ended or
    /// aborted). A struct rather than an `async` block, which would hold `task` twice (before it
    /// is first polled, and as the awaited future) and so double every connection task's cell.
    struct MemberTask<F> {
        #[pin]
        task: F,
        member: Member,
    }
}

impl<F: Future<Output = ()>> Future for MemberTask<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.project().task.poll(cx)
    }
}

fn member_task<F: Future<Output = ()>>(member: Member, task: F) -> MemberTask<F> {
    MemberTask { task, member }
}

/// Bytes of the future a member spawned with a `F` runs (the task cell holds it; see
/// [`crate::proxy::task`]).
#[cfg(test)]
pub(crate) fn spawned_size<F: Future<Output = ()>>() -> usize {
    fn returned<A, B, R>(_: fn(A, B) -> R) -> usize {
        std::mem::size_of::<R>()
    }
    returned(member_task::<F>)
}

impl TaskScope {
    /// An empty scope.
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns `task` (`tokio::spawn`: must be called within a runtime) as a member. A panic in
    /// it ends only that task, as with `JoinSet`, where panics unwind (tests; the release profile
    /// aborts the process). `&mut`: one spawner at a time, so that the slot reserved here is still
    /// this task's when its handle is stored (or gone, if it ended).
    pub fn spawn<F>(&mut self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let key = self.inner.lock().insert(None);
        let member = Member {
            inner: self.inner.clone(),
            key,
        };
        // Not under the lock: a runtime that is shutting down drops the task inside `spawn`.
        let handle = tokio::spawn(member_task(member, task));
        if let Some(slot) = self.inner.lock().get_mut(key) {
            *slot = Some(handle.abort_handle());
        }
    }

    /// Members still running.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    /// Whether no member is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once no member is running (at once if none is).
    pub async fn wait_empty(&self) {
        loop {
            let emptied = self.inner.emptied.notified();
            tokio::pin!(emptied);
            // registered before the check, so that the last member's notification is not missed
            emptied.as_mut().enable();
            if self.is_empty() {
                return;
            }
            emptied.await;
        }
    }
}

impl Drop for TaskScope {
    /// Aborts every member (each ends at its next poll, dropping its future).
    fn drop(&mut self) {
        let tasks = std::mem::take(&mut *self.inner.lock());
        for task in tasks.into_iter().filter_map(|(_, t)| t) {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// Counts the drops of the futures it is part of.
    struct DropCount(Arc<AtomicUsize>);

    impl Drop for DropCount {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn members_that_end_leave_the_scope() {
        let mut scope = TaskScope::new();
        for _ in 0..100 {
            scope.spawn(async {});
        }
        tokio::time::timeout(Duration::from_secs(5), scope.wait_empty())
            .await
            .expect("the members ended");
        assert_eq!(scope.len(), 0);
        assert!(scope.inner.lock().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_scope_aborts_its_members() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let mut scope = TaskScope::new();
        for _ in 0..10 {
            let count = DropCount(dropped.clone());
            scope.spawn(async move {
                let _count = count;
                std::future::pending::<()>().await
            });
        }
        assert_eq!(scope.len(), 10);
        drop(scope);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while dropped.load(Ordering::SeqCst) < 10 {
            assert!(tokio::time::Instant::now() < deadline, "members still run");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn wait_empty_waits_for_the_last_member() {
        let mut scope = TaskScope::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        scope.spawn(async move {
            let _ = rx.await;
        });
        scope.spawn(async {});
        let waiting = tokio::time::timeout(Duration::from_millis(100), scope.wait_empty()).await;
        assert!(waiting.is_err(), "resolved with a member still running");
        assert_eq!(scope.len(), 1);
        let _ = tx.send(());
        tokio::time::timeout(Duration::from_secs(5), scope.wait_empty())
            .await
            .expect("resolved after the last member ended");
    }

    #[tokio::test]
    async fn a_panicking_member_leaves_the_scope() {
        let mut scope = TaskScope::new();
        scope.spawn(async { panic!("member panics") });
        tokio::time::timeout(Duration::from_secs(5), scope.wait_empty())
            .await
            .expect("the panicked member left");
    }
}
