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
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::mesh_lab::{MeshLab, MeshSpec, MeshStage};
use super::node::{Lab, LabOptions, Pod, ProcessGuard};
use crate::mesh::HBONE_PORT;
use crate::netns::Netns;

const PREFIX: &str = "ztdemo";
const SUBNET: &str = "10.248.0.0/24";
const CLIENT_IP: &str = "10.248.0.2";
const SERVER_IP: &str = "10.248.0.3";
const APP_PORT: u16 = 8080;
const MESSAGE: &[u8] = b"hello from the client pod, carried by HBONE";
/// The node's `--cni-bin-dir`, an empty dir in the lab dir.
const HOST_BIN: &str = "host-bin";
/// The node's `--cni-conf-dir`, an empty dir in the lab dir.
const HOST_CONF: &str = "host-net.d";

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
            println!(
                "\nDemo passed: the pods talked over HBONE (mTLS + HTTP/2 CONNECT on {HBONE_PORT})."
            );
            0
        }
        Err(e) => {
            eprintln!("\nDemo FAILED: {e:#}");
            1
        }
    }
}

/// Registers a process for the Ctrl-C cleanup.
fn track(pid: u32) {
    if let Ok(mut c) = CHILDREN.lock() {
        c.push(pid);
    }
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
    let _ = std::fs::remove_dir_all(lab_dir());
}

/// The demo's steps in order; the lab and every process are removed when `mesh` drops.
fn run_inner(verbose: bool) -> anyhow::Result<()> {
    use anyhow::Context;
    if !nix::unistd::geteuid().is_root() {
        anyhow::bail!("the demo creates network namespaces: run it as root");
    }
    cleanup_leftovers();
    let exe = std::env::current_exe().context("locate the ztnode binary")?;
    let mesh = start_mesh(&exe)?;
    let [client, server] = &mesh.pods;
    show_redirection(client, verbose)?;
    let pcap = mesh.lab.dir().join("bridge.pcap");
    let (dump, echo) = capture_and_echo(&mesh.lab, server, &pcap)?;
    connect(client, server, echo)?;
    evidence(&mesh.log, &pcap, dump, client.ip, server.ip)?;
    println!("\nCleaning up (CNI DEL, namespaces, processes)");
    Ok(())
}

/// The lab's directory (its name is fixed by [`PREFIX`]).
fn lab_dir() -> PathBuf {
    std::env::temp_dir().join(format!("ztnode-lab-{PREFIX}"))
}

/// Steps 1 to 3: the lab node with the CNI chain, `ztnode node` inside it, and the pods `client`
/// and `server` enrolled through the chain.
fn start_mesh(exe: &Path) -> anyhow::Result<MeshLab<2>> {
    let client_ip: IpAddr = CLIENT_IP.parse()?;
    let server_ip: IpAddr = SERVER_IP.parse()?;
    let node_args = [
        "--cni-bin-dir".into(),
        lab_dir().join(HOST_BIN).into_os_string(),
        "--cni-conf-dir".into(),
        lab_dir().join(HOST_CONF).into_os_string(),
    ];
    let spec = MeshSpec {
        lab: LabOptions {
            prefix: PREFIX.into(),
            ztnode_binary: Some(exe.to_owned()),
            // Inside the lab dir, which the lab removes when it is dropped.
            run_dir: lab_dir().join("run"),
            subnet: SUBNET.into(),
            cni_version: "1.0.0".into(),
        },
        exe,
        workloads: &[
            ("client", "default", "client", client_ip),
            ("server", "default", "server", server_ip),
        ],
        extra_config: "",
        log_level: "info",
        node_args: &node_args,
        node_env: &[],
        pods: [("client", "default"), ("server", "default")],
    };
    step(
        1,
        "Building a throwaway node: node netns + CNI chain (bridge, host-local, ztnode-cni)",
    );
    let mesh = MeshLab::start_observed(spec, show_stage)?;
    let [client, server] = &mesh.pods;
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
    Ok(mesh)
}

/// Prints the end of steps 1 and 2 and the start of the next one as [`start_mesh`] gets there;
/// makes the node's (empty) host CNI dirs once the lab dir exists.
fn show_stage(stage: MeshStage<'_>) -> anyhow::Result<()> {
    match stage {
        MeshStage::LabBuilt(lab) => {
            ok(format!(
                "node netns {} with CNI bin dir {}",
                lab.node_name(),
                lab.dir().join("bin").display()
            ));
            step(
                2,
                "Starting `ztnode node` (agent + proxy) inside the node netns",
            );
            std::fs::create_dir_all(lab.dir().join(HOST_BIN))?;
            std::fs::create_dir_all(lab.dir().join(HOST_CONF))?;
        }
        MeshStage::NodeStarted { pid, log, .. } => {
            track(pid);
            ok(format!(
                "plugin socket {}",
                lab_dir().join("run").join("pluginevent.sock").display()
            ));
            ok(format!("node log {}", log.display()));
            step(
                3,
                "Adding pods through the CNI chain (the plugin tells the agent, the agent enrolls them)",
            );
        }
    }
    Ok(())
}

/// Step 4: the outbound redirect is in the client pod's ruleset (shown when nft is there).
fn show_redirection(client: &Pod, verbose: bool) -> anyhow::Result<()> {
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
                text.contains(&format!("redirect to :{}", crate::mesh::OUTBOUND_PORT)),
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
    Ok(())
}

/// The echo server's thread: the peer address it saw.
type Echo = std::thread::JoinHandle<std::io::Result<SocketAddr>>;

/// Step 5: a capture on the bridge into `pcap`, and an echo server for one [`MESSAGE`] in the
/// server pod.
fn capture_and_echo(lab: &Lab, server: &Pod, pcap: &Path) -> anyhow::Result<(ProcessGuard, Echo)> {
    step(
        5,
        "Starting a capture on the bridge and an echo server in the server pod",
    );
    let dump = lab.capture(pcap)?;
    track(dump.0.id());
    let server_ns = Netns::open(&server.netns_path)?;
    let listener = Lab::listen_in(&server_ns, SocketAddr::new(server.ip, APP_PORT))?;
    let echo = std::thread::spawn(move || -> std::io::Result<SocketAddr> {
        let (mut s, peer) = listener.accept()?;
        let mut buf = vec![0u8; MESSAGE.len()];
        s.read_exact(&mut buf)?;
        s.write_all(&buf)?;
        Ok(peer)
    });
    ok(format!("echo server on {}:{APP_PORT}", server.ip));
    Ok((dump, echo))
}

/// Step 6: sends [`MESSAGE`] from the client pod, reads it back, and checks that the server app
/// saw the client's own IP.
fn connect(client: &Pod, server: &Pod, echo: Echo) -> anyhow::Result<()> {
    use anyhow::Context;
    step(6, "Connecting from the client pod to the server pod");
    let client_ns = Netns::open(&client.netns_path)?;
    let mut conn = Lab::connect_from(&client_ns, SocketAddr::new(server.ip, APP_PORT))?;
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
        seen.ip() == client.ip,
        "the server saw {} instead of the client's IP",
        seen.ip()
    );
    ok(format!(
        "the server app saw the connection from {} (the client's real IP)",
        seen.ip()
    ));
    Ok(())
}

/// Step 7: stops the capture, then shows both SPIFFE IDs in the access log and checks the capture
/// ([`bridge_capture`]).
fn evidence(
    log: &Path,
    pcap: &Path,
    dump: ProcessGuard,
    client_ip: IpAddr,
    server_ip: IpAddr,
) -> anyhow::Result<()> {
    step(7, "Evidence");
    std::thread::sleep(Duration::from_millis(500));
    drop(dump);
    let ids = access_log_identities(log, Duration::from_secs(5))?;
    for line in &ids {
        ok(line);
    }
    ok(bridge_capture(pcap, client_ip, server_ip)?);
    Ok(())
}

/// Checks that the segments between the pods in `pcap` all use port 15008, carry TLS records and
/// never [`MESSAGE`] in clear; returns the summary line.
fn bridge_capture(pcap: &Path, client_ip: IpAddr, server_ip: IpAddr) -> anyhow::Result<String> {
    use anyhow::Context;
    let data = std::fs::read(pcap).context("read the capture")?;
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
    let all_hbone = between
        .iter()
        .all(|s| s.src_port == HBONE_PORT || s.dst_port == HBONE_PORT);
    let clear = between
        .iter()
        .any(|s| super::pcap::contains(&s.payload, MESSAGE));
    let tls_records = between
        .iter()
        .filter(|s| s.payload.starts_with(&[0x17, 0x03, 0x03]))
        .count();
    let bytes: usize = between.iter().map(|s| s.payload.len()).sum();
    anyhow::ensure!(
        all_hbone,
        "some packets between the pods did not use port {HBONE_PORT}"
    );
    anyhow::ensure!(!clear, "the message crossed the bridge in clear text");
    anyhow::ensure!(
        tls_records > 0,
        "no TLS application-data records on the bridge"
    );
    Ok(format!(
        "bridge capture: {} TCP segments between the pods, all on port {HBONE_PORT}, {} TLS records, {} payload bytes, message not visible in clear",
        between.len(),
        tls_records,
        bytes
    ))
}

/// Reads "connection complete" access-log lines and returns a summary per direction with the
/// SPIFFE IDs of both ends.
fn access_log_identities(log: &Path, timeout: Duration) -> anyhow::Result<Vec<String>> {
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
