//! A tiny HTTP/1.1 client for the lab's fake servers (API server, istiod control endpoint) and a
//! node's admin endpoint, which listen inside a lab namespace: one request per connection, made
//! from inside that namespace.

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
    let payload = body.map(|(c, v)| (c, v.to_string()));
    let (code, text) = exchange(
        netns,
        addr,
        method,
        path,
        payload.as_ref().map(|(c, p)| (*c, p.as_str())),
    )?;
    Ok((code, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// `GET path` from inside `netns` to `addr`: the status code and the body as text (for large or
/// non-JSON answers such as a node's `/config_dump`, searched rather than parsed).
///
/// # Errors
/// As [`request`].
pub fn get_text(netns: &Netns, addr: SocketAddr, path: &str) -> Result<(u16, String), LabError> {
    exchange(netns, addr, "GET", path, None)
}

/// `method path` without a body from inside `netns` to `addr` (e.g. `POST /logging?level=debug`):
/// the status code and the body as text.
///
/// # Errors
/// As [`request`].
pub fn call_text(
    netns: &Netns,
    addr: SocketAddr,
    method: &str,
    path: &str,
) -> Result<(u16, String), LabError> {
    exchange(netns, addr, method, path, None)
}

/// One request (`body` = content type, text); the status code and the (dechunked) body.
fn exchange(
    netns: &Netns,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<(&str, &str)>,
) -> Result<(u16, String), LabError> {
    let io = |what: &str| {
        let what = format!("{what} {method} {path}");
        move |source| LabError::Io { what, source }
    };
    let mut s = Lab::connect_from(netns, addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io("timeout"))?;
    let (ctype, payload) = body.unwrap_or(("application/json", ""));
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
    Ok((code, body))
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
