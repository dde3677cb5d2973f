//! SOCK_SEQPACKET unix sockets for ZDS: one protobuf message per datagram, fds as SCM_RIGHTS.
//!
//! Framing follows `../shared/spec/ztunnel.md` §1 "Transport": no length prefix, a 1024-byte receive
//! buffer, and a datagram or control message that does not fit (MSG_TRUNC / MSG_CTRUNC) is an error.
//! Sockets are non-blocking, close-on-exec, and driven by tokio's [`AsyncFd`]; received fds get
//! `MSG_CMSG_CLOEXEC`.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Largest ZDS message either side accepts, bytes (the receive buffer size of Istio and ztunnel).
pub const MAX_MESSAGE: usize = 1024;

/// Listen backlog of the agent's socket.
const BACKLOG: i32 = 16;

/// Errors of ZDS socket I/O.
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    /// A socket call failed.
    #[error("ZDS socket {path}: {op}: {source}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The failed operation (`bind`, `connect`, `sendmsg`, ...).
        op: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A message to send does not fit the peer's receive buffer.
    #[error("ZDS message of {len} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge {
        /// Encoded length, bytes.
        len: usize,
    },
    /// A received datagram was longer than [`MAX_MESSAGE`] (MSG_TRUNC).
    #[error("ZDS message truncated: longer than {MAX_MESSAGE} bytes (MSG_TRUNC)")]
    Truncated,
    /// A received control message did not fit (MSG_CTRUNC): too many fds.
    #[error("ZDS control message truncated (MSG_CTRUNC): too many fds")]
    ControlTruncated,
    /// A received datagram is not the expected protobuf message.
    #[error("decode ZDS {what}: {source}")]
    Decode {
        /// The expected message type.
        what: &'static str,
        /// Cause.
        #[source]
        source: prost::DecodeError,
    },
    /// The peer did not answer in time.
    #[error("ZDS {op} timed out after {after:?}")]
    Timeout {
        /// What was awaited.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The peer closed the connection.
    #[error("ZDS peer closed the connection")]
    Closed,
}

/// One received datagram and the fds that came with it.
#[derive(Debug)]
pub struct Packet {
    /// Message bytes (at most [`MAX_MESSAGE`]).
    pub data: Vec<u8>,
    /// Fds received as SCM_RIGHTS (closed when dropped).
    pub fds: Vec<OwnedFd>,
}

/// A connected SOCK_SEQPACKET socket.
#[derive(Debug)]
pub struct SeqPacket {
    fd: AsyncFd<Socket>,
    path: PathBuf,
}

/// A listening SOCK_SEQPACKET socket.
#[derive(Debug)]
pub struct SeqPacketListener {
    fd: AsyncFd<Socket>,
    path: PathBuf,
}

/// Binds and listens at `path`. The caller removes a stale file first and sets the mode.
pub fn listen(path: &Path) -> Result<SeqPacketListener, PacketError> {
    let sock = Socket::new(Domain::UNIX, Type::SEQPACKET, None).map_err(io_err(path, "socket"))?;
    sock.bind(&SockAddr::unix(path).map_err(io_err(path, "address"))?)
        .map_err(io_err(path, "bind"))?;
    sock.listen(BACKLOG).map_err(io_err(path, "listen"))?;
    Ok(SeqPacketListener {
        fd: register(sock).map_err(io_err(path, "register"))?,
        path: path.to_owned(),
    })
}

/// Connects to the listener at `path` (non-blocking; a full backlog is an error to retry).
pub fn connect(path: &Path) -> Result<SeqPacket, PacketError> {
    let sock = Socket::new(Domain::UNIX, Type::SEQPACKET, None).map_err(io_err(path, "socket"))?;
    sock.set_nonblocking(true)
        .map_err(io_err(path, "nonblocking"))?;
    sock.connect(&SockAddr::unix(path).map_err(io_err(path, "address"))?)
        .map_err(io_err(path, "connect"))?;
    SeqPacket::new(sock, path)
}

/// A connected pair (tests).
pub fn pair() -> Result<(SeqPacket, SeqPacket), PacketError> {
    let path = Path::new("<pair>");
    let (a, b) = Socket::pair(Domain::UNIX, Type::SEQPACKET, None).map_err(io_err(path, "pair"))?;
    Ok((SeqPacket::new(a, path)?, SeqPacket::new(b, path)?))
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> PacketError {
    let path = path.to_owned();
    move |source| PacketError::Io { path, op, source }
}

/// Registers a socket with the tokio reactor (read and write interest).
#[allow(unsafe_code)]
fn register(sock: Socket) -> io::Result<AsyncFd<Socket>> {
    sock.set_nonblocking(true)?;
    // SAFETY: `Socket` owns its fd and is moved into the `AsyncFd`, so the fd stays open and refers to
    // the same socket until the `AsyncFd` is dropped; `as_raw_fd` always returns that fd.
    unsafe { AsyncFd::register_with_interest(sock, Interest::READABLE | Interest::WRITABLE) }
        .map_err(io::Error::from)
}

/// Takes ownership of an fd the kernel just installed for us through SCM_RIGHTS.
#[allow(unsafe_code)]
fn own_received_fd(fd: RawFd) -> OwnedFd {
    // SAFETY: `recvmsg` returned this fd in an SCM_RIGHTS control message: the kernel installed it in
    // our fd table for this call only, so it is open and nothing else in the process owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

// === impl SeqPacketListener ===

impl SeqPacketListener {
    /// Accepts the next connection.
    pub async fn accept(&self) -> Result<SeqPacket, PacketError> {
        loop {
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(io_err(&self.path, "accept"))?;
            match guard.try_io(|s| s.get_ref().accept()) {
                Ok(Ok((sock, _))) => return SeqPacket::new(sock, &self.path),
                Ok(Err(e)) => return Err(io_err(&self.path, "accept")(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

// === impl SeqPacket ===

impl SeqPacket {
    fn new(sock: Socket, path: &Path) -> Result<SeqPacket, PacketError> {
        Ok(SeqPacket {
            fd: register(sock).map_err(io_err(path, "register"))?,
            path: path.to_owned(),
        })
    }

    /// Encodes `msg` into one datagram, with `fd` attached as SCM_RIGHTS when given.
    pub async fn send(
        &self,
        msg: &impl prost::Message,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), PacketError> {
        let bytes = msg.encode_to_vec();
        if bytes.len() > MAX_MESSAGE {
            return Err(PacketError::TooLarge { len: bytes.len() });
        }
        self.send_bytes(&bytes, fd).await
    }

    /// Sends `bytes` as one datagram (no size check; tests use it to send oversized messages).
    pub async fn send_bytes(
        &self,
        bytes: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), PacketError> {
        let fds: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
        let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
            Vec::new()
        } else {
            vec![ControlMessage::ScmRights(&fds)]
        };
        let iov = [IoSlice::new(bytes)];
        loop {
            let mut guard = self
                .fd
                .writable()
                .await
                .map_err(io_err(&self.path, "sendmsg"))?;
            let sent = guard.try_io(|s| {
                sendmsg::<()>(s.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(io::Error::from)
            });
            match sent {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => return Err(io_err(&self.path, "sendmsg")(e)),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one datagram; `Ok(None)` when the peer closed the connection.
    ///
    /// Cancel safe: a datagram is only consumed by the final, synchronous `recvmsg`.
    pub async fn recv(&self) -> Result<Option<Packet>, PacketError> {
        loop {
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(io_err(&self.path, "recvmsg"))?;
            match guard.try_io(|s| recv_now(s.as_raw_fd())) {
                Ok(Ok(r)) => return r,
                Ok(Err(e)) => return Err(io_err(&self.path, "recvmsg")(e)),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives and decodes one message of type `M` (without fds); `what` names it in errors.
    /// The peer closing the connection is [`PacketError::Closed`].
    pub async fn recv_msg<M: prost::Message + Default>(
        &self,
        what: &'static str,
    ) -> Result<M, PacketError> {
        let pkt = self.recv().await?.ok_or(PacketError::Closed)?;
        M::decode(pkt.data.as_slice()).map_err(|source| PacketError::Decode { what, source })
    }
}

/// One `recvmsg` into a [`MAX_MESSAGE`] buffer with room for one fd. Socket errors (including
/// `WouldBlock`, for `try_io`) are the outer error, framing errors the inner one.
fn recv_now(fd: RawFd) -> io::Result<Result<Option<Packet>, PacketError>> {
    let mut buf = [0u8; MAX_MESSAGE];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let (len, flags) = (msg.bytes, msg.flags);
    // nix refuses to walk a truncated control buffer, so on MSG_CTRUNC the fds that did fit cannot
    // be reclaimed here (they are close-on-exec); the agent peer is root-only and sends one fd.
    let mut fds = Vec::new();
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(raw) = c {
                fds.extend(raw.into_iter().map(own_received_fd));
            }
        }
    }
    if flags.contains(MsgFlags::MSG_TRUNC) {
        return Ok(Err(PacketError::Truncated));
    }
    if flags.contains(MsgFlags::MSG_CTRUNC) {
        return Ok(Err(PacketError::ControlTruncated));
    }
    if len == 0 && fds.is_empty() {
        return Ok(Ok(None));
    }
    Ok(Ok(Some(Packet {
        data: buf[..len].to_vec(),
        fds,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zds::proto::{DelWorkload, ZdsHello};

    #[tokio::test]
    async fn one_message_per_datagram_with_fd() {
        let (a, b) = pair().expect("pair");
        let ns = crate::netns::Netns::current().expect("own netns");
        a.send(&ZdsHello { version: 1 }, None).await.expect("send");
        a.send(&DelWorkload { uid: "x".into() }, Some(ns.fd()))
            .await
            .expect("send with fd");
        let hello: ZdsHello = b.recv_msg("hello").await.expect("hello");
        assert_eq!(hello.version, 1);
        let pkt = b.recv().await.expect("recv").expect("not closed");
        assert_eq!(pkt.data, [0x12, 0x01, b'x']);
        assert_eq!(pkt.fds.len(), 1);
        let got = crate::netns::Netns::from_file(std::fs::File::from(
            pkt.fds.into_iter().next().expect("fd"),
        ))
        .expect("netns from fd");
        assert_eq!(got.id(), ns.id());
    }

    #[tokio::test]
    async fn oversized_messages_are_errors_on_both_sides() {
        let (a, b) = pair().expect("pair");
        let big = DelWorkload {
            uid: "u".repeat(MAX_MESSAGE),
        };
        let err = a.send(&big, None).await.expect_err("too large");
        assert!(matches!(err, PacketError::TooLarge { .. }), "{err}");
        a.send_bytes(&[7u8; MAX_MESSAGE + 1], None)
            .await
            .expect("raw send");
        let err = b.recv().await.expect_err("truncated");
        assert!(matches!(err, PacketError::Truncated), "{err}");
        a.send_bytes(&[7u8; MAX_MESSAGE], None)
            .await
            .expect("raw send");
        let pkt = b.recv().await.expect("exactly 1024 fits").expect("open");
        assert_eq!(pkt.data.len(), MAX_MESSAGE);
    }

    #[tokio::test]
    async fn peer_close_is_none_and_closed() {
        let (a, b) = pair().expect("pair");
        drop(a);
        assert!(b.recv().await.expect("recv").is_none());
        let err = b.recv_msg::<ZdsHello>("hello").await.expect_err("closed");
        assert!(matches!(err, PacketError::Closed), "{err}");
    }
}
