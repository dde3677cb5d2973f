//! TLS 1.3 record protection (RFC 8446 §5) with the traffic keys rustls hands over after the
//! handshake (`rustls::kernel`). Records are sealed into and opened inside the caller's buffers, so
//! a record costs one copy of its plaintext and no allocation.

use std::ops::Range;

use ring::aead;
use rustls::ConnectionTrafficSecrets;

/// Bytes of a record header: type, legacy version (2), length (2).
pub const HEADER_LEN: usize = 5;
/// Max plaintext per record (RFC 8446 §5.1).
pub const MAX_PLAINTEXT: usize = 1 << 14;
/// Max protected length of a record, header excluded (RFC 8446 §5.2).
pub const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// Bytes of an AES-GCM (and ChaCha20-Poly1305) tag.
const TAG_LEN: usize = 16;

/// Content types (RFC 8446 §5.1).
pub mod content {
    /// `change_cipher_spec`: only legal during the handshake.
    pub const CHANGE_CIPHER_SPEC: u8 = 20;
    /// `alert`.
    pub const ALERT: u8 = 21;
    /// `handshake`: post-handshake messages (NewSessionTicket, KeyUpdate).
    pub const HANDSHAKE: u8 = 22;
    /// `application_data`: also the outer type of every protected record.
    pub const APPLICATION_DATA: u8 = 23;
}

/// Errors of the record layer. Each one ends the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The negotiated cipher suite is not one the record layer implements.
    #[error("cipher suite not supported by the record layer")]
    UnsupportedSuite,
    /// The key material does not fit the AEAD.
    #[error("traffic key rejected by the AEAD")]
    BadKey,
    /// A protected record whose outer type is not `application_data`.
    #[error("record of type {0} after the handshake")]
    OuterType(u8),
    /// A record longer than TLS 1.3 allows (`record_overflow`).
    #[error("record of {0} bytes exceeds the TLS 1.3 limit")]
    Overflow(usize),
    /// The record failed authentication (`bad_record_mac`).
    #[error("record failed authentication")]
    BadMac,
    /// The decrypted record is all padding: no content type (`unexpected_message`).
    #[error("record without a content type")]
    NoContentType,
    /// More than 2^64 - 1 records under one key.
    #[error("record sequence number exhausted")]
    SeqExhausted,
}

/// One direction's traffic key: the AEAD key, the static IV and the next sequence number
/// (RFC 8446 §5.3).
pub struct RecordKey {
    key: aead::LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    seq: u64,
}

impl std::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordKey")
            .field("algorithm", self.key.algorithm())
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl RecordKey {
    /// The key for `secrets`, whose next record has sequence number `seq`.
    ///
    /// # Errors
    /// [`RecordError::UnsupportedSuite`] for suites other than AES-GCM and ChaCha20-Poly1305,
    /// [`RecordError::BadKey`] if the key length does not match.
    pub fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<RecordKey, RecordError> {
        let (algorithm, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            _ => return Err(RecordError::UnsupportedSuite),
        };
        let key =
            aead::UnboundKey::new(algorithm, key.as_ref()).map_err(|_| RecordError::BadKey)?;
        let iv: [u8; aead::NONCE_LEN] = iv.as_ref().try_into().map_err(|_| RecordError::BadKey)?;
        Ok(RecordKey {
            key: aead::LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// The sequence number of the next record.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The per-record nonce (the IV xor the sequence number, §5.3), advancing the sequence.
    fn next_nonce(&mut self) -> Result<aead::Nonce, RecordError> {
        let mut nonce = self.iv;
        for (n, s) in nonce[aead::NONCE_LEN - 8..]
            .iter_mut()
            .zip(self.seq.to_be_bytes())
        {
            *n ^= s;
        }
        self.seq = self.seq.checked_add(1).ok_or(RecordError::SeqExhausted)?;
        Ok(aead::Nonce::assume_unique_for_key(nonce))
    }

    /// Appends one protected record of content type `typ` to `out`; `fill` appends its plaintext
    /// (at most [`MAX_PLAINTEXT`] bytes) to the vector it is given.
    ///
    /// # Errors
    /// [`RecordError::Overflow`] if `fill` appended too much, [`RecordError::SeqExhausted`].
    pub fn seal(
        &mut self,
        typ: u8,
        out: &mut Vec<u8>,
        fill: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), RecordError> {
        let start = out.len();
        out.extend_from_slice(&[content::APPLICATION_DATA, 0x03, 0x03, 0, 0]);
        fill(out);
        let plaintext = out.len() - start - HEADER_LEN;
        if plaintext > MAX_PLAINTEXT {
            out.truncate(start);
            return Err(RecordError::Overflow(plaintext));
        }
        out.push(typ);
        let len = plaintext + 1 + TAG_LEN;
        let Ok(len16) = u16::try_from(len) else {
            out.truncate(start);
            return Err(RecordError::Overflow(len));
        };
        out[start + 3..start + HEADER_LEN].copy_from_slice(&len16.to_be_bytes());
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&out[start..start + HEADER_LEN]);
        // on any error nothing stays in `out`: it would go out unencrypted
        let sealed = self.next_nonce().and_then(|nonce| {
            self.key
                .seal_in_place_separate_tag(
                    nonce,
                    aead::Aad::from(header),
                    &mut out[start + HEADER_LEN..],
                )
                .map_err(|_| RecordError::BadKey)
        });
        match sealed {
            Ok(tag) => {
                out.extend_from_slice(tag.as_ref());
                Ok(())
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// Decrypts the one whole record in `record` (header included) in place. Returns its inner
    /// content type and where its plaintext now is, relative to `record`.
    ///
    /// # Errors
    /// As [`RecordKey::open_within`].
    pub fn open(&mut self, record: &mut [u8]) -> Result<(u8, Range<usize>), RecordError> {
        self.open_within(record, 0, HEADER_LEN)
    }

    /// Decrypts the whole record that starts at `buf[at..]` and fills the rest of `buf`, writing
    /// its plaintext from `buf[dst..]` on (`dst <= at + HEADER_LEN`; the decryption moves the
    /// bytes as it goes, so records read back to back are compacted without a copy). Returns the
    /// inner content type and the plaintext's range in `buf`.
    ///
    /// # Errors
    /// [`RecordError::BadMac`] (also for a record shorter than its header and tag, or a `dst`
    /// past the ciphertext), [`RecordError::NoContentType`], [`RecordError::Overflow`] for an
    /// inner plaintext (padding included) over 2^14 + 1 bytes, [`RecordError::SeqExhausted`].
    pub fn open_within(
        &mut self,
        buf: &mut [u8],
        at: usize,
        dst: usize,
    ) -> Result<(u8, Range<usize>), RecordError> {
        let header: [u8; HEADER_LEN] = buf
            .get(at..)
            .and_then(|r| r.first_chunk::<HEADER_LEN>())
            .copied()
            .ok_or(RecordError::BadMac)?;
        let body = at + HEADER_LEN;
        if dst > body {
            return Err(RecordError::BadMac);
        }
        let nonce = self.next_nonce()?;
        let plain = self
            .key
            .open_within(
                nonce,
                aead::Aad::from(header),
                &mut buf[dst..],
                body - dst..,
            )
            .map_err(|_| RecordError::BadMac)?;
        // TLSInnerPlaintext, padding included, is at most 2^14 + 1 bytes (§5.2, §5.4)
        if plain.len() > MAX_PLAINTEXT + 1 {
            return Err(RecordError::Overflow(plain.len()));
        }
        let Some(typ_at) = plain.iter().rposition(|&b| b != 0) else {
            return Err(RecordError::NoContentType);
        };
        Ok((plain[typ_at], dst..dst + typ_at))
    }
}

/// The length (header included) of the record starting `buf`, or `None` while its header is
/// incomplete. The record itself may still be incomplete.
///
/// # Errors
/// [`RecordError::OuterType`] unless the outer type is `application_data`,
/// [`RecordError::Overflow`] for a length over [`MAX_CIPHERTEXT`].
pub fn record_len(buf: &[u8]) -> Result<Option<usize>, RecordError> {
    let Some(header) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    if header[0] != content::APPLICATION_DATA {
        return Err(RecordError::OuterType(header[0]));
    }
    let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if len > MAX_CIPHERTEXT {
        return Err(RecordError::Overflow(len));
    }
    Ok(Some(HEADER_LEN + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (RecordKey, RecordKey) {
        let secrets = || ConnectionTrafficSecrets::Aes256Gcm {
            key: [7u8; 32].into(),
            iv: [9u8; 12].into(),
        };
        (
            RecordKey::new(0, secrets()).expect("key"),
            RecordKey::new(0, secrets()).expect("key"),
        )
    }

    /// Appends one application_data record of `plain` to `out`.
    fn seal_data(tx: &mut RecordKey, out: &mut Vec<u8>, plain: &[u8]) {
        tx.seal(content::APPLICATION_DATA, out, |o| {
            o.extend_from_slice(plain)
        })
        .expect("seal");
    }

    #[test]
    fn sealed_records_open_with_type_and_plaintext() {
        let (mut tx, mut rx) = pair();
        let mut out = Vec::new();
        seal_data(&mut tx, &mut out, b"hello");
        tx.seal(content::ALERT, &mut out, |o| o.extend_from_slice(&[1, 0]))
            .expect("seal");
        let first = record_len(&out).expect("len").expect("whole header");
        assert_eq!(first, HEADER_LEN + 5 + 1 + TAG_LEN);
        assert_eq!(&out[..3], &[23, 3, 3]);
        let (a, b) = out.split_at_mut(first);
        let (typ, range) = rx.open(a).expect("open");
        assert_eq!((typ, &a[range]), (content::APPLICATION_DATA, &b"hello"[..]));
        let (typ, range) = rx.open(b).expect("open");
        assert_eq!((typ, &b[range]), (content::ALERT, &[1u8, 0][..]));
        assert_eq!((tx.seq(), rx.seq()), (2, 2));
    }

    #[test]
    fn a_flipped_bit_or_a_reordered_record_fails_authentication() {
        let (mut tx, mut rx) = pair();
        let mut one = Vec::new();
        seal_data(&mut tx, &mut one, b"one");
        let mut two = Vec::new();
        seal_data(&mut tx, &mut two, b"two");
        // record two under sequence number 0
        assert_eq!(rx.open(&mut two.clone()), Err(RecordError::BadMac));
        let (_, mut rx) = pair();
        let last = one.len() - 1;
        one[last] ^= 1;
        assert_eq!(rx.open(&mut one), Err(RecordError::BadMac));
    }

    #[test]
    fn padding_is_stripped_and_all_padding_is_rejected() {
        let (mut tx, mut rx) = pair();
        let mut out = Vec::new();
        // an inner plaintext "hi" + type 23 + 3 zero bytes of padding, sealed by hand
        tx.seal(0, &mut out, |o| o.extend_from_slice(b"hi\x17\0\0"))
            .expect("seal");
        let (typ, range) = rx.open(&mut out).expect("open");
        assert_eq!((typ, &out[range]), (content::APPLICATION_DATA, &b"hi"[..]));
        let mut zeros = Vec::new();
        tx.seal(0, &mut zeros, |o| o.extend_from_slice(&[0, 0]))
            .expect("seal");
        assert_eq!(rx.open(&mut zeros), Err(RecordError::NoContentType));
    }

    #[test]
    fn padding_past_the_inner_plaintext_limit_is_an_overflow() {
        let (mut tx, mut rx) = pair();
        // 2^14 bytes of content + type + one byte of padding: one byte too many
        let mut rec = vec![23, 3, 3, 0, 0];
        rec.extend_from_slice(&[b'a'; MAX_PLAINTEXT]);
        rec.extend_from_slice(&[content::APPLICATION_DATA, 0]);
        let len = u16::try_from(rec.len() - HEADER_LEN + TAG_LEN).expect("fits");
        rec[3..5].copy_from_slice(&len.to_be_bytes());
        let header: [u8; HEADER_LEN] = rec[..HEADER_LEN].try_into().expect("header");
        let nonce = tx.next_nonce().expect("nonce");
        let tag = tx
            .key
            .seal_in_place_separate_tag(nonce, aead::Aad::from(header), &mut rec[HEADER_LEN..])
            .expect("seal");
        rec.extend_from_slice(tag.as_ref());
        assert_eq!(
            rx.open(&mut rec),
            Err(RecordError::Overflow(MAX_PLAINTEXT + 2))
        );
    }

    #[test]
    fn record_len_checks_type_and_limit() {
        assert_eq!(record_len(&[23, 3, 3, 0]), Ok(None));
        assert_eq!(
            record_len(&[23, 3, 3, 0x41, 0x00]),
            Ok(Some(HEADER_LEN + 0x4100))
        );
        assert_eq!(
            record_len(&[23, 3, 3, 0x41, 0x01]),
            Err(RecordError::Overflow(0x4101))
        );
        assert_eq!(
            record_len(&[22, 3, 3, 0, 1]),
            Err(RecordError::OuterType(22))
        );
    }

    #[test]
    fn oversized_plaintext_is_refused_and_leaves_out_unchanged() {
        let (mut tx, _) = pair();
        let mut out = vec![1, 2, 3];
        let big = vec![0u8; MAX_PLAINTEXT + 1];
        assert_eq!(
            tx.seal(content::APPLICATION_DATA, &mut out, |o| o
                .extend_from_slice(&big)),
            Err(RecordError::Overflow(MAX_PLAINTEXT + 1))
        );
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(tx.seq(), 0);
    }

    #[test]
    fn records_opened_within_one_buffer_are_compacted_in_order() {
        let (mut tx, mut rx) = pair();
        let mut buf = Vec::new();
        for chunk in [&b"first "[..], b"second ", b"third"] {
            seal_data(&mut tx, &mut buf, chunk);
        }
        let mut at = 0;
        let mut dst = 0;
        while at < buf.len() {
            let len = record_len(&buf[at..]).expect("len").expect("header");
            let (typ, range) = rx.open_within(&mut buf[..at + len], at, dst).expect("open");
            assert_eq!((typ, range.start), (content::APPLICATION_DATA, dst));
            at += len;
            dst = range.end;
        }
        assert_eq!(&buf[..dst], b"first second third");
        // a destination past the record's body is refused before any decryption
        let mut one = Vec::new();
        seal_data(&mut tx, &mut one, b"x");
        assert_eq!(
            rx.open_within(&mut one, 0, HEADER_LEN + 1),
            Err(RecordError::BadMac)
        );
        assert_eq!(rx.seq(), 3);
    }
}
