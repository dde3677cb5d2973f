//! ZDS: a sequence of agent → proxy requests (each with a claimed fd count, fd-less Adds
//! included) through the proxy's checks and snapshot bookkeeping, and the proxy → agent messages
//! the agent decodes.
//!
//! Input: records of `[fds: u8][len: u16 be][len bytes]`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use ztnode::zds::client::{SnapshotState, check_request};
use ztnode::zds::proto::workload_request::Payload;
use ztnode::zds::proto::{WorkloadResponse, ZdsHello};

fuzz_target!(|data: &[u8]| {
    let mut state = SnapshotState::default();
    let mut rest = data;
    while let [fds, hi, lo, tail @ ..] = rest {
        let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(tail.len());
        let (msg, next) = tail.split_at(len);
        rest = next;
        let _ = WorkloadResponse::decode(msg);
        let _ = ZdsHello::decode(msg);
        let Ok(payload) = check_request(msg, usize::from(*fds % 4)) else {
            continue;
        };
        match payload {
            Payload::Add(add) => state.added(&add.uid, fds & 0x80 == 0),
            Payload::Keep(keep) => {
                let _ = state.kept(&keep.uid);
            }
            Payload::Del(del) => state.deleted(&del.uid),
            Payload::SnapshotSent(_) => {
                let _ = state.snapshot_sent();
            }
        }
        if fds & 0x40 != 0 {
            state.connected();
        }
    }
});
