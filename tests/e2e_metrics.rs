//! End to end: one connection through a service VIP between two enrolled pods, seen on the node's
//! `:15020/metrics` (Istio's TCP metrics with ztunnel's labels, for both reporters, as strict
//! enough OpenMetrics text; gzip when asked) and in the access log (ztunnel's fields).

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::node::{MeshNode, echo_once};
use ztnode::lab::Lab;
use ztnode::netns::Netns;

/// Service `default/svc` (`svc.example`) at VIP 10.249.0.201:80, backed by the server's 8080.
const SERVICE: &str = "services:
- name: svc
  namespace: default
  hostname: svc.example
  vips: [\"/10.249.0.201\"]
  ports: {80: 8080}
  endpoints:
    cluster1//v1/Pod/default/server: {workloadUid: cluster1//v1/Pod/default/server}
";

const VIP: &str = "10.249.0.201:80";
const MESSAGE: &[u8] = b"through the service, counted on both sides";
const ALICE: &str = "spiffe://cluster.local/ns/default/sa/alice";
const BOB: &str = "spiffe://cluster.local/ns/default/sa/bob";

/// Starts the node with the service, sends [`MESSAGE`] from the client to the VIP and reads the
/// echo; returns once both proxies logged the connection complete (their counters are updated
/// before the log line): `(node, outbound line, inbound line)`.
fn one_connection(tag: &str) -> (MeshNode, String, String) {
    let node = MeshNode::start_with(&common::prefix(tag), SERVICE);
    let server_ns = Netns::open(&node.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let echo = echo_once(&server_ns, SocketAddr::new(node.server.ip, 8080));
    let vip: SocketAddr = VIP.parse().expect("vip");
    let log = || node.log_text();
    let mut c = Lab::connect_from(&client_ns, vip).expect("connect to the VIP");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    c.write_all(MESSAGE)
        .unwrap_or_else(|e| panic!("write: {e}; log:\n{}", log()));
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back)
        .unwrap_or_else(|e| panic!("read echo: {e}; log:\n{}", log()));
    assert_eq!(back, MESSAGE);
    let (got, _) = echo.join().expect("echo thread");
    assert_eq!(got, MESSAGE);
    drop(c);
    let wait = |dir: &str| {
        node.wait_log(
            &["connection complete", &format!("direction=\"{dir}\"")],
            Duration::from_secs(10),
        )
    };
    let (out, inb) = (wait("outbound"), wait("inbound"));
    (node, out, inb)
}

/// One sample line: metric name, labels, value.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'));
    first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
}

/// `{k="v",...}` at the start of `s` (escapes `\\`, `\"`, `\n`): the labels and the rest.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s.strip_prefix('{').ok_or("no {")?;
    if let Some(r) = rest.strip_prefix('}') {
        return Ok((labels, r));
    }
    loop {
        let eq = rest.find('=').ok_or("label without =")?;
        let key = &rest[..eq];
        if !is_name(key, false) {
            return Err(format!("bad label name {key:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("unquoted label value")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().ok_or("unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, '\n') => return Err("newline in label value".into()),
                (_, c) => value.push(c),
            }
        };
        if labels.insert(key.to_owned(), value).is_some() {
            return Err(format!("duplicate label {key}"));
        }
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        rest = rest.strip_prefix(',').ok_or("labels not comma-separated")?;
    }
}

fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse().map_err(|_| format!("bad value {v:?}")),
    }
}

/// Checks `text` against the OpenMetrics text grammar (metadata lines, samples under their
/// family's `# TYPE` with the type's suffixes, `# EOF` once at the end, no blank lines) and
/// returns the samples.
fn parse_openmetrics(text: &str) -> Vec<Sample> {
    const TYPES: [&str; 8] = [
        "counter",
        "gauge",
        "histogram",
        "gaugehistogram",
        "stateset",
        "info",
        "summary",
        "unknown",
    ];
    let body = text
        .strip_suffix("# EOF\n")
        .unwrap_or_else(|| panic!("does not end with # EOF:\n{text}"));
    let mut samples = Vec::new();
    let mut family: Option<(String, String)> = None;
    let mut seen_families = std::collections::BTreeSet::new();
    for (n, line) in body.lines().enumerate() {
        let fail = |why: &str| -> ! { panic!("line {}: {why}: {line:?}\n{text}", n + 1) };
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let kind = parts.next().unwrap_or_default();
            let name = parts
                .next()
                .unwrap_or_else(|| fail("metadata without name"));
            if !is_name(name, true) {
                fail("bad family name");
            }
            let arg = parts.next();
            match kind {
                "TYPE" => {
                    let t = arg.unwrap_or_else(|| fail("TYPE without type"));
                    if !TYPES.contains(&t) {
                        fail("unknown type");
                    }
                    if !seen_families.insert(name.to_owned()) {
                        fail("family declared twice");
                    }
                    family = Some((name.to_owned(), t.to_owned()));
                }
                "HELP" | "UNIT" => {
                    if arg.is_none() {
                        fail("metadata without text");
                    }
                    if kind == "UNIT" && !arg.is_some_and(|u| name.ends_with(&format!("_{u}"))) {
                        fail("family name does not end with its unit");
                    }
                }
                "EOF" => fail("# EOF before the end"),
                _ => fail("unknown metadata"),
            }
            continue;
        }
        if line.is_empty() {
            fail("blank line");
        }
        let name_end = line.find(['{', ' ']).unwrap_or_else(|| fail("no value"));
        let name = &line[..name_end];
        if !is_name(name, true) {
            fail("bad metric name");
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).unwrap_or_else(|e| fail(&e))
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let value = rest
            .strip_prefix(' ')
            .unwrap_or_else(|| fail("no space before value"));
        // no exemplars or timestamps are emitted
        let value = parse_value(value).unwrap_or_else(|e| fail(&e));
        let (fam, t) = family
            .as_ref()
            .unwrap_or_else(|| fail("sample before any # TYPE"));
        let suffixes: &[&str] = match t.as_str() {
            "counter" => &["_total", "_created"],
            "histogram" | "gaugehistogram" => &["_bucket", "_count", "_sum", "_created"],
            "summary" => &["", "_count", "_sum", "_created"],
            "info" => &["_info"],
            _ => &[""],
        };
        if !suffixes.iter().any(|s| name == format!("{fam}{s}")) {
            fail(&format!("sample outside its family {fam} ({t})"));
        }
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    samples
}

/// The one sample of `name` whose labels include `reporter`.
fn series<'a>(samples: &'a [Sample], name: &str, reporter: &str) -> &'a Sample {
    let found: Vec<_> = samples
        .iter()
        .filter(|s| {
            s.name == name && s.labels.get("reporter").map(String::as_str) == Some(reporter)
        })
        .collect();
    assert_eq!(found.len(), 1, "{name} for {reporter}: {found:#?}");
    found[0]
}

fn metrics_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 15020))
}

/// `GET /metrics` with `headers`, raw: the response head (lower-cased) and body bytes.
fn get_raw(node: &MeshNode, headers: &str) -> (String, Vec<u8>) {
    let mut s = Lab::connect_from(node.lab.node(), metrics_addr()).expect("connect to 15020");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\n{headers}Connection: close\r\n\r\n"
    )
    .expect("request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("response");
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of head");
    let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
    (head, raw[end + 4..].to_vec())
}

#[test]
fn a_connection_through_a_vip_is_counted_by_both_reporters_with_istios_labels() {
    if !common::privileged(
        "a_connection_through_a_vip_is_counted_by_both_reporters_with_istios_labels",
    ) {
        return;
    }
    let (node, _, _) = one_connection("e2m");
    let (code, text) =
        ztnode::lab::http::get_text(node.lab.node(), metrics_addr(), "/metrics").expect("metrics");
    assert_eq!(code, 200, "{text}");
    let samples = parse_openmetrics(&text);

    let want: [(&str, &str); 19] = [
        ("source_workload", "client"),
        ("source_canonical_service", "client"),
        ("source_canonical_revision", "latest"),
        ("source_workload_namespace", "default"),
        ("source_principal", ALICE),
        ("source_app", "client"),
        ("source_version", "latest"),
        ("destination_service", "svc.example"),
        ("destination_service_namespace", "default"),
        ("destination_service_name", "svc"),
        ("destination_workload", "server"),
        ("destination_canonical_service", "server"),
        ("destination_workload_namespace", "default"),
        ("destination_principal", BOB),
        ("destination_app", "server"),
        ("destination_version", "latest"),
        ("request_protocol", "tcp"),
        ("response_flags", "-"),
        ("connection_security_policy", "mutual_tls"),
    ];
    for reporter in ["source", "destination"] {
        let opened = series(&samples, "istio_tcp_connections_opened_total", reporter);
        for (k, v) in want {
            assert_eq!(
                opened.labels.get(k).map(String::as_str),
                Some(v),
                "{reporter}: label {k}: {opened:#?}"
            );
        }
        assert_eq!(opened.value, 1.0, "{opened:#?}");
        let same = |name: &str| {
            let s = series(&samples, name, reporter);
            assert_eq!(s.labels, opened.labels, "{name}: the connection's labels");
            s.value
        };
        assert_eq!(same("istio_tcp_connections_closed_total"), 1.0);
        // the flipped convention: both reporters count the request direction as received
        let len = MESSAGE.len() as f64;
        assert_eq!(same("istio_tcp_received_bytes_total"), len);
        assert_eq!(same("istio_tcp_sent_bytes_total"), len);
        assert!(
            !samples
                .iter()
                .any(|s| s.name == "istio_tcp_connections_failed_total"
                    && s.labels.get("reporter").map(String::as_str) == Some(reporter)),
            "{reporter}: nothing failed\n{text}"
        );
        let open = series(&samples, "istio_tcp_sockets_open", reporter);
        assert_eq!(open.value, 0.0, "the connection is closed: {open:#?}");
    }
    let one = |name: &str| -> f64 {
        samples
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .value
    };
    let build = samples
        .iter()
        .find(|s| s.name == "istio_build")
        .unwrap_or_else(|| panic!("no istio_build in\n{text}"));
    assert_eq!(
        build.labels.get("component").map(String::as_str),
        Some("ztunnel")
    );
    assert_eq!(
        build.labels.get("tag").map(String::as_str),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(one("workload_manager_active_proxy_count"), 2.0);
    assert_eq!(one("workload_manager_pending_proxy_count"), 0.0);
    assert_eq!(one("workload_manager_proxies_started_total"), 2.0);
    assert_eq!(one("ztnode_agent_pods_enrolled"), 2.0);
    assert!(one("process_resident_memory_bytes") > 1e6);
    assert!(one("process_open_fds") > 0.0);
    assert!(one("process_threads") >= 1.0);
    // the binary allocates with mimalloc: what it holds is visible
    assert!(one("ztnode_allocator_committed_bytes") > 0.0);
    let plugin_ok = samples
        .iter()
        .find(|s| {
            s.name == "istio_cni_plugin_requests_total"
                && s.labels.get("response_code").map(String::as_str) == Some("200")
        })
        .unwrap_or_else(|| panic!("no plugin requests in\n{text}"));
    assert!(
        plugin_ok.value >= 3.0,
        "three pods were added: {plugin_ok:?}"
    );

    // OpenMetrics when asked for it, gzipped when accepted
    let (head, body) = get_raw(
        &node,
        "Accept: application/openmetrics-text;version=1.0.0\r\nAccept-Encoding: gzip\r\n",
    );
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-encoding: gzip"), "{head}");
    assert!(
        head.contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    let mut unzipped = String::new();
    flate2::read::GzDecoder::new(&body[..])
        .read_to_string(&mut unzipped)
        .expect("gunzip");
    let again = parse_openmetrics(&unzipped);
    series(&again, "istio_tcp_connections_opened_total", "destination");
    let (head, body) = get_raw(&node, "");
    assert!(!head.contains("content-encoding"), "{head}");
    assert!(head.contains("content-type: text/plain"), "{head}");
    parse_openmetrics(std::str::from_utf8(&body).expect("utf8"));
}

/// The `key=value` fields after the message of an access-log line, in order (values unquoted).
fn fields(line: &str, message: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let at = line
        .find(message)
        .unwrap_or_else(|| panic!("no {message:?} in {line}"));
    let mut rest = &line[at + message.len()..];
    while let Some(eq) = rest.find('=') {
        let key_start = rest[..eq].rfind(char::is_whitespace).map_or(0, |i| i + 1);
        let key = rest[key_start..eq].to_owned();
        let after = &rest[eq + 1..];
        let (value, next) = match after.strip_prefix('"') {
            Some(q) => {
                let end = q.find('"').unwrap_or(q.len());
                (q[..end].to_owned(), &q[(end + 1).min(q.len())..])
            }
            None => {
                let end = after.find(' ').unwrap_or(after.len());
                (after[..end].to_owned(), &after[end..])
            }
        };
        out.push((key, value));
        rest = next;
    }
    out
}

#[test]
fn the_access_log_has_ztunnels_fields_for_both_directions() {
    if !common::privileged("the_access_log_has_ztunnels_fields_for_both_directions") {
        return;
    }
    let (node, out, inb) = one_connection("e2l");
    let client = node.client.ip;
    let server = node.server.ip;
    let len = MESSAGE.len().to_string();
    let hbone = format!("{server}:15008");
    let target = format!("{server}:8080");
    for (line, direction) in [(&out, "outbound"), (&inb, "inbound")] {
        let got = fields(line, "connection complete");
        let keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "src.addr",
                "src.workload",
                "src.namespace",
                "src.identity",
                "dst.addr",
                "dst.hbone_addr",
                "dst.service",
                "dst.workload",
                "dst.namespace",
                "dst.identity",
                "direction",
                "bytes_sent",
                "bytes_recv",
                "duration",
            ],
            "{line}"
        );
        let v = |k: &str| {
            got.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_default()
        };
        assert!(v("src.addr").starts_with(&format!("{client}:")), "{line}");
        assert_eq!(v("src.workload"), "client", "{line}");
        assert_eq!(v("src.namespace"), "default", "{line}");
        assert_eq!(v("src.identity"), ALICE, "{line}");
        assert_eq!(v("dst.addr"), hbone, "{line}");
        assert_eq!(v("dst.hbone_addr"), target, "{line}");
        assert_eq!(v("dst.service"), "svc.example", "{line}");
        assert_eq!(v("dst.workload"), "server", "{line}");
        assert_eq!(v("dst.namespace"), "default", "{line}");
        assert_eq!(v("dst.identity"), BOB, "{line}");
        assert_eq!(v("direction"), direction, "{line}");
        assert_eq!(v("bytes_sent"), len, "{line}");
        assert_eq!(v("bytes_recv"), len, "{line}");
        let ms = v("duration")
            .strip_suffix("ms")
            .unwrap_or_else(|| panic!("duration in ms: {line}"));
        assert!(ms.parse::<u64>().is_ok(), "{line}");
        // ztunnel's plain line: time, level, scope, message, fields, tab-separated
        assert!(
            line.contains("\tinfo\taccess\tconnection complete\t"),
            "{line}"
        );
    }
    // a second connection finds no app listening (the echo served one): logged failed, with its
    // error and the same fields
    let client_ns = Netns::open(&node.client.netns_path).expect("client netns");
    let _ = common::connect_unless_reset(&client_ns, VIP.parse().expect("vip"), "second connect");
    let failed = node.wait_log(
        &["connection failed", "direction=\"inbound\"", "error="],
        Duration::from_secs(10),
    );
    assert!(
        failed.contains(&format!("dst.hbone_addr={target}")),
        "{failed}"
    );
    assert!(failed.contains(&format!("dst.addr={hbone}")), "{failed}");
    assert!(
        failed.contains(&format!("src.identity=\"{ALICE}\"")),
        "{failed}"
    );
}
