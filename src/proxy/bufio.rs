//! Read batching under TLS.
//!
//! rustls reads the socket 4 KiB at a time (its deframer's read size), so a busy HBONE connection
//! would make several `recv` calls per 16 KiB record. [`ReadBuffered`] reads up to [`BUF_SIZE`] per
//! syscall and serves rustls from memory. The buffer exists only while data is flowing: it is
//! released as soon as a read finds the socket empty, so idle connections hold no read buffer.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read from the socket per syscall while data keeps coming.
pub const BUF_SIZE: usize = 256 * 1024;
/// Plaintext rustls may buffer for sending on an HBONE connection (its default is 64 KiB): one
/// `writev` then carries up to 16 TLS records.
pub const TLS_SEND_BUFFER: usize = 256 * 1024;

/// First read size after the stream was idle.
const SMALL_SIZE: usize = 16 * 1024;

/// An I/O stream whose reads are batched (see module docs); writes pass through unchanged.
#[derive(Debug)]
pub struct ReadBuffered<T> {
    inner: T,
    buf: BytesMut,
    /// The last socket read filled its buffer: more is probably waiting.
    busy: bool,
}

impl<T> ReadBuffered<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        ReadBuffered {
            inner,
            buf: BytesMut::new(),
            busy: false,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadBuffered<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.buf.is_empty() {
            if out.remaining() >= BUF_SIZE {
                return Pin::new(&mut this.inner).poll_read(cx, out);
            }
            let want = if this.busy { BUF_SIZE } else { SMALL_SIZE };
            this.buf.reserve(want);
            let cap = this.buf.capacity();
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf) {
                Poll::Pending => {
                    // Nothing to read: do not keep a read buffer while idle.
                    this.buf = BytesMut::new();
                    this.busy = false;
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(n)) => this.busy = n >= cap,
            }
        }
        let n = out.remaining().min(this.buf.len());
        out.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ReadBuffered<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_reads_see_every_byte_and_eof() {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sent = payload.clone();
        let writer = tokio::spawn(async move {
            a.write_all(&sent).await.expect("write");
            a.shutdown().await.expect("shutdown");
        });
        let mut r = ReadBuffered::new(b);
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = r.read(&mut chunk).await.expect("read");
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        writer.await.expect("writer");
        assert_eq!(got, payload);
    }

    #[tokio::test]
    async fn idle_stream_releases_its_buffer() {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut r = ReadBuffered::new(b);
        a.write_all(b"hello").await.expect("write");
        let mut five = [0u8; 5];
        r.read_exact(&mut five).await.expect("read");
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(20), r.read(&mut five)).await;
        assert!(pending.is_err(), "no data: the read must wait");
        assert_eq!(r.buf.capacity(), 0, "idle stream keeps no buffer");
    }
}
