//! Two lab nodes joined by a link, one `ztnode node` on each, both fed by one fake istiod (delta
//! xDS + CA) that runs in node A's namespace on the link address; no CA dir is shared.
#![allow(dead_code)]

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use ztnode::lab::istiod::{FAKE_ISTIOD_SCRIPT, FakeIstiod, FakeIstiodOptions};
use ztnode::lab::{LINK_ADDRS, Lab, LabOptions, Pod, ProcessGuard};

use super::node::MeshNode;

/// Pod subnets of node A and node B.
pub const SUBNETS: [&str; 2] = ["10.61.1.0/24", "10.61.2.0/24"];
/// The token both nodes present; the fake istiod lets it impersonate namespace `default` only.
pub const TOKEN: &str = "ztnode-node-token";

/// One node of [`TwoNodes`]. Field order = drop order: process first, then the lab.
pub struct IstiodNode {
    pub process: Option<ProcessGuard>,
    pub lab: Lab,
    pub log: PathBuf,
    pub run_dir: PathBuf,
    pub env: Vec<(String, String)>,
}

/// Server pod `server` (sa bob) on node A, client pod `client` (sa alice) on node B.
pub struct TwoNodes {
    pub a: IstiodNode,
    pub b: IstiodNode,
    pub server: Pod,
    pub client: Pod,
    pub istiod: FakeIstiod,
    pub dir: PathBuf,
}

/// The fake istiod's world for the pods (node names = lab node names = prefixes).
pub fn world(a: &str, b: &str, extra: &str) -> String {
    format!(
        "workloads:
- name: server
  namespace: default
  serviceAccount: bob
  workloadIps: [10.61.1.2]
  protocol: HBONE
  node: {a}
- name: client
  namespace: default
  serviceAccount: alice
  workloadIps: [10.61.2.2]
  protocol: HBONE
  node: {b}
{extra}"
    )
}

fn lab(prefix: &str, subnet: &str, run_dir: &std::path::Path) -> Lab {
    Lab::new(LabOptions {
        prefix: prefix.into(),
        ztnode_binary: Some(env!("CARGO_BIN_EXE_ztnode").into()),
        run_dir: run_dir.to_owned(),
        subnet: subnet.into(),
        cni_version: "1.0.0".into(),
    })
    .expect("lab")
}

impl IstiodNode {
    /// (Re)starts `ztnode node` on this lab with the env.
    pub fn start(&mut self) {
        self.process = None;
        let (process, log) = self
            .lab
            .start_node_with(
                env!("CARGO_BIN_EXE_ztnode").as_ref(),
                &self.run_dir,
                &[OsString::from("--no-install")],
                &self.env,
                "info",
            )
            .expect("start ztnode node");
        self.process = Some(process);
        self.log = log;
    }

    /// Waits for a log line with all `needles`.
    pub fn wait_log(&self, needles: &[&str], timeout: Duration) -> String {
        MeshNode::wait_log_in(&self.log, needles, timeout)
    }
}

impl TwoNodes {
    /// Builds both nodes; `tag` must be unique per test (≤ 4 chars). `extra_world` is appended
    /// to the world (e.g. `services:` or `policies:`); `istiod_args` go to the fake istiod.
    pub fn start(tag: &str, extra_world: &str, istiod_args: &[&str]) -> TwoNodes {
        TwoNodes::start_with_world(tag, |_, _| extra_world.to_owned(), istiod_args)
    }

    /// [`TwoNodes::start`] with the extra world made from the two node names (A, B).
    pub fn start_with_world(
        tag: &str,
        extra_world: impl Fn(&str, &str) -> String,
        istiod_args: &[&str],
    ) -> TwoNodes {
        TwoNodes::start_with_env(tag, extra_world, istiod_args, &[])
    }

    /// [`TwoNodes::start_with_world`] with `extra_env` added to both nodes' env.
    pub fn start_with_env(
        tag: &str,
        extra_world: impl Fn(&str, &str) -> String,
        istiod_args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> TwoNodes {
        let (pa, pb) = (
            super::prefix(&format!("{tag}a")),
            super::prefix(&format!("{tag}b")),
        );
        let extra_world = extra_world(&pa, &pb);
        let dir = std::env::temp_dir().join(format!("ztnode-e2e-istiod-{pa}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let (run_a, run_b) = (dir.join("run-a"), dir.join("run-b"));
        let lab_a = lab(&pa, SUBNETS[0], &run_a);
        let lab_b = lab(&pb, SUBNETS[1], &run_b);
        lab_a.link(&lab_b).expect("link the nodes");
        let mut args: Vec<String> = vec![
            "--san".into(),
            LINK_ADDRS.0.to_string(),
            "--token".into(),
            format!("{TOKEN}=spiffe://cluster.local/ns/default/*"),
        ];
        args.extend(istiod_args.iter().map(|a| (*a).to_owned()));
        let istiod = FakeIstiod::start(
            lab_a.node_name(),
            FAKE_ISTIOD_SCRIPT.as_ref(),
            &dir.join("istiod"),
            FakeIstiodOptions {
                world: Some(world(&pa, &pb, &extra_world)),
                host: IpAddr::V4(LINK_ADDRS.0),
                port: 0,
                args,
            },
        )
        .expect("fake istiod");
        let token = dir.join("istio-token");
        std::fs::write(&token, TOKEN).expect("token");
        let env = |node: &str| -> Vec<(String, String)> {
            let root = istiod.root_cert.display().to_string();
            [
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
            .chain(
                extra_env
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
            )
            .collect()
        };
        let mut a = IstiodNode {
            process: None,
            lab: lab_a,
            log: PathBuf::new(),
            run_dir: run_a,
            env: env(&pa),
        };
        let mut b = IstiodNode {
            process: None,
            lab: lab_b,
            log: PathBuf::new(),
            run_dir: run_b,
            env: env(&pb),
        };
        a.start();
        b.start();
        let server = a.lab.add_pod("server", "default").expect("server pod");
        let client = b.lab.add_pod("client", "default").expect("client pod");
        assert_eq!(
            (
                server.ip.to_string().as_str(),
                client.ip.to_string().as_str()
            ),
            ("10.61.1.2", "10.61.2.2"),
            "host-local allocation order"
        );
        TwoNodes {
            a,
            b,
            server,
            client,
            istiod,
            dir,
        }
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        self.a.process = None;
        self.b.process = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
