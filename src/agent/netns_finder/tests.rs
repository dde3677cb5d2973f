//! Finder tests on a fake proc tree (a tempdir whose `<pid>/ns/net` are symlinks to plain files, so
//! each file's inode is a netns identity), plus one root test against a real netns.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

const UID_A: &str = "2c48913c-b29f-11e7-9350-020968147796";
const UID_B: &str = "0e4b9a5c-3a55-4a4e-9a0d-5f2e8c1b7d21";
const IP_A: &str = "10.0.0.7";
const IP_B: &str = "10.0.0.8";

struct FakeProc {
    dir: tempfile::TempDir,
}

impl FakeProc {
    /// A tree with pid 1 in netns `host`.
    fn new() -> FakeProc {
        let fake = FakeProc {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        std::fs::create_dir_all(fake.root()).expect("proc dir");
        std::fs::create_dir_all(fake.dir.path().join("ns")).expect("ns dir");
        fake.process(1, "0::/init.scope\n", "host", 1);
        fake
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    fn ns_file(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join("ns").join(name);
        if !p.exists() {
            std::fs::write(&p, name).expect("ns file");
        }
        p
    }

    fn id(&self, name: &str) -> NetnsId {
        stat_id(&self.ns_file(name)).expect("stat ns file")
    }

    fn process(&self, pid: u32, cgroup: &str, netns: &str, start: u64) {
        let dir = self.root().join(pid.to_string());
        std::fs::create_dir_all(dir.join("ns")).expect("pid dir");
        std::fs::write(dir.join("cgroup"), cgroup).expect("cgroup");
        symlink(self.ns_file(netns), dir.join("ns/net")).expect("ns/net link");
        let stat = format!(
            "{pid} (a (b) c) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {start} 8000 200\n"
        );
        std::fs::write(dir.join("stat"), stat).expect("stat");
    }

    fn pod_process(&self, pid: u32, uid: &str, netns: &str, start: u64) {
        let cgroup = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{pid:x}ab.scope\n",
            uid.replace('-', "_")
        );
        self.process(pid, &cgroup, netns, start);
    }
}

/// A check that answers from a table of netns -> addresses and counts its calls.
#[derive(Clone)]
struct FakeCheck {
    addrs: Arc<BTreeMap<NetnsId, Vec<IpAddr>>>,
    fail: Option<NetnsId>,
    calls: Arc<AtomicUsize>,
}

impl FakeCheck {
    fn new(fake: &FakeProc, table: &[(&str, &[&str])]) -> FakeCheck {
        let addrs = table
            .iter()
            .map(|(ns, ips)| (fake.id(ns), ips.iter().map(|i| ip(i)).collect()))
            .collect();
        FakeCheck {
            addrs: Arc::new(addrs),
            fail: None,
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl OwnershipCheck for FakeCheck {
    fn holds_any(&self, netns: &Netns, ips: &[IpAddr]) -> Result<bool, CheckError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail == Some(netns.id()) {
            return Err(CheckError::Netns(crate::netns::NetnsError::Addrs {
                id: netns.id(),
                source: nix::Error::EPERM,
            }));
        }
        let found = self.addrs.get(&netns.id()).cloned().unwrap_or_default();
        Ok(holds_any_ip(&found, ips))
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn query(uid: &str, ips: &[&str]) -> PodQuery {
    PodQuery {
        uid: PodUid::new(uid),
        ips: ips.iter().map(|i| ip(i)).collect(),
    }
}

fn finder(fake: &FakeProc, check: &FakeCheck) -> NetnsFinder<FakeCheck> {
    NetnsFinder::with_check(fake.root(), HostNetns::FromProc, check.clone())
}

#[test]
fn finds_the_pod_netns_through_its_oldest_process() {
    let fake = FakeProc::new();
    fake.pod_process(300, UID_A, "a", 500); // app container
    fake.pod_process(200, UID_A, "a", 400); // pause: oldest
    fake.pod_process(250, UID_A, "a", 400); // same tick, higher pid
    fake.pod_process(400, UID_B, "b", 100); // another pod
    let check = FakeCheck::new(&fake, &[("a", &[IP_A]), ("b", &[IP_B])]);
    let found = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect("found");
    assert_eq!(found.owner.pid, 200);
    assert_eq!(found.owner.start_time, 400);
    assert_eq!(found.owner.netns, fake.id("a"));
    assert_eq!(found.netns.id(), fake.id("a"));
    assert_eq!(found.path, fake.root().join("200/ns/net"));
    assert!(found.others.is_empty() && found.rejected.is_empty());
    assert_eq!(check.calls(), 1, "one netns, verified once");
}

#[test]
fn both_uid_spellings_and_cgroup_versions_are_found() {
    let cgroups = [
        format!(
            "12:memory:/kubepods/besteffort/pod{UID_A}/9bca8d63\n1:name=systemd:/kubepods/besteffort/pod{UID_A}/9bca8d63\n"
        ),
        format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/docker-9bca8d63.scope\n",
            UID_A.replace('-', "_")
        ),
        format!("0::/../pod{UID_A}/9bca8d63\n"),
    ];
    for cgroup in cgroups {
        let fake = FakeProc::new();
        fake.process(77, &cgroup, "a", 10);
        let check = FakeCheck::new(&fake, &[("a", &[IP_A])]);
        let found = finder(&fake, &check).find(&query(UID_A, &[IP_A]));
        assert_eq!(found.expect(&cgroup).owner.pid, 77, "{cgroup}");
    }
    // The query may spell the UID either way, too.
    let fake = FakeProc::new();
    fake.pod_process(77, UID_A, "a", 10);
    let check = FakeCheck::new(&fake, &[("a", &[IP_A])]);
    let upper = UID_A.to_uppercase().replace('-', "_");
    assert!(finder(&fake, &check).find(&query(&upper, &[IP_A])).is_ok());
}

#[test]
fn host_netns_is_never_a_pod_netns() {
    let fake = FakeProc::new();
    fake.pod_process(50, UID_A, "host", 5);
    fake.pod_process(51, UID_A, "host", 6);
    let check = FakeCheck::new(&fake, &[("host", &[IP_A])]);
    let err = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect_err("host");
    assert!(
        matches!(
            err,
            FindError::NotFound {
                in_host_netns: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(check.calls(), 0, "the host netns is not even entered");

    // A given host identity is used instead of pid 1's.
    let given =
        NetnsFinder::with_check(fake.root(), HostNetns::Id(fake.id("other")), check.clone());
    let found = given
        .find(&query(UID_A, &[IP_A]))
        .expect("host id given elsewhere");
    assert_eq!(found.owner.pid, 50);
}

#[test]
fn oldest_verified_netns_wins_and_transiting_processes_are_rejected() {
    let fake = FakeProc::new();
    fake.pod_process(10, UID_A, "foreign", 1); // oldest, but in a netns without the pod's IP
    fake.pod_process(20, UID_A, "a", 2);
    fake.pod_process(30, UID_A, "nested", 3); // younger netns of the pod (nested container)
    let check = FakeCheck::new(
        &fake,
        &[("foreign", &[IP_B]), ("a", &[IP_A]), ("nested", &[IP_A])],
    );
    let found = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect("found");
    assert_eq!(found.owner.pid, 20);
    assert_eq!(found.rejected.len(), 1);
    assert_eq!(found.rejected[0].candidate.pid, 10);
    assert!(matches!(found.rejected[0].reason, Rejection::NoPodIp));
    assert_eq!(found.others.iter().map(|c| c.pid).collect::<Vec<_>>(), [30]);
    assert_eq!(check.calls(), 2, "the younger netns is not entered");
}

#[test]
fn unverifiable_candidates_are_reported() {
    let fake = FakeProc::new();
    fake.pod_process(10, UID_A, "x", 1);
    fake.pod_process(11, UID_A, "y", 2);
    let mut check = FakeCheck::new(&fake, &[("x", &["10.9.9.9"])]);
    check.fail = Some(fake.id("y"));
    let err = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect_err("none verified");
    let FindError::NotVerified { rejected, .. } = &err else {
        panic!("want NotVerified, got {err}");
    };
    assert_eq!(rejected.len(), 2);
    assert!(matches!(rejected[0].reason, Rejection::NoPodIp));
    assert!(matches!(
        rejected[1].reason,
        Rejection::Check(CheckError::Netns(crate::netns::NetnsError::Addrs { .. }))
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("pid 10 in netns") && msg.contains("ownership check failed"),
        "{msg}"
    );
}

#[test]
fn same_tick_in_two_verified_netns_is_ambiguous() {
    let fake = FakeProc::new();
    fake.pod_process(10, UID_A, "x", 7);
    fake.pod_process(11, UID_A, "y", 7);
    let check = FakeCheck::new(&fake, &[("x", &[IP_A]), ("y", &[IP_A])]);
    let err = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect_err("ambiguous");
    assert!(
        matches!(err, FindError::Ambiguous { first, second, .. } if first.pid == 10 && second.pid == 11),
        "{err}"
    );

    // Only one of them verified: no ambiguity.
    let check = FakeCheck::new(&fake, &[("y", &[IP_A])]);
    let found = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect("one verified");
    assert_eq!(found.owner.pid, 11);
    assert_eq!(found.rejected.len(), 1);
}

#[test]
fn pods_without_ips_are_deferred_and_bad_uids_refused() {
    let fake = FakeProc::new();
    fake.pod_process(10, UID_A, "a", 1);
    let check = FakeCheck::new(&fake, &[("a", &[IP_A])]);
    let f = finder(&fake, &check);
    assert!(matches!(
        f.find(&query(UID_A, &[])),
        Err(FindError::NoPodIps { .. })
    ));
    assert!(matches!(
        f.find(&query("not-a-uid", &[IP_A])),
        Err(FindError::BadUid { .. })
    ));
    assert_eq!(check.calls(), 0);
}

#[test]
fn scan_errors_name_the_path() {
    let fake = FakeProc::new();
    let check = FakeCheck::new(&fake, &[]);
    let missing = NetnsFinder::with_check(
        fake.dir.path().join("nope"),
        HostNetns::FromProc,
        check.clone(),
    );
    let err = missing.find(&query(UID_A, &[IP_A])).expect_err("no proc");
    assert!(
        matches!(err, FindError::Scan(ScanError::HostNetns { .. })),
        "{err}"
    );
    let missing = NetnsFinder::with_check(
        fake.dir.path().join("nope"),
        HostNetns::Id(fake.id("host")),
        check.clone(),
    );
    let err = missing.find(&query(UID_A, &[IP_A])).expect_err("no proc");
    assert!(
        matches!(err, FindError::Scan(ScanError::ReadProc { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("nope"), "{err}");

    std::fs::remove_file(fake.root().join("1/ns/net")).expect("rm host ns");
    let err = finder(&fake, &check)
        .find(&query(UID_A, &[IP_A]))
        .expect_err("no host ns");
    assert!(err.to_string().contains("1/ns/net"), "{err}");
}

#[test]
fn one_scan_serves_many_pods_and_skips_odd_entries() {
    let fake = FakeProc::new();
    fake.pod_process(10, UID_A, "a", 1);
    fake.pod_process(20, UID_B, "b", 2);
    // Conflicting cgroup (two pods): skipped.
    fake.process(
        5,
        &format!("2:cpu:/kubepods/pod{UID_A}/c1\n1:memory:/kubepods/pod{UID_B}/c1\n"),
        "b",
        0,
    );
    // Missing stat: skipped.
    fake.pod_process(6, UID_B, "b", 0);
    std::fs::remove_file(fake.root().join("6/stat")).expect("rm stat");
    // Unparsable stat: skipped.
    fake.pod_process(7, UID_B, "b", 0);
    std::fs::write(fake.root().join("7/stat"), "7 (x) S 1").expect("short stat");
    // Non-numeric entries and dangling ns links.
    std::fs::create_dir_all(fake.root().join("self")).expect("self");
    std::fs::write(fake.root().join("uptime"), "1 1").expect("uptime");
    fake.pod_process(8, UID_B, "gone", 0);
    std::fs::remove_file(fake.ns_file("gone")).expect("rm ns");

    let check = FakeCheck::new(&fake, &[("a", &[IP_A]), ("b", &["::ffff:10.0.0.8"])]);
    let uid_c = "11111111-2222-3333-4444-555555555555";
    let all = finder(&fake, &check)
        .find_all(&[
            query(UID_A, &[IP_A]),
            query(UID_B, &[IP_B]),
            query(uid_c, &[IP_A]),
        ])
        .expect("scan");
    assert_eq!(all.len(), 3);
    assert_eq!(all[&PodUid::new(UID_A)].as_ref().expect("a").owner.pid, 10);
    let b = all[&PodUid::new(UID_B)].as_ref().expect("b");
    assert_eq!((b.owner.pid, b.netns.id()), (20, fake.id("b")));
    assert!(matches!(
        all[&PodUid::new(uid_c)],
        Err(FindError::NotFound {
            in_host_netns: 0,
            ..
        })
    ));
}

#[test]
fn addresses_match_across_v4_mapped_forms() {
    let cases: [(&[&str], &[&str], bool); 7] = [
        (&["10.0.0.7"], &["10.0.0.7"], true),
        (&["10.0.0.7"], &["10.0.0.8"], false),
        (&["::ffff:10.0.0.7"], &["10.0.0.7"], true),
        (&["10.0.0.7"], &["::ffff:10.0.0.7"], true),
        (&["127.0.0.1", "fd00::7"], &["10.0.0.7", "fd00::7"], true),
        (&[], &["10.0.0.7"], false),
        (&["fd00::7"], &["fd00::8"], false),
    ];
    for (found, wanted, want) in cases {
        let f: Vec<IpAddr> = found.iter().map(|s| ip(s)).collect();
        let w: Vec<IpAddr> = wanted.iter().map(|s| ip(s)).collect();
        assert_eq!(holds_any_ip(&f, &w), want, "{found:?} vs {wanted:?}");
    }
}

#[test]
fn start_time_is_field_22() {
    let cases = [
        (
            "1 (init) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 42 8000 200",
            Some(42),
        ),
        (
            "9 (a) b (c)) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 43 8000",
            Some(43),
        ),
        (
            "9 (sleep) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0",
            None,
        ),
        (
            "9 (sleep) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 x 1",
            None,
        ),
        ("no parens", None),
    ];
    for (stat, want) in cases {
        assert_eq!(start_time_of(stat), want, "{stat}");
    }
}

/// Root only: a real netns (made by `unshare -n`, so nothing is created on the machine and it
/// vanishes with its process) holding a sleeping process with a test address, found through a
/// proc tree whose entries link to the real `/proc` files, and verified by [`InterfaceAddrCheck`].
#[test]
fn finds_a_real_netns_with_the_real_check() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var_os("CI").is_none(), "root required under CI");
        eprintln!("SKIP finds_a_real_netns_with_the_real_check: needs root");
        return;
    }
    let pod_ip = "10.254.77.9";
    let child = std::process::Command::new("unshare")
        .args(["-n", "sh", "-c"])
        .arg(format!(
            "ip link set lo up && ip addr add {pod_ip}/32 dev lo && exec sleep 30"
        ))
        .spawn()
        .expect("spawn unshare");
    let guard = crate::lab::ProcessGuard(child);
    let pid = guard.0.id();
    let real = Path::new("/proc").join(pid.to_string());
    let ready = (0..250).any(|_| {
        let ok = Netns::open(real.join("ns/net"))
            .ok()
            .and_then(|ns| InterfaceAddrCheck.holds_any(&ns, &[ip(pod_ip)]).ok())
            .unwrap_or(false);
        if !ok {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        ok
    });
    assert!(ready, "the child's netns never got {pod_ip}");

    let dir = tempfile::tempdir().expect("tempdir");
    let link = |pid_dir: &str, real_pid: &str| {
        let d = dir.path().join(pid_dir);
        std::fs::create_dir_all(d.join("ns")).expect("pid dir");
        symlink(format!("/proc/{real_pid}/ns/net"), d.join("ns/net")).expect("ns link");
        symlink(format!("/proc/{real_pid}/stat"), d.join("stat")).expect("stat link");
        d
    };
    // The test's own netns stands in for the host's (pid 1's may be out of reach in a sandbox).
    let me = std::process::id().to_string();
    link("1", &me);
    let cgroup = format!("0::/kubepods/besteffort/pod{UID_A}/0123abcd\n");
    std::fs::write(
        link(&pid.to_string(), &pid.to_string()).join("cgroup"),
        &cgroup,
    )
    .expect("cgroup");
    // A decoy process of the same pod in the "host" netns: skipped without being entered.
    std::fs::write(link(&me, &me).join("cgroup"), &cgroup).expect("cgroup");

    let f = NetnsFinder::new(dir.path());
    let found = f
        .find(&query(UID_A, &[pod_ip]))
        .expect("found the real netns");
    assert_eq!(found.owner.pid, pid);
    let direct = Netns::open(real.join("ns/net")).expect("open child netns");
    assert_eq!(found.netns, direct);
    assert_ne!(found.netns, Netns::current().expect("own netns"));
    assert!(found.rejected.is_empty() && found.others.is_empty());

    let err = f
        .find(&query(UID_A, &["10.254.77.10"]))
        .expect_err("wrong IP");
    let FindError::NotVerified { rejected, .. } = err else {
        panic!("want NotVerified, got {err}");
    };
    assert!(
        rejected
            .iter()
            .any(|r| r.candidate.pid == pid && matches!(r.reason, Rejection::NoPodIp))
    );
}
