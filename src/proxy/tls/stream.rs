//! The HBONE mTLS byte stream. rustls runs the TLS 1.3 handshake through its unbuffered API
//! (`tls/handshake.rs`) and then hands over the traffic keys (`rustls::kernel`); [`TlsStream`]
//! protects the records itself with the record layer (`super::record`), in its own buffers.
//!
//! Why not rustls' buffered stream: it reads the socket 4 KiB at a time and copies every received
//! record twice (into its plaintext queue, then out to the reader) plus allocates per record.
//! Here a read with room (h2 reserves a whole frame) goes straight into the caller's buffer and
//! its records are decrypted there, the plaintext compacted as it is decrypted: no copy; smaller
//! reads go through a receive buffer and are copied once. A sent record is built in one copy and
//! many go out per `write`.
//!
//! rustls keeps what it is good at: the handshake, certificate verification and the key schedule
//! for KeyUpdate (RFC 8446 §4.6.3). This stream follows the peer's KeyUpdates, answers a burst of
//! requests with one update, refuses more than 32 records without data in a row, and updates its
//! own send key before the cipher suite's confidentiality limit. A record that fails
//! (authentication, length, type) gets the fatal alert RFC 8446 §6.2 names, and nothing more is
//! sent.

use std::io::{self, IoSlice};
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, BytesMut};
use rustls::ExtractedSecrets;
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::kernel::Kernel;
use super::message::{self, Alert, CLOSE_NOTIFY, KEY_UPDATE, MAX_POST_HANDSHAKE, PostHandshake};
use super::record::{self, RecordError, RecordKey, content};

/// Target size of the receive buffer: several records per `read`.
const READ_BUFFER: usize = 64 * 1024;
/// Free room in the caller's buffer from which a read goes there directly
/// ([`TlsStream::poll_read_direct`]) instead of through the receive buffer.
const DIRECT_READ_MIN: usize = 32 * 1024;
/// Plaintext per batch of sealed records (16 full records; a write whose rest would be less than
/// a record more goes in whole, so its tail does not follow in a record and a send of its own).
/// One batch is in flight while the next is sealed, so about twice this is buffered per
/// connection; a writer waits when both are full.
const WRITE_QUEUE: usize = 256 * 1024;
/// Bytes a sealed record adds to its plaintext: header, content type, AEAD tag.
const RECORD_OVERHEAD: usize = record::HEADER_LEN + 1 + 16;
/// Plaintext a stream delivers since a read last returned `Pending` (its socket ran dry, or
/// tokio's task budget ran out) before it yields once: the next read wakes the task and returns
/// `Pending`. In a multi-thread tokio runtime the task then goes to the back of its worker's run
/// queue, where an idle worker may take it, while the relay task that h2 woke with the decoded
/// data (in the worker's LIFO slot, which no other worker takes) writes it to the app: decrypting
/// and writing out proceed on both CPUs instead of in turn. About one HTTP/2 DATA frame of ours
/// (`hbone::FRAME_SIZE`); small request/response exchanges do not reach it.
const READ_YIELD_AFTER: usize = 1024 * 1024;
/// Records without application data (KeyUpdate, NewSessionTicket, user_canceled, empty data) a
/// peer may send in a row; rustls and BoringSSL have similar limits.
const MAX_EMPTY_RECORDS_IN_A_ROW: u8 = 32;
/// Alert descriptions (RFC 8446 §6).
const UNEXPECTED_MESSAGE: u8 = 10;
const BAD_RECORD_MAC: u8 = 20;
const RECORD_OVERFLOW: u8 = 22;
const ILLEGAL_PARAMETER: u8 = 47;
const DECODE_ERROR: u8 = 50;
const INTERNAL_ERROR: u8 = 80;

/// The fatal alert a read failing with `e` sends (RFC 8446 §5.2, §6.2): none for socket errors,
/// a peer that closed or the peer's own alert.
fn fatal_alert(e: &StreamError) -> Option<u8> {
    match e {
        StreamError::Record(RecordError::BadMac) => Some(BAD_RECORD_MAC),
        StreamError::Record(RecordError::Overflow(_)) => Some(RECORD_OVERFLOW),
        StreamError::Record(RecordError::OuterType(_) | RecordError::NoContentType)
        | StreamError::Unexpected(_)
        | StreamError::HandshakeTooLarge(_) => Some(UNEXPECTED_MESSAGE),
        StreamError::Malformed(_) => Some(DECODE_ERROR),
        StreamError::IllegalParameter(_) => Some(ILLEGAL_PARAMETER),
        StreamError::Record(
            RecordError::SeqExhausted | RecordError::BadKey | RecordError::UnsupportedSuite,
        )
        | StreamError::Tls(_) => Some(INTERNAL_ERROR),
        StreamError::Io(_)
        | StreamError::ClosedInHandshake
        | StreamError::Alert(_)
        | StreamError::Unsupported(_) => None,
    }
}

/// Errors of the handshake and of the record stream. Read and write errors reach the caller as
/// `io::Error`s: socket errors as they are, a peer that closed without close_notify as
/// `UnexpectedEof`, the rest as `InvalidData` wrapping these.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// rustls rejected the handshake (certificate, protocol or alert).
    #[error("{0}")]
    Tls(#[from] rustls::Error),
    /// Record protection failed.
    #[error("{0}")]
    Record(#[from] RecordError),
    /// The peer closed the connection before the handshake completed.
    #[error("peer closed the connection during the TLS handshake")]
    ClosedInHandshake,
    /// The peer sent more than a handshake flight may hold.
    #[error("TLS handshake data over {0} bytes")]
    HandshakeTooLarge(usize),
    /// A record or handshake message that is not allowed after the handshake.
    #[error("unexpected TLS message: {0}")]
    Unexpected(&'static str),
    /// A message that does not parse (`decode_error`).
    #[error("malformed TLS message: {0}")]
    Malformed(&'static str),
    /// A field with a value the protocol does not allow (`illegal_parameter`).
    #[error("illegal TLS parameter: {0}")]
    IllegalParameter(&'static str),
    /// The config or the negotiated protocol is one this stream does not run.
    #[error("TLS stream needs {0}")]
    Unsupported(&'static str),
    /// The peer sent a fatal alert.
    #[error("peer sent TLS alert {0}")]
    Alert(u8),
}

impl From<StreamError> for io::Error {
    fn from(e: StreamError) -> io::Error {
        match e {
            StreamError::Io(e) => e,
            other => io::Error::new(io::ErrorKind::InvalidData, other),
        }
    }
}

/// A TLS 1.3 connection after its handshake: `AsyncRead`/`AsyncWrite` of the application data.
///
/// Reads of at least 32 KiB of room decrypt in the caller's buffer; smaller ones decrypt whole
/// records in the receive buffer (64 KiB, released while the socket is idle) and copy their
/// plaintext out. After 1 MiB delivered without a `Pending` a read yields to the scheduler once
/// (`READ_YIELD_AFTER`). Writes seal up to 16 KiB per record into batches of up to
/// 256 KiB of plaintext, one being sent while the next fills (both released once sent).
/// `poll_shutdown` sends close_notify. A peer's NewSessionTicket is ignored (resumption is off),
/// KeyUpdate is followed (and answered when requested, except after our close_notify), alerts
/// other than close_notify and user_canceled end the stream.
///
/// One task must drive both directions (as h2 does): a read may send a queued KeyUpdate answer
/// and so registers the read's waker for write readiness.
pub struct TlsStream<IO> {
    io: IO,
    kernel: Kernel,
    rx: RecordKey,
    tx: RecordKey,
    /// Sequence number at which the send key is updated (confidentiality limit).
    tx_rekey_at: u64,
    /// Received bytes; `[..rpos]` is consumed or holds `plain`.
    rbuf: BytesMut,
    rpos: usize,
    /// Decrypted plaintext in `rbuf` not yet read.
    plain: Range<usize>,
    /// A post-handshake message split over records.
    handshake: Vec<u8>,
    /// Sealed records being sent; `[..wpos]` already sent.
    wbuf: Vec<u8>,
    wpos: usize,
    /// Records sealed while `wbuf` is in flight (double buffering: the next batch is encrypted
    /// while the socket drains the previous one).
    wnext: Vec<u8>,
    read_closed: bool,
    close_sent: bool,
    /// A KeyUpdate request was answered and no application data was sent since: further
    /// requests need no answer of their own. RFC 8446 §4.6.3 asks for one answer to requests
    /// that arrive while we send nothing; our answer's key has protected no data yet either.
    answered: bool,
    /// Records without application data received in a row.
    empty_in_a_row: u8,
    /// NewSessionTickets received (and ignored).
    tickets: u32,
    /// Key updates of the receive and the send direction.
    rx_updates: u32,
    tx_updates: u32,
    /// Reads that went straight into the caller's buffer ([`TlsStream::poll_read_direct`]).
    direct_reads: u64,
    /// A read error, returned again on later reads.
    read_failed: Option<(io::ErrorKind, String)>,
    /// Plaintext delivered since a read last returned `Pending` ([`READ_YIELD_AFTER`]).
    read_streak: usize,
    /// Reads that yielded after a long streak (tests).
    read_yields: u64,
    peer_certificates: Option<Vec<CertificateDer<'static>>>,
    alpn: Option<Vec<u8>>,
}

impl<IO> std::fmt::Debug for TlsStream<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream")
            .field("rx", &self.rx)
            .field("tx", &self.tx)
            .field("rx_updates", &self.rx_updates)
            .field("tx_updates", &self.tx_updates)
            .field("direct_reads", &self.direct_reads)
            .field("read_yields", &self.read_yields)
            .field("read_closed", &self.read_closed)
            .field("close_sent", &self.close_sent)
            .finish_non_exhaustive()
    }
}

impl<IO> TlsStream<IO> {
    pub(super) fn new(
        io: IO,
        kernel: Kernel,
        secrets: ExtractedSecrets,
        rbuf: BytesMut,
        peer_certificates: Option<Vec<CertificateDer<'static>>>,
        alpn: Option<Vec<u8>>,
    ) -> Result<TlsStream<IO>, StreamError> {
        let ExtractedSecrets {
            tx: (tx_seq, tx),
            rx: (rx_seq, rx),
        } = secrets;
        let tx_rekey_at = kernel.confidentiality_limit().saturating_sub(1);
        Ok(TlsStream {
            io,
            kernel,
            rx: RecordKey::new(rx_seq, rx)?,
            tx: RecordKey::new(tx_seq, tx)?,
            tx_rekey_at,
            rbuf,
            rpos: 0,
            plain: 0..0,
            handshake: Vec::new(),
            wbuf: Vec::new(),
            wpos: 0,
            wnext: Vec::new(),
            read_closed: false,
            close_sent: false,
            answered: false,
            empty_in_a_row: 0,
            tickets: 0,
            rx_updates: 0,
            tx_updates: 0,
            direct_reads: 0,
            read_failed: None,
            read_streak: 0,
            read_yields: 0,
            peer_certificates,
            alpn,
        })
    }

    /// The peer's certificate chain, leaf first (`None` if it sent none).
    pub fn peer_certificates(&self) -> Option<&[CertificateDer<'static>]> {
        self.peer_certificates.as_deref()
    }

    /// The negotiated ALPN protocol.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        self.alpn.as_deref()
    }

    /// The underlying transport.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// Sets the sequence number at which the send key is updated (tests).
    #[cfg(test)]
    fn rekey_at(&mut self, seq: u64) {
        self.tx_rekey_at = seq;
    }

    /// Seals one record of `typ` whose plaintext `fill` appends, updating the send key first
    /// when it reached its limit.
    fn seal(&mut self, typ: u8, fill: impl FnOnce(&mut Vec<u8>)) -> Result<(), StreamError> {
        if self.tx.seq() >= self.tx_rekey_at {
            self.send_key_update()?;
        }
        if typ == content::APPLICATION_DATA {
            self.answered = false;
        }
        self.tx.seal(typ, &mut self.wnext, fill)?;
        Ok(())
    }

    /// Sends KeyUpdate(update_not_requested) under the current key, then switches to the next.
    fn send_key_update(&mut self) -> Result<(), StreamError> {
        // the next key first: if that fails, nothing announces a key the peer would switch to
        let (seq, secrets) = self.kernel.update_tx()?;
        let next = RecordKey::new(seq, secrets)?;
        self.tx.seal(content::HANDSHAKE, &mut self.wnext, |o| {
            o.extend_from_slice(&[KEY_UPDATE, 0, 0, 1, 0]);
        })?;
        self.tx = next;
        self.tx_updates = self.tx_updates.saturating_add(1);
        Ok(())
    }

    /// Decrypts the next whole record in `rbuf`, if any. Returns whether one was consumed.
    fn open_next(&mut self) -> Result<bool, StreamError> {
        let Some(len) = record::record_len(&self.rbuf[self.rpos..])? else {
            return Ok(false);
        };
        if self.rbuf.len() - self.rpos < len {
            return Ok(false);
        }
        let at = self.rpos;
        let (typ, range) = self.rx.open(&mut self.rbuf[at..at + len])?;
        self.rpos += len;
        let range = at + range.start..at + range.end;
        // `on_record` may grow the other fields; the buffer is only read
        let rbuf = std::mem::take(&mut self.rbuf);
        let opened = self.on_record(typ, &rbuf[range.clone()]);
        self.rbuf = rbuf;
        if opened? {
            self.plain = range;
        }
        Ok(true)
    }

    /// Handles one decrypted record of inner type `typ`. Returns whether it carries application
    /// data (the caller delivers `plain`); post-handshake messages and alerts are acted on here.
    fn on_record(&mut self, typ: u8, plain: &[u8]) -> Result<bool, StreamError> {
        if typ != content::HANDSHAKE && !self.handshake.is_empty() {
            return Err(StreamError::Unexpected("record inside a handshake message"));
        }
        if typ != content::APPLICATION_DATA || plain.is_empty() {
            self.empty_in_a_row = self.empty_in_a_row.saturating_add(1);
            if self.empty_in_a_row > MAX_EMPTY_RECORDS_IN_A_ROW {
                return Err(StreamError::Unexpected("too many records without data"));
            }
        }
        match typ {
            content::APPLICATION_DATA if !plain.is_empty() => {
                self.empty_in_a_row = 0;
                return Ok(true);
            }
            content::APPLICATION_DATA => {}
            content::HANDSHAKE if plain.is_empty() => {
                return Err(StreamError::Unexpected("empty handshake record"));
            }
            content::HANDSHAKE => {
                if self.handshake.len() + plain.len() > MAX_POST_HANDSHAKE + 4 {
                    return Err(StreamError::HandshakeTooLarge(MAX_POST_HANDSHAKE));
                }
                self.handshake.extend_from_slice(plain);
                self.on_handshake()?;
            }
            content::ALERT => match message::alert(plain)? {
                Alert::CloseNotify => self.read_closed = true,
                Alert::UserCanceled => {}
            },
            _ => return Err(StreamError::Unexpected("record content type")),
        }
        Ok(false)
    }

    /// Reads the socket straight into the caller's buffer and decrypts the records there,
    /// compacting their plaintext to the front ([`RecordKey::open_within`]): bulk data is not
    /// copied again. Called with no plaintext pending; the start of a record that an earlier
    /// read ended inside (in `rbuf`, less than a record) is put in the caller's buffer first and
    /// the read continues it, and the record this read ends inside goes to `rbuf`. The caller's
    /// buffer must have room for more than that held part. Returns the bytes read from the
    /// socket (`Ready(Ok(0))`: end of stream; the held part stays in `rbuf`). Past the filled
    /// part, the caller's buffer may hold ciphertext and the decrypted bodies of records other
    /// than data (KeyUpdate, NewSessionTicket).
    fn poll_read_direct(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<Result<usize, StreamError>>
    where
        IO: AsyncRead + Unpin,
    {
        debug_assert!(self.plain.is_empty());
        let base = out.filled().len();
        let held = self.rbuf.len() - self.rpos;
        debug_assert!(held < out.remaining());
        out.put_slice(&self.rbuf[self.rpos..]);
        let read = Pin::new(&mut self.io).poll_read(cx, out);
        let n = out.filled().len() - base - held;
        if !matches!(read, Poll::Ready(Ok(()))) || n == 0 {
            if held == 0 {
                self.rbuf = BytesMut::new();
                self.rpos = 0;
                self.plain = 0..0;
            }
            out.set_filled(base);
            return match read {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(0)),
                Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
                Poll::Pending => Poll::Pending,
            };
        }
        self.direct_reads += 1;
        let buf = out.filled_mut();
        let end = buf.len();
        let mut at = base;
        let mut dst = base;
        let mut failed = None;
        while !self.read_closed {
            let len = match record::record_len(&buf[at..end]) {
                Ok(Some(len)) if end - at >= len => len,
                Ok(_) => break,
                Err(e) => {
                    failed = Some(e.into());
                    break;
                }
            };
            let opened = self
                .rx
                .open_within(&mut buf[..at + len], at, dst)
                .map_err(StreamError::from)
                .and_then(|(typ, range)| Ok((self.on_record(typ, &buf[range.clone()])?, range)));
            match opened {
                Ok((true, range)) => dst = range.end,
                Ok((false, _)) => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            at += len;
        }
        let tail = failed.is_none() && !self.read_closed && at < end;
        if at == base {
            // no record finished: `rbuf` still holds the start, add what was read (not the whole
            // held part again, which a record arriving in small pieces would make quadratic)
            if tail {
                self.rbuf
                    .reserve((record::HEADER_LEN + record::MAX_CIPHERTEXT).saturating_sub(held));
                self.rbuf.extend_from_slice(&buf[base + held..end]);
            }
        } else {
            self.rbuf.clear();
            self.rpos = 0;
            self.plain = 0..0;
            if tail {
                // room for the whole record, so finishing it does not regrow the buffer
                self.rbuf
                    .reserve(record::HEADER_LEN + record::MAX_CIPHERTEXT);
                self.rbuf.extend_from_slice(&buf[at..end]);
            }
        }
        out.set_filled(dst);
        match failed {
            Some(e) => Poll::Ready(Err(e)),
            None => Poll::Ready(Ok(n)),
        }
    }

    /// Handles the whole post-handshake messages buffered in `self.handshake`.
    fn on_handshake(&mut self) -> Result<(), StreamError> {
        let client = matches!(self.kernel, Kernel::Client(_));
        while let Some((msg, used)) = message::next_message(&self.handshake, client)? {
            match msg {
                PostHandshake::NewSessionTicket => {
                    self.tickets = self.tickets.saturating_add(1);
                }
                PostHandshake::KeyUpdate { requested } => {
                    let (seq, secrets) = self.kernel.update_rx()?;
                    self.rx = RecordKey::new(seq, secrets)?;
                    self.rx_updates = self.rx_updates.saturating_add(1);
                    // one answer per burst of requests, and none after our close_notify
                    if requested && !self.answered && !self.close_sent {
                        self.send_key_update()?;
                        self.answered = true;
                    }
                }
            }
            self.handshake.drain(..used);
            if self.handshake.is_empty() {
                self.handshake = Vec::new();
            }
        }
        Ok(())
    }

    /// Reads at most `limit` more bytes from the socket into `rbuf`. `Ready(Ok(0))` is end of
    /// stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>, limit: usize) -> Poll<io::Result<usize>>
    where
        IO: AsyncRead + Unpin,
    {
        // a read of 0 bytes would look like end of stream
        debug_assert!(limit > 0);
        // Only called with no plaintext pending: everything before `rpos` can go.
        self.rbuf.advance(self.rpos);
        self.rpos = 0;
        self.plain = 0..0;
        let partial = self.rbuf.len();
        let room = limit.min(record::HEADER_LEN + record::MAX_CIPHERTEXT);
        if self.rbuf.capacity() - partial < room {
            self.rbuf.reserve(READ_BUFFER.max(partial + room) - partial);
        }
        let mut room = (&mut self.rbuf).limit(limit);
        match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut room) {
            Poll::Pending => {
                if self.rbuf.is_empty() {
                    self.rbuf = BytesMut::new();
                }
                Poll::Pending
            }
            other => other,
        }
    }

    /// Writes queued records until the queue is empty (then released) or the socket is full.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>
    where
        IO: AsyncWrite + Unpin,
    {
        loop {
            if self.wpos == self.wbuf.len() {
                if self.wnext.is_empty() {
                    // idle: give both buffers back
                    self.wbuf = Vec::new();
                    self.wnext = Vec::new();
                    self.wpos = 0;
                    return Poll::Ready(Ok(()));
                }
                std::mem::swap(&mut self.wbuf, &mut self.wnext);
                self.wnext.clear();
                self.wpos = 0;
            }
            match ready!(Pin::new(&mut self.io).poll_write(cx, &self.wbuf[self.wpos..])) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => self.wpos += n,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Records a failed read (returned again by later reads) and, for a protocol error, sends
    /// the fatal alert RFC 8446 §6.2 names for it (best effort) in place of any further data.
    fn read_error(&mut self, cx: &mut Context<'_>, e: StreamError) -> io::Error
    where
        IO: AsyncWrite + Unpin,
    {
        // after a fatal alert either way, nothing more is sent (RFC 8446 §6.2)
        if matches!(e, StreamError::Alert(_)) {
            self.close_sent = true;
        }
        if let Some(desc) = fatal_alert(&e)
            && !self.close_sent
        {
            self.close_sent = true;
            if self
                .seal(content::ALERT, |o| o.extend_from_slice(&[2, desc]))
                .is_ok()
            {
                // errors: the connection is failing anyway
                let _ = self.poll_drain(cx);
            }
        }
        let e = io::Error::from(e);
        self.read_failed = Some((e.kind(), e.to_string()));
        e
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsStream<IO> {
    /// Reads application data; after `READ_YIELD_AFTER` bytes delivered since the last
    /// `Pending`, one read yields (wakes the task, `Pending`) first.
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.read_streak >= READ_YIELD_AFTER {
            this.read_streak = 0;
            this.read_yields += 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let start = out.filled().len();
        let polled = this.poll_read_records(cx, out);
        match polled {
            Poll::Ready(Ok(())) => this.read_streak += out.filled().len() - start,
            Poll::Ready(Err(_)) => {}
            Poll::Pending => this.read_streak = 0,
        }
        polled
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> TlsStream<IO> {
    /// [`AsyncRead::poll_read`] without the yield: plaintext from the records, reading the socket
    /// when none is left.
    fn poll_read_records(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self;
        if this.wpos < this.wbuf.len() || !this.wnext.is_empty() {
            // a KeyUpdate answer (or unflushed data): keep it moving; write errors surface on
            // the next write or flush
            let _ = this.poll_drain(cx);
        }
        if let Some((kind, msg)) = &this.read_failed {
            return Poll::Ready(Err(io::Error::new(*kind, msg.clone())));
        }
        let start = out.filled().len();
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(out.remaining());
                out.put_slice(&this.rbuf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                if out.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            match this.open_next() {
                Ok(true) => {
                    if !this.wnext.is_empty() {
                        // a KeyUpdate answer: start sending it (errors: as above)
                        let _ = this.poll_drain(cx);
                    }
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    let e = this.read_error(cx, e);
                    if out.filled().len() > start {
                        return Poll::Ready(Ok(()));
                    }
                    return Poll::Ready(Err(e));
                }
            }
            if out.filled().len() > start {
                return Poll::Ready(Ok(()));
            }
            let held = this.rbuf.len() - this.rpos;
            // (what `rbuf` holds here is less than a record: the room is for more than that)
            let direct = this.handshake.is_empty() && out.remaining() >= DIRECT_READ_MIN + held;
            let filled = if direct {
                match ready!(this.poll_read_direct(cx, out)) {
                    Ok(n) => {
                        if !this.wnext.is_empty() {
                            // a KeyUpdate answer: start sending it (errors: as above)
                            let _ = this.poll_drain(cx);
                        }
                        n
                    }
                    // socket errors are returned as they are, like `poll_fill`'s
                    Err(StreamError::Io(e)) => return Poll::Ready(Err(e)),
                    Err(e) => {
                        let e = this.read_error(cx, e);
                        if out.filled().len() > start {
                            return Poll::Ready(Ok(()));
                        }
                        return Poll::Ready(Err(e));
                    }
                }
            } else {
                ready!(this.poll_fill(cx, usize::MAX))?
            };
            if filled == 0 {
                let why = if this.rbuf.is_empty() {
                    "peer closed the connection without close_notify"
                } else {
                    "peer closed the connection inside a TLS record"
                };
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, why)));
            }
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsStream<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        // Send what is queued; a new batch is sealed while the previous one is in flight, and
        // the writer waits once both are full.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        if this.wnext.len() >= WRITE_QUEUE {
            return Poll::Pending;
        }
        let offered = bufs.iter().map(|b| b.len()).sum::<usize>();
        let room = WRITE_QUEUE - this.wnext.len();
        // e.g. an HTTP/2 frame of 1 MiB is 4 batches and its 9-byte header: not 5 sends
        let total = if offered.saturating_sub(room) < record::MAX_PLAINTEXT {
            offered
        } else {
            room
        };
        // room for all the records at once, so sealing does not regrow (and recopy) the batch
        let records = total.div_ceil(record::MAX_PLAINTEXT);
        this.wnext.reserve(total + records * RECORD_OVERHEAD);
        let mut src = Gather {
            bufs,
            at: 0,
            off: 0,
        };
        let mut left = total;
        while left > 0 {
            let n = left.min(record::MAX_PLAINTEXT);
            this.seal(content::APPLICATION_DATA, |o| src.copy_to(o, n))?;
            left -= n;
        }
        // Start sending; errors surface on the next write or flush.
        let _ = this.poll_drain(cx);
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // no close_notify after a failed read: the peer must not take the close for a clean one
        if !this.close_sent && this.read_failed.is_none() {
            this.seal(content::ALERT, |o| o.extend_from_slice(&[1, CLOSE_NOTIFY]))?;
        }
        this.close_sent = true;
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

/// A cursor over the caller's write slices.
struct Gather<'a, 'b> {
    bufs: &'a [IoSlice<'b>],
    at: usize,
    off: usize,
}

impl Gather<'_, '_> {
    /// Appends the next `n` bytes to `out` (fewer if the slices end).
    fn copy_to(&mut self, out: &mut Vec<u8>, mut n: usize) {
        while n > 0 {
            let Some(buf) = self.bufs.get(self.at) else {
                return;
            };
            let take = (buf.len() - self.off).min(n);
            out.extend_from_slice(&buf[self.off..self.off + take]);
            self.off += take;
            n -= take;
            if self.off == buf.len() {
                self.at += 1;
                self.off = 0;
            }
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
