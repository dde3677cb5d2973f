//! The soak's changes to the node: the local config it rewrites (the workloads, an authorization
//! policy that changes with every push), pods added through the CNI chain and deleted again with a
//! connection to and from each while it exists, and the checks in `/config_dump` that the node
//! picked each change up.
//!
//! In standalone mode a pod is enrolled when the node's state lists a workload with its namespace
//! and name, so an added pod's workload goes into the config first, with the address host-local
//! will give it (the one after the last it handed out); the node shows it in `/config_dump` before
//! the pod's CNI ADD runs.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::load::{Tally, exchange};
use crate::lab::bench::measure::echo_server;
use crate::lab::{Lab, Pod, http, local_config};
use crate::mesh::ADMIN_PORT;
use crate::netns::Netns;

/// Namespace of the soak's workloads (the bench's).
pub(super) const NAMESPACE: &str = "bench";
/// Names the added pods cycle over (`c0` ...): more than live at once.
const SLOTS: u64 = 4;
/// Control cycles an added pod lives before it is deleted.
pub(super) const POD_CYCLES: u64 = 2;
/// Port of the one-shot echo server in an added pod.
const POD_ECHO_PORT: u16 = 7402;
/// How long the node may take to show a config change in `/config_dump` (it polls the file every
/// second).
const DUMP_TIMEOUT: Duration = Duration::from_secs(20);

/// The principal of the service account `sa` of the soak's namespace.
fn principal(sa: &str) -> String {
    format!("cluster.local/ns/{NAMESPACE}/sa/{sa}")
}

/// Service account of the added pod `name`.
fn churn_account(name: &str) -> String {
    format!("soak-{name}")
}

/// What `/config_dump` shows of push `n`: the principal of its harmless rule.
fn push_marker(n: u64) -> String {
    format!("cluster.local/ns/soak-push/sa/push-{n}")
}

/// The `policies:` of push `n`: an ALLOW for the soak's namespace that allows `clients` (so it never
/// denies the soak's traffic) and, as a second rule, [`push_marker`]`(n)` to port 9 (a principal
/// nothing has); even pushes add a DENY for another principal nothing has.
pub(super) fn policies(n: u64, clients: &[String]) -> String {
    let allowed: Vec<String> = clients.iter().map(|c| format!("{{Exact: {c}}}")).collect();
    let mut y = format!(
        "policies:\n- name: soak-allow\n  namespace: {NAMESPACE}\n  scope: Namespace\n  action: Allow\n  rules:\n  \
         - [[{{principals: [{}]}}]]\n  - [[{{principals: [{{Exact: {}}}]}}], [{{destinationPorts: [9]}}]]\n",
        allowed.join(", "),
        push_marker(n)
    );
    if n.is_multiple_of(2) {
        y.push_str(&format!(
            "- name: soak-deny-unused\n  namespace: {NAMESPACE}\n  scope: Namespace\n  action: Deny\n  \
             rules: [[[{{principals: [{{Exact: cluster.local/ns/nowhere/sa/nobody}}]}}]]]\n"
        ));
    }
    y
}

/// Whether the `/config_dump` document shows push `n`'s policy.
pub(super) fn dump_shows_push(dump: &Value, n: u64) -> bool {
    // the marker with its closing quote, so push 1 is not found in push 12
    dump.get("policies")
        .is_some_and(|p| p.to_string().contains(&format!("{}\"", push_marker(n))))
}

/// Whether the `/config_dump` document lists the workload `name` of the soak's namespace with `ip`.
pub(super) fn dump_shows_workload(dump: &Value, name: &str, ip: IpAddr) -> bool {
    let ip = ip.to_string();
    dump.get("workloads")
        .and_then(Value::as_array)
        .is_some_and(|ws| {
            ws.iter().any(|w| {
                w.get("name").and_then(Value::as_str) == Some(name)
                    && w.get("namespace").and_then(Value::as_str) == Some(NAMESPACE)
                    && w.get("workloadIps")
                        .and_then(Value::as_array)
                        .is_some_and(|ips| ips.iter().any(|i| i.as_str() == Some(&ip)))
            })
        })
}

/// The address host-local hands out after `last` (its `last_reserved_ip` file's content).
pub(super) fn next_ip(last: &str) -> Option<IpAddr> {
    let last: Ipv4Addr = last.trim().parse().ok()?;
    Some(IpAddr::V4(Ipv4Addr::from(u32::from(last).checked_add(1)?)))
}

/// An added pod: in the config from before its ADD (`pod` is `None` until the ADD returned).
struct Added {
    name: String,
    ip: IpAddr,
    cycle: u64,
    pod: Option<Pod>,
}

/// The soak's hand on the node's config and pods (used by the control loop alone).
pub(super) struct Control<'a> {
    lab: &'a Lab,
    tally: &'a Tally,
    node_ns: Netns,
    client_ns: Netns,
    /// The local config file the node watches.
    config: PathBuf,
    /// host-local's record of the address it handed out last.
    last_reserved: PathBuf,
    /// The node's name in the config.
    node_name: String,
    /// The fixed workloads `(name, service account, ip)`: the client and the server.
    base: Vec<(String, String, IpAddr)>,
    added: Vec<Added>,
    /// The server's one-shot echo server, which the added pods connect to.
    server_echo: SocketAddr,
    pushes: u64,
    adds: u64,
}

impl<'a> Control<'a> {
    /// The control of `lab` (named `prefix`, watching `config`), with `client` and `server` the
    /// fixed workloads; the added pods connect to `server_echo`.
    pub(super) fn new(
        lab: &'a Lab,
        tally: &'a Tally,
        prefix: &str,
        config: PathBuf,
        [client, server]: [&Pod; 2],
        server_echo: SocketAddr,
    ) -> anyhow::Result<Control<'a>> {
        Ok(Control {
            lab,
            tally,
            node_ns: lab.node().clone(),
            client_ns: Netns::open(&client.netns_path)?,
            config,
            last_reserved: lab
                .dir()
                .join("ipam")
                .join(format!("{prefix}-net"))
                .join("last_reserved_ip.0"),
            node_name: prefix.to_owned(),
            base: [client, server]
                .iter()
                .map(|p| (p.name.clone(), p.name.clone(), p.ip))
                .collect(),
            added: Vec::new(),
            server_echo,
            pushes: 0,
            adds: 0,
        })
    }

    /// The config: the fixed and the added workloads, and the policy of the last push.
    fn yaml(&self) -> String {
        let mut workloads: Vec<(String, String, IpAddr)> = self.base.clone();
        workloads.extend(
            self.added
                .iter()
                .map(|a| (a.name.clone(), churn_account(&a.name), a.ip)),
        );
        let refs: Vec<(&str, &str, &str, IpAddr)> = workloads
            .iter()
            .map(|(n, sa, ip)| (n.as_str(), NAMESPACE, sa.as_str(), *ip))
            .collect();
        let mut clients = vec![principal(&self.base[0].1)];
        clients.extend((0..SLOTS).map(|s| principal(&churn_account(&format!("c{s}")))));
        local_config(&self.node_name, &refs) + &policies(self.pushes, &clients)
    }

    /// Replaces the config file (written whole, then renamed: the node never reads half a file).
    fn write(&self) -> std::io::Result<()> {
        let tmp = self.config.with_extension("yaml.new");
        std::fs::write(&tmp, self.yaml())?;
        std::fs::rename(&tmp, &self.config)
    }

    /// Fetches `/config_dump` until `shows` holds, for up to [`DUMP_TIMEOUT`].
    fn wait_dump(&self, what: &str, shows: impl Fn(&Value) -> bool) -> Result<(), String> {
        let admin = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), ADMIN_PORT);
        let deadline = Instant::now() + DUMP_TIMEOUT;
        let mut last = String::new();
        while Instant::now() < deadline {
            match http::get_text(&self.node_ns, admin, "/config_dump") {
                Ok((200, text)) => match serde_json::from_str::<Value>(&text) {
                    Ok(dump) if shows(&dump) => return Ok(()),
                    Ok(_) => last = "not shown yet".into(),
                    Err(e) => last = format!("not JSON: {e}"),
                },
                Ok((code, _)) => last = format!("status {code}"),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "/config_dump did not show {what} within {DUMP_TIMEOUT:?} ({last})"
        ))
    }

    /// Writes the config with the next policy and waits until the node shows it.
    pub(super) fn push_policy(&mut self) {
        self.pushes += 1;
        let n = self.pushes;
        self.tally.pushes.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.write() {
            self.tally
                .error(format!("policy push {n}: write the config: {e}"));
            return;
        }
        match self.wait_dump(&format!("policy push {n}"), |d| dump_shows_push(d, n)) {
            Ok(()) => {
                self.tally.pushes_seen.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.tally.error(e),
        }
    }

    /// Adds the next pod of the cycle (its workload into the config first), then connects from it
    /// to the server and from the client to it. Failures go to the tally.
    pub(super) fn add_pod(&mut self, cycle: u64) {
        let name = format!("c{}", self.adds % SLOTS);
        self.adds += 1;
        if let Err(e) = self.try_add(&name, cycle) {
            self.tally.error(format!("add pod {name}: {e}"));
            // whatever of it exists goes again
            if let Some(i) = self.added.iter().position(|a| a.name == name) {
                let a = self.added.remove(i);
                if let Some(pod) = a.pod
                    && self.lab.del_pod(&pod).is_ok()
                {
                    self.tally.pods_removed.fetch_add(1, Ordering::Relaxed);
                }
                let _ = self.write();
            }
            return;
        }
        let Some(pod) = self
            .added
            .iter()
            .find(|a| a.name == name)
            .and_then(|a| a.pod.clone())
        else {
            return;
        };
        self.connect_pod(&pod);
    }

    fn try_add(&mut self, name: &str, cycle: u64) -> Result<(), String> {
        let last = std::fs::read_to_string(&self.last_reserved)
            .map_err(|e| format!("read {}: {e}", self.last_reserved.display()))?;
        let ip = next_ip(&last).ok_or_else(|| format!("no address follows {last:?}"))?;
        self.added.push(Added {
            name: name.to_owned(),
            ip,
            cycle,
            pod: None,
        });
        self.write().map_err(|e| format!("write the config: {e}"))?;
        self.wait_dump(&format!("workload {name} ({ip})"), |d| {
            dump_shows_workload(d, name, ip)
        })?;
        let pod = self
            .lab
            .add_pod(name, NAMESPACE)
            .map_err(|e| format!("CNI ADD: {e}"))?;
        let got = pod.ip;
        if let Some(a) = self.added.iter_mut().find(|a| a.name == name) {
            a.pod = Some(pod);
            a.ip = got;
        }
        self.tally.pods_added.fetch_add(1, Ordering::Relaxed);
        if got != ip {
            return Err(format!(
                "host-local gave {got}, not {ip} as the config said before the ADD"
            ));
        }
        Ok(())
    }

    /// A connection from `pod` to the server's echo and one from the client to an echo server in
    /// `pod`, both through the mesh.
    fn connect_pod(&self, pod: &Pod) {
        let seed = (1 << 40) | self.adds;
        let outbound = Netns::open(&pod.netns_path)
            .map_err(|e| e.to_string())
            .and_then(|ns| {
                ns.run(|| exchange(self.server_echo, seed))
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())
            });
        match outbound {
            Ok(()) => self.tally.ok(),
            Err(e) => self.tally.conn_failed(format!(
                "pod {} ({}) to {}: {e}",
                pod.name, pod.ip, self.server_echo
            )),
        }
        let to = SocketAddr::new(pod.ip, POD_ECHO_PORT);
        let inbound = echo_server(pod, POD_ECHO_PORT, true)
            .map_err(|e| format!("echo server: {e:#}"))
            .and_then(|echo| {
                let r = self
                    .client_ns
                    .run(|| exchange(to, seed + 1))
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string());
                drop(echo);
                r
            });
        match inbound {
            Ok(()) => self.tally.ok(),
            Err(e) => self
                .tally
                .conn_failed(format!("client to pod {} at {to}: {e}", pod.name)),
        }
    }

    /// Deletes the added pods that lived [`POD_CYCLES`] by `cycle` (all of them with `None`) and
    /// takes their workloads out of the config.
    pub(super) fn remove_expired(&mut self, cycle: Option<u64>) {
        let (gone, kept): (Vec<Added>, Vec<Added>) = std::mem::take(&mut self.added)
            .into_iter()
            .partition(|a| cycle.is_none_or(|c| a.cycle + POD_CYCLES <= c));
        self.added = kept;
        if gone.is_empty() {
            return;
        }
        for pod in gone.into_iter().filter_map(|a| a.pod) {
            match self.lab.del_pod(&pod) {
                Ok(()) => {
                    self.tally.pods_removed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => self.tally.error(format!("delete pod {}: {e}", pod.name)),
            }
        }
        if let Err(e) = self.write() {
            self.tally
                .error(format!("write the config after deleting pods: {e}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn policies_parse_allow_the_clients_and_change_with_every_push() {
        let clients = [principal("m-client"), principal("soak-c0")];
        for n in [1, 2] {
            let yaml = format!("workloads: []\n{}", policies(n, &clients));
            let cfg = crate::proxy::config::parse_local_config(&yaml).expect("parses");
            assert_eq!(cfg.policies.len(), if n == 2 { 2 } else { 1 }, "{yaml}");
            assert!(cfg.policies.iter().all(|p| p.invalid.is_none()), "{yaml}");
            let allow = &cfg.policies[0];
            assert_eq!(allow.rules.len(), 2);
            let dump = json!({ "policies": serde_json::to_value(&cfg.policies).expect("json") });
            assert!(dump_shows_push(&dump, n));
            assert!(!dump_shows_push(&dump, 3 - n));
            assert!(
                dump.to_string()
                    .contains("cluster.local/ns/bench/sa/m-client")
            );
        }
        let twelve =
            json!({"policies": [{"rules": [[[{"principals": [{"Exact": push_marker(12)}]}]]]}]});
        assert!(dump_shows_push(&twelve, 12));
        assert!(!dump_shows_push(&twelve, 1));
    }

    #[test]
    fn workloads_are_found_in_the_dump_by_name_and_address() {
        let ip: IpAddr = "10.250.0.7".parse().expect("ip");
        let dump = json!({"workloads": [
            {"name": "c1", "namespace": "bench", "workloadIps": ["10.250.0.7"]},
            {"name": "c2", "namespace": "other", "workloadIps": ["10.250.0.8"]},
        ]});
        assert!(dump_shows_workload(&dump, "c1", ip));
        assert!(!dump_shows_workload(
            &dump,
            "c1",
            "10.250.0.8".parse().expect("ip")
        ));
        assert!(!dump_shows_workload(
            &dump,
            "c2",
            "10.250.0.8".parse().expect("ip")
        ));
        assert!(!dump_shows_workload(&json!({}), "c1", ip));
    }

    #[test]
    fn the_next_address_follows_host_locals_last() {
        assert_eq!(next_ip("10.250.0.5\n"), "10.250.0.6".parse().ok());
        assert_eq!(next_ip("10.250.0.255"), "10.250.1.0".parse().ok());
        assert_eq!(next_ip("255.255.255.255"), None);
        assert_eq!(next_ip("junk"), None);
    }
}
