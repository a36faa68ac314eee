//! Catch-up on the Postgres projection: read the account row (with the index rows asked
//! for), read the store from the row's cursor, fold what is new exactly as the memory fold
//! does, and persist the fold (index rows inside the retention, and the cursor) in one
//! statement.

use std::time::Instant;

use super::warm::WarmUpdate;
use super::{PgError, PgProjection, PgRow, RowLife};
use crate::account::AccountId;
use crate::log_limit::{LogLimit, REPORT_INTERVAL};
use crate::projection::state::{AccountState, Broken, FoldContext, Snapshot};
use crate::projection::{Projection, ProjectionError, RecentWrite, broken_error};
use crate::store::{Batch, BatchStream, ReadFilter, StoreError};

/// What a Postgres catch-up found: the state, the index rows asked for, and how many
/// database statements it took.
pub struct PgCaughtUp {
    pub snap: Snapshot,
    pub hits: Vec<(u128, RecentWrite)>,
    pub statements: u32,
}

/// A database failure, as the layers above see it: retryable, nothing applied. The detail
/// (an SQLSTATE and the server's message, never the URL) is logged here, at most once a
/// second with how many failed since: while the database is down every write's every
/// attempt fails (`tally_projection_db_statements_total{outcome="error"}` counts each).
pub(crate) fn db_error(e: PgError) -> ProjectionError {
    static LOG: LogLimit = LogLimit::new(REPORT_INTERVAL);
    if let Some(report) = LOG.occurred() {
        tracing::warn!(error = %e, failed = report.count, since_ms = report.since_ms, "projection database statement failed");
    }
    ProjectionError::Database
}

/// The error of a row marked broken.
pub(crate) fn row_broken(account: AccountId, snap: Snapshot, broken: Broken) -> ProjectionError {
    let st = AccountState {
        version: snap.version,
        broken: Some(Box::new(broken)),
        ..AccountState::default()
    };
    broken_error(account, &st)
}

impl Projection {
    /// The account row and the index rows of `lookups` (and, with `since`, every live
    /// row above it: see [`PgProjection::load`]), without reading the store.
    pub(crate) async fn pg_load(
        &self,
        pg: &PgProjection,
        account: AccountId,
        lookups: &[u128],
        since: Option<u64>,
    ) -> Result<PgRow, ProjectionError> {
        if let Some(refused) = self.rows_refused() {
            return Err(ProjectionError::Store(refused));
        }
        let row = pg
            .load(account, lookups, self.server_tip_ms(), since)
            .await
            .map_err(db_error)?;
        // The row's writer knew the server had reached this time: age entries against it
        // too. (The lookup above used the estimate from before it; it can only have been
        // lower, so the rows it returned are live by it or by more.)
        self.observe_server_time(row.server_ts_ms);
        Ok(row)
    }

    /// Before a trim above the row this catch-up started from marks the account broken: the
    /// shared row is read again, and if another replica has meanwhile moved it past the trim
    /// (it folded those versions before they went), the account is fine and this attempt
    /// answers a retry (the next one starts from that row) rather than a final 500.
    async fn pg_cursor_still_below(
        &self,
        pg: &PgProjection,
        account: AccountId,
        min_available: u64,
    ) -> Result<(), ProjectionError> {
        let row = self.pg_load(pg, account, &[], None).await?;
        let version = row.state.map_or(0, |(snap, _)| snap.version);
        if version + 1 >= min_available {
            return Err(ProjectionError::Store(StoreError::shed(format!(
                "the shared cursor moved to version {version}, past the trim at {min_available}, during this catch-up"
            ))));
        }
        Ok(())
    }

    /// Catches the account up from the shared row and persists what it folded.
    pub(crate) async fn pg_catch_up(
        &self,
        pg: &PgProjection,
        account: AccountId,
        lookups: &[u128],
    ) -> Result<PgCaughtUp, ProjectionError> {
        let mut statements = 1;
        let since = self.pg_since(account);
        let loaded = self.pg_load(pg, account, lookups, since).await?;
        let mut st = AccountState::default();
        if let Some((snap, broken)) = loaded.state {
            if let Some(b) = broken {
                return Err(row_broken(account, snap, b));
            }
            st.balance = snap.balance;
            st.version = snap.version;
            st.max_client_seq = snap.max_client_seq;
        }
        let start = st.version;
        let started = Instant::now();
        // No row (a fresh or restored database): from a checkpoint, not the whole stream.
        let mut definitive = true;
        if st.version == 0 {
            definitive = self.seed_from_checkpoint(account, &mut st, None).await;
        }
        let (broken, newest_ts) = self
            .pg_fold_stream(pg, account, &mut st, definitive)
            .await?;
        self.metrics
            .catchup_duration
            .observe(started.elapsed().as_secs_f64());
        let snap = st.snapshot();
        let replayed = self.pg_row_lives(st.recent.live_entries());
        if st.version > start || broken.is_some() {
            statements += 1;
            pg.persist(account, snap, broken.as_ref(), &replayed, newest_ts)
                .await
                .map_err(db_error)?;
            self.metrics
                .projection_db_rows_replayed
                .inc_by(replayed.len() as u64);
        }
        if let Some(b) = broken {
            self.metrics.poisoned_accounts.inc();
            return Err(row_broken(account, snap, b));
        }
        self.pg_warm_up(
            account,
            WarmUpdate {
                since,
                snap,
                delta: loaded.delta.as_deref(),
                replayed: &replayed,
            },
        );
        let hits = answer_lookups(&st, lookups, self.server_tip_ms(), loaded.hits);
        Ok(PgCaughtUp {
            snap,
            hits,
            statements,
        })
    }

    /// Folds the stream after `st` into it, going on from a checkpoint when the row lies
    /// below a trim. Returns what broke the fold, if anything (to be persisted with the row),
    /// and the newest commit time read.
    async fn pg_fold_stream(
        &self,
        pg: &PgProjection,
        account: AccountId,
        st: &mut AccountState,
        mut definitive: bool,
    ) -> Result<(Option<Broken>, u64), ProjectionError> {
        let mut tried_checkpoint = false;
        let mut stream = BatchStream::new(
            self.log.as_ref(),
            self.identity.key(account),
            ReadFilter::from_version(st.version + 1),
        );
        let mut first_page = true;
        let mut broken: Option<Broken> = None;
        let mut newest_ts = 0;
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(StoreError::Trimmed { min_available })
                    if st.version + 1 < min_available && !tried_checkpoint =>
                {
                    // A row from before a trim: on from a checkpoint at or above it.
                    tried_checkpoint = true;
                    definitive = self
                        .seed_from_checkpoint(account, st, Some(min_available))
                        .await;
                    stream = BatchStream::new(
                        self.log.as_ref(),
                        self.identity.key(account),
                        ReadFilter::from_version(st.version + 1),
                    );
                    continue;
                }
                Err(StoreError::Trimmed { min_available }) => {
                    if st.version + 1 < min_available && !definitive {
                        return Err(ProjectionError::Store(StoreError::shed(format!(
                            "the stream is trimmed below version {min_available} and its checkpoints could not be read; retry"
                        ))));
                    }
                    if st.version + 1 < min_available {
                        self.pg_cursor_still_below(pg, account, min_available)
                            .await?;
                        broken = Some(Broken::Trimmed { min_available });
                    }
                    break;
                }
                Err(e) => return Err(ProjectionError::Store(e)),
            };
            let Some(last) = page.last() else { continue };
            self.observe_server_time(last.server_timestamp_ms);
            newest_ts = newest_ts.max(last.server_timestamp_ms);
            if first_page && stream.has_more() {
                // As the memory fold: age a long catch-up's early pages against the tip.
                if let Ok(d) = self.log.details(self.identity.key(account)).await {
                    self.observe_server_time(d.last_server_timestamp_ms);
                }
            }
            first_page = false;
            if let Err(b) = self.pg_fold_page(st, &page) {
                broken = Some(b);
                break;
            }
        }
        Ok((broken, newest_ts))
    }

    /// The rows a catch-up persists, from its scratch index: each entry expires at its
    /// batch's commit time plus the retention (see [`Projection::pg_fold_page`]), and its
    /// window ends that much earlier than the retention does.
    fn pg_row_lives(&self, folded: Vec<(u128, RecentWrite)>) -> Vec<(u128, RecentWrite, RowLife)> {
        let past_window = self.retention_ms().saturating_sub(self.window_ms());
        folded
            .into_iter()
            .map(|(id, w)| {
                let life = RowLife {
                    window_ends_ms: w.expires_at_ms.saturating_sub(past_window),
                    expires_at_ms: w.expires_at_ms,
                };
                (id, w, life)
            })
            .collect()
    }

    /// Folds one page into `st`, ageing in server time by the retention: a batch's entry
    /// expires at its commit time plus the retention (the fold computes `now + window -
    /// age` with the retention as its window, and now = tip here). So the scratch index
    /// holds every keyed event younger than the retention, each a row to persist, and its
    /// lookups answer a retry from anywhere in the retention.
    fn pg_fold_page(&self, st: &mut AccountState, page: &[Batch]) -> Result<(), Broken> {
        let tip = self.server_tip_ms();
        let ctx = FoldContext {
            client_id: self.identity.client(),
            window_ms: self.retention_ms().max(self.window_ms()),
            // The database keeps the keys (its index rows); the scratch state needs no
            // compact memory of them.
            retention_ms: 0,
            tip_ms: tip,
            now_ms: tip,
            // Holds need the memory projection (`Config::check`): a hold event stops the fold.
            holds: false,
        };
        let applied = st.fold(page, &ctx)?;
        self.metrics.events_folded.inc_by(applied);
        Ok(())
    }
}

/// What the lookups find: the fold just done first (it is at least as new as the row read
/// before it), then the row read.
fn answer_lookups(
    st: &AccountState,
    lookups: &[u128],
    tip: u64,
    from_row: Vec<(u128, RecentWrite)>,
) -> Vec<(u128, RecentWrite)> {
    let mut hits: Vec<(u128, RecentWrite)> = lookups
        .iter()
        .filter_map(|&id| st.recent.get(id, tip).map(|w| (id, w)))
        .collect();
    for (id, w) in from_row {
        if !hits.iter().any(|(h, _)| *h == id) {
            hits.push((id, w));
        }
    }
    hits
}
