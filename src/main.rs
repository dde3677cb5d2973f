//! Multi-call entry point. `argv[0]` basename picks the role: `ztnode-cni` is the CNI plugin,
//! `ztunnel` the proxy, `ztnode-agent` the agent; anything else is the `ztnode` CLI.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use mimalloc::MiMalloc;
use ztnode::agent::enroll::ENV_AMBIENT_ENABLEMENT_SELECTOR;
use ztnode::agent::enroll::EnrollmentRules;
use ztnode::agent::install::{
    DEFAULT_SERVICE_ACCOUNT_DIR, InClusterApi, InstallConfig, KubeconfigSource, PluginKube,
};
use ztnode::agent::kube::{KubeAccess, KubeSettings};
use ztnode::agent::{AgentConfig, KubeMode};
use ztnode::mesh::{self, PacketMark};
use ztnode::proxy::istio_env::IstioEnv;
use ztnode::proxy::xds::XdsConfig;
use ztnode::proxy::{CertSource, ProxyConfig};
use ztnode::runtime;

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
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = mesh::DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
    /// Host CNI binary dir.
    #[arg(long, default_value = mesh::DEFAULT_CNI_BIN_DIR)]
    cni_bin_dir: PathBuf,
    /// Host CNI config dir.
    #[arg(long, default_value = mesh::DEFAULT_CNI_CONF_DIR)]
    cni_conf_dir: PathBuf,
}

/// Options both halves must agree on (`node`, `agent`, `proxy`).
#[derive(clap::Args, Debug, Clone)]
struct MeshOpts {
    /// SO_MARK of the proxy's sockets, which the in-pod rules exclude from capture (decimal, or
    /// hex with 0x; non-zero, within 0xfff, not 0x111). Agent and proxy must use the same.
    #[arg(long, env = "PACKET_MARK", default_value_t = PacketMark::DEFAULT)]
    packet_mark: PacketMark,
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
    /// Kubeconfig for Kubernetes mode (else `KUBECONFIG`, else the in-cluster service account).
    /// Without any of them the agent runs standalone.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// This node's name (Kubernetes mode: only its pods are watched).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// The host's procfs, where running pods' netns are found (Kubernetes mode; `/host/proc`
    /// when the agent runs in a container).
    #[arg(long, env = "HOST_PROC", default_value = "/proc")]
    proc_root: PathBuf,
    /// The kubelet's UID, whose probes to enrolled pods are SNATed to 169.254.7.127 (Kubernetes
    /// mode; default: found in the host's procfs).
    #[arg(long, env = "KUBELET_UID")]
    kubelet_uid: Option<u32>,
}

/// Options of the proxy half (`node`, `proxy`).
#[derive(clap::Args, Debug, Clone)]
struct ProxyOpts {
    /// CA dir (root-cert.pem, ca-key.pem); default `<run-dir>/ca`.
    #[arg(long)]
    ca_dir: Option<PathBuf>,
    /// Workload certificate lifetime, seconds.
    #[arg(long, env = "SECRET_TTL_SECONDS", default_value_t = ztnode::proxy::identity::DEFAULT_CERT_LIFETIME.as_secs())]
    cert_lifetime_secs: u64,
    /// Admin address (`/config_dump`).
    #[arg(long, default_value_t = mesh::DEFAULT_ADMIN_ADDR)]
    admin_addr: SocketAddr,
    /// Readiness address (`/healthz/ready`).
    #[arg(long, default_value_t = mesh::DEFAULT_READINESS_ADDR)]
    readiness_addr: SocketAddr,
    /// Metrics address (`/metrics`).
    #[arg(long, default_value_t = mesh::DEFAULT_METRICS_ADDR)]
    metrics_addr: SocketAddr,
    /// Do not serve the in-pod DNS proxy on 15053 (ztunnel's `DNS_CAPTURE` proxy metadata off).
    #[arg(long)]
    no_dns_proxy: bool,
    /// Resolver config whose nameservers get the DNS queries the DNS proxy forwards (read once
    /// at start; default the node's own).
    #[arg(long, env = "DNS_RESOLV_CONF", default_value = ztnode::proxy::dns::DEFAULT_RESOLV_CONF)]
    dns_resolv_conf: PathBuf,
    /// Cluster DNS domain of the pods' search domains (`<ns>.svc.<domain>`).
    #[arg(long, env = "CLUSTER_DOMAIN", default_value = ztnode::proxy::dns::DEFAULT_CLUSTER_DOMAIN)]
    cluster_domain: String,
}

/// `ztnode proxy` / `ztunnel`.
#[derive(clap::Args, Debug, Clone)]
struct ProxyCmd {
    /// Local config (ztunnel LOCAL_XDS_PATH YAML format); not needed with istiod (`XDS_ADDRESS`).
    #[arg(long, env = "LOCAL_XDS_PATH")]
    config: Option<PathBuf>,
    /// The node agent's ZDS socket.
    #[arg(long, env = "INPOD_UDS", default_value = mesh::DEFAULT_ZDS_SOCKET)]
    zds_socket: PathBuf,
    /// Run dir (the CA dir defaults to `<run-dir>/ca`).
    #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = mesh::DEFAULT_RUN_DIR)]
    run_dir: PathBuf,
    #[command(flatten)]
    mesh: MeshOpts,
    #[command(flatten)]
    proxy: ProxyOpts,
}

/// `ztnode agent` / `ztnode-agent`.
#[derive(clap::Args, Debug, Clone)]
struct AgentCmd {
    /// Local config (ztunnel LOCAL_XDS_PATH YAML format): in standalone mode enrollment = HBONE
    /// workload of the pod; optional in Kubernetes mode.
    #[arg(long, env = "LOCAL_XDS_PATH")]
    config: Option<PathBuf>,
    /// Where to serve ZDS for proxies.
    #[arg(long, env = "ZTUNNEL_UDS_ADDRESS", default_value = mesh::DEFAULT_ZDS_SOCKET)]
    zds_socket: PathBuf,
    #[command(flatten)]
    mesh: MeshOpts,
    #[command(flatten)]
    agent: AgentOpts,
}

/// Parser for argv[0] `ztunnel`: `ztunnel [proxy [ztunnel]]` as Istio's chart runs it, or
/// `ztunnel version`.
#[derive(Parser)]
#[command(name = "ztunnel", about = "The ztnode proxy alone (as `ztnode proxy`)")]
struct ZtunnelCli {
    /// `proxy` (the default) or `version`.
    #[arg(value_parser = ["proxy", "version"])]
    mode: Option<String>,
    /// The proxy's kind as the chart names it (`ztunnel`); only that one exists.
    #[arg(value_parser = ["ztunnel"], requires = "mode")]
    kind: Option<String>,
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
        /// Local config (ztunnel LOCAL_XDS_PATH YAML format); optional in Kubernetes mode.
        #[arg(long, env = "LOCAL_XDS_PATH")]
        config: Option<PathBuf>,
        #[command(flatten)]
        mesh: MeshOpts,
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
    /// Reverse `install` and remove the host rules: the plugin's config entry, binary and
    /// kubeconfig, and the host probe SNAT table. In-pod rules stay (as on any shutdown).
    Uninstall {
        #[command(flatten)]
        dirs: HostDirs,
    },
    /// The built-in CA (standalone mode): `ca init` makes one root for every node.
    Ca {
        #[command(subcommand)]
        cmd: CaCmd,
    },
    /// Build a throwaway node on this machine and show HBONE between two pods (root).
    Demo {
        /// Keep going with more output.
        #[arg(long)]
        verbose: bool,
    },
    /// Measure throughput, latency, connection rate, memory and CNI ADD time against the direct path,
    /// Kubernetes-mode enrollment and xDS push latency (root).
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
        /// Seconds to keep the lab up before measuring (to attach a profiler); with `--peer`,
        /// before each proxy's figures.
        #[arg(long, default_value_t = 0)]
        hold: u64,
        /// Run only these sections (comma-separated); all when omitted.
        #[arg(long, value_delimiter = ',', value_enum)]
        only: Vec<ztnode::lab::bench::Section>,
        /// Name prefix of the lab's namespaces (to run benches side by side).
        #[arg(long, default_value = ztnode::lab::bench::DEFAULT_LAB_PREFIX)]
        lab_prefix: String,
        /// Workloads in the xds section's world (served by the fake istiod).
        #[arg(long, default_value_t = 1000)]
        xds_workloads: usize,
        /// Authorization policies in the xds section's world.
        #[arg(long, default_value_t = 100)]
        xds_policies: usize,
        /// Pushes the xds section times, in each of its two series (ACK, config_dump).
        #[arg(long, default_value_t = 20)]
        xds_pushes: usize,
        /// Measure ztnode's proxy and this one (a ztunnel built with `--features testing`) side
        /// by side, alternating, on the same agent and pods, instead of the sections.
        #[arg(long)]
        peer: Option<PathBuf>,
        /// Rounds of `--peer` (each measures both proxies).
        #[arg(long, default_value_t = 4)]
        rounds: usize,
        /// Run only the soak, for this many minutes (fractions allowed): connection churn, long
        /// streams, pods added and deleted, policy pushes; a line a minute; exit 1 when RSS or fds
        /// grew more than `--soak-growth-limit` (10 %) after warm-up or a connection failed.
        #[arg(long, value_name = "MINUTES")]
        soak: Option<f64>,
        /// New connections per second of the soak's churn.
        #[arg(long, default_value_t = 50)]
        soak_rate: u32,
        /// Long streams the soak holds.
        #[arg(long, default_value_t = 4)]
        soak_streams: usize,
        /// Seconds between the soak's samples (for short test runs).
        #[arg(long, default_value_t = 60, hide = true)]
        soak_sample_secs: u64,
        /// Percent the node's RSS and fds may grow after the soak's warm-up sample before it
        /// fails (a short run's warm-up sample still holds start-up growth).
        #[arg(long, default_value_t = ztnode::lab::bench::DEFAULT_SOAK_GROWTH_LIMIT_PCT, value_name = "PCT")]
        soak_growth_limit: u64,
    },
    /// Check this node: CNI config, kernel features, in-pod rules, readiness, istiod, pods' UIDs
    /// and labels. One line per check; exit 1 on a failure, 2 on warnings only.
    Doctor {
        /// Agent run dir (`pods.json`).
        #[arg(long, env = "CNI_AGENT_RUN_DIR", default_value = mesh::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
        /// Host CNI config dir.
        #[arg(long, default_value = mesh::DEFAULT_CNI_CONF_DIR)]
        cni_conf_dir: PathBuf,
        /// The node's admin address (`/config_dump`).
        #[arg(long, default_value_t = mesh::DEFAULT_ADMIN_ADDR)]
        admin_addr: SocketAddr,
        /// The node's readiness address (`/healthz/ready`); default the readiness port on localhost.
        #[arg(long, default_value = "127.0.0.1:15021")]
        readiness_addr: SocketAddr,
        /// The host's procfs (`/host/proc` in the DaemonSet).
        #[arg(long, env = "HOST_PROC", default_value = "/proc")]
        proc_root: PathBuf,
        /// The node's in-pod rules redirect DNS too (`ztnode node --dns-capture`).
        #[arg(long, env = "AMBIENT_DNS_CAPTURE")]
        dns_capture: bool,
        /// The node's in-pod rules cover IPv6 too (`ztnode node --ipv6`).
        #[arg(long, env = "AMBIENT_IPV6")]
        ipv6: bool,
        #[command(flatten)]
        mesh: MeshOpts,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The CNI plugin (same as running as `ztnode-cni`).
    Cni,
    /// Print version and git commit.
    Version,
}

/// `ztnode ca …`.
#[derive(Subcommand)]
enum CaCmd {
    /// Generate a new root (ECDSA P-256, 10 years) for all nodes to share: into a CA dir
    /// (`root-cert.pem`, `ca-key.pem` 0600; never overwritten), or as a Secret manifest on stdout
    /// for the standalone component (`ztnode ca init --secret-yaml | kubectl apply -f -`).
    Init {
        /// Write the CA files into this dir (the proxy's `--ca-dir`).
        #[arg(
            long,
            required_unless_present = "secret_yaml",
            conflicts_with = "secret_yaml"
        )]
        out: Option<PathBuf>,
        /// Print a Secret holding both files instead.
        #[arg(long)]
        secret_yaml: bool,
        /// The Secret's name.
        #[arg(long, default_value = ztnode::node::ca_init::CA_SECRET_NAME, requires = "secret_yaml")]
        name: String,
        /// The Secret's namespace.
        #[arg(long, default_value = ztnode::node::ca_init::CA_SECRET_NAMESPACE, requires = "secret_yaml")]
        namespace: String,
    },
}

/// The installer's settings for these dirs: this binary as the plugin, `kube-system` excluded.
fn install_config(dirs: &HostDirs) -> anyhow::Result<InstallConfig> {
    Ok(InstallConfig {
        cni_bin_dir: dirs.cni_bin_dir.clone(),
        cni_conf_dir: dirs.cni_conf_dir.clone(),
        ..InstallConfig::new(std::env::current_exe()?, dirs.run_dir.clone())
    })
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
            runtime::init_tracing();
            runtime::raise_nofile_limit();
            let env = istio_env(&p.config)?;
            let cfg = proxy_config(&p.proxy, &p.mesh, &p.run_dir, &env);
            let source = workload_source(p.config, &env, &None)?;
            runtime::build()?.block_on(ztnode::node::run_proxy(
                source,
                cfg,
                p.zds_socket,
                runtime::shutdown_signal(),
            ))?;
            Ok(0)
        }
        Cmd::Agent(a) => {
            runtime::init_tracing();
            ztnode::agent::coexist::check(&a.agent.dirs.cni_conf_dir, &a.zds_socket)?;
            let kube = kube_mode(&a.agent)?;
            let cfg = agent_config(&a.agent, &a.mesh, &kube)?;
            let config = local_config(a.config, &kube)?;
            runtime::build()?.block_on(ztnode::node::run_agent(
                config,
                kube,
                cfg,
                a.zds_socket,
                runtime::shutdown_signal(),
            ))?;
            Ok(0)
        }
        Cmd::Install { dirs } => {
            runtime::init_tracing();
            let outcome = ztnode::agent::install::install(&install_config(&dirs)?)?;
            println!("{outcome:?}");
            Ok(0)
        }
        Cmd::Uninstall { dirs } => {
            runtime::init_tracing();
            ztnode::agent::install::uninstall(&install_config(&dirs)?)?;
            // The host probe SNAT table (Kubernetes mode's host rules); the kubelet UID only
            // shapes the rules, removal deletes the whole table.
            ztnode::agent::redirect::host::HostProbe::new(0).remove()?;
            Ok(0)
        }
        Cmd::Doctor {
            run_dir,
            cni_conf_dir,
            admin_addr,
            readiness_addr,
            proc_root,
            dns_capture,
            ipv6,
            mesh,
            json,
        } => {
            let opts = ztnode::node::doctor::DoctorOptions {
                run_dir,
                cni_conf_dir,
                admin_addr,
                readiness_addr,
                proc_root,
                plan: ztnode::agent::redirect::RedirectPlan {
                    ipv6,
                    dns_capture,
                    proxy_mark: mesh.packet_mark,
                    ..Default::default()
                },
                xds_address: std::env::var("XDS_ADDRESS").ok(),
                ca_address: std::env::var("CA_ADDRESS").ok(),
            };
            let report = ztnode::node::doctor::run(&opts);
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.render());
            }
            Ok(report.exit_code())
        }
        Cmd::Ca {
            cmd:
                CaCmd::Init {
                    out,
                    secret_yaml: _,
                    name,
                    namespace,
                },
        } => {
            use ztnode::node::ca_init;
            match out {
                Some(dir) => {
                    ca_init::write_dir(&dir)?;
                    eprintln!(
                        "wrote a new CA root to {}; give every node the same dir (--ca-dir)",
                        dir.display()
                    );
                }
                None => print!(
                    "{}",
                    ca_init::secret_manifest(&name, &namespace, &std::env::temp_dir())?
                ),
            }
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
            xds_workloads,
            xds_policies,
            xds_pushes,
            soak,
            soak_rate,
            soak_streams,
            soak_sample_secs,
            soak_growth_limit,
            peer,
            rounds,
        } => Ok(ztnode::lab::bench::run(ztnode::lab::bench::BenchOptions {
            peer,
            rounds,
            soak: soak
                .map(|minutes| -> anyhow::Result<_> {
                    let duration = Duration::try_from_secs_f64(minutes * 60.0)
                        .ok()
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| {
                            anyhow::anyhow!(
                                "--soak must be a positive number of minutes, not {minutes}"
                            )
                        })?;
                    Ok(ztnode::lab::bench::SoakOptions {
                        duration,
                        rate: soak_rate,
                        streams: soak_streams,
                        sample: Duration::from_secs(soak_sample_secs),
                        growth_limit_pct: soak_growth_limit,
                    })
                })
                .transpose()?,
            only,
            lab_prefix,
            xds_workloads,
            xds_policies,
            xds_pushes,
            hold: Duration::from_secs(hold),
            duration: Duration::from_secs(duration),
            round_trips,
            pods,
            idle_conns,
            json,
        })),
        Cmd::Node {
            config,
            mesh,
            agent,
            proxy,
        } => {
            runtime::init_tracing();
            ztnode::agent::coexist::check(&agent.dirs.cni_conf_dir, &istio_zds_socket())?;
            runtime::raise_nofile_limit();
            let kube = kube_mode(&agent)?;
            let env = istio_env(&config)?;
            let proxy = proxy_config(&proxy, &mesh, &agent.dirs.run_dir, &env);
            let cfg = ztnode::node::NodeConfig {
                source: workload_source(config, &env, &kube)?,
                node_name: Some(env.node_name.clone()).filter(|n| !n.is_empty()),
                agent: agent_config(&agent, &mesh, &kube)?,
                kube,
                proxy,
            };
            runtime::build()?.block_on(ztnode::node::run(cfg, runtime::shutdown_signal()))?;
            Ok(0)
        }
    }
}

/// Where Istio's istio-cni agent would serve ZDS for ztunnel (`ZTUNNEL_UDS_ADDRESS`, default
/// [`mesh::DEFAULT_ZDS_SOCKET`]); `ztnode node` serves none but refuses to start when something
/// answers there.
fn istio_zds_socket() -> PathBuf {
    std::env::var_os("ZTUNNEL_UDS_ADDRESS")
        .filter(|v| !v.is_empty())
        .map_or_else(|| mesh::DEFAULT_ZDS_SOCKET.into(), PathBuf::from)
}

fn agent_config(
    a: &AgentOpts,
    m: &MeshOpts,
    kube: &Option<KubeMode>,
) -> anyhow::Result<AgentConfig> {
    let install = if a.no_install {
        None
    } else {
        let mut icfg = install_config(&a.dirs)?;
        if let Some(k) = kube {
            // The plugin decides with the agent's rules, so both see the same settings.
            icfg.exclude_namespaces = k.rules.excluded.iter().map(str::to_owned).collect();
            icfg.kube = Some(plugin_kube(k)?);
        }
        Some(icfg)
    };
    Ok(AgentConfig {
        run_dir: a.dirs.run_dir.clone(),
        install,
        redirect: ztnode::agent::redirect::RedirectPlan {
            ipv6: a.ipv6,
            dns_capture: a.dns_capture,
            proxy_mark: m.packet_mark,
            ..Default::default()
        },
        metrics: Default::default(),
    })
}

/// Kubernetes mode's settings when a kubeconfig or the in-cluster service account is there
/// (`NODE_NAME` then required; the rules from `AMBIENT_ENABLEMENT_SELECTOR`,
/// `EXCLUDE_NAMESPACES`, `POD_NAMESPACE`).
fn kube_mode(a: &AgentOpts) -> anyhow::Result<Option<KubeMode>> {
    let access = KubeAccess::detect(
        a.kubeconfig.as_deref(),
        std::env::var("KUBECONFIG").ok().as_deref(),
        std::env::var("KUBERNETES_SERVICE_HOST").ok().as_deref(),
        std::path::Path::new(ztnode::agent::kube::SERVICE_ACCOUNT_TOKEN),
    );
    let Some(access) = access else {
        return Ok(None);
    };
    let node_name = a
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or(ztnode::agent::kube::KubeError::NoNodeName)?;
    let rules = EnrollmentRules::from_env(|k| std::env::var(k).ok())?;
    let daemonset = (
        rules.own.namespace.clone(),
        std::env::var("ZTNODE_DAEMONSET").unwrap_or_else(|_| "ztnode".into()),
    );
    let safe_upgrade = std::env::var(ztnode::agent::ENV_DISABLE_SAFE_UPGRADE)
        .map(|v| !v.eq_ignore_ascii_case("true"))
        .unwrap_or(true);
    Ok(Some(KubeMode {
        daemonset,
        safe_upgrade,
        settings: KubeSettings { access, node_name },
        rules,
        proc_root: a.proc_root.clone(),
        kubelet_uid: a.kubelet_uid,
    }))
}

/// What the installer writes for the plugin in Kubernetes mode: a kubeconfig (the agent's own
/// copied, or one built from the service account) and the rules' settings.
fn plugin_kube(k: &KubeMode) -> anyhow::Result<PluginKube> {
    let source = match &k.settings.access {
        KubeAccess::Kubeconfig(path) => KubeconfigSource::Copy(std::path::absolute(path)?),
        KubeAccess::InCluster => KubeconfigSource::InCluster(InClusterApi {
            host: std::env::var("KUBERNETES_SERVICE_HOST").unwrap_or_default(),
            port: std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into()),
            service_account_dir: DEFAULT_SERVICE_ACCOUNT_DIR.into(),
        }),
    };
    Ok(PluginKube {
        source,
        enablement_selector: std::env::var(ENV_AMBIENT_ENABLEMENT_SELECTOR).ok(),
        namespace: k.rules.own.namespace.clone(),
    })
}

/// Where the proxy's workloads come from: istiod (`XDS_ADDRESS`), else the local config, which
/// standalone mode requires.
fn workload_source(
    config: Option<PathBuf>,
    env: &IstioEnv,
    kube: &Option<KubeMode>,
) -> anyhow::Result<ztnode::node::WorkloadSource> {
    use ztnode::node::WorkloadSource;
    if let Some(xds) = XdsConfig::from_env(env) {
        return Ok(WorkloadSource::Xds(Box::new(xds)));
    }
    match config {
        Some(c) => Ok(WorkloadSource::LocalConfig(c)),
        None if kube.is_some() => Ok(WorkloadSource::Empty),
        None => anyhow::bail!(
            "no workload source: give a local config (--config, LOCAL_XDS_PATH) or istiod's address (XDS_ADDRESS)"
        ),
    }
}

/// The local config: required in standalone mode.
fn local_config(
    config: Option<PathBuf>,
    kube: &Option<KubeMode>,
) -> anyhow::Result<Option<PathBuf>> {
    if config.is_none() && kube.is_none() {
        anyhow::bail!(
            "--config (LOCAL_XDS_PATH) is required in standalone mode (no --kubeconfig, KUBECONFIG or in-cluster service account)"
        );
    }
    Ok(config)
}

/// ztunnel's env (istiod's xDS and CA, the node identity); a local config keeps xDS off unless
/// `XDS_ADDRESS` asks for it, and then both together are refused (one workload source).
fn istio_env(config: &Option<PathBuf>) -> anyhow::Result<IstioEnv> {
    let env = IstioEnv::from_vars(std::env::vars())?;
    env.warn_unsupported();
    if let (Some(c), Some(_)) = (config, &env.xds) {
        anyhow::bail!(
            "both a local config ({}) and XDS_ADDRESS are set: ztnode takes workloads from one source; unset one",
            c.display()
        );
    }
    Ok(env)
}

fn proxy_config(
    p: &ProxyOpts,
    m: &MeshOpts,
    run_dir: &std::path::Path,
    env: &IstioEnv,
) -> ProxyConfig {
    let cert_source = match &env.ca {
        Some(ca) => CertSource::Istio {
            endpoint: ca.endpoint.clone(),
            auth: ca.auth.clone(),
        },
        None => CertSource::BuiltIn {
            ca_dir: p.ca_dir.clone().unwrap_or_else(|| run_dir.join("ca")),
        },
    };
    // ztunnel's SECRET_TTL wins over ztnode's seconds flag when set.
    let cert_lifetime = env
        .secret_ttl
        .unwrap_or(Duration::from_secs(p.cert_lifetime_secs));
    ProxyConfig {
        cert_source,
        cert_lifetime,
        trust_roots: env.xds.iter().map(|x| x.endpoint.roots.clone()).collect(),
        packet_mark: m.packet_mark,
        admin_addr: p.admin_addr,
        readiness_addr: p.readiness_addr,
        metrics_addr: p.metrics_addr,
        pool: env.pool,
        dns: ztnode::proxy::dns::DnsOptions {
            enabled: !p.no_dns_proxy,
            resolv_conf: p.dns_resolv_conf.clone(),
            cluster_domain: p.cluster_domain.clone(),
        },
        trust_domain: env.trust_domain.clone(),
        termination_deadline: env.termination_deadline,
        port_reuse: env.port_reuse,
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
        "ztunnel" => match ZtunnelCli::parse() {
            ZtunnelCli { mode: Some(m), .. } if m == "version" => Cmd::Version,
            z => Cmd::Proxy(z.cmd),
        },
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
