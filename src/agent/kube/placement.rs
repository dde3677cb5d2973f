//! Whether a DaemonSet still places a pod on a node, from its pod template's `nodeSelector` and
//! required node affinity (`requiredDuringSchedulingIgnoredDuringExecution`), as the scheduler
//! reads them. The shutdown check uses it: a DaemonSet that no longer selects this node (its
//! selector or affinity was changed) removes its pod here for good, which is an uninstall from
//! this node (istio-cni's `ShouldStopCleanup`, `../shared/spec/istio-cni.md` §3.10). Taints are
//! not looked at: ztnode tolerates every taint.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm};

/// Whether `ds` constrains where its pods run at all (then the node is worth reading).
pub fn constrains_nodes(ds: &DaemonSet) -> bool {
    let Some(pod) = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()) else {
        return false;
    };
    pod.node_selector.as_ref().is_some_and(|s| !s.is_empty()) || required_terms(ds).is_some()
}

/// Whether `ds`'s pods may run on `node`: every `nodeSelector` label matches, and when required
/// node affinity is set, at least one of its terms matches (each term: all its expressions on
/// labels and fields). A term with no requirements matches nothing, as in Kubernetes.
pub fn selects(ds: &DaemonSet, node: &Node) -> bool {
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let pod = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref());
    let selector_ok = pod
        .and_then(|p| p.node_selector.as_ref())
        .is_none_or(|sel| sel.iter().all(|(k, v)| labels.get(k) == Some(v)));
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let affinity_ok =
        required_terms(ds).is_none_or(|terms| terms.iter().any(|t| term_matches(t, labels, name)));
    selector_ok && affinity_ok
}

fn required_terms(ds: &DaemonSet) -> Option<&Vec<NodeSelectorTerm>> {
    ds.spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .map(|s| &s.node_selector_terms)
}

fn term_matches(term: &NodeSelectorTerm, labels: &BTreeMap<String, String>, name: &str) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs
        .iter()
        .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            let value = (r.key == "metadata.name").then_some(name);
            requirement_matches(r, value)
        })
}

/// One requirement against the value of its key (`None`: the node has no such label/field).
/// Unknown operators and unparsable numbers match nothing.
fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), [want]) = (value.and_then(number), values) else {
                return false;
            };
            let Some(want) = number(want) else {
                return false;
            };
            if r.operator == "Gt" {
                have > want
            } else {
                have < want
            }
        }
        _ => false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ds(pod_spec: serde_json::Value) -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": "ztnode"},
            "spec": {"selector": {}, "template": {"spec": pod_spec}}
        }))
        .unwrap()
    }

    fn node(name: &str, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
    }

    fn affinity(terms: serde_json::Value) -> DaemonSet {
        ds(json!({"containers": [], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}))
    }

    #[test]
    fn node_selector_must_match_every_label() {
        let linux = node("n1", json!({"kubernetes.io/os": "linux", "pool": "a"}));
        let d = ds(json!({"containers": [], "nodeSelector": {"kubernetes.io/os": "linux"}}));
        assert!(constrains_nodes(&d));
        assert!(selects(&d, &linux));
        let d = ds(
            json!({"containers": [], "nodeSelector": {"kubernetes.io/os": "linux", "pool": "b"}}),
        );
        assert!(!selects(&d, &linux));
        let free = ds(json!({"containers": []}));
        assert!(!constrains_nodes(&free));
        assert!(selects(&free, &linux));
    }

    #[test]
    fn affinity_terms_are_ored_their_requirements_anded() {
        let n = node("n1", json!({"zone": "z1", "cores": "8"}));
        let d = affinity(json!([
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z2"]}]},
            {"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["z1", "z3"]},
                {"key": "cores", "operator": "Gt", "values": ["4"]},
                {"key": "gpu", "operator": "DoesNotExist"}
            ]}
        ]));
        assert!(constrains_nodes(&d));
        assert!(selects(&d, &n));
        let d = affinity(json!([{"matchExpressions": [
            {"key": "zone", "operator": "NotIn", "values": ["z1"]}]}]));
        assert!(!selects(&d, &n));
        let d = affinity(json!([{"matchExpressions": [
            {"key": "cores", "operator": "Lt", "values": ["x"]}]}]));
        assert!(!selects(&d, &n), "unparsable number");
        let d = affinity(json!([{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]));
        assert!(!selects(&d, &n));
        assert!(
            !selects(&affinity(json!([{}])), &n),
            "an empty term matches nothing"
        );
    }

    #[test]
    fn match_fields_name_the_node() {
        let d = affinity(json!([{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]));
        assert!(selects(&d, &node("n1", json!({}))));
        assert!(!selects(&d, &node("n2", json!({}))));
    }
}
