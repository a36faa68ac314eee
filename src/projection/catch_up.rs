//! The memory fold's catch-up: read the account's stream from its cursor (or from a
//! checkpoint, cold or behind a trim) and fold it page by page, in the fold generation it was
//! read for.

use std::sync::Arc;
use std::time::Instant;

use crate::account::AccountId;
use crate::store::{Batch, BatchStream, ReadFilter, StoreError};

use super::{
    AccountSlot, AccountState, Backend, Broken, FoldContext, Projection, ProjectionError, Snapshot,
    broken_error, check_broken,
};

impl Projection {
    /// Reads the account's stream from its cursor and folds what is new. Returns the slot
    /// and the state after the fold. The memory fold's own catch-up: callers that serve
    /// either backend go through [`Projection::refresh`].
    ///
    /// # Panics
    /// On the Postgres backend, whose slots are warm copies with server-time expiry: a
    /// memory fold there would mark a copy complete with entries aged on the local clock,
    /// and a lookup could then miss a live key.
    pub async fn catch_up(
        &self,
        account: AccountId,
    ) -> Result<(Arc<AccountSlot>, Snapshot), ProjectionError> {
        assert!(
            matches!(self.backend, Backend::Memory),
            "the memory fold's catch-up called on the {} projection",
            self.backend_name()
        );
        let slot = self.slot(account);
        // `definitive`: whether a trim met by this fold is a verdict (see
        // `start_from_checkpoint`).
        let (from, generation, mut definitive) = self.fold_start(account, &slot).await?;
        let started = Instant::now();
        let mut stream = BatchStream::new(
            self.log.as_ref(),
            self.identity.key(account),
            ReadFilter::from_version(from),
        );
        let mut first_page = true;
        let mut tried_checkpoint = false;
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(StoreError::Trimmed { min_available }) if !tried_checkpoint => {
                    // Behind a trim (a cold fold whose pick lay below it, or a replica that held
                    // the account from before it): go on from a checkpoint at or above it.
                    tried_checkpoint = true;
                    let next;
                    (next, definitive) = self
                        .start_from_checkpoint(account, &slot, generation, Some(min_available))
                        .await;
                    if next >= min_available {
                        stream = BatchStream::new(
                            self.log.as_ref(),
                            self.identity.key(account),
                            ReadFilter::from_version(next),
                        );
                        first_page = true;
                    }
                    continue;
                }
                Err(StoreError::Trimmed { min_available }) => {
                    self.met_trim(account, &slot, generation, min_available, definitive)?;
                    // Our cursor moved past the trim meanwhile: what we have is whole.
                    break;
                }
                Err(e) => return Err(ProjectionError::Store(e)),
            };
            let Some(last) = page.last() else { continue };
            let long_read = first_page && stream.has_more();
            self.observe_page_time(account, last.server_timestamp_ms, long_read)
                .await;
            first_page = false;
            self.fold_page(account, &slot, generation, &page)?;
        }
        let snap = self.finish_catch_up(account, &slot, generation, started)?;
        Ok((slot, snap))
    }

    /// Where a catch-up starts: the fold generation it reads for, the version after the
    /// cursor, or for a cold fold the checkpoint it starts from, and whether a trim it meets
    /// is a verdict (see `start_from_checkpoint`). A broken account goes no further.
    async fn fold_start(
        &self,
        account: AccountId,
        slot: &AccountSlot,
    ) -> Result<(u64, u64, bool), ProjectionError> {
        let (mut from, generation, cold) = {
            let st = slot.state.lock();
            check_broken(account, &st)?;
            (st.version + 1, st.generation, st.version == 0 && !st.warm)
        };
        let mut definitive = true;
        if cold {
            (from, definitive) = self
                .start_from_checkpoint(account, slot, generation, None)
                .await;
        }
        Ok((from, generation, definitive))
    }

    /// Takes the server time of a page's last batch for ageing entries. A long catch-up
    /// (`long_read`: its first page, with more to come) ages its early pages against the
    /// stream's real tip, not against their own last batch, or long-expired entries would
    /// come back: one extra call, only for reads longer than a page.
    async fn observe_page_time(&self, account: AccountId, last_server_ms: u64, long_read: bool) {
        self.observe_server_time(last_server_ms);
        if long_read && let Ok(d) = self.log.details(self.identity.key(account)).await {
            self.observe_server_time(d.last_server_timestamp_ms);
        }
    }

    /// Ends a catch-up that read everything: its duration counted, then, if the fold is
    /// still the generation it read for, the fold marked warm and its expired entries
    /// dropped. Returns the state it ends at.
    fn finish_catch_up(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        generation: u64,
        started: Instant,
    ) -> Result<Snapshot, ProjectionError> {
        self.metrics
            .catchup_duration
            .observe(started.elapsed().as_secs_f64());
        let now = self.now_ms();
        let mut st = slot.state.lock();
        same_fold(&st, generation)?;
        st.warm = true;
        st.last_touch_ms = now;
        let expired = st.recent.evict_expired(now);
        self.add_index_entries(-(expired as i64));
        if self.config.holds {
            self.note_expiring(account, &st);
        }
        Ok(st.snapshot())
    }

    /// Folds one page a catch-up read into the account's state, in the generation it was
    /// read for.
    fn fold_page(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        generation: u64,
        page: &[Batch],
    ) -> Result<(), ProjectionError> {
        let ctx = self.fold_context();
        let mut st = slot.state.lock();
        same_fold(&st, generation)?;
        let (before, keys_before) = (st.recent.len(), st.keys.len());
        let result = st.fold(page, &ctx);
        self.add_index_entries(st.recent.len() as i64 - before as i64);
        self.keys_changed(&mut st, keys_before);
        match result {
            Ok(applied) => {
                self.metrics.events_folded.inc_by(applied);
                self.note_progress(account, &mut st, applied);
                Ok(())
            }
            Err(broken) => {
                self.metrics.poisoned_accounts.inc();
                st.broken = Some(Box::new(broken));
                Err(broken_error(account, &st))
            }
        }
    }

    /// A catch-up met a trim it cannot go on from. Below the cursor it is a verdict when the
    /// checkpoints could be read (the account is broken as trimmed), else retryable; at or
    /// above it (the cursor moved past the trim meanwhile) nothing is missing.
    fn met_trim(
        &self,
        account: AccountId,
        slot: &AccountSlot,
        generation: u64,
        min_available: u64,
        definitive: bool,
    ) -> Result<(), ProjectionError> {
        let mut st = slot.state.lock();
        same_fold(&st, generation)?;
        if st.version + 1 < min_available && !definitive {
            return Err(ProjectionError::Store(StoreError::shed(format!(
                "the stream is trimmed below version {min_available} and its checkpoints could not be read; retry"
            ))));
        }
        if st.version + 1 < min_available {
            self.metrics.poisoned_accounts.inc();
            st.broken = Some(Box::new(Broken::Trimmed { min_available }));
        }
        check_broken(account, &st)
    }

    /// The fold context for a fold starting now.
    pub fn fold_context(&self) -> FoldContext {
        FoldContext {
            client_id: self.identity.client(),
            window_ms: self.window_ms(),
            retention_ms: self.retention_ms(),
            tip_ms: self.server_tip_ms(),
            now_ms: self.now_ms(),
            holds: self.config.holds,
        }
    }
}

/// Whether the account's fold is still the generation a catch-up read for. One dropped in
/// place meanwhile (`regress.rs`): what was read belongs to the old one, and folding it would
/// look like a gap, so the catch-up is retried from the new one.
fn same_fold(st: &AccountState, generation: u64) -> Result<(), ProjectionError> {
    if st.generation == generation {
        Ok(())
    } else {
        Err(ProjectionError::Store(Projection::dropped_during_catch_up()))
    }
}
