//! What the xDS client holds, and the per-response logic, without any network: [`Held::apply`]
//! takes one `DeltaDiscoveryResponse` and returns the ACK or NACK to send, with what changed.
//!
//! Behaviour (ztunnel's, spec §5): every resource is decoded on its own; the valid ones replace
//! what is held under their name, an invalid one leaves the previous version of that name in
//! place (last good state) and turns the reply into a NACK (`error_detail` code 3
//! `INVALID_ARGUMENT`, message `name: error; ...`). `removed_resources` are dropped. The versions
//! held are what a new stream announces in `initial_resource_versions`.

use std::collections::{BTreeMap, HashMap};

use super::convert::{self, AddressResource, ConvertError};
use super::proto::{
    ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, Any, DeltaDiscoveryRequest, DeltaDiscoveryResponse,
    Node, Resource, Status,
};
use crate::proxy::config::{LocalConfig, LocalPolicy};

/// gRPC code `INVALID_ARGUMENT`, the `error_detail.code` of a NACK.
pub const INVALID_ARGUMENT: i32 = 3;

/// The two resource types a ztunnel subscribes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceType {
    /// `istio.workload.Address`: workloads and services.
    Address,
    /// `istio.security.Authorization`: policies.
    Authorization,
}

/// One resource held: the version the server gave it, its converted value and when it last
/// changed (the order in which overlapping records win, see [`Held::local_config`]).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry<T> {
    version: String,
    value: T,
    seq: u64,
}

/// Everything the client holds, by type and resource name. Kept across reconnects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    addresses: BTreeMap<String, Entry<AddressResource>>,
    policies: BTreeMap<String, Entry<LocalPolicy>>,
    /// Change counter: the `seq` of the next changed entry.
    next_seq: u64,
}

/// The result of one response: the reply to send and what happened.
#[derive(Debug)]
pub struct Outcome {
    /// The ACK (no `error_detail`) or NACK for the response.
    pub reply: DeltaDiscoveryRequest,
    /// The response's type, `None` for a type URL we never asked for.
    pub resource_type: Option<ResourceType>,
    /// Names added or replaced with a different value.
    pub updated: Vec<String>,
    /// Names removed that were held.
    pub removed: Vec<String>,
    /// Resources refused, with why (their previous version, if any, is kept).
    pub rejected: Vec<(String, ConvertError)>,
}

// === impl ResourceType ===

impl ResourceType {
    /// Both types, in the order the client subscribes.
    pub const ALL: [ResourceType; 2] = [ResourceType::Address, ResourceType::Authorization];

    /// `type.googleapis.com/istio.workload.Address` or `.../istio.security.Authorization`.
    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Address => ADDRESS_TYPE_URL,
            ResourceType::Authorization => AUTHORIZATION_TYPE_URL,
        }
    }

    /// The type of a type URL, if it is one of ours.
    pub fn from_type_url(url: &str) -> Option<ResourceType> {
        ResourceType::ALL.into_iter().find(|t| t.type_url() == url)
    }

    /// Short name for logs and readiness (`Address`, `Authorization`).
    pub fn name(self) -> &'static str {
        match self {
            ResourceType::Address => "Address",
            ResourceType::Authorization => "Authorization",
        }
    }
}

impl std::fmt::Display for ResourceType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// === impl Outcome ===

impl Outcome {
    /// Whether the reply is an ACK.
    pub fn is_ack(&self) -> bool {
        self.reply.error_detail.is_none()
    }

    /// Whether the held state changed (so the proxy state must be rebuilt).
    pub fn changed(&self) -> bool {
        !self.updated.is_empty() || !self.removed.is_empty()
    }
}

// === impl Held ===

impl Held {
    /// Nothing held.
    pub fn new() -> Held {
        Held::default()
    }

    /// The first request of a stream for `t`: wildcard (no names), with the versions held as
    /// `initial_resource_versions`, and `node` (give it only on the stream's first request).
    pub fn initial_request(&self, t: ResourceType, node: Option<Node>) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            node,
            type_url: t.type_url().to_owned(),
            initial_resource_versions: self.versions(t),
            ..DeltaDiscoveryRequest::default()
        }
    }

    /// Name -> version of what is held of type `t`.
    pub fn versions(&self, t: ResourceType) -> HashMap<String, String> {
        fn of<T>(m: &BTreeMap<String, Entry<T>>) -> HashMap<String, String> {
            m.iter()
                .map(|(k, e)| (k.clone(), e.version.clone()))
                .collect()
        }
        match t {
            ResourceType::Address => of(&self.addresses),
            ResourceType::Authorization => of(&self.policies),
        }
    }

    /// Applies one response and returns the reply to send (see the module docs).
    pub fn apply(&mut self, resp: &DeltaDiscoveryResponse) -> Outcome {
        let mut out = Outcome {
            reply: DeltaDiscoveryRequest {
                type_url: resp.type_url.clone(),
                response_nonce: resp.nonce.clone(),
                ..DeltaDiscoveryRequest::default()
            },
            resource_type: ResourceType::from_type_url(&resp.type_url),
            updated: Vec::new(),
            removed: Vec::new(),
            rejected: Vec::new(),
        };
        match out.resource_type {
            Some(ResourceType::Address) => {
                apply_to(
                    &mut self.addresses,
                    &mut self.next_seq,
                    resp,
                    &mut out,
                    convert::decode_address,
                );
            }
            Some(ResourceType::Authorization) => {
                apply_to(
                    &mut self.policies,
                    &mut self.next_seq,
                    resp,
                    &mut out,
                    convert::decode_authorization,
                );
            }
            None => {
                out.reply.error_detail = Some(Status {
                    code: INVALID_ARGUMENT,
                    message: format!("unknown type URL {:?}", resp.type_url),
                    details: Vec::new(),
                });
                return out;
            }
        }
        if !out.rejected.is_empty() {
            let message = out
                .rejected
                .iter()
                .map(|(name, e)| format!("{name}: {e}"))
                .collect::<Vec<_>>()
                .join("; ");
            out.reply.error_detail = Some(Status {
                code: INVALID_ARGUMENT,
                message,
                details: Vec::new(),
            });
        }
        out
    }

    /// What is held, as a local config: workloads, services and policies in the order they last
    /// changed, so where two records overlap (a pod IP reused before the old pod's removal
    /// arrived) the most recent one wins, as in ztunnel's store.
    pub fn local_config(&self) -> LocalConfig {
        let mut cfg = LocalConfig::default();
        let mut addresses: Vec<_> = self.addresses.values().collect();
        addresses.sort_by_key(|e| e.seq);
        for e in addresses {
            match &e.value {
                AddressResource::Workload(w) => cfg.workloads.push(w.as_ref().clone()),
                AddressResource::Service(s) => cfg.services.push(s.as_ref().clone()),
            }
        }
        let mut policies: Vec<_> = self.policies.values().collect();
        policies.sort_by_key(|e| e.seq);
        cfg.policies = policies.into_iter().map(|e| e.value.clone()).collect();
        cfg
    }

    /// Number of resources held of type `t`.
    pub fn len(&self, t: ResourceType) -> usize {
        match t {
            ResourceType::Address => self.addresses.len(),
            ResourceType::Authorization => self.policies.len(),
        }
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.addresses.is_empty() && self.policies.is_empty()
    }
}

/// Removals first, then upserts, into `held`; results go to `out`.
fn apply_to<T: PartialEq>(
    held: &mut BTreeMap<String, Entry<T>>,
    next_seq: &mut u64,
    resp: &DeltaDiscoveryResponse,
    out: &mut Outcome,
    decode: fn(&[u8]) -> Result<T, ConvertError>,
) {
    for name in &resp.removed_resources {
        if held.remove(name).is_some() {
            out.removed.push(name.clone());
        }
    }
    for r in &resp.resources {
        let value = match decode_any(r, &resp.type_url, decode) {
            Ok(v) => v,
            Err(e) => {
                out.rejected.push((r.name.clone(), e));
                continue;
            }
        };
        match held.get_mut(&r.name) {
            Some(old) if old.value == value => old.version = r.version.clone(),
            _ => {
                let entry = Entry {
                    version: r.version.clone(),
                    value,
                    seq: *next_seq,
                };
                *next_seq += 1;
                held.insert(r.name.clone(), entry);
                out.updated.push(r.name.clone());
            }
        }
    }
}

/// The resource's `Any`, checked against the response's type URL, then decoded.
fn decode_any<T>(
    r: &Resource,
    type_url: &str,
    decode: fn(&[u8]) -> Result<T, ConvertError>,
) -> Result<T, ConvertError> {
    let want = ResourceType::from_type_url(type_url).map_or("", ResourceType::type_url);
    match &r.resource {
        Some(Any {
            type_url: got,
            value,
        }) if got.is_empty() || got == type_url => decode(value),
        Some(Any { type_url: got, .. }) => Err(ConvertError::TypeUrl {
            got: got.clone(),
            want,
        }),
        None => Err(ConvertError::TypeUrl {
            got: String::new(),
            want,
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
