//! The key memory's bounds on one replica: how many keys it holds, the caps that make the
//! oldest go first, the retention that expires them, and the horizon an answer states.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{AccountState, Projection};
use crate::account::AccountId;
use crate::log_limit::{LogLimit, REPORT_INTERVAL};
use crate::metrics::remembered;

impl Projection {
    pub fn retention_ms(&self) -> u64 {
        u64::try_from(self.config.retention.as_millis()).unwrap_or(u64::MAX)
    }

    /// Counts what a fold or a write did to an account's key memory (`before`: its length
    /// then), and keeps the account under its cap. Called under the account's lock.
    pub(super) fn keys_changed(&self, st: &mut AccountState, before: usize) {
        let over = st.keys.cap(self.config.max_keys_per_account);
        if over > 0 {
            self.forgot(remembered::CAP_ACCOUNT, over);
        }
        self.add_remembered(st.keys.len() as i64 - before as i64);
    }

    pub(super) fn add_remembered(&self, delta: i64) {
        if delta != 0 {
            let n = self.remembered_keys.fetch_add(delta, Ordering::Relaxed) + delta;
            self.metrics.remembered_keys.set(n);
        }
    }

    /// Keys forgotten inside the retention to keep `cap`: counted, and said at most once
    /// a reporting interval.
    pub(super) fn forgot(&self, cap: &'static str, keys: usize) {
        self.metrics
            .keys_forgotten
            .with_label_values(&[cap])
            .inc_by(keys as u64);
        static LOG: LogLimit = LogLimit::new(REPORT_INTERVAL);
        if let Some(report) = LOG.occurred() {
            tracing::warn!(
                cap,
                keys,
                times = report.count,
                since_ms = report.since_ms,
                "forgot idempotency keys inside the retention to stay under a cap; those accounts' answers state the shorter horizon"
            );
        }
    }

    /// How long a key written now to all of `accounts` is remembered: the retention, or less
    /// where a cap made an account forget keys younger than that.
    pub fn key_horizon(&self, accounts: &[AccountId]) -> Duration {
        let retention = self.retention_ms();
        if self.uses_database() {
            // The database's rows keep every key for the retention; a warm copy's
            // fingerprints are only a filter in front of them.
            return Duration::from_millis(retention);
        }
        let tip = self.server_tip_ms();
        let horizon = accounts
            .iter()
            .filter_map(|a| self.resident_slot(*a))
            .map(|slot| slot.state.lock().keys.forgotten_ms())
            .filter(|&forgotten| forgotten > 0)
            .map(|forgotten| tip.saturating_sub(forgotten).min(retention))
            .min()
            .unwrap_or(retention);
        Duration::from_millis(horizon)
    }

    /// The sweep's part: expires every key past the retention (server time), then forgets
    /// the oldest runs, across accounts, while the replica is over its cap. Returns the keys
    /// expired and forgotten.
    pub(super) fn sweep_keys(&self) -> (usize, usize) {
        let tip = self.server_tip_ms();
        let oldest_ms = tip.saturating_sub(self.retention_ms());
        let mut expired = 0;
        let mut runs: Vec<(u64, AccountId)> = Vec::new();
        for entry in self.accounts.iter() {
            let Some(mut st) = entry.value().state.try_lock() else {
                continue;
            };
            // Before the first anchor nothing is known to be old.
            if tip > 0 {
                expired += st.keys.expire(oldest_ms);
            }
            if let Some(ms) = st.keys.oldest_ms() {
                runs.push((ms, *entry.key()));
            }
        }
        self.add_remembered(-(expired as i64));
        let forgotten = self.keep_replica_cap(runs);
        (expired, forgotten)
    }

    /// Forgets the oldest run of the account whose oldest keys are the oldest, again and
    /// again, until the replica holds at most `--idempotency-max-keys`.
    fn keep_replica_cap(&self, runs: Vec<(u64, AccountId)>) -> usize {
        let cap = self.config.max_keys as i64;
        let mut forgotten = 0;
        let mut oldest_first: BinaryHeap<Reverse<(u64, usize)>> = runs
            .iter()
            .enumerate()
            .map(|(i, (ms, _))| Reverse((*ms, i)))
            .collect();
        while self.remembered_keys.load(Ordering::Relaxed) > cap {
            let Some(Reverse((_, i))) = oldest_first.pop() else {
                break;
            };
            let Some(slot) = self.resident_slot(runs[i].1) else {
                continue;
            };
            let mut st = slot.state.lock();
            let n = st.keys.forget_oldest();
            forgotten += n;
            self.add_remembered(-(n as i64));
            if let Some(ms) = st.keys.oldest_ms() {
                oldest_first.push(Reverse((ms, i)));
            }
        }
        if forgotten > 0 {
            self.forgot(remembered::CAP_REPLICA, forgotten);
        }
        forgotten
    }
}
