//! Table tests of the enrollment rules, the selector parser and the annotation options.

use std::collections::BTreeMap;

use super::*;

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn pod(namespace: &str, name: &str) -> PodFacts {
    PodFacts {
        name: name.into(),
        namespace: namespace.into(),
        uid: PodUid::new("0e4b9a5c-3a55-4a4e-9a0d-5f2e8c1b7d21"),
        service_account: "default".into(),
        node_name: "node-1".into(),
        ips: vec!["10.0.0.7".parse().expect("ip")],
        phase: PodPhase::Running,
        ..PodFacts::default()
    }
}

fn ns(name: &str, pairs: &[(&str, &str)]) -> NamespaceFacts {
    NamespaceFacts {
        name: name.into(),
        labels: labels(pairs),
    }
}

const AMBIENT: (&str, &str) = (DATAPLANE_MODE_LABEL, DATAPLANE_MODE_AMBIENT);
const NONE: (&str, &str) = (DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE);
const SIDECAR: (&str, &str) = (
    SIDECAR_STATUS_ANNOTATION,
    "{\"containers\":[\"istio-proxy\"]}",
);

struct Case {
    name: &'static str,
    pod: PodFacts,
    ns_labels: &'static [(&'static str, &'static str)],
    want: Result<usize, SkipReason>,
}

fn case(
    name: &'static str,
    ns_labels: &'static [(&'static str, &'static str)],
    want: Result<usize, SkipReason>,
    edit: impl FnOnce(&mut PodFacts),
) -> Case {
    let mut p = pod("apps", "web-0");
    edit(&mut p);
    Case {
        name,
        pod: p,
        ns_labels,
        want,
    }
}

fn check(rules: &EnrollmentRules, cases: Vec<Case>) {
    for c in cases {
        let d = rules.decide(&c.pod, &ns(&c.pod.namespace.clone(), c.ns_labels));
        let got = match &d {
            Decision::Enroll { selector, .. } => Ok(*selector),
            Decision::Skip(r) => Err(*r),
        };
        assert_eq!(got, c.want, "case {:?}: {d}", c.name);
        assert_eq!(d.is_enrolled(), c.want.is_ok(), "case {:?}", c.name);
        assert_eq!(d.skip_reason(), c.want.err(), "case {:?}", c.name);
    }
}

/// Istio's `TestEnablementSelectorMatches` cases plus the label precedence, with the default
/// selectors: entry 0 is "pod label ambient", entry 1 is "namespace label ambient, pod not none".
#[test]
fn default_selectors_follow_istio_precedence() {
    use SkipReason::*;
    let cases = vec![
        case("ns enabled", &[AMBIENT], Ok(1), |_| {}),
        case("pod enabled", &[], Ok(0), |p| p.labels = labels(&[AMBIENT])),
        case("both", &[AMBIENT], Ok(0), |p| p.labels = labels(&[AMBIENT])),
        case("neither", &[], Err(NotSelected), |_| {}),
        case(
            "sidecar in ambient ns",
            &[AMBIENT],
            Err(SidecarInjected),
            |p| p.annotations = labels(&[SIDECAR]),
        ),
        case(
            "pod none in ambient ns",
            &[AMBIENT],
            Err(NotSelected),
            |p| p.labels = labels(&[NONE]),
        ),
        case("sidecar with pod label", &[], Err(SidecarInjected), |p| {
            p.labels = labels(&[AMBIENT]);
            p.annotations = labels(&[SIDECAR]);
        }),
        case(
            "hostNetwork in ambient ns",
            &[AMBIENT],
            Err(HostNetwork),
            |p| p.host_network = true,
        ),
        case("hostNetwork with pod label", &[], Err(HostNetwork), |p| {
            p.labels = labels(&[AMBIENT]);
            p.host_network = true;
        }),
        case("pod ambient wins over ns none", &[NONE], Ok(0), |p| {
            p.labels = labels(&[AMBIENT])
        }),
        case("pod none in plain ns", &[], Err(NotSelected), |p| {
            p.labels = labels(&[NONE])
        }),
        case("other pod value in ambient ns", &[AMBIENT], Ok(1), |p| {
            p.labels = labels(&[(DATAPLANE_MODE_LABEL, "sidecar")])
        }),
        case(
            "ns label other value",
            &[(DATAPLANE_MODE_LABEL, "Ambient")],
            Err(NotSelected),
            |_| {},
        ),
        case(
            "unrelated labels",
            &[("team", "a")],
            Err(NotSelected),
            |p| p.labels = labels(&[("app", "web")]),
        ),
        case(
            "empty sidecar annotation still counts",
            &[AMBIENT],
            Err(SidecarInjected),
            |p| p.annotations = labels(&[(SIDECAR_STATUS_ANNOTATION, "")]),
        ),
    ];
    check(&EnrollmentRules::default(), cases);
}

#[test]
fn never_rules_and_their_order() {
    use SkipReason::*;
    let own_ns = DEFAULT_OWN_NAMESPACE;
    let cases = vec![
        case("empty name", &[AMBIENT], Err(NotKubernetesPod), |p| {
            p.name.clear()
        }),
        case("empty namespace", &[AMBIENT], Err(NotKubernetesPod), |p| {
            p.namespace.clear()
        }),
        case("own pod by name", &[AMBIENT], Err(OwnPod), |p| {
            p.namespace = own_ns.into();
            p.name = "ztnode-x7k2p".into();
            p.labels = labels(&[AMBIENT]);
        }),
        case("own pod by app label", &[AMBIENT], Err(OwnPod), |p| {
            p.namespace = own_ns.into();
            p.labels = labels(&[("app", OWN_APP_LABEL), AMBIENT]);
        }),
        case(
            "own name in another ns is not own",
            &[AMBIENT],
            Ok(1),
            |p| p.name = "ztnode-x7k2p".into(),
        ),
        case(
            "own label in another ns is not own",
            &[AMBIENT],
            Ok(1),
            |p| p.labels = labels(&[("app", OWN_APP_LABEL)]),
        ),
        case(
            "other pod in own ns is enrollable",
            &[AMBIENT],
            Ok(1),
            |p| {
                p.namespace = own_ns.into();
                p.name = "tools-0".into();
            },
        ),
        case(
            "excluded ns with pod label",
            &[AMBIENT],
            Err(ExcludedNamespace),
            |p| {
                p.namespace = "kube-system".into();
                p.labels = labels(&[AMBIENT]);
            },
        ),
        case("succeeded", &[AMBIENT], Err(Terminated), |p| {
            p.phase = PodPhase::Succeeded
        }),
        case("failed", &[AMBIENT], Err(Terminated), |p| {
            p.phase = PodPhase::Failed
        }),
        case("pending enrolls", &[AMBIENT], Ok(1), |p| {
            p.phase = PodPhase::Pending
        }),
        case("unknown phase enrolls", &[AMBIENT], Ok(1), |p| {
            p.phase = PodPhase::Unknown
        }),
        case(
            "excluded before terminated",
            &[],
            Err(ExcludedNamespace),
            |p| {
                p.namespace = "kube-system".into();
                p.phase = PodPhase::Failed;
            },
        ),
        case("terminated before hostNetwork", &[], Err(Terminated), |p| {
            p.phase = PodPhase::Succeeded;
            p.host_network = true;
        }),
        case(
            "hostNetwork before sidecar",
            &[AMBIENT],
            Err(HostNetwork),
            |p| {
                p.host_network = true;
                p.annotations = labels(&[SIDECAR]);
            },
        ),
    ];
    let mut rules = EnrollmentRules {
        own: OwnPods::new(own_ns),
        excluded: ExcludedNamespaces::default(),
        ..EnrollmentRules::default()
    };
    check(&rules, cases);

    rules.excluded = ExcludedNamespaces::new(["kube-system", own_ns]);
    let cases = vec![
        case("own before excluded", &[], Err(OwnPod), |p| {
            p.namespace = own_ns.into();
            p.name = "ztnode-a".into();
        }),
        case(
            "others in own ns now excluded",
            &[AMBIENT],
            Err(ExcludedNamespace),
            |p| {
                p.namespace = own_ns.into();
            },
        ),
    ];
    check(&rules, cases);
}

#[test]
fn configured_selectors_exclusions_and_own_namespace_apply() {
    use SkipReason::*;
    let env = |k: &str| match k {
        ENV_AMBIENT_ENABLEMENT_SELECTOR => Some(
            "[{podSelector: {matchExpressions: [{key: tier, operator: In, values: [web, api]}]}, \
             namespaceSelector: {matchExpressions: [{key: mesh, operator: Exists}]}}]"
                .to_owned(),
        ),
        ENV_EXCLUDE_NAMESPACES => Some(" legacy ,, batch ".to_owned()),
        ENV_POD_NAMESPACE => Some("mesh-system".to_owned()),
        _ => None,
    };
    let rules = EnrollmentRules::from_env(env).expect("rules");
    let cases = vec![
        case("selected", &[("mesh", "")], Ok(0), |p| {
            p.labels = labels(&[("tier", "api")])
        }),
        case(
            "pod value not in set",
            &[("mesh", "1")],
            Err(NotSelected),
            |p| p.labels = labels(&[("tier", "db")]),
        ),
        case("ns lacks key", &[], Err(NotSelected), |p| {
            p.labels = labels(&[("tier", "web")])
        }),
        case(
            "ambient label means nothing here",
            &[AMBIENT],
            Err(NotSelected),
            |p| p.labels = labels(&[AMBIENT]),
        ),
        case(
            "configured exclusion",
            &[("mesh", "")],
            Err(ExcludedNamespace),
            |p| {
                p.namespace = "batch".into();
                p.labels = labels(&[("tier", "web")]);
            },
        ),
        case(
            "kube-system no longer excluded",
            &[("mesh", "")],
            Ok(0),
            |p| {
                p.namespace = "kube-system".into();
                p.labels = labels(&[("tier", "web")]);
            },
        ),
        case(
            "own namespace from POD_NAMESPACE",
            &[("mesh", "")],
            Err(OwnPod),
            |p| {
                p.namespace = "mesh-system".into();
                p.name = "ztnode-q".into();
                p.labels = labels(&[("tier", "web")]);
            },
        ),
        case(
            "default own namespace is ordinary now",
            &[("mesh", "")],
            Ok(0),
            |p| {
                p.namespace = DEFAULT_OWN_NAMESPACE.into();
                p.name = "ztnode-q".into();
                p.labels = labels(&[("tier", "web")]);
            },
        ),
    ];
    check(&rules, cases);
}

#[test]
fn empty_selector_entries_match_everything_and_empty_lists_nothing() {
    let everything = EnrollmentRules {
        selectors: "- {}".parse().expect("one empty entry"),
        ..EnrollmentRules::default()
    };
    check(
        &everything,
        vec![
            case("any pod", &[], Ok(0), |_| {}),
            case("pod none too", &[], Ok(0), |p| p.labels = labels(&[NONE])),
            case(
                "hostNetwork still never",
                &[],
                Err(SkipReason::HostNetwork),
                |p| p.host_network = true,
            ),
        ],
    );
    for text in ["", "  \n", "null", "~", "[]"] {
        let nothing = EnrollmentRules {
            selectors: text.parse().expect("empty list"),
            ..EnrollmentRules::default()
        };
        check(
            &nothing,
            vec![case(
                "labelled",
                &[AMBIENT],
                Err(SkipReason::NoSelectors),
                |p| p.labels = labels(&[AMBIENT]),
            )],
        );
    }
}

#[test]
fn from_env_defaults_and_errors() {
    let rules = EnrollmentRules::from_env(|_| None).expect("defaults");
    assert_eq!(rules, EnrollmentRules::default());
    assert_eq!(rules.selectors, EnablementSelectors::default());
    assert!(rules.excluded.contains("kube-system"));
    assert_eq!(rules.own.namespace, DEFAULT_OWN_NAMESPACE);

    let rules = EnrollmentRules::from_env(|k| {
        (k == ENV_EXCLUDE_NAMESPACES || k == ENV_POD_NAMESPACE).then(String::new)
    })
    .expect("empty values");
    assert_eq!(
        rules.excluded.iter().count(),
        0,
        "EXCLUDE_NAMESPACES=\"\" excludes nothing"
    );
    assert_eq!(rules.own.namespace, DEFAULT_OWN_NAMESPACE);

    let rules =
        EnrollmentRules::from_env(|k| (k == ENV_AMBIENT_ENABLEMENT_SELECTOR).then(String::new))
            .expect("empty selector");
    assert!(
        rules.selectors.is_empty(),
        "set but empty enrolls nothing, as Istio's code"
    );

    let err = EnrollmentRules::from_env(|k| {
        (k == ENV_AMBIENT_ENABLEMENT_SELECTOR).then(|| "- podSelectr: {}".to_owned())
    })
    .expect_err("typo");
    let msg = err.to_string();
    assert!(
        msg.contains("AMBIENT_ENABLEMENT_SELECTOR=\"- podSelectr: {}\""),
        "{msg}"
    );
    assert!(msg.contains("podSelectr"), "{msg}");
}

#[test]
fn excluded_namespaces_parse_like_istio() {
    let cases: [(&str, &[&str]); 11] = [
        ("", &[]),
        ("   ", &[]),
        (",", &[]),
        (" , ,, ", &[]),
        ("a", &["a"]),
        ("a,b", &["a", "b"]),
        (" a , b ", &["a", "b"]),
        ("a,,b", &["a", "b"]),
        (",a,", &["a"]),
        ("a,a", &["a"]),
        (
            "kube-system,\tistio-system\n",
            &["istio-system", "kube-system"],
        ),
    ];
    for (text, want) in cases {
        let parsed = ExcludedNamespaces::parse(text);
        let got: Vec<&str> = parsed.iter().collect();
        assert_eq!(got, want, "{text:?}");
    }
    let d = ExcludedNamespaces::default();
    assert_eq!(
        d.iter().collect::<Vec<_>>(),
        crate::mesh::DEFAULT_EXCLUDED_NAMESPACES.to_vec()
    );
}

#[test]
fn own_pods_name_test_is_usable_without_the_pod() {
    let own = OwnPods::new("ztnode-system");
    assert!(own.matches_name("ztnode-system", "ztnode-abcde"));
    assert!(
        !own.matches_name("ztnode-system", "ztnode"),
        "the prefix includes the dash"
    );
    assert!(!own.matches_name("default", "ztnode-abcde"));
    assert!(!own.matches_name("ztnode-system", "web-0"));
}

#[test]
fn options_follow_annotations_and_ignore_bad_values() {
    type Check = fn(&PodOptions) -> bool;
    type Annotations = &'static [(&'static str, &'static str)];
    let cases: Vec<(Annotations, Check, usize)> = vec![
        (&[], |o| *o == PodOptions::default(), 0),
        (
            &[(BYPASS_INBOUND_CAPTURE_ANNOTATION, "true")],
            |o| o.bypass_inbound_capture,
            0,
        ),
        (
            &[(BYPASS_INBOUND_CAPTURE_ANNOTATION, "T")],
            |o| o.bypass_inbound_capture,
            0,
        ),
        (
            &[(BYPASS_INBOUND_CAPTURE_ANNOTATION, "1")],
            |o| o.bypass_inbound_capture,
            0,
        ),
        (
            &[(BYPASS_INBOUND_CAPTURE_ANNOTATION, "False")],
            |o| !o.bypass_inbound_capture,
            0,
        ),
        (
            &[(BYPASS_INBOUND_CAPTURE_ANNOTATION, "yes")],
            |o| !o.bypass_inbound_capture,
            1,
        ),
        (
            &[(BYPASS_INBOUND_CAPTURE_ANNOTATION, " true")],
            |o| !o.bypass_inbound_capture,
            1,
        ),
        (
            &[(DNS_CAPTURE_ANNOTATION, "false")],
            |o| o.dns_capture_override == Some(false),
            0,
        ),
        (
            &[(DNS_CAPTURE_ANNOTATION, "TRUE")],
            |o| o.dns_capture_override == Some(true),
            0,
        ),
        (
            &[(DNS_CAPTURE_ANNOTATION, "f")],
            |o| o.dns_capture_override == Some(false),
            0,
        ),
        (
            &[(DNS_CAPTURE_ANNOTATION, "")],
            |o| o.dns_capture_override.is_none(),
            1,
        ),
        (
            &[(DNS_CAPTURE_ANNOTATION, "on")],
            |o| o.dns_capture_override.is_none(),
            1,
        ),
        (
            &[(REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "")],
            |o| o.reroute_virtual_interfaces.is_empty(),
            0,
        ),
        (
            &[(REROUTE_VIRTUAL_INTERFACES_ANNOTATION, " eth1 , ,net1,")],
            |o| names(o) == ["eth1", "net1"],
            0,
        ),
        (
            &[(
                REROUTE_VIRTUAL_INTERFACES_ANNOTATION,
                "tap0,a/b,..,a b,x:y,sixteen-chars-xx,.,tap1",
            )],
            |o| names(o) == ["tap0", "tap1"],
            6,
        ),
        (
            &[(REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "fifteen-chars-x")],
            |o| names(o) == ["fifteen-chars-x"],
            0,
        ),
        (
            &[
                (BYPASS_INBOUND_CAPTURE_ANNOTATION, "t"),
                (DNS_CAPTURE_ANNOTATION, "0"),
                (REROUTE_VIRTUAL_INTERFACES_ANNOTATION, "kube-virt"),
            ],
            |o| {
                o.bypass_inbound_capture
                    && o.dns_capture_override == Some(false)
                    && names(o) == ["kube-virt"]
            },
            0,
        ),
        (
            &[("ambient.istio.io/other", "x")],
            |o| *o == PodOptions::default(),
            0,
        ),
    ];
    for (annotations, ok, warnings) in cases {
        let opts = PodOptions::from_annotations(&labels(annotations));
        assert!(ok(&opts), "{annotations:?}: {opts:?}");
        assert_eq!(
            opts.warnings.len(),
            warnings,
            "{annotations:?}: {:?}",
            opts.warnings
        );
    }
    let bad = PodOptions::from_annotations(&labels(&[(DNS_CAPTURE_ANNOTATION, "on")]));
    assert_eq!(
        bad.warnings[0].to_string(),
        "annotation ambient.istio.io/dns-capture=\"on\" ignored: expected a boolean (true/false, 1/0, t/f)"
    );
}

fn names(o: &PodOptions) -> Vec<&str> {
    o.reroute_virtual_interfaces
        .iter()
        .map(InterfaceName::as_str)
        .collect()
}

#[test]
fn dns_override_beats_the_global_setting() {
    let cases = [
        (None, false, false),
        (None, true, true),
        (Some(true), false, true),
        (Some(false), true, false),
    ];
    for (over, global, want) in cases {
        let o = PodOptions {
            dns_capture_override: over,
            ..PodOptions::default()
        };
        assert_eq!(o.dns_capture(global), want, "{over:?} {global}");
    }
}

#[test]
fn enrolled_decisions_carry_options_and_skips_do_not() {
    let rules = EnrollmentRules::default();
    let mut p = pod("apps", "web-0");
    p.labels = labels(&[AMBIENT]);
    p.annotations = labels(&[
        (BYPASS_INBOUND_CAPTURE_ANNOTATION, "true"),
        (DNS_CAPTURE_ANNOTATION, "x"),
    ]);
    let d = rules.decide(&p, &ns("apps", &[]));
    let opts = d.options().expect("enrolled");
    assert!(opts.bypass_inbound_capture);
    assert_eq!(opts.warnings.len(), 1);
    assert_eq!(
        d.to_string(),
        "enrolled: enablement selector entry 0 matched"
    );

    p.host_network = true;
    let d = rules.decide(&p, &ns("apps", &[]));
    assert!(d.options().is_none());
    assert_eq!(d.to_string(), "not enrolled: host network pod");
}

#[test]
fn phases_parse_from_the_api() {
    let cases = [
        ("Pending", PodPhase::Pending, false),
        ("Running", PodPhase::Running, false),
        ("Succeeded", PodPhase::Succeeded, true),
        ("Failed", PodPhase::Failed, true),
        ("Unknown", PodPhase::Unknown, false),
        ("", PodPhase::Unknown, false),
        ("running", PodPhase::Unknown, false),
    ];
    for (text, want, terminal) in cases {
        assert_eq!(PodPhase::from_api(text), want, "{text:?}");
        assert_eq!(want.is_terminal(), terminal, "{text:?}");
    }
}
