//! The verb handlers, called by [`super::run`] after the env, config and version gate passed.
//!
//! ztnode's plugin is a chained plugin that owns no state: ADD hands the pod to the node agent (fail
//! closed) and passes `prevResult` through; DEL tells the agent best effort and never fails; CHECK
//! validates its input; STATUS reports whether the agent socket accepts connections; GC has nothing
//! of its own to collect.
//!
//! In Kubernetes mode (conf key `kubeconfig`) ADD first asks the API server whether the pod is
//! ambient and decides with the agent's `EnrollmentRules`: a pod that is not enrolled passes
//! through without contacting the agent, so it starts while the agent is down; an enrolled pod
//! fails closed as before (`../shared/spec/istio-cni.md` §1.4).

use std::net::IpAddr;
use std::time::Duration;

use serde_json::Value;

use crate::netns::Netns;
use crate::podevent::{EVENT_TIMEOUT_SECS, PATH_CMDADD, PATH_CMDDEL, PodAddEvent, PodDelEvent};

use super::client::AgentClient;
use super::kube::{self, KUBE_TIMEOUT};
use super::log::Log;
use super::netconf::{KubeConf, NetConf};
use super::result::{PrevResult, empty_result};
use super::skel::{CmdArgs, PluginError};
use super::version::CniVersion;

/// Total time ADD waits for the agent.
pub const ADD_TIMEOUT: Duration = Duration::from_secs(EVENT_TIMEOUT_SECS);
/// Total time DEL waits for the agent (short: DEL must not hold up the runtime's teardown).
pub const DEL_TIMEOUT: Duration = Duration::from_secs(2);

/// One gated invocation: env, config version and validated config.
#[derive(Debug, Clone)]
pub struct Request {
    /// The `CNI_*` env.
    pub args: CmdArgs,
    /// The config's `cniVersion` (supported and allowed for the verb).
    pub version: CniVersion,
    /// The validated config.
    pub conf: NetConf,
}

/// ADD: returns the result to print (`prevResult` at the config's version, or an empty result).
///
/// Order: parse `prevResult` (codes 6/7) -> refuse the host netns (code 8, unless
/// `CNI_NETNS_OVERRIDE`) -> pass through non-Kubernetes pods and excluded namespaces -> in
/// Kubernetes mode: pass through ztnode's own pods by name (before any API call, spec §1.4 step 3),
/// GET pod and namespace (code 11 when that fails) and pass through pods the rules do not enroll
/// -> `POST /cmdadd` (code 11 when the agent is unreachable or answers non-200).
pub fn add(req: &Request, log: &mut Log<'_>) -> Result<Value, PluginError> {
    let prev = req
        .conf
        .prev_result
        .as_ref()
        .map(|v| PrevResult::parse(v, req.version))
        .transpose()?;
    let output = match &prev {
        Some(p) => p.to_version(req.version),
        None => empty_result(req.version),
    };
    if !req.args.netns_override {
        refuse_host_netns(&req.args.netns, log)?;
    }
    let Some((namespace, name)) = req.args.args.pod() else {
        log.info(format_args!(
            "ADD container {}: not a kubernetes pod, passing through",
            req.args.container_id
        ));
        return Ok(output);
    };
    if req.conf.is_excluded(namespace) {
        log.info(format_args!(
            "ADD pod {namespace}/{name}: namespace excluded, passing through"
        ));
        return Ok(output);
    }
    let ips = prev.as_ref().map(PrevResult::pod_ips).unwrap_or_default();
    if let Some(kube) = &req.conf.kube {
        let fallback: Vec<IpAddr> = ips.iter().map(|ip| ip.address.ip).collect();
        if !is_ambient(req, kube, (namespace, name), &fallback, log)? {
            return Ok(output);
        }
    }
    let event = PodAddEvent {
        netns: req.args.netns.clone(),
        pod_name: name.to_owned(),
        pod_namespace: namespace.to_owned(),
        pod_uid: req.args.args.pod_uid.clone().unwrap_or_default(),
        container_id: req.args.container_id.clone(),
        if_name: req.args.ifname.clone(),
        ips,
    };
    let client = AgentClient::new(&req.conf.run_dir);
    log.debug(format_args!(
        "ADD pod {namespace}/{name}: sending {event:?} to {}",
        client.socket().display()
    ));
    client
        .post(PATH_CMDADD, &event, ADD_TIMEOUT)
        .map_err(|source| PluginError::AgentAdd {
            pod: format!("{namespace}/{name}"),
            socket: client.socket().to_owned(),
            source,
        })?;
    log.info(format_args!(
        "ADD pod {namespace}/{name} (netns {}): enrolled by the node agent",
        req.args.netns
    ));
    Ok(output)
}

/// Kubernetes mode's classification: `Ok(true)` when the agent must enroll the pod, `Ok(false)`
/// when it passes through (logged with the reason). Errors: [`PluginError::Classify`].
fn is_ambient(
    req: &Request,
    kube: &KubeConf,
    (namespace, name): (&str, &str),
    fallback_ips: &[IpAddr],
    log: &mut Log<'_>,
) -> Result<bool, PluginError> {
    if kube.rules.own.matches_name(namespace, name) {
        log.info(format_args!(
            "ADD pod {namespace}/{name}: one of ztnode's own pods, passing through"
        ));
        return Ok(false);
    }
    let (pod, ns) =
        kube::fetch(&kube.kubeconfig, namespace, name, KUBE_TIMEOUT).map_err(|source| {
            PluginError::Classify {
                pod: format!("{namespace}/{name}"),
                source: Box::new(source),
            }
        })?;
    let uid = req.args.args.pod_uid.as_deref();
    let pod_facts = kube::pod_facts(&pod, namespace, name, uid, fallback_ips);
    let ns_facts = kube::namespace_facts(&ns, namespace);
    let decision = kube.rules.decide(&pod_facts, &ns_facts);
    log.info(format_args!("ADD pod {namespace}/{name}: {decision}"));
    Ok(decision.is_enrolled())
}

/// DEL: tells the agent, best effort. Never fails: a missing netns, an absent agent or an error answer
/// is logged to stderr, because a failing DEL would stop the runtime's DEL chain (cni.md §2).
/// Non-Kubernetes pods were never sent to the agent, so they are skipped.
pub fn del(args: &CmdArgs, conf: &NetConf, log: &mut Log<'_>) {
    let Some((namespace, name)) = args.args.pod() else {
        log.info(format_args!(
            "DEL container {}: not a kubernetes pod, nothing to do",
            args.container_id
        ));
        return;
    };
    let event = PodDelEvent {
        netns: args.netns.clone(),
        pod_name: name.to_owned(),
        pod_namespace: namespace.to_owned(),
        pod_uid: args.args.pod_uid.clone().unwrap_or_default(),
        container_id: args.container_id.clone(),
    };
    let client = AgentClient::new(&conf.run_dir);
    match client.post(PATH_CMDDEL, &event, DEL_TIMEOUT) {
        Ok(()) => log.info(format_args!(
            "DEL pod {namespace}/{name}: node agent notified"
        )),
        Err(e) => log.warn(format_args!(
            "DEL pod {namespace}/{name} (container {}): could not notify the node agent at {}: {e}; \
             reporting success anyway",
            args.container_id,
            client.socket().display()
        )),
    }
}

/// CHECK: the config was validated by the caller; validates `prevResult` (codes 6/7) when present.
pub fn check(req: &Request) -> Result<(), PluginError> {
    if let Some(prev) = &req.conf.prev_result {
        PrevResult::parse(prev, req.version)?;
    }
    Ok(())
}

/// STATUS: ready when the agent socket accepts a connection, else code 50.
pub fn status(conf: &NetConf) -> Result<(), PluginError> {
    let client = AgentClient::new(&conf.run_dir);
    client.probe().map_err(|source| PluginError::AgentStatus {
        socket: client.socket().to_owned(),
        source,
    })
}

/// GC: the plugin keeps no per-attachment state (the agent reconciles pods itself), so nothing to do.
pub fn gc(conf: &NetConf, log: &mut Log<'_>) {
    match &conf.valid_attachments {
        Some(list) => log.info(format_args!(
            "GC network {}: {} valid attachments, no plugin state to collect",
            conf.name,
            list.len()
        )),
        None => log.info(format_args!(
            "GC network {}: no attachment list, no plugin state to collect",
            conf.name
        )),
    }
}

/// Fails with code 8 if `netns` is the plugin's own network namespace. A path that cannot be opened
/// is left to the agent to judge.
fn refuse_host_netns(netns: &str, log: &mut Log<'_>) -> Result<(), PluginError> {
    match (Netns::open(netns), Netns::current()) {
        (Ok(target), Ok(own)) if target == own => Err(PluginError::HostNetns {
            netns: netns.to_owned(),
        }),
        (Err(e), _) | (_, Err(e)) => {
            log.debug(format_args!("netns identity check skipped: {e}"));
            Ok(())
        }
        _ => Ok(()),
    }
}
