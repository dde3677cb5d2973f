//! The ZDS protobuf messages (package `istio.workload.zds`, Istio `pkg/zdsapi/zds.proto`), written
//! by hand with prost derives. Field numbers follow `../shared/spec/ztunnel.md` §1 exactly; note that
//! `DelWorkload.uid` is field 2 and `WorkloadRequest.keep` is field 5.

/// `Version`: the protocol version announced in [`ZdsHello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    /// `NOT_USED = 0` (the proto3 default; never sent).
    NotUsed = 0,
    /// `V1 = 1`.
    V1 = 1,
}

/// `ZdsHello`: the first message of a connection, proxy → agent; not acked.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct ZdsHello {
    /// `version = 1`.
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

/// `WorkloadInfo`: how the proxy finds the pod's workload and identity (field 4 `trust_domain` is
/// reserved). The one pod shape the agent and the proxy share: on the wire, in the agent's state
/// file and pod table (flattened, snake_case keys) and in `/config_dump`.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message, serde::Serialize, serde::Deserialize)]
pub struct WorkloadInfo {
    /// `name = 1`: pod name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// `namespace = 2`: pod namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// `service_account = 3`: the Kubernetes service account (the SPIFFE `sa` segment).
    #[prost(string, tag = "3")]
    pub service_account: String,
}

/// `AddWorkload`: serve this pod; its netns fd travels as SCM_RIGHTS with the datagram.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct AddWorkload {
    /// `uid = 1`: Kubernetes pod UID.
    #[prost(string, tag = "1")]
    pub uid: String,
    /// `workload_info = 2` (mandatory for ztunnel).
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// `KeepWorkload`: the pod exists but its netns is not available (snapshot only).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct KeepWorkload {
    /// `uid = 1`.
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// `DelWorkload`: stop serving the pod.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct DelWorkload {
    /// `uid = 2` (sic: field number 2).
    #[prost(string, tag = "2")]
    pub uid: String,
}

/// `SnapshotSent`: end of the initial snapshot.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct SnapshotSent {}

/// `WorkloadRequest`: agent → proxy.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadRequest {
    /// oneof `payload`.
    #[prost(oneof = "workload_request::Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<workload_request::Payload>,
}

/// The oneof of [`WorkloadRequest`].
pub mod workload_request {
    /// oneof `payload`: `add = 1`, `del = 2`, `snapshot_sent = 3`, `keep = 5`.
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        /// `add = 1`.
        #[prost(message, tag = "1")]
        Add(super::AddWorkload),
        /// `del = 2`.
        #[prost(message, tag = "2")]
        Del(super::DelWorkload),
        /// `snapshot_sent = 3`.
        #[prost(message, tag = "3")]
        SnapshotSent(super::SnapshotSent),
        /// `keep = 5`.
        #[prost(message, tag = "5")]
        Keep(super::KeepWorkload),
    }
}

/// `Ack`: empty `error` = success, otherwise the NACK text.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct Ack {
    /// `error = 1`.
    #[prost(string, tag = "1")]
    pub error: String,
}

/// `WorkloadResponse`: proxy → agent, exactly one per request.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadResponse {
    /// oneof `payload`.
    #[prost(oneof = "workload_response::Payload", tags = "1")]
    pub payload: Option<workload_response::Payload>,
}

/// The oneof of [`WorkloadResponse`].
pub mod workload_response {
    /// oneof `payload`: `ack = 1`.
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        /// `ack = 1`.
        #[prost(message, tag = "1")]
        Ack(super::Ack),
    }
}

// === impl WorkloadRequest ===

impl WorkloadRequest {
    /// The request wrapping `payload`.
    pub fn new(payload: workload_request::Payload) -> WorkloadRequest {
        WorkloadRequest {
            payload: Some(payload),
        }
    }
}

// === impl WorkloadResponse ===

impl WorkloadResponse {
    /// An ack (`error` empty) or a nack carrying `error`.
    pub fn ack(error: impl Into<String>) -> WorkloadResponse {
        WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack {
                error: error.into(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::workload_request::Payload;
    use super::*;

    #[test]
    fn hello_v1_is_field_1_varint_1() {
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        assert_eq!(hello.encode_to_vec(), [0x08, 0x01]);
        let back = ZdsHello::decode(&[0x08, 0x01][..]).expect("decode");
        assert_eq!(back.version(), Version::V1);
    }

    #[test]
    fn del_workload_uid_is_field_2() {
        let del = DelWorkload { uid: "x".into() };
        assert_eq!(del.encode_to_vec(), [0x12, 0x01, b'x']);
        let req = WorkloadRequest::new(Payload::Del(del));
        assert_eq!(req.encode_to_vec(), [0x12, 0x03, 0x12, 0x01, b'x']);
    }

    #[test]
    fn add_workload_bytes() {
        let req = WorkloadRequest::new(Payload::Add(AddWorkload {
            uid: "u".into(),
            workload_info: Some(WorkloadInfo {
                name: "n".into(),
                namespace: "ns".into(),
                service_account: "sa".into(),
            }),
        }));
        let info = [
            0x0a, 0x01, b'n', 0x12, 0x02, b'n', b's', 0x1a, 0x02, b's', b'a',
        ];
        let mut add = vec![0x0a, 0x01, b'u', 0x12, info.len() as u8];
        add.extend_from_slice(&info);
        let mut want = vec![0x0a, add.len() as u8];
        want.extend_from_slice(&add);
        assert_eq!(req.encode_to_vec(), want);
        assert_eq!(WorkloadRequest::decode(&want[..]).expect("decode"), req);
    }

    #[test]
    fn snapshot_sent_and_keep_tags() {
        let snap = WorkloadRequest::new(Payload::SnapshotSent(SnapshotSent {}));
        assert_eq!(snap.encode_to_vec(), [0x1a, 0x00]);
        let keep = WorkloadRequest::new(Payload::Keep(KeepWorkload { uid: "k".into() }));
        assert_eq!(keep.encode_to_vec(), [0x2a, 0x03, 0x0a, 0x01, b'k']);
    }

    #[test]
    fn ack_and_nack_bytes() {
        assert_eq!(WorkloadResponse::ack("").encode_to_vec(), [0x0a, 0x00]);
        assert_eq!(
            WorkloadResponse::ack("no").encode_to_vec(),
            [0x0a, 0x04, 0x0a, 0x02, b'n', b'o']
        );
        let back =
            WorkloadResponse::decode(&[0x0a, 0x04, 0x0a, 0x02, b'n', b'o'][..]).expect("decode");
        assert_eq!(back, WorkloadResponse::ack("no"));
    }

    #[test]
    fn unknown_fields_are_skipped() {
        // field 4 (reserved trust_domain) in WorkloadInfo, as an older peer might send
        let bytes = [0x0a, 0x01, b'n', 0x22, 0x01, b't'];
        let info = WorkloadInfo::decode(&bytes[..]).expect("decode");
        assert_eq!(info.name, "n");
    }
}
