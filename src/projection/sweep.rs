//! Keeping a replica's memory bounded: expiring index entries, dropping idle accounts and
//! evicting the least recently touched ones above the resident cap.

use std::sync::Arc;
use std::time::Duration;

use super::Projection;
use crate::account::AccountId;

/// How many more accounts than the cap an eviction pass removes, as a fraction of the cap,
/// so passes do not run on every insert.
const EVICTION_SLACK_DIVISOR: usize = 100;

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    pub index_entries_expired: usize,
    pub evicted_idle: usize,
    pub evicted_capacity: usize,
    /// Keys past the retention dropped from key memories.
    pub keys_expired: usize,
    /// Keys dropped inside the retention to keep the replica's cap.
    pub keys_forgotten: usize,
}

impl Projection {
    /// Expires index entries of every resident account, drops accounts idle past the idle
    /// timeout, and evicts the least recently touched ones above the cap. Accounts in use
    /// (a request holds their slot) are never dropped.
    pub fn sweep(&self) -> SweepStats {
        let now = self.now_ms();
        // Entries expire in local time in the memory fold, in server time in the Postgres
        // backend's warm copies (as the rows they copy).
        let expiry_now = match self.backend {
            super::Backend::Memory => now,
            super::Backend::Postgres(_) => self.server_tip_ms(),
        };
        let idle_ms = u64::try_from(self.config.idle_timeout.as_millis()).unwrap_or(u64::MAX);
        let mut stats = SweepStats::default();
        let mut idle = Vec::new();
        let mut touched = Vec::new();
        let over_cap = self
            .accounts
            .len()
            .saturating_sub(self.config.max_resident_accounts);
        for entry in self.accounts.iter() {
            let Some(mut st) = entry.value().state.try_lock() else {
                continue;
            };
            stats.index_entries_expired += st.recent.evict_expired(expiry_now);
            if now.saturating_sub(st.last_touch_ms) >= idle_ms {
                idle.push(*entry.key());
            } else if over_cap > 0 {
                touched.push((st.last_touch_ms, *entry.key()));
            }
        }
        self.add_index_entries(-(stats.index_entries_expired as i64));
        (stats.keys_expired, stats.keys_forgotten) = self.sweep_keys();
        for account in idle {
            if self.evict(account) {
                stats.evicted_idle += 1;
            }
        }
        let excess = self
            .accounts
            .len()
            .saturating_sub(self.config.max_resident_accounts);
        if excess > 0 {
            let target = (excess + self.config.max_resident_accounts / EVICTION_SLACK_DIVISOR)
                .min(touched.len());
            if target > 0 && target < touched.len() {
                touched.select_nth_unstable(target);
            }
            for &(_, account) in touched.iter().take(target) {
                if self.evict(account) {
                    stats.evicted_capacity += 1;
                }
            }
        }
        self.metrics
            .evictions
            .with_label_values(&["idle"])
            .inc_by(stats.evicted_idle as u64);
        self.metrics
            .evictions
            .with_label_values(&["capacity"])
            .inc_by(stats.evicted_capacity as u64);
        self.metrics
            .resident_accounts
            .set(self.accounts.len() as i64);
        stats
    }

    /// Drops an account that no request is using.
    fn evict(&self, account: AccountId) -> bool {
        let removed = self
            .accounts
            .remove_if(&account, |_, slot| Arc::strong_count(slot) == 1);
        if let Some((_, slot)) = &removed {
            self.forget_fold(account, &slot.state.lock());
        }
        removed.is_some()
    }

    /// What dropping a fold from memory leaves behind, for an eviction and for a fold the
    /// store went back under (`regress.rs`): its index entries no longer count, and an
    /// account that held events is read before it is written (never a blind create).
    pub(super) fn forget_fold(&self, account: AccountId, st: &super::AccountState) {
        self.add_index_entries(-(st.recent.len() as i64));
        self.add_remembered(-(st.keys.len() as i64));
        if st.version > 0 {
            self.existed.remember(account);
        }
    }

    /// Runs [`Projection::sweep`] every `interval`, and at once when the cap is exceeded,
    /// until `shutdown` resolves.
    pub async fn run_sweeper(
        self: Arc<Self>,
        interval: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(interval) => {}
                _ = self.evict_signal.notified() => {}
            }
            if let super::Backend::Postgres(pg) = &self.backend {
                // The shared table: delete rows expired in server time, a bounded batch at a
                // time. Every replica sweeps; the deletes are idempotent. No sweep before the
                // first server-time observation (the tip is 0 then).
                let tip = self.server_tip_ms();
                if tip > 0
                    && let Err(e) = pg.sweep(tip).await
                {
                    tracing::warn!(error = %e, "sweeping expired index rows failed; the next sweep retries");
                }
                // The warm copies (`postgres/warm.rs`) are swept below like the memory fold.
            }
            let this = self.clone();
            // A sweep walks every resident account; keep it off the async workers.
            let _ = tokio::task::spawn_blocking(move || this.sweep()).await;
        }
    }
}
