//! The pod lifecycle without privileges: a recording [`RuleApplier`], a fake proxy behind
//! [`zds::in_process`] that acks everything, and the test process's own netns (`/proc/self/ns/net`)
//! standing in for pod namespaces.

use std::os::unix::fs::PermissionsExt;

use super::store::StoredNetnsId;
use super::*;
use crate::podevent::{IpNet, PodIp};
use crate::zds::{self, InProcessSender};

const OWN_NETNS: &str = "/proc/self/ns/net";

/// Records `apply`/`remove` calls; `on_apply` runs once, in the first `apply` (an older agent
/// acting meanwhile).
#[derive(Default)]
struct FakeRules {
    calls: Mutex<Vec<&'static str>>,
    on_apply: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl FakeRules {
    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().expect("calls").clone()
    }
}

impl RuleApplier for FakeRules {
    fn apply_for_pod(
        &self,
        _netns: &Netns,
        _pod: &crate::agent::enroll::PodOptions,
    ) -> Result<(), redirect::RedirectError> {
        self.calls.lock().expect("calls").push("apply");
        if let Some(hook) = self.on_apply.lock().expect("hook").take() {
            hook();
        }
        Ok(())
    }
    fn remove(&self, _netns: &Netns) -> Result<(), redirect::RedirectError> {
        self.calls.lock().expect("calls").push("remove");
        Ok(())
    }
}

/// A proxy that acks every request and records it as `add <uid>`, `del <uid>`, `keep <uid>` or
/// `snapshot`.
fn fake_proxy() -> (InProcessSender, Arc<Mutex<Vec<String>>>) {
    let (client, mut rx) = zds::in_process();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Some((req, ack)) = rx.recv().await {
            let line = match req {
                WorkloadRequest::Add { uid, .. } => format!("add {uid}"),
                WorkloadRequest::Del { uid } => format!("del {uid}"),
                WorkloadRequest::Keep { uid } => format!("keep {uid}"),
                WorkloadRequest::SnapshotSent => "snapshot".to_owned(),
            };
            log.lock().expect("log").push(line);
            let _ = ack.send(Ok(()));
        }
    });
    (client, seen)
}

struct Fixture {
    pods: PodManager,
    rules: Arc<FakeRules>,
    proxy: Arc<Mutex<Vec<String>>>,
}

impl Fixture {
    fn new() -> Fixture {
        let (zds, proxy) = fake_proxy();
        let rules = Arc::new(FakeRules::default());
        let policy: Arc<dyn EnrollmentPolicy> = Arc::new(|ns: &str, name: &str| {
            Some(WorkloadInfo {
                name: name.to_owned(),
                namespace: ns.to_owned(),
                service_account: format!("sa-{name}"),
            })
        });
        Fixture {
            pods: PodManager::with_rules(policy, zds, rules.clone()),
            rules,
            proxy,
        }
    }

    fn proxy(&self) -> Vec<String> {
        self.proxy.lock().expect("proxy").clone()
    }
}

fn add_event(name: &str, uid: &str, container_id: &str) -> PodAddEvent {
    PodAddEvent {
        netns: OWN_NETNS.into(),
        pod_name: name.into(),
        pod_namespace: "default".into(),
        pod_uid: uid.into(),
        container_id: container_id.into(),
        if_name: "eth0".into(),
        ips: vec![PodIp {
            interface: Some(0),
            address: IpNet {
                ip: "10.0.0.2".parse().expect("ip"),
                prefix: 24,
            },
            gateway: None,
        }],
    }
}

fn del_event(name: &str, uid: &str, container_id: &str) -> PodDelEvent {
    PodDelEvent {
        netns: OWN_NETNS.into(),
        pod_name: name.into(),
        pod_namespace: "default".into(),
        pod_uid: uid.into(),
        container_id: container_id.into(),
    }
}

fn stored(dir: &Path) -> Vec<PodRecord> {
    Store::new(dir).load().expect("load pods.json")
}

#[tokio::test]
async fn a_late_del_of_an_old_sandbox_keeps_the_new_one() {
    let f = Fixture::new();
    let add = |cid| f.pods.add(add_event("web", "uid-1", cid));
    assert_eq!(add("sandbox-old").await.expect("add"), AddOutcome::Enrolled);
    // the runtime recreated the sandbox: same pod uid, new container id
    assert_eq!(add("sandbox-new").await.expect("add"), AddOutcome::Enrolled);
    assert_eq!(f.rules.calls(), ["apply", "apply"]);

    f.pods
        .del(del_event("web", "uid-1", "sandbox-old"))
        .await
        .expect("late DEL succeeds");
    let enrolled = f.pods.enrolled();
    assert_eq!(enrolled.len(), 1, "the new sandbox stays enrolled");
    assert_eq!(enrolled[0].container_id, "sandbox-new");
    assert_eq!(f.rules.calls(), ["apply", "apply"], "no rules removed");
    assert_eq!(f.proxy(), ["add uid-1", "add uid-1"], "no Del sent");

    f.pods
        .del(del_event("web", "uid-1", "sandbox-new"))
        .await
        .expect("DEL");
    assert!(f.pods.enrolled().is_empty());
    assert_eq!(f.rules.calls(), ["apply", "apply", "remove"]);
    assert_eq!(f.proxy(), ["add uid-1", "add uid-1", "del uid-1"]);
}

#[tokio::test]
async fn the_table_is_persisted_on_every_add_and_del_with_mode_0600() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = Fixture::new();
    let report = f.pods.restore(dir.path()).await.expect("attach");
    assert_eq!(report, RestoreReport::default());
    f.pods
        .add(add_event("a", "uid-a", "cid-a"))
        .await
        .expect("add a");
    f.pods
        .add(add_event("b", "uid-b", "cid-b"))
        .await
        .expect("add b");
    let file = dir.path().join(STATE_FILE);
    let mode = std::fs::metadata(&file)
        .expect("pods.json")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let recs = stored(dir.path());
    assert_eq!(
        recs.iter().map(|r| r.uid.as_str()).collect::<Vec<_>>(),
        ["uid-a", "uid-b"]
    );
    let a = &recs[0];
    assert_eq!(
        (
            a.info.name.as_str(),
            a.info.namespace.as_str(),
            a.info.service_account.as_str()
        ),
        ("a", "default", "sa-a")
    );
    assert_eq!(
        (a.netns.as_str(), a.container_id.as_str()),
        (OWN_NETNS, "cid-a")
    );
    assert_eq!(a.ips, ["10.0.0.2".parse::<IpAddr>().expect("ip")]);
    let own = Netns::open(OWN_NETNS).expect("own netns").id();
    assert_eq!(a.netns_id, Some(own.into()));

    f.pods
        .del(del_event("a", "uid-a", "cid-a"))
        .await
        .expect("del a");
    let recs = stored(dir.path());
    assert_eq!(
        recs.iter().map(|r| r.uid.as_str()).collect::<Vec<_>>(),
        ["uid-b"]
    );
    assert!(
        !dir.path().join("pods.json.tmp").exists(),
        "no temp file left"
    );
}

#[tokio::test]
async fn restore_reapplies_rules_readds_pods_and_drops_gone_netns() {
    let dir = tempfile::tempdir().expect("tempdir");
    // what a previous agent left: enrolled through the real flow
    {
        let f = Fixture::new();
        f.pods.restore(dir.path()).await.expect("attach");
        f.pods
            .add(add_event("a", "uid-a", "cid-a"))
            .await
            .expect("add a");
    }
    let mut recs = stored(dir.path());
    let live = recs[0].clone();
    recs.push(PodRecord {
        uid: "uid-gone".into(),
        netns: "/nonexistent/netns/gone".into(),
        ..live.clone()
    });
    recs.push(PodRecord {
        uid: "uid-replaced".into(),
        netns_id: Some(StoredNetnsId { inode: 1, dev: 1 }),
        ..live.clone()
    });
    Store::new(dir.path()).save(1, recs).expect("write");

    let f = Fixture::new();
    let report = f.pods.restore(dir.path()).await.expect("restore");
    assert_eq!(
        report,
        RestoreReport {
            restored: 1,
            dropped: 2,
            failed: 0
        }
    );
    assert_eq!(f.rules.calls(), ["apply"]);
    assert_eq!(f.proxy(), ["add uid-a", "snapshot"]);
    let enrolled = f.pods.enrolled();
    assert_eq!(enrolled.len(), 1);
    assert_eq!(
        (enrolled[0].uid.as_str(), enrolled[0].container_id.as_str()),
        ("uid-a", "cid-a")
    );
    assert_eq!(stored(dir.path()), [live], "dropped entries leave the file");

    // the restored pod is a normal member: its DEL removes rules and proxy
    f.pods
        .del(del_event("a", "uid-a", "cid-a"))
        .await
        .expect("del");
    assert_eq!(f.rules.calls(), ["apply", "remove"]);
    assert!(stored(dir.path()).is_empty());
}

/// A table file with pods `uids`, all in the test's own netns.
fn write_table(dir: &Path, generation: u64, uids: &[&str]) {
    let own = Netns::open(OWN_NETNS).expect("own netns").id();
    let recs = uids
        .iter()
        .map(|uid| PodRecord {
            uid: (*uid).into(),
            info: WorkloadInfo {
                name: uid.to_string(),
                namespace: "default".into(),
                service_account: "sa".into(),
            },
            options: Default::default(),
            netns: OWN_NETNS.into(),
            container_id: format!("cid-{uid}"),
            ips: vec![],
            netns_id: Some(own.into()),
        })
        .collect();
    Store::new(dir).save(generation, recs).expect("write");
}

#[tokio::test]
async fn restore_follows_what_the_old_agent_wrote_meanwhile() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_table(dir.path(), 1, &["uid-a", "uid-b"]);
    let f = Fixture::new();
    // while the first pod is being restored, the old agent finishes an ADD of c and a DEL of b
    let path = dir.path().to_owned();
    *f.rules.on_apply.lock().expect("hook") =
        Some(Box::new(move || write_table(&path, 1, &["uid-a", "uid-c"])));
    let report = f.pods.restore(dir.path()).await.expect("restore");
    assert_eq!(report.restored, 3, "{report:?}");
    let uids: Vec<_> = f.pods.enrolled().into_iter().map(|p| p.uid).collect();
    assert_eq!(uids, ["uid-a", "uid-c"]);
    assert!(
        f.proxy().contains(&"add uid-c".to_owned()),
        "{:?}",
        f.proxy()
    );
    assert!(
        f.proxy().contains(&"del uid-b".to_owned()),
        "{:?}",
        f.proxy()
    );
    assert_eq!(f.proxy().last().map(String::as_str), Some("snapshot"));
    assert_eq!(
        stored(dir.path())
            .into_iter()
            .map(|r| r.uid)
            .collect::<Vec<_>>(),
        ["uid-a", "uid-c"]
    );
}

#[tokio::test]
async fn an_agent_whose_socket_was_taken_over_stops_writing_the_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("pluginevent.sock");
    let _old_listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
    let f = Fixture::new();
    f.pods.set_owner(SocketFile::claim(&sock));
    f.pods.restore(dir.path()).await.expect("attach");
    f.pods
        .add(add_event("a", "uid-a", "cid-a"))
        .await
        .expect("add a");
    assert_eq!(stored(dir.path()).len(), 1);
    // a newer agent binds the path; while it restores, this agent's changes still reach the file
    std::fs::remove_file(&sock).expect("unlink");
    let _new_listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind again");
    f.pods
        .add(add_event("b", "uid-b", "cid-b"))
        .await
        .expect("add b");
    assert_eq!(
        stored(dir.path())
            .into_iter()
            .map(|r| r.uid)
            .collect::<Vec<_>>(),
        ["uid-a", "uid-b"],
        "the new agent's second read sees b"
    );
    // then the new agent writes its own table
    write_table(dir.path(), 1, &["uid-new"]);
    f.pods
        .add(add_event("c", "uid-c", "cid-c"))
        .await
        .expect("add c still served");
    f.pods
        .del(del_event("a", "uid-a", "cid-a"))
        .await
        .expect("del a");
    assert_eq!(
        stored(dir.path())
            .into_iter()
            .map(|r| r.uid)
            .collect::<Vec<_>>(),
        ["uid-new"],
        "the old agent left the new agent's table alone"
    );
}

#[tokio::test]
async fn a_corrupt_table_is_kept_aside_and_replaced_by_an_empty_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join(STATE_FILE), b"{not json").expect("write");
    let f = Fixture::new();
    let report = f.pods.restore(dir.path()).await.expect("restore");
    assert_eq!(report, RestoreReport::default());
    assert_eq!(f.proxy(), ["snapshot"]);
    assert!(stored(dir.path()).is_empty(), "rewritten as an empty table");
    assert_eq!(
        std::fs::read(dir.path().join("pods.json.torn")).expect("kept aside"),
        b"{not json"
    );
}

#[tokio::test]
async fn a_torn_table_restores_every_complete_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_table(dir.path(), 1, &["uid-a", "uid-b", "uid-c"]);
    let path = dir.path().join(STATE_FILE);
    let whole = std::fs::read(&path).expect("read");
    // cut inside the third record (after its uid)
    let cut = whole
        .windows(b"uid-c".len())
        .position(|w| w == b"uid-c")
        .expect("third record")
        + 8;
    std::fs::write(&path, &whole[..cut]).expect("tear");
    let f = Fixture::new();
    let report = f.pods.restore(dir.path()).await.expect("restore");
    assert_eq!(report.restored, 2, "{report:?}");
    assert_eq!(f.proxy(), ["add uid-a", "add uid-b", "snapshot"]);
    let uids: Vec<String> = stored(dir.path()).into_iter().map(|r| r.uid).collect();
    assert_eq!(uids, ["uid-a", "uid-b"], "the table is whole again");
    assert_eq!(
        std::fs::read(dir.path().join("pods.json.torn")).expect("kept aside"),
        &whole[..cut]
    );
    // a cut before the list, or another version, salvages nothing
    for torn in [&whole[..10], &b"{\"version\": 2, \"pods\": ["[..]] {
        std::fs::write(&path, torn).expect("tear");
        let got = Store::new(dir.path()).recover().expect("recover");
        assert!(got.pods.is_empty() && got.damage.is_some(), "{got:?}");
    }
}

#[tokio::test]
async fn an_add_the_table_cannot_record_fails_and_keeps_the_rules_for_its_del() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = Fixture::new();
    f.pods.restore(dir.path()).await.expect("attach");
    // the temp file's path taken by a directory: every write fails, as on a full disk
    let tmp = dir.path().join("pods.json.tmp");
    std::fs::create_dir(&tmp).expect("block the temp file");
    let err = f
        .pods
        .add(add_event("a", "uid-a", "cid-a"))
        .await
        .expect_err("the ADD cannot be recorded");
    assert!(matches!(err, PodError::Persist { .. }), "{err}");
    assert!(err.to_string().contains("pod table"), "{err}");
    assert_eq!(f.rules.calls(), ["apply"], "rules stay: fail closed");
    assert!(
        f.proxy().iter().all(|r| r != "add uid-a"),
        "not handed to the proxy"
    );
    assert!(
        f.pods
            .enrolled()
            .iter()
            .any(|p| p.uid == "uid-a" && p.pending)
    );
    // the pending-pod retry does not serve it either while it cannot be recorded
    let retry = f.pods.retry_proxy("uid-a").await.expect_err("not recorded");
    assert!(matches!(retry, PodError::Persist { .. }), "{retry}");
    assert!(
        f.proxy().iter().all(|r| r != "add uid-a"),
        "not handed to the proxy"
    );
    // the runtime's DEL removes the rules; once the disk has room, the retried ADD is recorded
    f.pods
        .del(del_event("a", "uid-a", "cid-a"))
        .await
        .expect("del");
    assert_eq!(f.rules.calls(), ["apply", "remove"]);
    std::fs::remove_dir(&tmp).expect("unblock");
    f.pods
        .add(add_event("a", "uid-a", "cid-a"))
        .await
        .expect("add once the table can be written");
    assert_eq!(stored(dir.path()).len(), 1);
}

#[tokio::test]
async fn restore_twice_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = Fixture::new();
    f.pods.restore(dir.path()).await.expect("first");
    let err = f.pods.restore(dir.path()).await.expect_err("second");
    assert!(
        matches!(err, PodError::Store(StoreError::AlreadyAttached(_))),
        "{err}"
    );
}

#[test]
fn an_older_generation_does_not_overwrite_a_newer_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    let rec = |uid: &str| PodRecord {
        uid: uid.into(),
        info: WorkloadInfo {
            name: "n".into(),
            namespace: "default".into(),
            service_account: "sa".into(),
        },
        options: Default::default(),
        netns: OWN_NETNS.into(),
        container_id: "c".into(),
        ips: vec![],
        netns_id: None,
    };
    store.save(2, vec![rec("new")]).expect("save 2");
    store.save(1, vec![rec("old")]).expect("save 1");
    assert_eq!(store.load().expect("load"), [rec("new")]);
}

#[test]
fn pod_options_are_stored_and_older_records_read_without_them() {
    use crate::agent::enroll::{InterfaceName, PodOptions};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    let options = PodOptions {
        bypass_inbound_capture: true,
        dns_capture_override: Some(false),
        reroute_virtual_interfaces: vec![InterfaceName::new("tap0").expect("name")],
        ..Default::default()
    };
    let rec = PodRecord {
        uid: "u".into(),
        info: WorkloadInfo {
            name: "n".into(),
            namespace: "default".into(),
            service_account: "sa".into(),
        },
        options: options.clone(),
        netns: OWN_NETNS.into(),
        container_id: "c".into(),
        ips: vec![],
        netns_id: None,
    };
    store.save(1, vec![rec.clone()]).expect("save");
    assert_eq!(store.load().expect("load"), std::slice::from_ref(&rec));
    let mut old = serde_json::to_value(&rec).expect("json");
    old.as_object_mut().expect("object").remove("options");
    let back: PodRecord = serde_json::from_value(old).expect("older record");
    assert_eq!(back.options, PodOptions::default());
    let mut bad = serde_json::to_value(&rec).expect("json");
    bad["options"]["reroute_virtual_interfaces"] = serde_json::json!(["bad name"]);
    assert!(serde_json::from_value::<PodRecord>(bad).is_err());
}
