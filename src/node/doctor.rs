//! `ztnode doctor`: a node-side check a person runs on a node (or with `kubectl exec` in the
//! ztnode pod), one line per check with what to do about a failure, or JSON (`--json`).
//!
//! Checks ([`checks`]): the CNI config (ztnode's entry once and last in the primary config, the
//! primary valid, no `istio-cni` chained too, no entry elsewhere); kernel features (nf_tables,
//! network namespaces, `SO_MARK`, `IP_TRANSPARENT`, IPv6); the in-pod rules of every pod in
//! `<run-dir>/pods.json` against the plan the agent applies (drift); readiness (`:15021`) and what
//! is pending, and the admin's view (proxies started, certificates); istiod's xDS and CA
//! reachable when the node uses them; enrolled pods with a process running as UID 1337 (the
//! proxy's UID, which Istio reserves: its analyzer warns); meshed workloads without `app` /
//! `version` labels (a telemetry suggestion, when istiod's workloads show the labels).
//!
//! Exit code ([`Report::exit_code`]): 0 when nothing failed or warned, 1 when a check failed,
//! 2 when only warnings were found. Suggestions and skipped checks do not count.

pub mod checks;

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;

use crate::agent::redirect::RedirectPlan;

/// What `ztnode doctor` looks at; the flag names follow `ztnode node`'s.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// The agent's run dir (`pods.json`).
    pub run_dir: PathBuf,
    /// The host CNI config dir.
    pub cni_conf_dir: PathBuf,
    /// The node's admin address (`/config_dump`).
    pub admin_addr: SocketAddr,
    /// The node's readiness address (`/healthz/ready`).
    pub readiness_addr: SocketAddr,
    /// The host's procfs (processes of the pods).
    pub proc_root: PathBuf,
    /// The node-wide redirection plan the agent applies (its `--ipv6`, `--dns-capture`,
    /// `--packet-mark`); each pod's plan is this one with the pod's options.
    pub plan: RedirectPlan,
    /// istiod's xDS address when the admin cannot tell (`XDS_ADDRESS`).
    pub xds_address: Option<String>,
    /// istiod's CA address when the admin cannot tell (`CA_ADDRESS`).
    pub ca_address: Option<String>,
}

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Ok,
    /// Broken: the mesh does not work as it should for some pod or at all.
    Fail,
    /// Works, but against Istio's rules or advice.
    Warn,
    /// A suggestion (telemetry quality); never changes the exit code.
    Info,
    /// Not applicable here (not configured, nothing to check).
    Skip,
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Check name (`cni`, `kernel`, `pod-rules`, ...).
    pub check: &'static str,
    /// Outcome.
    pub status: Status,
    /// What was found.
    pub message: String,
    /// What to do about it (failures, warnings and suggestions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    /// A passed check.
    pub fn ok(check: &'static str, message: impl Into<String>) -> Finding {
        Finding {
            check,
            status: Status::Ok,
            message: message.into(),
            fix: None,
        }
    }

    /// A check with `status` and what to do.
    pub fn with(
        check: &'static str,
        status: Status,
        message: impl Into<String>,
        fix: impl Into<String>,
    ) -> Finding {
        Finding {
            check,
            status,
            message: message.into(),
            fix: Some(fix.into()),
        }
    }

    /// A check that does not apply.
    pub fn skip(check: &'static str, message: impl Into<String>) -> Finding {
        Finding {
            check,
            status: Status::Skip,
            message: message.into(),
            fix: None,
        }
    }
}

/// Everything `ztnode doctor` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// True when nothing failed or warned.
    pub ok: bool,
    /// The findings, in check order.
    pub checks: Vec<Finding>,
}

impl Report {
    /// A report of `checks`.
    pub fn new(checks: Vec<Finding>) -> Report {
        let ok = !checks
            .iter()
            .any(|c| matches!(c.status, Status::Fail | Status::Warn));
        Report { ok, checks }
    }

    /// 1 when a check failed, 2 when only warnings, else 0.
    pub fn exit_code(&self) -> i32 {
        if self.checks.iter().any(|c| c.status == Status::Fail) {
            1
        } else if self.checks.iter().any(|c| c.status == Status::Warn) {
            2
        } else {
            0
        }
    }

    /// The report as text: a line per finding (`✓`, `✗`, `!` warning, `·` suggestion, `-`
    /// skipped), what to do indented below it, and a summary line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let mark = match c.status {
                Status::Ok => "✓",
                Status::Fail => "✗",
                Status::Warn => "!",
                Status::Info => "·",
                Status::Skip => "-",
            };
            out.push_str(&format!("{mark} {}: {}\n", c.check, c.message));
            if let Some(fix) = &c.fix {
                out.push_str(&format!("    → {fix}\n"));
            }
        }
        let count = |s: Status| self.checks.iter().filter(|c| c.status == s).count();
        out.push_str(&format!(
            "{} failed, {} warnings, {} suggestions\n",
            count(Status::Fail),
            count(Status::Warn),
            count(Status::Info)
        ));
        out
    }
}

/// Runs every check (blocking; a few seconds at most when the node does not answer).
pub fn run(opts: &DoctorOptions) -> Report {
    let mut found = Vec::new();
    found.extend(checks::cni_config(&opts.cni_conf_dir));
    found.extend(checks::kernel(&opts.plan));
    found.extend(checks::pod_rules(&opts.run_dir, &opts.plan));
    found.push(checks::readiness(opts.readiness_addr));
    let dump = checks::fetch_config_dump(opts.admin_addr);
    found.extend(checks::admin(&dump, opts.admin_addr));
    found.extend(checks::control_plane(&dump, opts));
    found.extend(checks::proxy_uid(&opts.run_dir, &opts.proc_root));
    found.extend(checks::telemetry_labels(&dump));
    Report::new(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_code_counts_failures_then_warnings_never_suggestions() {
        let ok = Finding::ok("a", "fine");
        let info = Finding::with("b", Status::Info, "x", "y");
        let warn = Finding::with("c", Status::Warn, "x", "y");
        let fail = Finding::with("d", Status::Fail, "x", "y");
        let skip = Finding::skip("e", "n/a");
        assert_eq!(
            Report::new(vec![ok.clone(), info.clone(), skip]).exit_code(),
            0
        );
        assert_eq!(Report::new(vec![ok.clone(), warn.clone()]).exit_code(), 2);
        let r = Report::new(vec![ok, warn, fail, info]);
        assert_eq!(r.exit_code(), 1);
        assert!(!r.ok);
        let text = r.render();
        assert!(text.contains("✓ a: fine\n"), "{text}");
        assert!(text.contains("✗ d: x\n    → y\n"), "{text}");
        assert!(
            text.ends_with("1 failed, 1 warnings, 1 suggestions\n"),
            "{text}"
        );
        let json = serde_json::to_value(&r).expect("json");
        assert_eq!(json["ok"], false);
        assert_eq!(json["checks"][2]["status"], "fail");
        assert!(json["checks"][0].get("fix").is_none());
    }
}
