//! The TLS 1.3 handshake of an HBONE connection: rustls' unbuffered API driven over the socket
//! one whole record at a time, then the traffic keys handed over (`rustls::kernel`) to the
//! [`TlsStream`] that protects the records itself.

use std::ops::DerefMut;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, EncodeTlsData, UnbufferedConnectionCommon, UnbufferedStatus,
};
use rustls::{ClientConfig, ExtractedSecrets, ServerConfig};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::kernel::Kernel;
use super::record::{self, RecordError};
use super::stream::{StreamError, TlsStream};

/// Max bytes buffered while the handshake waits for a whole message (rustls limits handshake
/// messages to 64 KiB).
const MAX_HANDSHAKE_BUFFER: usize = 128 * 1024;

/// Runs the client side of the handshake over `io`, presenting the certificate and verifying the
/// peer as `config` says (`config.enable_secret_extraction` must be set).
///
/// # Errors
/// [`StreamError`]: the socket, rustls' verdict, or a peer that closed.
pub async fn connect<IO>(
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    io: IO,
) -> Result<TlsStream<IO>, StreamError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    if !config.enable_secret_extraction {
        return Err(StreamError::Unsupported("enable_secret_extraction"));
    }
    handshake(UnbufferedClientConnection::new(config, name)?, io).await
}

/// Runs the server side of the handshake over `io` (`config.enable_secret_extraction` must be
/// set); returns once the client's Finished (and so its certificate) has been verified.
///
/// # Errors
/// As [`connect`].
pub async fn accept<IO>(config: Arc<ServerConfig>, io: IO) -> Result<TlsStream<IO>, StreamError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    if !config.enable_secret_extraction {
        return Err(StreamError::Unsupported("enable_secret_extraction"));
    }
    handshake(UnbufferedServerConnection::new(config)?, io).await
}

/// What both unbuffered connection types offer the handshake driver.
trait Unbuffered: DerefMut<Target = UnbufferedConnectionCommon<Self::Data>> {
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error>;
}

/// Implements [`Unbuffered`] for one side (the two types share no trait in rustls).
macro_rules! unbuffered {
    ($conn:ty, $data:ty, $kernel:ident) => {
        impl Unbuffered for $conn {
            type Data = $data;
            fn process<'c, 'i>(
                &'c mut self,
                incoming: &'i mut [u8],
            ) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
            fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error> {
                let (secrets, k) = self.dangerous_into_kernel_connection()?;
                Ok((secrets, Kernel::$kernel(k)))
            }
        }
    };
}

unbuffered!(UnbufferedClientConnection, ClientConnectionData, Client);
unbuffered!(UnbufferedServerConnection, ServerConnectionData, Server);

/// The next step of the handshake driver.
enum Step {
    Process,
    Transmit,
    Feed,
    Done,
}

/// Runs the handshake. rustls is handed one whole record at a time and nothing after the record
/// that completes the handshake: every later record (the peer's first data, a KeyUpdate or a
/// NewSessionTicket that came in the same read as its Finished) is left to the [`TlsStream`].
async fn handshake<C, IO>(mut conn: C, mut io: IO) -> Result<TlsStream<IO>, StreamError>
where
    C: Unbuffered,
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let mut incoming = BytesMut::with_capacity(8 * 1024);
    // `incoming[..fed]` holds the whole records rustls has been given
    let mut fed = 0;
    let mut outgoing = Vec::new();
    loop {
        let status = conn.process(&mut incoming[..fed]);
        let discard = status.discard;
        let step = match status.state {
            Ok(ConnectionState::EncodeTlsData(mut enc)) => {
                encode(&mut enc, &mut outgoing)?;
                Step::Process
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                t.done();
                Step::Transmit
            }
            Ok(ConnectionState::BlockedHandshake) => Step::Feed,
            Ok(ConnectionState::WriteTraffic(_)) => Step::Done,
            Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => {
                return Err(StreamError::ClosedInHandshake);
            }
            Ok(_) => return Err(StreamError::Unexpected("application data in the handshake")),
            Err(e) => {
                incoming.advance(discard);
                fed = fed.saturating_sub(discard);
                send_alert(&mut conn, &mut incoming[..fed], &mut outgoing, &mut io).await;
                return Err(e.into());
            }
        };
        incoming.advance(discard);
        fed = fed.checked_sub(discard).ok_or(StreamError::Unexpected(
            "handshake discard past the records given",
        ))?;
        match step {
            Step::Process => {}
            Step::Transmit => {
                io.write_all(&outgoing).await?;
                outgoing.clear();
            }
            // A server may send before the client's Finished arrives; wait for it, so the
            // client certificate is verified before the stream exists.
            Step::Done if !conn.is_handshaking() => break,
            Step::Feed | Step::Done => fed += next_record(&mut io, &mut incoming, fed).await?,
        }
    }
    if fed != 0 {
        return Err(StreamError::Unexpected("handshake data after Finished"));
    }
    if !outgoing.is_empty() {
        io.write_all(&outgoing).await?;
    }
    io.flush().await?;
    if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
        return Err(StreamError::Unsupported("a TLS version other than 1.3"));
    }
    let peer_certificates = conn
        .peer_certificates()
        .map(|chain| chain.iter().map(|c| c.clone().into_owned()).collect());
    let alpn = conn.alpn_protocol().map(<[u8]>::to_vec);
    let (secrets, kernel) = conn.into_kernel()?;
    TlsStream::new(io, kernel, secrets, incoming, peer_certificates, alpn)
}

/// Reads until `incoming[fed..]` starts with a whole record; returns its length.
async fn next_record<IO: AsyncRead + Unpin>(
    io: &mut IO,
    incoming: &mut BytesMut,
    fed: usize,
) -> Result<usize, StreamError> {
    loop {
        if let Some(header) = incoming[fed..].first_chunk::<{ record::HEADER_LEN }>() {
            let len = record::HEADER_LEN + usize::from(u16::from_be_bytes([header[3], header[4]]));
            if len > record::HEADER_LEN + record::MAX_CIPHERTEXT {
                return Err(RecordError::Overflow(len - record::HEADER_LEN).into());
            }
            if incoming.len() - fed >= len {
                return Ok(len);
            }
        }
        if incoming.len() >= MAX_HANDSHAKE_BUFFER {
            return Err(StreamError::HandshakeTooLarge(MAX_HANDSHAKE_BUFFER));
        }
        incoming.reserve(8 * 1024);
        if io.read_buf(incoming).await? == 0 {
            return Err(StreamError::ClosedInHandshake);
        }
    }
}

/// Appends one handshake chunk rustls wants sent to `out`.
fn encode<D>(enc: &mut EncodeTlsData<'_, D>, out: &mut Vec<u8>) -> Result<(), StreamError> {
    let start = out.len();
    out.resize(start + 4096, 0);
    loop {
        match enc.encode(&mut out[start..]) {
            Ok(n) => {
                out.truncate(start + n);
                return Ok(());
            }
            Err(EncodeError::InsufficientSize(s)) => out.resize(start + s.required_size, 0),
            Err(EncodeError::AlreadyEncoded) => {
                out.truncate(start);
                return Ok(());
            }
        }
    }
}

/// After a failed handshake, sends the alert rustls queued (best effort), so the peer learns why.
async fn send_alert<C: Unbuffered, IO: AsyncWrite + Unpin>(
    conn: &mut C,
    fed: &mut [u8],
    out: &mut Vec<u8>,
    io: &mut IO,
) {
    out.clear();
    // rustls tracks its position in the records it was given: it must see the same bytes again
    // Only while something is queued: past that, rustls would process the failed record again.
    while conn.wants_write() {
        let Ok(ConnectionState::EncodeTlsData(mut enc)) = conn.process(fed).state else {
            break;
        };
        if encode(&mut enc, out).is_err() {
            break;
        }
    }
    if !out.is_empty() {
        let _ = io.write_all(out).await;
        let _ = io.flush().await;
    }
}
