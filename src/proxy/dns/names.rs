//! Which mesh host a queried name means for a pod, as ztunnel's DNS `Store` decides it
//! (`src/dns/server.rs` `get_aliases`, `to_kube_fqdns`, `get_wildcards`, `find_server`,
//! `get_addresses`):
//!
//! - the name itself, and its Kubernetes FQDN for the pod's namespace: `<svc>` →
//!   `<svc>.<ns>.svc.<cd>`, `<svc>.<ns>` → `<svc>.<ns>.svc.<cd>`, `<svc>.<ns>.svc` →
//!   `<svc>.<ns>.svc.<cd>`;
//! - the name with one of the pod's search domains (`<ns>.svc.<cd>`, `svc.<cd>`, `<cd>`)
//!   stripped, and that stripped name's FQDN: such a match is answered with a CNAME from the
//!   queried name to the stripped one (the pod's resolver appended a search domain to a name that
//!   is a mesh host as it is);
//! - for each of these, the name, then wildcards of decreasing specificity (`*.example.com`,
//!   `*.com`) against service hostnames; then (ztnode) the exact name against workload hostnames.
//!
//! A service answers only if it has VIPs (headless services are left to the upstream); among
//! services sharing a hostname the one in the pod's namespace wins, then a `canonical` one, then
//! the first. Only VIPs on the pod's network are returned, in random order, of the queried family;
//! a service whose `ipFamilies` excludes the family answers with no records.
//!
//! Names are compared in lowercase, label by label (DNS names are case-insensitive, RFC 4343).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use crate::proxy::state::{IpFamily, ProxyState, Service, Workload};

/// Label that marks a Kubernetes service name (`<svc>.<ns>.svc`).
const SVC: &str = "svc";

/// The mesh's hostnames from one state snapshot, lowercased.
#[derive(Debug, Default)]
pub struct HostIndex {
    services: HashMap<String, Vec<Arc<Service>>>,
    workloads: HashMap<String, Vec<Arc<Workload>>>,
}

/// What a name resolved to.
#[derive(Debug, Clone)]
pub enum Target {
    /// A service (answered with its VIPs).
    Service(Arc<Service>),
    /// A workload by its `hostname` (answered with its IPs).
    Workload(Arc<Workload>),
}

/// A match of a queried name.
#[derive(Debug, Clone)]
pub struct Match {
    /// What it resolved to.
    pub target: Target,
    /// When the match came from the name with a search domain stripped: the number of leading
    /// labels of the queried name that make the stripped name (the CNAME's target).
    pub stripped_labels: Option<usize>,
    /// The match was against a wildcard hostname (no CNAME then, as ztunnel).
    pub wildcard: bool,
}

/// One name to look up for a query.
#[derive(Debug, PartialEq, Eq)]
struct Alias {
    name: String,
    stripped_labels: Option<usize>,
}

impl HostIndex {
    /// The hostnames of `state`'s services (with VIPs) and workloads (with a `hostname`).
    pub fn new(state: &ProxyState) -> HostIndex {
        let mut idx = HostIndex::default();
        for s in state.services().filter(|s| !s.vips.is_empty()) {
            idx.services
                .entry(normalize(&s.hostname))
                .or_default()
                .push(s.clone());
        }
        for w in state.workloads().filter(|w| !w.hostname.is_empty()) {
            idx.workloads
                .entry(normalize(&w.hostname))
                .or_default()
                .push(w.clone());
        }
        idx
    }

    /// The mesh host that `labels` (the queried name, lowercase, without the root) means for a
    /// pod in `namespace` with cluster domain `cluster_domain`, if any.
    pub fn find(&self, labels: &[String], namespace: &str, cluster_domain: &str) -> Option<Match> {
        for alias in aliases(labels, namespace, cluster_domain) {
            for (i, candidate) in wildcards(&alias.name).into_iter().enumerate() {
                if let Some(svc) = self.service(&candidate, namespace) {
                    return Some(Match {
                        target: Target::Service(svc),
                        stripped_labels: alias.stripped_labels,
                        wildcard: i > 0,
                    });
                }
            }
            if let Some(w) = self.workloads.get(&alias.name).and_then(|ws| {
                ws.iter()
                    .find(|w| w.namespace == namespace)
                    .or_else(|| ws.first())
            }) {
                return Some(Match {
                    target: Target::Workload(w.clone()),
                    stripped_labels: alias.stripped_labels,
                    wildcard: false,
                });
            }
        }
        None
    }

    fn service(&self, host: &str, namespace: &str) -> Option<Arc<Service>> {
        let all = self.services.get(host)?;
        all.iter()
            .find(|s| s.namespace == namespace)
            .or_else(|| all.iter().find(|s| s.canonical))
            .or_else(|| all.first())
            .cloned()
    }
}

impl Match {
    /// The addresses to answer a query of family `v6` (AAAA) or v4 (A) from `client`.
    pub fn addresses(&self, client: &Workload, v6: bool) -> Vec<IpAddr> {
        let family = |ip: &IpAddr| ip.is_ipv6() == v6;
        let mut out: Vec<IpAddr> = match &self.target {
            Target::Service(s) => {
                let allowed = match s.ip_families {
                    Some(IpFamily::IPv4) => !v6,
                    Some(IpFamily::IPv6) => v6,
                    Some(IpFamily::Dual) | None => true,
                };
                if !allowed {
                    return Vec::new();
                }
                s.vips
                    .iter()
                    .filter(|(network, ip)| *network == client.network && family(ip))
                    .map(|(_, ip)| *ip)
                    .collect()
            }
            Target::Workload(w) => w.workload_ips.iter().copied().filter(family).collect(),
        };
        fastrand::shuffle(&mut out);
        out
    }
}

/// A hostname as the index keys it: lowercase, no trailing dot.
fn normalize(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// The names to try for `labels`, in order, without duplicates (ztunnel's `get_aliases`).
fn aliases(labels: &[String], namespace: &str, cluster_domain: &str) -> Vec<Alias> {
    let mut out: Vec<Alias> = Vec::new();
    let mut add = |name: String, stripped_labels: Option<usize>| {
        if !out.iter().any(|a| a.name == name) {
            out.push(Alias {
                name,
                stripped_labels,
            });
        }
    };
    add(labels.join("."), None);
    if let Some(fqdn) = kube_fqdns(labels, namespace, cluster_domain) {
        add(fqdn, None);
    }
    for domain in search_domains(namespace, cluster_domain) {
        let suffix: Vec<&str> = domain.split('.').collect();
        if labels.len() <= suffix.len() {
            continue;
        }
        let keep = labels.len() - suffix.len();
        if labels[keep..]
            .iter()
            .map(String::as_str)
            .ne(suffix.iter().copied())
        {
            continue;
        }
        let stripped = &labels[..keep];
        add(stripped.join("."), Some(keep));
        if let Some(fqdn) = kube_fqdns(stripped, namespace, cluster_domain) {
            add(fqdn, Some(keep));
        }
    }
    out
}

/// A pod's search domains in Kubernetes (`<ns>.svc.<cd> svc.<cd> <cd>`), as ztunnel assumes them
/// for every pod in shared mode.
fn search_domains(namespace: &str, cluster_domain: &str) -> [String; 3] {
    [
        format!("{namespace}.{SVC}.{cluster_domain}"),
        format!("{SVC}.{cluster_domain}"),
        cluster_domain.to_owned(),
    ]
}

/// The Kubernetes service FQDN that a short name can stand for (ztunnel's `to_kube_fqdns`,
/// without the headless pod-host forms).
fn kube_fqdns(labels: &[String], namespace: &str, cluster_domain: &str) -> Option<String> {
    let name = labels.join(".");
    match labels {
        [_] => Some(format!("{name}.{namespace}.{SVC}.{cluster_domain}")),
        [_, _] => Some(format!("{name}.{SVC}.{cluster_domain}")),
        [_, _, last] if last == SVC => Some(format!("{name}.{cluster_domain}")),
        _ => None,
    }
}

/// `name`, then each wildcard above it: `a.b.c` → `a.b.c`, `*.b.c`, `*.c` (ztunnel's
/// `get_wildcards`).
fn wildcards(name: &str) -> Vec<String> {
    let mut out = vec![name.to_owned()];
    let mut rest = name;
    while let Some((_, parent)) = rest.split_once('.') {
        out.push(format!("*.{parent}"));
        rest = parent;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::config::parse_local_config;

    fn labels(name: &str) -> Vec<String> {
        name.split('.').map(str::to_owned).collect()
    }

    fn index(yaml: &str) -> HostIndex {
        let cfg = parse_local_config(yaml).expect("config");
        HostIndex::new(&ProxyState::from_config(&cfg).expect("state"))
    }

    const MESH: &str = "workloads:\n\
        - {uid: w1, name: client, namespace: ns1, workloadIps: [\"10.0.0.2\"], hostname: db-0.db.ns1.svc.cluster.local}\n\
        services:\n\
        - {name: productpage, namespace: ns1, hostname: productpage.ns1.svc.cluster.local, vips: [\"/10.1.0.1\", \"/fd00::1\"]}\n\
        - {name: example, namespace: ns2, hostname: example.ns2.svc.cluster.local, vips: [\"/10.1.0.2\"], ipFamilies: IPv4}\n\
        - {name: headless, namespace: ns1, hostname: headless.ns1.svc.cluster.local}\n\
        - {name: wild, namespace: ns1, hostname: \"*.wild.example\", vips: [\"/10.1.0.3\"]}\n\
        - {name: ext, namespace: ns1, hostname: www.example.com, vips: [\"/10.1.0.4\"]}\n\
        - {name: remote, namespace: ns1, hostname: remote.example, vips: [\"net2/10.1.0.5\"]}\n";

    fn find(idx: &HostIndex, name: &str) -> Option<Match> {
        idx.find(&labels(name), "ns1", "cluster.local")
    }

    fn service_name(m: &Match) -> &str {
        match &m.target {
            Target::Service(s) => &s.name,
            Target::Workload(w) => &w.name,
        }
    }

    #[test]
    fn kubernetes_short_forms_resolve_in_the_pods_namespace() {
        let idx = index(MESH);
        for name in [
            "productpage",
            "productpage.ns1",
            "productpage.ns1.svc",
            "productpage.ns1.svc.cluster.local",
        ] {
            let m = find(&idx, name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(service_name(&m), "productpage", "{name}");
            assert_eq!(m.stripped_labels, None, "{name}: no CNAME");
        }
        // another namespace's service needs its namespace in the name
        assert!(find(&idx, "example").is_none());
        assert_eq!(
            find(&idx, "example.ns2").map(|m| service_name(&m).to_owned()),
            Some("example".into())
        );
        // a service without VIPs is left to the upstream
        assert!(find(&idx, "headless").is_none());
        assert!(find(&idx, "unknown.ns1.svc.cluster.local").is_none());
    }

    #[test]
    fn a_search_domain_appended_by_the_pod_is_stripped_and_answered_with_a_cname() {
        let idx = index(MESH);
        // `productpage.ns1` searched in `ns1.svc.cluster.local` first
        let m = find(&idx, "productpage.ns1.ns1.svc.cluster.local").expect("match");
        assert_eq!(service_name(&m), "productpage");
        assert_eq!(m.stripped_labels, Some(2));
        // a non-Kubernetes mesh host searched in each domain
        for (name, keep) in [
            ("www.example.com.ns1.svc.cluster.local", 3),
            ("www.example.com.svc.cluster.local", 3),
            ("www.example.com.cluster.local", 3),
        ] {
            let m = find(&idx, name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!((service_name(&m), m.stripped_labels), ("ext", Some(keep)));
        }
        // another namespace's search domain is not the pod's
        assert!(find(&idx, "www.example.com.ns2.svc.cluster.local").is_none());
    }

    #[test]
    fn wildcards_match_below_their_domain_only() {
        let idx = index(MESH);
        let m = find(&idx, "a.wild.example").expect("wildcard");
        assert!(m.wildcard);
        assert_eq!(service_name(&m), "wild");
        assert!(find(&idx, "a.b.wild.example").is_some());
        assert!(find(&idx, "wild.example").is_none());
        assert_eq!(
            wildcards("a.b.c"),
            vec!["a.b.c".to_owned(), "*.b.c".into(), "*.c".into()]
        );
    }

    #[test]
    fn addresses_are_the_queried_family_on_the_clients_network() {
        let idx = index(MESH);
        let client = Workload::from_handoff("cluster.local", "u", "client", "ns1", "sa", vec![]);
        let pp = find(&idx, "productpage").expect("match");
        assert_eq!(
            pp.addresses(&client, false),
            vec!["10.1.0.1".parse::<IpAddr>().expect("ip")]
        );
        assert_eq!(
            pp.addresses(&client, true),
            vec!["fd00::1".parse::<IpAddr>().expect("ip")]
        );
        // IPv4-only service: no AAAA even if asked
        let ex = find(&idx, "example.ns2.svc").expect("match");
        assert!(ex.addresses(&client, true).is_empty());
        // VIP on another network: found (so not forwarded) but nothing to answer
        let remote = find(&idx, "remote.example").expect("match");
        assert!(remote.addresses(&client, false).is_empty());
    }

    #[test]
    fn workload_hostnames_resolve_to_the_workloads_ips() {
        let idx = index(MESH);
        let m = find(&idx, "db-0.db.ns1.svc.cluster.local").expect("workload host");
        let client = Workload::from_handoff("cluster.local", "u", "client", "ns1", "sa", vec![]);
        assert!(matches!(m.target, Target::Workload(_)));
        assert_eq!(
            m.addresses(&client, false),
            vec!["10.0.0.2".parse::<IpAddr>().expect("ip")]
        );
        assert!(m.addresses(&client, true).is_empty());
    }

    #[test]
    fn the_pods_namespace_wins_among_services_sharing_a_hostname() {
        let idx = index(
            "services:\n\
             - {name: a, namespace: other, hostname: shared.example, vips: [\"/10.2.0.1\"]}\n\
             - {name: b, namespace: ns1, hostname: shared.example, vips: [\"/10.2.0.2\"]}\n\
             - {name: c, namespace: x, hostname: canon.example, vips: [\"/10.2.0.3\"]}\n\
             - {name: d, namespace: y, hostname: canon.example, vips: [\"/10.2.0.4\"], canonical: true}\n",
        );
        assert_eq!(service_name(&find(&idx, "shared.example").expect("m")), "b");
        assert_eq!(service_name(&find(&idx, "canon.example").expect("m")), "d");
        assert_eq!(
            service_name(&find(&idx, "SHARED.example".to_ascii_lowercase().as_str()).expect("m")),
            "b"
        );
    }
}
