//! The one backoff of the retry loops: a bound that starts at `first`, doubles per retry
//! up to `ceiling`, and a wait jittered into the upper half of that bound by a number the
//! caller draws. The draw is the caller's (a hash of what is retried and the retry number,
//! or a seeded generator's next value), so a wait is a pure function of its inputs: a test
//! pins it without a clock, and under tokio's paused clock the simulation replays it seed
//! for seed. Jitter keeps the retries of many writers, steps or readers that failed
//! together from coming back in lockstep; the upper half keeps every wait at least half
//! its bound, so a store that is down is never knocked on at once again.
//!
//! Not the `backon` crate: its jitter adds a random part of up to the whole delay (the wait
//! lies in `[delay, 2·delay)`, not in the upper half of the bound), drawn from a generator
//! the backoff owns and advances per wait, over an `f32` factor. A wait there depends on how
//! many waits were drawn before it rather than on (retry, salt), so it cannot give the
//! waits these loops give (which the simulation's traces pin), and siblings that share no
//! generator cannot be spread apart deterministically.
//!
//! Pauses that do not grow and are not jittered are not backoffs and stay constants of
//! their loops: the fixed re-reads of a lagging store replica (the watch's channel and
//! replay), the Celeriant client's short linear retry of a lost reply within a request's
//! deadline, the periodic resyncs.

use std::time::Duration;

/// Doublings past which a bound stops growing: `first` · 2^30 is past any ceiling in use,
/// and the factor still fits a `u32`.
const MAX_DOUBLINGS: u32 = 30;

/// A capped, doubling backoff with its jitter's grain (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    ceiling: Duration,
    /// The jitter moves a wait in whole grains.
    grain: Duration,
}

impl Backoff {
    /// Bounds that start at `first` and double per retry up to `ceiling`; jitter in
    /// nanoseconds.
    pub const fn new(first: Duration, ceiling: Duration) -> Self {
        Self {
            first,
            ceiling,
            grain: Duration::from_nanos(1),
        }
    }

    /// The same bound for every retry.
    pub const fn fixed(bound: Duration) -> Self {
        Self::new(bound, bound)
    }

    /// Jitter in whole `grain`s (say milliseconds) instead of nanoseconds.
    pub const fn in_grains_of(self, grain: Duration) -> Self {
        Self { grain, ..self }
    }

    /// The bound of retry `retry` (1-based; 0 counts as 1): `first` · 2^(retry − 1), at
    /// most `ceiling`.
    pub fn bound(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(MAX_DOUBLINGS);
        self.first
            .saturating_mul(1u32 << doublings)
            .min(self.ceiling)
    }

    /// The wait before retry `retry`: in the upper half of its bound, `[bound/2, bound)`,
    /// at the grain `draw` picks (`draw` modulo the grains in that half). A half shorter
    /// than one grain is waited whole.
    pub fn wait(&self, retry: u32, draw: u64) -> Duration {
        let half = self.bound(retry) / 2;
        let grain = self.grain.as_nanos().max(1);
        let grains = u64::try_from(half.as_nanos() / grain)
            .unwrap_or(u64::MAX)
            .max(1);
        let offset = grain * u128::from(draw % grains);
        half + Duration::from_nanos(u64::try_from(offset).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Rule: a bound starts at `first`, doubles per retry and stops at the ceiling; retry 0
    /// is the first, and a retry count far past the ceiling neither overflows nor drops.
    #[test]
    fn bounds_double_from_the_first_up_to_the_ceiling() {
        let b = Backoff::new(100 * MS, 5_000 * MS);
        let bounds: Vec<u64> = (0..=8).map(|r| b.bound(r).as_millis() as u64).collect();
        assert_eq!(
            bounds,
            [100, 100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000]
        );
        assert_eq!(b.bound(u32::MAX), 5_000 * MS);
        let fixed = Backoff::fixed(20 * MS);
        assert!((0..50).all(|r| fixed.bound(r) == 20 * MS));
    }

    /// Rule: a wait lies in the upper half of its bound, `[bound/2, bound)`, moves with the
    /// draw in whole grains, and is the same for the same (retry, draw).
    #[test]
    fn waits_lie_in_the_upper_half_of_their_bound_in_whole_grains() {
        let nanos = Backoff::new(2 * MS, 200 * MS);
        let millis = Backoff::fixed(1_000 * MS).in_grains_of(MS);
        for retry in 0..20 {
            for draw in [0, 1, 999, 12_345_678_901, u64::MAX] {
                for b in [nanos, millis] {
                    let (bound, wait) = (b.bound(retry), b.wait(retry, draw));
                    assert!(wait >= bound / 2 && wait < bound, "{b:?} {retry} {draw}");
                    assert_eq!(wait, b.wait(retry, draw));
                }
                assert_eq!(millis.wait(retry, draw).subsec_nanos() % 1_000_000, 0);
            }
        }
        assert_eq!(millis.wait(1, 0), 500 * MS);
        assert_eq!(millis.wait(1, 499), 999 * MS);
        assert_eq!(millis.wait(1, 500), 500 * MS);
        assert_eq!(nanos.wait(1, 7), MS + Duration::from_nanos(7));
    }

    /// Rule: a bound too short to jitter (a half under one grain) is waited at its half,
    /// with no division by zero.
    #[test]
    fn a_bound_under_two_grains_waits_its_half() {
        let b = Backoff::fixed(Duration::from_micros(1_500)).in_grains_of(MS);
        assert_eq!(b.wait(1, u64::MAX), Duration::from_micros(750));
        let tiny = Backoff::fixed(Duration::from_nanos(1));
        assert_eq!(tiny.wait(3, 42), Duration::ZERO);
    }
}
