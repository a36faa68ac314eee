//! This replica's own successful writes, recorded on the fold: index entries first, then
//! the cursor bump when the write applied on top of the state held (the colocation rule).

use crate::account::{AccountEvent, AccountId};

use super::state::{apply_holds, hold_change};
use super::{AccountSlot, AccountState, Projection, RecentWrite};
use crate::account::holds::Commit;

impl Projection {
    /// Records this replica's own successful write to one account: index entries first (or
    /// in the same critical section), then the cursor bump, which never moves backwards and
    /// only happens when the write applied on top of the state we hold. Entries written
    /// here get the full window: this replica never re-folds its own event, so this entry is
    /// the only record it will have.
    pub fn record_write(&self, slot: &AccountSlot, write: &RecordedWrite<'_>) {
        let expires_at_ms = self.now_ms().saturating_add(self.window_ms());
        self.apply_own_write(&mut slot.state.lock(), write, expires_at_ms);
    }

    /// [`Projection::record_write`] on `account`, then the checkpoint count: the write's
    /// events are past the account's checkpoint when the cursor took them.
    pub(crate) fn record_own_write(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        write: &RecordedWrite<'_>,
    ) {
        let expires_at_ms = self.now_ms().saturating_add(self.window_ms());
        let mut st = slot.state.lock();
        self.apply_own_write(&mut st, write, expires_at_ms);
        if st.version == write.new_version && st.generation == write.generation {
            self.note_progress(account, &mut st, write.events.len() as u64);
            if write.events.iter().any(|(_, _, e)| e.is_hold()) {
                self.note_expiring(account, &st);
            }
        }
    }

    /// One own write on a held state (the memory fold's, or a Postgres warm copy): its
    /// index entries, expiring at `expires_at_ms`, then the cursor bump when the write
    /// applied on top of this state.
    pub(super) fn apply_own_write(
        &self,
        st: &mut AccountState,
        write: &RecordedWrite<'_>,
        expires_at_ms: u64,
    ) {
        // A fold dropped since the write was decided (the store went backwards under it,
        // `regress.rs`) may stand at the expected version again, read from the new store,
        // and the write may have landed on either store: nothing of it is recorded here. If
        // it landed on the store there is now, a retry's conflict and catch-up fold it from
        // there, index entry included.
        if st.generation != write.generation {
            return;
        }
        let before = st.recent.len();
        for &(event_id, balance, event) in write.events {
            // The run that wrote it answers from its own success, never from this entry.
            let w = RecentWrite {
                balance,
                version: write.new_version,
                expires_at_ms,
                event,
                write_tag: None,
            };
            st.recent.insert(event_id, w);
        }
        if st.version == write.expected_version
            && st.broken.is_none()
            && self.apply_own_holds(st, write)
        {
            // Keys follow the cursor: the fold that moves it past this version later skips
            // the batch, so this is the one place its keys are remembered here. Its commit
            // time is not in the store's answer; the estimate never runs ahead of it.
            // On Postgres the database keeps them, beside the row.
            if !self.uses_database() {
                let (keys_before, commit_ms) = (st.keys.len(), self.server_tip_ms());
                for &(event_id, balance, _) in write.events {
                    st.keys
                        .push(event_id, write.new_version, balance, commit_ms);
                }
                self.keys_changed(st, keys_before);
            }
            st.version = write.new_version;
            st.balance = write.balance_after;
            st.max_client_seq = st.max_client_seq.max(write.max_client_seq);
            // Applied at version 0: the stream held nothing before it, so this state is
            // the whole fold (a first touch's write leaves the account warm).
            st.warm |= write.expected_version == 0;
        }
        st.last_touch_ms = self.now_ms();
        self.add_index_entries(st.recent.len() as i64 - before as i64);
    }
}

impl Projection {
    /// The write's hold events on the account's holds, all or none. Their commit time is
    /// not in the store's answer: a placement's is taken as at least the estimate of the
    /// server's now, which never runs ahead of it (`account/holds.rs`, `Commit`). Returns
    /// false when the holds cannot take them (a decision on state that was not the
    /// account's): the cursor then stays, and the next catch-up folds the batch as written.
    fn apply_own_holds(&self, st: &mut AccountState, write: &RecordedWrite<'_>) -> bool {
        if !write.events.iter().any(|(_, _, e)| e.is_hold()) {
            return true;
        }
        let at = (write.new_version, Commit::AtLeast(self.server_tip_ms()));
        let mut changes = Vec::with_capacity(write.events.len());
        for &(event_id, _, event) in write.events {
            match hold_change(&event, Some(event_id), at) {
                Ok(change) => changes.extend(change),
                Err(_) => return false,
            }
        }
        match apply_holds(&mut st.holds, &changes) {
            Ok(()) => true,
            Err(_) => {
                tracing::error!(
                    version = write.new_version,
                    "an own write's holds do not apply to the state it was decided on; the account is read again"
                );
                false
            }
        }
    }
}

/// A successful write to one account, as the write loop hands it to the projection.
pub struct RecordedWrite<'a> {
    pub expected_version: u64,
    /// The generation of the fold the write was decided on ([`Snapshot::generation`]).
    pub generation: u64,
    pub new_version: u64,
    /// The balance after the whole batch.
    pub balance_after: i64,
    pub max_client_seq: u64,
    /// (event id, balance right after that event, the event), in write order.
    pub events: &'a [(u128, i64, AccountEvent)],
}
