//! The `NETLINK_NETFILTER` socket: opened in the calling thread's network namespace, bound to a
//! kernel-assigned port id, with a receive timeout so a lost reply cannot hang the caller.

use std::os::fd::{AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, sendto,
    setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;

use super::NftError;

/// How long to wait for each reply datagram before giving up, in seconds.
const RECV_TIMEOUT_SECS: i64 = 5;
/// Receive buffer for one datagram; replies are acks carrying at most one of our requests.
pub(crate) const RECV_BUF_LEN: usize = 64 * 1024;

/// An open `NETLINK_NETFILTER` socket.
pub(crate) struct NfSocket {
    fd: OwnedFd,
}

impl NfSocket {
    /// Opens and binds the socket in the current thread's network namespace.
    pub(crate) fn open() -> Result<NfSocket, NftError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(|source| NftError::Socket {
            op: "socket",
            source,
        })?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))
            .map_err(|source| NftError::Socket { op: "bind", source })?;
        let tv = TimeVal::new(RECV_TIMEOUT_SECS, 0);
        setsockopt(&fd, sockopt::ReceiveTimeout, &tv).map_err(|source| NftError::Socket {
            op: "setsockopt SO_RCVTIMEO",
            source,
        })?;
        Ok(NfSocket { fd })
    }

    /// Sends `buf` (one or more messages) to the kernel in one datagram.
    pub(crate) fn send(&self, buf: &[u8]) -> Result<(), NftError> {
        let kernel = NetlinkAddr::new(0, 0);
        loop {
            match sendto(self.fd.as_raw_fd(), buf, &kernel, MsgFlags::empty()) {
                Ok(n) if n == buf.len() => return Ok(()),
                Ok(_) => {
                    return Err(NftError::Send {
                        source: Errno::EMSGSIZE,
                    });
                }
                Err(Errno::EINTR) => continue,
                Err(source) => return Err(NftError::Send { source }),
            }
        }
    }

    /// Receives one datagram into `buf`. `Ok(None)` means the receive timeout expired.
    pub(crate) fn recv(&self, buf: &mut [u8]) -> Result<Option<usize>, NftError> {
        loop {
            match recv(self.fd.as_raw_fd(), buf, MsgFlags::empty()) {
                Ok(n) => return Ok(Some(n)),
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Ok(None),
                Err(source) => return Err(NftError::Recv { source }),
            }
        }
    }
}
