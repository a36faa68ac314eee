//! Which accounts this replica holds: the map of resident slots (loaded on first touch,
//! bounded by the sweeper), and the warm snapshot that answers without a store read.

use std::sync::Arc;

use crate::account::AccountId;

use super::{AccountSlot, Projection, Snapshot};

impl Projection {
    pub fn resident_accounts(&self) -> usize {
        self.accounts.len()
    }

    /// The account's slot, loading an empty (cold) one if it is not resident.
    pub fn slot(&self, account: AccountId) -> Arc<AccountSlot> {
        if let Some(slot) = self.accounts.get(&account) {
            return slot.clone();
        }
        let slot = self.accounts.entry(account).or_default().clone();
        let resident = self.accounts.len();
        self.metrics.resident_accounts.set(resident as i64);
        if resident > self.config.max_resident_accounts {
            self.evict_signal.notify_one();
        }
        slot
    }

    /// The slot only if the account is resident.
    pub fn resident_slot(&self, account: AccountId) -> Option<Arc<AccountSlot>> {
        self.accounts.get(&account).map(|s| s.clone())
    }

    /// The resident account's slot and state when its fold can answer without a store read:
    /// caught up at least once since it was loaded, and not broken.
    pub fn warm_snapshot(&self, account: AccountId) -> Option<(Arc<AccountSlot>, Snapshot)> {
        if self.rows_refused().is_some() {
            return None; // Postgres, after the store went backwards: only `pg_load` answers
        }
        let slot = self.resident_slot(account)?;
        let st = slot.state.lock();
        let snap = (st.warm && st.broken.is_none()).then(|| st.snapshot());
        drop(st);
        snap.map(|snap| (slot, snap))
    }
}
