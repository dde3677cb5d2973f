//! Host probe SNAT rules against a real kernel (root; fresh named network namespaces per test, each
//! standing in for a node's host netns; nothing touches the machine's own namespace).
//!
//! - `apply` + pod elements list as `tests/golden/host_probe_v4v6.nft` (checked by eye against
//!   istio-cni's `hostprobe_ipv6.golden` plus its sets), re-apply keeps elements, upsert / removal by
//!   UID / sync behave, a flushed or deleted table is detected by `is_applied` and repaired, IPv6 off
//!   converges to `tests/golden/host_probe_v4.nft`, `remove` leaves nothing; the rendered scripts fed
//!   to `nft -f` install the same rules. `UPDATE_GOLDEN=1` rewrites goldens.
//! - Behaviour: TCP from a socket owned by the kubelet UID to an enrolled pod arrives from the probe
//!   address (v4 and v6); other UIDs, and addresses not in the set, keep their source.
//!
//! Without root (or without `ip`/`nft`) the tests print SKIP, or fail when `CI` is set.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use nix::unistd::{Uid, setfsuid};
use ztnode::agent::redirect::host::{HostProbe, ProbeEntry};
use ztnode::mesh::{DEFAULT_PROBE_V4, DEFAULT_PROBE_V6};
use ztnode::netns::Netns;

/// The kubelet UID the tests configure (nobody on this machine needs to own it).
const KUBELET_UID: u32 = 4242;

/// A named network namespace deleted on drop.
struct TestNs {
    name: String,
    netns: Netns,
}

impl TestNs {
    fn new(tag: &str) -> Result<TestNs> {
        let name = format!("zt-hp-{tag}-{}", std::process::id());
        run("ip", &["netns", "add", &name])?;
        // Build the guard before `?` so the namespace is deleted even if opening it failed.
        match Netns::open(format!("/var/run/netns/{name}")) {
            Ok(netns) => Ok(TestNs { name, netns }),
            Err(e) => {
                let _ = run("ip", &["netns", "del", &name]);
                Err(e.into())
            }
        }
    }

    /// Runs `cmd args..` inside the namespace and returns stdout.
    fn exec(&self, cmd: &str, args: &[&str]) -> Result<String> {
        let mut full = vec!["netns", "exec", &self.name, cmd];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    fn ruleset(&self) -> Result<String> {
        self.exec("nft", &["list", "ruleset"])
    }

    /// Runs `f` with `hp` inside the namespace.
    fn host<R: Send>(&self, hp: &HostProbe, f: impl FnOnce(&HostProbe) -> R + Send) -> Result<R> {
        Ok(self.netns.run(|| f(hp))?)
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.name]);
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("spawn {cmd}"))?;
    ensure!(
        out.status.success(),
        "{cmd} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// True when the test can run; otherwise SKIP (or panic under CI).
fn privileged() -> bool {
    let missing = if !nix::unistd::geteuid().is_root() {
        Some("root")
    } else if run("nft", &["--version"]).is_err() {
        Some("the nft binary")
    } else if run("ip", &["-V"]).is_err() {
        Some("the ip binary")
    } else {
        None
    };
    match missing {
        None => true,
        Some(what) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI: host probe tests need {what}"
            );
            eprintln!("SKIP: host probe kernel tests need {what}");
            false
        }
    }
}

fn golden_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(file)
}

/// Compares `actual` with the golden file, or rewrites it when `UPDATE_GOLDEN=1`.
fn check_golden(file: &str, actual: &str) -> Result<()> {
    let path = golden_path(file);
    if std::env::var("UPDATE_GOLDEN").as_deref() == Ok("1") {
        std::fs::write(&path, actual).with_context(|| format!("write {}", path.display()))?;
        return Ok(());
    }
    let expected =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    if expected != actual {
        bail!(
            "{file} differs (UPDATE_GOLDEN=1 to accept)\n--- expected\n{expected}\n--- actual\n{actual}"
        );
    }
    Ok(())
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn entry(addr: &str, uid: &str) -> ProbeEntry {
    ProbeEntry {
        ip: ip(addr),
        uid: Some(uid.into()),
    }
}

fn dual_stack() -> HostProbe {
    HostProbe {
        ipv6: true,
        ..HostProbe::new(KUBELET_UID)
    }
}

#[test]
fn host_rules_round_trip() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = TestNs::new("rt")?;
    let hp = dual_stack();
    ensure!(
        !ns.host(&hp, HostProbe::is_applied)??,
        "fresh netns reports applied"
    );
    ns.host(&hp, HostProbe::apply)??;
    ensure!(
        ns.host(&hp, HostProbe::is_applied)??,
        "is_applied after apply"
    );

    ns.host(&hp, |h| {
        h.add_pod("uid-a", &[ip("10.1.0.5"), ip("fd00::5")])
    })??;
    ns.host(&hp, |h| h.add_pod("uid-b", &[ip("10.1.0.6")]))??;
    let listed = ns.ruleset()?;
    check_golden("host_probe_v4v6.nft", &listed)?;

    // Re-applying keeps the elements and changes nothing.
    ns.host(&hp, HostProbe::apply)??;
    ensure!(ns.ruleset()? == listed, "re-apply changed the ruleset");
    let all = [
        entry("10.1.0.5", "uid-a"),
        entry("10.1.0.6", "uid-b"),
        entry("fd00::5", "uid-a"),
    ];
    ensure!(ns.host(&hp, HostProbe::entries)?? == all, "entries");

    // Removal only takes the caller's own elements and reports the others.
    let foreign = ns.host(&hp, |h| {
        h.remove_pod("uid-b", &[ip("10.1.0.5"), ip("10.1.0.6"), ip("10.1.0.99")])
    })??;
    ensure!(
        foreign == [entry("10.1.0.5", "uid-a")],
        "foreign {foreign:?}"
    );
    let left = ns.host(&hp, HostProbe::entries)??;
    ensure!(left == [all[0].clone(), all[2].clone()], "left {left:?}");

    // Upsert: the address moves to the new pod.
    ns.host(&hp, |h| h.add_pod("uid-c", &[ip("::ffff:10.1.0.5")]))??;
    let left = ns.host(&hp, HostProbe::entries)??;
    ensure!(
        left == [entry("10.1.0.5", "uid-c"), all[2].clone()],
        "after upsert {left:?}"
    );
    ensure!(ns.host(&hp, |h| h.remove_uid("uid-a"))?? == 1, "remove_uid");

    // Sync makes the sets exactly the snapshot.
    let snapshot = vec![
        ("uid-d".to_owned(), vec![ip("10.1.0.7"), ip("fd00::7")]),
        ("uid-e".to_owned(), vec![ip("10.1.0.7"), ip("10.1.0.8")]),
        ("uid-f".to_owned(), Vec::new()),
    ];
    ns.host(&hp, |h| h.sync(&snapshot))??;
    let synced = ns.host(&hp, HostProbe::entries)??;
    ensure!(
        synced
            == [
                entry("10.1.0.7", "uid-d"),
                entry("10.1.0.8", "uid-e"),
                entry("fd00::7", "uid-d"),
            ],
        "synced {synced:?}"
    );

    // Someone flushes the table: detected, repaired, elements kept.
    ns.exec("nft", &["flush", "table", "inet", "istio-ambient-nat"])?;
    ensure!(!ns.host(&hp, HostProbe::is_applied)??, "flush not detected");
    ns.host(&hp, HostProbe::apply)??;
    ensure!(ns.host(&hp, HostProbe::is_applied)??, "not repaired");
    ensure!(
        ns.host(&hp, HostProbe::entries)?? == synced,
        "repair lost elements"
    );

    // Someone deletes the table: detected, apply recreates it (empty sets).
    ns.exec("nft", &["delete", "table", "inet", "istio-ambient-nat"])?;
    ensure!(
        !ns.host(&hp, HostProbe::is_applied)??,
        "delete not detected"
    );
    ns.host(&hp, HostProbe::apply)??;
    ensure!(
        ns.host(&hp, HostProbe::entries)??.is_empty(),
        "sets not empty"
    );

    // IPv6 off converges: the v6 rule and set go; the other configuration is not "applied".
    let v4 = HostProbe::new(KUBELET_UID);
    ns.host(&hp, |h| {
        h.add_pod("uid-g", &[ip("10.1.0.9"), ip("fd00::9")])
    })??;
    ns.host(&v4, HostProbe::apply)??;
    check_golden("host_probe_v4.nft", &ns.ruleset()?)?;
    ensure!(ns.host(&v4, HostProbe::is_applied)??, "v4 config applied");
    ensure!(
        !ns.host(&hp, HostProbe::is_applied)??,
        "v6 config must not be"
    );
    let other_uid = HostProbe::new(KUBELET_UID + 1);
    ensure!(
        !ns.host(&other_uid, HostProbe::is_applied)??,
        "another kubelet UID must not be"
    );

    ns.host(&hp, HostProbe::remove)??;
    ensure!(ns.ruleset()?.trim().is_empty(), "left: {}", ns.ruleset()?);
    ns.host(&hp, HostProbe::remove)??;
    ensure!(
        !ns.host(&hp, HostProbe::is_applied)??,
        "applied after remove"
    );
    Ok(())
}

#[test]
fn rendered_scripts_install_what_apply_installs() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    for hp in [HostProbe::new(KUBELET_UID), dual_stack()] {
        let ours = TestNs::new("ours")?;
        ours.host(&hp, HostProbe::apply)??;
        let script = tempfile::NamedTempFile::new()?;
        std::fs::write(script.path(), hp.render_sets_script() + &hp.render_script())?;
        let path = script.path().to_str().context("temp path")?;
        let by_nft = TestNs::new("nft")?;
        by_nft.exec("nft", &["-f", path])?;
        ensure!(
            by_nft.ruleset()? == ours.ruleset()?,
            "nft -f listing differs:\n{}\n--- ours\n{}",
            by_nft.ruleset()?,
            ours.ruleset()?
        );
        ensure!(
            by_nft.host(&hp, HostProbe::is_applied)??,
            "nft's rules pass is_applied"
        );
    }
    Ok(())
}

// === behaviour ===

/// A node netns (`hn`: 10.254.7.1/24, fd00:254:7::1/64) and a pod netns (`hp`: 10.254.7.2 and
/// 10.254.7.3, fd00:254:7::2 and ::3) joined by a veth pair; the pod routes everything via the node.
fn node_and_pod() -> Result<(TestNs, TestNs)> {
    let node = TestNs::new("node")?;
    let pod = TestNs::new("pod")?;
    run(
        "ip",
        &[
            "link", "add", "hn", "netns", &node.name, "type", "veth", "peer", "name", "hp",
            "netns", &pod.name,
        ],
    )?;
    for (ns, dev, addrs) in [
        (&node, "hn", &["10.254.7.1/24", "fd00:254:7::1/64"][..]),
        (
            &pod,
            "hp",
            &[
                "10.254.7.2/24",
                "10.254.7.3/24",
                "fd00:254:7::2/64",
                "fd00:254:7::3/64",
            ][..],
        ),
    ] {
        for a in addrs {
            let mut args = vec!["addr", "add", a, "dev", dev];
            if a.contains(':') {
                args.push("nodad");
            }
            ns.exec("ip", &args)?;
        }
        ns.exec("ip", &["link", "set", dev, "up"])?;
        ns.exec("ip", &["link", "set", "lo", "up"])?;
    }
    pod.exec("ip", &["route", "add", "default", "via", "10.254.7.1"])?;
    pod.exec(
        "ip",
        &["-6", "route", "add", "default", "via", "fd00:254:7::1"],
    )?;
    Ok((node, pod))
}

fn listen(ns: &Netns, addr: SocketAddr) -> Result<TcpListener> {
    Ok(ns.run(move || TcpListener::bind(addr))??)
}

/// Connects from `ns` with a socket created under file-system UID `uid` (the owner `meta skuid`
/// sees), sends one byte.
fn connect_as(ns: &Netns, uid: u32, to: SocketAddr) -> Result<TcpStream> {
    let s = ns.run(move || -> Result<TcpStream> {
        let domain = socket2::Domain::for_address(to);
        // setfsuid is per thread, and this thread exists only for this call.
        let before = setfsuid(Uid::from_raw(uid));
        let sock = socket2::Socket::new(domain, socket2::Type::STREAM, None);
        setfsuid(before);
        let sock = sock?;
        sock.connect_timeout(&to.into(), Duration::from_secs(5))
            .with_context(|| format!("connect {to} as uid {uid}"))?;
        Ok(sock.into())
    })??;
    std::io::Write::write_all(&mut &s, b"x")?;
    Ok(s)
}

/// Accepts one connection on `l`, reads its byte and returns the peer address.
fn accept_peer(l: &TcpListener) -> Result<IpAddr> {
    l.set_nonblocking(true)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut s, peer) = loop {
        match l.accept() {
            Ok(a) => break a,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("accept"),
        }
    };
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(peer.ip())
}

/// The source address a connection from `uid` in the node to `to` arrives with in the pod.
fn source_seen(node: &TestNs, l: &TcpListener, uid: u32, to: SocketAddr) -> Result<IpAddr> {
    let _c = connect_as(&node.netns, uid, to)?;
    accept_peer(l)
}

#[test]
fn kubelet_tcp_to_enrolled_pods_is_snated_to_the_probe_address() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let (node, pod) = node_and_pod()?;
    let hp = dual_stack();
    node.host(&hp, HostProbe::apply)??;
    node.host(&hp, |h| {
        h.add_pod("pod-uid", &[ip("10.254.7.2"), ip("fd00:254:7::2")])
    })??;

    let l4 = listen(&pod.netns, SocketAddr::from((Ipv4Addr::UNSPECIFIED, 8080)))?;
    let l6 = listen(&pod.netns, SocketAddr::from((Ipv6Addr::UNSPECIFIED, 8081)))?;
    let to = |a: &str, port| SocketAddr::new(ip(a), port);
    let probe4 = IpAddr::V4(DEFAULT_PROBE_V4);
    let probe6 = IpAddr::V6(DEFAULT_PROBE_V6);

    let seen = source_seen(&node, &l4, KUBELET_UID, to("10.254.7.2", 8080))?;
    ensure!(seen == probe4, "kubelet v4 probe arrived from {seen}");
    let seen = source_seen(&node, &l6, KUBELET_UID, to("fd00:254:7::2", 8081))?;
    ensure!(seen == probe6, "kubelet v6 probe arrived from {seen}");

    // Another UID keeps its source, and so does the kubelet to an address not in the set.
    let seen = source_seen(&node, &l4, 0, to("10.254.7.2", 8080))?;
    ensure!(seen == ip("10.254.7.1"), "root arrived from {seen}");
    let seen = source_seen(&node, &l6, KUBELET_UID + 1, to("fd00:254:7::2", 8081))?;
    ensure!(seen == ip("fd00:254:7::1"), "uid+1 arrived from {seen}");
    let seen = source_seen(&node, &l4, KUBELET_UID, to("10.254.7.3", 8080))?;
    ensure!(
        seen == ip("10.254.7.1"),
        "not enrolled, arrived from {seen}"
    );

    // Once the pod is removed its probes keep their source.
    let foreign = node.host(&hp, |h| {
        h.remove_pod("pod-uid", &[ip("10.254.7.2"), ip("fd00:254:7::2")])
    })??;
    ensure!(foreign.is_empty(), "foreign {foreign:?}");
    let seen = source_seen(&node, &l4, KUBELET_UID, to("10.254.7.2", 8080))?;
    ensure!(
        seen == ip("10.254.7.1"),
        "after removal arrived from {seen}"
    );
    Ok(())
}
