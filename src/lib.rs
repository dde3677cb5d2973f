//! ztnode: the node side of an ambient (sidecar-less) service mesh, wire-compatible with Istio ambient.
//!
//! One binary, several roles chosen by `argv[0]` or subcommand (see `main.rs`):
//! the CNI plugin ([`plugin`]), the node agent ([`agent`]) and the proxy ([`proxy`]).
//! The lab ([`lab`]) is the throwaway node on one machine for `ztnode demo`, `ztnode bench` and the
//! end-to-end tests. Shared bottom modules ([`netns`], [`podevent`], [`zds`], [`nft`]) never import
//! a role.

pub mod agent;
pub mod lab;
pub mod netns;
pub mod nft;
pub mod node;
pub mod plugin;
pub mod podevent;
pub mod proxy;
pub mod zds;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (as ztunnel does at start): a proxy holds two
/// sockets per proxied connection.
pub fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}
