//! Multi-call entry point. `argv[0]` basename picks the role: `ztnode-cni` is the CNI plugin,
//! `ztunnel` the proxy, `ztnode-agent` the agent; anything else is the `ztnode` CLI.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

#[derive(Parser)]
#[command(name = "ztnode", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("ZTNODE_GIT_SHA"), ")"),
    about = "The node side of an ambient service mesh, wire-compatible with Istio ambient")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug, Clone)]
struct HostDirs {
    /// Agent run dir (plugin socket `pluginevent.sock`, built-in CA).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = ztnode::podevent::DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
    /// Host CNI binary dir.
    #[arg(long, default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// Host CNI config dir.
    #[arg(long, default_value = "/etc/cni/net.d")]
    cni_conf_dir: PathBuf,
}

/// Options of the agent half (`node`, `agent`).
#[derive(clap::Args, Debug, Clone)]
struct AgentOpts {
    #[command(flatten)]
    dirs: HostDirs,
    /// Do not install the plugin onto the host CNI dirs.
    #[arg(long)]
    no_install: bool,
    /// Redirect DNS (udp/tcp 53) to 15053 in enrolled pods.
    #[arg(long, env = "AMBIENT_DNS_CAPTURE")]
    dns_capture: bool,
    /// Program IPv6 redirection too.
    #[arg(long, env = "AMBIENT_IPV6")]
    ipv6: bool,
}

/// Options of the proxy half (`node`, `proxy`).
#[derive(clap::Args, Debug, Clone)]
struct ProxyOpts {
    /// CA dir (root-cert.pem, ca-key.pem); default `<run-dir>/ca`.
    #[arg(long)]
    ca_dir: Option<PathBuf>,
    /// Workload certificate lifetime, seconds.
    #[arg(long, env = "SECRET_TTL_SECONDS", default_value_t = 86400)]
    cert_lifetime_secs: u64,
    /// SO_MARK of proxy sockets.
    #[arg(long, env = "PACKET_MARK", default_value_t = ztnode::proxy::socket::DEFAULT_PACKET_MARK)]
    packet_mark: u32,
    /// Admin address (`/config_dump`).
    #[arg(long, default_value = "127.0.0.1:15000")]
    admin_addr: SocketAddr,
    /// Readiness address (`/healthz/ready`).
    #[arg(long, default_value = "0.0.0.0:15021")]
    readiness_addr: SocketAddr,
    /// Metrics address (`/metrics`).
    #[arg(long, default_value = "0.0.0.0:15020")]
    metrics_addr: SocketAddr,
}

/// `ztnode proxy` / `ztunnel`.
#[derive(clap::Args, Debug, Clone)]
struct ProxyCmd {
    /// Local config (ztunnel LOCAL_XDS_PATH YAML format).
    #[arg(long, env = "LOCAL_XDS_PATH")]
    config: PathBuf,
    /// The node agent's ZDS socket.
    #[arg(long, env = "INPOD_UDS", default_value = ztnode::zds::DEFAULT_SOCKET_PATH)]
    zds_socket: PathBuf,
    /// Run dir (the CA dir defaults to `<run-dir>/ca`).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = ztnode::podevent::DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
    #[command(flatten)]
    proxy: ProxyOpts,
}

/// `ztnode agent` / `ztnode-agent`.
#[derive(clap::Args, Debug, Clone)]
struct AgentCmd {
    /// Local config (ztunnel LOCAL_XDS_PATH YAML format): enrollment = HBONE workload of the pod.
    #[arg(long, env = "LOCAL_XDS_PATH")]
    config: PathBuf,
    /// Where to serve ZDS for proxies.
    #[arg(long, env = "ZTUNNEL_UDS_ADDRESS", default_value = ztnode::zds::DEFAULT_SOCKET_PATH)]
    zds_socket: PathBuf,
    #[command(flatten)]
    agent: AgentOpts,
}

/// Parser for argv[0] `ztunnel`.
#[derive(Parser)]
#[command(name = "ztunnel", about = "The ztnode proxy alone (as `ztnode proxy`)")]
struct ZtunnelCli {
    #[command(flatten)]
    cmd: ProxyCmd,
}

/// Parser for argv[0] `ztnode-agent`.
#[derive(Parser)]
#[command(
    name = "ztnode-agent",
    about = "The ztnode node agent alone (as `ztnode agent`)"
)]
struct AgentCli {
    #[command(flatten)]
    cmd: AgentCmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Agent and proxy in one process (standalone mode DaemonSet entrypoint).
    Node {
        /// Local config (ztunnel LOCAL_XDS_PATH YAML format).
        #[arg(long, env = "LOCAL_XDS_PATH")]
        config: PathBuf,
        #[command(flatten)]
        agent: AgentOpts,
        #[command(flatten)]
        proxy: ProxyOpts,
    },
    /// The proxy alone (ztunnel): takes pods from the node agent's ZDS socket.
    Proxy(ProxyCmd),
    /// The node agent alone (istio-cni agent): serves ZDS to separate proxies.
    Agent(AgentCmd),
    /// Copy the plugin into the CNI bin dir and chain it into the primary CNI config.
    Install {
        #[command(flatten)]
        dirs: HostDirs,
    },
    /// Reverse `install`.
    Uninstall {
        #[command(flatten)]
        dirs: HostDirs,
    },
    /// Build a throwaway node on this machine and show HBONE between two pods (root).
    Demo {
        /// Keep going with more output.
        #[arg(long)]
        verbose: bool,
    },
    /// Measure throughput, latency, connection rate, memory and CNI ADD time against the direct path (root).
    Bench {
        /// Seconds per path for each throughput and connection-rate figure, taken in up to five
        /// alternating slices of whole seconds (rounded down to a multiple of the slice).
        #[arg(long, default_value_t = 10)]
        duration: u64,
        /// 1 KiB round trips for the latency percentiles.
        #[arg(long, default_value_t = 20000)]
        round_trips: usize,
        /// Enrolled pods for the idle-memory and CNI ADD figures.
        #[arg(long, default_value_t = 100)]
        pods: usize,
        /// Idle connections per batch held through the tunnel (RSS read after each of 3 batches).
        #[arg(long, default_value_t = 1000)]
        idle_conns: usize,
        /// JSON report path.
        #[arg(long, default_value = "bench.json")]
        json: PathBuf,
        /// Seconds to keep the lab up before measuring (to attach a profiler).
        #[arg(long, default_value_t = 0)]
        hold: u64,
        /// Run only these sections (comma-separated); all when omitted.
        #[arg(long, value_delimiter = ',', value_enum)]
        only: Vec<ztnode::lab::bench::Section>,
        /// Name prefix of the lab's namespaces (to run benches side by side).
        #[arg(long, default_value = ztnode::lab::bench::DEFAULT_LAB_PREFIX)]
        lab_prefix: String,
    },
    /// The CNI plugin (same as running as `ztnode-cni`).
    Cni,
    /// Print version and git commit.
    Version,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,netlink_packet_route=error"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|v| v == "json");
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

fn install_config(dirs: &HostDirs) -> anyhow::Result<ztnode::agent::install::InstallConfig> {
    Ok(ztnode::agent::install::InstallConfig {
        cni_bin_dir: dirs.cni_bin_dir.clone(),
        cni_conf_dir: dirs.cni_conf_dir.clone(),
        source_binary: std::env::current_exe()?,
        run_dir: dirs.run_dir.clone(),
        exclude_namespaces: vec!["kube-system".into()],
        log_level: None,
    })
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

/// Data-plane worker threads: `ZTUNNEL_WORKER_THREADS` (ztunnel's name), default 2.
fn worker_threads() -> usize {
    std::env::var("ZTUNNEL_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(2)
}

thread_local!(static LAST_COLLECT: std::cell::Cell<Option<std::time::Instant>> =
    const { std::cell::Cell::new(None) });

/// Returns freed memory to the OS when a worker goes idle, at most once per second per thread:
/// mimalloc keeps freed pages for reuse and only purges them (about 1 s after a burst's first
/// free) during later allocations or collections, so without this and [`trim_heap`] an idle proxy
/// would hold the peak of its last burst (e.g. after many connections closed).
fn collect_idle_heap() {
    if LAST_COLLECT
        .get()
        .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
    {
        return;
    }
    collect_heap();
}

/// Collects this thread's heap and the purges that are due (process-wide), now.
#[allow(unsafe_code)]
fn collect_heap() {
    LAST_COLLECT.set(Some(std::time::Instant::now()));
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time; it
    // only frees memory mimalloc owns and no longer hands out.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

/// How often [`trim_heap`] collects: mimalloc's purge delay (`purge_delay`, 1 s).
const HEAP_TRIM_INTERVAL: Duration = Duration::from_secs(1);

/// Collects on a timer too: the purges a burst's frees schedule are only due a second later, when
/// an idle worker may not park again for a long time.
async fn trim_heap() {
    let mut tick = tokio::time::interval(HEAP_TRIM_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        collect_heap();
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .on_thread_park(collect_idle_heap)
        .worker_threads(worker_threads())
        .thread_name("ztnode")
        .enable_all()
        .build()?;
    rt.spawn(trim_heap());
    Ok(rt)
}

fn run(cmd: Cmd) -> anyhow::Result<i32> {
    match cmd {
        Cmd::Cni => Ok(ztnode::plugin::main()),
        Cmd::Version => {
            println!(
                "ztnode {} (git {}, {} build)",
                env!("CARGO_PKG_VERSION"),
                env!("ZTNODE_GIT_SHA"),
                env!("ZTNODE_PROFILE")
            );
            Ok(0)
        }
        Cmd::Proxy(p) => {
            init_tracing();
            let cfg = proxy_config(&p.proxy, &p.run_dir);
            runtime()?.block_on(ztnode::node::run_proxy(
                p.config,
                cfg,
                p.zds_socket,
                shutdown_signal(),
            ))?;
            Ok(0)
        }
        Cmd::Agent(a) => {
            init_tracing();
            runtime()?.block_on(ztnode::node::run_agent(
                a.config,
                agent_config(&a.agent),
                a.zds_socket,
                shutdown_signal(),
            ))?;
            Ok(0)
        }
        Cmd::Install { dirs } => {
            init_tracing();
            let outcome = ztnode::agent::install::install(&install_config(&dirs)?)?;
            println!("{outcome:?}");
            Ok(0)
        }
        Cmd::Uninstall { dirs } => {
            init_tracing();
            ztnode::agent::install::uninstall(&install_config(&dirs)?)?;
            Ok(0)
        }
        Cmd::Demo { verbose } => Ok(ztnode::lab::demo::run(verbose)),
        Cmd::Bench {
            duration,
            round_trips,
            pods,
            idle_conns,
            json,
            hold,
            only,
            lab_prefix,
        } => Ok(ztnode::lab::bench::run(ztnode::lab::bench::BenchOptions {
            only,
            lab_prefix,
            hold: Duration::from_secs(hold),
            duration: Duration::from_secs(duration),
            round_trips,
            pods,
            idle_conns,
            json,
        })),
        Cmd::Node {
            config,
            agent,
            proxy,
        } => {
            init_tracing();
            ztnode::raise_nofile_limit();
            let cfg = ztnode::node::NodeConfig {
                config,
                proxy: proxy_config(&proxy, &agent.dirs.run_dir),
                agent: agent_config(&agent),
            };
            runtime()?.block_on(ztnode::node::run(cfg, shutdown_signal()))?;
            Ok(0)
        }
    }
}

fn agent_config(a: &AgentOpts) -> ztnode::node::AgentConfig {
    ztnode::node::AgentConfig {
        run_dir: a.dirs.run_dir.clone(),
        cni_bin_dir: a.dirs.cni_bin_dir.clone(),
        cni_conf_dir: a.dirs.cni_conf_dir.clone(),
        install: !a.no_install,
        redirect: ztnode::agent::redirect::RedirectPlan {
            ipv6: a.ipv6,
            dns_capture: a.dns_capture,
            ..Default::default()
        },
    }
}

fn proxy_config(p: &ProxyOpts, run_dir: &std::path::Path) -> ztnode::node::ProxyConfig {
    ztnode::node::ProxyConfig {
        ca_dir: p.ca_dir.clone().unwrap_or_else(|| run_dir.join("ca")),
        cert_lifetime: Duration::from_secs(p.cert_lifetime_secs),
        packet_mark: p.packet_mark,
        admin_addr: p.admin_addr,
        readiness_addr: p.readiness_addr,
        metrics_addr: p.metrics_addr,
    }
}

fn main() {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let base = std::path::Path::new(&argv0)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cmd = match base.as_str() {
        "ztnode-cni" => Cmd::Cni,
        "ztunnel" => Cmd::Proxy(ZtunnelCli::parse().cmd),
        "ztnode-agent" => Cmd::Agent(AgentCli::parse().cmd),
        _ => Cli::parse().cmd,
    };
    let code = match run(cmd) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ztnode: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident set of this process, MiB.
    fn rss_mib() -> f64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        kib / 1024.0
    }

    /// Assumes mimalloc's default purge delay (`MIMALLOC_PURGE_DELAY` unset). Covers the purge of
    /// freed arena memory (1 MiB objects go straight back to the arena); memory kept in another
    /// worker's own heap is the park hook's part.
    #[test]
    fn freed_memory_is_returned_while_the_runtime_idles() {
        let rt = runtime().expect("runtime");
        // Freed on a worker, which then parks before the purge is due.
        let peak = rt
            .block_on(rt.spawn(async {
                let held: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 1 << 20]).collect();
                let peak = rss_mib();
                drop(held);
                peak
            }))
            .expect("task");
        // A plain sleep: no tokio timer wakes a worker here except the trim task's.
        std::thread::sleep(HEAP_TRIM_INTERVAL * 3);
        let after = rss_mib();
        assert!(
            after < peak - 32.0,
            "64 MiB freed, RSS {peak:.1} MiB before and {after:.1} MiB after"
        );
    }
}
