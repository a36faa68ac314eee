//! Scan on miss (issue 14), opt-in: the guide's last resort for a retry older than the
//! recent-writes window. When the index misses a request, the account's own recent batches
//! are read (scoped to this service's client id, and to batches committed after the newest
//! server time this replica has seen minus the scan window: never the local clock) and the
//! request's event id looked for. A request found this way answers like any replay.
//!
//! Cost: one store read per account of every request the index misses (every new request),
//! and one more read on a hit, to rebuild the balance right after the found event.

use super::{Projection, Snapshot};
use crate::account::{AccountEvent, AccountId};
use crate::store::{BatchStream, ReadFilter, StoreError};

/// The most batches one scan reads before it gives up (counted as a miss): bounds the cost
/// of a miss on a very busy account with a long scan window.
pub const SCAN_MAX_BATCHES: usize = 10_000;

/// A request found by a scan on one account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanHit {
    /// The version of the batch that carries it.
    pub version: u64,
    /// What it wrote (the fingerprint a reused key is checked against).
    pub event: AccountEvent,
    /// The balance right after it, when the state read reaches its batch; `None` when the
    /// found batch is newer than that state (a later catch-up answers it).
    pub balance: Option<i64>,
}

impl Projection {
    /// Looks for `event_id` among this service's batches of `account` committed within the
    /// scan window, and rebuilds its response from `snap` (the state just read). `Ok(None)`
    /// when scanning is off, nothing is found, or the scan hit its bound.
    pub async fn scan_for(
        &self,
        account: AccountId,
        event_id: u128,
        snap: Snapshot,
    ) -> Result<Option<ScanHit>, StoreError> {
        let Some(window) = self.config.scan_window else {
            return Ok(None);
        };
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let key = self.identity.key(account);
        let filter = ReadFilter {
            from_version: 1,
            include_client_id: Some(self.identity.client()),
            min_server_timestamp_ms: Some(self.server_tip_ms().saturating_sub(window_ms)),
            ..ReadFilter::default()
        };
        let mut stream = BatchStream::new(self.log.as_ref(), key, filter);
        let mut seen = 0usize;
        let mut found: Option<(u64, usize, AccountEvent)> = None;
        'pages: while let Some(page) = match stream.next_page().await {
            Ok(page) => page,
            Err(StoreError::AggregateNotFound) => None,
            Err(e) => return Err(e),
        } {
            for batch in &page {
                seen += 1;
                if seen > SCAN_MAX_BATCHES {
                    self.metrics
                        .idem_scans
                        .with_label_values(&["bounded"])
                        .inc();
                    return Ok(None);
                }
                if let Some(at) = batch
                    .events
                    .iter()
                    .position(|e| e.event_id == Some(event_id))
                {
                    let e = &batch.events[at];
                    let Ok(event) = AccountEvent::decode(e.event_type, &e.payload) else {
                        // Undecodable: the fold reports the account as poisoned; no answer here.
                        return Ok(None);
                    };
                    found = Some((batch.version, at, event));
                    break 'pages;
                }
            }
        }
        let Some((version, at, event)) = found else {
            self.metrics.idem_scans.with_label_values(&["miss"]).inc();
            return Ok(None);
        };
        self.metrics.idem_scans.with_label_values(&["hit"]).inc();
        let balance = if version > snap.version {
            None
        } else {
            Some(self.balance_after(account, version, at, snap).await?)
        };
        Ok(Some(ScanHit {
            version,
            event,
            balance,
        }))
    }

    /// The balance right after event `at` of batch `version`: the state's balance with every
    /// later event up to the state's version taken back out (any writer's: all of them moved
    /// the balance).
    async fn balance_after(
        &self,
        account: AccountId,
        version: u64,
        at: usize,
        snap: Snapshot,
    ) -> Result<i64, StoreError> {
        let filter = ReadFilter {
            from_version: version,
            to_version: Some(snap.version),
            ..ReadFilter::default()
        };
        let mut stream = BatchStream::new(self.log.as_ref(), self.identity.key(account), filter);
        let mut balance = snap.balance;
        while let Some(page) = stream.next_page().await? {
            for batch in page.iter().filter(|b| b.version <= snap.version) {
                let skip = if batch.version == version { at + 1 } else { 0 };
                for e in batch.events.iter().skip(skip) {
                    let event = AccountEvent::decode(e.event_type, &e.payload).map_err(|err| {
                        StoreError::Other {
                            code: 0,
                            message: format!(
                                "undecodable event at version {}: {err}",
                                batch.version
                            ),
                        }
                    })?;
                    let amount = event.amount();
                    balance = if event.is_credit() {
                        balance.wrapping_sub(amount)
                    } else {
                        balance.wrapping_add(amount)
                    };
                }
            }
        }
        Ok(balance)
    }
}
