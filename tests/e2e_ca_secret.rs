//! End to end, standalone: two lab nodes (linked netns, a pod on each) running `ztnode node` with
//! the built-in CA, as the standalone component deploys it: each node's `--ca-dir` holds the
//! files of the Secret `ztnode ca init --secret-yaml` prints (tests/deploy.rs checks that the
//! component mounts exactly that Secret there). With one root on both nodes, a pod on one node
//! reaches a pod on the other over HBONE; with a root per node (what the DaemonSet did before the
//! Secret) the same connection fails, so the test sees the difference the Secret makes.

mod common;

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::node::echo_once;
use k8s_openapi::api::core::v1::Secret;
use ztnode::lab::{Lab, LabOptions, Pod, ProcessGuard, local_config};
use ztnode::netns::Netns;

const EXE: &str = env!("CARGO_BIN_EXE_ztnode");
const SUBNETS: [&str; 2] = ["10.62.1.0/24", "10.62.2.0/24"];
const APP_PORT: u16 = 8080;

fn lab(prefix: &str, subnet: &str, run_dir: &Path) -> Lab {
    Lab::new(LabOptions {
        prefix: prefix.into(),
        ztnode_binary: Some(EXE.into()),
        run_dir: run_dir.to_owned(),
        subnet: subnet.into(),
        cni_version: "1.0.0".into(),
    })
    .expect("lab")
}

/// Writes the Secret's keys as the kubelet mounts a Secret volume (one file per key, 0400).
fn mount_secret(secret: &Secret, dir: &Path) {
    std::fs::create_dir_all(dir).expect("CA dir");
    for (key, value) in secret.data.iter().flatten() {
        let path = dir.join(key);
        std::fs::write(&path, &value.0).expect("write key");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).expect("mode");
    }
}

fn start(lab: &Lab, run_dir: &Path, config: &Path, ca_dir: &Path) -> (ProcessGuard, PathBuf) {
    let args: Vec<OsString> = vec![
        "--no-install".into(),
        "--config".into(),
        config.into(),
        "--ca-dir".into(),
        ca_dir.into(),
    ];
    lab.start_node_with(EXE.as_ref(), run_dir, &args, &[], "info")
        .expect("start ztnode node")
}

/// One echo from `client` to `server`'s app port through both proxies: `Some(reply)` if the bytes
/// came back, `None` if the connection failed.
fn echo(client: &Netns, server: SocketAddr) -> Option<Vec<u8>> {
    let mut c = Lab::connect_from(client, server).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    c.write_all(b"ping").ok()?;
    c.shutdown(std::net::Shutdown::Write).ok()?;
    let mut back = Vec::new();
    c.read_to_end(&mut back).ok()?;
    (!back.is_empty()).then_some(back)
}

/// Tries [`echo`] until it succeeds or `within` passed.
fn echo_within(client: &Netns, server: SocketAddr, within: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(back) = echo(client, server) {
            return Some(back);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn netns(pod: &Pod) -> Netns {
    Netns::open(&pod.netns_path).expect("pod netns")
}

#[test]
fn nodes_sharing_the_ca_secret_reach_each_other() {
    if !common::privileged("nodes_sharing_the_ca_secret_reach_each_other") {
        return;
    }
    let (pa, pb) = (common::prefix("casa"), common::prefix("casb"));
    let dir = std::env::temp_dir().join(format!("ztnode-e2e-ca-secret-{pa}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let _remove = common::RemoveOnDrop(dir.clone());

    let out = Command::new(EXE)
        .args(["ca", "init", "--secret-yaml"])
        .output()
        .expect("ztnode ca init");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secret: Secret = serde_yaml_ng::from_slice(&out.stdout).expect("a Secret");
    let (ca_a, ca_b) = (dir.join("a/etc/ztnode-ca"), dir.join("b/etc/ztnode-ca"));
    mount_secret(&secret, &ca_a);
    mount_secret(&secret, &ca_b);
    // What each node had without the Secret: a root of its own.
    let own_b = dir.join("b/own-ca");
    let out = Command::new(EXE)
        .args(["ca", "init", "--out"])
        .arg(&own_b)
        .output()
        .expect("ztnode ca init --out");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (run_a, run_b) = (dir.join("a/run"), dir.join("b/run"));
    let lab_a = lab(&pa, SUBNETS[0], &run_a);
    let lab_b = lab(&pb, SUBNETS[1], &run_b);
    lab_a.link(&lab_b).expect("link the nodes");
    let (server_ip, client_ip): (IpAddr, IpAddr) = (
        "10.62.1.2".parse().expect("ip"),
        "10.62.2.2".parse().expect("ip"),
    );
    let config = dir.join("local-config.yaml");
    let yaml = local_config(&pa, &[("server", "default", "bob", server_ip)])
        + local_config(&pb, &[("client", "default", "alice", client_ip)])
            .trim_start_matches("workloads:\n");
    std::fs::write(&config, yaml).expect("config");

    let (node_a, log_a) = start(&lab_a, &run_a, &config, &ca_a);
    let (node_b, log_b) = start(&lab_b, &run_b, &config, &own_b);
    let server = lab_a.add_pod("server", "default").expect("server pod");
    let client = lab_b.add_pod("client", "default").expect("client pod");
    assert_eq!(
        (server.ip, client.ip),
        (server_ip, client_ip),
        "host-local order"
    );
    let app = SocketAddr::new(server.ip, APP_PORT);
    let _listener = echo_once(&netns(&server), app);

    assert_eq!(
        echo_within(&netns(&client), app, Duration::from_secs(3)),
        None,
        "a root per node: the server's node must refuse the client's certificate"
    );
    // and it failed for that reason (node B served the client and tried), not for lack of a node
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let failed_on_trust = || {
        std::fs::read_to_string(&log_b)
            .unwrap_or_default()
            .lines()
            .any(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("connection failed")
                    && (l.contains("certificate") || l.contains("issuer") || l.contains("tls"))
            })
    };
    while !failed_on_trust() {
        assert!(
            std::time::Instant::now() < deadline,
            "node B logged no certificate failure:\n{}",
            std::fs::read_to_string(&log_b).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    drop(node_b);
    let (node_b, log_b2) = start(&lab_b, &run_b, &config, &ca_b);
    let back = echo_within(&netns(&client), app, Duration::from_secs(15));
    let logs = || {
        format!(
            "node A:\n{}\nnode B:\n{}\nnode B before:\n{}",
            std::fs::read_to_string(&log_a).unwrap_or_default(),
            std::fs::read_to_string(&log_b2).unwrap_or_default(),
            std::fs::read_to_string(&log_b).unwrap_or_default()
        )
    };
    assert_eq!(back.as_deref(), Some(&b"ping"[..]), "one root: {}", logs());
    let log = std::fs::read_to_string(&log_a).unwrap_or_default();
    assert!(
        log.contains("spiffe://cluster.local/ns/default/sa/alice"),
        "node A's access log lacks the client's identity: {}",
        logs()
    );
    drop(node_b);
    drop(node_a);
}
