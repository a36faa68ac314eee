//! A page of an account's history: whole batches read from the store's stream from a
//! version, each event marked with its writer, beside the fold's balance at the page's
//! current version.

use crate::account::{AccountEvent, AccountId};
use crate::projection::{Loaded, ProjectionError};
use crate::store::{Batch, BatchStream, ClientId, ReadFilter, StoreError};

use super::{AccountReader, ReadError};

/// History page size when the caller names none, and the most it may ask for.
pub const DEFAULT_HISTORY_LIMIT: usize = 100;
pub const MAX_HISTORY_LIMIT: usize = 1000;

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

/// What the read of one history page found.
struct PageRead {
    events: Vec<HistoryEntry>,
    /// The version after which the next page starts: the last batch returned, or the one
    /// before where this page started.
    last_version: u64,
    /// The newest version any read showed (the fold's `current` may lag a read).
    newest_read: u64,
    /// Set when the stream is trimmed above the asked-for start: the page starts here.
    first_available_version: Option<u64>,
}

impl AccountReader {
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
        let limit = page_limit(limit)?;
        // The balance comes from the fold; a stream the fold cannot derive (trimmed) still
        // has a readable history, just no balance.
        let (balance_cents, current) = self.history_fold(account).await?;
        let read = self.read_page(account, from_version, limit).await?;
        // The balance must be the one at the page's current version: when the history read
        // saw versions the fold had not (its read lagged), fold again before answering.
        let (balance_cents, current) = match balance_cents {
            Some(_) if read.newest_read > current => {
                self.fold_again(account, read.newest_read, current).await?
            }
            other => (other, current),
        };
        let current_version = current.max(read.newest_read);
        // More exists: a full page, or a read that came back short of the version the fold
        // has (a lagging read). A client that follows `next_from_version` gets all of it.
        let next_from_version = if read.last_version < current_version {
            if read.events.is_empty() {
                return Err(ReadError::HistoryBehindFold {
                    from_version,
                    current: current_version,
                });
            }
            Some(read.last_version + 1)
        } else {
            None
        };
        Ok(HistoryPage {
            events: read.events,
            current_version,
            balance_cents,
            next_from_version,
            first_available_version: read.first_available_version,
        })
    }

    /// The fold's balance and version for a history page. A fold that cannot derive the
    /// balance (trimmed, poisoned) gives none, and the version comes from the store's
    /// details, which must answer ([`ReadError::HistoryTipUnknown`]): without the tip a full
    /// page would look like the last one.
    async fn history_fold(&self, account: AccountId) -> Result<(Option<i64>, u64), ReadError> {
        match self.projection.refresh(account, &[]).await {
            Ok(loaded) => {
                self.confirm_empty(account, loaded.snap.version).await?;
                Ok((Some(loaded.snap.balance), loaded.snap.version))
            }
            Err(ProjectionError::Store(e)) => Err(e.into()),
            Err(ProjectionError::Database) => Err(ReadError::Database),
            Err(_) => {
                let key = self.projection.identity().key(account);
                match self.projection.log().details(key).await {
                    Ok(d) => Ok((None, d.max_version)),
                    Err(e) => Err(ReadError::HistoryTipUnknown(e)),
                }
            }
        }
    }

    /// Folds again for a page whose read saw versions up to `seen`, past the fold's
    /// `current`: the balance at a version at least `seen`, or
    /// [`ReadError::BalanceBehindHistory`] while the fold still lags. Never an older balance
    /// beside a newer version; a fold that can no longer derive it gives none.
    async fn fold_again(
        &self,
        account: AccountId,
        seen: u64,
        current: u64,
    ) -> Result<(Option<i64>, u64), ReadError> {
        match self.projection.refresh(account, &[]).await {
            Ok(Loaded { snap, .. }) if snap.version >= seen => {
                Ok((Some(snap.balance), snap.version))
            }
            Ok(_) => Err(ReadError::BalanceBehindHistory { seen }),
            Err(ProjectionError::Store(e)) => Err(e.into()),
            Err(ProjectionError::Database) => Err(ReadError::Database),
            Err(_) => Ok((None, current)),
        }
    }

    /// Reads whole batches from `from_version` until the page holds `limit` events (or one
    /// batch alone holds more) or the stream ends. A start below the trim point moves, once,
    /// to the first available version and says so.
    async fn read_page(
        &self,
        account: AccountId,
        from_version: u64,
        limit: usize,
    ) -> Result<PageRead, ReadError> {
        let log = self.projection.log();
        let key = self.projection.identity().key(account);
        let service = self.projection.identity().client();
        let filter = |from| ReadFilter {
            from_version: from,
            // Every batch holds at least one event, so this bounds the read to one page's
            // worth.
            to_version: Some(from.saturating_add(limit as u64 - 1)),
            ..ReadFilter::default()
        };
        let mut read = PageRead {
            events: Vec::with_capacity(limit.min(DEFAULT_HISTORY_LIMIT)),
            last_version: from_version.saturating_sub(1),
            newest_read: 0,
            first_available_version: None,
        };
        let mut stream = BatchStream::new(log.as_ref(), key, filter(from_version));
        loop {
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => return Ok(read),
                Err(StoreError::Trimmed { min_available })
                    if read.first_available_version.is_none() =>
                {
                    read.first_available_version = Some(min_available);
                    read.last_version = min_available.saturating_sub(1);
                    stream = BatchStream::new(log.as_ref(), key, filter(min_available));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            for batch in &page {
                read.newest_read = read.newest_read.max(batch.version);
                if !read.events.is_empty() && read.events.len() + batch.events.len() > limit {
                    return Ok(read);
                }
                push_batch(&mut read.events, batch, account, service)?;
                read.last_version = batch.version;
                if read.events.len() >= limit {
                    return Ok(read);
                }
            }
        }
    }
}

/// The page size asked for, or the default; one outside `1..=MAX_HISTORY_LIMIT` is refused.
fn page_limit(limit: Option<u64>) -> Result<usize, ReadError> {
    match limit {
        None => Ok(DEFAULT_HISTORY_LIMIT),
        Some(n) if n == 0 || n > MAX_HISTORY_LIMIT as u64 => Err(ReadError::LimitOutOfRange {
            max: MAX_HISTORY_LIMIT,
        }),
        Some(n) => Ok(n as usize),
    }
}

/// Appends a batch's events to a page, each marked with its writer: this service (its
/// client id is `service`) or another client of the store. An event that cannot be decoded
/// makes the account unreadable; it is never skipped.
fn push_batch(
    events: &mut Vec<HistoryEntry>,
    batch: &Batch,
    account: AccountId,
    service: ClientId,
) -> Result<(), ReadError> {
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
            writer: if batch.client_id == service {
                Writer::Service
            } else {
                Writer::Client(batch.client_id)
            },
        });
    }
    Ok(())
}
