//! The proxy role (`ztunnel`): per-pod listeners, HBONE client/server, identities, workload state.
//!
//! A pod's journey here: the agent hands its netns over ([`crate::zds`]) → [`manager`] binds the
//! listeners inside it and runs their accept loop with the pod's context ([`pod`]) → [`outbound`]
//! tunnels the app's connections over HBONE ([`pool`], [`tls`], [`identity`]) → the peer's
//! [`inbound`] checks and forwards them to its app; both log and count each connection
//! ([`accesslog`], [`metrics`]).
//!
//! The modules form a one-way stack: the manager sits on top; the connection code ([`inbound`],
//! [`outbound`], [`task`]) sees only the per-pod context, never the manager.

pub mod accesslog;
pub mod authz;
pub mod config;
pub mod copy;
pub mod hbone;
pub mod identity;
pub mod inbound;
pub mod manager;
pub mod metrics;
pub mod outbound;
pub mod pod;
pub mod pool;
pub mod route;
pub mod socket;
pub mod state;
pub mod task;
pub mod tls;
