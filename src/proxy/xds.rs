//! The xDS client: workloads, services and authorization policies from istiod over delta ADS
//! (spec §5 "XDS", §6), as ztunnel gets them.
//!
//! - [`proto`]: hand-written prost messages (`istio.workload`, `istio.security`, the delta
//!   discovery messages, `Node`, `google.rpc.Status`) with ztunnel's field numbers.
//! - [`convert`]: proto → the local-config shapes (`LocalWorkload`, `LocalService`,
//!   `LocalPolicy`), so xDS and `LOCAL_XDS_PATH` build the same [`ProxyState`]; bad input is a
//!   typed [`ConvertError`].
//! - [`held`]: what the client holds and the per-response ACK/NACK logic, free of I/O.
//! - [`client`]: the stream, reconnects with backoff, readiness, publishing to the
//!   [`StateHandle`].
//! - [`metrics`]: ztunnel's `istio_xds_*` counters ([`XdsConfig::metrics`]).
//!
//! Front door: build an [`XdsConfig`] (endpoint and [`CallAuth`] from `proxy::control`, a
//! [`NodeIdentity::ztunnel`] node) and spawn [`run`]`(cfg, state, &readiness, shutdown)`. It
//! registers the readiness tasks `xds Address` and `xds Authorization` at once, and every applied
//! push replaces the proxy state (new connections see it immediately).
//!
//! [`ProxyState`]: crate::proxy::state::ProxyState
//! [`StateHandle`]: crate::proxy::state::StateHandle
//! [`CallAuth`]: crate::proxy::control::CallAuth

pub mod client;
pub mod convert;
pub mod held;
pub mod metrics;
pub mod proto;

pub use client::{
    DELTA_ADS_PATH, NodeIdentity, NodeParams, XdsClient, XdsConfig, XdsError, readiness_task_name,
    run,
};
pub use convert::{AddressResource, ConvertError};
pub use held::{Held, Outcome, ResourceType};
