//! Policies apply to open connections too: every inbound connection of a pod (HBONE stream or
//! plaintext) is registered in the pod's [`LiveConnections`] with what [`authz::check`] needs,
//! and when the workload state changes the pod's accept loop re-checks them ([`PolicyWatcher`]).
//! The ones now denied are closed: their relay ([`Revocable`]) ends with [`LateRejection`], which
//! drops both sides (the HBONE stream is reset, the app's socket closed) and puts the error, naming
//! the policy, in the access-log line; the re-check logs the closing as well. Other connections
//! are untouched.
//!
//! This is ztunnel's `PolicyWatcher` (`src/proxy/connection_manager.rs`, spec
//! `../shared/spec/ztunnel.md` §6, its error `AuthorizationPolicyLateRejection`, "connection
//! closed due to policy change"), per pod instead of per proxy.
//!
//! No connection escapes a change: a connection is registered before its first check, and
//! [`crate::proxy::state::StateHandle::store`] swaps the snapshot before it bumps the version. So
//! either the first check already reads the new snapshot, or the registration was there when the
//! re-check took the registry's lock.
//!
//! Cost: one allocation, mutex lock and map insert when a connection is registered, one lock and
//! removal when it ends; the relay reads an atomic when it wakes, nothing per byte; the relaying
//! task grows by one pointer (the inbound stream's still fits its 512-byte task cell, see
//! `proxy::task`). A re-check runs only when the policies or the pod's workload changed (an xDS
//! push of other addresses costs a comparison), and holds the lock while it evaluates the policies
//! for each connection.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use tokio::sync::watch;

use crate::proxy::authz::{self, Denied};
use crate::proxy::copy::{CopyError, H2Relay, TcpRelay, Transferred};
use crate::proxy::identity::Identity;
use crate::proxy::state::{Policy, ProxyState, StateHandle, Workload};

/// An open connection closed because the policies changed and now deny it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("connection closed due to policy change: {0}")]
pub struct LateRejection(#[source] pub Denied);

/// The live inbound connections of one pod.
#[derive(Debug, Default)]
pub struct LiveConnections {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Tracked>,
}

/// What [`authz::check`] needs of a connection, and how to close it.
#[derive(Debug)]
struct Tracked {
    src_identity: Option<Identity>,
    src_ip: IpAddr,
    dst: SocketAddr,
    slot: Arc<Slot>,
}

/// A connection's place in [`LiveConnections`], given up when dropped. One pointer, so that it
/// costs the relaying task 8 bytes.
#[derive(Debug)]
pub struct Registration(Arc<Slot>);

/// Shared by a [`Registration`] and its entry in the registry.
#[derive(Debug)]
struct Slot {
    live: Arc<LiveConnections>,
    id: u64,
    /// Set once, by the re-check that closes the connection.
    closed: OnceLock<Denied>,
    /// The relay's task, woken when `closed` is set.
    waker: AtomicWaker,
}

/// A relay that ends with [`LateRejection`] when its connection is closed by a re-check.
#[derive(Debug)]
pub struct Revocable<F> {
    relay: F,
    registration: Registration,
}

/// Waits for state versions and re-checks one pod's connections when what its policy decisions
/// depend on changed: the policies, or the pod's workload (namespace, `authorizationPolicies`).
#[derive(Debug)]
pub struct PolicyWatcher {
    state: StateHandle,
    versions: watch::Receiver<u64>,
    live: Arc<LiveConnections>,
    /// The pod's workload at start (see [`ProxyState::current`]).
    workload: Arc<Workload>,
    /// The policies and the workload of the last check.
    checked: (Vec<Arc<Policy>>, Arc<Workload>),
}

// === impl LiveConnections ===

impl LiveConnections {
    /// Registers `conn` (call it before the connection's first check, see the module docs).
    pub fn register(self: &Arc<Self>, conn: &authz::Connection<'_>) -> Registration {
        let mut inner = self.lock();
        let id = inner.next;
        inner.next += 1;
        let slot = Arc::new(Slot {
            live: self.clone(),
            id,
            closed: OnceLock::new(),
            waker: AtomicWaker::new(),
        });
        inner.conns.insert(
            id,
            Tracked {
                src_identity: conn.src_identity.cloned(),
                src_ip: conn.src_ip,
                dst: conn.dst,
                slot: slot.clone(),
            },
        );
        Registration(slot)
    }

    /// Checks every connection against `state`'s policies for `dst` (the pod's workload) and
    /// closes the ones denied, with a log line each; returns how many.
    pub fn recheck(&self, state: &ProxyState, dst: &Workload) -> usize {
        let mut inner = self.lock();
        let denied: Vec<(u64, Denied)> = inner
            .conns
            .iter()
            .filter_map(|(id, t)| {
                let conn = authz::Connection {
                    src_identity: t.src_identity.as_ref(),
                    src_ip: t.src_ip,
                    dst: t.dst,
                };
                authz::check(state, dst, &conn).err().map(|d| (*id, d))
            })
            .collect();
        for (id, why) in &denied {
            if let Some(t) = inner.conns.remove(id) {
                let src_id = t.src_identity.as_ref().map(ToString::to_string);
                tracing::info!(
                    "src.addr" = %t.src_ip,
                    "src.identity" = src_id.as_deref(),
                    "dst.addr" = %t.dst,
                    reason = %why,
                    "connection closed because it is no longer allowed after a policy update"
                );
                let _ = t.slot.closed.set(why.clone());
                t.slot.waker.wake();
            }
        }
        denied.len()
    }

    /// Number of connections registered.
    pub fn len(&self) -> usize {
        self.lock().conns.len()
    }

    /// Whether no connection is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

// === impl Registration ===

impl Registration {
    /// `relay`, ended early if this connection is closed by a re-check.
    pub fn revocable<F>(self, relay: F) -> Revocable<F> {
        Revocable {
            relay,
            registration: self,
        }
    }

    /// The rejection, once a re-check closed the connection; until then `cx` is woken by it.
    fn poll_closed(&self, cx: &mut Context<'_>) -> Option<&Denied> {
        if let Some(why) = self.0.closed.get() {
            return Some(why);
        }
        self.0.waker.register(cx.waker());
        // set between the first look and the registration of the waker
        self.0.closed.get()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // (drops the registry's reference to the slot, never the last one: this holds another)
        let removed = self.0.live.lock().conns.remove(&self.0.id);
        drop(removed);
    }
}

// === impl Revocable ===

/// A relay that can tell how many bytes it has moved so far (what a revoked connection reports).
pub trait SoFar {
    /// Bytes moved in each direction until now.
    fn so_far(&self) -> Transferred;
}

impl SoFar for H2Relay {
    fn so_far(&self) -> Transferred {
        self.transferred()
    }
}

impl SoFar for TcpRelay {
    fn so_far(&self) -> Transferred {
        TcpRelay::so_far(self)
    }
}

impl<F: SoFar> SoFar for Revocable<F> {
    fn so_far(&self) -> Transferred {
        self.relay.so_far()
    }
}

impl<A: SoFar, B: SoFar> SoFar for futures::future::Either<A, B> {
    fn so_far(&self) -> Transferred {
        match self {
            futures::future::Either::Left(a) => a.so_far(),
            futures::future::Either::Right(b) => b.so_far(),
        }
    }
}

impl<F> Future for Revocable<F>
where
    F: Future<Output = Result<Transferred, CopyError>> + SoFar + Unpin,
{
    type Output = Result<Transferred, CopyError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(why) = this.registration.poll_closed(cx) {
            return Poll::Ready(Err(CopyError {
                error: io::Error::other(LateRejection(why.clone())),
                transferred: this.relay.so_far(),
            }));
        }
        Pin::new(&mut this.relay).poll(cx)
    }
}

// === impl PolicyWatcher ===

impl PolicyWatcher {
    /// A watcher of `state` for the connections in `live` of the pod whose workload at start was
    /// `workload`, from the current version on.
    pub fn new(
        state: StateHandle,
        live: Arc<LiveConnections>,
        workload: Arc<Workload>,
    ) -> PolicyWatcher {
        let versions = state.subscribe();
        let now = state.load();
        let checked = (now.policies().cloned().collect(), now.current(&workload));
        PolicyWatcher {
            state,
            versions,
            live,
            workload,
            checked,
        }
    }

    /// Waits for the next state version; pending forever once the state has no writer left.
    pub async fn changed(&mut self) {
        if self.versions.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Re-checks the connections if the policies or the pod's workload differ from the last
    /// check; returns how many were closed.
    pub fn recheck(&mut self) -> usize {
        let state = self.state.load();
        let workload = state.current(&self.workload);
        // `Arc<T: Eq>` compares pointers first, so an unchanged snapshot costs little.
        let same = self.checked.1 == workload && self.checked.0.iter().eq(state.policies());
        if same {
            return 0;
        }
        let closed = self.live.recheck(&state, &workload);
        self.checked = (state.policies().cloned().collect(), workload);
        closed
    }
}

#[cfg(test)]
mod tests;
