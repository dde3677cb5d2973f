//! `ztnode demo`: a throwaway node on this machine, two pods, and proof that their traffic went
//! through HBONE.
//!
//! Steps (each printed): build a node netns with the real CNI chain (reference `bridge` +
//! `host-local`, then `ztnode-cni`), start `ztnode node` inside it, add pods `client` and `server`
//! (enrolled by the plugin → agent → redirection → proxy), start an echo server in `server`, connect
//! from `client`, and check: the app saw the client's real IP, both SPIFFE IDs appear in the access
//! log, and a capture on the bridge holds only TLS on port 15008 between the pods with no payload
//! bytes in clear. Everything is removed at the end, on failure and on Ctrl-C.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::node::{Lab, LabOptions, ProcessGuard, local_config};
use crate::netns::Netns;

const PREFIX: &str = "ztdemo";
const SUBNET: &str = "10.248.0.0/24";
const CLIENT_IP: &str = "10.248.0.2";
const SERVER_IP: &str = "10.248.0.3";
const APP_PORT: u16 = 8080;
const MESSAGE: &[u8] = b"hello from the client pod, carried by HBONE";

/// Processes to kill on Ctrl-C (the lab's Drop does not run when the process is interrupted).
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn step(n: u32, text: &str) {
    println!("\n[{n}/7] {text}");
}

fn ok(text: impl AsRef<str>) {
    println!("      ✓ {}", text.as_ref());
}

/// Runs the demo; returns the exit status (0 only if traffic really went through HBONE).
pub fn run(verbose: bool) -> i32 {
    install_interrupt_cleanup();
    match run_inner(verbose) {
        Ok(()) => {
            println!("\nDemo passed: the pods talked over HBONE (mTLS + HTTP/2 CONNECT on 15008).");
            0
        }
        Err(e) => {
            eprintln!("\nDemo FAILED: {e:#}");
            1
        }
    }
}

/// Registers a process for the Ctrl-C cleanup.
fn track(guard: ProcessGuard) -> ProcessGuard {
    if let Ok(mut c) = CHILDREN.lock() {
        c.push(guard.0.id());
    }
    guard
}

fn install_interrupt_cleanup() {
    std::thread::spawn(|| {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let _ = tokio::signal::ctrl_c().await;
        });
        eprintln!("\ninterrupted: cleaning up");
        if let Ok(c) = CHILDREN.lock() {
            for pid in c.iter() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        cleanup_leftovers();
        std::process::exit(130);
    });
}

/// Deletes every netns and dir a (possibly interrupted) demo run can leave.
fn cleanup_leftovers() {
    for name in ["client", "server", "node"] {
        let _ = Command::new("ip")
            .args(["netns", "del", &format!("{PREFIX}-{name}")])
            .output();
    }
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("ztnode-lab-{PREFIX}")));
}

fn run_inner(verbose: bool) -> anyhow::Result<()> {
    use anyhow::Context;
    if !nix::unistd::geteuid().is_root() {
        anyhow::bail!("the demo creates network namespaces: run it as root");
    }
    cleanup_leftovers();
    let exe = std::env::current_exe().context("locate the ztnode binary")?;
    // Inside the lab dir, which the lab removes when it is dropped.
    let run_dir = std::env::temp_dir()
        .join(format!("ztnode-lab-{PREFIX}"))
        .join("run");

    step(
        1,
        "Building a throwaway node: node netns + CNI chain (bridge, host-local, ztnode-cni)",
    );
    let lab = Lab::new(LabOptions {
        prefix: PREFIX.into(),
        ztnode_binary: Some(exe.clone()),
        run_dir: run_dir.clone(),
        subnet: SUBNET.into(),
        cni_version: "1.0.0".into(),
    })?;
    ok(format!(
        "node netns {} with CNI bin dir {}",
        lab.node_name(),
        lab.dir().join("bin").display()
    ));

    step(
        2,
        "Starting `ztnode node` (agent + proxy) inside the node netns",
    );
    let client_ip: IpAddr = CLIENT_IP.parse()?;
    let server_ip: IpAddr = SERVER_IP.parse()?;
    let config_path = lab.dir().join("local-config.yaml");
    std::fs::write(
        &config_path,
        local_config(
            PREFIX,
            &[
                ("client", "default", "client", client_ip),
                ("server", "default", "server", server_ip),
            ],
        ),
    )?;
    let (host_bin, host_conf) = (lab.dir().join("host-bin"), lab.dir().join("host-net.d"));
    std::fs::create_dir_all(&host_bin)?;
    std::fs::create_dir_all(&host_conf)?;
    let extra = [
        "--cni-bin-dir".into(),
        host_bin.into_os_string(),
        "--cni-conf-dir".into(),
        host_conf.into_os_string(),
    ];
    let (node, log_path) = lab.start_node(&exe, &config_path, &run_dir, "info", &extra)?;
    let _node = track(node);
    ok(format!(
        "plugin socket {}",
        run_dir.join("pluginevent.sock").display()
    ));
    ok(format!("node log {}", log_path.display()));

    step(
        3,
        "Adding pods through the CNI chain (the plugin tells the agent, the agent enrolls them)",
    );
    let client = lab.add_pod("client", "default")?;
    let server = lab.add_pod("server", "default")?;
    anyhow::ensure!(
        client.ip == client_ip && server.ip == server_ip,
        "unexpected pod IPs {} {}",
        client.ip,
        server.ip
    );
    ok(format!(
        "pod default/client {} (service account client)",
        client.ip
    ));
    ok(format!(
        "pod default/server {} (service account server)",
        server.ip
    ));

    step(4, "Checking the redirection rules inside the client pod");
    let rules = Command::new("ip")
        .args([
            "netns",
            "exec",
            &client.netns_name,
            "nft",
            "list",
            "ruleset",
        ])
        .output();
    match rules {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            let tables: Vec<_> = text.lines().filter(|l| l.starts_with("table")).collect();
            anyhow::ensure!(
                text.contains("redirect to :15001"),
                "no outbound redirect in the client pod"
            );
            for t in tables {
                ok(t.trim_end_matches(" {"));
            }
            if verbose {
                println!("{text}");
            }
        }
        Err(e) => println!("      (nft not available to show the rules: {e})"),
    }

    step(
        5,
        "Starting a capture on the bridge and an echo server in the server pod",
    );
    let pcap = lab.dir().join("bridge.pcap");
    let dump = track(lab.capture(&pcap)?);
    let server_ns = Netns::open(&server.netns_path)?;
    let listener = Lab::listen_in(&server_ns, SocketAddr::new(server_ip, APP_PORT))?;
    let echo = std::thread::spawn(move || -> std::io::Result<SocketAddr> {
        let (mut s, peer) = listener.accept()?;
        let mut buf = vec![0u8; MESSAGE.len()];
        s.read_exact(&mut buf)?;
        s.write_all(&buf)?;
        Ok(peer)
    });
    ok(format!("echo server on {server_ip}:{APP_PORT}"));

    step(6, "Connecting from the client pod to the server pod");
    let client_ns = Netns::open(&client.netns_path)?;
    let mut conn = Lab::connect_from(&client_ns, SocketAddr::new(server_ip, APP_PORT))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.write_all(MESSAGE)?;
    let mut back = vec![0u8; MESSAGE.len()];
    conn.read_exact(&mut back).context("read the echo")?;
    anyhow::ensure!(back == MESSAGE, "echo differs");
    drop(conn);
    let seen = echo
        .join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    ok(format!("sent {} bytes, got them back", MESSAGE.len()));
    anyhow::ensure!(
        seen.ip() == client_ip,
        "the server saw {} instead of the client's IP",
        seen.ip()
    );
    ok(format!(
        "the server app saw the connection from {} (the client's real IP)",
        seen.ip()
    ));

    step(7, "Evidence");
    std::thread::sleep(Duration::from_millis(500));
    drop(dump);
    let ids = access_log_identities(&log_path, Duration::from_secs(5))?;
    for line in &ids {
        ok(line);
    }
    let data = std::fs::read(&pcap).context("read the capture")?;
    let segs = super::pcap::tcp_segments(&data)?;
    let between: Vec<_> = segs
        .iter()
        .filter(|s| {
            (s.src == client_ip && s.dst == server_ip) || (s.src == server_ip && s.dst == client_ip)
        })
        .collect();
    anyhow::ensure!(
        !between.is_empty(),
        "the capture saw no packets between the pods ({} TCP segments, {} bytes in {})",
        segs.len(),
        data.len(),
        pcap.display()
    );
    let all_15008 = between
        .iter()
        .all(|s| s.src_port == 15008 || s.dst_port == 15008);
    let clear = between
        .iter()
        .any(|s| super::pcap::contains(&s.payload, MESSAGE));
    let tls_records = between
        .iter()
        .filter(|s| s.payload.starts_with(&[0x17, 0x03, 0x03]))
        .count();
    let bytes: usize = between.iter().map(|s| s.payload.len()).sum();
    anyhow::ensure!(
        all_15008,
        "some packets between the pods did not use port 15008"
    );
    anyhow::ensure!(!clear, "the message crossed the bridge in clear text");
    anyhow::ensure!(
        tls_records > 0,
        "no TLS application-data records on the bridge"
    );
    ok(format!(
        "bridge capture: {} TCP segments between the pods, all on port 15008, {} TLS records, {} payload bytes, message not visible in clear",
        between.len(),
        tls_records,
        bytes
    ));
    println!("\nCleaning up (CNI DEL, namespaces, processes)");
    Ok(())
}

/// Reads "connection complete" access-log lines and returns a summary per direction with the
/// SPIFFE IDs of both ends.
fn access_log_identities(log: &PathBuf, timeout: Duration) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<_> = text
            .lines()
            .filter(|l| l.contains("connection complete") && l.contains("spiffe://"))
            .collect();
        let out = lines
            .iter()
            .any(|l| l.contains("direction=\"outbound\"") || l.contains("direction=outbound"));
        let inb = lines
            .iter()
            .any(|l| l.contains("direction=\"inbound\"") || l.contains("direction=inbound"));
        if out && inb {
            let mut v = Vec::new();
            for l in lines {
                let ids: Vec<_> = l
                    .split_whitespace()
                    .filter(|w| w.contains("identity="))
                    .map(|w| w.replace('"', ""))
                    .collect();
                let dir = if l.contains("outbound") {
                    "outbound (client side)"
                } else {
                    "inbound (server side)"
                };
                v.push(format!("access log {dir}: {}", ids.join(" ")));
            }
            return Ok(v);
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "no access-log lines with both SPIFFE IDs in {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
