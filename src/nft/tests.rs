//! Unit tests of the nf_tables encoder. Expected bytes were taken from `nft --debug=mnl` (nftables
//! 1.0.6) for the same objects; header words are built with native endianness like the kernel's.

use super::wire::{self, Attr, Reply};
use super::*;

/// An `nlattr` header: length and type (with the nested flag when `nested`).
pub(super) fn h(len: u16, ty: u16, nested: bool) -> Vec<u8> {
    let ty = if nested { ty | wire::NLA_F_NESTED } else { ty };
    [len.to_ne_bytes(), ty.to_ne_bytes()].concat()
}

pub(super) fn encode(e: &Expr) -> Vec<u8> {
    let mut out = Vec::new();
    e.attr().write(&mut out).expect("encode");
    out
}

fn r1() -> Register {
    Register::R1
}

#[test]
fn strz_attribute_is_nul_terminated_and_padded() {
    let mut out = Vec::new();
    Attr::strz(1, "lo").write(&mut out).expect("write");
    assert_eq!(out, [h(7, 1, false), b"lo\0\0".to_vec()].concat());
}

#[test]
fn nested_attribute_sets_flag_and_total_length() {
    let mut out = Vec::new();
    Attr::Nested(4, vec![Attr::be32(1, 3), Attr::be32(2, 0xffff_ff9c)])
        .write(&mut out)
        .expect("write");
    let expected = [
        h(20, 4, true),
        h(8, 1, false),
        vec![0, 0, 0, 3],
        h(8, 2, false),
        vec![0xff, 0xff, 0xff, 0x9c],
    ]
    .concat();
    assert_eq!(out, expected);
}

#[test]
fn meta_load_matches_nft() {
    let got = encode(&Expr::Meta {
        key: MetaKey::L4Proto,
        dreg: r1(),
    });
    let expected = [
        h(36, 1, true),
        h(9, 1, false),
        b"meta\0\0\0\0".to_vec(),
        h(20, 2, true),
        h(8, 2, false),
        vec![0, 0, 0, 0x10],
        h(8, 1, false),
        vec![0, 0, 0, 1],
    ]
    .concat();
    assert_eq!(got, expected);
}

#[test]
fn cmp_matches_nft() {
    let got = encode(&Expr::Cmp {
        sreg: r1(),
        op: CmpOp::Eq,
        data: vec![6],
    });
    let expected = [
        h(44, 1, true),
        h(8, 1, false),
        b"cmp\0".to_vec(),
        h(32, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 1],
        h(8, 2, false),
        vec![0, 0, 0, 0],
        h(12, 3, true),
        h(5, 1, false),
        vec![6, 0, 0, 0],
    ]
    .concat();
    assert_eq!(got, expected);
}

#[test]
fn payload_matches_nft() {
    let got = encode(&Expr::Payload {
        base: PayloadBase::Network,
        offset: 16,
        len: 4,
        dreg: r1(),
    });
    let expected = [
        h(52, 1, true),
        h(12, 1, false),
        b"payload\0".to_vec(),
        h(36, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 1],
        h(8, 2, false),
        vec![0, 0, 0, 1],
        h(8, 3, false),
        vec![0, 0, 0, 16],
        h(8, 4, false),
        vec![0, 0, 0, 4],
    ]
    .concat();
    assert_eq!(got, expected);
}

#[test]
fn immediate_port_and_redir_match_nft() {
    let imm = encode(&Expr::Immediate {
        dreg: r1(),
        data: ImmediateData::Value(15001u16.to_be_bytes().to_vec()),
    });
    let expected_imm = [
        h(44, 1, true),
        h(14, 1, false),
        b"immediate\0\0\0".to_vec(),
        h(24, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 1],
        h(12, 2, true),
        h(6, 1, false),
        vec![0x3a, 0x99, 0, 0],
    ]
    .concat();
    assert_eq!(imm, expected_imm);

    let redir = encode(&Expr::Redir { proto_min: r1() });
    let expected_redir = [
        h(36, 1, true),
        h(10, 1, false),
        b"redir\0\0\0".to_vec(),
        h(20, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 1],
        h(8, 3, false),
        vec![0, 0, 0, 2],
    ]
    .concat();
    assert_eq!(redir, expected_redir);
}

#[test]
fn verdicts_encode_code_and_chain() {
    let jump = Expr::verdict(Verdict::Jump("istio-output".into())).attr();
    let Attr::Nested(_, elem) = jump else {
        panic!("list element must be nested")
    };
    let data = &elem[1];
    let expected = Attr::Nested(
        wire::rule::EXPR_DATA,
        vec![
            Attr::be32(wire::expr::IMMEDIATE_DREG, 0),
            Attr::Nested(
                wire::expr::IMMEDIATE_DATA,
                vec![Attr::Nested(
                    wire::expr::DATA_VERDICT,
                    vec![
                        Attr::Bytes(wire::expr::VERDICT_CODE, (-3i32).to_be_bytes().to_vec()),
                        Attr::strz(wire::expr::VERDICT_CHAIN, "istio-output"),
                    ],
                )],
            ),
        ],
    );
    assert_eq!(data, &expected);
    assert_eq!(Verdict::Accept.code(), 1);
    assert_eq!(Verdict::Return.code(), -5);
}

/// `iifname fake1s0f0 ... return` as nft 1.0.6 sends it (`nft --debug=mnl`): `meta load iifname`,
/// a 16-byte NUL-padded compare, and the return verdict (-5 = 0xfffffffb).
#[test]
fn iifname_match_and_return_verdict_match_nft() {
    let meta = encode(&Expr::Meta {
        key: MetaKey::IifName,
        dreg: r1(),
    });
    let expected_meta = [
        h(36, 1, true),
        h(9, 1, false),
        b"meta\0\0\0\0".to_vec(),
        h(20, 2, true),
        h(8, 2, false),
        vec![0, 0, 0, 6],
        h(8, 1, false),
        vec![0, 0, 0, 1],
    ]
    .concat();
    assert_eq!(meta, expected_meta);

    let cmp = encode(&Expr::Cmp {
        sreg: r1(),
        op: CmpOp::Eq,
        data: b"fake1s0f0\0\0\0\0\0\0\0".to_vec(),
    });
    let expected_cmp = [
        h(56, 1, true),
        h(8, 1, false),
        b"cmp\0".to_vec(),
        h(44, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 1],
        h(8, 2, false),
        vec![0, 0, 0, 0],
        h(24, 3, true),
        h(20, 1, false),
        b"fake1s0f0\0\0\0\0\0\0\0".to_vec(),
    ]
    .concat();
    assert_eq!(cmp, expected_cmp);

    let ret = encode(&Expr::verdict(Verdict::Return));
    let expected_ret = [
        h(48, 1, true),
        h(14, 1, false),
        b"immediate\0\0\0".to_vec(),
        h(28, 2, true),
        h(8, 1, false),
        vec![0, 0, 0, 0],
        h(16, 2, true),
        h(12, 2, true),
        h(8, 1, false),
        vec![0xff, 0xff, 0xff, 0xfb],
    ]
    .concat();
    assert_eq!(ret, expected_ret);
}

#[test]
fn bitwise_ct_meta_set_and_counter_layout() {
    let bw = Expr::Bitwise {
        sreg: r1(),
        dreg: r1(),
        mask: 0xfffff000u32.to_ne_bytes().to_vec(),
        xor: 0x111u32.to_ne_bytes().to_vec(),
    }
    .attr();
    let Attr::Nested(_, elem) = bw else {
        panic!("nested")
    };
    let Attr::Nested(_, data) = &elem[1] else {
        panic!("nested data")
    };
    let types: Vec<u16> = data.iter().map(Attr::ty).collect();
    assert_eq!(types, [1, 2, 3, 4, 5], "sreg dreg len mask xor");
    assert_eq!(data[2], Attr::be32(wire::expr::BITWISE_LEN, 4));

    let ct_set = Expr::CtSet {
        key: CtKey::Zone,
        sreg: r1(),
    }
    .attr();
    let Attr::Nested(_, elem) = ct_set else {
        panic!("nested")
    };
    assert_eq!(elem[0], Attr::strz(1, "ct"));
    assert_eq!(
        elem[1],
        Attr::Nested(2, vec![Attr::be32(2, 17), Attr::be32(4, 1)])
    );

    let meta_set = Expr::MetaSet {
        key: MetaKey::Mark,
        sreg: r1(),
    }
    .attr();
    let Attr::Nested(_, elem) = meta_set else {
        panic!("nested")
    };
    assert_eq!(
        elem[1],
        Attr::Nested(2, vec![Attr::be32(2, 3), Attr::be32(3, 1)])
    );

    assert_eq!(
        Expr::Counter.attr(),
        Attr::Nested(1, vec![Attr::strz(1, "counter")])
    );
}

fn sample_batch() -> Batch {
    let t = Table::inet("t1");
    let mut b = Batch::new();
    b.push(Command::AddTable(t.clone()))
        .push(Command::DelTable(t.clone()))
        .push(Command::AddChain(Chain {
            table: t.clone(),
            name: "c1".into(),
            hook: Some(ChainHook {
                chain_type: ChainType::Nat,
                hook: Hook::Output,
                priority: -100,
            }),
        }))
        .push(Command::AddRule(Rule {
            table: t,
            chain: "c1".into(),
            exprs: vec![Expr::Counter, Expr::verdict(Verdict::Accept)],
        }));
    b
}

/// One decoded message: (type, flags, seq, nfgenmsg bytes, attributes).
pub(super) type Msg = (u16, u16, u32, [u8; 4], Vec<u8>);

/// Splits an encoded batch into messages.
pub(super) fn split(buf: &[u8]) -> Vec<Msg> {
    let mut out = Vec::new();
    let mut rest = buf;
    while !rest.is_empty() {
        let len = u32::from_ne_bytes(rest[0..4].try_into().expect("len")) as usize;
        let ty = u16::from_ne_bytes(rest[4..6].try_into().expect("ty"));
        let flags = u16::from_ne_bytes(rest[6..8].try_into().expect("flags"));
        let seq = u32::from_ne_bytes(rest[8..12].try_into().expect("seq"));
        assert_eq!(&rest[12..16], &[0; 4], "pid must be 0");
        let nfgen: [u8; 4] = rest[16..20].try_into().expect("nfgen");
        out.push((ty, flags, seq, nfgen, rest[20..len].to_vec()));
        rest = &rest[wire::align4(len)..];
    }
    out
}

#[test]
fn batch_is_framed_by_begin_and_end() {
    let msgs = split(&sample_batch().encode(7).expect("encode"));
    let types: Vec<u16> = msgs.iter().map(|m| m.0).collect();
    assert_eq!(types, [0x10, 0x0a00, 0x0a02, 0x0a03, 0x0a06, 0x11]);
    let seqs: Vec<u32> = msgs.iter().map(|m| m.2).collect();
    assert_eq!(seqs, [7, 8, 9, 10, 11, 12]);
    for delim in [&msgs[0], &msgs[5]] {
        assert_eq!(delim.1, wire::NLM_F_REQUEST);
        assert_eq!(
            delim.3,
            [0, 0, 0, 10],
            "AF_UNSPEC, v0, res_id NFNL_SUBSYS_NFTABLES (be16)"
        );
        assert!(delim.4.is_empty());
    }
    let (req, ack, create, append) = (0x1, 0x4, 0x400, 0x800);
    assert_eq!(msgs[1].1, req | ack | create);
    assert_eq!(msgs[2].1, req | ack);
    assert_eq!(msgs[3].1, req | ack | create);
    assert_eq!(msgs[4].1, req | ack | create | append);
    for m in &msgs[1..5] {
        assert_eq!(m.3, [1, 0, 0, 0], "NFPROTO_INET, v0, res_id 0");
    }
}

#[test]
fn base_chain_message_matches_nft() {
    let msgs = split(&sample_batch().encode(1).expect("encode"));
    let body = &msgs[3].4;
    let expected = [
        h(7, 1, false),
        b"t1\0\0".to_vec(),
        h(7, 3, false),
        b"c1\0\0".to_vec(),
        h(8, 7, false),
        b"nat\0".to_vec(),
        h(20, 4, true),
        h(8, 1, false),
        vec![0, 0, 0, 3],
        h(8, 2, false),
        vec![0xff, 0xff, 0xff, 0x9c],
    ]
    .concat();
    assert_eq!(body, &expected);
}

#[test]
fn command_display_names_the_object() {
    let b = sample_batch();
    let shown: Vec<String> = b.commands().iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        [
            "add table inet t1",
            "delete table inet t1",
            "add chain inet t1 c1 { type nat hook output priority -100 ; }",
            "add rule inet t1 c1 [counter immediate]",
        ]
    );
}

fn nlmsg(ty: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let len = (wire::NLMSG_HDRLEN + payload.len()) as u32;
    let mut v = Vec::new();
    v.extend_from_slice(&len.to_ne_bytes());
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(&0u16.to_ne_bytes());
    v.extend_from_slice(&seq.to_ne_bytes());
    v.extend_from_slice(&77u32.to_ne_bytes());
    v.extend_from_slice(payload);
    v
}

fn error_msg(seq: u32, code: i32) -> Vec<u8> {
    // nlmsgerr: error code, then the echoed request header.
    let mut p = code.to_ne_bytes().to_vec();
    p.extend_from_slice(&[0; wire::NLMSG_HDRLEN]);
    nlmsg(wire::NLMSG_ERROR, seq, &p)
}

#[test]
fn replies_parse_acks_errors_and_others() {
    let mut buf = error_msg(3, 0);
    buf.extend(error_msg(4, -2));
    buf.extend(nlmsg(0x0a00, 5, &[1, 0, 0, 0]));
    let replies = wire::parse_replies(&buf).expect("parse");
    assert_eq!(
        replies,
        [
            Reply::Ack { seq: 3 },
            Reply::Error { seq: 4, errno: 2 },
            Reply::Other { seq: 5, ty: 0x0a00 },
        ]
    );
}

#[test]
fn truncated_reply_is_rejected() {
    let mut buf = error_msg(3, 0);
    buf[0] = 200;
    let err = wire::parse_replies(&buf).expect_err("must fail");
    assert!(matches!(err, NftError::MalformedReply { .. }), "{err}");
}

#[test]
fn collector_keeps_earliest_failing_command() {
    let mut pending: BTreeMap<u32, usize> = (2..6).zip(0..4).collect();
    let mut c = ReplyCollector::default();
    for r in [
        Reply::Ack { seq: 2 },
        Reply::Error { seq: 5, errno: 22 },
        Reply::Error { seq: 4, errno: 2 },
        Reply::Ack { seq: 3 },
    ] {
        c.record(r, 1, &mut pending).expect("record");
    }
    assert!(pending.is_empty());
    assert_eq!(c.first, Some((2, Errno::ENOENT)));
}

#[test]
fn error_on_begin_fails_the_batch() {
    let mut pending: BTreeMap<u32, usize> = (2..4).zip(0..2).collect();
    let err = ReplyCollector::default()
        .record(Reply::Error { seq: 1, errno: 1 }, 1, &mut pending)
        .expect_err("must fail");
    assert!(
        matches!(
            err,
            NftError::Kernel {
                source: Errno::EPERM,
                ..
            }
        ),
        "{err}"
    );
}

/// Runs `f` on a thread that has its own fresh network namespace (nothing touches the caller's).
pub(super) fn in_fresh_netns<R: Send>(f: impl FnOnce() -> R + Send) -> Option<R> {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var_os("CI").is_none(), "root required under CI");
        eprintln!("SKIP: nf_tables kernel test needs root");
        return None;
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare netns");
            f()
        })
        .join()
        .expect("netns thread")
    })
    .into()
}

#[test]
fn kernel_commit_applies_and_reports_failures() {
    in_fresh_netns(|| {
        let t = Table::inet("zt-nft-test");
        assert!(!table_exists(&t).expect("get table"));
        sample_batch_for(&t).commit().expect("commit");
        assert!(table_exists(&t).expect("get table"));

        // A jump to a missing chain fails; the table add before it in the batch is rolled back.
        let other = Table::inet("zt-nft-rolled-back");
        let mut bad = Batch::new();
        bad.push(Command::AddTable(other.clone()))
            .push(Command::AddRule(Rule {
                table: t.clone(),
                chain: "c1".into(),
                exprs: vec![Expr::verdict(Verdict::Jump("missing".into()))],
            }));
        let err = bad.commit().expect_err("must fail");
        match &err {
            NftError::Kernel { command, source } => {
                assert_eq!(*source, Errno::ENOENT);
                assert!(
                    command.starts_with("add rule inet zt-nft-test c1"),
                    "{command}"
                );
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(!table_exists(&other).expect("get table"));

        let mut del = Batch::new();
        del.push(Command::DelTable(other.clone()));
        let err = del.commit().expect_err("deleting a missing table fails");
        assert!(
            err.to_string()
                .contains("delete table inet zt-nft-rolled-back"),
            "{err}"
        );
    });
}

fn sample_batch_for(t: &Table) -> Batch {
    let mut b = Batch::new();
    b.push(Command::AddTable(t.clone()))
        .push(Command::AddChain(Chain {
            table: t.clone(),
            name: "c1".into(),
            hook: Some(ChainHook {
                chain_type: ChainType::Filter,
                hook: Hook::Output,
                priority: 0,
            }),
        }))
        .push(Command::AddRule(Rule {
            table: t.clone(),
            chain: "c1".into(),
            exprs: vec![
                Expr::Meta {
                    key: MetaKey::L4Proto,
                    dreg: r1(),
                },
                Expr::Cmp {
                    sreg: r1(),
                    op: CmpOp::Eq,
                    data: vec![6],
                },
                Expr::Counter,
                Expr::verdict(Verdict::Accept),
            ],
        }));
    b
}
