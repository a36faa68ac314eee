//! A key past the window, found again: the key memory names the batches its fingerprint
//! points at, and one store read of each confirms or refutes it (`keys/` has the memory).

use super::keys::MAX_CANDIDATES;
use super::{AccountView, Projection, RecentWrite, index};
use crate::account::{AccountEvent, AccountId};
use crate::metrics::remembered;
use crate::store::{StoreError, read_whole};

impl Projection {
    /// The write `event_id` made on `account`, when the account's key memory remembers it
    /// and the batch it points at carries it, committed within the retention. `Ok(None)`: not
    /// remembered (never landed here, landed past the retention, or a Postgres view, whose
    /// rows answer through [`Projection::lookup`]). A fingerprint that matches another key
    /// costs one read and answers nothing. Too many matches, or a read that fails, is an
    /// error: the caller must not write on a guess.
    pub async fn remembered(
        &self,
        account: AccountId,
        view: &AccountView,
        event_id: u128,
    ) -> Result<Option<RecentWrite>, StoreError> {
        let AccountView::Memory(slot) = view else {
            return Ok(None);
        };
        let candidates = slot.state.lock().keys.candidates(event_id);
        let candidates = candidates.map_err(|n| {
            self.count_look(remembered::COLLIDED);
            StoreError::shed(format!(
                "{n} remembered keys share this key's fingerprint (at most {MAX_CANDIDATES} are read)"
            ))
        })?;
        // Newest first: a key that landed again after its first landing aged out answers
        // with its latest landing, and once the newest is past the retention all are.
        let mut candidates = candidates;
        candidates.sort_unstable_by_key(|c| std::cmp::Reverse(c.version));
        let key = self.identity.key(account);
        for c in candidates {
            let batch = match read_whole(self.log.as_ref(), key, c.version, c.version).await {
                Ok(batches) => batches.into_iter().next(),
                // Trimmed away: a trim keeps every batch a remembered key points at, so this
                // one is past the retention (or trimmed by hand): not remembered.
                Err(StoreError::Trimmed { .. }) => None,
                Err(e) => return Err(e),
            };
            let Some(batch) = batch.filter(|b| b.version == c.version) else {
                self.count_look(remembered::EXPIRED);
                continue;
            };
            let Some(e) = batch.events.iter().find(|e| e.event_id == Some(event_id)) else {
                self.count_look(remembered::COLLISION);
                continue;
            };
            // Aged as the index ages its entries: at the retention exactly, forgotten.
            let age = self
                .server_tip_ms()
                .saturating_sub(batch.server_timestamp_ms);
            if age >= self.retention_ms() {
                self.count_look(remembered::EXPIRED);
                return Ok(None);
            }
            let event = AccountEvent::decode(e.event_type, &e.payload).map_err(|err| {
                StoreError::Other {
                    code: 0,
                    message: format!("event at version {}: undecodable: {err}", c.version),
                }
            })?;
            self.count_look(remembered::HIT);
            let own = batch.client_id == self.identity.client();
            return Ok(Some(RecentWrite {
                balance: c.balance,
                version: c.version,
                // Answered now, never kept: it has no lifetime of its own.
                expires_at_ms: self.now_ms(),
                event,
                write_tag: own.then(|| index::write_tag(e.client_seq, e.timestamp_ms)),
            }));
        }
        Ok(None)
    }

    fn count_look(&self, result: &'static str) {
        self.metrics
            .remembered_looks
            .with_label_values(&[result])
            .inc();
    }
}
