//! The measurements behind the bench's figures: throughput, round trips, connection rate and the
//! node's RSS and CPU time, each on a direct and a meshed pair of pods.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::placement::{OneCpu, Placement, PollingIdle};
use crate::lab::node::{Lab, Pod, ProcessGuard};
use crate::netns::Netns;

/// Bytes of one request and of its echo.
pub(super) const MSG: usize = 1024;
/// Longest a bench connection ([`conn_rate_timed`], [`round_trips_each`]) may wait for connect, a
/// write or a read.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The `p` quantile (0 to 1) of `sorted`, nearest rank; 0 when empty.
pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Resident set size of the process `pid`, KiB.
pub(super) fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    status_kib(pid, "VmRSS:")
}

/// The anonymous part of [`rss_kib`] (heap, stacks, relocated data; not the binary's and
/// libraries' file pages), KiB.
pub(super) fn rss_anon_kib(pid: u32) -> anyhow::Result<u64> {
    status_kib(pid, "RssAnon:")
}

/// A `/proc/<pid>/status` line's value in KiB (`field` with its colon).
fn status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// CPU time (user + system) the process `pid` has used, seconds (`/proc/<pid>/stat` fields 14
/// and 15, in clock ticks).
pub(super) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let ticks = super::busy::parse_proc_stat(&stat)
        .context("malformed /proc/<pid>/stat")?
        .cpu_ticks;
    Ok(ticks as f64 / clock_ticks_per_sec()?)
}

/// CPU time the whole machine has worked, seconds summed over all CPUs
/// ([`super::busy::machine_work_ticks`]): every process, kernel thread, hardirq and softirq;
/// not steal. The difference of two readings is what a measurement cost the node, wherever the
/// kernel's network work ran. (Without IRQ time accounting in effect, as on the VMs this bench
/// was measured on, a process's own [`cpu_seconds`] also holds the hardirq and softirq work that
/// ran while it was on the CPU: a busier process is charged more of everyone's packets.)
pub(super) fn machine_cpu_seconds() -> anyhow::Result<f64> {
    Ok(super::busy::machine_work_ticks()? as f64 / clock_ticks_per_sec()?)
}

/// `CLK_TCK`: the unit of `/proc`'s CPU times.
fn clock_ticks_per_sec() -> anyhow::Result<f64> {
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?
        .filter(|&hz| hz > 0)
        .context("no CLK_TCK")?;
    Ok(hz as f64)
}

/// [`rss_kib`] after 1.5 s for the process to settle.
pub(super) fn settle_rss(pid: u32) -> anyhow::Result<u64> {
    std::thread::sleep(Duration::from_millis(1500));
    rss_kib(pid)
}

/// Slices a throughput or connection-rate figure is taken in, the paths alternating.
const SLICES: u64 = 5;

/// Measures `direct` and `mesh` over `secs` seconds each, in [`SLICES`] alternating slices (each
/// closure gets the slice length, whole seconds, and returns its rate), and returns the mean rate
/// of each path. Alternating makes both paths see the same spells of a VM whose speed drifts
/// within a minute, which one run after the other did not.
pub(super) fn interleaved(
    secs: u64,
    mut direct: impl FnMut(u64) -> anyhow::Result<f64>,
    mut mesh: impl FnMut(u64) -> anyhow::Result<f64>,
) -> anyhow::Result<(f64, f64)> {
    let (slices, slice) = slicing(secs);
    let (mut d, mut m) = (0.0, 0.0);
    for _ in 0..slices {
        d += direct(slice)?;
        m += mesh(slice)?;
    }
    Ok((d / slices as f64, m / slices as f64))
}

/// `(slices, seconds per slice)` for `secs` seconds per path: up to [`SLICES`] slices of whole
/// seconds, at least one of a second; they cover `secs` rounded down to a multiple of the slice.
fn slicing(secs: u64) -> (u64, u64) {
    let slices = SLICES.min(secs).max(1);
    (slices, (secs / slices).max(1))
}

/// Runs iperf3 from `client` to `server`; returns Gbit/s and the bytes received.
pub(super) fn iperf(
    client: &Pod,
    server: &Pod,
    streams: usize,
    secs: u64,
) -> anyhow::Result<(f64, f64)> {
    let port = "5201";
    let srv = Command::new("ip")
        .args([
            "netns",
            "exec",
            &server.netns_name,
            "iperf3",
            "-s",
            "-1",
            "-p",
            port,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start iperf3 (install the iperf3 package)")?;
    let _srv = ProcessGuard(srv);
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &client.netns_name,
            "iperf3",
            "-c",
            &server.ip.to_string(),
            "-p",
            port,
            "-J",
        ])
        .args(["-t", &secs.to_string(), "-P", &streams.to_string()])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("iperf3 JSON")?;
    let sum = &v["end"]["sum_received"];
    let bps = sum["bits_per_second"].as_f64().context("iperf3 result")?;
    let bytes = sum["bytes"].as_f64().context("iperf3 result")?;
    Ok((bps / 1e9, bytes))
}

/// How long a one-shot echo server waits for a connection's message.
const ONE_SHOT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// An echo server's accept loop on its own thread. Stopping it (dropping it) shuts the listener
/// down, which wakes the blocked `accept`, and joins the thread: the port can then be listened on
/// again, whatever state the path to it is in.
pub(super) struct EchoServer {
    /// Where it listens.
    pub(super) addr: SocketAddr,
    /// The listening socket, shared with the thread.
    listener: std::net::TcpListener,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Listens on `server`'s IP and `port` and echoes [`MSG`]-byte messages: one message per
/// connection, then close (`close_after_reply`), or until the client closes (a thread each).
pub(super) fn echo_server(
    server: &Pod,
    port: u16,
    close_after_reply: bool,
) -> anyhow::Result<EchoServer> {
    let ns = Netns::open(&server.netns_path)?;
    let listener = Lab::listen_in(&ns, SocketAddr::new(server.ip, port))?;
    serve_echo(listener, close_after_reply)
}

/// Runs [`echo_server`]'s accept loop on `listener`.
pub(super) fn serve_echo(
    listener: std::net::TcpListener,
    close_after_reply: bool,
) -> anyhow::Result<EchoServer> {
    listener.set_nonblocking(false)?;
    let addr = listener.local_addr()?;
    let accepting = listener.try_clone()?;
    let thread = std::thread::spawn(move || {
        // Ends with the error `accept` returns once the listener is shut down.
        while let Ok((mut s, _)) = accepting.accept() {
            let _ = s.set_nodelay(true);
            let mut buf = [0u8; MSG];
            if close_after_reply {
                // one at a time: a client that never sends must not hold up the next ones for ever
                let _ = s.set_read_timeout(Some(ONE_SHOT_READ_TIMEOUT));
                if s.read_exact(&mut buf).is_ok() {
                    let _ = s.write_all(&buf);
                }
                continue;
            }
            std::thread::spawn(move || {
                while s.read_exact(&mut buf).is_ok() {
                    if s.write_all(&buf).is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(EchoServer {
        addr,
        listener,
        thread: Some(thread),
    })
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        let _ = socket2::SockRef::from(&self.listener).shutdown(std::net::Shutdown::Both);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Round-trip percentiles of both paths, µs.
pub(super) struct Latency {
    pub(super) direct_p50: f64,
    pub(super) direct_p99: f64,
    pub(super) mesh_p50: f64,
    pub(super) mesh_p99: f64,
}

/// 1 KiB round trips on one kept connection per path (`pods`: direct client, direct server, mesh
/// client, mesh server). The two paths alternate sample by sample, so both see the same machine
/// (CPU wake-up latency on this VM moves the direct p50 by tens of µs between runs; measuring the
/// paths one after the other would put that drift into the difference).
pub(super) fn latency(
    pods: [&Pod; 4],
    n: usize,
    port: u16,
    placement: Placement,
    node_pid: u32,
) -> anyhow::Result<Latency> {
    let [d_client, d_server, m_client, m_server] = pods;
    // Pinned before the echo servers start, so their threads inherit the one CPU.
    let _pinned = (placement == Placement::OneCpu)
        .then(|| OneCpu::pin(node_pid))
        .transpose()?;
    let _polling = (placement == Placement::PollingIdle)
        .then(PollingIdle::hold)
        .transpose()?;
    let d_echo = echo_server(d_server, port, false)?;
    let m_echo = echo_server(m_server, port, false)?;
    let (d_addr, m_addr) = (d_echo.addr, m_echo.addr);
    let d_ns = Netns::open(&d_client.netns_path)?;
    let m_ns = Netns::open(&m_client.netns_path)?;
    let mut d = Lab::connect_from(&d_ns, d_addr)?;
    let mut m = Lab::connect_from(&m_ns, m_addr)?;
    d.set_nodelay(true)?;
    m.set_nodelay(true)?;
    let buf = [7u8; MSG];
    let mut back = [0u8; MSG];
    let mut round_trip = |s: &mut std::net::TcpStream| -> std::io::Result<f64> {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut back)?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    };
    for _ in 0..n / 10 {
        round_trip(&mut d)?;
        round_trip(&mut m)?;
    }
    let mut direct = Vec::with_capacity(n);
    let mut mesh = Vec::with_capacity(n);
    for _ in 0..n {
        direct.push(round_trip(&mut d)?);
        mesh.push(round_trip(&mut m)?);
    }
    drop((d, m));
    drop((d_echo, m_echo));
    direct.sort_by(f64::total_cmp);
    mesh.sort_by(f64::total_cmp);
    Ok(Latency {
        direct_p50: percentile(&direct, 0.5),
        direct_p99: percentile(&direct, 0.99),
        mesh_p50: percentile(&mesh, 0.5),
        mesh_p99: percentile(&mesh, 0.99),
    })
}

/// Connections per second from `client` to an echo server in `server` over `dur`: connect, one
/// [`MSG`] round trip, close.
pub(super) fn conn_rate(client: &Pod, server: &Pod, dur: Duration) -> anyhow::Result<f64> {
    Ok(conn_rate_timed(client, server, dur)?.per_sec)
}

/// What [`conn_rate_timed`] measured.
pub(super) struct ConnRate {
    /// Connections per second.
    pub(super) per_sec: f64,
    /// Time of each connection (connect, round trip, close seen), ms, sorted.
    pub(super) each_ms: Vec<f64>,
}

/// [`conn_rate`] with the time each connection took.
pub(super) fn conn_rate_timed(
    client: &Pod,
    server: &Pod,
    dur: Duration,
) -> anyhow::Result<ConnRate> {
    let echo = echo_server(server, 7200, true)?;
    let addr = echo.addr;
    let ns = Netns::open(&client.netns_path)?;
    let buf = [9u8; MSG];
    let (mut each_ms, elapsed) = ns.run(move || -> std::io::Result<(Vec<f64>, f64)> {
        let start = Instant::now();
        let mut each = Vec::new();
        let mut back = [0u8; MSG];
        while start.elapsed() < dur {
            let t = Instant::now();
            let mut s = std::net::TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
            s.set_nodelay(true)?;
            // a proxy that holds the connection fails the figure instead of hanging the bench
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.set_write_timeout(Some(IO_TIMEOUT))?;
            s.write_all(&buf)?;
            s.read_exact(&mut back)?;
            let mut rest = [0u8; 1];
            let _ = s.read(&mut rest);
            each.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok((each, start.elapsed().as_secs_f64()))
    })??;
    drop(echo);
    each_ms.sort_by(f64::total_cmp);
    Ok(ConnRate {
        per_sec: each_ms.len() as f64 / elapsed,
        each_ms,
    })
}

/// [`MSG`] round trips per second over `conns` kept connections from `client` to an echo server
/// in `server` (port 7500), each connection on its own client thread, for `dur`: how a proxy
/// serves many connections' small messages at once, sharing the machine's CPUs with the clients
/// and the echo threads. Errors: the echo server's listener, a connect, or as
/// [`round_trips_each`].
pub(super) fn parallel_round_trips(
    client: &Pod,
    server: &Pod,
    conns: usize,
    dur: Duration,
) -> anyhow::Result<f64> {
    let echo = echo_server(server, 7500, false)?;
    let ns = Netns::open(&client.netns_path)?;
    let streams = (0..conns)
        .map(|_| Lab::connect_from(&ns, echo.addr))
        .collect::<Result<Vec<_>, _>>()?;
    let (each, elapsed) = round_trips_each(streams, dur)
        .with_context(|| format!("{conns} connections at once to {}", echo.addr))?;
    drop(echo);
    Ok(each.iter().sum::<u64>() as f64 / elapsed.as_secs_f64())
}

/// Runs [`MSG`] round trips on each of `streams`, each from its own thread, until `dur` has
/// passed (at least one per stream): the round trips each stream completed, and the time until
/// the last thread ended. Errors: a thread that cannot be started, or a stream's first I/O error
/// (a reply that is not the request's echo, or [`IO_TIMEOUT`] passing in a write or read); the
/// other streams then stop at their next round trip.
fn round_trips_each(
    streams: Vec<std::net::TcpStream>,
    dur: Duration,
) -> std::io::Result<(Vec<u64>, Duration)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let start = Instant::now();
    let deadline = start + dur;
    let failed = std::sync::Arc::new(AtomicBool::new(false));
    let threads = streams
        .into_iter()
        .map(|mut s| {
            let failed = failed.clone();
            std::thread::Builder::new().spawn(move || -> std::io::Result<u64> {
                let run = |s: &mut std::net::TcpStream| -> std::io::Result<u64> {
                    s.set_nodelay(true)?;
                    s.set_read_timeout(Some(IO_TIMEOUT))?;
                    s.set_write_timeout(Some(IO_TIMEOUT))?;
                    let buf = [5u8; MSG];
                    let mut back = [0u8; MSG];
                    let mut n = 0;
                    loop {
                        s.write_all(&buf)?;
                        s.read_exact(&mut back)?;
                        if back != buf {
                            return Err(std::io::Error::other("the reply is not the echo"));
                        }
                        n += 1;
                        if Instant::now() >= deadline || failed.load(Ordering::Relaxed) {
                            return Ok(n);
                        }
                    }
                };
                let res = run(&mut s);
                if res.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                res
            })
        })
        .collect::<std::io::Result<Vec<_>>>();
    let threads = match threads {
        Ok(t) => t,
        Err(e) => {
            failed.store(true, Ordering::Relaxed);
            return Err(e);
        }
    };
    let each = threads
        .into_iter()
        .map(|t| {
            t.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("client thread panicked")))
        })
        .collect::<std::io::Result<Vec<u64>>>()?;
    Ok((each, start.elapsed()))
}

/// RSS of the node process while idle connections are held through the tunnel, KiB: after each
/// of [`IDLE_BATCHES`] batches of `n` connections (`held[i]` with `(i + 1) * n` open), and after
/// all closed.
///
/// The per-connection figure is the slope from `n` to `IDLE_BATCHES * n`: the first `n` also pay
/// one-time costs (code pages first touched by the data path, the first pooled HBONE connections
/// and their buffers, allocator pages), which are not a cost per held connection. Two batches past
/// the first halve the RSS noise per connection (how much freed memory of earlier sections a batch
/// happens to reuse moves each reading by about a MiB).
pub(super) fn idle_connections(
    client: &Pod,
    server: &Pod,
    n: usize,
    pid: u32,
) -> anyhow::Result<IdleRss> {
    let ns = Netns::open(&client.netns_path)?;
    let sns = Netns::open(&server.netns_path)?;
    let addr = SocketAddr::new(server.ip, 7300);
    let listener = Lab::listen_in(&sns, addr)?;
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    let acceptor = std::thread::spawn(move || {
        let mut held = Vec::new();
        while held.len() < IDLE_BATCHES * n {
            match listener.accept() {
                Ok((s, _)) => {
                    held.push(s);
                    count.store(held.len(), std::sync::atomic::Ordering::Release);
                }
                Err(_) => break,
            }
        }
        held
    });
    // A client connect returns once ztnode's listener answered; the tunnel behind it is complete
    // when the app accepted it.
    let wait_accepted = |want: usize| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while accepted.load(std::sync::atomic::Ordering::Acquire) < want {
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {} of {want} idle connections reached the app",
                accepted.load(std::sync::atomic::Ordering::Acquire)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    let open = |count: usize| {
        ns.run(move || -> std::io::Result<Vec<std::net::TcpStream>> {
            (0..count)
                .map(|_| std::net::TcpStream::connect(addr))
                .collect()
        })
    };
    let mut clients = Vec::with_capacity(IDLE_BATCHES * n);
    let mut held = Vec::with_capacity(IDLE_BATCHES);
    for batch in 1..=IDLE_BATCHES {
        clients.extend(open(n)??);
        wait_accepted(batch * n)?;
        held.push(settle_rss(pid)?);
    }
    let accepted = acceptor
        .join()
        .map_err(|_| anyhow::anyhow!("acceptor panicked"))?;
    drop((clients, accepted));
    std::thread::sleep(Duration::from_secs(2));
    let after = settle_rss(pid)?;
    Ok(IdleRss { held, after })
}

/// Batches of idle connections [`idle_connections`] opens.
const IDLE_BATCHES: usize = 3;

/// RSS readings of [`idle_connections`], KiB.
pub(super) struct IdleRss {
    /// After each batch (`held[i]`: `(i + 1) * n` connections open).
    pub(super) held: Vec<u64>,
    /// After all closed.
    pub(super) after: u64,
}

impl IdleRss {
    /// KiB per connection from the first batch to the last.
    pub(super) fn per_conn(&self, n: usize) -> f64 {
        let (Some(first), Some(last)) = (self.held.first(), self.held.last()) else {
            return 0.0;
        };
        let conns = (self.held.len().saturating_sub(1) * n).max(1);
        last.saturating_sub(*first) as f64 / conns as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_alternate_and_average_each_path() {
        assert_eq!(slicing(10), (5, 2));
        assert_eq!(slicing(3), (3, 1));
        assert_eq!(slicing(0), (1, 1));
        let order = std::cell::RefCell::new(Vec::new());
        let (d, m) = interleaved(
            10,
            |s| {
                order.borrow_mut().push('d');
                Ok(s as f64 * (order.borrow().len() as f64))
            },
            |s| {
                order.borrow_mut().push('m');
                Ok(s as f64)
            },
        )
        .expect("measured");
        assert_eq!(order.into_inner().iter().collect::<String>(), "dmdmdmdmdm");
        // direct slices returned 2, 6, 10, 14 and 18
        assert_eq!((d, m), (10.0, 2.0));
    }

    #[test]
    fn a_stopped_echo_server_frees_its_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let echo = serve_echo(listener, true).expect("serve");
        let addr = echo.addr;
        let mut c = std::net::TcpStream::connect(addr).expect("connect");
        c.write_all(&[5u8; MSG]).expect("write");
        let mut back = [0u8; MSG];
        c.read_exact(&mut back).expect("echo");
        assert_eq!(back, [5u8; MSG]);
        drop(echo);
        std::net::TcpListener::bind(addr).expect("the port is free again");
    }

    /// Every connection runs its own round trips until the time is up, and a connection whose
    /// peer is gone fails the measurement (and stops the others) instead of counting nothing.
    #[test]
    fn each_connection_makes_round_trips_until_the_time_is_up() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let echo = serve_echo(listener, false).expect("serve");
        let streams = (0..4)
            .map(|_| std::net::TcpStream::connect(echo.addr).expect("connect"))
            .collect();
        let dur = Duration::from_millis(300);
        let (each, _) = round_trips_each(streams, dur).expect("round trips");
        assert_eq!(each.len(), 4);
        assert!(each.iter().all(|n| *n > 0), "{each:?}");
        // beside a working connection, one whose peer takes it and closes it at once (its first
        // read finds EOF): the measurement fails, and does not wait out a long `dur`
        let closing = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = closing.local_addr().expect("addr");
        let closer = std::thread::spawn(move || drop(closing.accept()));
        let broken = std::net::TcpStream::connect(addr).expect("connect");
        closer.join().expect("closer");
        let good = std::net::TcpStream::connect(echo.addr).expect("connect");
        let t = Instant::now();
        assert!(round_trips_each(vec![good, broken], Duration::from_secs(60)).is_err());
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }

    #[test]
    fn per_connection_slope_runs_from_the_first_batch_to_the_last() {
        let idle = IdleRss {
            held: vec![10_000, 14_000, 16_000],
            after: 0,
        };
        // (16,000 - 10,000) KiB over the 2 × 1,000 connections past the first batch
        assert_eq!(idle.per_conn(1000), 3.0);
        // RSS that fell is no cost
        let fell = IdleRss {
            held: vec![10_000, 9_000, 9_500],
            after: 0,
        };
        assert_eq!(fell.per_conn(1000), 0.0);
        let one = IdleRss {
            held: vec![10_000],
            after: 0,
        };
        assert_eq!(one.per_conn(1000), 0.0);
    }
}
