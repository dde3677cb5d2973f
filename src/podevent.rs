//! Events the CNI plugin sends to the node agent, and the socket they travel on.
//!
//! Transport (as istio-cni, `../shared/spec/istio-cni.md` §1.5): HTTP/1.1 over the unix stream socket
//! `<run_dir>/pluginevent.sock`, `POST /cmdadd` (and ztnode's `POST /cmddel`), `Content-Type:
//! application/json`, 5 s total timeout on the client. The agent answers 200 on success, 400 on an
//! unparseable body and 500 (error text as body) when enrollment failed.
//!
//! JSON keys are capitalised like Istio's `CNIPluginAddEvent` (a Go struct without json tags), so an
//! Istio plugin can talk to our agent: `Netns`, `PodName`, `PodNamespace`, `IPs`; ztnode adds
//! `PodUid`, `ContainerId` and `IfName` (Istio's agent ignores unknown keys, and so do we).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// File name of the plugin event socket inside the run dir.
pub const PLUGIN_SOCKET_NAME: &str = "pluginevent.sock";
/// URL path for ADD events.
pub const PATH_CMDADD: &str = "/cmdadd";
/// URL path for DEL events.
pub const PATH_CMDDEL: &str = "/cmddel";
/// Total client timeout for one event, in seconds.
pub const EVENT_TIMEOUT_SECS: u64 = 5;

/// Path of the plugin socket inside `run_dir`.
pub fn plugin_socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join(PLUGIN_SOCKET_NAME)
}

/// One IP of the pod, from the chained plugin's `prevResult.ips`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PodIp {
    /// Index into prevResult `interfaces`, if given.
    #[serde(default)]
    pub interface: Option<i64>,
    /// Address with prefix length.
    pub address: IpNet,
    /// Gateway, if given.
    #[serde(default)]
    pub gateway: Option<IpAddr>,
}

/// An address and prefix. Serialised as Go's `net.IPNet` JSON: `{"IP": "10.0.0.2", "Mask": "<base64>"}`
/// is what Istio sends; ztnode sends and accepts `{"IP": "10.0.0.2", "Prefix": 24}` and also accepts
/// the Go form (the mask is ignored, as Istio's agent does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpNet {
    /// The address (host bits kept).
    #[serde(rename = "IP")]
    pub ip: IpAddr,
    /// Prefix length in bits.
    #[serde(rename = "Prefix", default)]
    pub prefix: u8,
}

/// `POST /cmdadd` body: a pod's sandbox got its network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodAddEvent {
    /// CNI_NETNS as given by the runtime (e.g. `/var/run/netns/cni-1234`).
    #[serde(rename = "Netns")]
    pub netns: String,
    /// `K8S_POD_NAME`.
    #[serde(rename = "PodName")]
    pub pod_name: String,
    /// `K8S_POD_NAMESPACE`.
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// `K8S_POD_UID`, empty when the runtime did not send it.
    #[serde(rename = "PodUid", default)]
    pub pod_uid: String,
    /// CNI_CONTAINERID (the sandbox id).
    #[serde(rename = "ContainerId", default)]
    pub container_id: String,
    /// CNI_IFNAME.
    #[serde(rename = "IfName", default)]
    pub if_name: String,
    /// The pod's IPs from prevResult.
    #[serde(rename = "IPs", default)]
    pub ips: Vec<PodIp>,
}

/// `POST /cmddel` body: the runtime tears the sandbox down. Fields may be empty (DEL is best effort).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodDelEvent {
    /// CNI_NETNS; may be empty or already gone.
    #[serde(rename = "Netns", default)]
    pub netns: String,
    /// `K8S_POD_NAME`.
    #[serde(rename = "PodName", default)]
    pub pod_name: String,
    /// `K8S_POD_NAMESPACE`.
    #[serde(rename = "PodNamespace", default)]
    pub pod_namespace: String,
    /// `K8S_POD_UID`.
    #[serde(rename = "PodUid", default)]
    pub pod_uid: String,
    /// CNI_CONTAINERID.
    #[serde(rename = "ContainerId", default)]
    pub container_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_istio_plugin_body() {
        let body = r#"{"Netns":"/var/run/netns/x","PodName":"a","PodNamespace":"default",
            "IPs":[{"Interface":1,"Address":{"IP":"10.0.0.2","Mask":"////AA=="},"Gateway":"10.0.0.1"}]}"#;
        let ev: PodAddEvent = serde_json::from_str(body).expect("istio body parses");
        assert_eq!(
            ev.ips[0].address.ip,
            "10.0.0.2".parse::<IpAddr>().expect("ip")
        );
        assert_eq!(ev.pod_uid, "");
    }
}
