//! The proxy role (`ztunnel`): per-pod listeners, HBONE client/server, identities, workload state.

pub mod config;
pub mod identity;
pub mod state;
pub mod tls;
