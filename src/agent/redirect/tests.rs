//! Pure tests of the rendered rule set against istio-cni's nftables golden files.

use std::net::Ipv6Addr;

use super::*;

/// The v6 probe address istio-cni's unit tests use in `*_ipv6.golden`.
const ISTIO_TEST_PROBE_V6: Ipv6Addr = Ipv6Addr::new(
    0xe9ac, 0x1e77, 0x90ca, 0x399f, 0x4d6d, 0xece2, 0x2f9b, 0x3164,
);

fn istio_golden(name: &str) -> String {
    let path = format!(
        "{}/../shared/testdata/istio-nftables/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// Spelling-insensitive form of an nft script line: single spaces, `&`/`|` as `and`/`or`, and a
/// bare `mark` (nft's shorthand) written as `meta mark`.
fn normalize(script: &str) -> Vec<String> {
    script
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut out: Vec<&str> = Vec::new();
            for tok in line.split_whitespace() {
                let tok = match tok {
                    "&" => "and",
                    "|" => "or",
                    t => t,
                };
                if tok == "mark" && !matches!(out.last(), Some(&"meta" | &"ct")) {
                    out.push("meta");
                }
                out.push(tok);
            }
            out.join(" ")
        })
        .collect()
}

fn plan(ipv6: bool, dns_capture: bool) -> RedirectPlan {
    RedirectPlan {
        ipv6,
        dns_capture,
        probe_v6: ISTIO_TEST_PROBE_V6,
        ..RedirectPlan::default()
    }
}

#[track_caller]
fn assert_matches_istio(plan: &RedirectPlan, golden: &str) {
    let ours = normalize(&render_script(plan));
    let theirs = normalize(&istio_golden(golden));
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "line {} differs from {golden}", i + 1);
    }
    assert_eq!(ours.len(), theirs.len(), "line count vs {golden}");
}

#[test]
fn v4_with_dns_matches_istio_default() {
    assert_matches_istio(&plan(false, true), "default.golden");
}

#[test]
fn v4_v6_with_dns_matches_istio_default_ipv6() {
    assert_matches_istio(&plan(true, true), "default_ipv6.golden");
}

#[test]
fn v4_without_dns_matches_istio_dns_disabled() {
    assert_matches_istio(
        &plan(false, false),
        "dns_pod_disabled_and_on_globally.golden",
    );
}

#[test]
fn v4_v6_without_dns_matches_istio_dns_disabled_ipv6() {
    assert_matches_istio(
        &plan(true, false),
        "dns_pod_disabled_and_on_globally_ipv6.golden",
    );
}

#[test]
fn normalize_unifies_mark_spellings() {
    assert_eq!(
        normalize("x mark and 0xfff  != 0x539\ny meta mark & 0xfff == 1 ct mark | 2"),
        [
            "x meta mark and 0xfff != 0x539",
            "y meta mark and 0xfff == 1 ct mark or 2"
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
    let default = render_script(&plan(true, true));
    let p = RedirectPlan {
        proxy_mark: crate::mesh::PacketMark::new(0x540).expect("mark"),
        ..plan(true, true)
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
        ..plan(true, false)
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
    let shown: Vec<String> = apply_batch(&plan(false, false))
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
