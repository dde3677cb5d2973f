//! The lab: a throwaway node on one machine, and what runs on it.
//!
//! A lab node ([`Lab`], in `node`) is a "node" netns with a bridge and "pod" netns attached
//! through the real CNI chain ([`cnichain`]), all in namespaces it creates and removes again; a
//! [`MeshLab`] is one running `ztnode node` with its first pods. On it run `ztnode demo` ([`demo`]:
//! two pods and proof that their traffic went through HBONE), `ztnode bench`
//! ([`bench`](mod@bench): what the mesh costs against the direct path) and the end-to-end tests;
//! [`pcap`] reads the captures taken on the bridge; [`dump_shape`] checks an admin `/config_dump`
//! against the shape of ztunnel's.

pub mod bench;
pub mod cnichain;
pub mod demo;
pub mod dump_shape;
pub mod http;
pub mod istiod;
pub mod kube;
mod mesh_lab;
mod node;
pub mod pcap;

pub use mesh_lab::{MeshLab, MeshSpec, MeshStage};
pub use node::{LINK_ADDRS, Lab, LabError, LabOptions, Pod, ProcessGuard, local_config};
