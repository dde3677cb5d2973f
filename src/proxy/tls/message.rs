//! Post-handshake messages and alerts a TLS 1.3 peer sends under the traffic keys, parsed without
//! acting on them: [`next_message`] takes the handshake messages (RFC 8446 §4.6: NewSessionTicket,
//! KeyUpdate) off the front of the bytes received so far, [`alert`] reads an alert record (§6).
//! The stream (`super::stream`) acts on what they return; the fuzz target `tls_record` drives
//! them with arbitrary bytes.

use super::stream::StreamError;

/// Max size of a post-handshake message body (NewSessionTicket, KeyUpdate).
pub const MAX_POST_HANDSHAKE: usize = 64 * 1024;
/// Handshake message types (RFC 8446 §4).
pub const NEW_SESSION_TICKET: u8 = 4;
/// KeyUpdate's handshake type.
pub const KEY_UPDATE: u8 = 24;
/// Alert descriptions (RFC 8446 §6).
pub const CLOSE_NOTIFY: u8 = 0;
/// The peer cancels what it was doing; not an error by itself.
pub const USER_CANCELED: u8 = 90;

/// A post-handshake message the stream accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostHandshake {
    /// A session ticket (only a client gets them); ignored but counted.
    NewSessionTicket,
    /// KeyUpdate: the peer's next record is under its next key; `requested` asks for ours too
    /// (`update_requested`, §4.6.3).
    KeyUpdate {
        /// The peer asked us to update our send key as well.
        requested: bool,
    },
}

/// A non-fatal alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alert {
    /// close_notify: the peer sends nothing more.
    CloseNotify,
    /// user_canceled: ignored (a close_notify is expected to follow).
    UserCanceled,
}

/// The next whole post-handshake message at the front of `buf` (the handshake bytes received so
/// far, ending where the last record ended) and the bytes it takes (4 + its length); `Ok(None)`
/// when it is not complete yet. `client` says whether we are the client (NewSessionTicket is
/// only allowed then).
///
/// # Errors
/// [`StreamError::HandshakeTooLarge`] for a length over [`MAX_POST_HANDSHAKE`];
/// [`StreamError::Unexpected`] for another message type or a KeyUpdate that does not end its
/// record; [`StreamError::IllegalParameter`] / [`StreamError::Malformed`] for a KeyUpdate whose
/// request byte is not 0 or 1 / whose length is not 1.
pub fn next_message(
    buf: &[u8],
    client: bool,
) -> Result<Option<(PostHandshake, usize)>, StreamError> {
    let [typ, a, b, c, rest @ ..] = buf else {
        return Ok(None);
    };
    let len = usize::from(*a) << 16 | usize::from(*b) << 8 | usize::from(*c);
    if len > MAX_POST_HANDSHAKE {
        return Err(StreamError::HandshakeTooLarge(MAX_POST_HANDSHAKE));
    }
    if rest.len() < len {
        return Ok(None);
    }
    let msg = match (*typ, &rest[..len]) {
        (NEW_SESSION_TICKET, _) if client => PostHandshake::NewSessionTicket,
        (KEY_UPDATE, [request @ (0 | 1)]) => {
            // KeyUpdate must end its record: the next record is under the new key.
            if rest.len() > len {
                return Err(StreamError::Unexpected("data after KeyUpdate"));
            }
            PostHandshake::KeyUpdate {
                requested: *request == 1,
            }
        }
        (KEY_UPDATE, [_]) => return Err(StreamError::IllegalParameter("KeyUpdate request")),
        (KEY_UPDATE, _) => return Err(StreamError::Malformed("KeyUpdate")),
        _ => return Err(StreamError::Unexpected("post-handshake message")),
    };
    Ok(Some((msg, 4 + len)))
}

/// The alert in the plaintext of an alert record (`[level, description]`).
///
/// # Errors
/// [`StreamError::Alert`] with the description for any other (fatal) alert;
/// [`StreamError::Malformed`] when the record is not two bytes.
pub fn alert(plain: &[u8]) -> Result<Alert, StreamError> {
    match plain {
        [_, CLOSE_NOTIFY] => Ok(Alert::CloseNotify),
        [_, USER_CANCELED] => Ok(Alert::UserCanceled),
        [_, desc] => Err(StreamError::Alert(*desc)),
        _ => Err(StreamError::Malformed("alert")),
    }
}
