//! Tests of [`CertManager`] with a scripted remote CA, on paused tokio time (the manager's clock
//! follows tokio's, so refresh and backoff times are exact).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::BoxFuture;
use tokio::time::Instant;

use super::*;

/// A clock that moves with tokio's (paused) time.
fn tokio_clock() -> Clock {
    let base = SystemTime::now();
    let start = Instant::now();
    Arc::new(move || base + start.elapsed())
}

/// A remote CA answering from a script (`Ok` when the script is empty).
struct FakeCa {
    ca: Ca,
    clock: Clock,
    lifetime: Duration,
    delay: Duration,
    script: Mutex<VecDeque<Result<(), CaClientError>>>,
    fetches: Mutex<Vec<(Identity, Instant)>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    root: rustls_pki_types::CertificateDer<'static>,
}

impl FakeCa {
    fn new(clock: Clock, lifetime: Duration) -> Arc<FakeCa> {
        let ca = Ca::generate().unwrap();
        Arc::new(FakeCa {
            root: ca.root_der(),
            ca,
            clock,
            lifetime,
            delay: Duration::ZERO,
            script: Mutex::new(VecDeque::new()),
            fetches: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        })
    }

    fn script(&self, outcomes: impl IntoIterator<Item = Result<(), CaClientError>>) {
        self.script.lock().unwrap().extend(outcomes);
    }

    /// Seconds (since `t0`) of each fetch.
    fn fetch_times(&self, t0: Instant) -> Vec<f64> {
        let f = self.fetches.lock().unwrap();
        f.iter().map(|(_, t)| (*t - t0).as_secs_f64()).collect()
    }

    fn count(&self) -> usize {
        self.fetches.lock().unwrap().len()
    }
}

impl RemoteCa for FakeCa {
    fn fetch<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Result<Issued, CaClientError>> {
        Box::pin(async move {
            self.fetches
                .lock()
                .unwrap()
                .push((id.clone(), Instant::now()));
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let outcome = self.script.lock().unwrap().pop_front().unwrap_or(Ok(()));
            outcome?;
            let mut cert = self.ca.issue(id, self.lifetime).unwrap();
            // validity on the manager's clock
            cert.not_before = (self.clock)();
            cert.not_after = cert.not_before + self.lifetime;
            Ok(Issued {
                cert,
                roots: vec![self.root.clone()],
            })
        })
    }

    fn address(&self) -> String {
        "https://fake-ca:15012".into()
    }
}

fn unavailable() -> Result<(), CaClientError> {
    Err(CaClientError::Status {
        code: tonic::Code::Unavailable,
        message: "down".into(),
    })
}

fn id(sa: &str) -> Identity {
    Identity::new(DEFAULT_TRUST_DOMAIN, "default", sa)
}

fn remote(fake: &Arc<FakeCa>, clock: Clock) -> Arc<CertManager> {
    let opts = CertOptions {
        clock,
        ..CertOptions::new(fake.lifetime)
    };
    let bundle = Arc::new(TrustBundle::new(Vec::new(), &[]));
    CertManager::remote(fake.clone(), bundle, opts)
}

#[tokio::test(start_paused = true)]
async fn ensure_fetches_once_and_get_serves_the_cache_until_the_last_release() {
    let clock = tokio_clock();
    let fake = FakeCa::new(clock.clone(), Duration::from_secs(3600));
    let mgr = remote(&fake, clock);
    let me = id("a");
    assert!(matches!(
        mgr.get(&me),
        Err(IdentityError::NotFetched { .. })
    ));
    let first = mgr.ensure(&me).await.unwrap();
    assert!(Arc::ptr_eq(&first, &mgr.get(&me).unwrap()));
    let again = mgr.ensure(&me).await.unwrap();
    assert!(Arc::ptr_eq(&first, &again), "no second fetch");
    assert_eq!(fake.count(), 1);
    assert_eq!(mgr.holders(&me), 2);
    // the CA's root is trusted while the identity is held
    assert_eq!(mgr.bundle().certificates(), vec![fake.root.clone()]);

    mgr.release(&me);
    assert!(mgr.get(&me).is_ok(), "one holder left");
    mgr.release(&me);
    assert_eq!(mgr.holders(&me), 0);
    assert!(matches!(
        mgr.get(&me),
        Err(IdentityError::NotFetched { .. })
    ));
    assert!(mgr.certificates().is_empty());
    assert!(mgr.bundle().certificates().is_empty(), "its roots went too");
    // the worker stopped: no refresh later
    tokio::time::sleep(Duration::from_secs(7200)).await;
    assert_eq!(fake.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_certificate_is_refreshed_at_half_its_lifetime() {
    let clock = tokio_clock();
    let fake = FakeCa::new(clock.clone(), Duration::from_secs(100));
    let mgr = remote(&fake, clock);
    let t0 = Instant::now();
    let me = id("b");
    let first = mgr.ensure(&me).await.unwrap();
    tokio::time::sleep(Duration::from_secs(49)).await;
    assert_eq!(fake.count(), 1);
    assert!(Arc::ptr_eq(&first, &mgr.get(&me).unwrap()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(fake.fetch_times(t0), [0.0, 50.0]);
    let second = mgr.get(&me).unwrap();
    assert_ne!(first.serial_hex(), second.serial_hex());
    tokio::time::sleep(Duration::from_secs(50)).await;
    assert_eq!(fake.fetch_times(t0), [0.0, 50.0, 100.0]);
}

#[tokio::test(start_paused = true)]
async fn failed_refreshes_back_off_and_keep_the_old_certificate() {
    let clock = tokio_clock();
    let fake = FakeCa::new(clock.clone(), Duration::from_secs(100));
    fake.script([Ok(()), unavailable(), unavailable(), unavailable()]);
    let mgr = remote(&fake, clock);
    let t0 = Instant::now();
    let me = id("c");
    let first = mgr.ensure(&me).await.unwrap();
    tokio::time::sleep(Duration::from_secs(50)).await;
    // the refresh at 50 s failed: the old certificate is still served
    assert!(Arc::ptr_eq(&first, &mgr.get(&me).unwrap()));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let times = fake.fetch_times(t0);
    assert_eq!(times.len(), 5, "{times:?}");
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps[0], 50.0);
    for (gap, nominal) in gaps[1..].iter().zip([0.5, 1.0, 2.0]) {
        assert!(
            (nominal * 0.8..=nominal * 1.2).contains(gap),
            "gap {gap} for nominal {nominal}: {times:?}"
        );
    }
    let renewed = mgr.get(&me).unwrap();
    assert_ne!(first.serial_hex(), renewed.serial_hex());
}

#[tokio::test(start_paused = true)]
async fn an_expired_certificate_is_not_served() {
    let clock = tokio_clock();
    let fake = FakeCa::new(clock.clone(), Duration::from_secs(10));
    fake.script([Ok(())]);
    fake.script((0..100).map(|_| unavailable()));
    let mgr = remote(&fake, clock);
    let me = id("d");
    mgr.ensure(&me).await.unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert!(mgr.get(&me).is_ok(), "valid until 10 s");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let err = mgr.get(&me).unwrap_err();
    assert!(matches!(err, IdentityError::Expired { .. }), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_refused_token_fails_ensure_at_once_with_the_cas_words() {
    let clock = tokio_clock();
    let fake = FakeCa::new(clock.clone(), Duration::from_secs(100));
    fake.script([Err(CaClientError::Unauthenticated {
        message: "unknown token".into(),
    })]);
    let mgr = remote(&fake, clock);
    let me = id("e");
    let t0 = Instant::now();
    let err = mgr.ensure(&me).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_millis(100), "no waiting");
    assert_eq!(
        err.to_string(),
        "fetching the certificate for spiffe://cluster.local/ns/default/sa/e failed: \
         CA refused the token (UNAUTHENTICATED): unknown token"
    );
    assert_eq!(mgr.holders(&me), 0, "no reference kept");
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(
        fake.count(),
        1,
        "the worker stopped with the last reference"
    );
}

#[tokio::test(start_paused = true)]
async fn ensure_waits_through_outages_until_its_timeout() {
    let clock = tokio_clock();
    let fake = FakeCa::new(clock.clone(), Duration::from_secs(100));
    fake.script([unavailable()]);
    let mgr = remote(&fake, clock.clone());
    let t0 = Instant::now();
    // one outage: the retry ~0.5 s later succeeds
    mgr.ensure(&id("f")).await.unwrap();
    let waited = t0.elapsed().as_secs_f64();
    assert!((0.4..=0.6).contains(&waited), "{waited}");

    // a lasting outage: fails after ENSURE_TIMEOUT, naming the last failure
    fake.script((0..100).map(|_| unavailable()));
    let t0 = Instant::now();
    let err = mgr.ensure(&id("g")).await.unwrap_err();
    assert_eq!(t0.elapsed(), ENSURE_TIMEOUT);
    assert!(
        matches!(
            &err,
            IdentityError::FetchTimeout {
                last_error: Some(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("UNAVAILABLE"), "{err}");
    assert!(err.to_string().contains("https://fake-ca:15012"), "{err}");
    assert_eq!(mgr.holders(&id("g")), 0);
}

#[tokio::test(start_paused = true)]
async fn a_ca_that_never_answers_is_named_when_ensure_gives_up() {
    // a partition: the first call hangs past ENSURE_TIMEOUT, no failure is recorded yet
    let clock = tokio_clock();
    let mut fake = FakeCa::new(clock.clone(), Duration::from_secs(3600));
    Arc::get_mut(&mut fake).unwrap().delay = Duration::from_secs(30);
    let mgr = remote(&fake, clock);
    let err = mgr.ensure(&id("h")).await.unwrap_err();
    assert!(
        matches!(
            &err,
            IdentityError::FetchTimeout {
                last_error: None,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("from the CA https://fake-ca:15012 within 4s: no answer yet"),
        "{text}"
    );
    assert_eq!(mgr.holders(&id("h")), 0);
}

#[tokio::test(start_paused = true)]
async fn at_most_eight_csrs_are_in_flight() {
    let clock = tokio_clock();
    let mut fake = FakeCa::new(clock.clone(), Duration::from_secs(3600));
    Arc::get_mut(&mut fake).unwrap().delay = Duration::from_secs(1);
    let mgr = remote(&fake, clock);
    let ids: Vec<_> = (0..20).map(|i| id(&format!("sa{i}"))).collect();
    let t0 = Instant::now();
    let all = futures::future::join_all(ids.iter().map(|i| mgr.ensure(i))).await;
    assert!(all.iter().all(Result::is_ok));
    assert_eq!(
        fake.max_in_flight.load(Ordering::SeqCst),
        MAX_CONCURRENT_CSRS
    );
    assert_eq!(fake.count(), 20);
    // 20 fetches of 1 s, 8 at a time: 3 rounds
    assert_eq!(t0.elapsed(), Duration::from_secs(3));
}

#[tokio::test]
async fn the_built_in_ca_counts_holders_too() {
    let mgr = CertManager::new(Ca::generate().unwrap(), DEFAULT_CERT_LIFETIME);
    assert!(!mgr.is_remote());
    let me = id("h");
    let a = mgr.ensure(&me).await.unwrap();
    let b = mgr.ensure(&me).await.unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(mgr.holders(&me), 2);
    mgr.release(&me);
    assert_eq!(mgr.certificates().len(), 1);
    mgr.release(&me);
    assert!(mgr.certificates().is_empty());
    // get() still issues on demand
    assert!(mgr.get(&me).is_ok());
}
