//! xDS: `istio.workload.Address` and `istio.security.Authorization` resources, and delta
//! responses applied in sequence to the held state, which then builds a proxy state.
//!
//! Input: `[mode: u8]` then the bytes (modes 0, 1), or records of `[len: u16 be][len bytes]`, each
//! a `DeltaDiscoveryResponse` (mode 2).
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use ztnode::proxy::state::ProxyState;
use ztnode::proxy::xds::convert::{decode_address, decode_authorization};
use ztnode::proxy::xds::held::Held;
use ztnode::proxy::xds::proto::DeltaDiscoveryResponse;

fuzz_target!(|data: &[u8]| {
    let Some((mode, body)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            let _ = decode_address(body);
        }
        1 => {
            let _ = decode_authorization(body);
        }
        _ => {
            let mut held = Held::new();
            let mut rest = body;
            while let [hi, lo, tail @ ..] = rest {
                let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(tail.len());
                let (msg, next) = tail.split_at(len);
                rest = next;
                if let Ok(resp) = DeltaDiscoveryResponse::decode(msg) {
                    let outcome = held.apply(&resp);
                    let _ = outcome.is_ack();
                }
            }
            let _ = ProxyState::from_config_lenient(&held.local_config());
        }
    }
});
