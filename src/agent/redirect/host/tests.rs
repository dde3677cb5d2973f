//! Pure tests of the host probe rule set against istio-cni's `hostprobe*.golden` and against the
//! expressions `nft --debug=netlink` (1.0.6) prints for the same rules.

use crate::nft::{CmpOp, Expr, ImmediateData, MetaKey, NatKind, PayloadBase, Register};

use super::super::tests::{ISTIO_TEST_PROBE_V6, istio_golden, normalize};
use super::*;

/// istio-cni's test configuration: kubelet UID 1000, its v6 probe address.
fn istio_host(ipv6: bool) -> HostProbe {
    HostProbe {
        ipv6,
        probe_v6: ISTIO_TEST_PROBE_V6,
        ..HostProbe::new(1000)
    }
}

#[test]
fn script_matches_istio_hostprobe_golden() {
    assert_eq!(
        normalize(&istio_host(false).render_script()),
        normalize(&istio_golden("hostprobe.golden"))
    );
}

#[test]
fn script_matches_istio_hostprobe_ipv6_golden() {
    assert_eq!(
        normalize(&istio_host(true).render_script()),
        normalize(&istio_golden("hostprobe_ipv6.golden"))
    );
}

#[test]
fn script_is_byte_exact_for_the_default_node() {
    let script = HostProbe::new(0).render_script();
    assert_eq!(
        script,
        "add table inet istio-ambient-nat\n\
         flush table inet istio-ambient-nat\n\
         add chain inet istio-ambient-nat postrouting { type nat hook postrouting priority 100 ; }\n\
         add rule inet istio-ambient-nat postrouting meta l4proto tcp skuid 0 ip daddr @istio-inpod-probes-v4 counter snat to 169.254.7.127\n"
    );
}

#[test]
fn sets_script_names_both_sets_with_istios_comment() {
    assert_eq!(
        HostProbe {
            ipv6: true,
            ..HostProbe::new(1)
        }
        .render_sets_script(),
        "add table inet istio-ambient-nat\n\
         add set inet istio-ambient-nat istio-inpod-probes-v4 { type ipv4_addr ; comment \"UUID of the pods that are part of ambient mesh\" ; }\n\
         add set inet istio-ambient-nat istio-inpod-probes-v6 { type ipv6_addr ; comment \"UUID of the pods that are part of ambient mesh\" ; }\n"
    );
}

fn r1() -> Register {
    Register::R1
}

fn meta(key: MetaKey) -> Expr {
    Expr::Meta { key, dreg: r1() }
}

fn eq(data: Vec<u8>) -> Expr {
    Expr::Cmp {
        sreg: r1(),
        op: CmpOp::Eq,
        data,
    }
}

#[test]
fn rule_expressions_follow_nft() {
    // nft --debug=netlink: meta load l4proto; cmp eq 6; meta load skuid; cmp eq 0x3e8; meta load
    // nfproto; cmp eq 2; payload load 4b @ network header + 16; lookup set; counter; immediate
    // 0x7f07fea9; nat snat ip addr_min reg 1.
    let rules = istio_host(true).rules();
    assert_eq!(rules.len(), 2);
    assert_eq!(
        rules[0].exprs(),
        [
            meta(MetaKey::L4Proto),
            eq(vec![6]),
            meta(MetaKey::SkUid),
            eq(1000u32.to_ne_bytes().to_vec()),
            meta(MetaKey::NfProto),
            eq(vec![2]),
            Expr::Payload {
                base: PayloadBase::Network,
                offset: 16,
                len: 4,
                dreg: r1(),
            },
            Expr::Lookup {
                sreg: r1(),
                set: PROBE_SET_V4.into(),
            },
            Expr::Counter,
            Expr::Immediate {
                dreg: r1(),
                data: ImmediateData::Value(vec![169, 254, 7, 127]),
            },
            Expr::Nat {
                kind: NatKind::Snat,
                family: crate::nft::Family::Ip,
                addr_min: r1(),
            },
        ]
    );
    // v6: nfproto 10, 16 bytes at offset 24, the v6 set, nat snat ip6.
    let v6 = rules[1].exprs();
    assert_eq!(v6[5], eq(vec![10]));
    assert!(matches!(
        v6[6],
        Expr::Payload {
            offset: 24,
            len: 16,
            ..
        }
    ));
    assert!(matches!(&v6[7], Expr::Lookup { set, .. } if set == PROBE_SET_V6));
    assert!(matches!(
        &v6[9],
        Expr::Immediate { data: ImmediateData::Value(a), .. } if a[..2] == [0xe9, 0xac]
    ));
    assert!(matches!(
        v6[10],
        Expr::Nat {
            family: crate::nft::Family::Ip6,
            ..
        }
    ));
}

#[test]
fn apply_batch_keeps_elements_and_drops_the_v6_set_without_ipv6() {
    let shown = |h: &HostProbe| -> Vec<String> {
        h.apply_batch()
            .commands()
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    let t = "inet istio-ambient-nat";
    let chain = format!("add chain {t} postrouting {{ type nat hook postrouting priority 100 ; }}");
    let rule = format!(
        "add rule {t} postrouting [meta cmp meta cmp meta cmp payload lookup counter immediate nat]"
    );
    assert_eq!(
        shown(&HostProbe::new(1000)),
        [
            format!("add table {t}"),
            format!("flush table {t}"),
            format!("add set {t} istio-inpod-probes-v4 {{ type ipv4_addr ; }}"),
            format!("add set {t} istio-inpod-probes-v6 {{ type ipv6_addr ; }}"),
            format!("delete set {t} istio-inpod-probes-v6"),
            chain.clone(),
            rule.clone(),
        ]
    );
    assert_eq!(
        shown(&istio_host(true)),
        [
            format!("add table {t}"),
            format!("flush table {t}"),
            format!("add set {t} istio-inpod-probes-v4 {{ type ipv4_addr ; }}"),
            format!("add set {t} istio-inpod-probes-v6 {{ type ipv6_addr ; }}"),
            chain,
            rule.clone(),
            rule,
        ]
    );
    assert!(
        !shown(&istio_host(true))
            .iter()
            .any(|c| c.starts_with("flush set") || c.starts_with("delete table")),
        "apply never touches set elements"
    );
}

#[test]
fn usable_addresses_are_unmapped_and_v6_needs_ipv6() {
    let ips: Vec<IpAddr> = ["10.0.0.1", "::ffff:10.0.0.2", "fd00::3"]
        .iter()
        .map(|s| s.parse().expect("ip"))
        .collect();
    let v4only: Vec<IpAddr> = HostProbe::new(0).usable(&ips).collect();
    assert_eq!(
        v4only,
        [
            "10.0.0.1".parse::<IpAddr>().expect("ip"),
            "10.0.0.2".parse().expect("ip")
        ]
    );
    assert_eq!(istio_host(true).usable(&ips).count(), 3);
}

#[test]
fn sync_batch_flushes_refills_and_splits_large_snapshots() {
    let pods: Vec<(String, Vec<IpAddr>)> = (0..600u32)
        .map(|i| {
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
            (format!("{i:08}-0000-0000-0000-000000000000"), vec![ip])
        })
        .collect();
    let b = istio_host(true).sync_batch(&pods);
    let shown: Vec<String> = b
        .commands()
        .iter()
        .map(|c| {
            c.to_string()
                .split(" {")
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    let t = "inet istio-ambient-nat";
    assert_eq!(
        shown,
        [
            format!("flush set {t} istio-inpod-probes-v4"),
            format!("add element {t} istio-inpod-probes-v4"),
            format!("add element {t} istio-inpod-probes-v4"),
            format!("add element {t} istio-inpod-probes-v4"),
            format!("flush set {t} istio-inpod-probes-v6"),
        ]
    );
    b.encode(1).expect("every command fits its length fields");

    // Duplicates go to the first pod; an empty snapshot only flushes.
    let dup = vec![
        ("a".to_owned(), vec![ip("10.0.0.1")]),
        ("b".to_owned(), vec![ip("10.0.0.1"), ip("fd00::1")]),
    ];
    let cmds = istio_host(true).sync_batch(&dup);
    let shown: Vec<String> = cmds.commands().iter().map(ToString::to_string).collect();
    assert_eq!(
        shown[1],
        format!("add element {t} istio-inpod-probes-v4 {{ 10.0.0.1 comment \"a\" }}")
    );
    assert_eq!(
        shown[3],
        format!("add element {t} istio-inpod-probes-v6 {{ fd00::1 comment \"b\" }}")
    );
    assert_eq!(HostProbe::new(0).sync_batch(&[]).commands().len(), 1);
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}
