//! Retry delays after a failed certificate fetch (spec §4 "Rotation"; ztunnel
//! `src/identity/manager.rs`): 500 ms, doubling, ±20 % jitter, at most 150 s.

use std::time::Duration;

/// First retry delay.
pub const INITIAL: Duration = Duration::from_millis(500);
/// Growth per failure.
pub const MULTIPLIER: f64 = 2.0;
/// Each delay is the nominal one times a uniform factor in `[1 - JITTER, 1 + JITTER]`.
pub const JITTER: f64 = 0.2;
/// Largest delay (also after jitter).
pub const MAX: Duration = Duration::from_secs(150);

/// Exponential backoff state of one identity. [`Backoff::reset`] after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    nominal: Duration,
}

impl Backoff {
    /// Starts at [`INITIAL`].
    pub fn new() -> Backoff {
        Backoff { nominal: INITIAL }
    }

    /// The next delay, jittered with `unit` (a uniform sample of `[0, 1)`; `0.5` = no jitter).
    pub fn next_with(&mut self, unit: f64) -> Duration {
        let factor = 1.0 + JITTER * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
        let delay = self.nominal.mul_f64(factor).min(MAX);
        self.nominal = self.nominal.mul_f64(MULTIPLIER).min(MAX);
        delay
    }

    /// The next delay with random jitter.
    pub fn next_delay(&mut self) -> Duration {
        self.next_with(fastrand::f64())
    }

    /// Back to [`INITIAL`].
    pub fn reset(&mut self) {
        self.nominal = INITIAL;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_500ms_up_to_150s() {
        let mut b = Backoff::new();
        let nominal: Vec<_> = (0..12).map(|_| b.next_with(0.5)).collect();
        let ms: Vec<u128> = nominal.iter().map(Duration::as_millis).collect();
        assert_eq!(
            ms,
            [
                500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 150000, 150000, 150000
            ]
        );
        b.reset();
        assert_eq!(b.next_with(0.5), INITIAL);
    }

    #[test]
    fn jitter_stays_within_20_percent_and_under_the_cap() {
        let mut low = Backoff::new();
        let mut high = Backoff::new();
        assert_eq!(low.next_with(0.0), Duration::from_millis(400));
        assert_eq!(high.next_with(1.0), Duration::from_millis(600));
        let mut b = Backoff::new();
        for _ in 0..20 {
            let d = b.next_delay();
            assert!(d >= Duration::from_millis(400) && d <= MAX, "{d:?}");
        }
        // at the cap, jitter may only lower the delay
        let mut capped = Backoff { nominal: MAX };
        assert_eq!(capped.next_with(1.0), MAX);
        assert_eq!(capped.next_with(0.0), MAX.mul_f64(0.8));
    }
}
