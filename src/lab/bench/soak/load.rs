//! The soak's connection load and its tally: short connections at a fixed rate and long streams,
//! each in its own thread inside the client pod's netns, every byte echoed and checked.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::super::measure::MSG;

/// Failure reasons the tally keeps (the first ones; later ones are only counted).
const KEPT_REASONS: usize = 20;
/// Bytes of one block a long stream sends and reads back.
pub(super) const BLOCK: usize = 64 * 1024;
/// How often a long stream sends a block.
const BLOCK_EVERY: Duration = Duration::from_millis(100);
/// Connect timeout, and how long a read or write may block, before the connection counts as failed.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// A churn that fell this far behind its schedule starts a new one from now (it does not burst).
const MAX_LAG: Duration = Duration::from_secs(1);

/// What the load and the control loop count, shared by all threads of the soak.
pub(super) struct Tally {
    started: Instant,
    /// Connections that passed (churn, to and from the added pods, long streams held to the end).
    pub(super) conns_ok: AtomicU64,
    /// Connections that failed.
    pub(super) conns_failed: AtomicU64,
    /// [`BLOCK`]s the long streams echoed.
    pub(super) stream_blocks: AtomicU64,
    /// Failures that are not a connection's.
    pub(super) errors: AtomicU64,
    /// Pods added through the CNI chain.
    pub(super) pods_added: AtomicU64,
    /// Pods deleted again.
    pub(super) pods_removed: AtomicU64,
    /// Policy pushes written.
    pub(super) pushes: AtomicU64,
    /// Pushes the node showed in `/config_dump`.
    pub(super) pushes_seen: AtomicU64,
    /// The first [`KEPT_REASONS`] failures and errors, each with its time into the run.
    reasons: Mutex<Vec<String>>,
}

impl Tally {
    /// A tally whose reasons are timed from `started`.
    pub(super) fn new(started: Instant) -> Tally {
        Tally {
            started,
            conns_ok: AtomicU64::new(0),
            conns_failed: AtomicU64::new(0),
            stream_blocks: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            pods_added: AtomicU64::new(0),
            pods_removed: AtomicU64::new(0),
            pushes: AtomicU64::new(0),
            pushes_seen: AtomicU64::new(0),
            reasons: Mutex::new(Vec::new()),
        }
    }

    /// Counts a connection that passed.
    pub(super) fn ok(&self) {
        self.conns_ok.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a failed connection and keeps `why`.
    pub(super) fn conn_failed(&self, why: String) {
        self.conns_failed.fetch_add(1, Ordering::Relaxed);
        self.keep(why);
    }

    /// Counts an error that is not a connection's and keeps `why`.
    pub(super) fn error(&self, why: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.keep(why);
    }

    /// Keeps `why` (and prints it) while fewer than [`KEPT_REASONS`] are kept; later ones are only
    /// counted, so a run that goes wrong does not flood the terminal.
    fn keep(&self, why: String) {
        let line = format!("{:.1} s: {why}", self.started.elapsed().as_secs_f64());
        if let Ok(mut r) = self.reasons.lock()
            && r.len() < KEPT_REASONS
        {
            eprintln!("soak: {line}");
            r.push(line);
            if r.len() == KEPT_REASONS {
                eprintln!("soak: further failures are only counted");
            }
        }
    }

    /// The failures and errors kept so far.
    pub(super) fn reasons(&self) -> Vec<String> {
        self.reasons.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// `counter`'s value now.
    pub(super) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Fills `buf` with the bytes of message `seed` (different for neighbouring seeds, and along the
/// buffer, so a shifted or mixed-up echo does not compare equal).
pub(super) fn pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        for (b, v) in chunk.iter_mut().zip(x.to_le_bytes()) {
            *b = v;
        }
    }
}

/// One short connection from the calling thread's netns: connect to `to`, send the [`MSG`]-byte
/// message `seed`, read its echo and check it, then wait for the server to close.
pub(super) fn exchange(to: SocketAddr, seed: u64) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.set_nodelay(true)?;
    let mut msg = [0u8; MSG];
    pattern(&mut msg, seed);
    s.write_all(&msg)?;
    let mut back = [0u8; MSG];
    s.read_exact(&mut back)?;
    if back != msg {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the echo differs from what was sent",
        ));
    }
    let mut rest = [0u8; 1];
    match s.read(&mut rest)? {
        0 => Ok(()),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "bytes after the echo",
        )),
    }
}

/// Short connections ([`exchange`]) from the calling thread's netns to `to` at `rate` per second
/// until `stop`; each passes or fails in `tally`.
pub(super) fn churn(to: SocketAddr, rate: u32, stop: &AtomicBool, tally: &Tally) {
    let every = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut next = Instant::now();
    let mut seed = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        } else if now - next > MAX_LAG {
            next = now;
        }
        next += every;
        seed += 1;
        match exchange(to, seed) {
            Ok(()) => tally.ok(),
            Err(e) => tally.conn_failed(format!("churn connection #{seed} to {to}: {e}")),
        }
    }
}

/// Long stream `id` from the calling thread's netns to the echo server at `to` until `stop`: one
/// connection echoing a [`BLOCK`] every [`BLOCK_EVERY`]. A stream that breaks counts as a failed
/// connection and is opened again; one held to the end counts as passed.
pub(super) fn stream(to: SocketAddr, id: u64, stop: &AtomicBool, tally: &Tally) {
    let mut opened = 0u64;
    while !stop.load(Ordering::Relaxed) {
        opened += 1;
        match hold_stream(to, id, opened, stop, tally) {
            Ok(()) => tally.ok(),
            Err(e) => {
                tally.conn_failed(format!("stream {id} (connection {opened}) to {to}: {e}"));
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

/// One connection of [`stream`]: blocks are written here and read back by a reader thread, so
/// neither direction waits for the other's buffers.
fn hold_stream(
    to: SocketAddr,
    id: u64,
    opened: u64,
    stop: &AtomicBool,
    tally: &Tally,
) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut reader = s.try_clone()?;
    // seeds of this connection's blocks: (id, connection, block) folded into one
    let seed = move |block: u64| (id << 48) ^ (opened << 32) ^ block;
    let (tx, rx) = std::sync::mpsc::sync_channel::<std::io::Result<u64>>(2);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut want = vec![0u8; BLOCK];
            let mut got = vec![0u8; BLOCK];
            for block in 0u64.. {
                let r = reader.read_exact(&mut got).and_then(|()| {
                    pattern(&mut want, seed(block));
                    if got == want {
                        Ok(block)
                    } else {
                        Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("block {block}: the echo differs from what was sent"),
                        ))
                    }
                });
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    return;
                }
            }
        });
        let result = (|| {
            let mut block = vec![0u8; BLOCK];
            let mut next = Instant::now();
            for n in 0u64.. {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                pattern(&mut block, seed(n));
                s.write_all(&block)?;
                match rx.recv_timeout(IO_TIMEOUT + IO_TIMEOUT) {
                    Ok(Ok(_)) => {
                        tally.stream_blocks.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("block {n}: no echo"),
                        ));
                    }
                }
                next += BLOCK_EVERY;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
            Ok(())
        })();
        // wakes the reader, which then ends (its sends fail once `rx` is gone, never block)
        let _ = s.shutdown(Shutdown::Both);
        drop(rx);
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::bench::measure::serve_echo;

    #[test]
    fn patterns_differ_by_seed_and_along_the_buffer() {
        let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
        pattern(&mut a, 1);
        pattern(&mut b, 2);
        assert_ne!(a, b);
        assert_ne!(a[..8], a[8..16]);
        pattern(&mut b, 1);
        assert_eq!(a, b);
    }

    #[test]
    fn exchanges_and_a_stream_pass_against_an_echo_server_and_fail_without_one() {
        let tally = Tally::new(Instant::now());
        let one_shot = serve_echo(
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind"),
            true,
        )
        .expect("serve");
        exchange(one_shot.addr, 7).expect("echoed");
        let kept = serve_echo(
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind"),
            false,
        )
        .expect("serve");
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| stream(kept.addr, 1, &stop, &tally));
            let deadline = Instant::now() + Duration::from_secs(20);
            while Tally::get(&tally.stream_blocks) < 3 {
                assert!(Instant::now() < deadline, "no blocks echoed");
                std::thread::sleep(Duration::from_millis(20));
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert_eq!(Tally::get(&tally.conns_ok), 1);
        assert_eq!(Tally::get(&tally.conns_failed), 0);
        // nothing listens on a port just freed
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        assert!(exchange(addr, 1).is_err());
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| stream(addr, 2, &stop, &tally));
            let deadline = Instant::now() + Duration::from_secs(20);
            while Tally::get(&tally.conns_failed) < 1 {
                assert!(Instant::now() < deadline, "the failure was not counted");
                std::thread::sleep(Duration::from_millis(20));
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert!(tally.reasons()[0].contains("stream 2 (connection 1)"));
    }
}
