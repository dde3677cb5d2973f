//! Redirection rules against a real kernel (root; fresh named network namespaces per test).
//!
//! - `nft list ruleset` after `apply` equals `tests/golden/<case>.nft` for v4 / v4+v6, DNS capture
//!   on / off, and the per-pod options ingress mode (`v4_ingress`, istio-cni's `ingress.golden`)
//!   and virtual interfaces (`v4v6_virtual_interfaces`, `virtual_interfaces_ipv6.golden`); the
//!   rendered script equals `tests/golden/<case>.script.nft`, passes `nft -c -f`, and applied with
//!   `nft -f` lists exactly like our netlink apply; re-applying through [`NftRules`] with the pod's
//!   options changes nothing. `UPDATE_GOLDEN=1` rewrites goldens.
//! - apply is idempotent, remove cleans nft, `ip rule` and table 100 (v4 and v6), twice and on an
//!   empty netns; TCP really gets redirected (outbound -> 15001, inbound -> 15006, 15008 and probes
//!   untouched; in ingress mode inbound is untouched; from a virtual interface inbound -> 15001).
//!
//! Without root (or without `ip`/`nft`) the tests print SKIP, or fail when `CI` is set.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ztnode::agent::enroll::{InterfaceName, PodOptions};
use ztnode::agent::pods::{NftRules, RuleApplier};
use ztnode::agent::redirect::{self, RedirectPlan};
use ztnode::netns::Netns;

/// A named network namespace deleted on drop.
struct TestNs {
    name: String,
    netns: Netns,
}

impl TestNs {
    fn new(tag: &str) -> Result<TestNs> {
        let name = format!("zt-rg-{tag}-{}", std::process::id());
        run("ip", &["netns", "add", &name])?;
        let netns = Netns::open(format!("/var/run/netns/{name}"));
        // Build the guard before `?` so the namespace is deleted even if opening it failed.
        match netns {
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
                "CI: redirect tests need {what}"
            );
            eprintln!("SKIP: redirect kernel tests need {what}");
            false
        }
    }
}

/// A golden case: the node-wide plan, the pod's options and the pod plan they merge into.
struct Case {
    name: &'static str,
    node: RedirectPlan,
    pod: PodOptions,
    plan: RedirectPlan,
}

fn pod_case(name: &'static str, ipv6: bool, dns_capture: bool, pod: PodOptions) -> Case {
    let node = RedirectPlan {
        ipv6,
        dns_capture,
        ..RedirectPlan::default()
    };
    Case {
        name,
        plan: node.for_pod(&pod),
        node,
        pod,
    }
}

fn case(name: &'static str, ipv6: bool, dns_capture: bool) -> Case {
    pod_case(name, ipv6, dns_capture, PodOptions::default())
}

fn ingress_mode() -> PodOptions {
    PodOptions {
        bypass_inbound_capture: true,
        ..Default::default()
    }
}

fn virtual_interfaces(names: &[&str]) -> Result<PodOptions> {
    let names = names
        .iter()
        .map(|n| InterfaceName::new(n))
        .collect::<Result<_, _>>()?;
    Ok(PodOptions {
        reroute_virtual_interfaces: names,
        ..Default::default()
    })
}

/// The cases; the last two are istio-cni's `ingress` (v4) and `virtual_interfaces` (v4+v6) cases,
/// DNS capture off as in its tests.
fn cases() -> Result<[Case; 6]> {
    Ok([
        case("v4", false, false),
        case("v4_dns", false, true),
        case("v4v6", true, false),
        case("v4v6_dns", true, true),
        pod_case("v4_ingress", false, false, ingress_mode()),
        pod_case(
            "v4v6_virtual_interfaces",
            true,
            false,
            virtual_interfaces(&["fake1s0f0", "fake1s0f1"])?,
        ),
    ])
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

/// Lines of `ip [-6] rule` / `ip [-6] route show table 100` that belong to us.
fn policy_routing(ns: &TestNs, family: &str) -> Result<(Vec<String>, String)> {
    let rules = ns.exec("ip", &[family, "rule"])?;
    let ours = rules
        .lines()
        .filter(|l| l.contains("fwmark 0x111/0xfff"))
        .map(str::to_owned)
        .collect();
    // `ip route show table N` fails when the table was never created: that counts as empty.
    let routes = match ns.exec("ip", &[family, "route", "show", "table", "100"]) {
        Ok(r) => r.trim().to_owned(),
        Err(e) if e.to_string().contains("FIB table does not exist") => String::new(),
        Err(e) => return Err(e),
    };
    Ok((ours, routes))
}

fn assert_routing(ns: &TestNs, ipv6: bool) -> Result<()> {
    let (rules, routes) = policy_routing(ns, "-4")?;
    ensure!(
        rules == ["32764:\tfrom all fwmark 0x111/0xfff lookup 100"],
        "v4 rules {rules:?}"
    );
    ensure!(
        routes == "local default dev lo scope host",
        "v4 routes {routes:?}"
    );
    let (rules, routes) = policy_routing(ns, "-6")?;
    if ipv6 {
        ensure!(
            rules == ["32764:\tfrom all fwmark 0x111/0xfff lookup 100"],
            "v6 rules {rules:?}"
        );
        ensure!(
            routes.starts_with("local default dev lo"),
            "v6 routes {routes:?}"
        );
    } else {
        ensure!(
            rules.is_empty() && routes.is_empty(),
            "unexpected v6 {rules:?} {routes:?}"
        );
    }
    Ok(())
}

fn assert_clean(ns: &TestNs) -> Result<()> {
    ensure!(
        ns.ruleset()?.trim().is_empty(),
        "ruleset left: {}",
        ns.ruleset()?
    );
    for family in ["-4", "-6"] {
        let (rules, routes) = policy_routing(ns, family)?;
        ensure!(
            rules.is_empty() && routes.is_empty(),
            "{family}: {rules:?} {routes:?}"
        );
    }
    ensure!(!redirect::is_applied(&ns.netns)?, "is_applied after remove");
    Ok(())
}

#[test]
fn rendered_scripts_match_goldens() -> Result<()> {
    for c in cases()? {
        check_golden(
            &format!("{}.script.nft", c.name),
            &redirect::render_script(&c.plan),
        )?;
    }
    Ok(())
}

fn apply_case(c: &Case) -> Result<()> {
    let ns = TestNs::new(c.name)?;
    ensure!(
        !redirect::is_applied(&ns.netns)?,
        "fresh netns reports applied"
    );
    redirect::apply(&ns.netns, &c.plan)?;
    let once = ns.ruleset()?;
    check_golden(&format!("{}.nft", c.name), &once)?;
    assert_routing(&ns, c.plan.ipv6)?;
    ensure!(redirect::is_applied(&ns.netns)?, "is_applied after apply");

    // The agent's path: the node-wide plan and the pod's options through the rule applier.
    NftRules::new(c.node.clone()).apply_for_pod(&ns.netns, &c.pod)?;
    ensure!(ns.ruleset()? == once, "second apply changed the ruleset");
    assert_routing(&ns, c.plan.ipv6)?;

    // The script is valid nft, and nft itself installs exactly what we installed.
    let script = tempfile::NamedTempFile::new()?;
    std::fs::write(script.path(), redirect::render_script(&c.plan))?;
    let path = script.path().to_str().context("temp path")?;
    ns.exec("nft", &["-c", "-f", path])?;
    let by_nft = TestNs::new(&format!("{}-nft", c.name))?;
    by_nft.exec("nft", &["-f", path])?;
    ensure!(
        by_nft.ruleset()? == once,
        "nft -f listing differs:\n{}",
        by_nft.ruleset()?
    );
    Ok(())
}

#[test]
fn apply_v4_matches_golden() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    apply_case(&cases()?[0])
}

#[test]
fn apply_v4_dns_matches_golden() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    apply_case(&cases()?[1])
}

#[test]
fn apply_v4v6_matches_golden() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    apply_case(&cases()?[2])
}

#[test]
fn apply_v4v6_dns_matches_golden() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    apply_case(&cases()?[3])
}

#[test]
fn apply_v4_ingress_matches_golden() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    apply_case(&cases()?[4])
}

#[test]
fn apply_v4v6_virtual_interfaces_matches_golden() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    apply_case(&cases()?[5])
}

#[test]
fn changed_pod_options_converge() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let [v4, _, _, _, v4_ingress, v4v6_virt] = cases()?;
    let ns = TestNs::new("pod-switch")?;
    redirect::apply(&ns.netns, &v4v6_virt.plan)?;
    redirect::apply(&ns.netns, &v4_ingress.plan)?;
    check_golden("v4_ingress.nft", &ns.ruleset()?)?;
    assert_routing(&ns, false)?;
    redirect::apply(&ns.netns, &v4.plan)?;
    check_golden("v4.nft", &ns.ruleset()?)
}

#[test]
fn reapply_with_other_plan_converges() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let [v4, _, _, v4v6_dns, _, _] = cases()?;
    let ns = TestNs::new("switch")?;
    redirect::apply(&ns.netns, &v4v6_dns.plan)?;
    redirect::apply(&ns.netns, &v4.plan)?;
    check_golden("v4.nft", &ns.ruleset()?)?;
    assert_routing(&ns, false)
}

#[test]
fn remove_cleans_up_and_is_idempotent() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = TestNs::new("remove")?;
    redirect::apply(&ns.netns, &cases()?[3].plan)?;
    redirect::remove(&ns.netns)?;
    assert_clean(&ns)?;
    redirect::remove(&ns.netns)?;
    assert_clean(&ns)
}

#[test]
fn remove_on_untouched_netns_is_ok() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = TestNs::new("remove-empty")?;
    redirect::remove(&ns.netns)?;
    assert_clean(&ns)
}

/// Accepts one connection on `l` (non-blocking), waiting up to a few seconds for the handshake.
fn accept_one(l: &TcpListener) -> Result<TcpStream> {
    l.set_nonblocking(true)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match l.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("accept"),
        }
    }
}

fn listen(ns: &Netns, port: u16) -> Result<TcpListener> {
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    Ok(ns.run(move || TcpListener::bind(addr))??)
}

/// Connects from inside `ns` (optionally from `source`), sends one byte, returns the socket.
fn connect(ns: &Netns, to: SocketAddrV4, source: Option<Ipv4Addr>) -> Result<TcpStream> {
    let s = ns.run(move || -> Result<TcpStream> {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        if let Some(src) = source {
            sock.bind(&SocketAddr::from((src, 0)).into())?;
        }
        sock.connect_timeout(&SocketAddr::V4(to).into(), Duration::from_secs(5))
            .with_context(|| format!("connect {to}"))?;
        Ok(sock.into())
    })??;
    std::io::Write::write_all(&mut &s, b"x")?;
    Ok(s)
}

/// The destination the client asked for, as seen through the redirect (SO_ORIGINAL_DST).
fn original_dst(s: &TcpStream) -> Result<SocketAddrV4> {
    let raw = nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::OriginalDst)?;
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(raw.sin_addr.s_addr)),
        u16::from_be(raw.sin_port),
    ))
}

fn read_byte(mut s: &TcpStream) -> Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    ensure!(b == *b"x", "unexpected byte");
    Ok(())
}

#[test]
fn outbound_tcp_is_redirected_to_15001() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let ns = TestNs::new("outbound")?;
    // Any non-loopback interface with a route to the target will do (dummy may be unavailable).
    ns.exec(
        "ip",
        &["link", "add", "o0", "type", "veth", "peer", "name", "o1"],
    )?;
    ns.exec("ip", &["addr", "add", "10.254.1.2/24", "dev", "o0"])?;
    ns.exec("ip", &["link", "set", "o0", "up"])?;
    ns.exec("ip", &["link", "set", "o1", "up"])?;
    redirect::apply(&ns.netns, &RedirectPlan::default())?;

    let outbound = listen(&ns.netns, 15001)?;
    let target = SocketAddrV4::new(Ipv4Addr::new(10, 254, 1, 9), 80);
    let _client = connect(&ns.netns, target, None)?;
    let accepted = accept_one(&outbound)?;
    read_byte(&accepted)?;
    ensure!(original_dst(&accepted)? == target, "original dst lost");
    Ok(())
}

/// A pod netns with `vp` = 10.254.2.2/24 and a peer netns with `vc` = 10.254.2.1/24 plus the
/// probe SNAT address 169.254.7.127, joined by a veth pair.
fn pod_and_peer(tag: &str) -> Result<(TestNs, TestNs, Ipv4Addr)> {
    let pod = TestNs::new(&format!("{tag}-pod"))?;
    let peer = TestNs::new(&format!("{tag}-peer"))?;
    run(
        "ip",
        &[
            "link", "add", "vp", "netns", &pod.name, "type", "veth", "peer", "name", "vc", "netns",
            &peer.name,
        ],
    )?;
    pod.exec("ip", &["addr", "add", "10.254.2.2/24", "dev", "vp"])?;
    pod.exec("ip", &["link", "set", "vp", "up"])?;
    pod.exec("ip", &["route", "add", "default", "dev", "vp"])?;
    peer.exec("ip", &["addr", "add", "10.254.2.1/24", "dev", "vc"])?;
    peer.exec("ip", &["addr", "add", "169.254.7.127/32", "dev", "vc"])?;
    peer.exec("ip", &["link", "set", "vc", "up"])?;
    peer.exec("ip", &["link", "set", "lo", "up"])?;
    Ok((pod, peer, Ipv4Addr::new(10, 254, 2, 2)))
}

#[test]
fn inbound_tcp_is_redirected_except_hbone_and_probes() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let (pod, peer, pod_ip) = pod_and_peer("in")?;
    redirect::apply(&pod.netns, &RedirectPlan::default())?;

    let inbound = listen(&pod.netns, 15006)?;
    let hbone = listen(&pod.netns, 15008)?;
    let app = listen(&pod.netns, 8080)?;

    let _c1 = connect(&peer.netns, SocketAddrV4::new(pod_ip, 8080), None)?;
    let s1 = accept_one(&inbound).context("plain inbound must reach 15006")?;
    read_byte(&s1)?;
    ensure!(
        original_dst(&s1)? == SocketAddrV4::new(pod_ip, 8080),
        "original dst lost"
    );

    let _c2 = connect(&peer.netns, SocketAddrV4::new(pod_ip, 15008), None)?;
    read_byte(&accept_one(&hbone).context("15008 must not be redirected")?)?;

    let probe = Some(Ipv4Addr::new(169, 254, 7, 127));
    let _c3 = connect(&peer.netns, SocketAddrV4::new(pod_ip, 8080), probe)?;
    read_byte(&accept_one(&app).context("probes must reach the app port")?)?;
    Ok(())
}

#[test]
fn ingress_mode_leaves_inbound_tcp_alone() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let (pod, peer, pod_ip) = pod_and_peer("ing")?;
    let plan = RedirectPlan::default().for_pod(&ingress_mode());
    redirect::apply(&pod.netns, &plan)?;

    let _inbound = listen(&pod.netns, 15006)?;
    let app = listen(&pod.netns, 8080)?;
    let _c = connect(&peer.netns, SocketAddrV4::new(pod_ip, 8080), None)?;
    read_byte(&accept_one(&app).context("ingress mode: inbound must reach the app port")?)?;
    Ok(())
}

#[test]
fn tcp_from_a_virtual_interface_is_redirected_to_15001() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let (pod, peer, pod_ip) = pod_and_peer("virt")?;
    let plan = RedirectPlan::default().for_pod(&virtual_interfaces(&["vp"])?);
    redirect::apply(&pod.netns, &plan)?;

    let outbound = listen(&pod.netns, 15001)?;
    let _inbound = listen(&pod.netns, 15006)?;
    let target = SocketAddrV4::new(pod_ip, 8080);
    let _c = connect(&peer.netns, target, None)?;
    let s = accept_one(&outbound).context("TCP in on a virtual interface must reach 15001")?;
    read_byte(&s)?;
    ensure!(original_dst(&s)? == target, "original dst lost");
    Ok(())
}

/// An agent restart re-applies each pod's unchanged plan: the tables stay in place (same
/// handles, no window without rules). A changed plan still replaces them.
#[test]
fn reapplying_an_unchanged_plan_leaves_the_tables_in_place() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let c = &cases()?[0];
    let ns = TestNs::new("keep")?;
    redirect::apply(&ns.netns, &c.plan)?;
    // the pod's own DNAT chain, added after ours at the same hook and priority
    ns.exec(
        "nft",
        &["add table inet pod-own ; add chain inet pod-own pre { type nat hook prerouting priority -100 ; } ; add rule inet pod-own pre tcp dport 8080 dnat ip to 10.0.0.9:9090"],
    )?;
    let listing =
        |ns: &TestNs| ns.exec("nft", &["-a", "list", "table", "inet", "istio-ambient-nat"]);
    let before = listing(&ns)?;
    ensure!(before.contains("# handle"), "{before}");
    redirect::apply(&ns.netns, &c.plan)?;
    let after = listing(&ns)?;
    ensure!(
        before == after,
        "an unchanged plan recreated the table:\nbefore:\n{before}\nafter:\n{after}"
    );
    let mut changed = c.plan.clone();
    changed.dns_capture = !changed.dns_capture;
    redirect::apply(&ns.netns, &changed)?;
    ensure!(listing(&ns)? != before, "a changed plan must be applied");
    Ok(())
}

/// Tables an older version left with istio-cni's nat priority (`dstnat`, -100) are not current:
/// applying the plan replaces them with chains at -101, so the redirect runs before a pod's own nat
/// chains.
#[test]
fn tables_at_an_older_priority_are_replaced() -> Result<()> {
    if !privileged() {
        return Ok(());
    }
    let c = &cases()?[0];
    let ns = TestNs::new("prio")?;
    let old = redirect::render_script(&c.plan).replace("priority -101 ;", "priority -100 ;");
    ensure!(old.contains("priority -100 ;"), "{old}");
    let path = std::env::temp_dir().join(format!("ztnode-old-prio-{}.nft", std::process::id()));
    std::fs::write(&path, &old)?;
    let loaded = ns.exec("nft", &["-f", &path.to_string_lossy()]);
    let _ = std::fs::remove_file(&path);
    loaded?;
    let listing = |ns: &TestNs| ns.exec("nft", &["list", "table", "inet", "istio-ambient-nat"]);
    ensure!(
        listing(&ns)?.contains("priority dstnat;"),
        "{}",
        listing(&ns)?
    );
    redirect::apply(&ns.netns, &c.plan)?;
    let after = listing(&ns)?;
    ensure!(
        after.contains("priority dstnat - 1;") && !after.contains("priority dstnat;"),
        "the old chains were kept:\n{after}"
    );
    Ok(())
}
