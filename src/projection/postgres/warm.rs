//! A replica's warm copy of Postgres rows, so a write on the fast path sends ONE database
//! statement (the record) instead of two (the load, then the record).
//!
//! The copy lives in the memory fold's own slots (otherwise empty under Postgres), so it
//! is bounded, swept and evicted exactly like the memory fold. A slot is `warm` only while
//! it is COMPLETE up to its version: its index holds every live index row of the account
//! at or below that version. Completeness is what makes it safe to answer a lookup miss
//! from it: a retry whose key is not in a complete copy either never landed, or landed
//! above the copy's version, and then the write, guarded on the copy's version, is bounced
//! by the store (2003) and the loop catches up. A copy that is current but missing rows
//! (the half-shared configuration docs/postgres.md warns about) would write the retry again, so
//! a copy is only ever built from:
//!
//! - a load that returned every live row of the account (`since` 0), or every live row
//!   above the version a complete copy already had (`since` = that version);
//! - plus what a catch-up replayed from the store above the row's cursor;
//! - plus this replica's own writes, recorded on a copy that was complete right below them.
//!
//! The database holds every live row at or below its cursor (cursor and rows move in one
//! statement), so a load's rows are complete up to the row's version. A copy that would
//! pass [`super::WARM_MAX_ROWS_PER_ACCOUNT`] is dropped and not rebuilt for one window.
//! Index entries keep the database's window end (server time) and are aged against the
//! server-time estimate, as the database's own lookups are.
//!
//! The database keeps a row for the retention, the copy's index only for the window. So
//! the copy also remembers every key inside the retention in the account's key memory
//! (`keys/`: a fingerprint, a few bytes), built from the same three sources. A key the
//! index misses and no fingerprint matches never landed within the retention: the write
//! goes ahead on the copy. A fingerprint that matches, or a key memory that has forgotten
//! keys still inside the retention (a cap), sends the lookup to the database
//! ([`Projection::pg_warm_answer`]). A copy with more than
//! [`super::WARM_MAX_KEYS_PER_ACCOUNT`] keys is dropped as one with too many rows is.

use super::RowLife;
use crate::account::AccountId;
use crate::projection::state::{AccountState, Snapshot};
use crate::projection::{AccountSlot, Projection, RecentWrite, RecordedWrite};

/// The largest share of the index cap ([`crate::projection::DEFAULT_MAX_INDEX_ENTRIES`])
/// warm copies may fill, in percent: below the 80% alert, since on Postgres a full cap
/// only means more database reads, never a refused write.
const WARM_INDEX_SHARE_PERCENT: usize = 75;

/// What a catch-up or load hands over to build or extend a warm copy.
pub(crate) struct WarmUpdate<'a> {
    /// The `since` the load was given (see [`Projection::pg_since`]).
    pub since: Option<u64>,
    /// The state the rows (and replay) are complete up to.
    pub snap: Snapshot,
    /// Every row inside its retention above `since`, from the load; `None`: too many, or
    /// not asked.
    pub delta: Option<&'a [(u128, RecentWrite, RowLife)]>,
    /// What a catch-up replayed from the store above the row's cursor.
    pub replayed: &'a [(u128, RecentWrite, RowLife)],
}

impl Projection {
    /// What a warm copy answers for `lookups` without the database: the index entries
    /// (`Some`) when every key either has one or matches no remembered fingerprint (it never
    /// landed within the retention). `None`: some key may sit in the database past the
    /// window; load the row with it.
    pub(crate) fn pg_warm_answer(
        &self,
        slot: &AccountSlot,
        lookups: &[u128],
    ) -> Option<Vec<(u128, RecentWrite)>> {
        let tip = self.server_tip_ms();
        let st = slot.state.lock();
        // Keys committed after this are all in the key memory: a cap forgot none of them.
        let forgotten = st.keys.forgotten_ms();
        let complete = forgotten == 0 || forgotten < tip.saturating_sub(self.retention_ms());
        let mut hits = Vec::with_capacity(lookups.len());
        for &id in lookups {
            match st.recent.get(id, tip) {
                Some(w) => hits.push((id, w)),
                None if complete && st.keys.candidates(id).is_ok_and(|c| c.is_empty()) => {}
                None => return None,
            }
        }
        Some(hits)
    }

    /// The index entries of `lookups` in a warm copy, aged against the server-time estimate.
    pub(crate) fn pg_warm_hits(
        &self,
        slot: &AccountSlot,
        lookups: &[u128],
    ) -> Vec<(u128, RecentWrite)> {
        let tip = self.server_tip_ms();
        let st = slot.state.lock();
        lookups
            .iter()
            .filter_map(|&id| st.recent.get(id, tip).map(|w| (id, w)))
            .collect()
    }

    /// What a load should ask the database for, to build or extend this account's warm
    /// copy: every live row above the copy's version when it has a complete one, every live
    /// row when it has none, nothing when the account was found too big within the window.
    pub(crate) fn pg_since(&self, account: AccountId) -> Option<u64> {
        let Some(slot) = self.resident_slot(account) else {
            return Some(0);
        };
        let st = slot.state.lock();
        if st.warm {
            Some(st.version)
        } else if st.cold_until_ms > self.now_ms() {
            None
        } else {
            Some(0)
        }
    }

    /// Builds or extends the account's warm copy from a load (and a catch-up's replay), if
    /// that keeps it complete; otherwise leaves it as it was, or drops it.
    pub(crate) fn pg_warm_up(&self, account: AccountId, update: WarmUpdate<'_>) {
        let Some(since) = update.since else { return };
        // Rows loaded before the store was seen going backwards build no copy after it.
        if self.rows_refused().is_some() {
            return;
        }
        let Some(delta) = update.delta else {
            // Too many rows to hold: no copy, and no full load again for a window.
            let slot = self.slot(account);
            let mut st = slot.state.lock();
            self.drop_copy(&mut st);
            st.cold_until_ms = self.now_ms().saturating_add(self.window_ms());
            return;
        };
        let cap = self.config.max_index_entries / 100 * WARM_INDEX_SHARE_PERCENT;
        if self.index_entries() >= cap && self.resident_slot(account).is_none() {
            return;
        }
        let slot = self.slot(account);
        let mut st = slot.state.lock();
        // The rows above `since` complete a copy only on top of one complete up to `since`
        // (still here, and not rebuilt lower meanwhile); rows above 0 are complete alone.
        if since > 0 && !(st.warm && st.version >= since) {
            return;
        }
        let (before, keys_before) = (st.recent.len(), st.keys.len());
        let mut rows: Vec<&(u128, RecentWrite, RowLife)> =
            delta.iter().chain(update.replayed).collect();
        // The key memory takes keys in version order, each once: the copy already holds
        // every key at or below the newest it has.
        rows.sort_by_key(|(_, w, _)| w.version);
        let (tip, known) = (self.server_tip_ms(), st.keys.newest_version());
        for &&(id, w, life) in &rows {
            if life.window_ends_ms > tip {
                let w = RecentWrite {
                    expires_at_ms: life.window_ends_ms,
                    ..w
                };
                st.recent.insert(id, w);
            }
            if w.version > known {
                let committed_ms = life.expires_at_ms.saturating_sub(self.retention_ms());
                st.keys.push(id, w.version, w.balance, committed_ms);
            }
        }
        self.add_remembered(st.keys.len() as i64 - keys_before as i64);
        if !st.warm || update.snap.version > st.version {
            st.balance = update.snap.balance;
            st.version = update.snap.version;
        }
        st.max_client_seq = st.max_client_seq.max(update.snap.max_client_seq);
        st.warm = true;
        st.last_touch_ms = self.now_ms();
        self.add_index_entries(st.recent.len() as i64 - before as i64);
        self.cap_copy(&mut st);
    }

    /// This replica's own write, recorded on the account's warm copy: complete right below
    /// the write, so complete at it. Expiry `expires_at_ms` is in server time, as the
    /// database row's.
    pub(crate) fn pg_record_warm(
        &self,
        account: AccountId,
        write: &RecordedWrite<'_>,
        expires_at_ms: u64,
    ) {
        let Some(slot) = self.resident_slot(account) else {
            return;
        };
        let mut st = slot.state.lock();
        if !st.warm || self.rows_refused().is_some() {
            return;
        }
        let applies = st.generation == write.generation
            && st.version == write.expected_version
            && st.broken.is_none();
        self.apply_own_write(&mut st, write, expires_at_ms);
        if applies {
            // The copy's key memory, as the database's rows: its commit time is not in the
            // store's answer, and the estimate never runs ahead of it.
            let (keys_before, committed_ms) = (st.keys.len(), self.server_tip_ms());
            for &(event_id, balance, _) in write.events {
                st.keys
                    .push(event_id, write.new_version, balance, committed_ms);
            }
            self.add_remembered(st.keys.len() as i64 - keys_before as i64);
        }
        self.cap_copy(&mut st);
    }

    /// Forgets the account's warm copy, if it has one: the database fell behind it.
    pub(crate) fn pg_forget_warm(&self, account: AccountId) {
        if let Some(slot) = self.resident_slot(account) {
            self.drop_copy(&mut slot.state.lock());
        }
    }

    /// Drops a copy grown past [`super::WARM_MAX_ROWS_PER_ACCOUNT`] live entries or
    /// [`super::WARM_MAX_KEYS_PER_ACCOUNT`] remembered keys.
    fn cap_copy(&self, st: &mut AccountState) {
        if st.recent.len() > super::WARM_MAX_ROWS_PER_ACCOUNT
            || st.keys.len() > super::WARM_MAX_KEYS_PER_ACCOUNT
        {
            self.drop_copy(st);
            st.cold_until_ms = self.now_ms().saturating_add(self.window_ms());
        }
    }

    /// Forgets the copy entirely (state too: a copy rebuilt later must not start from a
    /// version whose rows it no longer holds).
    fn drop_copy(&self, st: &mut AccountState) {
        let (n, keys) = (st.recent.len(), st.keys.len());
        *st = AccountState {
            last_touch_ms: st.last_touch_ms,
            ..AccountState::default()
        };
        self.add_index_entries(-(n as i64));
        self.add_remembered(-(keys as i64));
    }
}
