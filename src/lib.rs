//! ztnode: the node side of an ambient (sidecar-less) service mesh, wire-compatible with Istio ambient.
//!
//! One binary, several roles chosen by `argv[0]` or subcommand (see `main.rs`):
//! the CNI plugin ([`plugin`]), the node agent ([`agent`]) and the proxy ([`proxy`]); [`node`]
//! composes agent and proxy. Shared bottom modules ([`backoff`], [`mesh`], [`netns`], [`nft`],
//! [`podevent`], [`ready`], [`runtime`], [`zds`]) never import a role. The lab ([`lab`]) is the
//! throwaway node on one machine for `ztnode demo`, `ztnode bench` and the end-to-end tests.

pub mod agent;
pub mod backoff;
pub mod lab;
pub mod mesh;
pub mod metrics;
pub mod netns;
pub mod nft;
pub mod node;
pub mod plugin;
pub mod podevent;
pub mod proxy;
pub mod ready;
pub mod runtime;
pub mod zds;
