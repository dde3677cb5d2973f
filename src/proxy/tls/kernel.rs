//! rustls' connection state after the handshake ([`Kernel`]): what the handshake hands over to
//! the [`TlsStream`](super::TlsStream) with the traffic keys, and what the stream asks for the
//! next secrets on a KeyUpdate (`rustls::kernel`).

use rustls::ConnectionTrafficSecrets;
use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;

/// rustls' state after the handshake: derives the next secrets on KeyUpdate.
pub(super) enum Kernel {
    /// The client end of a connection.
    Client(KernelConnection<ClientConnectionData>),
    /// The server end of a connection.
    Server(KernelConnection<ServerConnectionData>),
}

impl Kernel {
    /// The next receive secret and the record sequence number it starts at (the peer sent a
    /// KeyUpdate). Errors: rustls' own.
    pub(super) fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_rx_secret(),
            Kernel::Server(k) => k.update_rx_secret(),
        }
    }

    /// The next send secret and the record sequence number it starts at (we send a KeyUpdate).
    /// Errors: rustls' own.
    pub(super) fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_tx_secret(),
            Kernel::Server(k) => k.update_tx_secret(),
        }
    }

    /// Records that may be protected under one key of the negotiated cipher suite (`u64::MAX`
    /// for a suite that is not TLS 1.3).
    pub(super) fn confidentiality_limit(&self) -> u64 {
        let suite = match self {
            Kernel::Client(k) => k.negotiated_cipher_suite(),
            Kernel::Server(k) => k.negotiated_cipher_suite(),
        };
        suite
            .tls13()
            .map_or(u64::MAX, |s| s.common.confidentiality_limit)
    }
}
