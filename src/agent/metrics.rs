//! The node agent's metrics: `istio_cni_plugin_requests_total{response_code}` (istio-cni's, one per
//! request on the plugin socket; `../shared/spec/istio-cni.md` §1.5),
//! `nodeagent_reconcile_events_total{type}` (istio-cni's name, one per change the Kubernetes
//! watches deliver; `type` is `pod` or `namespace`, where Istio's informer says add/update/delete),
//! and the gauges `ztnode_agent_pods_enrolled` and `ztnode_agent_pods_pending` (pods in the table
//! whose proxy took them, and those waiting for it: ztnode's own, Istio has no such figure).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResponseCode {
    response_code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventType {
    r#type: &'static str,
}

/// The agent's metric families (clones share the series).
#[derive(Clone, Debug, Default)]
pub struct AgentMetrics {
    plugin_requests: Family<ResponseCode, Counter>,
    reconcile_events: Family<EventType, Counter>,
    /// Pods enrolled whose proxy took them.
    pub enrolled: Gauge,
    /// Pods enrolled whose proxy has not taken them yet (retried).
    pub pending: Gauge,
}

impl AgentMetrics {
    /// Registers every family into `registry` (unprefixed: the names carry their prefixes).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "istio_cni_plugin_requests",
            "Total number of CNI plugin requests, by response code",
            self.plugin_requests.clone(),
        );
        registry.register(
            "nodeagent_reconcile_events",
            "Total number of node agent reconcile events",
            self.reconcile_events.clone(),
        );
        registry.register(
            "ztnode_agent_pods_enrolled",
            "Pods enrolled in the mesh whose proxy took them",
            self.enrolled.clone(),
        );
        registry.register(
            "ztnode_agent_pods_pending",
            "Pods enrolled in the mesh whose proxy has not taken them yet",
            self.pending.clone(),
        );
    }

    /// Counts a plugin request answered with HTTP status `code`.
    pub fn plugin_request(&self, code: http::StatusCode) {
        self.plugin_requests
            .get_or_create(&ResponseCode {
                response_code: code.as_u16().to_string(),
            })
            .inc();
    }

    /// Counts a reconcile event of `kind` (`pod`, `namespace`).
    pub fn reconcile_event(&self, kind: &'static str) {
        self.reconcile_events
            .get_or_create(&EventType { r#type: kind })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_with_istio_cni_names() {
        let m = AgentMetrics::default();
        m.plugin_request(http::StatusCode::OK);
        m.plugin_request(http::StatusCode::OK);
        m.plugin_request(http::StatusCode::INTERNAL_SERVER_ERROR);
        m.reconcile_event("pod");
        m.enrolled.set(3);
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).expect("encode");
        for want in [
            "istio_cni_plugin_requests_total{response_code=\"200\"} 2\n",
            "istio_cni_plugin_requests_total{response_code=\"500\"} 1\n",
            "nodeagent_reconcile_events_total{type=\"pod\"} 1\n",
            "ztnode_agent_pods_enrolled 3\n",
            "ztnode_agent_pods_pending 0\n",
        ] {
            assert!(text.contains(want), "no {want:?} in {text}");
        }
    }
}
