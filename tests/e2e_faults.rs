//! End to end faults of `ztnode node` in a lab node (issue "faults that lose nothing"): the node
//! killed with SIGKILL in the middle of ADDs, its pod table torn, its run dir full. In each, no pod
//! is in the table without its rules, a pod the table lost keeps its rules (its traffic fails
//! closed), the errors name the cause, nothing crosses the bridge in plaintext, and what a restart
//! or the runtime's retried ADD can rebuild is rebuilt.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::capture::BridgeCapture;
use common::node::{MeshNode, NodeProcess, echo_once};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use ztnode::lab::{Lab, LabOptions, MeshLab, MeshSpec, MeshStage, Pod};
use ztnode::netns::Netns;

/// SIGKILL: no cleanup at all. Waits until the process is dead and leaves the reaping to its guard.
fn sigkill(process: &NodeProcess) {
    let pid = Pid::from_raw(process.0.id() as i32);
    kill(pid, Signal::SIGKILL).expect("SIGKILL");
    waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT).expect("wait for death");
}

/// Starts `ztnode node` in `lab`'s node netns with `config` and `run_dir`, logging to `log`, and
/// waits until it restored its pod table.
fn start_node(lab: &Lab, config: &Path, run_dir: &Path, log: &Path) -> NodeProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ztnode"));
    cmd.arg("node")
        .arg("--config")
        .arg(config)
        .arg("--run-dir")
        .arg(run_dir)
        .arg("--no-install")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"));
    let node = NodeProcess(lab.spawn_in_node(cmd).expect("spawn ztnode node"));
    MeshNode::wait_log_in(log, &["pod table restored"], Duration::from_secs(20));
    node
}

/// One echo round trip `from` -> `to`:`port` through the mesh.
fn round_trip(from: &Pod, to: &Pod, port: u16, msg: &[u8]) -> Result<Vec<u8>, String> {
    let to_ns = Netns::open(&to.netns_path).expect("server netns");
    let from_ns = Netns::open(&from.netns_path).expect("client netns");
    let addr = SocketAddr::new(to.ip, port);
    let echo = echo_once(&to_ns, addr);
    let run = || -> Result<Vec<u8>, String> {
        let mut c = Lab::connect_from(&from_ns, addr).map_err(|e| e.to_string())?;
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        c.write_all(msg).map_err(|e| e.to_string())?;
        c.shutdown(std::net::Shutdown::Write)
            .map_err(|e| e.to_string())?;
        let mut back = Vec::new();
        c.read_to_end(&mut back).map_err(|e| e.to_string())?;
        Ok(back)
    };
    let res = run();
    if res.is_err() {
        // nobody connected: unblock the echo thread's accept
        let _ = Lab::connect_from(&to_ns, addr);
    }
    let (got, _) = echo.join().expect("echo thread");
    if let Ok(back) = &res {
        assert_eq!(back, msg, "echo");
        assert_eq!(got, msg, "the app got what was sent");
    }
    res
}

/// Retries [`round_trip`] on fresh ports for up to 10 s (a restarted node is serving its pods).
fn round_trip_soon(from: &Pod, to: &Pod, first_port: u16, msg: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut port = first_port;
    loop {
        match round_trip(from, to, port, msg) {
            Ok(_) => return,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "no traffic {} -> {}: {e}",
                    from.name,
                    to.name
                );
                port += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// A connection from `from` to `to`:`port` while nobody serves `from` or `to`: it must fail
/// (connect refused or reset, or no answer), never reach the app.
fn fails_closed(from: &Pod, to: &Pod, port: u16, secret: &[u8]) {
    let from_ns = Netns::open(&from.netns_path).expect("netns");
    let to_ns = Netns::open(&to.netns_path).expect("netns");
    let addr = SocketAddr::new(to.ip, port);
    let app = Lab::listen_in(&to_ns, addr).expect("listen");
    app.set_nonblocking(true).expect("nonblocking");
    if let Ok(mut c) = Lab::connect_from(&from_ns, addr) {
        let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = c.write_all(secret);
        let mut buf = [0u8; 64];
        let got = c.read(&mut buf).unwrap_or(0);
        assert_eq!(got, 0, "{} -> {}: an answer came back", from.name, to.name);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        app.accept().is_err(),
        "{} -> {}:{port} reached the app with nobody serving the pods",
        from.name,
        to.name
    );
}

/// Whether the in-pod redirection tables are in `pod`'s netns.
fn has_rules(netns_name: &str) -> bool {
    let out = Lab::exec_in(netns_name, "nft")
        .args(["list", "tables"])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).contains("istio-ambient-nat")
}

/// Whether the proxy listens on HBONE (15008) inside `pod`'s netns (it serves the pod).
fn served(netns_name: &str) -> bool {
    let out = Lab::exec_in(netns_name, "ss")
        .args(["-ltnH", "sport", "=", ":15008"])
        .output()
        .expect("ss");
    !String::from_utf8_lossy(&out.stdout).trim().is_empty()
}

/// Uids and netns paths in `<run_dir>/pods.json`, which must parse as a whole.
fn table(run_dir: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(run_dir.join("pods.json")).expect("read pods.json");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("pods.json parses");
    doc["pods"]
        .as_array()
        .expect("pods list")
        .iter()
        .map(|p| {
            (
                p["uid"].as_str().unwrap_or_default().to_owned(),
                p["netns"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// The netns name of a `/var/run/netns/<name>` path.
fn netns_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Every pod in the table has its rules in place.
#[track_caller]
fn every_tabled_pod_has_rules(run_dir: &Path) {
    for (uid, netns) in table(run_dir) {
        assert!(
            has_rules(netns_name(&netns)),
            "pod {uid} is in the table without its rules"
        );
    }
}

const PODS: usize = 12;

#[test]
fn a_node_killed_in_the_middle_of_adds_leaves_each_pod_enrolled_or_failed_and_retried() {
    if !common::privileged(
        "a_node_killed_in_the_middle_of_adds_leaves_each_pod_enrolled_or_failed_and_retried",
    ) {
        return;
    }
    let prefix = common::prefix("fkl");
    let run_dir = std::env::temp_dir().join(format!("ztnode-e2e-run-{prefix}"));
    let _ = std::fs::remove_dir_all(&run_dir);
    let _run_dir = common::RemoveOnDrop(run_dir.clone());
    let ip = |n: u8| -> IpAddr { format!("10.246.0.{n}").parse().expect("ip") };
    let names: Vec<String> = (0..PODS).map(|i| format!("p{i}")).collect();
    // The churned pods' config addresses are outside what host-local hands out here: they are
    // enrolled by name and checked by their listeners and rules, not by traffic.
    let mut workloads = vec![
        ("client", "default", "alice", ip(2)),
        ("server", "default", "bob", ip(3)),
    ];
    for (i, n) in names.iter().enumerate() {
        workloads.push((n.as_str(), "default", "carol", ip(200 + i as u8)));
    }
    let mesh = MeshLab::start(MeshSpec {
        lab: LabOptions {
            prefix: prefix.clone(),
            ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
            run_dir: run_dir.clone(),
            subnet: "10.246.0.0/24".into(),
            cni_version: "1.0.0".into(),
        },
        exe: env!("CARGO_BIN_EXE_ztnode").as_ref(),
        workloads: &workloads,
        extra_config: "",
        log_level: "info",
        node_args: &["--no-install".into()],
        node_env: &[],
        pods: [("client", "default"), ("server", "default")],
    })
    .expect("lab node with client and server");
    let [client, server] = mesh.pods.clone();
    assert_eq!((client.ip, server.ip), (ip(2), ip(3)), "host-local order");
    let lab = &mesh.lab;
    let log = mesh.log.clone();
    let capture = BridgeCapture::start(lab, "killed-mid-add");
    round_trip(&client, &server, 8080, b"before the kill").expect("traffic before");

    // ADDs in flight; the node dies once a third of them are enrolled
    const ENROLLED: &str = "pod enrolled, proxy serving it";
    let before = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches(ENROLLED)
        .count();
    let results: Vec<(String, Result<Pod, String>)> = std::thread::scope(|s| {
        let adds: Vec<_> = names
            .iter()
            .map(|n| {
                s.spawn(move || {
                    (
                        n.clone(),
                        lab.add_pod(n, "default").map_err(|e| e.to_string()),
                    )
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.matches(ENROLLED).count() >= before + PODS / 3 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the ADDs did not get through:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        sigkill(&mesh.node);
        adds.into_iter()
            .map(|h| h.join().expect("add thread"))
            .collect()
    });
    let (ok, failed): (Vec<_>, Vec<_>) = results.into_iter().partition(|(_, r)| r.is_ok());
    eprintln!(
        "ADDs: {} succeeded, {} failed when the node died",
        ok.len(),
        failed.len()
    );
    assert!(
        !failed.is_empty(),
        "the kill came after every ADD: nothing was in flight"
    );
    assert!(!ok.is_empty(), "the kill came before any ADD was answered");
    for (name, err) in &failed {
        let err = err.as_ref().err().map(String::as_str).unwrap_or_default();
        assert!(
            err.contains("node agent"),
            "{name}: the error must name the node agent: {err}"
        );
    }

    // what the dead node left: every pod in its table has its rules (or its sandbox is gone)
    for (uid, netns) in table(&run_dir) {
        assert!(
            !Path::new(&netns).exists() || has_rules(netns_name(&netns)),
            "pod {uid} is in the killed node's table without its rules"
        );
    }
    // while it is down: enrolled pods' traffic fails closed
    fails_closed(&client, &server, 8081, b"secret while the node is dead");

    let log2 = lab.dir().join("node-restarted.log");
    let restarted = start_node(lab, &mesh.config, &run_dir, &log2);
    // every pod whose ADD succeeded is back with rules and served; no pod is tabled without rules
    let tabled: Vec<String> = table(&run_dir).into_iter().map(|(uid, _)| uid).collect();
    for (name, pod) in &ok {
        let pod = pod.as_ref().expect("ok");
        assert!(
            tabled.contains(&pod.uid),
            "{name} succeeded but is not in the table"
        );
        assert!(has_rules(&pod.netns_name), "{name} lost its rules");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !served(&pod.netns_name) {
            assert!(
                Instant::now() < deadline,
                "{name} is not served after the restart"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    every_tabled_pod_has_rules(&run_dir);
    round_trip_soon(&client, &server, 8090, b"after the restart");

    // the runtime retries the failed ADDs (their sandboxes were torn down): they enroll
    for (name, _) in &failed {
        let pod = lab.add_pod(name, "default").expect("retried ADD");
        assert!(
            has_rules(&pod.netns_name) && served(&pod.netns_name),
            "{name}"
        );
    }
    assert_eq!(table(&run_dir).len(), 2 + PODS, "every pod tabled once");
    every_tabled_pod_has_rules(&run_dir);
    drop(restarted);
    capture.check(
        &[client.ip, server.ip],
        &[
            b"secret while the node is dead",
            b"before the kill",
            b"after the restart",
        ],
    );
}

#[test]
fn a_torn_pod_table_restores_its_complete_records_and_the_lost_pod_fails_closed() {
    if !common::privileged(
        "a_torn_pod_table_restores_its_complete_records_and_the_lost_pod_fails_closed",
    ) {
        return;
    }
    let mut node = MeshNode::start(&common::prefix("ftr"));
    let capture = BridgeCapture::start(&node.lab, "torn");
    round_trip(&node.client, &node.server, 8080, b"before the tear").expect("traffic before");
    sigkill(&node.process);

    // the table cut in the middle of its second record (a copy cut short)
    let path = node.run_dir.join("pods.json");
    let whole = std::fs::read_to_string(&path).expect("read pods.json");
    let second = whole
        .match_indices("\"uid\"")
        .nth(1)
        .expect("two records")
        .0;
    let torn = &whole[..second + 20];
    std::fs::write(&path, torn).expect("tear the table");
    let (kept, lost) = if whole[second..].contains(&node.server.uid) {
        (node.client.clone(), node.server.clone())
    } else {
        (node.server.clone(), node.client.clone())
    };

    let log = node.lab.dir().join("node-restarted.log");
    node.process = start_node(
        &node.lab,
        &node.lab.dir().join("local-config.yaml"),
        &node.run_dir,
        &log,
    );
    node.log = log;
    let line = node.wait_log(&["the pod table is torn"], Duration::from_secs(5));
    assert!(
        line.contains("recovered=1") && line.contains("pods.json.torn"),
        "{line}"
    );
    assert_eq!(
        std::fs::read_to_string(node.run_dir.join("pods.json.torn")).expect("kept aside"),
        torn,
        "the torn file is kept as it was"
    );
    let restored = node.wait_log(&["pod table restored"], Duration::from_secs(5));
    assert!(restored.contains("restored=1"), "{restored}");
    assert_eq!(
        table(&node.run_dir)
            .into_iter()
            .map(|(uid, _)| uid)
            .collect::<Vec<_>>(),
        std::slice::from_ref(&kept.uid),
        "the table is whole again, with the complete record"
    );
    every_tabled_pod_has_rules(&node.run_dir);
    assert!(served(&kept.netns_name), "{} is served again", kept.name);
    // the lost pod keeps its rules, nobody serves it: its traffic fails closed both ways
    assert!(has_rules(&lost.netns_name) && !served(&lost.netns_name));
    fails_closed(&lost, &kept, 8081, b"secret from the lost pod");
    fails_closed(&kept, &lost, 8082, b"secret to the lost pod");

    // the runtime recreates the lost pod's sandbox (DEL, then ADD in a new netns): enrolled
    // again, and traffic flows over HBONE both ways once the config names its new address
    node.lab.del_pod(&lost).expect("DEL of the lost sandbox");
    let again = node
        .lab
        .add_pod(&lost.name, &lost.namespace)
        .expect("ADD again");
    let (client, server) = if again.name == "client" {
        (again.clone(), kept.clone())
    } else {
        (kept.clone(), again.clone())
    };
    std::fs::write(
        node.lab.dir().join("local-config.yaml"),
        ztnode::lab::local_config(
            node.lab.node_name(),
            &[
                ("client", "default", "alice", client.ip),
                ("server", "default", "bob", server.ip),
            ],
        ),
    )
    .expect("config with the new address");
    node.wait_log(&["local config reloaded"], Duration::from_secs(5));
    round_trip_soon(&client, &server, 8090, b"after the new sandbox");
    round_trip_soon(&server, &client, 8100, b"after the new sandbox, back");
    assert_eq!(table(&node.run_dir).len(), 2);
    every_tabled_pod_has_rules(&node.run_dir);
    capture.check(
        &[node.client.ip, node.server.ip, again.ip],
        &[
            b"secret from the lost pod",
            b"secret to the lost pod",
            b"after the new sandbox",
        ],
    );
}

/// Unmounts a tmpfs when dropped (lazily, so a process still holding a file in it does not keep
/// it mounted).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system of `dir` with `<dir>/filler` until it has no space left.
fn fill(dir: &Path) -> PathBuf {
    let filler = dir.join("filler");
    let mut f = std::fs::File::create(&filler).expect("filler");
    let block = vec![0u8; 64 * 1024];
    loop {
        match f.write(&block) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
    filler
}

#[test]
fn a_full_run_dir_fails_the_add_clearly_and_loses_nothing() {
    if !common::privileged("a_full_run_dir_fails_the_add_clearly_and_loses_nothing") {
        return;
    }
    let prefix = common::prefix("ffl");
    let run_dir = std::env::temp_dir().join(format!("ztnode-e2e-run-{prefix}"));
    let _ = Command::new("umount")
        .arg("-l")
        .arg(&run_dir)
        .stderr(Stdio::null())
        .status();
    let _ = std::fs::remove_dir_all(&run_dir);
    let _run_dir = common::RemoveOnDrop(run_dir.clone());
    let mut unmount = None;
    let ip = |n: u8| -> IpAddr { format!("10.245.0.{n}").parse().expect("ip") };
    let mut mesh = MeshLab::start_observed(
        MeshSpec {
            lab: LabOptions {
                prefix: prefix.clone(),
                ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
                run_dir: run_dir.clone(),
                subnet: "10.245.0.0/24".into(),
                cni_version: "1.0.0".into(),
            },
            exe: env!("CARGO_BIN_EXE_ztnode").as_ref(),
            workloads: &[
                ("client", "default", "alice", ip(2)),
                ("server", "default", "bob", ip(3)),
                ("late", "default", "carol", ip(4)),
            ],
            extra_config: "",
            log_level: "info",
            node_args: &["--no-install".into()],
            node_env: &[],
            pods: [("client", "default"), ("server", "default")],
        },
        |stage| {
            if let MeshStage::LabBuilt(_) = stage {
                // the run dir on a small file system of its own
                std::fs::create_dir_all(&run_dir).expect("run dir");
                let ok = Command::new("mount")
                    .args(["-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs"])
                    .arg(&run_dir)
                    .status()
                    .expect("mount")
                    .success();
                assert!(ok, "mount a tmpfs on {}", run_dir.display());
                unmount = Some(Unmount(run_dir.clone()));
            }
            Ok::<(), ztnode::lab::LabError>(())
        },
    )
    .expect("lab node with client and server");
    let [client, server] = mesh.pods.clone();
    let capture = BridgeCapture::start(&mesh.lab, "full");
    round_trip(&client, &server, 8080, b"before the disk is full").expect("traffic before");
    let before = std::fs::read(run_dir.join("pods.json")).expect("table");

    // full: an ADD cannot be recorded, so it fails, naming the cause; the table is intact
    let filler = fill(&run_dir);
    let err = mesh
        .lab
        .add_pod("late", "default")
        .expect_err("ADD on a full run dir");
    let err = err.to_string();
    assert!(
        err.contains("pod table") && err.contains("No space left on device"),
        "the error must name the table and the cause: {err}"
    );
    assert_eq!(
        std::fs::read(run_dir.join("pods.json")).expect("table"),
        before,
        "table intact"
    );
    assert!(
        !run_dir.join("pods.json.tmp").exists(),
        "no partial temp file left"
    );
    every_tabled_pod_has_rules(&run_dir);
    round_trip(&client, &server, 8081, b"while the disk is full")
        .expect("enrolled pods keep working");

    // a restart while still full brings both pods back from the intact table
    sigkill(&mesh.node);
    let log2 = mesh.lab.dir().join("node-restarted.log");
    mesh.node = start_node(&mesh.lab, &mesh.config, &run_dir, &log2);
    let restored = MeshNode::wait_log_in(&log2, &["pod table restored"], Duration::from_secs(5));
    assert!(restored.contains("restored=2"), "{restored}");
    MeshNode::wait_log_in(
        &log2,
        &["persisting the pod table failed", "No space left"],
        Duration::from_secs(5),
    );
    round_trip_soon(&client, &server, 8090, b"after the restart while full");

    // space again: the runtime's retried ADD is recorded
    std::fs::remove_file(&filler).expect("free the space");
    let late = mesh.lab.add_pod("late", "default").expect("retried ADD");
    assert!(has_rules(&late.netns_name) && served(&late.netns_name));
    let uids: Vec<String> = table(&run_dir).into_iter().map(|(u, _)| u).collect();
    for pod in [&client, &server, &late] {
        assert!(
            uids.contains(&pod.uid),
            "{} in the table: {uids:?}",
            pod.name
        );
    }
    capture.check(
        &[client.ip, server.ip],
        &[
            b"before the disk is full",
            b"while the disk is full",
            b"after the restart while full",
        ],
    );
}
