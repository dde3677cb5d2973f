//! The CNI plugin role (`ztnode-cni`): a chained plugin that hands Kubernetes pods to the node agent.
//!
//! Protocol: CNI spec 0.3.0 to 1.1.0 (`../shared/spec/cni.md`), behaving like istio-cni's plugin in
//! ambient mode (`../shared/spec/istio-cni.md` §1). [`main`] wires the process; [`run`] is the whole
//! plugin over an injectable env, stdin, stdout and stderr. Modules: [`skel`] (verbs, env, version
//! gates, error codes), [`netconf`] (config and `CNI_ARGS`), [`result`] (prevResult conversion),
//! [`client`] (agent socket), [`kube`] (API server lookups in Kubernetes mode), [`cmd`] (verb
//! handlers), [`log`] (stderr logging).

use std::io::{Read, Write};

use serde::Serialize;

pub mod client;
pub mod cmd;
pub mod env;
pub mod kube;
pub mod log;
pub mod netconf;
pub mod result;
pub mod skel;
pub mod version;

pub use self::env::{Env, MapEnv, ProcessEnv};

use self::cmd::Request;
use self::log::Log;
use self::netconf::{ConfHeader, NetConf};
use self::skel::{
    CmdArgs, Command, ENV_COMMAND, PluginError, to_line, version_gate, version_reply,
};
use self::version::CniVersion;

/// Printed on stderr when `CNI_COMMAND` is absent (as skel's about string).
pub const ABOUT: &str = concat!(
    "ztnode-cni ",
    env!("CARGO_PKG_VERSION"),
    ": chained CNI plugin enrolling Kubernetes pods in the ztnode ambient mesh\n",
    "CNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n"
);

/// Runs the plugin with the process environment, stdin, stdout and stderr; returns the exit status.
pub fn main() -> i32 {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    run(
        &ProcessEnv,
        &mut stdin.lock(),
        &mut stdout.lock(),
        &mut stderr.lock(),
    )
}

/// Runs one CNI invocation and returns the exit status (0 success, 1 failure).
///
/// Without `CNI_COMMAND` it prints [`ABOUT`] on stderr and succeeds. On success the verb's output (if
/// any) goes to `stdout`; on failure the CNI error object (`cniVersion`, `code`, `msg`, `details`) goes
/// to `stdout` and a log line to `stderr`. Logs never touch `stdout`.
pub fn run(
    env: &dyn Env,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let mut log = Log::new(stderr);
    let Some(command) = env.get(ENV_COMMAND).filter(|c| !c.is_empty()) else {
        log.raw(ABOUT);
        return 0;
    };
    let mut reply_version = CniVersion::NEWEST;
    match dispatch(env, &command, stdin, &mut log, &mut reply_version) {
        Ok(output) => match output.map(|o| write_line(stdout, &o)) {
            Some(Err(e)) => {
                log.error(format_args!("{command}: writing the result to stdout: {e}"));
                1
            }
            _ => 0,
        },
        Err(err) => {
            log.error(format_args!(
                "{command} failed (code {}): {err}",
                err.code()
            ));
            if let Err(e) = write_line(stdout, &err.reply(reply_version)) {
                log.error(format_args!("{command}: writing the error to stdout: {e}"));
            }
            1
        }
    }
}

/// Everything a verb can print.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Output {
    Result(serde_json::Value),
    Version(skel::VersionReply),
}

fn dispatch(
    env: &dyn Env,
    command: &str,
    stdin: &mut dyn Read,
    log: &mut Log<'_>,
    reply_version: &mut CniVersion,
) -> Result<Option<Output>, PluginError> {
    let cmd = Command::parse(command).ok_or_else(|| PluginError::UnknownCommand {
        command: command.to_owned(),
    })?;
    let mut input = Vec::new();
    let read = stdin.read_to_end(&mut input);
    let sniffed = read
        .as_ref()
        .ok()
        .and_then(|_| ConfHeader::sniff_version(&input));
    if cmd == Command::Version {
        // Like skel, VERSION does not depend on stdin; a supported input version is echoed.
        return Ok(Some(Output::Version(version_reply(sniffed.as_deref()))));
    }
    if let Some(v) = sniffed.as_deref().and_then(CniVersion::parse) {
        *reply_version = v;
    }
    // skel's order: env, stdin, JSON and name, version gate, then the plugin's own keys.
    let args = CmdArgs::from_env(env, cmd)?;
    read.map_err(|source| PluginError::Stdin { source })?;
    let header = ConfHeader::parse(&input)?;
    let version = version_gate(cmd, header.version.as_deref())?;
    let conf = match NetConf::from_header(header) {
        Ok(conf) => conf,
        Err(e) if cmd == Command::Del => {
            log.warn(format_args!(
                "DEL container {}: {e}; skipping the node agent and reporting success",
                args.container_id
            ));
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(level) = conf.log_level {
        log.set_level(level);
    }
    log.debug(format_args!("{cmd} {args:?} cniVersion {version}"));
    let req = Request {
        args,
        version,
        conf,
    };
    match cmd {
        Command::Add => cmd::add(&req, log).map(|r| Some(Output::Result(r))),
        Command::Del => {
            cmd::del(&req.args, &req.conf, log);
            Ok(None)
        }
        Command::Check => cmd::check(&req).map(|()| None),
        Command::Status => cmd::status(&req.conf).map(|()| None),
        Command::Gc => {
            cmd::gc(&req.conf, log);
            Ok(None)
        }
        Command::Version => Ok(Some(Output::Version(version_reply(Some(version.as_str()))))),
    }
}

fn write_line<T: Serialize>(out: &mut dyn Write, value: &T) -> std::io::Result<()> {
    out.write_all(&to_line(value))?;
    out.flush()
}
