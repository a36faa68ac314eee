//! Warnings that a burst would repeat: a failure that every request meets (requests shed
//! under overload, every statement while the shared database is down) is logged at most once
//! per interval, with how many occurrences the line stands for. A line per occurrence would
//! cost more than the failure (the access-log line alone is a quarter of a shed request's
//! cost) and bury the first cause in the log. The occurrences between two lines are counted
//! by the second, whenever it comes: the tail of a burst that never recurs is not logged,
//! so every user also counts each occurrence in a metric, which is the exact record.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The interval of the warnings that use one.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// Counts occurrences and says when one should be logged.
#[derive(Debug)]
pub struct LogLimit {
    interval: Duration,
    /// The origin of `last_ms`: the first occurrence (so a limiter can be a `static`).
    started: OnceLock<Instant>,
    /// When a line was last written, in ms since `started`; `u64::MAX` before the first.
    last_ms: AtomicU64,
    /// Occurrences since that line.
    since_last: AtomicU64,
}

/// What an occurrence that should be logged reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Occurrences this line stands for: this one and those not logged since the last.
    pub count: u64,
    /// How long since the last line (`None` for the first).
    pub since_ms: Option<u64>,
}

impl LogLimit {
    pub const fn new(interval: Duration) -> Self {
        Self {
            interval,
            started: OnceLock::new(),
            last_ms: AtomicU64::new(u64::MAX),
            since_last: AtomicU64::new(0),
        }
    }

    /// Counts one occurrence. `Some` for the one occurrence per interval that should be
    /// logged (the first ever is), `None` for the others.
    pub fn occurred(&self) -> Option<Report> {
        self.since_last.fetch_add(1, Ordering::Relaxed);
        let started = self.started.get_or_init(Instant::now);
        let now = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        let last = self.last_ms.load(Ordering::Relaxed);
        let interval = u64::try_from(self.interval.as_millis()).unwrap_or(u64::MAX);
        let first = last == u64::MAX;
        if !first && now.saturating_sub(last) < interval {
            return None;
        }
        // Of the occurrences racing here, one wins the line.
        self.last_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .ok()?;
        Some(Report {
            count: self.since_last.swap(0, Ordering::Relaxed),
            since_ms: (!first).then(|| now.saturating_sub(last)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_occurrence_is_logged_and_the_rest_of_its_interval_only_counted() {
        let limit = LogLimit::new(Duration::from_secs(3600));
        let first = limit.occurred().expect("the first occurrence is logged");
        assert_eq!(first.count, 1);
        assert_eq!(first.since_ms, None);
        for _ in 0..99 {
            assert_eq!(limit.occurred(), None);
        }
        assert_eq!(limit.since_last.load(Ordering::Relaxed), 99);
    }

    #[test]
    fn a_line_after_the_interval_counts_every_occurrence_it_stands_for() {
        let limit = LogLimit::new(Duration::ZERO);
        assert!(limit.occurred().is_some());
        // With no interval every occurrence is logged, each standing for itself.
        let next = limit.occurred().expect("past the interval");
        assert_eq!(next.count, 1);
        assert!(next.since_ms.is_some());
        // Occurrences counted but not logged are reported by the next line.
        limit.since_last.fetch_add(41, Ordering::Relaxed);
        assert_eq!(limit.occurred().map(|r| r.count), Some(42));
    }
}
