//! Per-caller rate limits: each authenticated caller (`sub`) gets its own token bucket
//! (GCRA, from `governor`): `rate` requests a second on average, bursts of up to `burst`.
//! Only authenticated callers are paced, so the set of buckets is bounded by the callers
//! the issuer mints tokens for; buckets back at a full allowance are forgotten
//! periodically ([`CallerLimiter::forget_idle`]).
//!
//! Pacing is per replica: behind a load balancer spreading one caller over N replicas, the
//! caller's allowance is up to N times the configured rate.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Requests a second one caller may make on one replica, unless configured.
pub const DEFAULT_RATE_PER_CALLER: u32 = 200;
/// The burst one caller may make at once, unless configured.
pub const DEFAULT_BURST_PER_CALLER: u32 = 400;
/// Failed authentications (a missing or refused token) one peer address may make a minute
/// on one replica, unless configured; beyond it, 429. Enough for a client that lost its
/// token to notice; far too few to guess at tokens or keys.
pub const DEFAULT_AUTH_FAILURES_PER_MINUTE: u32 = 60;
/// The most peer addresses whose failures are tracked at once. Any address can connect, so
/// the set is bounded here: when it is full of recent failers, a new failing peer is
/// answered 429 too (a valid token is never refused for it).
pub const MAX_TRACKED_PEERS: usize = 65_536;
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

/// Per-peer allowances of failed authentications. Only failures are counted: a peer's
/// valid tokens are never refused for them. IPv6 peers are counted by their /64, since one
/// host may hold a whole /64 and pick a new address per connection.
pub struct PeerFailureLimiter {
    limiter: DefaultKeyedRateLimiter<IpAddr>,
    clock: DefaultClock,
}

impl PeerFailureLimiter {
    /// `per_minute` is positive (the caller checks).
    pub fn new(per_minute: u32) -> Self {
        let n = NonZeroU32::new(per_minute).unwrap_or(NonZeroU32::MIN);
        Self {
            limiter: RateLimiter::keyed(Quota::per_minute(n)),
            clock: DefaultClock::default(),
        }
    }

    /// Counts one failure of `peer`; `Err` when the peer is past its allowance, with how
    /// long until its next failure is allowed.
    pub fn fail(&self, peer: IpAddr) -> Result<(), Duration> {
        let key = counted_as(peer);
        if self.limiter.len() >= MAX_TRACKED_PEERS {
            self.forget_idle();
            if self.limiter.len() >= MAX_TRACKED_PEERS {
                return Err(Duration::from_secs(1));
            }
        }
        self.limiter
            .check_key(&key)
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    pub fn forget_idle(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}

/// The address a peer's failures are counted under: itself, or an IPv6 peer's /64 (an
/// IPv4 address mapped into IPv6 is the IPv4 address).
fn counted_as(peer: IpAddr) -> IpAddr {
    match peer {
        IpAddr::V4(_) => peer,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_past_its_failures_is_limited_and_an_ipv6_peer_counts_by_its_64() {
        let l = PeerFailureLimiter::new(2);
        let one: IpAddr = "2001:db8::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8::ffff:2".parse().unwrap();
        l.fail(one).expect("first failure");
        l.fail(same_64).expect("second failure, same /64");
        assert!(l.fail(one).is_err(), "third failure of the /64");
        l.fail("2001:db8:0:1::1".parse().unwrap())
            .expect("another /64 has its own allowance");
        l.fail("10.0.0.1".parse().unwrap())
            .expect("an IPv4 peer has its own");
    }

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
