//! The proxy role (`ztunnel`): per-pod listeners, HBONE client/server, identities, workload state.
//!
//! A pod's journey here: the agent hands its netns over ([`crate::zds`]) → [`pods`] binds the
//! listeners inside it → [`outbound`] tunnels the app's connections over HBONE ([`pool`], [`tls`],
//! [`identity`]) → the peer's [`inbound`] checks and forwards them to its app.

pub mod accesslog;
pub mod authz;
pub mod config;
pub mod copy;
pub mod hbone;
pub mod identity;
pub mod inbound;
pub mod metrics;
pub mod outbound;
pub mod pods;
pub mod pool;
pub mod route;
pub mod socket;
pub mod state;
pub mod task;
pub mod tls;
