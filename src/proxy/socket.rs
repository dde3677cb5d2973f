//! In-pod sockets: every socket the proxy opens for a pod is created inside that pod's network
//! namespace and carries `SO_MARK` = the packet mark (default 0x539 = 1337), as ztunnel's in-pod socket
//! factory does (`../shared/spec/ztunnel.md` §2).
//!
//! A [`PodSockets`] owns one OS thread that entered the pod netns once and creates sockets on request,
//! so neither `setns` nor a per-connection thread spawn happens on the async data path. From a pod's
//! first IPv4 socket on (a connect, or the IPv4 listener fallback of a pod without IPv6), the thread
//! also keeps a stock of [`STOCK_TARGET`] IPv4 sockets ready (that many file descriptors per pod),
//! refilled in batches: most connects then take a socket without waiting for the thread.
//!
//! Port reuse (ztunnel's `INPOD_PORT_REUSE`, on by default): the pod's listeners get
//! `SO_REUSEPORT`, so a new proxy process can bind them while the old one still runs, and
//! [`steer_to_newest`] makes the kernel hand every new connection (and datagram) to the socket
//! bound last, so the old process's listeners receive nothing more and can close without
//! resetting a connection waiting in their accept queue.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as stdmpsc;
use std::sync::{Arc, Mutex, PoisonError};

use socket2::{Domain, Protocol, SockAddr, SockRef, Socket, Type};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::sync::oneshot;

use crate::mesh::PacketMark;
use crate::netns::{Netns, NetnsError};

/// Listen backlog for pod listeners (ztunnel uses 128).
const LISTEN_BACKLOG: i32 = 1024;

/// Errors creating in-pod sockets.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Entering the pod netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// The socket thread is gone (pod stopped).
    #[error("pod socket thread stopped")]
    Stopped,
    /// A socket call failed.
    #[error("{op}: {source}")]
    Io {
        /// The operation (`socket`, `bind 0.0.0.0:15001`, `connect 10.0.0.2:80`, ...).
        op: String,
        /// Errno.
        #[source]
        source: io::Error,
    },
}

/// Maps an `io::Error` to [`SocketError::Io`] naming `op`, which is only turned into a string on
/// error (pass `format_args!` for an operation with an address).
fn io_err(op: impl std::fmt::Display) -> impl FnOnce(io::Error) -> SocketError {
    move |source| SocketError::Io {
        op: op.to_string(),
        source,
    }
}

/// IPv4 sockets the socket thread keeps ready per pod once the pod has connected somewhere.
pub const STOCK_TARGET: usize = 16;
/// A take that leaves fewer than this many sockets asks the thread for a refill.
const STOCK_LOW: usize = 8;

enum Request {
    /// Create one TCP socket of this family and send it back.
    Create(Domain, oneshot::Sender<Result<Socket, SocketError>>),
    /// Create one UDP socket of this family and send it back.
    CreateUdp(Domain, oneshot::Sender<Result<Socket, SocketError>>),
    /// Top the IPv4 stock up to [`STOCK_TARGET`].
    Refill,
}

/// Ready IPv4 sockets, shared by the pod's tasks and its socket thread.
#[derive(Debug, Default)]
struct Stock {
    v4: Mutex<Vec<Socket>>,
    /// A refill was asked for and has not finished yet (so only one is queued at a time).
    refilling: AtomicBool,
}

impl Stock {
    fn sockets(&self) -> std::sync::MutexGuard<'_, Vec<Socket>> {
        self.v4.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Creates TCP and UDP sockets inside one pod's netns, all marked with the packet mark.
#[derive(Debug, Clone)]
pub struct PodSockets {
    tx: stdmpsc::Sender<Request>,
    stock: Arc<Stock>,
    reuse_port: bool,
}

/// A non-blocking TCP socket of `domain` in the calling thread's netns, with SO_MARK `mark` and
/// TCP_NODELAY (every TCP socket of the proxy relays; a listener passes it on to the sockets it
/// accepts), set here so a connect from the stock makes one system call less.
fn new_socket(domain: Domain, mark: PacketMark) -> Result<Socket, SocketError> {
    let sock = new_socket_of(domain, Type::STREAM, Protocol::TCP, mark)?;
    sock.set_tcp_nodelay(true)
        .map_err(io_err("set TCP_NODELAY"))?;
    Ok(sock)
}

/// A non-blocking socket of `domain`, `ty` and `proto` in the calling thread's netns, with SO_MARK
/// `mark`.
fn new_socket_of(
    domain: Domain,
    ty: Type,
    proto: Protocol,
    mark: PacketMark,
) -> Result<Socket, SocketError> {
    let sock =
        Socket::new(domain, ty.nonblocking().cloexec(), Some(proto)).map_err(io_err("socket"))?;
    sock.set_mark(mark.get()).map_err(io_err("set SO_MARK"))?;
    Ok(sock)
}

impl PodSockets {
    /// Starts the socket thread for `netns`. `mark` is applied to every socket.
    pub fn new(netns: &Netns, mark: PacketMark) -> Result<PodSockets, SocketError> {
        let (tx, rx) = stdmpsc::channel::<Request>();
        let (ready_tx, ready_rx) = stdmpsc::channel();
        let netns = netns.clone();
        let stock = Arc::new(Stock::default());
        let thread_stock = stock.clone();
        std::thread::Builder::new()
            .name("pod-sockets".into())
            .spawn(move || {
                let entered = netns.enter();
                let ok = entered.is_ok();
                let _ = ready_tx.send(entered);
                if !ok {
                    return;
                }
                while let Ok(req) = rx.recv() {
                    match req {
                        Request::Create(domain, reply) => {
                            let _ = reply.send(new_socket(domain, mark));
                        }
                        Request::CreateUdp(domain, reply) => {
                            let _ =
                                reply.send(new_socket_of(domain, Type::DGRAM, Protocol::UDP, mark));
                        }
                        Request::Refill => {
                            let have = thread_stock.sockets().len();
                            // A failure (fd limit) just leaves the stock short; connects fall back
                            // to Create, which reports the error.
                            let fresh: Vec<Socket> = (have..STOCK_TARGET)
                                .map_while(|_| new_socket(Domain::IPV4, mark).ok())
                                .collect();
                            thread_stock.sockets().extend(fresh);
                            thread_stock.refilling.store(false, Ordering::Release);
                        }
                    }
                }
            })
            .map_err(io_err("spawn pod socket thread"))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(PodSockets {
                tx,
                stock,
                reuse_port: false,
            }),
            Ok(Err(e)) => Err(SocketError::Netns(e)),
            Err(_) => Err(SocketError::Stopped),
        }
    }

    /// The same factory with `SO_REUSEPORT` on (or off) for the listeners and the bound UDP
    /// sockets it makes from now on ([`PodSockets::listen`], [`PodSockets::listen_at`],
    /// [`PodSockets::udp_bind`]) on a fixed port (never on port 0); off by default.
    pub fn with_port_reuse(mut self, on: bool) -> PodSockets {
        self.reuse_port = on;
        self
    }

    /// Whether a socket bound to `addr` shares its port with a newer process: with port reuse
    /// on, and only for a fixed port. An ephemeral port (0, e.g. a DNS upstream query's socket)
    /// is this socket's alone; with `SO_REUSEPORT` the kernel could hand it a port another
    /// socket of this user holds, and the steering would take that socket's datagrams.
    fn shares_port(&self, addr: SocketAddr) -> bool {
        self.reuse_port && addr.port() != 0
    }

    /// `SO_REUSEPORT` on `sock` when it shares its port ([`PodSockets::shares_port`]).
    fn reuse(&self, sock: &Socket, addr: SocketAddr) -> Result<(), SocketError> {
        if self.shares_port(addr) {
            sock.set_reuse_port(true)
                .map_err(io_err("set SO_REUSEPORT"))?;
        }
        Ok(())
    }

    /// After bind (UDP) or listen (TCP) of a socket that shares its port: new flows go to it.
    fn take_over(&self, sock: &Socket, addr: SocketAddr) {
        if self.shares_port(addr)
            && let Err(e) = steer_to_newest(sock)
        {
            tracing::warn!(%addr, error = %e, "cannot steer new connections to the newest listener");
        }
    }

    /// A marked socket of `domain` in the pod netns: from the stock for IPv4 when there is one,
    /// else made by the socket thread.
    async fn socket(&self, domain: Domain) -> Result<Socket, SocketError> {
        let mut refill = false;
        if domain == Domain::IPV4 {
            let (stocked, left) = {
                let mut v4 = self.stock.sockets();
                let s = v4.pop();
                (s, v4.len())
            };
            refill = left < STOCK_LOW && !self.stock.refilling.swap(true, Ordering::AcqRel);
            if let Some(sock) = stocked {
                if refill {
                    // A send error means the thread is gone; later connects report it.
                    let _ = self.tx.send(Request::Refill);
                }
                return Ok(sock);
            }
        }
        let (reply_tx, reply_rx) = oneshot::channel();
        self.tx
            .send(Request::Create(domain, reply_tx))
            .map_err(|_| SocketError::Stopped)?;
        if refill {
            // After the Create, so this connect does not wait for the whole batch.
            let _ = self.tx.send(Request::Refill);
        }
        reply_rx.await.map_err(|_| SocketError::Stopped)?
    }

    /// A marked socket of `domain` (UDP or TCP) in the pod netns, made by the socket thread (never
    /// from the stock, and without starting one).
    async fn fresh_socket(&self, domain: Domain, udp: bool) -> Result<Socket, SocketError> {
        let (reply_tx, reply_rx) = oneshot::channel();
        let req = if udp {
            Request::CreateUdp(domain, reply_tx)
        } else {
            Request::Create(domain, reply_tx)
        };
        self.tx.send(req).map_err(|_| SocketError::Stopped)?;
        reply_rx.await.map_err(|_| SocketError::Stopped)?
    }

    /// A UDP socket bound to `addr` in the pod netns (port 0: any), with the packet mark. No
    /// SO_REUSEADDR: UDP has no TIME_WAIT to wait out, and with it a second socket could bind the
    /// same port and take its datagrams. With port reuse, `SO_REUSEPORT` (only sockets of the same
    /// user can join) and new datagrams go to the newest socket ([`steer_to_newest`]).
    pub async fn udp_bind(&self, addr: SocketAddr) -> Result<UdpSocket, SocketError> {
        let sock = self.fresh_socket(Domain::for_address(addr), true).await?;
        if addr.is_ipv6() {
            sock.set_only_v6(true).map_err(io_err("set IPV6_V6ONLY"))?;
        }
        self.reuse(&sock, addr)?;
        sock.bind(&SockAddr::from(addr))
            .map_err(io_err(format_args!("bind udp {addr}")))?;
        self.take_over(&sock, addr);
        UdpSocket::from_std(sock.into()).map_err(io_err("register udp socket"))
    }

    /// A TCP listener on exactly `addr` in the pod netns (e.g. `127.0.0.1:15053`), with
    /// SO_REUSEADDR, the packet mark, TCP_NODELAY (passed on to accepted sockets) and, with port
    /// reuse, SO_REUSEPORT.
    pub async fn listen_at(&self, addr: SocketAddr) -> Result<TcpListener, SocketError> {
        let sock = self.fresh_socket(Domain::for_address(addr), false).await?;
        sock.set_reuse_address(true)
            .map_err(io_err("set SO_REUSEADDR"))?;
        self.reuse(&sock, addr)?;
        if addr.is_ipv6() {
            sock.set_only_v6(true).map_err(io_err("set IPV6_V6ONLY"))?;
        }
        sock.bind(&SockAddr::from(addr))
            .map_err(io_err(format_args!("bind {addr}")))?;
        sock.listen(LISTEN_BACKLOG)
            .map_err(io_err(format_args!("listen {addr}")))?;
        self.take_over(&sock, addr);
        TcpListener::from_std(sock.into()).map_err(io_err("register listener"))
    }

    /// A listener on `[::]:port` (dual stack) or, when IPv6 is unavailable in the pod, `0.0.0.0:port`,
    /// with SO_REUSEADDR, TCP_NODELAY (passed on to accepted sockets), best-effort IP_TRANSPARENT
    /// and, with port reuse, SO_REUSEPORT.
    pub async fn listen(&self, port: u16) -> Result<TcpListener, SocketError> {
        let (sock, addr) = match self.socket(Domain::IPV6).await {
            Ok(s) if s.set_only_v6(false).is_ok() => {
                (s, SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
            }
            _ => (
                self.socket(Domain::IPV4).await?,
                SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
            ),
        };
        sock.set_reuse_address(true)
            .map_err(io_err("set SO_REUSEADDR"))?;
        self.reuse(&sock, addr)?;
        let _ = sock.set_ip_transparent_v4(true);
        sock.bind(&SockAddr::from(addr))
            .map_err(io_err(format_args!("bind {addr}")))?;
        sock.listen(LISTEN_BACKLOG)
            .map_err(io_err(format_args!("listen {addr}")))?;
        self.take_over(&sock, addr);
        TcpListener::from_std(sock.into()).map_err(io_err("register listener"))
    }

    /// Connects to `dst` from the pod. With `src` set (and different from `dst`'s IP) the socket binds
    /// that address with IP_TRANSPARENT + IP_FREEBIND, so the peer sees it as the source (ztunnel's
    /// `freebind_connect`). The connect is bounded by `timeout`. Errors: the socket could not be
    /// made or bound, the peer refused or was unreachable (the socket's error), or `timeout`
    /// passed (`TimedOut`).
    pub async fn connect(
        &self,
        dst: SocketAddr,
        src: Option<IpAddr>,
        timeout: std::time::Duration,
    ) -> Result<TcpStream, SocketError> {
        let domain = if dst.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        let sock = self.socket(domain).await?;
        if let Some(src) = src.filter(|s| *s != dst.ip()) {
            if dst.is_ipv4() {
                sock.set_ip_transparent_v4(true)
                    .map_err(io_err("set IP_TRANSPARENT"))?;
                sock.set_freebind_v4(true)
                    .map_err(io_err("set IP_FREEBIND"))?;
            } else {
                sock.set_ip_transparent_v6(true)
                    .map_err(io_err("set IPV6_TRANSPARENT"))?;
                sock.set_freebind_v6(true)
                    .map_err(io_err("set IPV6_FREEBIND"))?;
            }
            let bind = SocketAddr::new(src, 0);
            sock.bind(&SockAddr::from(bind))
                .map_err(io_err(format_args!("bind {bind}")))?;
        }
        let std_stream: std::net::TcpStream = sock.into();
        let tcp = TcpSocket::from_std_stream(std_stream);
        match tokio::time::timeout(timeout, tcp.connect(dst)).await {
            Ok(r) => r.map_err(io_err(format_args!("connect {dst}"))),
            Err(_) => Err(SocketError::Io {
                op: format!("connect {dst}"),
                source: io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
            }),
        }
    }
}

/// `SO_ATTACH_REUSEPORT_CBPF` (asm-generic/socket.h; the value of x86_64 and arm64).
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

/// Makes the kernel pick the second socket of `sock`'s `SO_REUSEPORT` group for every new
/// connection or datagram: a one-instruction classic BPF program (`ret #1`) set on the group,
/// which `sock` (bound, and listening for TCP) has joined last. While an old process's socket and
/// this one share the port the group is `[old, this]`, so nothing new goes to the old socket,
/// which can then close without resetting connections queued in it; once the old one is gone,
/// the index is past the end and the kernel falls back to its hash over the one left. (With
/// three generations at once the middle one would be picked; an upgrade has two.)
///
/// Errors: the `setsockopt` failed (e.g. `sock` has no `SO_REUSEPORT`).
#[allow(unsafe_code)]
pub fn steer_to_newest(sock: &impl std::os::fd::AsRawFd) -> io::Result<()> {
    let mut program = [libc::sock_filter {
        code: (libc::BPF_RET | libc::BPF_K) as u16,
        jt: 0,
        jf: 0,
        k: 1,
    }];
    let fprog = libc::sock_fprog {
        len: 1,
        filter: program.as_mut_ptr(),
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sock_fprog>())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `fprog` points at `program`, both alive for the call; the kernel copies the program.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_REUSEPORT_CBPF,
            (&raw const fprog).cast(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A TCP listener on `addr` in the calling thread's netns (the node's admin, readiness and
/// metrics endpoints) with SO_REUSEADDR and, when `reuse_port`, SO_REUSEPORT and
/// [`steer_to_newest`], so a new process can bind the same address while the old one drains.
pub fn node_listener(addr: SocketAddr, reuse_port: bool) -> io::Result<TcpListener> {
    let sock = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        Some(Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    if reuse_port {
        sock.set_reuse_port(true)?;
    }
    if addr.is_ipv6() {
        sock.set_only_v6(false)?;
    }
    sock.bind(&SockAddr::from(addr))?;
    sock.listen(LISTEN_BACKLOG)?;
    if reuse_port {
        steer_to_newest(&sock)?;
    }
    TcpListener::from_std(sock.into())
}

/// The original destination of a redirected connection: `SO_ORIGINAL_DST` (v4), then
/// `IP6T_SO_ORIGINAL_DST` (v6), else the local address; v4-mapped v6 is canonicalised to v4.
pub fn original_dst(stream: &TcpStream) -> io::Result<SocketAddr> {
    let sock = SockRef::from(stream);
    let found = sock
        .original_dst_v4()
        .ok()
        .and_then(|a| a.as_socket())
        .or_else(|| sock.original_dst_v6().ok().and_then(|a| a.as_socket()));
    let addr = match found {
        Some(a) => a,
        None => stream.local_addr()?,
    };
    Ok(canonical(addr))
}

/// Turns a v4-mapped v6 socket address into its v4 form.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        SocketAddr::V4(_) => addr,
    }
}

/// Ends a connection the proxy could not serve with a TCP RST (SO_LINGER 0), so the client sees
/// what it would see without the mesh when the destination refuses or is unreachable (a connect
/// error), not an accepted connection closed cleanly: clients that fall back on a connect error
/// (another address family, another endpoint) keep working.
pub fn reset(tcp: tokio::net::TcpStream) {
    if let Err(e) = socket2::SockRef::from(&tcp).set_linger(Some(std::time::Duration::ZERO)) {
        tracing::debug!(error = %e, "cannot set SO_LINGER 0; closing normally");
    }
    drop(tcp);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two generations on one port: new connections all go to the newer listener, none waits in
    /// the older one (which can close without resetting anything); once the newer one is gone the
    /// older takes them again.
    #[tokio::test]
    async fn with_port_reuse_new_connections_go_to_the_newest_listener() {
        let old = node_listener("127.0.0.1:0".parse().expect("addr"), true).expect("old");
        let addr = old.local_addr().expect("addr");
        let new = node_listener(addr, true).expect("the same port again");
        for _ in 0..20 {
            let _c = tokio::net::TcpStream::connect(addr).await.expect("connect");
            tokio::time::timeout(std::time::Duration::from_secs(5), new.accept())
                .await
                .expect("the newest listener accepts")
                .expect("accept");
        }
        let none = tokio::time::timeout(std::time::Duration::from_millis(100), old.accept()).await;
        assert!(none.is_err(), "nothing went to the old listener");
        drop(new);
        let _c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        tokio::time::timeout(std::time::Duration::from_secs(5), old.accept())
            .await
            .expect("the old listener alone takes them")
            .expect("accept");
        // without port reuse a second bind of the port fails
        let single = node_listener("127.0.0.1:0".parse().expect("addr"), false).expect("single");
        assert!(node_listener(single.local_addr().expect("addr"), false).is_err());
    }

    /// A loopback port free right now (bound and let go).
    fn free_port(udp: bool) -> u16 {
        if udp {
            std::net::UdpSocket::bind("127.0.0.1:0")
                .and_then(|s| s.local_addr())
                .expect("udp port")
                .port()
        } else {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|s| s.local_addr())
                .expect("tcp port")
                .port()
        }
    }

    #[tokio::test]
    async fn pod_udp_and_tcp_sockets_share_their_port_with_port_reuse() {
        let ns = Netns::current().expect("netns");
        let socks = PodSockets::new(&ns, PacketMark::DEFAULT)
            .expect("socket thread")
            .with_port_reuse(true);
        let at = SocketAddr::from(([127, 0, 0, 1], free_port(false)));
        let first = socks.listen_at(at).await.expect("tcp");
        assert!(
            SockRef::from(&first)
                .reuse_port()
                .expect("get SO_REUSEPORT")
        );
        let second = socks.listen_at(at).await.expect("tcp again");
        let _c = tokio::net::TcpStream::connect(at).await.expect("connect");
        tokio::time::timeout(std::time::Duration::from_secs(5), second.accept())
            .await
            .expect("newest accepts")
            .expect("accept");
        let uat = SocketAddr::from(([127, 0, 0, 1], free_port(true)));
        let _u1 = socks.udp_bind(uat).await.expect("udp");
        let u2 = socks.udp_bind(uat).await.expect("udp again");
        let client = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("client");
        client.send_to(b"q", uat).await.expect("send");
        let mut buf = [0u8; 8];
        let (n, _) =
            tokio::time::timeout(std::time::Duration::from_secs(5), u2.recv_from(&mut buf))
                .await
                .expect("newest gets the datagram")
                .expect("recv");
        assert_eq!(&buf[..n], b"q");
    }

    #[tokio::test]
    async fn ephemeral_sockets_never_share_their_port() {
        let ns = Netns::current().expect("netns");
        let socks = PodSockets::new(&ns, PacketMark::DEFAULT)
            .expect("socket thread")
            .with_port_reuse(true);
        let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let udp = socks.udp_bind(any).await.expect("udp");
        let tcp = socks.listen_at(any).await.expect("tcp");
        let listener = socks.listen(0).await.expect("listen");
        for sock in [
            SockRef::from(&udp),
            SockRef::from(&tcp),
            SockRef::from(&listener),
        ] {
            assert!(
                !sock.reuse_port().expect("get SO_REUSEPORT"),
                "no SO_REUSEPORT on port 0"
            );
        }
        let taken = udp.local_addr().expect("addr");
        assert!(
            socks.udp_bind(taken).await.is_err(),
            "nobody can join an ephemeral socket's port"
        );
    }

    #[test]
    fn canonicalises_mapped_addresses() {
        let mapped: SocketAddr = "[::ffff:10.0.0.2]:80".parse().expect("addr");
        assert_eq!(
            canonical(mapped),
            "10.0.0.2:80".parse::<SocketAddr>().expect("addr")
        );
        let v6: SocketAddr = "[fd00::1]:80".parse().expect("addr");
        assert_eq!(canonical(v6), v6);
    }

    #[tokio::test]
    async fn sockets_in_own_netns_carry_the_mark() {
        let ns = Netns::current().expect("own netns");
        let socks = PodSockets::new(&ns, PacketMark::DEFAULT).expect("socket thread");
        let listener = socks.listen(0).await.expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let client = socks
            .connect(
                SocketAddr::from(([127, 0, 0, 1], port)),
                None,
                std::time::Duration::from_secs(2),
            )
            .await
            .expect("connect");
        let mark = SockRef::from(&client).mark().expect("get SO_MARK");
        assert_eq!(mark, PacketMark::DEFAULT.get());
        assert!(client.nodelay().expect("TCP_NODELAY"));
        let (_accepted, peer) = listener.accept().await.expect("accept");
        assert_eq!(canonical(peer).ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    }

    /// The three outcomes of a connect: refused at once (the socket's error, not a hang), still in
    /// SYN-SENT (the peer's accept queue is full, so the kernel drops the SYN) until `timeout`, and
    /// established only after the wait, by the retransmitted SYN once the queue has room.
    #[tokio::test]
    async fn connect_reports_refusal_timeout_and_a_late_handshake() {
        let ns = Netns::current().expect("own netns");
        let socks = PodSockets::new(&ns, PacketMark::DEFAULT).expect("socket thread");
        let loopback = SockAddr::from(SocketAddr::from(([127, 0, 0, 1], 0)));
        // bound, never listening: its port answers a SYN with a RST and no other test can take it
        let closed = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        closed.bind(&loopback).expect("bind");
        let closed_addr = closed
            .local_addr()
            .expect("addr")
            .as_socket()
            .expect("inet");
        let short = std::time::Duration::from_millis(200);
        match socks.connect(closed_addr, None, short).await {
            Err(SocketError::Io { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::ConnectionRefused)
            }
            other => panic!("expected a refusal, got {other:?}"),
        }

        // backlog 1: the accept queue holds two connections, the next SYN is dropped
        let full = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        full.bind(&loopback).expect("bind");
        full.listen(1).expect("listen");
        full.set_nonblocking(true).expect("nonblocking");
        let full_addr = full.local_addr().expect("addr").as_socket().expect("inet");
        let _queued = [
            socks.connect(full_addr, None, short).await.expect("first"),
            socks.connect(full_addr, None, short).await.expect("second"),
        ];
        match socks.connect(full_addr, None, short).await {
            Err(SocketError::Io { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::TimedOut)
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        let started = std::time::Instant::now();
        let late = tokio::spawn({
            let socks = socks.clone();
            async move {
                socks
                    .connect(full_addr, None, std::time::Duration::from_secs(5))
                    .await
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!late.is_finished(), "the SYN waits for room in the queue");
        let (_first, _) = full.accept().expect("accept a queued one");
        let stream = late.await.expect("join").expect("late handshake");
        assert_eq!(stream.peer_addr().expect("peer"), full_addr);
        // the first SYN was dropped: only its retransmission (about 1 s later) got through
        assert!(started.elapsed() >= std::time::Duration::from_millis(500));
    }

    #[tokio::test]
    async fn udp_sockets_and_address_listeners_carry_the_mark_without_a_stock() {
        let ns = Netns::current().expect("own netns");
        let socks = PodSockets::new(&ns, PacketMark::DEFAULT).expect("socket thread");
        let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let udp = socks.udp_bind(any).await.expect("udp");
        let tcp = socks.listen_at(any).await.expect("tcp");
        for sock in [SockRef::from(&udp), SockRef::from(&tcp)] {
            assert_eq!(sock.mark().expect("mark"), PacketMark::DEFAULT.get());
        }
        assert!(tcp.local_addr().expect("addr").ip().is_loopback());
        assert!(socks.stock.sockets().is_empty(), "no stock for listeners");
    }

    #[tokio::test]
    async fn ipv4_stock_fills_after_the_first_connect_and_carries_the_mark_and_nodelay() {
        let ns = Netns::current().expect("own netns");
        let socks = PodSockets::new(&ns, PacketMark::DEFAULT).expect("socket thread");
        assert!(
            socks.stock.sockets().is_empty(),
            "no stock before any connect"
        );
        let listener = socks.listen(0).await.expect("listen");
        let dst = SocketAddr::from(([127, 0, 0, 1], listener.local_addr().expect("addr").port()));
        let timeout = std::time::Duration::from_secs(2);
        let _first = socks.connect(dst, None, timeout).await.expect("connect");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while socks.stock.sockets().len() < STOCK_TARGET {
            assert!(std::time::Instant::now() < deadline, "stock never filled");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let mut held = Vec::new();
        for _ in 0..=STOCK_TARGET - STOCK_LOW {
            let c = socks.connect(dst, None, timeout).await.expect("connect");
            assert_eq!(
                SockRef::from(&c).mark().expect("mark"),
                PacketMark::DEFAULT.get()
            );
            assert!(
                c.nodelay().expect("TCP_NODELAY"),
                "a stock socket relays too"
            );
            held.push(c);
        }
        // taken from the stock: below the low mark, one batch refills it
        while socks.stock.sockets().len() < STOCK_TARGET {
            assert!(std::time::Instant::now() < deadline, "stock never refilled");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(!socks.stock.refilling.load(Ordering::Acquire));
    }
}
