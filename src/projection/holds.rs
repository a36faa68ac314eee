//! What the write side and the reads ask of an account's holds: a hold's status and details,
//! the holds due for expiry, and a placement's exact commit time when an own write left it
//! unknown (`account/holds.rs`, `Commit`).

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::account::AccountId;
use crate::account::holds::{Due, HoldBook, HoldId, OpenHold, Resolved};
use crate::store::{StoreError, read_whole};

use super::{AccountSlot, AccountState, AccountView, Projection, Snapshot};

/// The most accounts with expiring holds a replica tracks for its sweeper. Past it, an
/// account's due holds are expired when something touches it. About 40 bytes an account.
pub const MAX_EXPIRING_ACCOUNTS: usize = 1_000_000;

/// Accounts with open holds that expire, and the earliest server time (ms) one of them may
/// fall due. It outlives an account's eviction: an account nobody touches is the one the
/// sweeper is for.
#[derive(Default)]
pub struct Expiring(Mutex<HashMap<AccountId, u64>>);

/// One hold as a read shows it: open, or resolved while the fold remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldView {
    Open(OpenHold),
    Resolved(Resolved),
}

impl Projection {
    /// Hold `id` in the view's fold, open or resolved; `None` when the fold knows no such
    /// hold (never placed here, or resolved longer ago than the fold remembers).
    pub fn hold_view(&self, view: &AccountView, id: HoldId) -> Option<HoldView> {
        let AccountView::Memory(slot) = view else {
            return None;
        };
        let st = slot.state.lock();
        let book = st.holds.as_deref()?;
        if let crate::account::holds::HoldStatus::Open(open) = book.status(id) {
            return Some(HoldView::Open(open));
        }
        book.resolved(id).map(|r| HoldView::Resolved(*r))
    }

    /// The account's open holds, in id order, and the snapshot they belong to.
    pub fn open_holds(&self, view: &AccountView) -> Option<(Snapshot, Vec<(HoldId, OpenHold)>)> {
        let AccountView::Memory(slot) = view else {
            return None;
        };
        let st = slot.state.lock();
        let open = st.holds.as_deref().map(HoldBook::open).unwrap_or_default();
        Some((st.snapshot(), open))
    }

    /// Whether a resident account may hold a hold due now (server time): the cheap test a
    /// write makes before it touches the account.
    pub fn may_have_due_holds(&self, account: AccountId) -> bool {
        let Some(slot) = self.resident_slot(account) else {
            return false;
        };
        let tip = self.server_tip_ms();
        let st = slot.state.lock();
        st.holds.as_deref().is_some_and(|b| b.any_due(tip))
    }

    /// The account's holds due now, at most `limit`, each proven due in server time: a
    /// placement whose commit time this replica does not know is read from its batch first.
    pub async fn due_holds(
        &self,
        account: AccountId,
        view: &AccountView,
        limit: usize,
    ) -> Result<Vec<HoldId>, StoreError> {
        let AccountView::Memory(slot) = view else {
            return Ok(Vec::new());
        };
        let due = |tip| {
            let st = slot.state.lock();
            let Some(book) = st.holds.as_deref() else {
                return (Vec::new(), Vec::new());
            };
            let due = book.due(tip, limit);
            let unsure: Vec<u64> = due
                .iter()
                .filter(|(_, d)| *d == Due::Unsure)
                .filter_map(|(id, _)| book.placed(*id))
                .map(|h| h.placed_version)
                .collect();
            (due, unsure)
        };
        let (_, unsure) = due(self.server_tip_ms());
        for version in unsure {
            self.learn_commit_at(account, slot, version).await?;
        }
        Ok(due(self.server_tip_ms())
            .0
            .into_iter()
            .filter(|(_, d)| *d == Due::Yes)
            .map(|(id, _)| id)
            .collect())
    }

    /// Reads the commit time of each placement in the view's fold whose expiry is known only
    /// by a bound (`hold`'s alone when given), so a read shows `expiresAt` as a replica that
    /// folded the placement does. One one-batch read a placement, once: learned, it is known.
    pub async fn learn_placement_commits(
        &self,
        account: AccountId,
        view: &AccountView,
        hold: Option<HoldId>,
    ) -> Result<(), StoreError> {
        let AccountView::Memory(slot) = view else {
            return Ok(());
        };
        let versions = match slot.state.lock().holds.as_deref() {
            Some(book) => book.unknown_commits(hold),
            None => return Ok(()),
        };
        for version in versions {
            self.learn_commit_at(account, slot, version).await?;
        }
        Ok(())
    }

    /// Reads the batch at `version` and learns its commit time: the holds it placed.
    async fn learn_commit_at(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        version: u64,
    ) -> Result<(), StoreError> {
        let key = self.identity.key(account);
        let batches = read_whole(self.log.as_ref(), key, version, version).await?;
        if let Some(b) = batches.first() {
            self.observe_server_time(b.server_timestamp_ms);
            if let Some(book) = slot.state.lock().holds.as_deref_mut() {
                book.learn_commit(version, b.server_timestamp_ms);
            }
        }
        Ok(())
    }

    /// Accounts whose holds may be due now, earliest first, at most `limit`: where a sweep
    /// starts. Resident or not.
    pub fn accounts_with_due_holds(&self, limit: usize) -> Vec<AccountId> {
        let tip = self.server_tip_ms();
        let map = self.expiring.0.lock();
        let mut due: Vec<(u64, AccountId)> = map
            .iter()
            .filter(|(_, at)| **at <= tip)
            .map(|(a, at)| (*at, *a))
            .collect();
        drop(map);
        due.sort_unstable();
        due.into_iter().take(limit).map(|(_, a)| a).collect()
    }

    /// Notes where the account's expiring holds stand after its state changed: tracked
    /// while it has one, forgotten when it has none.
    pub(super) fn note_expiring(&self, account: AccountId, st: &AccountState) {
        let next = st.holds.as_deref().and_then(HoldBook::next_due_ms);
        let mut map = self.expiring.0.lock();
        match next {
            Some(at) if map.len() < MAX_EXPIRING_ACCOUNTS || map.contains_key(&account) => {
                map.insert(account, at);
            }
            Some(_) => {}
            None => {
                map.remove(&account);
            }
        }
    }
}
