//! The write path's records, several writes to one statement.
//!
//! Every write that lands sends its record (the index rows and the guarded cursor bump,
//! `PgProjection::record`). With many writes in flight, one statement per write spends the
//! database's CPU on per-statement work (a transaction, a plan, a commit record each), which
//! on a small machine is the projection's bottleneck. So records go through one queue: a
//! dispatcher sends whatever has queued as ONE statement, with at most
//! [`RECORD_STATEMENTS_IN_FLIGHT`] statements running at a time. Under light load a record
//! goes out alone at once (nothing waits for company); under load the records that queued
//! behind a running statement share the next one.
//!
//! Nothing about a record's meaning changes: each account row keeps its own guard (bumped
//! only from the version its write expected), each index row its own upsert, and the
//! statement's rows are in account order so concurrent statements lock accounts in one
//! order. Two records of one account never share a statement (a record that would repeat
//! an account waits for the next statement), because an upsert cannot touch one row twice.
//! Two records of one account can still be in flight in two statements at once (a transfer
//! racing a deposit's lane, or a record that outlived its wait): if the later version's
//! statement takes the row first, its guard skips it, and the earlier one's catch-up or the
//! next write moves it. Only a row found below the version its write expected (a lost
//! commit) is reported, and the writer catches it up before it answers. A failed statement fails
//! every record in it, each then handled as any failed record: answered anyway, counted,
//! replayed by the next catch-up.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{Semaphore, mpsc, oneshot};
use uuid::Uuid;

use super::rows::{self, IndexRows, RowLife};
use super::{PgError, RecordRow};
use crate::account::AccountId;
use crate::metrics::Metrics;
use crate::projection::RecentWrite;

/// Records waiting for a statement, at most; a write whose record finds the queue full
/// waits for room (the database is then the bottleneck, and this is its backpressure).
pub const RECORD_QUEUE_CAPACITY: usize = 4_096;
/// Record statements running at once (each holds a pooled connection while it runs).
pub const RECORD_STATEMENTS_IN_FLIGHT: usize = 4;
/// Account rows one record statement carries, at most.
pub const MAX_RECORD_ACCOUNTS: usize = 256;

/// One account row of a record.
#[derive(Clone, Copy)]
struct AccountRow {
    id: Uuid,
    balance: i64,
    version: i64,
    seq: i64,
    expected: i64,
}

/// The rows a record statement writes: one write's record (its account rows and index
/// rows), owned so that it can share a statement with others, or several records merged
/// into one statement's.
#[derive(Default)]
pub(super) struct StatementRows {
    accounts: Vec<AccountRow>,
    index: Vec<(AccountId, u128, RecentWrite, RowLife)>,
}

impl StatementRows {
    /// The record of one write's rows; its index rows live for `life` (server time).
    pub fn of(rows: &[RecordRow<'_>], life: RowLife) -> Self {
        let mut record = StatementRows::default();
        for r in rows {
            let w = r.write;
            for &(event_id, balance, event) in w.events {
                let write = RecentWrite {
                    balance,
                    version: w.new_version,
                    expires_at_ms: life.expires_at_ms,
                    event,
                    write_tag: None,
                };
                record.index.push((r.account, event_id, write, life));
            }
            record.accounts.push(AccountRow {
                id: r.account.0,
                balance: w.balance_after,
                version: rows::to_i64(w.new_version),
                seq: rows::to_i64(w.max_client_seq),
                expected: rows::to_i64(w.expected_version),
            });
        }
        record
    }

    fn shares_an_account_with(&self, other: &StatementRows) -> bool {
        self.accounts
            .iter()
            .any(|a| other.accounts.iter().any(|b| a.id == b.id))
    }

    fn append(&mut self, other: StatementRows) {
        self.accounts.extend(other.accounts);
        self.index.extend(other.index);
    }

    /// The statement's columns, index rows and account rows each in account order (so
    /// concurrent statements lock accounts in one order).
    pub fn columns(mut self) -> Columns {
        self.accounts.sort_by_key(|a| a.id);
        self.index
            .sort_by_key(|(account, event_id, _, _)| (account.0, *event_id));
        let mut index = IndexRows::default();
        for (account, event_id, w, life) in &self.index {
            index.push(*account, *event_id, w, *life);
        }
        let col = |f: fn(&AccountRow) -> i64| self.accounts.iter().map(f).collect();
        Columns {
            index,
            ids: self.accounts.iter().map(|a| a.id).collect(),
            balances: col(|a| a.balance),
            versions: col(|a| a.version),
            seqs: col(|a| a.seq),
            expected: col(|a| a.expected),
        }
    }
}

/// A record statement's parameters: the index rows (`$1..$9`), then one column per
/// account-row field (`$10..$14`).
pub(super) struct Columns {
    pub index: IndexRows,
    pub ids: Vec<Uuid>,
    pub balances: Vec<i64>,
    pub versions: Vec<i64>,
    pub seqs: Vec<i64>,
    pub expected: Vec<i64>,
}

/// A record waiting for its statement, and where its outcome goes.
struct Pending {
    record: StatementRows,
    done: oneshot::Sender<Result<Arc<Vec<Uuid>>, PgError>>,
}

/// The queue records go through (see the module docs).
pub(super) struct RecordQueue {
    tx: mpsc::Sender<Pending>,
    /// The longest a write waits for its record (queueing included): then it is answered
    /// anyway, and the record, if it still lands, lands later. A database that is down or
    /// slow must not hold every write's answer for as long as the queue is deep.
    wait_limit: Duration,
}

impl RecordQueue {
    /// Starts the dispatcher (on the current tokio runtime); it stops when the queue drops.
    /// A write waits at most `wait_limit` for its record.
    pub fn start(pool: Pool, metrics: Arc<Metrics>, wait_limit: Duration) -> Self {
        let (tx, rx) = mpsc::channel(RECORD_QUEUE_CAPACITY);
        tokio::spawn(dispatch(rx, pool, metrics));
        Self { tx, wait_limit }
    }

    /// Sends `record` in the next statement with room for it, and waits for that
    /// statement's outcome, for at most the wait limit: the record's accounts whose row the
    /// statement found below the version their write expected.
    pub async fn record(&self, record: StatementRows) -> Result<Vec<AccountId>, PgError> {
        let accounts: Vec<Uuid> = record.accounts.iter().map(|a| a.id).collect();
        let queued = async {
            let (done, outcome) = oneshot::channel();
            self.tx
                .send(Pending { record, done })
                .await
                .map_err(|_| PgError("the record queue has stopped".into()))?;
            outcome
                .await
                .map_err(|_| PgError("the record statement was dropped".into()))?
        };
        let behind = tokio::time::timeout(self.wait_limit, queued)
            .await
            .unwrap_or_else(|_| {
                Err(PgError(format!(
                    "the record did not finish within {} ms",
                    self.wait_limit.as_millis()
                )))
            })?;
        Ok(accounts
            .into_iter()
            .filter(|id| behind.contains(id))
            .map(AccountId)
            .collect())
    }
}

/// Takes a free statement slot, then everything queued (up to the caps) as one statement.
async fn dispatch(mut rx: mpsc::Receiver<Pending>, pool: Pool, metrics: Arc<Metrics>) {
    let slots = Arc::new(Semaphore::new(RECORD_STATEMENTS_IN_FLIGHT));
    let mut carried: Option<Pending> = None;
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let first = match carried.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let mut batch = vec![first];
        let mut merged = StatementRows::default();
        let mut accounts = batch[0].record.accounts.len();
        while accounts < MAX_RECORD_ACCOUNTS {
            let Ok(next) = rx.try_recv() else { break };
            let clash = batch
                .iter()
                .any(|p| p.record.shares_an_account_with(&next.record));
            if clash {
                carried = Some(next);
                break;
            }
            accounts += next.record.accounts.len();
            batch.push(next);
        }
        let mut dones = Vec::with_capacity(batch.len());
        for p in batch {
            merged.append(p.record);
            dones.push(p.done);
        }
        let (pool, metrics) = (pool.clone(), metrics.clone());
        tokio::spawn(async move {
            let outcome = super::execute_record(&pool, &metrics, merged)
                .await
                .map(Arc::new);
            for done in dones {
                let _ = done.send(outcome.clone());
            }
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a write waits for its record at most the wait limit, even when no statement
    /// ever comes back (a database that hangs); it is then answered with the record counted
    /// as failed, never held for as long as the queue is deep.
    #[tokio::test(start_paused = true)]
    async fn a_record_that_never_finishes_gives_up_at_the_wait_limit() {
        let (tx, _stalled) = mpsc::channel(RECORD_QUEUE_CAPACITY);
        let queue = RecordQueue {
            tx,
            wait_limit: Duration::from_millis(400),
        };
        let started = tokio::time::Instant::now();
        let outcome = queue.record(StatementRows::default()).await;
        assert_eq!(started.elapsed(), Duration::from_millis(400));
        let err = outcome.expect_err("no statement answered");
        assert!(err.to_string().contains("within 400 ms"), "{err}");
    }
}
