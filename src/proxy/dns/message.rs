//! DNS messages the proxy reads and writes (RFC 1035 §4.1, EDNS RFC 6891), through
//! `hickory-proto`: what a request asks, the proxy's own answers for mesh hosts, and error replies.
//!
//! Forwarded requests and their answers are never re-encoded (the bytes go through as they are);
//! only the proxy's own answers are built here. Those follow ztunnel's handler
//! (`src/dns/handler.rs`): the request's id, opcode, RD and CD; AA (the mesh is the authority for
//! its hosts) and RA set; the question echoed; records with a 30 s TTL
//! (`DEFAULT_TTL_SECONDS`); an OPT record when the request had one (payload size
//! max(request's, 512), its version and DO bit). An answer that does not fit the client's UDP
//! size is sent truncated (TC, no records), so the client retries over TCP.

use std::net::IpAddr;

use hickory_proto::op::{Edns, Message, MessageType, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

/// TTL of the proxy's own records (ztunnel's `DEFAULT_TTL_SECONDS`).
pub const TTL_SECS: u32 = 30;
/// The DNS header's length.
pub const HEADER_LEN: usize = 12;
/// UDP payload every client accepts (RFC 1035 §4.2.1).
pub const MIN_UDP_PAYLOAD: u16 = 512;

/// Building an answer failed.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    /// A name of the answer is not a valid DNS name.
    #[error("invalid name in the answer: {0}")]
    Name(String),
    /// Encoding failed.
    #[error("encoding the answer: {0}")]
    Encode(String),
}

/// A request as far as the proxy needs to understand it.
#[derive(Debug)]
pub struct Request {
    /// Message id.
    pub id: u16,
    /// The QR bit is set (the "request" is a response).
    pub is_response: bool,
    /// Opcode (QUERY, NOTIFY, UPDATE, ...).
    pub op_code: OpCode,
    /// The whole message, when it decodes.
    pub message: Option<Message>,
}

impl Request {
    /// Reads `raw`; `None` when it is shorter than a DNS header (nothing to reply to).
    pub fn parse(raw: &[u8]) -> Option<Request> {
        let header = raw.get(..HEADER_LEN)?;
        Some(Request {
            id: u16::from_be_bytes([header[0], header[1]]),
            is_response: header[2] & 0x80 != 0,
            op_code: OpCode::from_u8((header[2] >> 3) & 0x0f),
            message: Message::from_vec(raw).ok(),
        })
    }

    /// The single question of a standard query, if this is one.
    pub fn query(&self) -> Option<&Query> {
        match (&self.message, self.op_code) {
            (Some(m), OpCode::Query) if !self.is_response && m.queries.len() == 1 => {
                m.queries.first()
            }
            _ => None,
        }
    }

    /// The first question's type for metrics, lowercase as ztunnel labels it (`a`, `aaaa`,
    /// `srv`, ...); `unknown` for types without a name or messages that do not decode.
    pub fn query_type_label(&self) -> String {
        match self
            .message
            .as_ref()
            .and_then(|m| m.queries.first())
            .map(Query::query_type)
        {
            Some(RecordType::Unknown(_)) | None => "unknown".into(),
            Some(t) => t.to_string().to_ascii_lowercase(),
        }
    }

    /// The largest UDP answer the client takes: its EDNS payload size (at least 512) or 512.
    pub fn max_udp_payload(&self) -> u16 {
        self.message
            .as_ref()
            .and_then(|m| m.edns.as_ref())
            .map_or(MIN_UDP_PAYLOAD, |e| e.max_payload().max(MIN_UDP_PAYLOAD))
    }
}

/// Whether `q` asks for addresses (class IN, type A or AAAA): the only questions the proxy
/// answers itself; `Some(true)` for AAAA.
pub fn address_query(q: &Query) -> Option<bool> {
    match (q.query_class(), q.query_type()) {
        (DNSClass::IN, RecordType::A) => Some(false),
        (DNSClass::IN, RecordType::AAAA) => Some(true),
        _ => None,
    }
}

/// The lowercase labels of `name` (no root), or `None` if one is not UTF-8.
pub fn lowercase_labels(name: &Name) -> Option<Vec<String>> {
    name.iter()
        .map(|l| std::str::from_utf8(l).ok().map(str::to_ascii_lowercase))
        .collect()
}

/// The proxy's answer to `req` (whose question is `q`): a CNAME from the queried name to its first
/// `cname_to` labels when set, then `addrs` under the final name. `max_len` truncates (UDP).
pub fn answer(
    req: &Request,
    q: &Query,
    cname_to: Option<usize>,
    addrs: &[IpAddr],
    max_len: Option<u16>,
) -> Result<Vec<u8>, MessageError> {
    let mut resp = response_to(req, ResponseCode::NoError);
    resp.metadata.authoritative = true;
    resp.metadata.recursion_available = true;
    resp.add_query(q.clone());
    let mut owner = q.name().clone();
    if let Some(keep) = cname_to {
        let target = Name::from_labels(q.name().iter().take(keep))
            .map_err(|e| MessageError::Name(e.to_string()))?;
        resp.add_answer(Record::from_rdata(
            owner,
            TTL_SECS,
            RData::CNAME(CNAME(target.clone())),
        ));
        owner = target;
    }
    for ip in addrs {
        let rdata = match ip {
            IpAddr::V4(v4) => RData::A(A(*v4)),
            IpAddr::V6(v6) => RData::AAAA(AAAA(*v6)),
        };
        resp.add_answer(Record::from_rdata(owner.clone(), TTL_SECS, rdata));
    }
    let bytes = encode(&resp)?;
    match max_len {
        Some(max) if bytes.len() > usize::from(max) => encode(&resp.truncate()),
        _ => Ok(bytes),
    }
}

/// An error reply (`code`: SERVFAIL, FORMERR, ...) to the request `raw`, echoing its question when
/// it decodes, else just the header (id, opcode, RD and CD copied).
pub fn error_reply(raw: &[u8], req: &Request, code: ResponseCode) -> Vec<u8> {
    if req.message.is_some()
        && let Ok(bytes) = encode(&{
            let mut m = response_to(req, code);
            m.add_queries(req.message.iter().flat_map(|m| m.queries.iter().cloned()));
            m
        })
    {
        return bytes;
    }
    let b2 = raw.get(2).copied().unwrap_or_default();
    let b3 = raw.get(3).copied().unwrap_or_default();
    let code = code.low();
    let mut out = vec![0; HEADER_LEN];
    out[..2].copy_from_slice(&req.id.to_be_bytes());
    out[2] = 0x80 | (b2 & 0x78) | (b2 & 0x01);
    out[3] = (b3 & 0x10) | (code & 0x0f);
    out
}

/// An empty response to `req` with `code`: its id, opcode, RD and CD.
fn response_to(req: &Request, code: ResponseCode) -> Message {
    let mut m = Message::new(req.id, MessageType::Response, req.op_code);
    if let Some(request) = &req.message {
        m.metadata = Metadata::response_from_request(&request.metadata);
        if let Some(e) = &request.edns {
            let mut edns = Edns::new();
            edns.set_max_payload(e.max_payload().max(MIN_UDP_PAYLOAD));
            edns.set_version(e.version());
            edns.set_dnssec_ok(e.flags().dnssec_ok);
            m.set_edns(edns);
        }
    }
    m.metadata.response_code = code;
    m
}

fn encode(m: &Message) -> Result<Vec<u8>, MessageError> {
    m.to_vec().map_err(|e| MessageError::Encode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, t: RecordType, edns: Option<u16>) -> Vec<u8> {
        let mut m = Message::new(0x1234, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).expect("name"), t));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            e.set_dnssec_ok(true);
            m.set_edns(e);
        }
        m.to_vec().expect("encode")
    }

    #[test]
    fn an_address_answer_echoes_the_query_and_is_authoritative() {
        let raw = query("Productpage.", RecordType::A, None);
        let req = Request::parse(&raw).expect("parse");
        let q = req.query().expect("query").clone();
        assert_eq!(address_query(&q), Some(false));
        assert_eq!(
            lowercase_labels(q.name()),
            Some(vec!["productpage".to_owned()])
        );
        let ip: IpAddr = "10.1.0.1".parse().expect("ip");
        let out = answer(&req, &q, None, &[ip], Some(512)).expect("answer");
        let resp = Message::from_vec(&out).expect("decode");
        assert_eq!(resp.metadata.id, 0x1234);
        assert_eq!(resp.metadata.message_type, MessageType::Response);
        assert!(resp.metadata.authoritative && resp.metadata.recursion_available);
        assert!(resp.metadata.recursion_desired, "RD copied");
        assert_eq!(resp.queries, vec![q.clone()]);
        assert_eq!(resp.answers.len(), 1);
        assert_eq!(resp.answers[0].name, *q.name(), "the client's case kept");
        assert_eq!(resp.answers[0].ttl, TTL_SECS);
        assert_eq!(resp.answers[0].data.ip_addr(), Some(ip));
        assert!(resp.edns.is_none(), "no OPT without one in the request");
    }

    #[test]
    fn no_addresses_is_noerror_with_no_answers() {
        let raw = query("productpage.", RecordType::AAAA, None);
        let req = Request::parse(&raw).expect("parse");
        let q = req.query().expect("query").clone();
        let resp =
            Message::from_vec(&answer(&req, &q, None, &[], None).expect("answer")).expect("decode");
        assert_eq!(resp.metadata.response_code, ResponseCode::NoError);
        assert!(resp.answers.is_empty());
    }

    #[test]
    fn a_stripped_search_domain_gets_a_cname_and_edns_is_echoed() {
        let raw = query(
            "www.example.com.ns1.svc.cluster.local.",
            RecordType::A,
            Some(1232),
        );
        let req = Request::parse(&raw).expect("parse");
        assert_eq!(req.max_udp_payload(), 1232);
        let q = req.query().expect("query").clone();
        let ip: IpAddr = "10.1.0.4".parse().expect("ip");
        let resp = Message::from_vec(&answer(&req, &q, Some(3), &[ip], None).expect("answer"))
            .expect("decode");
        let target = Name::from_ascii("www.example.com.").expect("name");
        assert_eq!(resp.answers.len(), 2);
        assert_eq!(resp.answers[0].data, RData::CNAME(CNAME(target.clone())));
        assert_eq!(resp.answers[1].name, target);
        let edns = resp.edns.expect("OPT echoed");
        assert_eq!(edns.max_payload(), 1232);
        assert!(edns.flags().dnssec_ok);
    }

    #[test]
    fn an_answer_larger_than_the_udp_size_is_truncated() {
        let raw = query("big.example.", RecordType::A, None);
        let req = Request::parse(&raw).expect("parse");
        let q = req.query().expect("query").clone();
        let ips: Vec<IpAddr> = (0..40u8).map(|i| IpAddr::from([10, 3, 0, i])).collect();
        let full = answer(&req, &q, None, &ips, None).expect("full");
        assert!(full.len() > 512);
        let cut = Message::from_vec(&answer(&req, &q, None, &ips, Some(512)).expect("cut"))
            .expect("decode");
        assert!(cut.metadata.truncation);
        assert!(cut.answers.is_empty());
        assert_eq!(cut.queries, vec![q]);
    }

    #[test]
    fn only_single_question_standard_queries_are_answered_locally() {
        let mut update = Message::new(7, MessageType::Query, OpCode::Update);
        update.add_query(Query::query(
            Name::from_ascii("example.").expect("name"),
            RecordType::SOA,
        ));
        let raw = update.to_vec().expect("encode");
        let req = Request::parse(&raw).expect("parse");
        assert_eq!(req.op_code, OpCode::Update);
        assert!(req.query().is_none());
        assert_eq!(req.query_type_label(), "soa");
        let srv = query("_http._tcp.example.", RecordType::SRV, None);
        let req = Request::parse(&srv).expect("parse");
        assert!(address_query(req.query().expect("query")).is_none());
        assert_eq!(req.query_type_label(), "srv");
        assert!(Request::parse(&[0; 11]).is_none());
    }

    #[test]
    fn error_replies_echo_the_question_or_just_the_header() {
        let raw = query("x.example.", RecordType::MX, None);
        let req = Request::parse(&raw).expect("parse");
        let resp =
            Message::from_vec(&error_reply(&raw, &req, ResponseCode::ServFail)).expect("decode");
        assert_eq!(resp.metadata.id, 0x1234);
        assert_eq!(resp.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(resp.queries.len(), 1);
        // garbage after a header: header-only reply with opcode and RD kept
        let mut junk = vec![0xab, 0xcd, 0x29, 0x10, 0, 1];
        junk.extend_from_slice(&[0xff; 10]);
        let req = Request::parse(&junk).expect("header");
        assert!(req.message.is_none());
        let out = error_reply(&junk, &req, ResponseCode::FormErr);
        assert_eq!(out, vec![0xab, 0xcd, 0xa9, 0x11, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
}
