//! The local monotonic clock. It runs the remaining lifetime of index entries, and carries
//! the replica's estimate of the server's now forward between observations of server time
//! (see `Projection::server_tip_ms`). Ages are measured in server time, never by the local
//! wall clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since an arbitrary fixed origin; never goes backwards.
    fn now_ms(&self) -> u64;

    /// Epoch milliseconds, for the timestamps the write loop stamps its events with: the
    /// wall clock, except where a test drives time by hand (and must get the same stamps,
    /// hence the same write tags, on every run of a seed).
    fn epoch_ms(&self) -> u64 {
        crate::store::wall_clock_ms()
    }
}

/// The process's monotonic clock.
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        // The origin is in the past, so this only saturates after 584 million years.
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A clock tests move by hand.
#[derive(Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new(start_ms: u64) -> Self {
        Self {
            now: AtomicU64::new(start_ms),
        }
    }

    pub fn advance_ms(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn epoch_ms(&self) -> u64 {
        self.now_ms()
    }
}
