//! The enrollment rules' view of Kubernetes objects: [`PodFacts`] and [`NamespaceFacts`] from a
//! `Pod` and a `Namespace` as the API serves them.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Pod};

use crate::agent::enroll::{NamespaceFacts, PodFacts, PodPhase, PodUid};

/// The facts of `pod`. IPs are `status.podIPs` (or `status.podIP` when the list is empty);
/// unparsable addresses are skipped. A pod without `spec.serviceAccountName` has Kubernetes'
/// `default`.
pub fn pod_facts(pod: &Pod) -> PodFacts {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    PodFacts {
        name: meta.name.clone().unwrap_or_default(),
        namespace: meta.namespace.clone().unwrap_or_default(),
        uid: PodUid::new(meta.uid.clone().unwrap_or_default()),
        labels: meta.labels.clone().unwrap_or_default(),
        annotations: meta.annotations.clone().unwrap_or_default(),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        service_account: spec
            .and_then(|s| s.service_account_name.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".to_owned()),
        node_name: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        ips: pod_ips(pod),
        phase: PodPhase::from_api(status.and_then(|s| s.phase.as_deref()).unwrap_or("")),
    }
}

/// `status.podIPs`, else `status.podIP`, parsed.
pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    let listed: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok())
        .collect();
    if !listed.is_empty() {
        return listed;
    }
    status
        .pod_ip
        .iter()
        .filter_map(|ip| ip.parse().ok())
        .collect()
}

/// The facts of namespace `name` (`None`: not known, so no labels).
pub fn namespace_facts(ns: Option<&Namespace>, name: &str) -> NamespaceFacts {
    NamespaceFacts {
        name: name.to_owned(),
        labels: ns
            .and_then(|n| n.metadata.labels.clone())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_come_from_the_api_fields() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "app", "uid": "u-1",
                         "labels": {"istio.io/dataplane-mode": "ambient"},
                         "annotations": {"a": "b"}},
            "spec": {"containers": [], "serviceAccountName": "web-sa", "nodeName": "n1"},
            "status": {"phase": "Running", "podIP": "10.0.0.9",
                       "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]}
        }))
        .expect("pod");
        let f = pod_facts(&pod);
        assert_eq!((f.name.as_str(), f.namespace.as_str()), ("web", "app"));
        assert_eq!(f.uid.as_str(), "u-1");
        assert_eq!(f.service_account, "web-sa");
        assert_eq!(f.node_name, "n1");
        assert_eq!(f.phase, PodPhase::Running);
        assert_eq!(
            f.ips,
            [
                "10.0.0.5".parse::<IpAddr>().expect("ip"),
                "fd00::5".parse().expect("ip")
            ]
        );
        assert_eq!(f.labels["istio.io/dataplane-mode"], "ambient");
        assert!(!f.host_network);
    }

    #[test]
    fn defaults_when_fields_are_missing() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "n"},
            "spec": {"containers": [], "hostNetwork": true},
            "status": {"podIP": "10.1.1.1"}
        }))
        .expect("pod");
        let f = pod_facts(&pod);
        assert_eq!(f.service_account, "default");
        assert!(f.host_network);
        assert_eq!(f.ips, ["10.1.1.1".parse::<IpAddr>().expect("ip")]);
        assert_eq!(f.phase, PodPhase::Unknown);
        assert!(namespace_facts(None, "n").labels.is_empty());
    }
}
