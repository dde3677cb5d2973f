//! Tests of the selector parser and matcher.

use std::collections::BTreeMap;

use super::*;

const AMBIENT: (&str, &str) = (DATAPLANE_MODE_LABEL, DATAPLANE_MODE_AMBIENT);
const NONE: (&str, &str) = (DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE);

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn istio_default_yaml_is_the_default_and_istio_examples_parse() {
    let parsed: EnablementSelectors = ISTIO_DEFAULT_ENABLEMENT_SELECTOR.parse().expect("default");
    assert_eq!(parsed, EnablementSelectors::default());
    assert_eq!(parsed.entries().len(), 2);

    // Istio's TestEnablementFromString inputs.
    let istio_default = "- podSelector:\n    matchLabels:\n      istio.io/dataplane-mode: ambient\n\
        - namespaceSelector:\n    matchLabels:\n      istio.io/dataplane-mode: ambient\n  \
        podSelector:\n    matchExpressions:\n    - key: istio.io/dataplane-mode\n      \
        operator: NotIn\n      values:\n      - none";
    assert_eq!(
        istio_default
            .parse::<EnablementSelectors>()
            .expect("istio default"),
        EnablementSelectors::default()
    );
    let ns_only: EnablementSelectors =
        "- namespaceSelector:\n    matchLabels:\n      istio.io/dataplane-mode: ambient"
            .parse()
            .expect("ns only");
    assert_eq!(ns_only.entries().len(), 1);
    assert!(ns_only.entries()[0].pod.is_empty());
    assert_eq!(ns_only.entries()[0].namespace.requirements().len(), 1);

    let json = r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},
        {"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn",
        "values":["none"]}]},"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]"#;
    assert_eq!(
        json.parse::<EnablementSelectors>().expect("json"),
        EnablementSelectors::default()
    );
    let nulls: EnablementSelectors =
        "- podSelector: null\n  namespaceSelector:\n    matchLabels: null"
            .parse()
            .expect("nulls are empty selectors");
    assert!(nulls.entries()[0].pod.is_empty() && nulls.entries()[0].namespace.is_empty());
}

#[test]
fn malformed_selectors_are_refused_with_variable_value_and_cause() {
    let syntax = [
        ("[", "unclosed flow sequence"),
        ("podSelector: {}", "a mapping, not a list"),
        ("- podSelectr: {}", "unknown entry key"),
        (
            "- podSelector: {matchLabel: {a: b}}",
            "unknown selector key",
        ),
        (
            "- podSelector: {matchExpressions: [{key: a, operator: In, value: [b]}]}",
            "unknown key",
        ),
        (
            "- podSelector: {matchExpressions: [{operator: Exists}]}",
            "missing key",
        ),
        ("- null", "null entry"),
        ("- podSelector: {matchLabels: [a, b]}", "labels not a map"),
        (
            "- podSelector: {matchLabels: {a: {b: c}}}",
            "label value not a string",
        ),
    ];
    for (text, why) in syntax {
        let err = text.parse::<EnablementSelectors>().expect_err(why);
        assert!(matches!(err, SelectorError::Syntax { .. }), "{why}: {err}");
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("AMBIENT_ENABLEMENT_SELECTOR={text:?}")),
            "{why}: {msg}"
        );
    }

    let long = "a".repeat(64);
    let invalid: Vec<(String, usize, SelectorField, &str)> = vec![
        (
            "- podSelector: {matchExpressions: [{key: a, operator: Has}]}".into(),
            0,
            SelectorField::Pod,
            "Operator",
        ),
        (
            "- podSelector: {matchExpressions: [{key: a, operator: in, values: [x]}]}".into(),
            0,
            SelectorField::Pod,
            "Operator",
        ),
        (
            "- {}\n- namespaceSelector: {matchExpressions: [{key: a, operator: In}]}".into(),
            1,
            SelectorField::Namespace,
            "ValuesRequired",
        ),
        (
            "- podSelector: {matchExpressions: [{key: a, operator: NotIn, values: []}]}".into(),
            0,
            SelectorField::Pod,
            "ValuesRequired",
        ),
        (
            "- podSelector: {matchExpressions: [{key: a, operator: Exists, values: [x]}]}".into(),
            0,
            SelectorField::Pod,
            "ValuesForbidden",
        ),
        (
            "- podSelector: {matchExpressions: [{key: a, operator: DoesNotExist, values: [x]}]}"
                .into(),
            0,
            SelectorField::Pod,
            "ValuesForbidden",
        ),
        (
            "- podSelector: {matchLabels: {-a: b}}".into(),
            0,
            SelectorField::Pod,
            "Key",
        ),
        (
            "- podSelector: {matchLabels: {a/b/c: b}}".into(),
            0,
            SelectorField::Pod,
            "Key",
        ),
        (
            "- podSelector: {matchLabels: {Istio.IO/mode: b}}".into(),
            0,
            SelectorField::Pod,
            "Key",
        ),
        (
            "- podSelector: {matchLabels: {/mode: b}}".into(),
            0,
            SelectorField::Pod,
            "Key",
        ),
        (
            "- podSelector: {matchLabels: {'istio.io/': b}}".into(),
            0,
            SelectorField::Pod,
            "Key",
        ),
        (
            format!("- podSelector: {{matchLabels: {{{long}: b}}}}"),
            0,
            SelectorField::Pod,
            "Key",
        ),
        (
            "- namespaceSelector: {matchLabels: {a: -b}}".into(),
            0,
            SelectorField::Namespace,
            "Value",
        ),
        (
            "- podSelector: {matchLabels: {a: 'b c'}}".into(),
            0,
            SelectorField::Pod,
            "Value",
        ),
        (
            format!("- podSelector: {{matchLabels: {{a: {long}}}}}"),
            0,
            SelectorField::Pod,
            "Value",
        ),
        (
            "- podSelector: {matchExpressions: [{key: a, operator: In, values: [ok, 'no!']}]}"
                .into(),
            0,
            SelectorField::Pod,
            "Value",
        ),
    ];
    for (text, want_index, want_field, want_problem) in invalid {
        let err = EnablementSelectors::parse("enablement_selectors", &text).expect_err(&text);
        let SelectorError::Invalid {
            variable,
            value,
            index,
            field,
            problem,
        } = &err
        else {
            panic!("{text}: want Invalid, got {err}");
        };
        assert_eq!(
            (variable.as_str(), value.as_str(), *index, *field),
            (
                "enablement_selectors",
                text.as_str(),
                want_index,
                want_field
            ),
            "{err}"
        );
        assert!(
            format!("{problem:?}").starts_with(want_problem),
            "{text}: {problem:?}"
        );
        assert!(
            err.to_string().starts_with("enablement_selectors="),
            "{err}"
        );
    }
}

#[test]
fn valid_keys_and_values_are_accepted() {
    let ok = [
        "- podSelector: {matchLabels: {istio.io/dataplane-mode: ambient}}",
        "- podSelector: {matchLabels: {a: ''}}",
        "- podSelector: {matchLabels: {A_b.C-9: X_y.z-0}}",
        "- podSelector: {matchLabels: {sub.example-1.com/Name: v}}",
        "- podSelector: {matchExpressions: [{key: a, operator: Exists}, {key: b, operator: DoesNotExist, values: []}]}",
        "- podSelector: {matchExpressions: [{key: a, operator: In, values: ['']}]}",
    ];
    for text in ok {
        text.parse::<EnablementSelectors>().expect(text);
    }
    let exactly_63 = format!(
        "- podSelector: {{matchLabels: {{{0}: {0}}}}}",
        "b".repeat(63)
    );
    exactly_63.parse::<EnablementSelectors>().expect("63 chars");
}

#[test]
fn requirements_match_like_kubernetes() {
    use Operator::*;
    let present = labels(&[("k", "v"), ("other", "x")]);
    let empty = labels(&[]);
    let cases = [
        (In, vec!["v"], &present, true),
        (In, vec!["w", "v"], &present, true),
        (In, vec!["w"], &present, false),
        (In, vec!["v"], &empty, false),
        (NotIn, vec!["v"], &present, false),
        (NotIn, vec!["w"], &present, true),
        (NotIn, vec!["v"], &empty, true),
        (Exists, vec![], &present, true),
        (Exists, vec![], &empty, false),
        (DoesNotExist, vec![], &present, false),
        (DoesNotExist, vec![], &empty, true),
    ];
    for (op, values, set, want) in cases {
        let r = Requirement::one_of(op, "k", values.clone());
        assert_eq!(r.matches(set), want, "{op:?} {values:?} on {set:?}");
    }
    let both = LabelSelector::new(vec![
        Requirement::one_of(In, "k", ["v"]),
        Requirement::one_of(Exists, "other", Vec::<String>::new()),
    ])
    .expect("valid");
    assert!(both.matches(&present));
    assert!(
        !both.matches(&labels(&[("k", "v")])),
        "all requirements must hold"
    );
    assert!(LabelSelector::everything().matches(&empty));
    assert!(LabelSelector::new(vec![Requirement::one_of(In, "k", Vec::<String>::new())]).is_err());
}

#[test]
fn matches_namespace_ignores_empty_namespace_selectors() {
    let d = EnablementSelectors::default();
    assert!(d.matches_namespace(&labels(&[AMBIENT])));
    assert!(!d.matches_namespace(&labels(&[NONE])));
    assert!(!d.matches_namespace(&labels(&[])));
    let pod_only: EnablementSelectors = "- podSelector: {matchLabels: {a: b}}".parse().expect("ok");
    assert!(
        !pod_only.matches_namespace(&labels(&[])),
        "empty ns selector is skipped"
    );
}
