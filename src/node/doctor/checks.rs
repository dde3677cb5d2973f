//! The checks of `ztnode doctor` (see [`super`]); each returns its findings and never panics on
//! what it reads (a missing file, a node that does not answer, an unreadable process).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::{DoctorOptions, Finding, Status};
use crate::agent::install::{ISTIO_CNI_TYPE, PLUGIN_TYPE, inspect_conf_dir};
use crate::agent::pods::{PodRecord, Store};
use crate::agent::redirect::{self, RedirectPlan};
use crate::netns::Netns;
use crate::nft::Table;

/// How long a connection to the node or istiod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The UID Istio reserves for its proxies; application processes must not run as it.
pub const PROXY_UID: u32 = 1337;

/// The CNI config: a valid primary, ztnode's entry in it once and last, no `istio-cni` in the
/// chain, no ztnode entry in other files.
pub fn cni_config(dir: &Path) -> Vec<Finding> {
    const C: &str = "cni";
    let report = match inspect_conf_dir(dir) {
        Ok(r) => r,
        Err(e) => {
            return vec![Finding::with(
                C,
                Status::Fail,
                format!("cannot read {}: {e}", dir.display()),
                "pass the host CNI config dir with --cni-conf-dir (the DaemonSet mounts it)",
            )];
        }
    };
    let Some(primary) = &report.primary else {
        return vec![Finding::with(
            C,
            Status::Fail,
            format!("no valid CNI config in {}", dir.display()),
            "install the node's primary CNI (its config comes first by name); ztnode chains after it",
        )];
    };
    let mut out = Vec::new();
    for bad in &report.invalid {
        out.push(Finding::with(
            C,
            Status::Warn,
            format!("{bad} does not parse or is not a CNI config the runtime accepts"),
            "fix or remove it; the runtime skips it",
        ));
    }
    let chain = report.chain.join(" → ");
    match report.ours() {
        0 => out.push(Finding::with(
            C,
            Status::Fail,
            format!("{primary} ({chain}) has no {PLUGIN_TYPE} entry: new pods are not captured"),
            "restart the ztnode node agent (it installs the entry at start and repairs it) or run `ztnode install`",
        )),
        1 if report.ours_last() => out.push(Finding::ok(
            C,
            format!("{PLUGIN_TYPE} is chained once and last in {primary} ({chain})"),
        )),
        1 => out.push(Finding::with(
            C,
            Status::Fail,
            format!("{PLUGIN_TYPE} is not the last plugin in {primary} ({chain})"),
            "restart the ztnode node agent, which moves its entry to the end",
        )),
        n => out.push(Finding::with(
            C,
            Status::Fail,
            format!("{PLUGIN_TYPE} is chained {n} times in {primary} ({chain})"),
            "restart the ztnode node agent, which keeps exactly one entry",
        )),
    }
    if report.chain.iter().any(|t| t == ISTIO_CNI_TYPE) {
        out.push(Finding::with(
            C,
            Status::Fail,
            format!("{primary} chains Istio's istio-cni too: two plugins redirect the same pods"),
            "remove Istio's istio-cni DaemonSet (ztnode replaces it) and its entry",
        ));
    }
    for stray in &report.stray {
        out.push(Finding::with(
            C,
            Status::Warn,
            format!("{stray} holds a {PLUGIN_TYPE} entry but is not the primary config"),
            "remove the entry from it (restarting the agent does so)",
        ));
    }
    out
}

/// Kernel features the node needs: nf_tables, network namespaces, `SO_MARK`, `IP_TRANSPARENT`
/// and, with IPv6 redirection, IPv6.
pub fn kernel(plan: &RedirectPlan) -> Vec<Finding> {
    const C: &str = "kernel";
    let mut out = Vec::new();
    match crate::nft::table_exists(&Table::inet(redirect::NAT_TABLE)) {
        Ok(_) => out.push(Finding::ok(C, "nf_tables answers")),
        Err(e) => out.push(Finding::with(
            C,
            Status::Fail,
            format!("nf_tables does not answer: {e}"),
            "load the nf_tables module (modprobe nf_tables) and run with CAP_NET_ADMIN",
        )),
    }
    match Netns::open("/proc/self/ns/net").and_then(|n| n.run(|| ())) {
        Ok(()) => out.push(Finding::ok(C, "network namespaces can be entered")),
        Err(e) => out.push(Finding::with(
            C,
            Status::Fail,
            format!("cannot enter a network namespace: {e}"),
            "run with CAP_SYS_ADMIN (the DaemonSet adds it) on a kernel with CONFIG_NET_NS",
        )),
    }
    let v4 = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None);
    match v4
        .as_ref()
        .map_err(|e| e.to_string())
        .and_then(|s| s.set_mark(plan.proxy_mark.get()).map_err(|e| e.to_string()))
    {
        Ok(()) => out.push(Finding::ok(C, "SO_MARK can be set")),
        Err(e) => out.push(Finding::with(
            C,
            Status::Fail,
            format!("SO_MARK cannot be set: {e}"),
            "run with CAP_NET_ADMIN (the DaemonSet adds it)",
        )),
    }
    match v4
        .as_ref()
        .map(|s| nix::sys::socket::setsockopt(s, nix::sys::socket::sockopt::IpTransparent, &true))
    {
        Ok(Ok(())) => out.push(Finding::ok(C, "IP_TRANSPARENT can be set")),
        Ok(Err(e)) => out.push(Finding::with(
            C,
            Status::Fail,
            format!("IP_TRANSPARENT cannot be set: {e}"),
            "run with CAP_NET_ADMIN and CAP_NET_RAW (the DaemonSet adds them)",
        )),
        Err(e) => out.push(Finding::with(
            C,
            Status::Fail,
            format!("no IPv4 TCP socket: {e}"),
            "check the node's network stack",
        )),
    }
    let v6 = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None).is_ok()
        && std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6")
            .map(|v| v.trim() != "1")
            .unwrap_or(false);
    match (v6, plan.ipv6) {
        (true, _) => out.push(Finding::ok(C, "IPv6 is available")),
        (false, true) => out.push(Finding::with(
            C,
            Status::Fail,
            "IPv6 is not available but IPv6 redirection is on",
            "enable IPv6 on the node or turn off --ipv6 (AMBIENT_IPV6)",
        )),
        (false, false) => out.push(Finding::skip(
            C,
            "IPv6 is not available (not needed: IPv6 redirection is off)",
        )),
    }
    out
}

/// The enrolled pods of `<run_dir>/pods.json`; a finding when the file cannot be read.
fn enrolled(run_dir: &Path, check: &'static str) -> Result<Vec<PodRecord>, Finding> {
    let store = Store::new(run_dir);
    if !store.path().exists() {
        return Ok(Vec::new());
    }
    store.load().map_err(|e| {
        Finding::with(
            check,
            Status::Fail,
            format!("cannot read {}: {e}", store.path().display()),
            "pass the agent's run dir with --run-dir",
        )
    })
}

/// Every enrolled pod's in-pod tables and rules against the agent's plan for it.
pub fn pod_rules(run_dir: &Path, plan: &RedirectPlan) -> Vec<Finding> {
    const C: &str = "pod-rules";
    let pods = match enrolled(run_dir, C) {
        Ok(p) => p,
        Err(f) => return vec![f],
    };
    if pods.is_empty() {
        return vec![Finding::skip(
            C,
            format!("no enrolled pods in {}", run_dir.display()),
        )];
    }
    pods.iter()
        .map(|p| {
            let name = format!("{}/{}", p.info.namespace, p.info.name);
            let result = Netns::open(&p.netns)
                .map_err(|e| e.to_string())
                .and_then(|ns| {
                    redirect::matches_plan(&ns, &plan.for_pod(&p.options))
                        .map_err(|e| e.to_string())
                });
            match result {
                Ok(true) => Finding::ok(C, format!("{name}: rules as planned")),
                Ok(false) => Finding::with(
                    C,
                    Status::Fail,
                    format!(
                        "{name}: its istio-ambient-* tables differ from the plan (missing, flushed or edited): its traffic may bypass the mesh"
                    ),
                    "restart the ztnode node agent (it re-applies every pod's rules at start) or recreate the pod",
                ),
                Err(e) => Finding::with(
                    C,
                    Status::Fail,
                    format!("{name}: cannot check its netns {}: {e}", p.netns),
                    "the sandbox may be gone; the agent drops it on the runtime's DEL",
                ),
            }
        })
        .collect()
}

/// `GET path` on `addr` over HTTP/1.0; the status code and body.
fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other("not an HTTP answer"))?;
    Ok((code, body.to_owned()))
}

/// The node's readiness and what is pending.
pub fn readiness(addr: SocketAddr) -> Finding {
    const C: &str = "readiness";
    match http_get(addr, "/healthz/ready") {
        Ok((200, _)) => Finding::ok(C, format!("ready ({addr})")),
        Ok((code, body)) => Finding::with(
            C,
            Status::Fail,
            format!("not ready ({code}): {}", body.trim()),
            "wait for the pending tasks; if one stays, the node log names why",
        ),
        Err(e) => Finding::with(
            C,
            Status::Fail,
            format!("no answer from {addr}: {e}"),
            "is `ztnode node` running? pass its address with --readiness-addr",
        ),
    }
}

/// The node's `/config_dump`, or why there is none.
pub fn fetch_config_dump(addr: SocketAddr) -> Result<Value, String> {
    match http_get(addr, "/config_dump") {
        Ok((200, body)) => serde_json::from_str(&body).map_err(|e| format!("not JSON: {e}")),
        Ok((code, body)) => Err(format!("{code}: {}", body.trim())),
        Err(e) => Err(e.to_string()),
    }
}

/// The admin's view: enrolled pods whose proxy has not started, certificates not available.
pub fn admin(dump: &Result<Value, String>, addr: SocketAddr) -> Vec<Finding> {
    const C: &str = "admin";
    let dump = match dump {
        Ok(d) => d,
        Err(e) => {
            return vec![Finding::with(
                C,
                Status::Fail,
                format!("no /config_dump from {addr}: {e}"),
                "is `ztnode node` running? pass its admin address with --admin-addr",
            )];
        }
    };
    let mut out = Vec::new();
    let pending: Vec<String> = dump["enrolledPods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["pending"] == true)
        .map(|p| {
            format!(
                "{}/{}",
                p["namespace"].as_str().unwrap_or("?"),
                p["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    if pending.is_empty() {
        let n = dump["workloadState"].as_object().map_or(0, |m| m.len());
        out.push(Finding::ok(C, format!("{n} pod proxies running")));
    } else {
        out.push(Finding::with(
            C,
            Status::Fail,
            format!("rules in place but no proxy yet (traffic held, fail closed): {}", pending.join(", ")),
            "the node log says why the proxy did not start (a refused token, a workload istiod does not list yet); it retries every 2 s",
        ));
    }
    let unavailable: Vec<String> = dump["certificates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["state"] != "Available")
        .map(|c| {
            format!(
                "{} ({})",
                c["identity"].as_str().unwrap_or("?"),
                c["state"].as_str().unwrap_or("?")
            )
        })
        .collect();
    if unavailable.is_empty() {
        out.push(Finding::ok(C, "every certificate is available"));
    } else {
        out.push(Finding::with(
            C,
            Status::Fail,
            format!("certificates not available: {}", unavailable.join(", ")),
            "check the CA (CA_ADDRESS) and the node's token; the node log has the CA's answer",
        ));
    }
    out
}

/// `host:port` of an address that may carry a scheme (`https://istiod:15012`).
fn host_port(address: &str) -> Option<(String, u16)> {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), port.parse().ok()?))
}

/// istiod's xDS and CA reachable over TCP, when the node uses them (its `/config_dump`
/// `config`, else `XDS_ADDRESS`/`CA_ADDRESS`).
pub fn control_plane(dump: &Result<Value, String>, opts: &DoctorOptions) -> Vec<Finding> {
    let from_dump = |k: &str| {
        dump.as_ref()
            .ok()
            .and_then(|d| d["config"][k].as_str().map(str::to_owned))
    };
    let xds =
        from_dump("xdsAddress").or_else(|| opts.xds_address.clone().filter(|a| !a.is_empty()));
    let ca = from_dump("caAddress").or_else(|| opts.ca_address.clone().filter(|a| !a.is_empty()));
    [("xds", xds), ("ca", ca)]
        .into_iter()
        .map(|(check, address)| {
            let Some(address) = address else {
                return Finding::skip(check, "not configured (local config or built-in CA)");
            };
            let reached = host_port(&address)
                .ok_or_else(|| "not host:port".to_owned())
                .and_then(|(h, p)| {
                    (h.as_str(), p)
                        .to_socket_addrs()
                        .map_err(|e| format!("cannot resolve {h}: {e}"))
                })
                .and_then(|mut addrs| {
                    let first = addrs.next().ok_or_else(|| "no address".to_owned())?;
                    TcpStream::connect_timeout(&first, CONNECT_TIMEOUT)
                        .map(|_| first)
                        .map_err(|e| format!("{first}: {e}"))
                });
            match reached {
                Ok(a) => Finding::ok(check, format!("{address} reachable ({a})")),
                Err(e) => Finding::with(
                    check,
                    Status::Fail,
                    format!("{address} not reachable: {e}"),
                    "check istiod is running and the node can reach it (network policy, DNS)",
                ),
            }
        })
        .collect()
}

/// The processes in the netns `ns` under `proc_root`: (pid, real UID, effective UID, command).
fn processes_in(proc_root: &Path, ns: (u64, u64)) -> Vec<(u32, u32, u32, String)> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let dir = e.path();
            let md = std::fs::metadata(dir.join("ns/net")).ok()?;
            if (md.dev(), md.ino()) != ns {
                return None;
            }
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let uids: Vec<u32> = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))?
                .split_whitespace()
                .filter_map(|u| u.parse().ok())
                .collect();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            Some((pid, *uids.first()?, *uids.get(1)?, comm.trim().to_owned()))
        })
        .collect()
}

/// Enrolled pods with a process running as [`PROXY_UID`] (Istio's analyzer warns: the UID is
/// the proxy's).
pub fn proxy_uid(run_dir: &Path, proc_root: &Path) -> Vec<Finding> {
    const C: &str = "pod-uid";
    let pods = match enrolled(run_dir, C) {
        Ok(p) => p,
        Err(f) => return vec![f],
    };
    let mut out = Vec::new();
    for p in &pods {
        let Ok(md) = std::fs::metadata(&p.netns) else {
            continue;
        };
        let found: Vec<String> = processes_in(proc_root, (md.dev(), md.ino()))
            .into_iter()
            .filter(|(_, real, eff, _)| *real == PROXY_UID || *eff == PROXY_UID)
            .map(|(pid, _, _, comm)| format!("{comm} (pid {pid})"))
            .collect();
        if !found.is_empty() {
            out.push(Finding::with(
                C,
                Status::Warn,
                format!(
                    "{}/{} runs as UID {PROXY_UID}, the UID Istio reserves for its proxy: {}",
                    p.info.namespace,
                    p.info.name,
                    found.join(", ")
                ),
                "run the application as another user (securityContext.runAsUser)",
            ));
        }
    }
    if out.is_empty() {
        out.push(Finding::ok(
            C,
            format!(
                "no enrolled pod runs as UID {PROXY_UID} ({} pods)",
                pods.len()
            ),
        ));
    }
    out
}

/// Meshed workloads of this node without the `app` / `version` labels telemetry names them by,
/// as istiod shows them (`canonicalName`, `canonicalRevision` `latest`). Labels are known only
/// with istiod's workloads.
pub fn telemetry_labels(dump: &Result<Value, String>) -> Vec<Finding> {
    const C: &str = "labels";
    let Ok(dump) = dump else {
        return vec![Finding::skip(C, "no /config_dump")];
    };
    if dump["config"]["xdsAddress"].as_str().is_none() {
        return vec![Finding::skip(
            C,
            "labels are not known without istiod's workloads",
        )];
    }
    let ours: Vec<(String, String)> = dump["enrolledPods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some((
                p["namespace"].as_str()?.to_owned(),
                p["name"].as_str()?.to_owned(),
            ))
        })
        .collect();
    let unlabelled: Vec<String> = dump["workloads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| {
            let key = (
                w["namespace"].as_str().unwrap_or_default().to_owned(),
                w["name"].as_str().unwrap_or_default().to_owned(),
            );
            ours.contains(&key)
        })
        .filter(|w| {
            w["canonicalName"].as_str().unwrap_or_default().is_empty()
                || matches!(w["canonicalRevision"].as_str(), None | Some("" | "latest"))
        })
        .map(|w| {
            format!(
                "{}/{}",
                w["namespace"].as_str().unwrap_or("?"),
                w["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    if unlabelled.is_empty() {
        vec![Finding::ok(
            C,
            "every meshed pod has app and version labels",
        )]
    } else {
        vec![Finding::with(
            C,
            Status::Info,
            format!(
                "meshed pods without app/version labels: {}",
                unlabelled.join(", ")
            ),
            "add the `app` and `version` labels so metrics and Kiali name the workloads",
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_takes_the_authority_of_an_address() {
        assert_eq!(
            host_port("istiod.istio-system.svc:15012"),
            Some(("istiod.istio-system.svc".into(), 15012))
        );
        assert_eq!(
            host_port("https://10.0.0.1:15012/"),
            Some(("10.0.0.1".into(), 15012))
        );
        assert_eq!(
            host_port("https://[::1]:15012"),
            Some(("::1".into(), 15012))
        );
        assert_eq!(host_port("istiod"), None);
    }

    fn write(dir: &Path, name: &str, v: Value) {
        std::fs::write(dir.join(name), v.to_string()).expect("write");
    }

    #[test]
    fn cni_config_wants_our_entry_once_and_last_and_no_istio_cni() {
        let d = tempfile::tempdir().expect("tmp");
        let status = |f: &[Finding]| f.iter().map(|f| f.status).collect::<Vec<_>>();
        assert_eq!(status(&cni_config(d.path())), [Status::Fail], "empty dir");
        let list = |types: &[&str]| {
            serde_json::json!({"cniVersion": "1.0.0", "name": "n",
                "plugins": types.iter().map(|t| serde_json::json!({"type": t})).collect::<Vec<_>>()})
        };
        write(d.path(), "10-a.conflist", list(&["bridge", "ztnode-cni"]));
        assert_eq!(status(&cni_config(d.path())), [Status::Ok]);
        write(d.path(), "10-a.conflist", list(&["bridge"]));
        let f = cni_config(d.path());
        assert_eq!(status(&f), [Status::Fail]);
        assert!(f[0].message.contains("no ztnode-cni entry"), "{f:?}");
        write(d.path(), "10-a.conflist", list(&["ztnode-cni", "bridge"]));
        assert!(cni_config(d.path())[0].message.contains("not the last"));
        write(
            d.path(),
            "10-a.conflist",
            list(&["bridge", "ztnode-cni", "ztnode-cni"]),
        );
        assert!(cni_config(d.path())[0].message.contains("2 times"));
        write(
            d.path(),
            "10-a.conflist",
            list(&["bridge", "istio-cni", "ztnode-cni"]),
        );
        let f = cni_config(d.path());
        assert_eq!(status(&f), [Status::Ok, Status::Fail]);
        assert!(f[1].message.contains("istio-cni"), "{f:?}");
        write(d.path(), "10-a.conflist", list(&["bridge", "ztnode-cni"]));
        write(d.path(), "20-b.conflist", list(&["other", "ztnode-cni"]));
        std::fs::write(d.path().join("05-bad.conf"), "{not json").expect("write");
        let f = cni_config(d.path());
        assert_eq!(
            status(&f),
            [Status::Warn, Status::Ok, Status::Warn],
            "{f:?}"
        );
    }

    #[test]
    fn labels_are_a_suggestion_only_with_istiods_workloads() {
        let dump = serde_json::json!({
            "config": {"xdsAddress": "https://istiod:15012"},
            "enrolledPods": [{"namespace": "a", "name": "p"}, {"namespace": "a", "name": "q"}],
            "workloads": [
                {"namespace": "a", "name": "p", "canonicalName": "p", "canonicalRevision": "latest"},
                {"namespace": "a", "name": "q", "canonicalName": "q", "canonicalRevision": "v1"},
                {"namespace": "b", "name": "elsewhere"}
            ]
        });
        let f = telemetry_labels(&Ok(dump.clone()));
        assert_eq!(f[0].status, Status::Info);
        assert_eq!(f[0].message, "meshed pods without app/version labels: a/p");
        let mut standalone = dump;
        standalone["config"] = serde_json::json!({});
        assert_eq!(telemetry_labels(&Ok(standalone))[0].status, Status::Skip);
    }

    #[test]
    fn admin_names_pending_pods_and_unavailable_certificates() {
        let dump = serde_json::json!({
            "workloadState": {"u1": {}},
            "enrolledPods": [{"namespace": "a", "name": "p", "pending": true}],
            "certificates": [{"identity": "spiffe://x/ns/a/sa/s", "state": "Initializing"}]
        });
        let f = admin(&Ok(dump), "127.0.0.1:1".parse().expect("addr"));
        assert_eq!(f.len(), 2);
        assert!(
            f[0].status == Status::Fail && f[0].message.contains("a/p"),
            "{f:?}"
        );
        assert!(
            f[1].status == Status::Fail && f[1].message.contains("Initializing"),
            "{f:?}"
        );
        let f = admin(&Err("refused".into()), "127.0.0.1:1".parse().expect("addr"));
        assert_eq!(f[0].status, Status::Fail);
    }
}
