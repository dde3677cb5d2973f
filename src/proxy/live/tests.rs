use std::future::{Pending, pending};
use std::time::Duration;

use futures::FutureExt;

use super::*;
use crate::proxy::config::parse_local_config;
use crate::proxy::state::{ProxyState, StateHandle};

const SERVER: &str = "workloads:
- {uid: c1//v1/Pod/default/server, name: server, namespace: default, serviceAccount: bob, workloadIps: [10.0.0.3], protocol: HBONE}
";

/// The server, then `rest` (more workloads, then `policies:`).
fn state(rest: &str) -> ProxyState {
    let cfg = parse_local_config(&format!("{SERVER}{rest}")).expect("config");
    ProxyState::from_config(&cfg).expect("state")
}

fn server(st: &ProxyState) -> Arc<Workload> {
    st.workload_by_name("default", "server").expect("server")
}

fn alice() -> Identity {
    Identity::new("cluster.local", "default", "alice")
}

/// alice's connection from 10.0.0.2 to the server's `port`.
fn to(id: &Identity, port: u16) -> authz::Connection<'_> {
    authz::Connection {
        src_identity: Some(id),
        src_ip: "10.0.0.2".parse().expect("ip"),
        dst: SocketAddr::new("10.0.0.3".parse().expect("ip"), port),
    }
}

/// An idle relay that has moved 7 bytes up and 3 down.
impl SoFar for Pending<Result<Transferred, CopyError>> {
    fn so_far(&self) -> Transferred {
        Transferred {
            sent: 7,
            received: 3,
        }
    }
}

impl SoFar for std::future::Ready<Result<Transferred, CopyError>> {
    fn so_far(&self) -> Transferred {
        Transferred::default()
    }
}

type Idle = Revocable<Pending<Result<Transferred, CopyError>>>;

fn idle(live: &Arc<LiveConnections>, conn: &authz::Connection<'_>) -> Idle {
    live.register(conn).revocable(pending())
}

#[tokio::test]
async fn a_recheck_closes_the_connections_now_denied_and_no_other() {
    let live = Arc::new(LiveConnections::default());
    let id = alice();
    let r80 = idle(&live, &to(&id, 80));
    let mut r81 = idle(&live, &to(&id, 81));
    assert_eq!(live.len(), 2);

    let allowing = state("");
    assert_eq!(live.recheck(&allowing, &server(&allowing)), 0);
    let denying = state(
        "policies:\n- {name: no-80, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [80]}]]]}\n",
    );
    assert_eq!(live.recheck(&denying, &server(&denying)), 1);
    assert_eq!(live.len(), 1, "the closed one is no longer tracked");

    let e = tokio::time::timeout(Duration::from_secs(5), r80)
        .await
        .expect("the denied relay ends")
        .expect_err("with an error");
    assert_eq!(
        e.error.to_string(),
        "connection closed due to policy change: explicitly denied by: default/no-80"
    );
    assert_eq!(
        (e.transferred.sent, e.transferred.received),
        (7, 3),
        "a revoked connection reports what it moved"
    );
    let late = e
        .error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<LateRejection>())
        .expect("a LateRejection");
    assert_eq!(late.0, Denied::Explicit("default/no-80".into()));
    assert!((&mut r81).now_or_never().is_none(), "port 81 keeps running");
    // checked again: nothing more to close
    assert_eq!(live.recheck(&denying, &server(&denying)), 0);
    drop(r81);
    assert!(live.is_empty(), "an ended connection gives up its place");
}

#[tokio::test]
async fn a_relay_that_ends_by_itself_is_not_revoked_and_unregisters() {
    let live = Arc::new(LiveConnections::default());
    let id = alice();
    let done = live
        .register(&to(&id, 80))
        .revocable(std::future::ready(Ok(Transferred {
            sent: 1,
            received: 2,
        })));
    assert_eq!(live.len(), 1);
    let t = done.await.expect("relay result");
    assert_eq!((t.sent, t.received), (1, 2));
    assert!(live.is_empty());
}

#[tokio::test]
async fn a_closing_decided_before_the_relay_starts_ends_it_at_once() {
    // a re-check may close a connection still in its setup (app connect): the relay built after
    // it ends on its first poll
    let live = Arc::new(LiveConnections::default());
    let id = alice();
    let registration = live.register(&to(&id, 80));
    let denying = state(
        "policies:\n- {name: blank, namespace: default, scope: Namespace, action: Deny, rules: [[[{}]]]}\n",
    );
    assert_eq!(live.recheck(&denying, &server(&denying)), 1);
    let relay = registration.revocable(pending::<Result<Transferred, CopyError>>());
    let e = relay
        .now_or_never()
        .expect("ends on the first poll")
        .expect_err("rejected");
    assert!(e.error.to_string().contains("default/blank"), "{e}");
}

#[test]
fn plaintext_connections_are_rechecked_without_identity() {
    let live = Arc::new(LiveConnections::default());
    let plain = authz::Connection {
        src_identity: None,
        src_ip: "10.9.0.1".parse().expect("ip"),
        dst: "10.0.0.3:80".parse().expect("addr"),
    };
    let _r = idle(&live, &plain);
    let mesh_only = state(
        "policies:\n- {name: mesh, namespace: default, scope: Namespace, action: Allow, rules: [[[{namespaces: [Presence]}]]]}\n",
    );
    assert_eq!(live.recheck(&mesh_only, &server(&mesh_only)), 1);
}

#[tokio::test]
async fn the_watcher_rechecks_when_the_policies_or_the_workload_change_and_only_then() {
    let deny_80 = "policies:\n- {name: no-80, namespace: default, scope: Namespace, action: Deny, rules: [[[{destinationPorts: [80]}]]]}\n";
    let handle = StateHandle::new(state(""));
    let live = Arc::new(LiveConnections::default());
    let start = server(&handle.load());
    let mut watcher = PolicyWatcher::new(handle.clone(), live.clone(), start);
    let id = alice();
    let r80 = idle(&live, &to(&id, 80));

    // another workload added, no policy touched: nothing to re-check
    let other = "- {uid: c1//v1/Pod/default/other, name: other, namespace: default, workloadIps: [10.0.0.9]}\n";
    handle.store(state(other));
    tokio::time::timeout(Duration::from_secs(5), watcher.changed())
        .await
        .expect("a new version");
    assert_eq!(watcher.recheck(), 0);

    handle.store(state(deny_80));
    tokio::time::timeout(Duration::from_secs(5), watcher.changed())
        .await
        .expect("a new version");
    assert_eq!(watcher.recheck(), 1);
    assert!(r80.await.is_err(), "closed");

    // a connection that slipped in under the deny is not re-checked while nothing relevant changes
    let _r = idle(&live, &to(&id, 80));
    handle.store(state(&format!("{other}{deny_80}")));
    watcher.changed().await;
    assert_eq!(watcher.recheck(), 0, "same policies, same server workload");
    // the server's workload changes (it names a selector policy): re-checked
    let named = format!(
        "{}{deny_80}",
        SERVER.replace(
            "protocol: HBONE}",
            "protocol: HBONE, authorizationPolicies: [default/x]}"
        )
    );
    let cfg = parse_local_config(&named).expect("config");
    handle.store(ProxyState::from_config(&cfg).expect("state"));
    watcher.changed().await;
    assert_eq!(watcher.recheck(), 1);
}
