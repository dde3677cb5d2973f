//! Exponential backoff for every retry and reconnect loop of the node: a [`Policy`] (the numbers,
//! built in `const`) and a [`Backoff`] (the state of one thing being retried).
//!
//! The nominal delay starts at the policy's `initial` and is multiplied by its `multiplier` after
//! each delay handed out, never above `max`. Each delay is the nominal one times a factor drawn
//! uniformly from `[1 - jitter, 1 + jitter]`, then capped at `max` (so at the cap, jitter can only
//! shorten a delay). [`Backoff::reset`] goes back to `initial`, typically after a success. Units:
//! delays are [`Duration`]s; the multiplier is an integer factor (exact `Duration` arithmetic, no
//! float drift); the jitter is a fraction of the nominal delay (`0.2` = ±20 %).
//!
//! Presets, one per caller, with their source:
//! - [`CA_RETRY`]: failed certificate fetches (ztunnel `src/identity/manager.rs`);
//! - [`XDS_RECONNECT`]: the delta ADS stream to istiod (ztunnel `src/xds/client.rs`);
//! - [`ZDS_RECONNECT`]: the proxy's connection to the node agent (ztunnel
//!   `src/inpod/workloadmanager.rs`);
//! - [`WATCH_RETRY`]: the Kubernetes watches after an error (ztnode's choice);
//! - [`RECONCILE_RETRY`]: a pod whose Kubernetes reconcile failed (Istio
//!   `cni/pkg/nodeagent/informers.go`).
//!
//! A bottom module: it imports no role.

use std::time::Duration;

/// Certificate fetch retries, per identity: 500 ms, ×2, ±20 % jitter, at most 150 s (spec §4
/// "Rotation"; ztunnel `src/identity/manager.rs`: `ExponentialBackoff { initial_interval: 500ms,
/// multiplier: 2.0, randomization_factor: 0.2, max_interval:
/// CERT_REFRESH_FAILURE_RETRY_DELAY_MAX_INTERVAL (150 s) }`).
pub const CA_RETRY: Policy = Policy::new(Duration::from_millis(500), Duration::from_secs(150))
    .with_multiplier(2)
    .with_jitter(0.2);

/// Reconnects of the delta ADS stream to istiod: 10 ms, ×2, at most 15 s, ±50 % jitter, reset by
/// the caller after a stream that got a response (spec ztunnel.md §5 "XDS"; ztunnel
/// `src/xds/client.rs` `INITIAL_BACKOFF`, `MAX_BACKOFF`, doubled in `run_loop`). The jitter is
/// ztnode's own (ztunnel's xDS delays are not jittered, and it doubles before its first wait):
/// many nodes losing istiod at once do not come back in lockstep.
pub const XDS_RECONNECT: Policy = Policy::new(Duration::from_millis(10), Duration::from_secs(15))
    .with_multiplier(2)
    .with_jitter(0.5);

/// Reconnects of the proxy to the node agent's ZDS socket: 10 ms, ×2, at most 15 s, no jitter,
/// reset by the caller once connected (spec ztunnel.md §1 "Reconnect"; ztunnel
/// `src/inpod/workloadmanager.rs` `connect`, whose first wait is already doubled to 20 ms; ztnode
/// waits 10 ms first).
pub const ZDS_RECONNECT: Policy = Policy::new(Duration::from_millis(10), Duration::from_secs(15))
    .with_multiplier(2)
    .with_jitter(0.0);

/// The Kubernetes watches (pods of this node, namespaces) after an error: 500 ms, ×2, ±20 %
/// jitter, at most 5 s, so a node agent notices an API server that is back within seconds (kube-rs'
/// default grows to 30 s: after a long outage the agent would stay blind for up to half a minute).
pub const WATCH_RETRY: Policy = Policy::new(Duration::from_millis(500), Duration::from_secs(5))
    .with_multiplier(2)
    .with_jitter(0.2);

/// Retries of one pod's failed reconcile: 5 ms, ×2, at most 5 s, no jitter, unlimited attempts
/// (spec istio-cni.md §3.3; Istio `cni/pkg/nodeagent/informers.go`:
/// `NewTypedItemExponentialFailureRateLimiter(5*time.Millisecond, 5*time.Second)`).
pub const RECONCILE_RETRY: Policy = Policy::new(Duration::from_millis(5), Duration::from_secs(5))
    .with_multiplier(2)
    .with_jitter(0.0);

/// The numbers of an exponential backoff; see the module docs for how a delay is made. Built in
/// `const` ([`Policy::new`] and the `with_*` methods check their arguments, so a bad preset fails
/// to compile).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    initial: Duration,
    max: Duration,
    multiplier: u32,
    jitter: f64,
}

impl Policy {
    /// Delays from `initial` up to `max`, doubling, without jitter.
    ///
    /// Panics (at compile time in a `const`) when `initial` is longer than `max`.
    pub const fn new(initial: Duration, max: Duration) -> Policy {
        assert!(
            initial.as_nanos() <= max.as_nanos(),
            "backoff: initial delay above max"
        );
        Policy {
            initial,
            max,
            multiplier: 2,
            jitter: 0.0,
        }
    }

    /// The same with the nominal delay multiplied by `multiplier` after each delay (`1` =
    /// constant delay).
    ///
    /// Panics (at compile time in a `const`) when `multiplier` is 0.
    pub const fn with_multiplier(self, multiplier: u32) -> Policy {
        assert!(multiplier >= 1, "backoff: multiplier below 1");
        Policy { multiplier, ..self }
    }

    /// The same with each delay scaled by a uniform factor in `[1 - fraction, 1 + fraction]`.
    ///
    /// Panics (at compile time in a `const`) unless `0 <= fraction <= 1`.
    pub const fn with_jitter(self, fraction: f64) -> Policy {
        assert!(
            fraction >= 0.0 && fraction <= 1.0,
            "backoff: jitter outside [0, 1]"
        );
        Policy {
            jitter: fraction,
            ..self
        }
    }

    /// First nominal delay.
    pub const fn initial(&self) -> Duration {
        self.initial
    }

    /// Largest delay, nominal or jittered.
    pub const fn max(&self) -> Duration {
        self.max
    }

    /// Growth of the nominal delay per delay handed out.
    pub const fn multiplier(&self) -> u32 {
        self.multiplier
    }

    /// Jitter as a fraction of the nominal delay.
    pub const fn jitter(&self) -> f64 {
        self.jitter
    }
}

/// The backoff state of one retried thing (a connection, an identity, a pod): its [`Policy`] and
/// the nominal delay of the next retry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    policy: Policy,
    nominal: Duration,
}

impl Backoff {
    /// Starts at the policy's `initial`.
    pub const fn new(policy: Policy) -> Backoff {
        Backoff {
            policy,
            nominal: policy.initial,
        }
    }

    /// The policy.
    pub const fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The nominal (un-jittered) next delay.
    pub const fn nominal(&self) -> Duration {
        self.nominal
    }

    /// The next delay, jittered with `unit`, a uniform sample of `[0, 1]` (`0.5` = no jitter, `0`
    /// and `1` = the extremes; clamped, NaN counts as `0.5`). Deterministic, for tests.
    pub fn next_with(&mut self, unit: f64) -> Duration {
        let Policy {
            max,
            multiplier,
            jitter,
            ..
        } = self.policy;
        let delay = if jitter == 0.0 {
            self.nominal
        } else {
            let unit = if unit.is_nan() {
                0.5
            } else {
                unit.clamp(0.0, 1.0)
            };
            // `Duration::mul_f64`, but a product beyond `Duration::MAX` is `max` instead of a panic.
            let factor = 1.0 + jitter * (2.0 * unit - 1.0);
            Duration::try_from_secs_f64(factor * self.nominal.as_secs_f64()).unwrap_or(max)
        };
        self.nominal = self.nominal.saturating_mul(multiplier).min(max);
        delay.min(max)
    }

    /// The next delay, with random jitter (no random number is drawn without jitter).
    pub fn next_delay(&mut self) -> Duration {
        let unit = if self.policy.jitter == 0.0 {
            0.5
        } else {
            fastrand::f64()
        };
        self.next_with(unit)
    }

    /// Back to the policy's `initial`.
    pub fn reset(&mut self) {
        self.nominal = self.policy.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_500ms_up_to_150s() {
        let mut b = Backoff::new(CA_RETRY);
        let nominal: Vec<_> = (0..12).map(|_| b.next_with(0.5)).collect();
        let ms: Vec<u128> = nominal.iter().map(Duration::as_millis).collect();
        assert_eq!(
            ms,
            [
                500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 150000, 150000, 150000
            ]
        );
        b.reset();
        assert_eq!(b.next_with(0.5), CA_RETRY.initial());
    }

    #[test]
    fn jitter_stays_within_20_percent_and_under_the_cap() {
        let max = CA_RETRY.max();
        let mut low = Backoff::new(CA_RETRY);
        let mut high = Backoff::new(CA_RETRY);
        assert_eq!(low.next_with(0.0), Duration::from_millis(400));
        assert_eq!(high.next_with(1.0), Duration::from_millis(600));
        let mut b = Backoff::new(CA_RETRY);
        for _ in 0..20 {
            let d = b.next_delay();
            assert!(d >= Duration::from_millis(400) && d <= max, "{d:?}");
        }
        // at the cap, jitter may only lower the delay
        let mut capped = Backoff {
            policy: CA_RETRY,
            nominal: max,
        };
        assert_eq!(capped.next_with(1.0), max);
        assert_eq!(capped.next_with(0.0), max.mul_f64(0.8));
    }

    #[test]
    fn the_ca_preset_is_ztunnels() {
        assert_eq!(CA_RETRY.initial(), Duration::from_millis(500));
        assert_eq!(CA_RETRY.max(), Duration::from_secs(150));
        assert_eq!(CA_RETRY.multiplier(), 2);
        assert_eq!(CA_RETRY.jitter(), 0.2);
    }

    #[test]
    fn xds_reconnects_double_from_10ms_to_15s_with_jitter() {
        let mut b = Backoff::new(XDS_RECONNECT);
        let max = XDS_RECONNECT.max();
        let mut steps = Vec::new();
        for _ in 0..16 {
            let step = b.nominal();
            let delay = b.next_delay();
            assert!(
                delay >= step / 2 && delay <= (step * 3 / 2).min(max),
                "{delay:?} for {step:?}"
            );
            steps.push(step);
        }
        assert_eq!(steps[0], Duration::from_millis(10));
        assert_eq!(steps[1], Duration::from_millis(20));
        assert_eq!(steps[10], Duration::from_millis(10_240));
        assert_eq!(steps[11], Duration::from_secs(15));
        assert_eq!(steps[15], Duration::from_secs(15));
        // 50-150 % of the step, capped at the max
        let mut b = Backoff::new(XDS_RECONNECT);
        assert_eq!(b.next_with(0.0), Duration::from_millis(5));
        assert_eq!(b.next_with(1.0), Duration::from_millis(30));
        let mut capped = Backoff {
            policy: XDS_RECONNECT,
            nominal: max,
        };
        assert_eq!(capped.next_with(1.0), max);
        assert_eq!(capped.next_with(0.0), max / 2);
        capped.reset();
        assert_eq!(capped.nominal(), Duration::from_millis(10));
    }

    #[test]
    fn zds_reconnects_double_from_10ms_to_15s_without_jitter() {
        let mut b = Backoff::new(ZDS_RECONNECT);
        let ms: Vec<u128> = (0..13).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(
            ms,
            [
                10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120, 10240, 15000, 15000
            ]
        );
        assert_eq!(b.next_with(0.0), Duration::from_secs(15), "no jitter");
        b.reset();
        assert_eq!(b.next_with(1.0), Duration::from_millis(10), "no jitter");
    }

    #[test]
    fn reconcile_retries_double_from_5ms_to_5s_without_jitter() {
        let mut b = Backoff::new(RECONCILE_RETRY);
        let ms: Vec<u128> = (0..12).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(
            ms,
            [5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5000, 5000]
        );
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(5));
    }

    #[test]
    fn odd_units_multipliers_and_long_runs_stay_in_range() {
        let mut b = Backoff::new(CA_RETRY);
        assert_eq!(b.next_with(f64::NAN), Duration::from_millis(500));
        assert_eq!(b.next_with(-3.0), Duration::from_millis(800));
        assert_eq!(b.next_with(7.0), Duration::from_millis(2400));
        let constant =
            Policy::new(Duration::from_secs(1), Duration::from_secs(1)).with_multiplier(1);
        let mut c = Backoff::new(constant);
        assert_eq!(c.next_delay(), Duration::from_secs(1));
        assert_eq!(c.next_delay(), Duration::from_secs(1));
        let huge = Policy::new(Duration::from_secs(1), Duration::MAX).with_multiplier(u32::MAX);
        let mut h = Backoff::new(huge);
        for _ in 0..10 {
            h.next_delay();
        }
        assert_eq!(
            h.next_delay(),
            Duration::MAX,
            "saturates instead of overflowing"
        );
        let mut j = Backoff::new(Policy::new(Duration::MAX, Duration::MAX).with_jitter(0.5));
        assert_eq!(
            j.next_with(1.0),
            Duration::MAX,
            "jitter beyond Duration::MAX is max"
        );
    }
}
