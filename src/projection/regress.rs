//! A store that went backwards: it shows fewer versions than this replica has folded. A
//! store that keeps what it acknowledged never does; one restored from a backup or replaced
//! by an empty one under running replicas does, and then a fold ahead of it is worse than
//! stale: once other writers take the stream back up to the fold's version, a write at that
//! version passes the guard against a balance the store does not have (else
//! a withdrawal could answer 200 and take the store's balance below zero).
//!
//! What is seen, and where: a version conflict whose current version is below the one the
//! write expected (per account, at once); and, at every server-clock anchor (the whole
//! store, within one re-anchor interval), the store's epoch changing (a create-only event
//! with a random id that the first replica to find none writes: a store replaced by an empty
//! one has none, or another) or the clock aggregate answering a probe with a lower version
//! than an earlier probe (a store restored from an older copy of itself). Either way the folds concerned are dropped to empty, exactly as if evicted:
//! the next request folds the account again from version 1, as a fresh replica would. A
//! false alarm (a conflict that leaves out its current version) costs one such read.
//!
//! The Postgres projection's shared rows are not moved backwards here (one replica's
//! observation does not rewrite the fleet's cursor): once a replica sees the store went
//! backwards, either way, it serves no row (retryable errors), because a row whose version
//! the store reaches again would pass the version guard on a balance the store does not
//! have. docs/stores.md, "A store that went backwards", says what the operator does.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::{AccountState, Projection};
use crate::account::AccountId;
use crate::metrics::seen_by;
use crate::store::{AggregateWrite, Event, EventType, ReadFilter, StoreError};

/// The event type of the store's epoch (in its own aggregate, never in an account).
const STORE_EPOCH_EVENT: EventType = EventType { major: 1, minor: 0 };

impl Projection {
    /// A conflict said `account` stands at `current` in the store: if the fold is past it,
    /// drop the fold (the next catch-up reads from version 1). Returns whether it did.
    pub fn store_went_behind(&self, account: AccountId, current: u64) -> bool {
        let Some(slot) = self.accounts.get(&account).map(|s| s.clone()) else {
            return false;
        };
        let mut st = slot.state.lock();
        if st.version <= current {
            return false;
        }
        tracing::error!(
            %account,
            folded = st.version,
            store = current,
            "the store shows fewer versions of this account than were folded (restored or replaced?); folding it again from version 1"
        );
        // On Postgres the shared row stays ahead of the store: once other writers take the
        // stream back up to it, a write at its version would pass the guard. The store's own
        // 2003 is its word, so the replica stops serving rows, as after the probe.
        self.refuse_rows();
        self.drop_fold(account, &mut st);
        self.metrics
            .store_regressions
            .with_label_values(&[seen_by::CONFLICT])
            .inc();
        true
    }

    /// Whether the store went back since the last check (the last server-clock probe's
    /// version, and the store's epoch), and if so every fold is dropped, once. Run once the
    /// start-up anchor is done and after each re-anchor, never on the start-up path: the
    /// epoch costs a round trip or two that readiness does not wait for (the replica's
    /// listening waits for the first, within start-up's first-attempts bound). The first check
    /// sets what the later ones compare with (a first check that learns no epoch leaves
    /// that to the next anchor; meanwhile a conflict below a fold's version still catches
    /// a store gone back under it).
    pub async fn check_store(&self) {
        let restored = self.note_anchor_version(self.probe_version.load(Ordering::Acquire));
        let replaced = self.check_store_epoch().await;
        if restored || replaced {
            self.whole_store_went_back();
        }
        self.store_checks.send_modify(|n| *n += 1);
    }

    /// Waits until `n` store checks have finished (a replica's first runs as soon as its
    /// start-up anchor is done).
    pub async fn store_checked(&self, n: u64) {
        let mut checks = self.store_checks.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail.
        let _ = checks.wait_for(|done| *done >= n).await;
    }

    /// Whether the probe landed lower than an earlier one: the store went backwards.
    fn note_anchor_version(&self, version: u64) -> bool {
        if version == 0 {
            return false; // no version reported: nothing to compare
        }
        let before = self.anchor_version.fetch_max(version, Ordering::AcqRel);
        if version >= before {
            return false;
        }
        // Start again from this store's count, so one regression is acted on once.
        self.anchor_version.store(version, Ordering::Release);
        tracing::error!(
            probe_version = version,
            earlier = before,
            "the clock probe landed below an earlier one: the store went backwards (restored?)"
        );
        true
    }

    /// Checks the store's epoch: writes a new one if the store has none (create-only, so
    /// only one ever lands), else reads the one it has. A different epoch than the last one
    /// seen, or none where one was seen, is a replaced store. An answer that proves neither
    /// (a lost reply, a read that does not show the epoch yet) is left for the next anchor.
    async fn check_store_epoch(&self) -> bool {
        let Some(epoch) = self.store_epoch().await else {
            return false;
        };
        let before = self.store_epoch.lock().replace(epoch);
        let mut replaced = before.is_some_and(|b| b != epoch);
        if replaced {
            tracing::error!("the store's epoch changed: the store was replaced");
        }
        // Postgres: the rows remember the store they were folded from, so a replica started
        // after the store was replaced (that never saw the old epoch) knows it too.
        // Before this replica's migrations the table may not exist yet (a fresh database):
        // the migration step runs this check again once they are done.
        if let super::Backend::Postgres(pg) = &self.backend
            && pg.is_migrated()
        {
            match pg.bind_store_epoch(epoch).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::error!(
                        "the shared rows were folded from another store than this one (replaced?)"
                    );
                    replaced = true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not check the rows' store epoch; the next anchor tries again");
                }
            }
        }
        replaced
    }

    /// The store's epoch: ours if the store had none (the create-only write landed), else
    /// the one it holds; `None` when an answer proves neither (said in the log).
    async fn store_epoch(&self) -> Option<u128> {
        let key = self.identity.store_epoch_key();
        let mine = uuid::Uuid::new_v4().as_u128();
        let create = AggregateWrite {
            key,
            events: vec![Event {
                client_seq: 0,
                event_id: Some(mine),
                event_type: STORE_EPOCH_EVENT,
                payload: Bytes::new(),
                timestamp_ms: 0,
            }],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: false,
        };
        match self.log.write(self.identity.client(), vec![create]).await {
            Ok(_) => Some(mine),
            Err(StoreError::Conflict { .. }) => {
                let first = ReadFilter {
                    to_version: Some(1),
                    ..ReadFilter::from_version(1)
                };
                match self.log.read(key, &first).await {
                    Ok(page) => match page.batches.first().and_then(|b| b.events.first()) {
                        Some(Event {
                            event_id: Some(id), ..
                        }) => Some(*id),
                        _ => None,
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "could not read the store's epoch; the next anchor tries again");
                        None
                    }
                }
            }
            Err(e) => {
                // Left for the next anchor; said, so a store that refuses the epoch's
                // aggregate (and leaves this check inert) is seen.
                tracing::warn!(error = %e, "could not check the store's epoch; the next anchor tries again");
                None
            }
        }
    }

    /// Every fold dropped (and, on Postgres, no row served again).
    fn whole_store_went_back(&self) {
        // On Postgres, rows are refused before anything is dropped: a load that passed
        // before the drop must not build a warm copy again after it (`pg_warm_up` asks
        // too). A replica refusing them already has acted, and the rows' epoch stays the
        // other store's until an operator reconciles them, so every later check sees it
        // again: acted on and counted once, however many checks race.
        if self.uses_database() && !self.refuse_rows() {
            return;
        }
        tracing::error!("the store went backwards under this replica; dropping every fold");
        // Collected first: no account lock is taken while the map's shards are held.
        let slots: Vec<_> = self
            .accounts
            .iter()
            .map(|e| (*e.key(), e.value().clone()))
            .collect();
        for (account, slot) in slots {
            self.drop_fold(account, &mut slot.state.lock());
        }
        self.metrics
            .store_regressions
            .with_label_values(&[seen_by::ANCHOR])
            .inc();
    }

    /// As an eviction drops it ([`Projection::forget_fold`]), but in place, one generation on.
    fn drop_fold(&self, account: AccountId, st: &mut AccountState) {
        self.forget_fold(account, st);
        let generation = st.generation + 1;
        *st = AccountState {
            generation,
            ..AccountState::default()
        };
    }

    /// Postgres: no row is served again (the memory fold has none to refuse).
    /// Postgres: no row is served from now on. Returns whether this call is the one that
    /// stopped them (always false on the memory projection).
    fn refuse_rows(&self) -> bool {
        if !self.uses_database() {
            return false;
        }
        self.metrics.rows_refused.set(1);
        !self.rows_ahead_of_store.swap(true, Ordering::AcqRel)
    }

    /// Postgres: why no row may be served, once the store went backwards under them.
    pub(crate) fn rows_refused(&self) -> Option<StoreError> {
        self.rows_ahead_of_store
            .load(Ordering::Acquire)
            .then(|| StoreError::shed("the store went backwards under the shared rows (restored or replaced?): an operator must reconcile them and restart this replica"))
    }

    /// A catch-up that read for an earlier generation of the fold: retryable.
    pub(super) fn dropped_during_catch_up() -> StoreError {
        StoreError::shed(
            "the fold was dropped during this catch-up (the store went backwards); try again",
        )
    }
}
