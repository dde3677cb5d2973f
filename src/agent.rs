//! The node agent role: self-install onto the host ([`install`]), the plugin event server
//! ([`server`]), enrollment decisions ([`enroll`]), in-pod redirection ([`redirect`]) and the pod
//! lifecycle that ties them together and hands each enrolled pod's netns to the proxy ([`pods`]).

pub mod enroll;
pub mod install;
pub mod pods;
pub mod redirect;
pub mod server;
