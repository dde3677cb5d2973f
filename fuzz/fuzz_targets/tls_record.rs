//! The TLS 1.3 record layer outside rustls: record length parsing, `open` on arbitrary records
//! (at arbitrary offsets), records sealed from arbitrary plaintext opened back by a second key
//! with the same secrets (content type, plaintext and sequence numbers must survive), and the
//! post-handshake messages (KeyUpdate, NewSessionTicket) and alerts received under the keys.
//!
//! Input: `[mode: u8]` then raw bytes (mode & 0xc0 == 0), records of `[type: u8][len: u16 be]
//! [len bytes]` to seal (0x80), or record plaintexts of `[len: u8][len bytes]` whose bytes are
//! added to the handshake buffer one record at a time, and read as alerts too (0x40).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rustls::ConnectionTrafficSecrets;
use rustls::crypto::cipher::{AeadKey, Iv};
use ztnode::proxy::tls::message::{self, MAX_POST_HANDSHAKE, PostHandshake};
use ztnode::proxy::tls::record::{MAX_PLAINTEXT, RecordKey, record_len};

fn key(suite: u8) -> RecordKey {
    let key = AeadKey::from([7u8; 32]);
    let iv = Iv::new([9u8; 12]);
    let secrets = if suite & 1 == 0 {
        ConnectionTrafficSecrets::Aes256Gcm { key, iv }
    } else {
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv }
    };
    RecordKey::new(0, secrets).expect("a supported suite")
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, body)) = data.split_first() else {
        return;
    };
    if mode & 0xc0 == 0x40 {
        post_handshake(*mode & 1 == 1, body);
    } else if mode & 0x80 == 0 {
        // raw records as a peer could send them
        let mut rx = key(*mode);
        let mut buf = body.to_vec();
        let mut at = 0;
        while let Ok(Some(len)) = record_len(&buf[at..]) {
            if at + len > buf.len() {
                break;
            }
            let dst = at.saturating_sub(usize::from(*mode & 7));
            let _ = rx.open_within(&mut buf[..at + len], at, dst);
            at += len;
        }
        let mut one = body.to_vec();
        let _ = rx.open(&mut one);
    } else {
        let mut tx = key(*mode);
        let mut rx = key(*mode);
        let mut rest = body;
        while let [typ, hi, lo, tail @ ..] = rest {
            let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(tail.len());
            let (plain, next) = tail.split_at(len);
            rest = next;
            let mut out = Vec::new();
            let sealed = tx.seal(*typ, &mut out, |v| v.extend_from_slice(plain));
            if plain.len() > MAX_PLAINTEXT {
                assert!(sealed.is_err(), "an oversized record is refused");
                continue;
            }
            sealed.expect("a record within the limit seals");
            assert_eq!(record_len(&out).ok().flatten(), Some(out.len()));
            let opened = rx.open(&mut out);
            if *typ == 0 {
                // a zero content type is padding: the opener sees no content type
                assert!(opened.is_err() || plain.iter().any(|b| *b != 0));
                continue;
            }
            let (got_typ, range) = opened.expect("our own record opens");
            assert_eq!(got_typ, *typ);
            assert_eq!(&out[range], plain);
        }
    }
});

/// Feeds record plaintexts to the handshake buffer as the stream does, taking whole messages off
/// its front; checks what each message takes and that a KeyUpdate ends its record.
fn post_handshake(client: bool, mut body: &[u8]) {
    let mut buf: Vec<u8> = Vec::new();
    while let [len, rest @ ..] = body {
        let len = usize::from(*len).min(rest.len());
        let (plain, next) = rest.split_at(len);
        body = next;
        let _ = message::alert(plain);
        buf.extend_from_slice(plain);
        loop {
            match message::next_message(&buf, client) {
                Ok(Some((msg, used))) => {
                    assert!((4..=4 + MAX_POST_HANDSHAKE).contains(&used) && used <= buf.len());
                    if let PostHandshake::KeyUpdate { .. } = msg {
                        assert_eq!(used, buf.len(), "a KeyUpdate ends its record");
                        assert_eq!(buf[0], message::KEY_UPDATE);
                    } else {
                        assert!(client, "only a client takes a NewSessionTicket");
                    }
                    buf.drain(..used);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
}
