//! The projection port: what the write loop and the reader call, answered the same by both
//! backends. Each call names the event ids it wants looked up, so the Postgres backend can
//! answer them in the same statement that reads the account row.

use std::sync::Arc;

use super::postgres::{RecordRow, RowLife, WarmUpdate};
use super::state::Snapshot;
use super::{AccountSlot, Backend, Projection, ProjectionError, RecentWrite, RecordedWrite};
use crate::account::AccountId;
use crate::account::holds::{HoldId, HoldStatus};
use crate::log_limit::{LogLimit, REPORT_INTERVAL};

/// What a load handed back to answer index lookups from.
pub enum AccountView {
    /// The resident account: looked up under its lock, at lookup time.
    Memory(Arc<AccountSlot>),
    /// The live index rows the load asked for, read with the account row.
    Postgres(Vec<(u128, RecentWrite)>),
}

/// An account's state, and the view its index lookups are answered from.
pub struct Loaded {
    pub view: AccountView,
    pub snap: Snapshot,
    /// Database statements the load took (0 on the memory backend).
    pub db_statements: u32,
}

/// What recording a write did.
#[derive(Debug, Default)]
pub struct Recorded {
    /// Database statements sent (0 or 1).
    pub statements: u32,
    /// Accounts whose shared row the record found below the version its write expected
    /// (Postgres): the writer catches them up before answering (`write_loop::run::append`),
    /// so an account written once after the database lost a commit does not keep a stale
    /// row.
    pub rows_behind: Vec<AccountId>,
}

impl Projection {
    /// Whether this projection talks to a database (its round trips are worth counting).
    pub fn uses_database(&self) -> bool {
        matches!(self.backend, Backend::Postgres(_))
    }

    /// The account's state without reading the store, when the backend can vouch for it:
    /// the memory fold's resident, warm and readable account; on Postgres, the replica's
    /// complete warm copy of the row (no statement) when it can answer every key of
    /// `lookups`, else the shared database's row (with the index rows of `lookups`), when
    /// there is one and it is readable. `None`: catch up instead ([`Projection::refresh`]).
    ///
    /// A warm copy's index holds the window only, and the database keeps rows for the
    /// retention. A key past the window is only a fingerprint in the copy, so a key that
    /// matches one is looked up in the database, never taken as "never landed"
    /// ([`Projection::pg_warm_answer`]).
    pub async fn current(
        &self,
        account: AccountId,
        lookups: &[u128],
    ) -> Result<Option<Loaded>, ProjectionError> {
        match &self.backend {
            Backend::Memory => Ok(self.warm_snapshot(account).map(|(slot, snap)| Loaded {
                view: AccountView::Memory(slot),
                snap,
                db_statements: 0,
            })),
            Backend::Postgres(pg) => {
                if let Some((slot, snap)) = self.warm_snapshot(account)
                    && let Some(hits) = self.pg_warm_answer(&slot, lookups)
                {
                    return Ok(Some(Loaded {
                        view: AccountView::Postgres(hits),
                        snap,
                        db_statements: 0,
                    }));
                }
                let since = self.pg_since(account);
                let row = self.pg_load(pg, account, lookups, since).await?;
                Ok(match row.state {
                    Some((snap, None)) => {
                        self.pg_warm_up(
                            account,
                            WarmUpdate {
                                since,
                                snap,
                                delta: row.delta.as_deref(),
                                replayed: &[],
                            },
                        );
                        Some(Loaded {
                            view: AccountView::Postgres(row.hits),
                            snap,
                            db_statements: 1,
                        })
                    }
                    _ => None,
                })
            }
        }
    }

    /// A first touch on the memory fold: an account this replica has never loaded (or has
    /// evicted), taken as empty without reading the store. A write decided on it expects
    /// version 0, so the store's version guard bounces it if the account has any event
    /// (including a landed earlier attempt of the same request), and the loop catches up;
    /// a brand-new account costs one round trip instead of a read of nothing and a write.
    /// `None` when the account is resident, was evicted holding events (it exists: read
    /// it), or on Postgres (its row read is the load).
    pub fn first_touch(&self, account: AccountId) -> Option<Loaded> {
        if self.uses_database()
            || self.resident_slot(account).is_some()
            || self.existed.knows(account)
        {
            return None;
        }
        Some(Loaded {
            view: AccountView::Memory(self.slot(account)),
            snap: Snapshot::default(),
            db_statements: 0,
        })
    }

    /// Notes that `account` exists, so that its first write reads it instead of taking it
    /// as new (a first touch, which would bounce off the version guard). Nothing is read
    /// now: a read here would move the server clock before start-up anchors it.
    pub fn remember_existing(&self, account: AccountId) {
        self.existed.remember(account);
    }

    /// Catches the account up with the store and returns its state; the index rows of
    /// `lookups` are answerable from the view.
    pub async fn refresh(
        &self,
        account: AccountId,
        lookups: &[u128],
    ) -> Result<Loaded, ProjectionError> {
        match &self.backend {
            Backend::Memory => {
                let (slot, snap) = self.catch_up(account).await?;
                Ok(Loaded {
                    view: AccountView::Memory(slot),
                    snap,
                    db_statements: 0,
                })
            }
            Backend::Postgres(pg) => {
                let c = self.pg_catch_up(pg, account, lookups).await?;
                Ok(Loaded {
                    view: AccountView::Postgres(c.hits),
                    snap: c.snap,
                    db_statements: c.statements,
                })
            }
        }
    }

    /// The live index entry of `event_id` on an account that is warm here, from memory alone:
    /// no store or database call, so it can answer when nothing else may run. `None` when the
    /// account is not warm here or holds no live entry (which proves nothing: on Postgres a
    /// warm copy holds the window, and the key may sit in the database past it).
    pub fn warm_lookup(&self, account: AccountId, event_id: u128) -> Option<RecentWrite> {
        let (slot, _) = self.warm_snapshot(account)?;
        let view = match &self.backend {
            Backend::Memory => AccountView::Memory(slot),
            Backend::Postgres(_) => AccountView::Postgres(self.pg_warm_hits(&slot, &[event_id])),
        };
        self.lookup(&view, event_id)
    }

    /// The live index entry of `event_id` in a loaded view.
    pub fn lookup(&self, view: &AccountView, event_id: u128) -> Option<RecentWrite> {
        match view {
            AccountView::Memory(slot) => slot.state.lock().recent.get(event_id, self.now_ms()),
            AccountView::Postgres(hits) => {
                hits.iter().find(|(id, _)| *id == event_id).map(|(_, w)| *w)
            }
        }
    }

    /// What the account's fold shows of hold `id` now. Holds need the memory projection.
    pub fn hold_status(&self, view: &AccountView, id: HoldId) -> HoldStatus {
        match view {
            AccountView::Memory(slot) => slot
                .state
                .lock()
                .holds
                .as_deref()
                .map_or(HoldStatus::Unknown, |book| book.status(id)),
            AccountView::Postgres(_) => HoldStatus::Unknown,
        }
    }

    /// Records this replica's own successful write, on every account it touched: index
    /// entries first or together, then the guarded cursor bump (see
    /// [`Projection::record_write`]). On Postgres this is ONE statement for the whole write.
    ///
    /// Never fails: the store holds the write, so its answer goes back regardless. A failed
    /// record is logged and counted (`tally_projection_record_failures_total`); the next
    /// catch-up replays the event and indexes it, so a retry on any replica still finds it.
    /// Returns the database statements sent (0 or 1), and the accounts whose shared row
    /// the record found behind (see [`Recorded`]).
    pub async fn record(
        &self,
        writes: &[(AccountId, &AccountView, RecordedWrite<'_>)],
    ) -> Recorded {
        match &self.backend {
            Backend::Memory => {
                for (account, view, write) in writes {
                    if let AccountView::Memory(slot) = view {
                        self.record_own_write(*account, slot, write);
                    }
                }
                Recorded::default()
            }
            Backend::Postgres(pg) => {
                let rows: Vec<RecordRow<'_>> = writes
                    .iter()
                    .map(|(account, _, write)| RecordRow {
                        account: *account,
                        write,
                    })
                    .collect();
                // The full window and retention from now, in server time: this write's own
                // commit time is not in the store's answer, and the estimate never runs
                // ahead of the server, so the row outlives each by a round trip at most.
                let tip = self.server_tip_ms();
                let life = RowLife {
                    window_ends_ms: tip.saturating_add(self.window_ms()),
                    expires_at_ms: tip.saturating_add(self.retention_ms().max(self.window_ms())),
                };
                // The warm copy first (it holds the window): the store holds the write
                // whatever the database says.
                for (account, _, write) in writes {
                    self.pg_record_warm(*account, write, life.window_ends_ms);
                }
                // Where the database is now behind this replica's copy, the copy goes. Kept,
                // it would send every later write down the fast path, whose records are
                // guarded on a cursor the database never reached: the shared row would stay
                // stale for as long as only this replica wrote. Without it, the next write
                // loads the row and catches up, which persists what was missed.
                let mut rows_behind = Vec::new();
                match pg.record(&rows, life).await {
                    Ok(behind) => {
                        // The row stood below the version this write expected: the database
                        // lost a commit the copy had counted on (asynchronous
                        // commit, a crash or a failover), or two statements raced. The copy
                        // goes, and the caller catches the row up.
                        self.metrics
                            .projection_rows_behind
                            .inc_by(behind.len() as u64);
                        for &account in &behind {
                            self.pg_forget_warm(account);
                        }
                        rows_behind = behind;
                    }
                    Err(e) => {
                        self.metrics.projection_record_failures.inc();
                        // While the database is down every write lands here: one line a
                        // second (the metric counts each).
                        static LOG: LogLimit = LogLimit::new(REPORT_INTERVAL);
                        if let Some(report) = LOG.occurred() {
                            tracing::warn!(error = %e, accounts = rows.len(), failed = report.count, since_ms = report.since_ms,
                                "the write landed but recording it in the projection failed; the next catch-up replays it");
                        }
                        for (account, _, _) in writes {
                            self.pg_forget_warm(*account);
                        }
                    }
                }
                Recorded {
                    statements: 1,
                    rows_behind,
                }
            }
        }
    }
}
