//! The proxy role (`ztunnel`): per-pod listeners, HBONE client/server, identities, workload state.

pub mod config;
pub mod copy;
pub mod hbone;
pub mod identity;
pub mod socket;
pub mod tls;
