//! End to end with Istio's control plane: two lab nodes (two node netns joined by a link, pods
//! through the real CNI chain on each), one `ztnode node` per node, both fed by one fake istiod
//! (delta xDS + CA) and sharing no CA dir. Pods on different nodes talk over HBONE with
//! certificates from istiod's CA.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::istiod::TwoNodes;
use common::node::echo_once;
use ztnode::lab::Lab;
use ztnode::netns::Netns;

const ALICE: &str = "spiffe://cluster.local/ns/default/sa/alice";
const BOB: &str = "spiffe://cluster.local/ns/default/sa/bob";

/// Sends `msg` from `from` to `to` and returns the echo (the server side echoes one connection).
fn round_trip(from: &Netns, to_ns: &Netns, to: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let echo = echo_once(to_ns, to);
    let mut c = Lab::connect_from(from, to).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    c.write_all(msg).expect("write");
    c.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut back = Vec::new();
    c.read_to_end(&mut back).expect("read echo");
    let (got, _) = echo.join().expect("echo thread");
    assert_eq!(got, msg);
    back
}

#[test]
fn pods_on_two_nodes_talk_over_hbone_with_certificates_from_istiods_ca() {
    if !common::privileged("pods_on_two_nodes_talk_over_hbone_with_certificates_from_istiods_ca") {
        return;
    }
    let t = TwoNodes::start("xc", "", &[]);
    let server_ns = Netns::open(&t.server.netns_path).expect("server netns");
    let client_ns = Netns::open(&t.client.netns_path).expect("client netns");
    let app = SocketAddr::new(t.server.ip, 8080);
    let msg = b"across nodes, one root";
    assert_eq!(round_trip(&client_ns, &server_ns, app, msg), msg);

    // both sides logged the connection with both SPIFFE ids
    let out = t.b.wait_log(
        &["connection complete", "direction=\"outbound\""],
        Duration::from_secs(5),
    );
    let inb = t.a.wait_log(
        &["connection complete", "direction=\"inbound\""],
        Duration::from_secs(5),
    );
    for line in [&out, &inb] {
        assert!(line.contains(ALICE) && line.contains(BOB), "{line}");
    }
    // the certificates came from the fake CA, each node impersonating its own pod's identity
    for id in [ALICE, BOB] {
        let req = t
            .istiod
            .wait_event("ca_request", Duration::from_secs(5), |e| {
                e["identity"] == id
            })
            .expect("CSR");
        assert_eq!(req["result"], "OK", "{req}");
        assert_eq!(req["metadata"]["ImpersonatedIdentity"], id, "{req}");
    }
    // every xDS response was ACKed with its nonce
    let responses = t.istiod.events(Some("xds_response")).expect("events");
    assert!(
        responses.len() >= 4,
        "two streams, two types: {responses:?}"
    );
    let requests = t.istiod.events(Some("xds_request")).expect("events");
    for r in &responses {
        assert!(
            requests.iter().any(|q| q["response_nonce"] == r["nonce"]
                && q["kind"] == "ack"
                && q["nonce_matches"] == true),
            "response {r} not ACKed"
        );
    }
}
