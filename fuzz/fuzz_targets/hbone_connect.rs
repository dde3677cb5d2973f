//! An inbound HBONE CONNECT: the `:authority` parser and the request checks (method, target IP,
//! forbidden ports) with arbitrary `forwarded`, `baggage` and `traceparent` headers.
//!
//! Input: `[method selector: u8][header count: u8]` then NUL-separated strings: the authority,
//! then header values.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ztnode::proxy::hbone::parse_authority;
use ztnode::proxy::inbound::check_request;

const HEADERS: [&str; 3] = ["forwarded", "baggage", "traceparent"];

fuzz_target!(|data: &[u8]| {
    let [method, count, rest @ ..] = data else {
        return;
    };
    let mut parts = rest.split(|b| *b == 0);
    let authority = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let _ = parse_authority(&authority);
    let method = match method % 3 {
        0 => http::Method::CONNECT,
        1 => http::Method::GET,
        _ => http::Method::POST,
    };
    let mut req = http::Request::builder().method(method).uri(authority.as_str());
    for (i, value) in parts.take(usize::from(*count)).enumerate() {
        req = req.header(HEADERS[i % HEADERS.len()], value);
    }
    let Ok(req) = req.body(()) else {
        return;
    };
    for local in ["10.0.0.2:15008", "[fd00::2]:15008"] {
        let local = local.parse().expect("a socket address");
        if let Ok(target) = check_request(&req, local) {
            assert_eq!(target.ip(), local.ip(), "the target is the pod itself");
            assert!(![15001, 15006, 15008].contains(&target.port()));
        }
    }
});
