//! The replica-wide count of recent-writes index entries, and the cap at which new writes
//! are refused (never entries dropped).

use std::sync::atomic::Ordering;

#[cfg(doc)]
use super::DEFAULT_MAX_INDEX_ENTRIES;
use super::Projection;

/// A new write refused because the replica-wide recent-writes index is at its cap.
/// Retryable: expiry frees room within the window, and another replica may have room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the recent-writes index holds {entries} entries, at its cap of {cap}")]
pub struct IndexFull {
    pub entries: usize,
    pub cap: usize,
}

impl Projection {
    /// Recent-writes index entries over every resident account. Entries that expired since
    /// their account was last swept or caught up still count, so this runs ahead of the
    /// live count by at most one sweep interval's expiries, never behind it.
    pub fn index_entries(&self) -> usize {
        usize::try_from(self.index_entries.load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Whether the replica-wide recent-writes index holds its cap or more.
    pub fn index_full(&self) -> bool {
        self.index_entries() >= self.config.max_index_entries
    }

    /// The write side's admission check for a NEW write (one the index cannot answer):
    /// `Err` while the index is full, counted on `tally_writes_refused_index_full_total`;
    /// answer it with a retryable 503.
    ///
    /// The cap bounds memory by refusing writes, never by dropping entries: an entry
    /// expired early would let a retry inside the stated window write twice. So nothing
    /// else stops at the cap: a write already admitted indexes its events, and a fold
    /// indexes every event it replays inside the window (the colocation rule), which
    /// includes other replicas' writes. The count can therefore pass the cap, by the writes
    /// in flight when it was reached plus what catch-ups replay.
    ///
    /// On Postgres the index is the database's table, and the entries counted here are the
    /// warm copies', which stop growing before the cap (`postgres/warm.rs`): never refused.
    pub fn check_index_room(&self) -> Result<(), IndexFull> {
        let entries = self.index_entries();
        if entries < self.config.max_index_entries || self.uses_database() {
            return Ok(());
        }
        self.metrics.writes_refused_index_full.inc();
        Err(IndexFull {
            entries,
            cap: self.config.max_index_entries,
        })
    }

    pub(super) fn add_index_entries(&self, delta: i64) {
        if delta != 0 {
            let n = self.index_entries.fetch_add(delta, Ordering::Relaxed) + delta;
            self.metrics.index_entries.set(n);
        }
    }
}
