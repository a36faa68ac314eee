//! Per-caller rate limits: each authenticated caller (`sub`) gets its own token bucket
//! (GCRA, from `governor`): `rate` requests a second on average, bursts of up to `burst`.
//! Only authenticated callers are paced, so the set of buckets is bounded by the callers
//! the issuer mints tokens for; buckets back at a full allowance are forgotten
//! periodically ([`CallerLimiter::forget_idle`]).
//!
//! Pacing is per replica: behind a load balancer spreading one caller over N replicas, the
//! caller's allowance is up to N times the configured rate.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Requests a second one caller may make on one replica, unless configured.
pub const DEFAULT_RATE_PER_CALLER: u32 = 200;
/// The burst one caller may make at once, unless configured.
pub const DEFAULT_BURST_PER_CALLER: u32 = 400;
/// How often idle callers' buckets are forgotten.
pub const FORGET_IDLE_INTERVAL: Duration = Duration::from_secs(30);

pub struct CallerLimiter {
    limiter: DefaultKeyedRateLimiter<String>,
    clock: DefaultClock,
}

impl CallerLimiter {
    /// `rate` and `burst` are positive (the caller checks).
    pub fn new(rate: u32, burst: u32) -> Self {
        let rate = NonZeroU32::new(rate).unwrap_or(NonZeroU32::MIN);
        let burst = NonZeroU32::new(burst).unwrap_or(rate);
        Self {
            limiter: RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst)),
            clock: DefaultClock::default(),
        }
    }

    /// Takes one request from the caller's bucket, or says how long until it may retry.
    pub fn check(&self, caller: &str) -> Result<(), Duration> {
        // The key is owned for the map; the lookup allocates once per request.
        self.limiter
            .check_key(&caller.to_owned())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    pub fn forget_idle(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }

    pub fn tracked_callers(&self) -> usize {
        self.limiter.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_caller_has_its_own_allowance() {
        let l = CallerLimiter::new(1, 3);
        for _ in 0..3 {
            l.check("alice").expect("within alice's burst");
        }
        let wait = l.check("alice").expect_err("alice is over her burst");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        // Bob is untouched by Alice's spending.
        l.check("bob").expect("bob has his own bucket");
        assert_eq!(l.tracked_callers(), 2);
    }
}
