//! HBONE protocol pieces shared by the client and the server: HTTP/2 settings, timeouts and
//! keepalive, the CONNECT `:authority` form and the request headers (`../shared/spec/ztunnel.md`
//! §2–3). The ports are the node's facts ([`crate::mesh`]).

use std::net::{IpAddr, SocketAddr};

/// HTTP/2 initial stream window, bytes (`HTTP2_STREAM_WINDOW_SIZE`).
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 connection window, bytes (`HTTP2_CONNECTION_WINDOW_SIZE`).
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// HTTP/2 max frame size, bytes (`HTTP2_FRAME_SIZE`).
pub const FRAME_SIZE: u32 = 1024 * 1024;
/// Max buffered outgoing bytes per stream on the client (h2's default is 400 KiB): one full 1 MiB
/// read of the app can be handed to h2 at once, without the 4 MiB a whole window would allow
/// (which measured slower: more data in flight through the caches).
pub const SEND_BUFFER: usize = 1024 * 1024;
/// Default cap on the streams open at once on one pooled connection before another one is dialed
/// (ztunnel `POOL_MAX_STREAMS_PER_CONNECTION`, default 100; see [`crate::proxy::pool::PoolConfig`]).
pub const MAX_STREAMS_PER_CONNECTION: usize = 100;
/// Max concurrent streams the server accepts per connection.
pub const SERVER_MAX_STREAMS: u32 = 200;
/// Max buffered outgoing bytes per stream on the server (ztunnel: 400 KiB).
pub const SERVER_SEND_BUFFER: usize = 400 * 1024;

/// TCP connect timeout towards a peer's 15008, as ztunnel; it also bounds the outbound TLS and
/// HTTP/2 handshakes of a new pooled connection, and the proxy's connects to the app and to
/// passthrough destinations.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Time the server allows for each of the TLS and the HTTP/2 handshake of an inbound HBONE
/// connection.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Interval between the HTTP/2 PINGs of an HBONE connection ([`keepalive`]).
pub const PING_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
/// Time a PING may wait for its PONG before the connection is given up ([`keepalive`]).
pub const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Errors parsing a CONNECT `:authority`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    /// No `:port` part.
    #[error("authority {0:?} has no port")]
    MissingPort(String),
    /// The port is not a number in 1..=65535.
    #[error("authority {0:?} has an invalid port")]
    BadPort(String),
    /// The host is not an IP literal (`10.0.0.2` or `[fd00::2]`).
    #[error("authority {0:?} is not ip:port")]
    BadHost(String),
}

/// Parses an HBONE `:authority` of the form `ip:port` or `[v6]:port`.
pub fn parse_authority(authority: &str) -> Result<SocketAddr, AuthorityError> {
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| AuthorityError::MissingPort(authority.to_owned()))?;
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        // a bare v6 address such as "fd00::2" (the last colon is part of it)
        return Err(AuthorityError::MissingPort(authority.to_owned()));
    }
    let port: u16 = match port.parse() {
        Ok(p) if p != 0 => p,
        _ => return Err(AuthorityError::BadPort(authority.to_owned())),
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ip: IpAddr = host
        .parse()
        .map_err(|_| AuthorityError::BadHost(authority.to_owned()))?;
    if ip.is_ipv6() && !authority.starts_with('[') {
        return Err(AuthorityError::BadHost(authority.to_owned()));
    }
    Ok(SocketAddr::new(ip, port))
}

/// Formats a target as an HBONE `:authority` (`ip:port`, `[v6]:port`).
pub fn format_authority(addr: SocketAddr) -> String {
    let mut out = String::with_capacity(MAX_V4_SOCKET_ADDR_LEN);
    push_socket_addr(&mut out, addr);
    out
}

/// Length of the longest IPv4 `ip:port` text (`255.255.255.255:65535`).
const MAX_V4_SOCKET_ADDR_LEN: usize = 21;

/// Appends `addr` as `SocketAddr`'s `Display` writes it (`ip:port`, `[v6]:port`). IPv4, the
/// common case, is written with `itoa`: `Display` goes through `fmt::write` once per octet, and
/// every CONNECT formats two addresses.
fn push_socket_addr(out: &mut String, addr: SocketAddr) {
    match addr {
        SocketAddr::V4(v4) => {
            for (i, octet) in v4.ip().octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                out.push_str(itoa::Buffer::new().format(octet));
            }
            out.push(':');
            out.push_str(itoa::Buffer::new().format(v4.port()));
        }
        SocketAddr::V6(v6) => {
            use std::fmt::Write;
            // Writing to a String cannot fail.
            let _ = write!(out, "{v6}");
        }
    }
}

/// Appends the low `digits` hex digits of `v`, lowercase, zero-padded.
fn push_hex(out: &mut String, v: u128, digits: u32) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        let nibble = (v >> (4 * i)) & 0xf;
        out.push(char::from(HEX[nibble as usize]));
    }
}

/// `forwarded` header value for a client address: `for="<ip:port>"` (RFC 7239 quoting, as
/// ztunnel), plus `;host=<service hostname>` when the connection was addressed to a service.
pub fn forwarded(client: SocketAddr, service_host: Option<&str>) -> String {
    // RFC 7239 §4: a value is a token or a quoted-string; control characters cannot be sent at
    // all, so such a host is left out rather than failing the request.
    let is_token = |h: &str| {
        h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    let mut out = String::with_capacity(MAX_V4_SOCKET_ADDR_LEN + 8);
    out.push_str("for=\"");
    push_socket_addr(&mut out, client);
    out.push('"');
    match service_host {
        Some(host) if !host.is_empty() && is_token(host) => {
            out.push_str(";host=");
            out.push_str(host);
        }
        Some(host) if !host.is_empty() && !host.bytes().any(|b| b.is_ascii_control()) => {
            out.push_str(";host=\"");
            for c in host.chars() {
                if c == '\\' || c == '"' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
        }
        _ => {}
    }
    out
}

/// The HBONE CONNECT request for `target` from the app's `client` address, with ztunnel's headers:
/// `:authority` [`format_authority`], `forwarded` ([`forwarded`], with `service_host` when the
/// connection was addressed to a service) and a fresh `traceparent` ([`traceparent`]). The two
/// headers are sent as HPACK literals never indexed ([`per_request`]).
///
/// # Errors
/// A header value the request cannot hold (none that these functions make).
pub fn connect_request(
    target: SocketAddr,
    client: SocketAddr,
    service_host: Option<&str>,
) -> Result<http::Request<()>, http::Error> {
    http::Request::builder()
        .method(http::Method::CONNECT)
        .uri(format_authority(target))
        .header("forwarded", per_request(forwarded(client, service_host))?)
        .header("traceparent", per_request(traceparent())?)
        .body(())
}

/// `value` as a header value that HPACK sends as a literal never indexed (RFC 7541 §6.2.3), for
/// values unique to one request (`forwarded` carries the client's port, `traceparent` random ids):
/// indexing them would only fill both ends' dynamic tables with entries never used again, each
/// insertion evicting a reusable one and lengthening the encoder's search of that header name.
///
/// # Errors
/// A character a header value cannot hold (RFC 9110 §5.5).
fn per_request(value: String) -> Result<http::HeaderValue, http::header::InvalidHeaderValue> {
    let mut v = http::HeaderValue::try_from(value)?;
    v.set_sensitive(true);
    Ok(v)
}

/// A random W3C `traceparent` value: `00-<32 hex trace id>-<16 hex parent id>-00`, both ids
/// non-zero (W3C Trace Context §3.2). The ids only need to be unique, not secret: they come from a
/// per-thread non-cryptographic generator (no syscall per connection).
pub fn traceparent() -> String {
    let mut out = String::with_capacity(55);
    out.push_str("00-");
    push_hex(&mut out, fastrand::u128(1..), 32);
    out.push('-');
    push_hex(&mut out, u128::from(fastrand::u64(1..)), 16);
    out.push_str("-00");
    out
}

/// The client-side HTTP/2 settings of HBONE.
pub fn client_builder() -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(FRAME_SIZE)
        .max_send_buffer_size(SEND_BUFFER)
        .initial_max_send_streams(MAX_STREAMS_PER_CONNECTION)
        .max_header_list_size(16 * 1024)
        .enable_push(false);
    b
}

/// The server-side HTTP/2 settings of HBONE.
pub fn server_builder() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(FRAME_SIZE)
        .max_send_buffer_size(SERVER_SEND_BUFFER)
        .max_concurrent_streams(SERVER_MAX_STREAMS)
        .max_header_list_size(64 * 1024);
    b
}

/// HTTP/2 keepalive of one HBONE connection, client or server: a PING every [`PING_INTERVAL`];
/// returns when a PONG does not arrive within [`PING_TIMEOUT`] (ztunnel `do_ping_pong`). Never
/// returns when `ping` is `None` (already taken).
pub async fn keepalive(ping: Option<h2::PingPong>) {
    let Some(mut ping) = ping else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(PING_INTERVAL).await;
        match tokio::time::timeout(PING_TIMEOUT, ping.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v4_and_v6_authorities() {
        assert_eq!(
            parse_authority("10.0.0.2:8080"),
            Ok("10.0.0.2:8080".parse().expect("addr"))
        );
        assert_eq!(
            parse_authority("[fd00::2]:80"),
            Ok("[fd00::2]:80".parse().expect("addr"))
        );
        assert_eq!(
            format_authority("[fd00::2]:80".parse().expect("addr")),
            "[fd00::2]:80"
        );
    }

    #[test]
    fn rejects_bad_authorities() {
        assert!(matches!(
            parse_authority("10.0.0.2"),
            Err(AuthorityError::MissingPort(_))
        ));
        assert!(matches!(
            parse_authority("fd00::2"),
            Err(AuthorityError::MissingPort(_))
        ));
        assert!(matches!(
            parse_authority("10.0.0.2:"),
            Err(AuthorityError::BadPort(_))
        ));
        assert!(matches!(
            parse_authority("10.0.0.2:0"),
            Err(AuthorityError::BadPort(_))
        ));
        assert!(matches!(
            parse_authority("10.0.0.2:99999"),
            Err(AuthorityError::BadPort(_))
        ));
        assert!(matches!(
            parse_authority("example.com:80"),
            Err(AuthorityError::BadHost(_))
        ));
        assert!(matches!(
            parse_authority("garbage"),
            Err(AuthorityError::MissingPort(_))
        ));
        assert!(matches!(
            parse_authority("[10.0.0.2:80"),
            Err(AuthorityError::BadHost(_))
        ));
        assert!(matches!(
            parse_authority(""),
            Err(AuthorityError::MissingPort(_))
        ));
    }

    #[test]
    fn addresses_and_numbers_are_written_as_std_writes_them() {
        for addr in [
            "0.0.0.0:0",
            "10.0.0.2:8080",
            "255.255.255.255:65535",
            "1.20.100.9:10",
            "[fd00::2]:80",
            "[::ffff:10.0.0.1]:15008",
        ] {
            let addr: SocketAddr = addr.parse().expect("addr");
            assert_eq!(format_authority(addr), addr.to_string());
            assert_eq!(forwarded(addr, None), format!("for=\"{addr}\""));
        }
        for v in [0u128, 1, 0xab, u128::MAX, 0x0123_4567_89ab_cdef] {
            let mut out = String::new();
            push_hex(&mut out, v, 32);
            assert_eq!(out, format!("{v:032x}"));
            let mut low = String::new();
            push_hex(&mut low, v, 16);
            assert_eq!(low, format!("{:016x}", v as u64));
        }
    }

    #[test]
    fn traceparent_has_w3c_shape() {
        let t = traceparent();
        let parts: Vec<_> = t.split('-').collect();
        assert_eq!(parts.len(), 4, "{t}");
        assert_eq!(
            (parts[0], parts[1].len(), parts[2].len(), parts[3]),
            ("00", 32, 16, "00")
        );
        assert_ne!(traceparent(), t);
        assert!(
            parts[1..3].iter().all(|p| p
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
                && p.bytes().any(|b| b != b'0')),
            "{t}"
        );
    }

    #[test]
    fn forwarded_quotes_the_client_and_names_the_service() {
        assert_eq!(
            forwarded("[fd00::1]:4000".parse().expect("addr"), None),
            "for=\"[fd00::1]:4000\""
        );
        let client = "10.0.0.2:4000".parse().expect("addr");
        assert_eq!(
            forwarded(client, Some("svc.example")),
            "for=\"10.0.0.2:4000\";host=svc.example"
        );
        // not a token: quoted, so it cannot add parameters
        assert_eq!(
            forwarded(client, Some("a;for=1.2.3.4")),
            "for=\"10.0.0.2:4000\";host=\"a;for=1.2.3.4\""
        );
        assert_eq!(
            forwarded(client, Some("a\"b\\c")),
            "for=\"10.0.0.2:4000\";host=\"a\\\"b\\\\c\""
        );
        // control characters: left out
        assert_eq!(forwarded(client, Some("a\nb")), "for=\"10.0.0.2:4000\"");
        // whatever it names, the value is a valid header value
        for host in ["svc.example", "a;for=1.2.3.4", "a\"b", "a\nb"] {
            assert!(
                http::HeaderValue::from_str(&forwarded(client, Some(host))).is_ok(),
                "{host:?}"
            );
        }
    }

    /// The header blocks of the first `n` HEADERS frames a client wrote into `wire` (after the
    /// 24-byte preface; frame layout RFC 9113 §4.1).
    async fn header_blocks(wire: &mut tokio::io::DuplexStream, n: usize) -> Vec<Vec<u8>> {
        use tokio::io::AsyncReadExt;
        let mut preface = [0u8; 24];
        wire.read_exact(&mut preface).await.expect("preface");
        let mut blocks = Vec::new();
        while blocks.len() < n {
            let mut head = [0u8; 9];
            wire.read_exact(&mut head).await.expect("frame head");
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            wire.read_exact(&mut payload).await.expect("frame payload");
            if head[3] == 0x1 {
                blocks.push(payload);
            }
        }
        blocks
    }

    #[test]
    fn connect_request_carries_ztunnels_headers_never_indexed() {
        let target = "10.0.0.3:8080".parse().expect("addr");
        let client = "10.0.0.2:4000".parse().expect("addr");
        let req = connect_request(target, client, Some("svc.example")).expect("request");
        assert_eq!(req.method(), http::Method::CONNECT);
        assert_eq!(req.uri().to_string(), "10.0.0.3:8080");
        let forwarded = &req.headers()["forwarded"];
        assert_eq!(forwarded, "for=\"10.0.0.2:4000\";host=svc.example");
        assert!(forwarded.is_sensitive());
        let traceparent = &req.headers()["traceparent"];
        assert_eq!(traceparent.len(), 55, "{traceparent:?}");
        assert!(traceparent.is_sensitive());
    }

    #[tokio::test]
    async fn per_request_values_are_never_indexed() {
        let (io, mut wire) = tokio::io::duplex(1 << 16);
        let (mut send, conn) = client_builder()
            .handshake::<_, bytes::Bytes>(io)
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let value = "v".repeat(64);
        for indexed in [false, true] {
            for _ in 0..2 {
                let v = if indexed {
                    http::HeaderValue::from_str(&value).expect("value")
                } else {
                    per_request(value.clone()).expect("value")
                };
                let name = if indexed { "x-indexed" } else { "traceparent" };
                let req = http::Request::builder()
                    .method(http::Method::CONNECT)
                    .uri("10.0.0.3:80")
                    .header(name, v)
                    .body(())
                    .expect("request");
                send = send.ready().await.expect("ready");
                let _ = send.send_request(req, false).expect("send");
            }
        }
        let blocks = header_blocks(&mut wire, 4).await;
        // Never indexed: after the indexed method and authority (one byte each), the second
        // request's field is again a literal never indexed with a new name (RFC 7541 §6.2.3:
        // first byte 0001 0000), carrying the whole value (Huffman, 7 bits per `v`)...
        assert_eq!(blocks[1][2], 0x10, "{blocks:?}");
        assert!(blocks[1].len() > 40, "{blocks:?}");
        // ...where an indexed value is sent once and then named by its table index (the control
        // shows the test can tell the two apart; h2 indexes the method and authority too).
        assert!(blocks[3].len() < 10, "{blocks:?}");
    }
}
