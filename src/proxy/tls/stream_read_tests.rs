//! Tests of [`TlsStream`]'s read path: records split across socket reads (a held partial record
//! continued by a direct read, or finished through the receive buffer; a split header), and the
//! read streak's yield. Helpers come from the stream tests.

use super::*;

#[tokio::test]
async fn a_record_split_across_reads_is_continued_by_the_next_direct_read() {
    let (mut c, mut s) = ours().await;
    let mut rest = hold_a_partial_record(&mut c, &mut s).await;
    assert_eq!(s.direct_reads, 1, "{s:?}");
    // the rest of the record and a whole one after it, in one write
    let more = payload(20_000);
    c.write_all(&more).await.expect("write");
    c.flush().await.expect("flush");
    let mut tail = vec![0u8; 2 * (5 + 1 + 16) + 20_000];
    within(s.io.read_exact(&mut tail))
        .await
        .expect("raw records");
    rest.extend_from_slice(&tail);
    c.io.write_all(&rest).await.expect("rest");
    let mut buf = vec![0u8; 64 * 1024];
    // one read: the held part goes first in the caller's buffer, the socket's bytes after it,
    // and both records decrypt there (not the held record's rest alone first)
    let n = within(s.read(&mut buf)).await.expect("records");
    let mut want = payload(5000);
    want.extend_from_slice(&more);
    assert_eq!(n, want.len(), "both records in one read");
    assert!(buf[..n] == want[..]);
    assert_eq!(s.direct_reads, 2, "{s:?}");
    assert!(s.rbuf.is_empty());
}

#[tokio::test]
async fn a_small_buffer_finishes_a_held_record_through_the_receive_buffer() {
    let (mut c, mut s) = ours().await;
    let rest = hold_a_partial_record(&mut c, &mut s).await;
    c.io.write_all(&rest).await.expect("rest");
    // less room than the held part and a direct read's minimum: the receive buffer finishes it
    let mut small = vec![0u8; DIRECT_READ_MIN];
    let mut got = Vec::new();
    while got.len() < 5000 {
        let n = within(s.read(&mut small)).await.expect("record");
        got.extend_from_slice(&small[..n]);
    }
    assert!(got == payload(5000));
    assert_eq!(s.direct_reads, 1, "{s:?}");
}

#[tokio::test]
async fn a_record_header_split_across_reads_is_joined() {
    let (mut c, mut s) = ours().await;
    let rest = send_part_of_a_record(&mut c, &mut s, b"split header", 3).await;
    c.io.write_all(&rest).await.expect("the rest");
    let mut buf = vec![0u8; 64 * 1024];
    let n = within(s.read(&mut buf)).await.expect("record");
    assert_eq!(&buf[..n], b"split header");
}

/// Counts how often it is woken.
#[derive(Default)]
struct CountingWaker(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[tokio::test]
async fn a_long_read_streak_yields_once_per_streak_and_wakes_itself() {
    let small = payload(100 * 1024);
    let (mut c, mut s) = ours().await;
    let (_, got) =
        within(async { tokio::join!(send_all(&mut c, &small), read_large(&mut s)) }).await;
    assert_eq!(got.expect("read"), small);
    assert_eq!(s.read_yields, 0, "100 KiB do not make a streak");

    let bulk = payload(3 * READ_YIELD_AFTER + 12_345);
    // the whole transfer fits in the pipe, so the reader's socket never runs dry
    let (mut c, mut s) = ours_over(8 * 1024 * 1024).await;
    within(send_all(&mut c, &bulk)).await;
    // outside tokio's cooperative budget, which would end the pipe's reads in this one poll
    let (got, streaks) = tokio::task::unconstrained(async { read_counting_pending(&mut s) }).await;
    assert_eq!(got, bulk, "nothing lost or reordered across the yields");
    assert!(
        streaks.len() >= 2,
        "a yield after each READ_YIELD_AFTER bytes: {streaks:?}"
    );
    assert_eq!(s.read_yields, streaks.len() as u64);
    for n in streaks {
        assert!(
            (READ_YIELD_AFTER..READ_YIELD_AFTER + 256 * 1024).contains(&n),
            "a streak of {n} bytes before its yield"
        );
    }
}

/// Reads `s` to its end by polling it directly with a [`CountingWaker`] and 256 KiB reads;
/// returns the data and, for each read that returned `Pending` (each must have woken the waker
/// first), the bytes delivered since the previous one.
fn read_counting_pending(s: &mut TlsStream<DuplexStream>) -> (Vec<u8>, Vec<usize>) {
    let count = Arc::new(CountingWaker::default());
    let waker = std::task::Waker::from(count.clone());
    let mut cx = Context::from_waker(&waker);
    let mut buf = vec![0u8; 256 * 1024];
    let (mut got, mut streaks, mut streak) = (Vec::new(), Vec::new(), 0);
    loop {
        let mut rb = ReadBuf::new(&mut buf);
        match Pin::new(&mut *s).poll_read(&mut cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => break,
            Poll::Ready(Ok(())) => {
                streak += rb.filled().len();
                got.extend_from_slice(rb.filled());
            }
            Poll::Ready(Err(e)) => panic!("read: {e}"),
            Poll::Pending => {
                streaks.push(std::mem::take(&mut streak));
                assert_eq!(
                    count.0.load(std::sync::atomic::Ordering::Relaxed),
                    streaks.len(),
                    "a yield wakes its task before returning Pending"
                );
            }
        }
    }
    (got, streaks)
}

#[tokio::test]
async fn a_socket_that_runs_dry_starts_a_new_streak() {
    let part = payload(768 * 1024);
    let (mut c, mut s) = ours_over(8 * 1024 * 1024).await;
    let count = Arc::new(CountingWaker::default());
    let waker = std::task::Waker::from(count.clone());
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = Vec::new();
    for last in [false, true] {
        c.write_all(&part).await.expect("write");
        if last {
            c.shutdown().await.expect("close_notify");
        } else {
            c.flush().await.expect("flush");
        }
        let woken_before = count.0.load(std::sync::atomic::Ordering::Relaxed);
        let dry = tokio::task::unconstrained(async {
            let mut cx = Context::from_waker(&waker);
            loop {
                let mut rb = ReadBuf::new(&mut buf);
                match Pin::new(&mut s).poll_read(&mut cx, &mut rb) {
                    Poll::Ready(Ok(())) if rb.filled().is_empty() => return false,
                    Poll::Ready(Ok(())) => got.extend_from_slice(rb.filled()),
                    Poll::Ready(Err(e)) => panic!("read: {e}"),
                    Poll::Pending => return true,
                }
            }
        })
        .await;
        assert_eq!(
            dry, !last,
            "the first part runs the pipe dry, the second ends it"
        );
        assert_eq!(
            count.0.load(std::sync::atomic::Ordering::Relaxed),
            woken_before,
            "running dry is no yield"
        );
    }
    assert_eq!(got.len(), 2 * part.len());
    assert_eq!(s.read_yields, 0, "1.5 MiB in two streaks of 768 KiB");
}
