//! Unit tests of sets, set elements, `flush table`, the `lookup` / `meta skuid` / `nat` expressions
//! and the decoding of listings. Expected bytes were taken from `nft --debug=mnl` (nftables 1.0.6)
//! for the host probe rules (`add set ... { type ipv4_addr ; comment "..." ; }`, `add element ...
//! { 10.0.0.5 comment "pod-uid-1" }`, `delete element`, `flush set`, `flush table`, `delete set`,
//! `meta l4proto tcp skuid 1000 ip daddr @set counter snat to 169.254.7.127`). The set-id
//! references nft adds to `lookup` and to element lists (`NFTA_LOOKUP_SET_ID`,
//! `NFTA_SET_ELEM_LIST_SET_ID`) are left out on purpose (see `expr.rs`, `set.rs`), so those
//! messages are 8 bytes shorter than nft's.

use std::net::IpAddr;

use super::tests::{Msg, encode, h, in_fresh_netns, split};
use super::wire::{self, Attr};
use super::*;

const TABLE: &[u8] = b"istio-ambient-nat\0\0\0";
const SET4: &[u8] = b"istio-inpod-probes-v4\0\0\0";
const SET_COMMENT: &str = "UUID of the pods that are part of ambient mesh";

fn host_table() -> Table {
    Table::inet("istio-ambient-nat")
}

fn v4_set() -> Set {
    Set {
        table: host_table(),
        name: "istio-inpod-probes-v4".into(),
        key_type: SetKeyType::Ipv4Addr,
        comment: Some(SET_COMMENT.into()),
    }
}

fn addr(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn elems(list: Vec<SetElem>) -> SetElems {
    SetElems {
        table: host_table(),
        set: "istio-inpod-probes-v4".into(),
        elems: list,
    }
}

/// The one command message of a batch holding `c`.
fn one(c: Command) -> Msg {
    let mut b = Batch::new();
    b.push(c);
    let mut msgs = split(&b.encode(1).expect("encode"));
    assert_eq!(msgs.len(), 3, "begin, command, end");
    msgs.swap_remove(1)
}

#[test]
fn new_set_matches_nft() {
    let (ty, flags, _, nfgen, body) = one(Command::AddSet(v4_set()));
    assert_eq!(ty, 0x0a09, "NFT_MSG_NEWSET");
    assert_eq!(flags, 0x1 | 0x4 | 0x400, "request, ack, create");
    assert_eq!(nfgen, [1, 0, 0, 0]);
    let mut udata = vec![0, 4, 2, 0, 0, 0, 7, 0x2f];
    udata.extend_from_slice(SET_COMMENT.as_bytes());
    udata.extend_from_slice(&[0, 0]);
    let expected = [
        h(22, 1, false),
        TABLE.to_vec(),
        h(26, 2, false),
        SET4.to_vec(),
        h(8, 3, false),
        vec![0, 0, 0, 0],
        h(8, 4, false),
        vec![0, 0, 0, 7],
        h(8, 5, false),
        vec![0, 0, 0, 4],
        h(8, 10, false),
        vec![0, 0, 0, 1],
        h(59, 13, false),
        udata,
    ]
    .concat();
    assert_eq!(body, expected);
}

#[test]
fn sets_of_a_batch_get_ids_in_order() {
    let mut b = Batch::new();
    b.push(Command::AddSet(v4_set()))
        .push(Command::AddTable(host_table()))
        .push(Command::AddSet(v4_set()));
    let msgs = split(&b.encode(1).expect("encode"));
    let ids: Vec<Vec<u8>> = [&msgs[1], &msgs[3]]
        .iter()
        .map(|m| {
            let attrs = wire::parse_attrs(&m.4).expect("attrs");
            wire::find_attr(&attrs, 10).expect("NFTA_SET_ID").to_vec()
        })
        .collect();
    assert_eq!(ids, [vec![0, 0, 0, 1], vec![0, 0, 0, 2]]);
}

#[test]
fn v6_set_has_ip6addr_key_of_16_bytes() {
    let set = Set {
        name: "istio-inpod-probes-v6".into(),
        key_type: SetKeyType::Ipv6Addr,
        comment: None,
        ..v4_set()
    };
    let (_, _, _, _, body) = one(Command::AddSet(set));
    let attrs = wire::parse_attrs(&body).expect("attrs");
    assert_eq!(wire::find_attr(&attrs, 4), Some(&[0, 0, 0, 8][..]));
    assert_eq!(wire::find_attr(&attrs, 5), Some(&[0, 0, 0, 16][..]));
    assert_eq!(
        wire::find_attr(&attrs, 13),
        Some(&[0, 4, 2, 0, 0, 0][..]),
        "only the key byte order without a comment"
    );
}

#[test]
fn add_element_with_comment_matches_nft() {
    let el = SetElem::addr(addr("10.0.0.5"), Some("pod-uid-1".into()));
    let (ty, flags, _, _, body) = one(Command::AddSetElems(elems(vec![el])));
    assert_eq!(ty, 0x0a0c, "NFT_MSG_NEWSETELEM");
    assert_eq!(flags, 0x1 | 0x4 | 0x400);
    let expected = [
        h(22, 1, false),
        TABLE.to_vec(),
        h(26, 2, false),
        SET4.to_vec(),
        h(36, 3, true),
        h(32, 1, true),
        h(12, 1, true),
        h(8, 1, false),
        vec![10, 0, 0, 5],
        h(16, 6, false),
        b"\x00\x0apod-uid-1\x00".to_vec(),
    ]
    .concat();
    assert_eq!(body, expected);
}

#[test]
fn delete_element_sends_keys_only_as_nft() {
    let el = SetElem::addr(addr("10.0.0.5"), Some("ignored".into()));
    let (ty, flags, _, _, body) = one(Command::DelSetElems(elems(vec![el])));
    assert_eq!(ty, 0x0a0e, "NFT_MSG_DELSETELEM");
    assert_eq!(flags, 0x1 | 0x4);
    let expected = [
        h(22, 1, false),
        TABLE.to_vec(),
        h(26, 2, false),
        SET4.to_vec(),
        h(20, 3, true),
        h(16, 1, true),
        h(12, 1, true),
        h(8, 1, false),
        vec![10, 0, 0, 5],
    ]
    .concat();
    assert_eq!(body, expected);
}

#[test]
fn v6_element_key_is_16_network_order_bytes() {
    let el = SetElem::addr(addr("fd00::5"), None);
    assert_eq!(el.key[0], 0xfd);
    assert_eq!(el.key[15], 5);
    assert_eq!(el.key_addr(), Some(addr("fd00::5")));
    assert_eq!(el.to_string(), "fd00::5");
    let hex = SetElem {
        key: vec![1, 2, 3],
        comment: Some("c".into()),
    };
    assert_eq!(hex.key_addr(), None);
    assert_eq!(hex.to_string(), "0x010203 comment \"c\"");
}

#[test]
fn flush_set_delete_set_and_flush_table_match_nft() {
    let (ty, flags, _, _, body) = one(Command::FlushSet {
        table: host_table(),
        name: "istio-inpod-probes-v4".into(),
    });
    assert_eq!((ty, flags), (0x0a0e, 0x1 | 0x4));
    let expected = [
        h(26, 2, false),
        SET4.to_vec(),
        h(22, 1, false),
        TABLE.to_vec(),
    ]
    .concat();
    assert_eq!(body, expected, "set name first, as nft sends it");

    let (ty, _, _, _, body) = one(Command::DelSet {
        table: host_table(),
        name: "istio-inpod-probes-v4".into(),
    });
    assert_eq!(ty, 0x0a0b, "NFT_MSG_DELSET");
    let expected = [
        h(22, 1, false),
        TABLE.to_vec(),
        h(26, 2, false),
        SET4.to_vec(),
    ]
    .concat();
    assert_eq!(body, expected);

    let (ty, flags, _, nfgen, body) = one(Command::FlushTable(host_table()));
    assert_eq!((ty, flags), (0x0a08, 0x1 | 0x4), "NFT_MSG_DELRULE");
    assert_eq!(nfgen, [1, 0, 0, 0]);
    assert_eq!(body, [h(22, 1, false), TABLE.to_vec()].concat());
}

#[test]
fn too_long_comment_fails_before_sending() {
    let el = SetElem::addr(addr("10.0.0.5"), Some("x".repeat(MAX_COMMENT_LEN + 1)));
    let mut b = Batch::new();
    b.push(Command::AddSetElems(elems(vec![el])));
    let err = b.encode(1).expect_err("must fail");
    assert!(matches!(err, NftError::TooLarge { len: 129, .. }), "{err}");
    let ok = SetElem::addr(addr("10.0.0.5"), Some("x".repeat(MAX_COMMENT_LEN)));
    let mut b = Batch::new();
    b.push(Command::AddSetElems(elems(vec![ok])));
    b.encode(1).expect("128 bytes fit");
}

#[test]
fn meta_skuid_and_its_compare_match_nft() {
    let meta = encode(&Expr::Meta {
        key: MetaKey::SkUid,
        dreg: Register::R1,
    });
    let expected = [
        h(36, 1, true),
        h(9, 1, false),
        b"meta\0\0\0\0".to_vec(),
        h(20, 2, true),
        h(8, 2, false),
        vec![0, 0, 0, 10],
        h(8, 1, false),
        vec![0, 0, 0, 1],
    ]
    .concat();
    assert_eq!(meta, expected);
    let cmp = encode(&Expr::Cmp {
        sreg: Register::R1,
        op: CmpOp::Eq,
        data: 1000u32.to_ne_bytes().to_vec(),
    });
    assert_eq!(&cmp[cmp.len() - 4..], &1000u32.to_ne_bytes(), "host order");
}

#[test]
fn lookup_matches_nft() {
    let got = encode(&Expr::Lookup {
        sreg: Register::R1,
        set: "istio-inpod-probes-v4".into(),
    });
    let expected = [
        h(56, 1, true),
        h(11, 1, false),
        b"lookup\0\0".to_vec(),
        h(40, 2, true),
        h(8, 2, false),
        vec![0, 0, 0, 1],
        h(26, 1, false),
        SET4.to_vec(),
    ]
    .concat();
    assert_eq!(got, expected);
}

#[test]
fn snat_to_v4_matches_nft() {
    let [imm, nat] = Expr::snat_to(addr("169.254.7.127"), Register::R1);
    let expected_imm = [
        h(44, 1, true),
        h(14, 1, false),
        b"immediate\0\0\0".to_vec(),
        h(24, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 1],
        h(12, 2, true),
        h(8, 1, false),
        vec![169, 254, 7, 127],
    ]
    .concat();
    assert_eq!(encode(&imm), expected_imm);
    let expected_nat = [
        h(40, 1, true),
        h(8, 1, false),
        b"nat\0".to_vec(),
        h(28, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 0],
        h(8, 2, false),
        vec![0, 0, 0, 2],
        h(8, 3, false),
        vec![0, 0, 0, 1],
    ]
    .concat();
    assert_eq!(encode(&nat), expected_nat);
}

#[test]
fn snat_to_v6_matches_nft() {
    let probe = addr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff");
    let [imm, nat] = Expr::snat_to(probe, Register::R1);
    let imm = encode(&imm);
    assert_eq!(&imm[..4], &h(56, 1, true)[..]);
    assert_eq!(
        &imm[imm.len() - 20..],
        &[
            h(20, 1, false),
            vec![0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37],
            vec![0xff; 8]
        ]
        .concat()[..]
    );
    let nat = encode(&nat);
    assert_eq!(&nat[28..32], &[0, 0, 0, 10], "NFPROTO_IPV6");
}

#[test]
fn set_command_display_names_the_object() {
    let el = SetElem::addr(addr("10.0.0.5"), Some("u1".into()));
    let shown: Vec<String> = [
        Command::FlushTable(host_table()),
        Command::AddSet(v4_set()),
        Command::AddSetElems(elems(vec![
            el.clone(),
            SetElem::addr(addr("10.0.0.6"), None),
        ])),
        Command::DelSetElems(elems(vec![el])),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(
        shown,
        [
            "flush table inet istio-ambient-nat",
            "add set inet istio-ambient-nat istio-inpod-probes-v4 { type ipv4_addr ; }",
            "add element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.5 comment \"u1\", 10.0.0.6 }",
            "delete element inet istio-ambient-nat istio-inpod-probes-v4 { 10.0.0.5 comment \"u1\" }",
        ]
    );
}

fn bytes(a: &Attr) -> Vec<u8> {
    let mut out = Vec::new();
    a.write(&mut out).expect("write");
    out
}

#[test]
fn listed_elements_decode_keys_and_comments() {
    // A NEWSETELEM listing as the kernel sends it: an element with a comment, one without, and
    // one whose user data holds another TLV before the comment.
    let listed = Attr::Nested(
        wire::set::ELEM_LIST_ELEMENTS,
        vec![
            Attr::Nested(
                1,
                vec![
                    Attr::Nested(1, vec![Attr::Bytes(1, vec![10, 0, 0, 5])]),
                    Attr::be32(3, 0),
                    Attr::Bytes(6, b"\x00\x0apod-uid-1\x00".to_vec()),
                ],
            ),
            Attr::Nested(
                1,
                vec![Attr::Nested(1, vec![Attr::Bytes(1, vec![10, 0, 0, 6])])],
            ),
            Attr::Nested(
                1,
                vec![
                    Attr::Nested(1, vec![Attr::Bytes(1, vec![10, 0, 0, 7])]),
                    Attr::Bytes(6, b"\x05\x01x\x00\x03u2\x00".to_vec()),
                ],
            ),
        ],
    );
    let buf = [bytes(&Attr::strz(1, "istio-ambient-nat")), bytes(&listed)].concat();
    let got = set::parse_elems(&wire::parse_attrs(&buf).expect("attrs")).expect("elems");
    assert_eq!(
        got,
        [
            SetElem::addr(addr("10.0.0.5"), Some("pod-uid-1".into())),
            SetElem::addr(addr("10.0.0.6"), None),
            SetElem::addr(addr("10.0.0.7"), Some("u2".into())),
        ]
    );
    let no_key = bytes(&Attr::Nested(
        3,
        vec![Attr::Nested(1, vec![Attr::be32(3, 0)])],
    ));
    let err = set::parse_elems(&wire::parse_attrs(&no_key).expect("attrs")).expect_err("no key");
    assert!(matches!(err, NftError::MalformedReply { .. }), "{err}");
}

#[test]
fn attribute_parser_rejects_overlong_lengths_and_strips_flags() {
    let mut buf = bytes(&Attr::Nested(3, vec![Attr::be32(1, 7)]));
    let attrs = wire::parse_attrs(&buf).expect("attrs");
    assert_eq!(attrs.len(), 1);
    assert_eq!(attrs[0].0, 3, "NLA_F_NESTED stripped");
    buf[0] = 200;
    assert!(wire::parse_attrs(&buf).is_err());
}

#[test]
fn kernel_sets_elements_and_flush_table() {
    in_fresh_netns(|| {
        let t = host_table();
        let set4 = v4_set();
        let chain = Chain {
            table: t.clone(),
            name: "postrouting".into(),
            hook: Some(ChainHook {
                chain_type: ChainType::Nat,
                hook: Hook::Postrouting,
                priority: 100,
            }),
        };
        let mut exprs = vec![
            Expr::Meta {
                key: MetaKey::SkUid,
                dreg: Register::R1,
            },
            Expr::Cmp {
                sreg: Register::R1,
                op: CmpOp::Eq,
                data: 1000u32.to_ne_bytes().to_vec(),
            },
            Expr::Meta {
                key: MetaKey::NfProto,
                dreg: Register::R1,
            },
            Expr::Cmp {
                sreg: Register::R1,
                op: CmpOp::Eq,
                data: vec![2],
            },
            Expr::Payload {
                base: PayloadBase::Network,
                offset: 16,
                len: 4,
                dreg: Register::R1,
            },
            Expr::Lookup {
                sreg: Register::R1,
                set: set4.name.clone(),
            },
            Expr::Counter,
        ];
        exprs.extend(Expr::snat_to(addr("169.254.7.127"), Register::R1));
        let kinds: Vec<String> = exprs.iter().map(|e| e.kind().to_owned()).collect();
        let rule_exprs = exprs.clone();
        let mut b = Batch::new();
        b.push(Command::AddTable(t.clone()))
            .push(Command::AddSet(set4.clone()))
            .push(Command::AddChain(chain))
            .push(Command::AddRule(Rule {
                table: t.clone(),
                chain: "postrouting".into(),
                exprs,
            }));
        b.commit().expect("set, chain and a rule looking it up");
        assert!(set_exists(&t, &set4.name).expect("get set"));
        assert!(!set_exists(&t, "missing").expect("get set"));
        assert!(!set_exists(&Table::inet("nope"), &set4.name).expect("get set"));
        let rules = list_rules(&t, "postrouting").expect("list rules");
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].expr_kinds, kinds);
        assert_eq!(
            rules[0].constants,
            [
                1000u32.to_ne_bytes().to_vec(),
                vec![2],
                b"istio-inpod-probes-v4".to_vec(),
                vec![169, 254, 7, 127],
            ]
        );
        assert!(rules[0].matches(&rule_exprs));
        let mut other_uid = rule_exprs.clone();
        other_uid[1] = Expr::Cmp {
            sreg: Register::R1,
            op: CmpOp::Eq,
            data: 1001u32.to_ne_bytes().to_vec(),
        };
        assert!(!rules[0].matches(&other_uid));
        assert!(!rules[0].matches(&rule_exprs[1..]));
        assert!(list_rules(&t, "missing").expect("no chain").is_empty());

        let a = SetElem::addr(addr("10.0.0.5"), Some("uid-a".into()));
        let b5 = SetElem::addr(addr("10.0.0.6"), None);
        let mut add = Batch::new();
        add.push(Command::AddSetElems(elems(vec![a.clone(), b5.clone()])));
        add.commit().expect("add elements");
        let mut listed = list_set_elems(&t, &set4.name).expect("list");
        listed.sort();
        assert_eq!(listed, [a.clone(), b5.clone()]);

        // Re-adding with another comment succeeds but keeps the old comment ...
        let a2 = SetElem::addr(addr("10.0.0.5"), Some("uid-b".into()));
        let mut readd = Batch::new();
        readd.push(Command::AddSetElems(elems(vec![a2.clone()])));
        readd.commit().expect("re-add is no error");
        assert!(list_set_elems(&t, &set4.name).expect("list").contains(&a));
        // ... while add + delete + add in one batch replaces it.
        let mut upsert = Batch::new();
        upsert
            .push(Command::AddSetElems(elems(vec![a2.clone()])))
            .push(Command::DelSetElems(elems(vec![a2.clone()])))
            .push(Command::AddSetElems(elems(vec![a2.clone()])));
        upsert.commit().expect("upsert");
        let listed = list_set_elems(&t, &set4.name).expect("list");
        assert!(listed.contains(&a2) && !listed.contains(&a), "{listed:?}");

        let mut del = Batch::new();
        del.push(Command::DelSetElems(elems(vec![b5.clone()])));
        del.commit().expect("delete element");
        let err = del.commit().expect_err("deleting a missing element fails");
        assert!(
            matches!(
                err,
                NftError::Kernel {
                    source: Errno::ENOENT,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            list_set_elems(&t, &set4.name).expect("list"),
            std::slice::from_ref(&a2)
        );

        // flush table: rules go, chain, set and elements stay.
        let mut flush = Batch::new();
        flush.push(Command::FlushTable(t.clone()));
        flush.commit().expect("flush table");
        assert!(list_rules(&t, "postrouting").expect("list").is_empty());
        assert_eq!(list_set_elems(&t, &set4.name).expect("list"), [a2]);

        let mut empty = Batch::new();
        empty.push(Command::FlushSet {
            table: t.clone(),
            name: set4.name.clone(),
        });
        empty.commit().expect("flush set");
        assert!(list_set_elems(&t, &set4.name).expect("list").is_empty());

        // Once no rule refers to it, the set can go; listing it then fails with ENOENT.
        let mut drop = Batch::new();
        drop.push(Command::DelSet {
            table: t.clone(),
            name: set4.name.clone(),
        });
        drop.commit().expect("delete set");
        let err = list_set_elems(&t, &set4.name).expect_err("missing set");
        assert!(
            matches!(
                err,
                NftError::Kernel {
                    source: Errno::ENOENT,
                    ..
                }
            ),
            "{err}"
        );
    });
}
