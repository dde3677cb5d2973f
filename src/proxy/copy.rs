//! Byte copying between a pod's TCP connection and an HBONE stream (or another TCP connection).
//!
//! Both directions run until each side has finished; EOF is propagated as a half-close (TCP
//! `shutdown(Write)` / HTTP/2 END_STREAM), an error or a stream reset on either side ends both.
//! Read buffers follow the traffic: a read that fills its buffer makes the next one 4× larger (up
//! to 1 MiB, so one read moves many TLS records and HTTP/2 DATA frames), a read of less than 16 KiB
//! goes back to 16 KiB (so request/response traffic does not allocate 1 MiB per message). Received
//! HTTP/2 data is written out without a copy. An app's FIN found right after a short read goes out
//! as END_STREAM on that read's last DATA frame (RFC 9113 §6.1), not in an empty frame of its
//! own.
//!
//! Bytes are counted as they are handed on (written to the socket, or given to h2 for the stream),
//! as ztunnel's `src/copy.rs` counts each write (`increment_send`/`increment_recv` after every
//! `poll_write_buf`): a relay that ends with an error still reports what it moved
//! ([`CopyError::transferred`]), for the access log and the byte counters. (ztunnel's counters
//! also move while the connection lives; ztnode's are added when it ends.)

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Smallest (and first) read buffer, bytes.
const SMALL_BUF: usize = 16 * 1024;
/// Largest read buffer, bytes.
const LARGE_BUF: usize = 1024 * 1024;

/// The read size of one copy direction, adapted to how full the previous reads came back. A
/// `u32` (sizes stay within [`LARGE_BUF`]): with the flags next to it, it keeps every relay, and
/// so every relaying task, 8 bytes smaller than a `usize` would (see [`crate::proxy::task`]).
#[derive(Debug, Clone, Copy)]
struct ReadSize(u32);

const _: () = assert!(LARGE_BUF <= u32::MAX as usize);

impl ReadSize {
    fn new() -> Self {
        ReadSize(SMALL_BUF as u32)
    }

    /// The size of the next read, bytes.
    fn get(self) -> usize {
        self.0 as usize
    }

    /// Adjusts after a read of `n` bytes into a buffer of `cap` bytes.
    fn update(&mut self, n: usize, cap: usize) {
        if n >= cap {
            self.0 = (self.0 * 4).min(LARGE_BUF as u32);
        } else if n < SMALL_BUF {
            self.0 = SMALL_BUF as u32;
        }
    }
}

/// Bytes moved by a finished relay.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Transferred {
    /// From the local (pod-side) TCP connection towards the peer.
    pub sent: u64,
    /// From the peer towards the local TCP connection.
    pub received: u64,
}

/// A relay that ended with an error, and what it had moved until then.
#[derive(Debug, thiserror::Error)]
#[error(
    "relay failed after {} bytes sent and {} received",
    .transferred.sent,
    .transferred.received
)]
pub struct CopyError {
    /// What ended the relay (the first error of either direction).
    #[source]
    pub error: io::Error,
    /// Bytes both directions had moved when it did.
    pub transferred: Transferred,
}

fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 io error"))
    } else {
        io::Error::other(e)
    }
}

/// Whether an h2 error on read means a clean end (RST_STREAM NO_ERROR or CANCEL).
fn is_clean_reset(e: &h2::Error) -> bool {
    matches!(
        e.reason(),
        Some(h2::Reason::NO_ERROR) | Some(h2::Reason::CANCEL)
    )
}

/// Reads the next chunk of `reader` as [`poll_read_chunk`] does. `None` at EOF.
async fn read_chunk<R: ReadReady>(
    reader: &mut R,
    size: &mut ReadSize,
) -> io::Result<Option<BytesMut>> {
    std::future::poll_fn(|cx| poll_read_chunk(reader, size, cx)).await
}

/// Copies `reader` into `writer` until EOF, then half-closes `writer`; buffers only while data
/// flows. Every byte written is added to `total` as it goes, so it holds the count also when an
/// error ends the copy.
///
/// After a bulk read (at least [`SMALL_BUF`], the size below which [`ReadSize`] falls back) the
/// copy yields once it has written it: with one IO event per driver turn
/// ([`crate::runtime::MAX_IO_EVENTS_PER_TICK`]) the other worker only joins when a turn leaves two
/// tasks runnable, and plain relays, unlike HBONE's tasks, wake no other task. The yield makes
/// such a turn, so bulk passthrough keeps both workers busy; smaller reads (requests, responses)
/// never yield.
async fn tcp_to_tcp(
    mut reader: OwnedReadHalf,
    mut writer: OwnedWriteHalf,
    total: &AtomicU64,
) -> io::Result<()> {
    let mut size = ReadSize::new();
    while let Some(buf) = read_chunk(&mut reader, &mut size).await? {
        let bulk = buf.len() >= SMALL_BUF;
        let mut rest = &buf[..];
        while !rest.is_empty() {
            let n = writer.write(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            total.fetch_add(n as u64, Ordering::Relaxed);
            rest = &rest[n..];
        }
        if bulk {
            tokio::task::yield_now().await;
        }
    }
    writer.shutdown().await
}

/// The bytes the app has already sent on `tcp`, read without waiting (at most one small read,
/// [`SMALL_BUF`]): what an outbound connection sends with its CONNECT as early data. `None` when
/// nothing is there yet (a server-first protocol) or at EOF (a FIN stays readable: the relay
/// finds it again).
///
/// A read shorter than the buffer drained the socket: it then leaves no readiness behind (as
/// tokio's `AsyncRead::poll_read` after a short read), so the relay's first read waits for epoll
/// instead of trying a `recv` that would only say EAGAIN.
///
/// Errors: the socket's error (e.g. the app reset it). The kernel reports it once, so the caller
/// must end the connection on it rather than leave it to the relay.
pub fn early_data(tcp: &TcpStream) -> io::Result<Option<Bytes>> {
    EARLY_BUF.with_borrow_mut(|buf| early_data_into(tcp, buf))
}

thread_local! {
    /// [`early_data`]'s read buffer, one per thread: zeroed once, where a buffer on the stack
    /// would have 16 KiB zeroed for every connection that reads early data.
    static EARLY_BUF: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; SMALL_BUF].into_boxed_slice());
}

/// [`early_data`] reading through `buf` (non-empty: an empty one reads nothing). The bytes read
/// are copied out, so `buf` is free again on return.
fn early_data_into(tcp: &TcpStream, buf: &mut [u8]) -> io::Result<Option<Bytes>> {
    use std::io::Read;
    let mut short = 0;
    let sock = socket2::SockRef::from(tcp);
    // WouldBlock from the closure is what makes tokio clear the readiness; the bytes of that
    // short read are kept in `short`.
    let read = tcp.try_io(tokio::io::Interest::READABLE, || {
        let n = (&*sock).read(buf)?;
        if n > 0 && n < buf.len() {
            short = n;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match read {
        Ok(0) => Ok(None),
        Ok(n) => Ok(Some(Bytes::copy_from_slice(&buf[..n]))),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock && short > 0 => {
            Ok(Some(Bytes::copy_from_slice(&buf[..short])))
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// Relays between a TCP connection and an HBONE stream in both directions (see module docs).
pub fn relay_h2(tcp: TcpStream, send: SendStream<Bytes>, recv: RecvStream) -> H2Relay {
    H2Relay {
        tcp,
        send,
        recv,
        up: Up {
            pending: None,
            size: ReadSize::new(),
            total: 0,
            short: false,
            done: false,
        },
        down: Down {
            pending: None,
            total: 0,
            eof: false,
            done: false,
        },
    }
}

/// The future of [`relay_h2`]: both copy directions in one small state machine (an idle relay is
/// a few hundred bytes, no buffers). Resolves when both directions finished, or with the first
/// error, which ends both (with the bytes moved until then).
#[derive(Debug)]
pub struct H2Relay {
    tcp: TcpStream,
    send: SendStream<Bytes>,
    recv: RecvStream,
    up: Up,
    down: Down,
}

/// TCP → HTTP/2 state.
#[derive(Debug)]
struct Up {
    /// Read but not yet handed to h2 (waiting for send capacity).
    pending: Option<Bytes>,
    size: ReadSize,
    /// Bytes handed to h2.
    total: u64,
    /// The last read returned less than its buffer held.
    short: bool,
    /// END_STREAM sent.
    done: bool,
}

impl Up {
    /// Notes whether a read chunk was short; returns it ready to send.
    fn take(&mut self, buf: BytesMut) -> Bytes {
        self.short = buf.len() < buf.capacity();
        buf.freeze()
    }
}

/// HTTP/2 → TCP state.
#[derive(Debug)]
struct Down {
    /// Received but not yet written to the socket.
    pending: Option<Bytes>,
    /// Bytes written to the socket.
    total: u64,
    /// The stream ended; the socket's write side is still to be ended (a `shutdown`, or the
    /// close when the read side has ended too).
    eof: bool,
    /// Write side shut down, or left to the socket's close when the read side had ended too.
    done: bool,
}

impl Future for H2Relay {
    type Output = Result<Transferred, CopyError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        // Pending from one direction only means it waits; the other one still gets polled.
        if !this.up.done
            && let Poll::Ready(Err(error)) = this.poll_up(cx)
        {
            return Poll::Ready(Err(this.failed(error)));
        }
        if !this.down.done
            && let Poll::Ready(Err(error)) = this.poll_down(cx)
        {
            return Poll::Ready(Err(this.failed(error)));
        }
        if this.up.done && this.down.done {
            Poll::Ready(Ok(this.transferred()))
        } else {
            Poll::Pending
        }
    }
}

impl H2Relay {
    /// The relay of a stream whose first `n` bytes from the TCP side were already handed to h2
    /// (early data sent with the CONNECT): counted as sent.
    pub fn with_sent(mut self, n: u64) -> Self {
        self.up.total = n;
        self
    }

    /// Bytes moved in each direction so far.
    pub fn transferred(&self) -> Transferred {
        Transferred {
            sent: self.up.total,
            received: self.down.total,
        }
    }

    /// `error` ending the relay, with the bytes moved until then.
    fn failed(&self, error: io::Error) -> CopyError {
        CopyError {
            error,
            transferred: self.transferred(),
        }
    }

    /// Moves TCP data into the HBONE stream until it would block, EOF (END_STREAM) or an error.
    fn poll_up(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let Some(chunk) = self.up.pending.as_mut() else {
                match ready!(poll_read_chunk(&mut self.tcp, &mut self.up.size, cx))? {
                    Some(buf) => self.up.pending = Some(self.up.take(buf)),
                    None => {
                        self.send.send_data(Bytes::new(), true).map_err(h2_io)?;
                        self.up.done = true;
                        return Poll::Ready(Ok(()));
                    }
                }
                continue;
            };
            self.send.reserve_capacity(chunk.len());
            let cap = self.send.capacity();
            if cap == 0 {
                match ready!(self.send.poll_capacity(cx)) {
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => return Poll::Ready(Err(h2_io(e))),
                    None => {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::BrokenPipe,
                            "HBONE stream closed",
                        )));
                    }
                }
            }
            let part = chunk.split_to(cap.min(chunk.len()));
            let n = part.len() as u64;
            if !chunk.is_empty() {
                self.send.send_data(part, false).map_err(h2_io)?;
                self.up.total += n;
                continue;
            }
            self.up.pending = None;
            // The last part of a short read: if the app already closed its side, that FIN goes
            // out as END_STREAM on this DATA frame instead of in an empty frame (often one TLS
            // record and one send fewer for a request or response followed by close).
            match self.poll_fin_after_short_read(cx) {
                Ok(end) => {
                    self.send.send_data(part, end).map_err(h2_io)?;
                    self.up.total += n;
                    if end {
                        self.up.done = true;
                        return Poll::Ready(Ok(()));
                    }
                }
                Err(e) => {
                    // Deliver what was read; the error ends the relay.
                    if self.send.send_data(part, false).is_ok() {
                        self.up.total += n;
                    }
                    return Poll::Ready(Err(e));
                }
            }
        }
    }

    /// After a short read, whether the socket's read side has reached EOF. The short read cleared
    /// the socket's readable state, so only a closed read side (kept by tokio) or data that came
    /// meanwhile makes it ready: then one more read tells which (that data becomes the next
    /// pending chunk). No syscall otherwise.
    fn poll_fin_after_short_read(&mut self, cx: &mut Context<'_>) -> io::Result<bool> {
        if !self.up.short {
            return Ok(false);
        }
        match poll_read_chunk(&mut self.tcp, &mut self.up.size, cx) {
            Poll::Ready(Ok(None)) => Ok(true),
            Poll::Ready(Ok(Some(buf))) => {
                self.up.pending = Some(self.up.take(buf));
                Ok(false)
            }
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => Ok(false),
        }
    }

    /// Moves HBONE data into the TCP socket until it would block, the stream's end (then the
    /// write side is shut down) or an error.
    fn poll_down(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if let Some(chunk) = self.down.pending.as_mut() {
                let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, chunk))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.down.total += n as u64;
                chunk.advance(n);
                if chunk.is_empty() {
                    self.down.pending = None;
                }
                continue;
            }
            if self.down.eof {
                // With the app's side already ended too, the relay is over and the socket's
                // close, when the relay's task drops it (after its access log line), sends the
                // FIN: no `shutdown` right before that `close`. The read side is at EOF, so no
                // unread data turns the close into a reset.
                if !self.up.done {
                    ready!(Pin::new(&mut self.tcp).poll_shutdown(cx))?;
                }
                self.down.done = true;
                return Poll::Ready(Ok(()));
            }
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    // Released before the write (as ztunnel does) so the peer keeps sending while
                    // we write; at most one more window is buffered while the app is slow.
                    self.recv
                        .flow_control()
                        .release_capacity(chunk.len())
                        .map_err(h2_io)?;
                    // An empty DATA frame (e.g. a bare END_STREAM) has nothing to write.
                    if !chunk.is_empty() {
                        self.down.pending = Some(chunk);
                    }
                }
                Some(Err(e)) if is_clean_reset(&e) => self.down.eof = true,
                Some(Err(e)) => return Poll::Ready(Err(h2_io(e))),
                None => self.down.eof = true,
            }
        }
    }
}

/// A TCP read side whose readiness can be awaited without a buffer.
trait ReadReady: AsyncRead + Unpin {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

impl ReadReady for TcpStream {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        TcpStream::poll_read_ready(self, cx)
    }
}

impl ReadReady for OwnedReadHalf {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.as_ref().poll_read_ready(cx)
    }
}

/// Waits until `reader` is readable, then reads into a fresh buffer of the direction's current
/// [`ReadSize`] (updated here). `None` at EOF. The buffer exists only while data flows: on stale
/// readiness `poll_read` clears it, registers the waker and the buffer is dropped. Waiting for
/// readiness spends tokio's cooperative budget, so a spent budget yields instead of spinning.
///
/// The read goes through `AsyncRead::poll_read`, which clears the socket's readiness when it
/// returns less than asked: the next call then waits for epoll instead of trying a `recv` that
/// would only say EAGAIN.
fn poll_read_chunk<R: ReadReady>(
    reader: &mut R,
    size: &mut ReadSize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<Option<BytesMut>>> {
    ready!(reader.poll_read_ready(cx))?;
    let mut buf = BytesMut::with_capacity(size.get());
    let cap = buf.capacity();
    let n = ready!(tokio_util::io::poll_read_buf(
        Pin::new(&mut *reader),
        cx,
        &mut buf
    ))?;
    if n == 0 {
        return Poll::Ready(Ok(None));
    }
    size.update(n, cap);
    Poll::Ready(Ok(Some(buf)))
}

/// Relays between two TCP connections (plain passthrough), half-close propagated; the first error
/// of either direction ends both, with the bytes moved until then.
pub async fn relay_tcp(local: TcpStream, remote: TcpStream) -> Result<Transferred, CopyError> {
    relay_tcp_counted(local, remote, &LiveCounts::default()).await
}

/// Byte counts of a running relay, readable while it runs.
#[derive(Debug, Default)]
pub struct LiveCounts {
    sent: AtomicU64,
    received: AtomicU64,
}

impl LiveCounts {
    /// The bytes moved until now.
    pub fn get(&self) -> Transferred {
        Transferred {
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
        }
    }
}

/// [`relay_tcp`] counting into `counts` as it goes.
async fn relay_tcp_counted(
    local: TcpStream,
    remote: TcpStream,
    counts: &LiveCounts,
) -> Result<Transferred, CopyError> {
    let (lr, lw) = local.into_split();
    let (rr, rw) = remote.into_split();
    let res = tokio::try_join!(
        tcp_to_tcp(lr, rw, &counts.sent),
        tcp_to_tcp(rr, lw, &counts.received)
    );
    match res {
        Ok(((), ())) => Ok(counts.get()),
        Err(error) => Err(CopyError {
            error,
            transferred: counts.get(),
        }),
    }
}

/// A [`relay_tcp`] (boxed) that tells the bytes it has moved while it runs
/// ([`TcpRelay::so_far`]): what a connection closed from outside (a revoked policy) reports.
pub struct TcpRelay {
    relay: Pin<Box<dyn Future<Output = Result<Transferred, CopyError>> + Send>>,
    counts: Arc<LiveCounts>,
}

impl TcpRelay {
    /// Relays `local` ↔ `remote` as [`relay_tcp`].
    pub fn new(local: TcpStream, remote: TcpStream) -> TcpRelay {
        let counts = Arc::new(LiveCounts::default());
        let shared = counts.clone();
        TcpRelay {
            relay: Box::pin(async move { relay_tcp_counted(local, remote, &shared).await }),
            counts,
        }
    }

    /// The bytes moved until now.
    pub fn so_far(&self) -> Transferred {
        self.counts.get()
    }
}

impl Future for TcpRelay {
    type Output = Result<Transferred, CopyError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.relay.as_mut().poll(cx)
    }
}

#[cfg(test)]
#[path = "copy_tests.rs"]
mod tests;
