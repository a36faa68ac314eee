//! The read side: an account's balance and its history, as typed values with one typed
//! error. It knows nothing about HTTP; `http::accounts` parses a request, calls it and maps
//! the answer (and `http::error` maps [`ReadError`]).
//!
//! A balance comes from the fold ([`Projection`]); a history page comes from the store's
//! stream itself, so a stream the fold cannot derive (trimmed, poisoned) still has a
//! readable history, just no balance.

use std::sync::Arc;
use std::time::Duration;

use crate::account::{AccountEvent, AccountId, AccountsMode};
use crate::projection::{Loaded, Projection, ProjectionError, Snapshot};
use crate::store::{BatchStream, ReadFilter, StoreError};

/// History page size when the caller names none, and the most it may ask for.
pub const DEFAULT_HISTORY_LIMIT: usize = 100;
pub const MAX_HISTORY_LIMIT: usize = 1000;
/// Catch-ups a `min_version` balance read tries before giving up with
/// [`ReadError::NotVisibleYet`].
const MIN_VERSION_ATTEMPTS: u32 = 5;
const MIN_VERSION_BACKOFF: Duration = Duration::from_millis(20);

/// An account's balance at a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Balance {
    pub balance_cents: i64,
    pub version: u64,
}

impl From<Snapshot> for Balance {
    fn from(s: Snapshot) -> Self {
        Self {
            balance_cents: s.balance,
            version: s.version,
        }
    }
}

/// One event of a history page, with the batch (version) it was written in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    pub version: u64,
    pub server_timestamp_ms: u64,
    pub event_id: Option<u128>,
    pub event: AccountEvent,
    pub writer: Writer,
}

/// Who wrote an event, from its batch's client id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    /// This service (every replica shares one client id).
    Service,
    /// Another writer: an offline device (its client id is its device id), or any other
    /// client of the store. Its events are folded like ours but never raise our sequence.
    Client(u128),
}

/// One page of an account's history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryPage {
    /// Whole batches, oldest first: at most the limit, unless one batch alone holds more.
    pub events: Vec<HistoryEntry>,
    /// The newest version known: the fold's, or a read's when the read is ahead of it.
    pub current_version: u64,
    /// `None` when the fold cannot derive the balance (a trimmed or poisoned stream).
    pub balance_cents: Option<i64>,
    /// Where the next page starts, when more exists.
    pub next_from_version: Option<u64>,
    /// Set when the stream is trimmed above the asked-for start: the page starts here.
    pub first_available_version: Option<u64>,
}

/// Why a read cannot be answered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// Retryable: this replica has not seen the asked-for version yet (read-your-writes
    /// against another replica's write).
    #[error("this replica has not yet seen version {min_version} of the account")]
    NotVisibleYet { min_version: u64 },
    /// Final: the store itself says the account has not reached `min_version`, so no
    /// replica can answer it (a version no write has produced; retrying cannot help).
    #[error(
        "minVersion {min_version} is beyond the account's newest version ({current}) in the store"
    )]
    MinVersionBeyondTip { min_version: u64, current: u64 },
    /// Retryable: the history read showed nothing where the fold has events (a lagging
    /// read). An empty page pointing at itself would stop a client that follows the pages.
    #[error(
        "the store's read shows nothing from version {from_version}, but the account is at {current}; retry"
    )]
    HistoryBehindFold { from_version: u64, current: u64 },
    /// Retryable: the history read showed versions the fold could not reach even after
    /// folding again (a lagging read), so no balance at the page's current version can be
    /// given. Never a balance of an older version next to a newer `currentAggregateVersion`.
    #[error("the account's fold lags behind version {seen} of its history; retry")]
    BalanceBehindHistory { seen: u64 },
    /// Retryable: the fold cannot say how far the stream goes (it is trimmed or poisoned),
    /// and the store's details call that would say it failed. Without the tip a full page
    /// would look like the last one, and a client following the pages would stop early.
    #[error("the store could not say where the account's stream ends ({0}); retry")]
    HistoryTipUnknown(StoreError),
    /// The page size asked for is outside `1..=MAX_HISTORY_LIMIT`.
    #[error("limit must be 1..={max}")]
    LimitOutOfRange { max: usize },
    /// An event in the stream could not be decoded or applied: the account is poisoned.
    #[error("account {account} is unreadable at version {version}: {reason}")]
    Unreadable {
        account: AccountId,
        version: u64,
        reason: String,
    },
    /// The stream was trimmed above the fold's cursor, so the balance cannot be derived.
    #[error(
        "account {account} stream is trimmed below version {min_available}; its balance cannot be folded"
    )]
    Trimmed {
        account: AccountId,
        min_available: u64,
    },
    /// The store did not answer, or answered an error.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The Postgres projection's database did not answer. Retryable.
    #[error("the projection database did not answer; retry shortly")]
    Database,
    /// Retryable: the store's reads show none of the account's events, but the store says
    /// the account is at `version`. Never a balance of 0 at version 0 for an account that
    /// exists (a server found to hide a new aggregate's head from reads; docs/stores.md).
    #[error(
        "the store says the account is at version {version}, but its reads show none of its events yet; retry"
    )]
    StoreHidesEvents { version: u64 },
    /// Accounts are explicit and the store has no stream for this one: it was never opened.
    #[error("account {account} was never opened")]
    AccountNotFound { account: AccountId },
}

impl From<ProjectionError> for ReadError {
    fn from(e: ProjectionError) -> Self {
        match e {
            ProjectionError::Poisoned {
                account,
                version,
                reason,
            } => ReadError::Unreadable {
                account,
                version,
                reason,
            },
            ProjectionError::Trimmed {
                account,
                min_available,
            } => ReadError::Trimmed {
                account,
                min_available,
            },
            ProjectionError::Store(s) => ReadError::Store(s),
            ProjectionError::Database => ReadError::Database,
        }
    }
}

/// Answers balance and history reads from this replica's fold and the store.
pub struct AccountReader {
    projection: Arc<Projection>,
    accounts: AccountsMode,
}

impl AccountReader {
    /// A reader for implicit accounts: an account with no event reads as empty.
    pub fn new(projection: Arc<Projection>) -> Self {
        Self {
            projection,
            accounts: AccountsMode::Implicit,
        }
    }

    /// With explicit accounts an account with no event is [`ReadError::AccountNotFound`].
    pub fn with_accounts(mut self, accounts: AccountsMode) -> Self {
        self.accounts = accounts;
        self
    }

    /// The account's balance. With `min_version`, at that version or newer: read-your-writes
    /// for a client that wrote through another replica. Answers from the local fold when it
    /// already has that version, else catches up (a few times, with a pause between) and
    /// gives up with [`ReadError::NotVisibleYet`]. Without it, always catches up first.
    pub async fn balance(
        &self,
        account: AccountId,
        min_version: Option<u64>,
    ) -> Result<Balance, ReadError> {
        // A read-your-writes read this replica can already satisfy needs no store round trip.
        if let Some(min) = min_version
            && let Some(snap) = self.local_snapshot(account).await?
            && snap.version >= min.max(1)
        {
            return Ok(snap.into());
        }
        let mut attempt = 0;
        loop {
            let snap = self.projection.refresh(account, &[]).await?.snap;
            if min_version.is_none_or(|min| snap.version >= min) {
                self.confirm_empty(account, snap.version).await?;
                return Ok(snap.into());
            }
            let min = min_version.expect("only a min version can be unmet");
            if attempt == 0 {
                self.check_reachable(account, min).await?;
            }
            attempt += 1;
            if attempt >= MIN_VERSION_ATTEMPTS {
                return Err(ReadError::NotVisibleYet { min_version: min });
            }
            tokio::time::sleep(MIN_VERSION_BACKOFF).await;
        }
    }

    /// On the first miss of a `min_version` read, asks the store how far the account goes
    /// (one details call, only when this replica's catch-up fell short): a version the store
    /// has not reached is refused at once, as the watch route refuses a resume beyond the
    /// tip, instead of a retryable 503 that no retry can turn into an answer. A version the
    /// store has is this replica's lag, and the catch-ups go on. Decides nothing (the read
    /// stays retryable) when the details call fails, or says the account has no version
    /// yet: a Celeriant server was found to hide a new account's create from its details
    /// call as well as its reads (docs/stores.md), so "no version" may be a create that
    /// landed, and a final 400 for the version its writer was given would be wrong.
    async fn check_reachable(&self, account: AccountId, min_version: u64) -> Result<(), ReadError> {
        let current = match self.projection.store_version(account).await {
            Ok(v) if v > 0 => v,
            Ok(_) | Err(_) => return Ok(()),
        };
        if min_version > current {
            return Err(ReadError::MinVersionBeyondTip {
                min_version,
                current,
            });
        }
        Ok(())
    }

    /// An account whose reads showed no event at all (`version` 0) is asked about once more,
    /// by the store's details: one that does not exist is answered as such (balance 0 at
    /// version 0, or [`ReadError::AccountNotFound`] with explicit accounts); one the store
    /// says exists is a read that hides its events, and retryable. Costs a round trip only
    /// for accounts that look new.
    async fn confirm_empty(&self, account: AccountId, version: u64) -> Result<(), ReadError> {
        if version > 0 {
            return Ok(());
        }
        match self.projection.store_version(account).await? {
            0 if self.accounts == AccountsMode::Explicit => {
                Err(ReadError::AccountNotFound { account })
            }
            0 => Ok(()),
            version => Err(ReadError::StoreHidesEvents { version }),
        }
    }

    /// The account's state when the projection can answer without a store read (the memory
    /// fold: caught up at least once and not broken; Postgres: the shared row). The write
    /// loop makes the same check before a first attempt at the local cursor.
    async fn local_snapshot(&self, account: AccountId) -> Result<Option<Snapshot>, ReadError> {
        Ok(self
            .projection
            .current(account, &[])
            .await?
            .map(|loaded| loaded.snap))
    }

    /// One page of the account's history from `from_version` (0 reads as 1), of at most
    /// `limit` events (default [`DEFAULT_HISTORY_LIMIT`], at most [`MAX_HISTORY_LIMIT`]).
    ///
    /// A page ends on a batch boundary (a version is the unit `from_version` names) and holds
    /// at most `limit` events, unless one batch alone holds more. Every page moves forward:
    /// it has events, or it is the end, or it is [`ReadError::HistoryBehindFold`]. A start
    /// below the trim point starts at the first available version and says so.
    pub async fn history(
        &self,
        account: AccountId,
        from_version: u64,
        limit: Option<u64>,
    ) -> Result<HistoryPage, ReadError> {
        let from_version = from_version.max(1);
        let limit = match limit {
            None => DEFAULT_HISTORY_LIMIT,
            Some(n) if n == 0 || n > MAX_HISTORY_LIMIT as u64 => {
                return Err(ReadError::LimitOutOfRange {
                    max: MAX_HISTORY_LIMIT,
                });
            }
            Some(n) => n as usize,
        };
        let log = self.projection.log();
        let key = self.projection.identity().key(account);
        // The balance comes from the fold; a stream the fold cannot derive (trimmed) still
        // has a readable history, just no balance.
        let (balance_cents, current) = match self.projection.refresh(account, &[]).await {
            Ok(loaded) => {
                self.confirm_empty(account, loaded.snap.version).await?;
                (Some(loaded.snap.balance), loaded.snap.version)
            }
            Err(ProjectionError::Store(e)) => return Err(e.into()),
            Err(ProjectionError::Database) => return Err(ReadError::Database),
            Err(_) => match log.details(key).await {
                Ok(d) => (None, d.max_version),
                Err(e) => return Err(ReadError::HistoryTipUnknown(e)),
            },
        };
        let mut first_available_version = None;
        let filter = |from| ReadFilter {
            from_version: from,
            // Every batch holds at least one event, so this bounds the read to one page's
            // worth.
            to_version: Some(from.saturating_add(limit as u64 - 1)),
            ..ReadFilter::default()
        };
        let mut events = Vec::with_capacity(limit.min(DEFAULT_HISTORY_LIMIT));
        // The version after which the next page starts: the last batch returned, or the one
        // before where this page started.
        let mut last_version = from_version.saturating_sub(1);
        // The newest version any read showed (the fold's `current` may lag a read).
        let mut newest_read = 0;
        let mut stream = BatchStream::new(log.as_ref(), key, filter(from_version));
        'pages: loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(StoreError::Trimmed { min_available }) if first_available_version.is_none() => {
                    first_available_version = Some(min_available);
                    last_version = min_available.saturating_sub(1);
                    stream = BatchStream::new(log.as_ref(), key, filter(min_available));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            for batch in &page {
                newest_read = newest_read.max(batch.version);
                if !events.is_empty() && events.len() + batch.events.len() > limit {
                    break 'pages;
                }
                for e in batch.events.iter() {
                    let event = AccountEvent::decode(e.event_type, &e.payload).map_err(|err| {
                        ReadError::Unreadable {
                            account,
                            version: batch.version,
                            reason: err.to_string(),
                        }
                    })?;
                    events.push(HistoryEntry {
                        version: batch.version,
                        server_timestamp_ms: batch.server_timestamp_ms,
                        event_id: e.event_id,
                        event,
                        writer: if batch.client_id == self.projection.identity().client() {
                            Writer::Service
                        } else {
                            Writer::Client(batch.client_id)
                        },
                    });
                }
                last_version = batch.version;
                if events.len() >= limit {
                    break 'pages;
                }
            }
        }
        // The balance must be the one at the page's current version: when the history read
        // saw versions the fold had not (its read lagged), fold again before answering.
        let (balance_cents, current) = match balance_cents {
            Some(_) if newest_read > current => match self.projection.refresh(account, &[]).await {
                Ok(Loaded { snap, .. }) if snap.version >= newest_read => {
                    (Some(snap.balance), snap.version)
                }
                Ok(_) => return Err(ReadError::BalanceBehindHistory { seen: newest_read }),
                Err(ProjectionError::Store(e)) => return Err(e.into()),
                Err(ProjectionError::Database) => return Err(ReadError::Database),
                Err(_) => (None, current),
            },
            other => (other, current),
        };
        let current_version = current.max(newest_read);
        // More exists: a full page, or a read that came back short of the version the fold
        // has (a lagging read). A client that follows `next_from_version` gets all of it.
        let next_from_version = if last_version < current_version {
            if events.is_empty() {
                return Err(ReadError::HistoryBehindFold {
                    from_version,
                    current: current_version,
                });
            }
            Some(last_version + 1)
        } else {
            None
        };
        Ok(HistoryPage {
            events,
            current_version,
            balance_cents,
            next_from_version,
            first_available_version,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::account::Identity;
    use crate::metrics::Metrics;
    use crate::projection::{ManualClock, ProjectionConfig};
    use crate::store::faults::{FaultConfig, FaultyLog};
    use crate::store::memory::MemoryLog;
    use crate::store::{
        AggregateDetails, AggregateKey, AggregateWrite, ClientId, Event, EventLog, EventType,
        ReadPage, SharedLog, StoreResult,
    };
    use bytes::Bytes;
    use std::sync::atomic::{AtomicBool, Ordering};
    use uuid::Uuid;

    /// Fails every `details` call while armed and passes everything else through.
    /// (`FaultyLog` scripts faults into writes and reads only.)
    struct FailingDetails {
        inner: SharedLog,
        armed: AtomicBool,
    }

    #[async_trait::async_trait]
    impl EventLog for FailingDetails {
        async fn write(
            &self,
            client_id: ClientId,
            writes: Vec<AggregateWrite>,
        ) -> StoreResult<Vec<u64>> {
            self.inner.write(client_id, writes).await
        }

        async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
            self.inner.read(key, filter).await
        }

        async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
            if self.armed.load(Ordering::SeqCst) {
                return Err(StoreError::NotApplied {
                    reason: "scripted: details unavailable".into(),
                });
            }
            self.inner.details(key).await
        }

        async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
            self.inner.trim_start(key, keep_from_version).await
        }
    }

    struct Fixture {
        memory: Arc<MemoryLog>,
        faulty: Arc<FaultyLog<MemoryLog>>,
        details: Arc<FailingDetails>,
        identity: Identity,
        metrics: Arc<Metrics>,
        reader: AccountReader,
        account: AccountId,
        next_seq: u64,
    }

    /// A reader over an in-memory store behind fault layers that inject nothing unless a
    /// test scripts them.
    fn fixture() -> Fixture {
        let memory = Arc::new(MemoryLog::new());
        let faulty = Arc::new(FaultyLog::new(memory.clone(), FaultConfig::default()));
        let details = Arc::new(FailingDetails {
            inner: faulty.clone(),
            armed: AtomicBool::new(false),
        });
        let identity = Identity::default();
        let metrics = Arc::new(Metrics::new());
        let projection = Projection::new(
            details.clone() as SharedLog,
            identity,
            ProjectionConfig::default(),
            Arc::new(ManualClock::new(0)),
            metrics.clone(),
        );
        Fixture {
            memory,
            faulty,
            details,
            identity,
            metrics,
            reader: AccountReader::new(Arc::new(projection)),
            account: AccountId(Uuid::new_v4()),
            next_seq: 1,
        }
    }

    impl Fixture {
        /// Appends one batch (one version) of deposits of these amounts.
        async fn deposit_batch(&mut self, amounts: &[i64]) {
            let events = amounts
                .iter()
                .map(|&amount| AccountEvent::Deposited { amount })
                .map(|e| (e.event_type(), e.encode()))
                .collect();
            self.append(events).await;
        }

        async fn append(&mut self, events: Vec<(EventType, Bytes)>) {
            let key = self.identity.key(self.account);
            let current = self.memory.details(key).await.map_or(0, |d| d.max_version);
            let events = events
                .into_iter()
                .map(|(event_type, payload)| {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    Event {
                        client_seq: seq,
                        event_id: Some(u128::from(seq)),
                        event_type,
                        payload,
                        timestamp_ms: 0,
                    }
                })
                .collect();
            let write = AggregateWrite {
                key,
                events,
                expected_version: Some(current),
                allow_create: true,
                enforce_client_idempotency: true,
            };
            self.memory
                .write_now(self.identity.client(), vec![write])
                .expect("write");
        }

        fn catch_ups(&self) -> u64 {
            self.metrics.catchup_duration.get_sample_count()
        }
    }

    fn versions(page: &HistoryPage) -> Vec<u64> {
        page.events.iter().map(|e| e.version).collect()
    }

    #[tokio::test]
    async fn a_history_page_ends_on_a_version_boundary_within_the_limit() {
        let mut f = fixture();
        f.deposit_batch(&[1]).await;
        f.deposit_batch(&[2, 3, 4]).await;
        f.deposit_batch(&[5]).await;
        // Version 2 would take the page to 4 events: the page stops before it.
        let page = f.reader.history(f.account, 1, Some(3)).await.expect("page");
        assert_eq!(versions(&page), vec![1]);
        assert_eq!(page.next_from_version, Some(2));
        // Exactly the limit, on a boundary.
        let page = f.reader.history(f.account, 1, Some(4)).await.expect("page");
        assert_eq!(versions(&page), vec![1, 2, 2, 2]);
        assert_eq!(page.next_from_version, Some(3));
    }

    #[tokio::test]
    async fn a_batch_larger_than_the_limit_is_served_whole() {
        let mut f = fixture();
        f.deposit_batch(&[1, 2, 3]).await;
        f.deposit_batch(&[4]).await;
        let page = f.reader.history(f.account, 1, Some(1)).await.expect("page");
        assert_eq!(versions(&page), vec![1, 1, 1]);
        assert_eq!(
            page.next_from_version,
            Some(2),
            "the page still moves forward"
        );
    }

    #[tokio::test]
    async fn following_next_from_version_reads_every_event_once_in_order() {
        let mut f = fixture();
        let batches: [&[i64]; 5] = [&[1], &[2, 3], &[4], &[5, 6, 7], &[8]];
        for b in batches {
            f.deposit_batch(b).await;
        }
        let mut amounts = Vec::new();
        let mut from = 0;
        loop {
            let page = f
                .reader
                .history(f.account, from, Some(2))
                .await
                .expect("page");
            assert_eq!(page.current_version, 5);
            assert_eq!(page.balance_cents, Some(36));
            amounts.extend(page.events.iter().map(|e| e.event.amount()));
            match page.next_from_version {
                Some(next) => from = next,
                None => break,
            }
        }
        assert_eq!(amounts, (1..=8).collect::<Vec<i64>>());
    }

    #[tokio::test]
    async fn a_history_limit_outside_its_range_is_refused() {
        let f = fixture();
        for limit in [0, MAX_HISTORY_LIMIT as u64 + 1] {
            assert_eq!(
                f.reader.history(f.account, 1, Some(limit)).await,
                Err(ReadError::LimitOutOfRange {
                    max: MAX_HISTORY_LIMIT
                }),
                "limit {limit}"
            );
        }
        assert!(
            f.reader
                .history(f.account, 1, Some(MAX_HISTORY_LIMIT as u64))
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn a_history_read_showing_nothing_where_the_fold_has_events_is_retryable() {
        let mut f = fixture();
        for amount in 1..=3 {
            f.deposit_batch(&[amount]).await;
        }
        // The catch-up read is current; the page read hides the newest 2 batches.
        f.faulty.lag_next_read(0);
        f.faulty.lag_next_read(2);
        assert_eq!(
            f.reader.history(f.account, 3, None).await,
            Err(ReadError::HistoryBehindFold {
                from_version: 3,
                current: 3
            })
        );
        // A read that shows part of it: that part, and where the rest starts.
        f.faulty.lag_next_read(0);
        f.faulty.lag_next_read(1);
        let page = f.reader.history(f.account, 2, None).await.expect("page");
        assert_eq!(versions(&page), vec![2]);
        assert_eq!(page.next_from_version, Some(3));
    }

    /// Rule: history marks each event's writer: this service, or another client of the
    /// store (an offline device, whose client id is its device id), by the batch's client id.
    #[tokio::test]
    async fn history_marks_each_events_writer_by_its_batchs_client_id() {
        let mut f = fixture();
        f.deposit_batch(&[5]).await;
        let device: u128 = 0xD3;
        let key = f.identity.key(f.account);
        let e = AccountEvent::Withdrawn { amount: 9 };
        let write = AggregateWrite {
            key,
            events: vec![Event {
                client_seq: 1,
                event_id: Some(77),
                event_type: e.event_type(),
                payload: e.encode(),
                timestamp_ms: 0,
            }],
            expected_version: None,
            allow_create: true,
            enforce_client_idempotency: true,
        };
        f.memory.write_now(device, vec![write]).expect("write");
        let page = f.reader.history(f.account, 1, None).await.expect("page");
        let writers: Vec<Writer> = page.events.iter().map(|e| e.writer).collect();
        assert_eq!(writers, vec![Writer::Service, Writer::Client(device)]);
        assert_eq!(
            page.balance_cents,
            Some(-4),
            "a device's debit may go below zero"
        );
    }

    /// Rule: a history page's balance is the balance at its `currentAggregateVersion`. A
    /// catch-up whose read lagged behind the page's read is folded again, never answered
    /// with an older balance beside a newer version.
    #[tokio::test]
    async fn a_history_balance_matches_its_current_version_when_the_folds_read_lagged() {
        let mut f = fixture();
        for amount in 1..=3 {
            f.deposit_batch(&[amount]).await;
        }
        // The first catch-up's read hides the newest 2 batches; the page read and the
        // second catch-up are current.
        f.faulty.lag_next_read(2);
        let page = f.reader.history(f.account, 1, None).await.expect("page");
        assert_eq!(versions(&page), vec![1, 2, 3]);
        assert_eq!(page.current_version, 3);
        assert_eq!(page.balance_cents, Some(6), "the balance at version 3");
    }

    #[tokio::test]
    async fn a_trimmed_history_starts_at_the_first_available_version_without_a_balance() {
        let mut f = fixture();
        for amount in 1..=4 {
            f.deposit_batch(&[amount]).await;
        }
        f.memory
            .trim_start_now(f.identity.key(f.account), 3)
            .expect("trim");
        let page = f.reader.history(f.account, 1, None).await.expect("page");
        assert_eq!(page.first_available_version, Some(3));
        assert_eq!(versions(&page), vec![3, 4]);
        assert_eq!(page.balance_cents, None, "a cold fold cannot derive it");
        assert_eq!(page.current_version, 4, "from the store's details");
        assert_eq!(page.next_from_version, None);
        assert!(matches!(
            f.reader.balance(f.account, None).await,
            Err(ReadError::Trimmed {
                min_available: 3,
                ..
            })
        ));
    }

    /// Rule: when neither the fold nor the store can say where the stream ends, the page is
    /// a retryable error, never a full page presented as the last one.
    #[tokio::test]
    async fn a_history_page_whose_tip_the_store_cannot_tell_is_retryable_not_the_last() {
        let mut f = fixture();
        for amount in 1..=6 {
            f.deposit_batch(&[amount]).await;
        }
        // A trimmed stream: the cold fold cannot derive it, so only `details` knows the tip.
        f.memory
            .trim_start_now(f.identity.key(f.account), 3)
            .expect("trim");
        f.details.armed.store(true, Ordering::SeqCst);
        let page = f.reader.history(f.account, 1, Some(2)).await;
        // The failing details call also hides the account's checkpoints, so the fold itself
        // answers retryably (a trim met without them is no verdict); either way, retryable.
        assert!(
            matches!(
                page,
                Err(ReadError::HistoryTipUnknown(StoreError::NotApplied { .. })
                    | ReadError::Store(StoreError::NotApplied { .. }))
            ),
            "{page:?}"
        );
        // With the store answering again, the same page says where the rest starts.
        f.details.armed.store(false, Ordering::SeqCst);
        let page = f.reader.history(f.account, 1, Some(2)).await.expect("page");
        assert_eq!(versions(&page), vec![3, 4]);
        assert_eq!(page.current_version, 6);
        assert_eq!(page.next_from_version, Some(5));
    }

    #[tokio::test]
    async fn an_undecodable_event_makes_the_account_unreadable_never_skipped() {
        let mut f = fixture();
        f.deposit_batch(&[1]).await;
        f.append(vec![(
            EventType {
                major: 99,
                minor: 0,
            },
            Bytes::new(),
        )])
        .await;
        assert!(matches!(
            f.reader.history(f.account, 1, None).await,
            Err(ReadError::Unreadable { version: 2, .. })
        ));
        assert!(matches!(
            f.reader.balance(f.account, None).await,
            Err(ReadError::Unreadable { version: 2, .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_min_version_this_replica_has_not_seen_is_a_typed_error_after_its_attempts() {
        let mut f = fixture();
        f.deposit_batch(&[5]).await;
        f.deposit_batch(&[7]).await;
        // The store has version 2, but every read of this replica's catch-ups hides it.
        for _ in 0..MIN_VERSION_ATTEMPTS {
            f.faulty.lag_next_read(1);
        }
        assert_eq!(
            f.reader.balance(f.account, Some(2)).await,
            Err(ReadError::NotVisibleYet { min_version: 2 })
        );
        assert_eq!(f.catch_ups(), u64::from(MIN_VERSION_ATTEMPTS));
        // Once a read shows it, the same request is answered.
        assert_eq!(
            f.reader.balance(f.account, Some(2)).await,
            Ok(Balance {
                balance_cents: 12,
                version: 2
            })
        );
    }

    /// Rule: a `minVersion` beyond the version the store itself gives the account is refused
    /// at once (400), as a watch resume beyond the tip is: no retry can answer it, so it must
    /// not be a 503. An account the store shows no version of stays retryable.
    #[tokio::test(start_paused = true)]
    async fn a_min_version_beyond_the_stores_tip_is_refused_after_one_catch_up() {
        let mut f = fixture();
        // An account with no version yet decides nothing: the store may hide a create.
        assert_eq!(
            f.reader.balance(f.account, Some(1)).await,
            Err(ReadError::NotVisibleYet { min_version: 1 })
        );
        assert_eq!(f.catch_ups(), u64::from(MIN_VERSION_ATTEMPTS));
        f.deposit_batch(&[5]).await;
        assert_eq!(
            f.reader.balance(f.account, Some(u64::MAX)).await,
            Err(ReadError::MinVersionBeyondTip {
                min_version: u64::MAX,
                current: 1
            })
        );
        assert_eq!(f.catch_ups(), u64::from(MIN_VERSION_ATTEMPTS) + 1);
        // A store that cannot say how far the account goes decides nothing: retryable.
        f.details.armed.store(true, Ordering::SeqCst);
        assert_eq!(
            f.reader.balance(f.account, Some(2)).await,
            Err(ReadError::NotVisibleYet { min_version: 2 })
        );
    }

    #[tokio::test]
    async fn a_min_version_the_fold_already_has_is_answered_without_a_catch_up() {
        let mut f = fixture();
        f.deposit_batch(&[5]).await;
        let first = f.reader.balance(f.account, None).await.expect("balance");
        assert_eq!(f.catch_ups(), 1);
        // The store moves on; a read at the version the fold has answers from the fold.
        f.deposit_batch(&[7]).await;
        assert_eq!(f.reader.balance(f.account, Some(1)).await, Ok(first));
        assert_eq!(f.catch_ups(), 1);
        // Without a min version, a balance read always catches up.
        let now = f.reader.balance(f.account, None).await.expect("balance");
        assert_eq!((now.balance_cents, now.version), (12, 2));
        assert_eq!(f.catch_ups(), 2);
    }
}
