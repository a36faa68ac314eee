//! Whether this replica can reach its store, as every store call finds it.
//!
//! A call that reached no node able to take it ([`NotApplied::Unreachable`]) marks the store
//! lost; any answer from the store marks it back. A call whose answer was lost or that the
//! store shed says nothing either way. The replica logs one WARN when it loses the store and
//! one INFO when it has it back, never a line per request, and `tally_store_reachable`
//! carries the state for alerts. The write loop reads it: while the store has been out of
//! reach for [`KNOWN_LOST_AFTER`], a write that cannot reach it is answered at once as the
//! outage it is, rather than spending every attempt against a store that is not there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{NotApplied, StoreError, StoreResult};
use crate::log_limit::LogLimit;
use crate::metrics::Metrics;

/// How long the store must have been out of reach before a write that cannot reach it stops
/// retrying and answers the outage after one attempt. Below it, a write rides through a
/// blip (a node restarting, a leader change) with its usual retries.
pub const KNOWN_LOST_AFTER: Duration = Duration::from_secs(1);

/// Lines about losing the store come at most this often. A store that flaps would otherwise
/// write a line per flap; the gauge and `tally_store_outages_total` are the exact record.
pub const OUTAGE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The marker for "reachable" in [`StoreHealth`]'s clock.
const REACHABLE: u64 = u64::MAX;

pub struct StoreHealth {
    /// Names the store in the log lines (its kind and address, no credentials).
    store: String,
    origin: Instant,
    /// Milliseconds since `origin` when the store was lost, or [`REACHABLE`].
    lost_at_ms: AtomicU64,
    lost_lines: LogLimit,
    metrics: Option<Arc<Metrics>>,
}

impl StoreHealth {
    pub fn new(store: impl Into<String>, metrics: Option<Arc<Metrics>>) -> Self {
        if let Some(m) = &metrics {
            m.store_reachable.set(1);
        }
        Self {
            store: store.into(),
            origin: Instant::now(),
            lost_at_ms: AtomicU64::new(REACHABLE),
            lost_lines: LogLimit::new(OUTAGE_LOG_INTERVAL),
            metrics,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(REACHABLE - 1)
    }

    /// Notes what one store call found.
    pub fn observe<T>(&self, result: &StoreResult<T>) {
        match result {
            Err(e) if e.is_unreachable() => self.lost(e),
            Err(StoreError::OutcomeUnknown { .. })
            | Err(StoreError::NotApplied {
                cause: NotApplied::Shed,
                ..
            }) => {}
            _ => self.answered(),
        }
    }

    fn lost(&self, e: &StoreError) {
        let now = self.now_ms();
        if self
            .lost_at_ms
            .compare_exchange(REACHABLE, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        if let Some(m) = &self.metrics {
            m.store_reachable.set(0);
            m.store_outages.inc();
        }
        if let Some(report) = self.lost_lines.occurred() {
            tracing::warn!(
                store = %self.store,
                error = %e,
                losses = report.count,
                "lost the event store: writes and reads that need it answer 503 STORE_UNAVAILABLE until it is back"
            );
        }
    }

    fn answered(&self) {
        // The common case: one load.
        if self.lost_at_ms.load(Ordering::Relaxed) == REACHABLE {
            return;
        }
        let lost_at = self.lost_at_ms.swap(REACHABLE, Ordering::Relaxed);
        if lost_at == REACHABLE {
            return;
        }
        if let Some(m) = &self.metrics {
            m.store_reachable.set(1);
        }
        let out_ms = self.now_ms().saturating_sub(lost_at);
        tracing::info!(store = %self.store, out_ms, "the event store answers again");
    }

    /// How long the store has been out of reach, or `None` while it answers.
    pub fn lost_for(&self) -> Option<Duration> {
        let lost_at = self.lost_at_ms.load(Ordering::Relaxed);
        (lost_at != REACHABLE).then(|| Duration::from_millis(self.now_ms().saturating_sub(lost_at)))
    }

    /// Whether the store has been out of reach for [`KNOWN_LOST_AFTER`] or longer.
    pub fn known_lost(&self) -> bool {
        self.lost_for().is_some_and(|d| d >= KNOWN_LOST_AFTER)
    }
}

impl Default for StoreHealth {
    /// A store nothing has been learnt of yet: reachable until a call says otherwise.
    fn default() -> Self {
        Self::new("the event store", None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable() -> StoreResult<()> {
        Err(StoreError::unreachable("connection refused"))
    }

    /// Rule: only a call that reached no node marks the store lost; any answer marks it
    /// back; a lost answer or a shed call says nothing either way.
    #[tokio::test(start_paused = true)]
    async fn only_an_unreachable_call_loses_the_store_and_any_answer_brings_it_back() {
        let metrics = Arc::new(Metrics::new());
        let h = StoreHealth::new("test", Some(metrics.clone()));
        assert_eq!(h.lost_for(), None);
        h.observe(&Err::<(), _>(StoreError::shed("busy")));
        h.observe(&Err::<(), _>(StoreError::OutcomeUnknown {
            reason: "timeout".into(),
        }));
        assert_eq!(h.lost_for(), None);
        h.observe(&unreachable());
        assert_eq!(metrics.store_reachable.get(), 0);
        assert_eq!(metrics.store_outages.get(), 1);
        assert!(!h.known_lost(), "lost just now");
        tokio::time::advance(KNOWN_LOST_AFTER).await;
        h.observe(&unreachable());
        assert!(h.known_lost());
        assert_eq!(
            metrics.store_outages.get(),
            1,
            "one outage, however many calls"
        );
        // Neither a lost answer nor a shed call says the store is back.
        h.observe(&Err::<(), _>(StoreError::shed("busy")));
        assert!(h.known_lost());
        // A refusal is an answer: the store is there.
        h.observe(&Err::<(), _>(StoreError::Conflict {
            expected: 1,
            current: 2,
        }));
        assert_eq!(h.lost_for(), None);
        assert_eq!(metrics.store_reachable.get(), 1);
        h.observe(&unreachable());
        assert_eq!(metrics.store_outages.get(), 2);
    }
}
