//! A tiny HTTP/1.1 client for the lab's fake servers (API server, istiod control endpoint), which
//! listen inside a lab namespace: one request per connection, made from inside that namespace.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;

use super::node::{Lab, LabError};
use crate::netns::Netns;

/// One request from inside `netns` to `addr`; `body` is `(content type, JSON)`. Returns the status
/// code and the JSON body (`Null` when empty or not JSON). Reads until the server closes.
///
/// # Errors
/// Connect, send or read failures ([`LabError::Io`]).
pub fn request(
    netns: &Netns,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<(&str, &Value)>,
) -> Result<(u16, Value), LabError> {
    let io = |what: &str| {
        let what = format!("{what} {method} {path}");
        move |source| LabError::Io { what, source }
    };
    let mut s = Lab::connect_from(netns, addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io("timeout"))?;
    let payload = body.map(|(_, v)| v.to_string()).unwrap_or_default();
    let ctype = body.map(|(c, _)| c).unwrap_or("application/json");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: fake\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    )
    .map_err(io("send"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io("read"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Ok((code, serde_json::from_str(&body).unwrap_or(Value::Null)))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}
