//! The node agent role: self-install onto the host, plugin event server, enrollment, in-pod
//! redirection, and netns handoff to the proxy.

pub mod install;
pub mod redirect;
