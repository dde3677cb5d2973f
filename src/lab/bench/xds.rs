//! The xDS figures (`--only xds`): a node that takes its workloads and policies from istiod's delta
//! xDS, holding a world of `--xds-workloads` workloads (HBONE, on other nodes, most behind one of a
//! few services) and `--xds-policies` authorization policies (namespace-scoped, ALLOW and DENY, with
//! principals and ports). Measured: the node's RSS with an empty world, holding that world (a
//! fresh node after its initial sync) and after each push series; the time from the node's start
//! to both types ACKed; and for `--xds-pushes` pushes (add a workload, change a policy, remove the
//! workload, in turn) the time from the control call to
//!
//! 1. the node's ACK of the response carrying the change, as the fake istiod logs it (the node
//!    publishes its new state before it ACKs): the primary figure, taken without any other load,
//!    with the node's share of it (response logged → ACK logged) and its CPU time per push;
//! 2. `/config_dump` on the admin port showing the change, in a second series of pushes, polled
//!    back to back (its resolution is one fetch of the whole dump, whose size and time are
//!    reported too).
//!
//! The log is read every 250 µs, which bounds the resolution of the ACK figures; push → ACK also
//! holds the fake istiod's own work (Python: the control call, the diff, the encoding).
//!
//! Its own lab (prefix `<lab prefix>-x`, no pods): the fake istiod (`../shared/tools/fake-istiod`, or
//! `ZTNODE_FAKE_ISTIOD`) on the node netns's loopback, and `ztnode node --no-install` there with
//! ztunnel's `XDS_ADDRESS`/`CA_ADDRESS` env.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use super::measure::{cpu_seconds, percentile, settle_rss};
use super::options::BenchOptions;
use super::report::{self, Figures};
use super::setup::RemoveOnDrop;
use crate::lab::istiod::{FAKE_ISTIOD_SCRIPT, FakeIstiod, FakeIstiodOptions};
use crate::lab::{Lab, LabOptions, ProcessGuard};

const ADDRESS: &str = "type.googleapis.com/istio.workload.Address";
const AUTHORIZATION: &str = "type.googleapis.com/istio.security.Authorization";
/// Namespaces the world's workloads and policies are spread over.
const NAMESPACES: usize = 20;
/// Services at most (a multiple of [`NAMESPACES`], so a workload's service is in its namespace).
const SERVICES: usize = 40;
/// Service accounts of the world's workloads.
const ACCOUNTS: usize = 50;
/// Other nodes the world's workloads run on (none on the bench's node: no certificates).
const NODES: usize = 10;
/// How long one sync, push or ACK may take before the bench gives up.
const TIMEOUT: Duration = Duration::from_secs(60);
/// How often the event log is read while waiting (it is a file the fake istiod appends to, a line
/// at a time): the resolution of the ACK figures.
const LOG_POLL: Duration = Duration::from_micros(250);
/// The node's admin endpoint, in its netns.
const ADMIN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 15000);
/// The bearer token the node presents (the fake istiod checks none here).
const TOKEN: &str = "ztnode-bench-token";

/// The fake istiod's script, when it is on this machine.
fn script() -> Option<PathBuf> {
    std::env::var_os("ZTNODE_FAKE_ISTIOD")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(FAKE_ISTIOD_SCRIPT)))
        .filter(|p| p.is_file())
}

fn namespace(i: usize) -> String {
    format!("ns{:02}", i % NAMESPACES)
}

/// The `s`-th service: `(resource name "ns/hostname", item)`.
fn service(s: usize) -> (String, Value) {
    let ns = namespace(s);
    let hostname = format!("svc-{s:02}.{ns}.svc.cluster.local");
    let item = json!({
        "name": format!("svc-{s:02}"),
        "namespace": ns,
        "hostname": hostname,
        "vips": [format!("/10.96.{}.{}", s / 250, s % 250 + 1)],
        "ports": {"80": 8080},
    });
    (format!("{ns}/{hostname}"), item)
}

/// A workload item: HBONE, on another node, behind `service` (its resource name) if any.
fn workload(name: &str, ns: &str, ip: Ipv4Addr, i: usize, service: Option<&str>) -> Value {
    let app = format!("app-{:02}", i % 100);
    let mut w = json!({
        "uid": format!("Kubernetes//v1/Pod/{ns}/{name}"),
        "name": name,
        "namespace": ns,
        "serviceAccount": format!("sa-{:02}", i % ACCOUNTS),
        "workloadIps": [ip.to_string()],
        "protocol": "HBONE",
        "node": format!("xb-node-{}", i % NODES),
        "canonicalName": app,
        "workloadName": app,
        "workloadType": "deployment",
    });
    if let Some(key) = service {
        w["services"] = json!({ key: {"80": 8080} });
    }
    w
}

/// The `k`-th policy; `marker` adds a principal (the change a push makes).
fn policy(k: usize, marker: Option<&str>) -> Value {
    let mut principals = vec![format!(
        "cluster.local/ns/{}/sa/sa-{:02}",
        namespace(k + 1),
        k % ACCOUNTS
    )];
    principals.extend(marker.map(str::to_owned));
    json!({
        "name": format!("pol-{k:03}"),
        "namespace": namespace(k),
        "scope": "Namespace",
        "action": if k.is_multiple_of(4) { "Deny" } else { "Allow" },
        "dryRun": false,
        "rules": [[
            [{"principals": principals}],
            [{"destinationPorts": [8080, 9000 + k % 50000]}],
        ]],
    })
}

/// The world of the section: `workloads` workloads (three in four behind a service), the services
/// they use, `policies` policies.
struct World {
    workloads: usize,
    policies: usize,
    services: usize,
}

impl World {
    fn new(opts: &BenchOptions) -> World {
        World {
            workloads: opts.xds_workloads,
            policies: opts.xds_policies,
            services: SERVICES.min(opts.xds_workloads),
        }
    }

    /// The whole world as a `PUT /world` body.
    fn document(&self) -> Value {
        let workloads: Vec<Value> = (0..self.workloads)
            .map(|i| {
                let ip = Ipv4Addr::new(10, 200, (i / 250) as u8, (i % 250 + 1) as u8);
                let svc = (i % 4 != 3).then(|| service(i % SERVICES).0);
                workload(&format!("w{i:04}"), &namespace(i), ip, i, svc.as_deref())
            })
            .collect();
        json!({
            "workloads": workloads,
            "services": (0..self.services).map(|s| service(s).1).collect::<Vec<_>>(),
            "policies": (0..self.policies).map(|k| policy(k, None)).collect::<Vec<_>>(),
        })
    }

    /// The `i`-th push of the run: adds workload `xb-add-<i>` (i ≡ 0 mod 3), changes a policy
    /// (i ≡ 1), removes the workload push `i - 2` added (i ≡ 2).
    fn push(&self, i: usize) -> Push {
        let added = |j: usize| {
            let s = j % self.services;
            let (key, _) = service(s);
            let name = format!("xb-add-{j:03}");
            let ns = namespace(s);
            let ip = Ipv4Addr::new(10, 201, (j / 250) as u8, (j % 250 + 1) as u8);
            let uid = format!("Kubernetes//v1/Pod/{ns}/{name}");
            (
                name,
                uid,
                workload(&format!("xb-add-{j:03}"), &ns, ip, j, Some(&key)),
            )
        };
        match i % 3 {
            0 => {
                let (name, uid, item) = added(i);
                Push {
                    path: "/apply",
                    body: json!({"workloads": [item]}),
                    type_url: ADDRESS,
                    resource: uid,
                    removed: false,
                    marker: name,
                    present: true,
                }
            }
            1 => {
                let k = (i / 3) % self.policies;
                let marker = format!("cluster.local/ns/xb/sa/push-{i:03}");
                Push {
                    path: "/apply",
                    body: json!({"policies": [policy(k, Some(&marker))]}),
                    type_url: AUTHORIZATION,
                    resource: format!("{}/pol-{k:03}", namespace(k)),
                    removed: false,
                    marker,
                    present: true,
                }
            }
            _ => {
                let (name, uid, _) = added(i - 2);
                Push {
                    path: "/delete",
                    body: json!({"workloads": [uid.clone()]}),
                    type_url: ADDRESS,
                    resource: uid,
                    removed: true,
                    marker: name,
                    present: false,
                }
            }
        }
    }
}

/// One control call and how its effect shows.
struct Push {
    /// `/apply` or `/delete`.
    path: &'static str,
    body: Value,
    /// The type of the response that carries it.
    type_url: &'static str,
    /// The resource name in that response (`resources`, or `removed_resources` when `removed`).
    resource: String,
    removed: bool,
    /// Text in `/config_dump` that is there after the push (`present`) or gone.
    marker: String,
    present: bool,
}

impl Push {
    /// Whether `e` is the `xds_response` carrying this push.
    fn is_response(&self, e: &Value) -> bool {
        e["event"] == "xds_response"
            && e["type_url"] == self.type_url
            && if self.removed {
                e["removed_resources"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|n| *n == *self.resource))
            } else {
                e["resources"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|n| n["name"] == *self.resource))
            }
    }

    /// Whether the dump `text` shows the push.
    fn shows_in(&self, text: &str) -> bool {
        text.contains(&self.marker) == self.present
    }
}

/// The fake istiod's event log, read as it grows; each event is stamped with when it was read.
struct Tail {
    file: std::fs::File,
    path: PathBuf,
    partial: Vec<u8>,
    queue: VecDeque<(Value, Instant)>,
}

impl Tail {
    fn open(path: &Path) -> anyhow::Result<Tail> {
        Ok(Tail {
            file: std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?,
            path: path.to_owned(),
            partial: Vec::new(),
            queue: VecDeque::new(),
        })
    }

    /// Reads what was appended since the last read into the queue.
    fn fill(&mut self) -> anyhow::Result<()> {
        let mut buf = Vec::new();
        self.file.read_to_end(&mut buf)?;
        let seen = Instant::now();
        self.partial.extend_from_slice(&buf);
        while let Some(pos) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=pos).collect();
            if let Ok(v) = serde_json::from_slice::<Value>(&line) {
                self.queue.push_back((v, seen));
            }
        }
        Ok(())
    }

    /// Consumes events up to the first that satisfies `pred`; returns it and when it was read.
    /// A NACK on the way is an error.
    fn wait(
        &mut self,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<(Value, Instant)> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            while let Some((e, seen)) = self.queue.pop_front() {
                anyhow::ensure!(
                    !(e["event"] == "xds_request" && e["kind"] == "nack"),
                    "the node NACKed: {e}"
                );
                if pred(&e) {
                    return Ok((e, seen));
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "no {what} within {TIMEOUT:?}; see {}",
                self.path.display()
            );
            std::thread::sleep(LOG_POLL);
            self.fill()?;
        }
    }

    /// Waits for an ACK of each type (a new stream's initial sync); returns when the last was read.
    fn wait_sync(&mut self) -> anyhow::Result<Instant> {
        let mut missing = vec![ADDRESS, AUTHORIZATION];
        let mut last = Instant::now();
        while !missing.is_empty() {
            let (e, seen) = self.wait("initial ACK", |e| {
                e["event"] == "xds_request"
                    && e["kind"] == "ack"
                    && missing.iter().any(|t| e["type_url"] == *t)
            })?;
            missing.retain(|t| e["type_url"] != *t);
            last = seen;
        }
        Ok(last)
    }

    /// Waits for the response carrying `push` and the node's ACK of it: when each was read. The
    /// fake istiod logs a response just before it sends it.
    fn wait_ack(&mut self, push: &Push) -> anyhow::Result<(Instant, Instant)> {
        let (resp, sent) = self.wait(&format!("response with {}", push.resource), |e| {
            push.is_response(e)
        })?;
        let nonce = resp["nonce"].clone();
        let (ack, acked) = self.wait(&format!("ACK of {nonce}"), |e| {
            e["event"] == "xds_request" && e["response_nonce"] == nonce
        })?;
        anyhow::ensure!(ack["kind"] == "ack", "not an ACK: {ack}");
        Ok((sent, acked))
    }
}

/// The node's `/config_dump` as text.
fn config_dump(lab: &Lab) -> anyhow::Result<String> {
    let (code, text) = crate::lab::http::get_text(lab.node(), ADMIN, "/config_dump")?;
    anyhow::ensure!(code == 200, "config_dump: {code} {text}");
    Ok(text)
}

/// Sends `push` to `istiod` on another thread while `wait` runs here; returns what `wait` returns
/// once both ended.
fn send_while<T>(
    istiod: &FakeIstiod,
    push: &Push,
    wait: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        let sender = s.spawn(|| istiod.ok("POST", push.path, Some(&push.body)));
        let res = wait();
        sender
            .join()
            .map_err(|_| anyhow::anyhow!("control call panicked"))??;
        res
    })
}

/// A [`FakeIstiod::start`] error with the end of the server's stderr (its dir goes away with the
/// section).
fn with_stderr(dir: &Path, e: crate::lab::LabError) -> anyhow::Error {
    let stderr = std::fs::read_to_string(dir.join("istiod.stderr")).unwrap_or_default();
    let lines: Vec<&str> = stderr.lines().collect();
    let tail = &lines[lines.len().saturating_sub(10)..];
    anyhow::anyhow!("{e}\n{}", tail.join("\n"))
}

/// The section's lab: the node netns with the fake istiod on its loopback, its event log, and the
/// node fed by it. Field order = drop order: the node first, the lab last.
struct Rig {
    node: Option<ProcessGuard>,
    istiod: FakeIstiod,
    lab: Lab,
    tail: Tail,
    exe: PathBuf,
    run_dir: PathBuf,
    env: Vec<(String, String)>,
    level: String,
}

impl Rig {
    /// Builds the lab (prefix `<lab prefix>-x`) in `dir` and starts the fake istiod, world empty.
    fn new(opts: &BenchOptions, script: &Path, dir: &Path) -> anyhow::Result<Rig> {
        let exe = std::env::current_exe()?;
        let run_dir = dir.join("run");
        let lab = Lab::new(LabOptions {
            prefix: format!("{}-x", opts.lab_prefix),
            ztnode_binary: Some(exe.clone()),
            run_dir: run_dir.clone(),
            subnet: "10.253.0.0/16".into(),
            cni_version: "1.0.0".into(),
        })?;
        let istiod_dir = dir.join("istiod");
        let istiod = FakeIstiod::start(
            lab.node_name(),
            script,
            &istiod_dir,
            FakeIstiodOptions::default(),
        )
        .map_err(|e| with_stderr(&istiod_dir, e))?;
        let tail = Tail::open(&istiod.log)?;
        let token = dir.join("istio-token");
        std::fs::write(&token, TOKEN)?;
        let root = istiod.root_cert.display().to_string();
        let node = lab.node_name();
        let env = [
            ("XDS_ADDRESS", istiod.address()),
            ("CA_ADDRESS", istiod.address()),
            ("XDS_ROOT_CA", root.clone()),
            ("CA_ROOT_CA", root),
            ("AUTH_TOKEN", token.display().to_string()),
            ("CLUSTER_ID", "Kubernetes".into()),
            ("NODE_NAME", node.into()),
            ("POD_NAME", format!("ztnode-{node}")),
            ("POD_NAMESPACE", "istio-system".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Ok(Rig {
            node: None,
            istiod,
            lab,
            tail,
            exe,
            run_dir,
            env,
            level: std::env::var("ZTNODE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        })
    }

    /// (Re)starts `ztnode node --no-install` and waits for its initial sync; returns the time
    /// from the start to the second type ACKed, and the node's log.
    fn start_node(&mut self) -> anyhow::Result<(Duration, PathBuf)> {
        self.node = None;
        let started = Instant::now();
        let (node, log) = self.lab.start_node_with(
            &self.exe,
            &self.run_dir,
            &[OsString::from("--no-install")],
            &self.env,
            &self.level,
        )?;
        self.node = Some(node);
        let synced = self.tail.wait_sync()?;
        Ok((synced - started, log))
    }

    /// Process id of the node.
    fn pid(&self) -> anyhow::Result<u32> {
        Ok(self.node.as_ref().context("no node")?.0.id())
    }

    /// Pushes `push` and waits for its ACK: the time from the control call to the ACK read from
    /// the log, and from the response read to the ACK read.
    fn push_until_ack(&mut self, push: &Push) -> anyhow::Result<(f64, f64)> {
        let sent = Instant::now();
        let tail = &mut self.tail;
        let (responded, acked) = send_while(&self.istiod, push, || tail.wait_ack(push))?;
        Ok((ms(acked - sent), ms(acked - responded)))
    }

    /// Pushes `push`, fetching `/config_dump` back to back until it shows the change; returns
    /// the time from the control call to the end of that fetch, once the ACK is in too.
    fn push_until_dump(&mut self, push: &Push) -> anyhow::Result<f64> {
        let sent = Instant::now();
        let lab = &self.lab;
        let shown = send_while(&self.istiod, push, || -> anyhow::Result<Instant> {
            loop {
                if push.shows_in(&config_dump(lab)?) {
                    return Ok(Instant::now());
                }
                anyhow::ensure!(
                    sent.elapsed() < TIMEOUT,
                    "config_dump does not show {} after {TIMEOUT:?}",
                    push.resource
                );
            }
        })?;
        self.tail.wait_ack(push)?;
        Ok(ms(shown - sent))
    }
}

/// What the section measured.
struct Measured {
    sync: Duration,
    /// RSS (KiB): empty world, holding the world, after the ACK series, after the dump series.
    rss: [u64; 4],
    /// Push → ACK (sorted, ms).
    acked: Vec<f64>,
    /// Response → ACK: the node's share (sorted, ms).
    client: Vec<f64>,
    /// Push → `/config_dump` (sorted, ms).
    dumped: Vec<f64>,
    cpu_ms_per_push: f64,
    dump: Dump,
}

/// Measures the section into `figures`; without the fake istiod it says so and adds nothing.
pub(super) fn measure(opts: &BenchOptions, figures: &mut Figures) -> anyhow::Result<()> {
    let Some(script) = script() else {
        eprintln!(
            "bench: xds skipped: no fake istiod at {FAKE_ISTIOD_SCRIPT} (set ZTNODE_FAKE_ISTIOD)"
        );
        return Ok(());
    };
    anyhow::ensure!(
        opts.xds_workloads >= 1 && opts.xds_policies >= 1 && opts.xds_pushes >= 1,
        "--xds-workloads, --xds-policies and --xds-pushes must be at least 1"
    );
    anyhow::ensure!(
        opts.xds_workloads <= 60_000 && opts.xds_pushes <= 30_000,
        "at most 60000 workloads and 30000 pushes (their addresses are in two /16s)"
    );
    let world = World::new(opts);
    let dir = std::env::temp_dir().join(format!("ztnode-bench-{}-x", opts.lab_prefix));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // Declared first, so dropped last: after the node, the fake istiod and the lab.
    let _dir = RemoveOnDrop(dir.clone());
    let mut rig = Rig::new(opts, &script, &dir)?;
    let m = run_series(&mut rig, &world, opts)?;
    add_figures(&world, opts.xds_pushes, &m, figures);
    Ok(())
}

/// The section's steps on `rig`: the empty world's RSS, the world served and a fresh node's sync
/// and RSS, the ACK series, the dump check, the dump series.
fn run_series(rig: &mut Rig, world: &World, opts: &BenchOptions) -> anyhow::Result<Measured> {
    rig.start_node()?;
    let rss_empty = settle_rss(rig.pid()?)?;
    rig.node = None;
    rig.istiod.ok("PUT", "/world", Some(&world.document()))?;
    eprintln!(
        "bench: xds world of {} workloads and {} policies served; starting the node",
        world.workloads, world.policies
    );
    let (sync, log) = rig.start_node()?;
    let pid = rig.pid()?;
    let rss_world = settle_rss(pid)?;

    // Series 1: push → ACK, nothing else running.
    let pushes = opts.xds_pushes;
    let (mut acked, mut client) = (Vec::new(), Vec::new());
    let cpu_before = cpu_seconds(pid)?;
    for i in 0..pushes {
        let (total, share) = rig.push_until_ack(&world.push(i))?;
        acked.push(total);
        client.push(share);
    }
    let cpu_ms_per_push = (cpu_seconds(pid)? - cpu_before) * 1e3 / pushes as f64;
    let rss_acked = settle_rss(pid)?;

    // The dump holds the world and the workload series 1 left added, if any; its cost.
    let adds = (0..pushes).filter(|i| i.is_multiple_of(3)).count();
    let removes = (0..pushes).filter(|i| i % 3 == 2).count();
    let dump = check_dump(&rig.lab, world, adds - removes)?;

    // Series 2: push → /config_dump shows it.
    let mut dumped = (pushes..2 * pushes)
        .map(|i| rig.push_until_dump(&world.push(i)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let rss_after = settle_rss(pid)?;
    report::keep_log(&opts.json.with_extension("xds.json"), &log);
    for v in [&mut acked, &mut client, &mut dumped] {
        v.sort_by(f64::total_cmp);
    }
    Ok(Measured {
        sync,
        rss: [rss_empty, rss_world, rss_acked, rss_after],
        acked,
        client,
        dumped,
        cpu_ms_per_push,
        dump,
    })
}

/// Adds the section's figures.
fn add_figures(world: &World, pushes: usize, m: &Measured, figures: &mut Figures) {
    let (nw, np) = (world.workloads, world.policies);
    let mut add = |label: String, key: &str, value: f64, precision: usize| {
        figures
            .values
            .push(report::Value::new(&label, key, value, precision));
    };
    add(
        format!("xds: node start → synced, {nw} workloads + {np} policies (ms)"),
        "xds_initial_sync_ms",
        ms(m.sync),
        0,
    );
    let rss = [
        ("RSS, empty world".to_owned(), "xds_rss_empty_mib"),
        (
            format!("RSS, {nw} workloads + {np} policies"),
            "xds_rss_world_mib",
        ),
        (
            format!("RSS after {pushes} pushes"),
            "xds_rss_after_pushes_mib",
        ),
        (
            format!("RSS after {pushes} more, config_dump polled"),
            "xds_rss_after_config_dump_mib",
        ),
    ];
    for ((what, key), kib) in rss.into_iter().zip(m.rss) {
        add(format!("xds: {what} (MiB)"), key, kib as f64 / 1024.0, 1);
    }
    for (what, key, sorted) in [
        ("push → ACK", "xds_push_ack", &m.acked),
        ("response → ACK", "xds_response_ack", &m.client),
        ("push → config_dump", "xds_push_config_dump", &m.dumped),
    ] {
        for (q, p) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
            add(
                format!("xds: {what} {q} (ms)"),
                &format!("{key}_{q}_ms"),
                percentile(sorted, p),
                2,
            );
        }
    }
    add(
        "xds: node CPU per push (ms)".into(),
        "xds_cpu_ms_per_push",
        m.cpu_ms_per_push,
        2,
    );
    add(
        "xds: config_dump size (KiB)".into(),
        "xds_config_dump_kib",
        m.dump.kib,
        0,
    );
    add(
        "xds: config_dump fetch (ms)".into(),
        "xds_config_dump_fetch_ms",
        m.dump.fetch_ms,
        2,
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The size of the node's `/config_dump` and the median time of three fetches.
struct Dump {
    kib: f64,
    fetch_ms: f64,
}

/// Checks that the node's `/config_dump` holds the whole world and `added` more workloads, and
/// times fetching it.
fn check_dump(lab: &Lab, world: &World, added: usize) -> anyhow::Result<Dump> {
    let mut times = Vec::new();
    let mut text = String::new();
    for _ in 0..3 {
        let t = Instant::now();
        text = config_dump(lab)?;
        times.push(ms(t.elapsed()));
    }
    times.sort_by(f64::total_cmp);
    let v: Value = serde_json::from_str(&text).context("config_dump is not JSON")?;
    let len = |k: &str| v[k].as_array().map_or(0, Vec::len);
    let held = (len("workloads"), len("services"), len("policies"));
    let want = (world.workloads + added, world.services, world.policies);
    anyhow::ensure!(
        held == want,
        "config_dump holds (workloads, services, policies) {held:?}, the world {want:?}"
    );
    Ok(Dump {
        kib: text.len() as f64 / 1024.0,
        fetch_ms: times[1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(workloads: usize, policies: usize) -> World {
        World {
            workloads,
            policies,
            services: SERVICES.min(workloads),
        }
    }

    #[test]
    fn the_world_has_distinct_addresses_and_services_in_their_workloads_namespace() {
        let doc = world(1000, 100).document();
        let ws = doc["workloads"].as_array().expect("workloads");
        assert_eq!(ws.len(), 1000);
        let ips: std::collections::HashSet<_> =
            ws.iter().map(|w| w["workloadIps"][0].clone()).collect();
        assert_eq!(ips.len(), 1000);
        for w in ws {
            if let Some(svcs) = w["services"].as_object() {
                let key = svcs.keys().next().expect("a service");
                assert!(
                    key.starts_with(&format!("{}/", w["namespace"].as_str().expect("namespace")))
                );
            }
        }
        assert_eq!(doc["services"].as_array().map(Vec::len), Some(SERVICES));
        let pols = doc["policies"].as_array().expect("policies");
        assert_eq!(pols.len(), 100);
        assert!(pols.iter().any(|p| p["action"] == "Deny"));
        assert!(pols.iter().any(|p| p["action"] == "Allow"));
    }

    #[test]
    fn pushes_add_change_and_remove_in_turn() {
        let w = world(5, 2);
        let (add, change, remove) = (w.push(0), w.push(1), w.push(2));
        assert_eq!(
            (add.path, add.type_url, add.present),
            ("/apply", ADDRESS, true)
        );
        assert_eq!(add.resource, remove.resource);
        assert_eq!((remove.path, remove.removed), ("/delete", true));
        assert_eq!(change.type_url, AUTHORIZATION);
        assert_eq!(change.resource, "ns00/pol-000");
        assert!(change.shows_in("\"cluster.local/ns/xb/sa/push-001\""));
        assert!(!remove.shows_in("xb-add-000"));
        let resp = json!({"event": "xds_response", "type_url": ADDRESS,
            "resources": [], "removed_resources": [remove.resource.clone()]});
        assert!(remove.is_response(&resp) && !add.is_response(&resp));
    }
}
