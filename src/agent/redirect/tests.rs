//! Pure tests of the rendered rule set against istio-cni's nftables golden files.

use std::net::Ipv6Addr;

use super::*;
use crate::agent::enroll::{InterfaceName, PodOptions};

/// The v6 probe address istio-cni's unit tests use in `*_ipv6.golden`.
pub(super) const ISTIO_TEST_PROBE_V6: Ipv6Addr = Ipv6Addr::new(
    0xe9ac, 0x1e77, 0x90ca, 0x399f, 0x4d6d, 0xece2, 0x2f9b, 0x3164,
);

pub(super) fn istio_golden(name: &str) -> String {
    let path = format!(
        "{}/../shared/testdata/istio-nftables/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// Spelling-insensitive form of an nft script line: single spaces, `&`/`|` as `and`/`or`, a bare
/// `mark` (nft's shorthand) written as `meta mark`, and names unquoted (`iifname "eth1"` is
/// `iifname eth1`).
pub(super) fn normalize(script: &str) -> Vec<String> {
    script
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut out: Vec<String> = Vec::new();
            for tok in line.split_whitespace() {
                let tok = match tok {
                    "&" => "and",
                    "|" => "or",
                    t => t,
                };
                if tok == "mark" && !matches!(out.last().map(String::as_str), Some("meta" | "ct")) {
                    out.push("meta".into());
                }
                out.push(tok.replace('"', ""));
            }
            out.join(" ")
        })
        .collect()
}

/// The node-wide plan of istio-cni's unit tests (`constructTestConfig`): its v6 probe address,
/// global DNS capture `dns`.
fn node(ipv6: bool, dns: bool) -> RedirectPlan {
    RedirectPlan {
        ipv6,
        dns_capture: dns,
        probe_v6: ISTIO_TEST_PROBE_V6,
        ..RedirectPlan::default()
    }
}

fn iface(name: &str) -> InterfaceName {
    InterfaceName::new(name).expect("interface name")
}

/// istio-cni's in-pod golden cases (`cni/pkg/nftables/common_test.go`
/// `GetCommonInPodTestCases`): golden stem, global DNS capture, pod options. Each runs with IPv4
/// only (`<stem>.golden`) and dual stack (`<stem>_ipv6.golden`).
fn istio_case(stem: &str) -> (bool, PodOptions) {
    let virt = || vec![iface("fake1s0f0"), iface("fake1s0f1")];
    match stem {
        "default" => (true, PodOptions::default()),
        "ingress" => (
            false,
            PodOptions {
                bypass_inbound_capture: true,
                ..Default::default()
            },
        ),
        "virtual_interfaces" => (
            false,
            PodOptions {
                reroute_virtual_interfaces: virt(),
                ..Default::default()
            },
        ),
        "ingress_and_virtual_interfaces" => (
            false,
            PodOptions {
                bypass_inbound_capture: true,
                reroute_virtual_interfaces: virt(),
                ..Default::default()
            },
        ),
        "dns_pod_enabled_and_off_globally" => (
            false,
            PodOptions {
                dns_capture_override: Some(true),
                ..Default::default()
            },
        ),
        "dns_pod_disabled_and_on_globally" => (
            true,
            PodOptions {
                dns_capture_override: Some(false),
                ..Default::default()
            },
        ),
        other => panic!("no istio case {other}"),
    }
}

const ISTIO_STEMS: [&str; 6] = [
    "default",
    "ingress",
    "virtual_interfaces",
    "ingress_and_virtual_interfaces",
    "dns_pod_enabled_and_off_globally",
    "dns_pod_disabled_and_on_globally",
];

fn golden_name(stem: &str, ipv6: bool) -> String {
    if ipv6 {
        format!("{stem}_ipv6.golden")
    } else {
        format!("{stem}.golden")
    }
}

/// The pod plan of case `stem`, built the way the agent builds it: node-wide plan + pod options.
fn istio_plan(stem: &str, ipv6: bool) -> RedirectPlan {
    let (global_dns, pod) = istio_case(stem);
    node(ipv6, global_dns).for_pod(&pod)
}

/// `line` with our one deliberate difference from istio-cni undone: the nat base chains run at
/// [`rules::NAT_PRIORITY`] where istio-cni uses `dstnat` (-100).
fn as_istio_priority(line: String) -> String {
    let ours = format!("priority {} ;", rules::NAT_PRIORITY);
    if line.contains("{ type nat hook ") && line.ends_with(&format!("{ours} }}")) {
        line.replace(&ours, "priority -100 ;")
    } else {
        line
    }
}

/// Where `plan`'s script first differs from Istio's `golden` (normalized), if anywhere.
fn istio_mismatch(plan: &RedirectPlan, golden: &str) -> Option<String> {
    let ours: Vec<String> = normalize(&render_script(plan))
        .into_iter()
        .map(as_istio_priority)
        .collect();
    let theirs = normalize(&istio_golden(golden));
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        if a != b {
            return Some(format!(
                "line {} differs from {golden}:\n ours: {a}\n istio: {b}",
                i + 1
            ));
        }
    }
    (ours.len() != theirs.len())
        .then(|| format!("{} lines, {golden} has {}", ours.len(), theirs.len()))
}

#[track_caller]
fn assert_matches_istio(plan: &RedirectPlan, golden: &str) {
    if let Some(diff) = istio_mismatch(plan, golden) {
        panic!("{diff}");
    }
}

#[track_caller]
fn assert_istio_case(stem: &str, ipv6: bool) {
    assert_matches_istio(&istio_plan(stem, ipv6), &golden_name(stem, ipv6));
}

#[test]
fn default_matches_istio() {
    assert_istio_case("default", false);
}

#[test]
fn default_ipv6_matches_istio() {
    assert_istio_case("default", true);
}

#[test]
fn ingress_matches_istio() {
    assert_istio_case("ingress", false);
}

#[test]
fn ingress_ipv6_matches_istio() {
    assert_istio_case("ingress", true);
}

#[test]
fn virtual_interfaces_matches_istio() {
    assert_istio_case("virtual_interfaces", false);
}

#[test]
fn virtual_interfaces_ipv6_matches_istio() {
    assert_istio_case("virtual_interfaces", true);
}

#[test]
fn ingress_and_virtual_interfaces_matches_istio() {
    assert_istio_case("ingress_and_virtual_interfaces", false);
}

#[test]
fn ingress_and_virtual_interfaces_ipv6_matches_istio() {
    assert_istio_case("ingress_and_virtual_interfaces", true);
}

#[test]
fn dns_pod_enabled_and_off_globally_matches_istio() {
    assert_istio_case("dns_pod_enabled_and_off_globally", false);
}

#[test]
fn dns_pod_enabled_and_off_globally_ipv6_matches_istio() {
    assert_istio_case("dns_pod_enabled_and_off_globally", true);
}

#[test]
fn dns_pod_disabled_and_on_globally_matches_istio() {
    assert_istio_case("dns_pod_disabled_and_on_globally", false);
}

#[test]
fn dns_pod_disabled_and_on_globally_ipv6_matches_istio() {
    assert_istio_case("dns_pod_disabled_and_on_globally", true);
}

#[test]
fn plain_node_plans_match_istio_dns_goldens() {
    // Without per-pod options the node-wide plan itself is what a pod gets.
    assert_matches_istio(&node(false, true), "default.golden");
    assert_matches_istio(&node(true, true), "default_ipv6.golden");
    assert_matches_istio(
        &node(false, false),
        "dns_pod_disabled_and_on_globally.golden",
    );
    assert_matches_istio(
        &node(true, false),
        "dns_pod_disabled_and_on_globally_ipv6.golden",
    );
}

/// Each case's golden is matched by its own options and by no other case's (so every test above
/// can fail), except where Istio's goldens are identical: a pod turning DNS on equals the default.
#[test]
fn each_istio_golden_is_matched_only_by_its_own_options() {
    let same = |a: &str, b: &str| {
        let pair = [a, b];
        a == b || pair.contains(&"default") && pair.contains(&"dns_pod_enabled_and_off_globally")
    };
    for ipv6 in [false, true] {
        for golden in ISTIO_STEMS {
            for opts in ISTIO_STEMS {
                let mismatch = istio_mismatch(&istio_plan(opts, ipv6), &golden_name(golden, ipv6));
                assert_eq!(
                    mismatch.is_none(),
                    same(golden, opts),
                    "options of {opts} vs {golden} (ipv6 {ipv6}): {mismatch:?}"
                );
            }
            // The other IP family never matches.
            let other = istio_mismatch(&istio_plan(golden, !ipv6), &golden_name(golden, ipv6));
            assert!(
                other.is_some(),
                "{golden} ipv6={ipv6} matched with ipv6={}",
                !ipv6
            );
        }
    }
}

#[test]
fn virtual_interface_rules_come_first_in_order_and_quoted() {
    let s = render_script(&istio_plan("virtual_interfaces", false));
    let pre: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with("add rule inet istio-ambient-nat istio-prerouting"))
        .collect();
    assert_eq!(
        pre[..4],
        [
            "add rule inet istio-ambient-nat istio-prerouting iifname \"fake1s0f0\" meta l4proto tcp counter redirect to :15001",
            "add rule inet istio-ambient-nat istio-prerouting iifname \"fake1s0f0\" meta l4proto tcp counter return",
            "add rule inet istio-ambient-nat istio-prerouting iifname \"fake1s0f1\" meta l4proto tcp counter redirect to :15001",
            "add rule inet istio-ambient-nat istio-prerouting iifname \"fake1s0f1\" meta l4proto tcp counter return",
        ]
    );
    assert!(
        !s.contains("istio-ambient-mangle istio-prerouting iifname"),
        "{s}"
    );
}

#[test]
fn ingress_mode_keeps_dns_capture_when_it_is_on() {
    let pod = PodOptions {
        bypass_inbound_capture: true,
        ..Default::default()
    };
    let s = render_script(&node(false, true).for_pod(&pod));
    assert!(!s.contains(":15006"), "{s}");
    assert!(!s.contains("ip saddr"), "{s}");
    assert!(s.contains("udp dport 53 counter redirect to :15053"), "{s}");
    assert!(s.contains("add table inet istio-ambient-raw"), "{s}");
}

#[test]
fn nat_chains_run_before_dstnat_and_the_rest_at_istio_priorities() {
    let script = render_script(&node(true, true));
    let chains: Vec<&str> = script.lines().filter(|l| l.contains("{ type ")).collect();
    assert_eq!(chains.len(), 6, "{script}");
    for line in chains {
        let want = if line.contains("type nat") {
            "priority -101 ;"
        } else if line.contains("istio-ambient-mangle") {
            "priority -150 ;"
        } else {
            "priority -300 ;"
        };
        assert!(line.contains(want), "{line}");
    }
}

#[test]
fn normalize_unifies_mark_spellings() {
    assert_eq!(
        normalize(
            "x mark and 0xfff  != 0x539\ny meta mark & 0xfff == 1 ct mark | 2\niifname \"a\""
        ),
        [
            "x meta mark and 0xfff != 0x539",
            "y meta mark and 0xfff == 1 ct mark or 2",
            "iifname a"
        ]
    );
}

#[test]
fn default_plan_uses_istio_probe_addresses() {
    let p = RedirectPlan::default();
    assert!(!p.ipv6 && !p.dns_capture);
    assert_eq!(p.probe_v4.to_string(), "169.254.7.127");
    assert_eq!(
        p.probe_v6.to_string(),
        "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
    );
}

#[test]
fn the_proxy_mark_comes_from_the_plan_everywhere_the_default_one_was() {
    let default = render_script(&node(true, true));
    let p = RedirectPlan {
        proxy_mark: crate::mesh::PacketMark::new(0x540).expect("mark"),
        ..node(true, true)
    };
    let s = render_script(&p);
    assert!(!s.contains("0x539"), "{s}");
    assert_eq!(s, default.replace("0x539", "0x540"));
    assert!(default.matches("0x539").count() >= 6, "{default}");
}

#[test]
fn probe_addresses_come_from_the_plan() {
    let p = RedirectPlan {
        probe_v4: "10.9.8.7".parse().expect("v4"),
        ..node(true, false)
    };
    let s = render_script(&p);
    assert!(s.contains("ip saddr 10.9.8.7 counter accept"), "{s}");
    assert!(!s.contains("169.254.7.127"), "{s}");
    assert!(
        s.contains(&format!("ip6 daddr {ISTIO_TEST_PROBE_V6} counter accept")),
        "{s}"
    );
}

#[test]
fn dns_off_batch_removes_raw_table() {
    let shown: Vec<String> = apply_batch(&node(false, false))
        .commands()
        .iter()
        .map(ToString::to_string)
        .collect();
    let tail = &shown[shown.len() - 2..];
    assert_eq!(
        tail,
        [
            "add table inet istio-ambient-raw",
            "delete table inet istio-ambient-raw"
        ]
    );
    assert!(
        !shown
            .iter()
            .any(|c| c.starts_with("add rule inet istio-ambient-raw"))
    );
}

#[test]
fn remove_batch_adds_then_deletes_every_table() {
    let shown: Vec<String> = remove_batch()
        .commands()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        shown,
        [
            "add table inet istio-ambient-nat",
            "delete table inet istio-ambient-nat",
            "add table inet istio-ambient-mangle",
            "delete table inet istio-ambient-mangle",
            "add table inet istio-ambient-raw",
            "delete table inet istio-ambient-raw",
        ]
    );
}

#[test]
fn fresh_netns_batch_has_no_deletes_and_existing_tables_are_replaced() {
    let plan = RedirectPlan {
        dns_capture: true,
        ..Default::default()
    };
    let fresh = apply_batch_for(&plan, &[]);
    assert!(
        !fresh
            .commands()
            .iter()
            .any(|c| matches!(c, Command::DelTable(_))),
        "{fresh:?}"
    );
    let all = rules::all_table_names();
    assert_eq!(apply_batch_for(&plan, &all), apply_batch(&plan));
    let some = apply_batch_for(&plan, &[NAT_TABLE]);
    let deletes: Vec<_> = some
        .commands()
        .iter()
        .filter_map(|c| match c {
            Command::DelTable(t) => Some(t.name.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(deletes, vec![NAT_TABLE.to_string()]);
}
