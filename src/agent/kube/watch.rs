//! Watches of this node's pods (field selector `spec.nodeName=<node>`) and of all namespaces, as
//! kube-rs reflectors (`../shared/spec/istio-cni.md` §3.3): each keeps a store of the objects and
//! reports every change as a [`Change`] for the reconciler. Bookmarks are asked for; a 410 Gone or a
//! dropped connection makes the watcher relist, with backoff while the API server is unreachable
//! (the stores keep the last known objects meanwhile).

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::mpsc;

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Pod `namespace/name` was created, changed or deleted (the store says which).
    Pod {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// Namespace `name` was created, changed or deleted: its pods need a look.
    Namespace(String),
    /// A (re)list of the pods is complete: the store holds every pod of the node.
    PodsSynced,
    /// A (re)list of the namespaces is complete.
    NamespacesSynced,
}

/// The stores the watches keep up to date.
#[derive(Clone)]
pub struct Watches {
    /// This node's pods.
    pub pods: Store<Pod>,
    /// All namespaces.
    pub namespaces: Store<Namespace>,
}

impl Watches {
    /// Starts both watches on the current runtime; changes go to `changes`. They run until the
    /// receiver is dropped.
    pub fn start(
        client: kube::Client,
        node_name: &str,
        changes: mpsc::UnboundedSender<Change>,
    ) -> Watches {
        let (pods, pod_writer) = reflector::store();
        let (namespaces, ns_writer) = reflector::store();
        let pod_config = watcher::Config::default()
            .fields(&format!("spec.nodeName={node_name}"))
            .any_semantic();
        let pod_stream = reflector::reflector(
            pod_writer,
            watcher(Api::<Pod>::all(client.clone()), pod_config),
        )
        .backoff(WatchBackoff::new());
        let ns_stream = reflector::reflector(
            ns_writer,
            watcher(Api::<Namespace>::all(client), watcher::Config::default()),
        )
        .backoff(WatchBackoff::new());
        tokio::spawn(forward(
            pod_stream,
            changes.clone(),
            "pods",
            |p: &Pod| Change::Pod {
                namespace: p.metadata.namespace.clone().unwrap_or_default(),
                name: p.metadata.name.clone().unwrap_or_default(),
            },
            Change::PodsSynced,
        ));
        tokio::spawn(forward(
            ns_stream,
            changes,
            "namespaces",
            |n: &Namespace| Change::Namespace(n.metadata.name.clone().unwrap_or_default()),
            Change::NamespacesSynced,
        ));
        Watches { pods, namespaces }
    }

    /// Pod `namespace/name` as last seen.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<std::sync::Arc<Pod>> {
        self.pods.get(&ObjectRef::new(name).within(namespace))
    }

    /// Namespace `name` as last seen.
    pub fn namespace(&self, name: &str) -> Option<std::sync::Arc<Namespace>> {
        self.namespaces.get(&ObjectRef::new(name))
    }

    /// Every pod of the node in `namespace`.
    pub fn pods_in(&self, namespace: &str) -> Vec<std::sync::Arc<Pod>> {
        self.pods
            .state()
            .into_iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
            .collect()
    }
}

/// Turns a reflector's events into [`Change`]s until `changes` is closed.
async fn forward<K, S>(
    stream: S,
    changes: mpsc::UnboundedSender<Change>,
    what: &'static str,
    change: impl Fn(&K) -> Change,
    synced: Change,
) where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut stream = std::pin::pin!(stream);
    let mut failing = false;
    while let Some(ev) = stream.next().await {
        let sent = match ev {
            Ok(
                watcher::Event::Apply(o) | watcher::Event::Delete(o) | watcher::Event::InitApply(o),
            ) => changes.send(change(&o)),
            Ok(watcher::Event::Init) => {
                if failing {
                    tracing::info!(watch = what, "watch re-established, relisting");
                    failing = false;
                }
                Ok(())
            }
            Ok(watcher::Event::InitDone) => changes.send(synced.clone()),
            Err(e) => {
                if !failing {
                    tracing::warn!(watch = what, error = %e, "watch failed; retrying with backoff");
                }
                failing = true;
                Ok(())
            }
        };
        if sent.is_err() {
            return;
        }
    }
}

/// The watches' retry delays ([`crate::backoff::WATCH_RETRY`]) as kube-rs' stream backoff: reset
/// when the stream yields again.
struct WatchBackoff(crate::backoff::Backoff);

impl WatchBackoff {
    fn new() -> WatchBackoff {
        WatchBackoff(crate::backoff::Backoff::new(crate::backoff::WATCH_RETRY))
    }
}

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;

    fn next(&mut self) -> Option<std::time::Duration> {
        Some(self.0.next_delay())
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.0.reset();
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;
    use kube::runtime::utils::Backoff as _;

    #[test]
    fn watch_retries_stay_within_five_seconds_and_start_over_after_a_success() {
        let mut b = WatchBackoff::new();
        let delays: Vec<_> = (0..12).filter_map(|_| b.next()).collect();
        assert!(
            delays[0] <= std::time::Duration::from_millis(600),
            "{delays:?}"
        );
        assert!(
            delays
                .iter()
                .all(|d| *d <= std::time::Duration::from_secs(5)),
            "{delays:?}"
        );
        assert!(
            delays[11] >= std::time::Duration::from_secs(4),
            "{delays:?}"
        );
        b.reset();
        assert!(
            b.next()
                .is_some_and(|d| d <= std::time::Duration::from_millis(600))
        );
    }
}
