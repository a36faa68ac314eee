//! Scan on miss (issue 14), opt-in: the guide's last resort for a retry older than the
//! recent-writes window. When the index misses a request, the account's own recent batches
//! are read (scoped to this service's client id, and to batches committed after the newest
//! server time this replica has seen minus the scan window: never the local clock) and the
//! request's event id looked for. A request found this way answers like any replay.
//!
//! Cost: one store read per account of every request the index misses (every new request),
//! and one more read on a hit, to rebuild the balance right after the found event. Bounded
//! in versions, not in batches found: the server-time and client filters drop batches
//! without making the read cheaper (on Celeriant every 512-version window is a read and a
//! details call, kept or not), so the scan starts [`SCAN_MAX_VERSIONS`] below the state it
//! is given, never at version 1, and reads at most [`SCAN_MAX_PAGES`] pages.

use std::cmp::Ordering;

use super::{Projection, Snapshot};
use crate::account::{AccountEvent, AccountId, fold};
use crate::store::{Batch, BatchStream, ReadFilter, StoreError, WholeRange};

/// How far below the state it is given a scan starts, in versions: a retry is looked for
/// among the account's newest versions, and one further back is a miss (as past the
/// window). On Celeriant, 20 windows of 512 versions.
pub const SCAN_MAX_VERSIONS: u64 = 10_240;

/// The most pages one scan reads before it gives up (counted as `bounded`, answered as a
/// miss): [`SCAN_MAX_VERSIONS`] in Celeriant's windows, and four more for what landed above
/// the state (a fold this replica trusted without reading).
pub const SCAN_MAX_PAGES: usize = 24;

/// A request found by a scan on one account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanHit {
    /// The version of the batch that carries it.
    pub version: u64,
    /// What it wrote (the fingerprint a reused key is checked against).
    pub event: AccountEvent,
    /// The balance right after it.
    pub balance: i64,
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
        let filter = ReadFilter {
            from_version: (snap.version + 1).saturating_sub(SCAN_MAX_VERSIONS).max(1),
            include_client_id: Some(self.identity.client()),
            min_server_timestamp_ms: Some(self.server_tip_ms().saturating_sub(window_ms)),
            ..ReadFilter::default()
        };
        let key = self.identity.key(account);
        let mut stream = BatchStream::new(self.log.as_ref(), key, filter.clone());
        let mut found: Option<(u64, usize, AccountEvent)> = None;
        let (mut pages, mut trimmed) = (0usize, false);
        while found.is_none() {
            if pages == SCAN_MAX_PAGES && stream.has_more() {
                self.metrics
                    .idem_scans
                    .with_label_values(&["bounded"])
                    .inc();
                return Ok(None);
            }
            let page = match stream.next_page().await {
                Ok(Some(page)) => page,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                // Started below a trim: what is left above it, once. A request in a batch
                // trimmed away cannot be found, as one older than the window cannot.
                Err(StoreError::Trimmed { min_available }) if !trimmed => {
                    trimmed = true;
                    let from_version = min_available.max(filter.from_version);
                    let rest = ReadFilter {
                        from_version,
                        ..filter.clone()
                    };
                    stream = BatchStream::new(self.log.as_ref(), key, rest);
                    continue;
                }
                Err(e) => return Err(e),
            };
            pages += 1;
            match find_event(&page, event_id) {
                Found::Yes(hit) => found = Some(hit),
                Found::No => {}
                // Undecodable: the fold reports the account as poisoned; no answer here.
                Found::Undecodable => return Ok(None),
            }
        }
        let Some((version, at, event)) = found else {
            self.metrics.idem_scans.with_label_values(&["miss"]).inc();
            return Ok(None);
        };
        self.metrics.idem_scans.with_label_values(&["hit"]).inc();
        // Also when the found batch is newer than the state (a first touch's state is the
        // empty account at version 0): a later catch-up cannot answer it, since the index
        // no longer holds a request this old (that is why it was scanned for).
        let balance = self.balance_after(account, version, at, snap).await?;
        Ok(Some(ScanHit {
            version,
            event,
            balance,
        }))
    }

    /// The balance right after event `at` of batch `version`, from the state's: every event
    /// between them taken back out (found below the state) or added (found above it), any
    /// writer's, since all of them moved the balance.
    async fn balance_after(
        &self,
        account: AccountId,
        version: u64,
        at: usize,
        snap: Snapshot,
    ) -> Result<i64, StoreError> {
        let above = version > snap.version;
        let (from, to) = if above {
            (snap.version + 1, version)
        } else {
            (version, snap.version)
        };
        let filter = ReadFilter {
            to_version: Some(to),
            ..ReadFilter::from_version(from)
        };
        let mut stream = BatchStream::new(self.log.as_ref(), self.identity.key(account), filter);
        // Every version between them, or the rebuilt balance is not the one answered then.
        let mut whole = WholeRange::new(from, to);
        let mut balance = snap.balance;
        while let Some(page) = stream.next_page().await? {
            for batch in &page {
                whole.saw(batch.version)?;
                // Above: the events up to and including the found one. Below: those after it.
                let events = match (above, batch.version.cmp(&version)) {
                    (true, Ordering::Less) => &batch.events[..],
                    (true, Ordering::Equal) => &batch.events[..(at + 1).min(batch.events.len())],
                    (false, Ordering::Equal) => batch.events.get(at + 1..).unwrap_or(&[]),
                    (false, Ordering::Greater) if batch.version <= snap.version => {
                        &batch.events[..]
                    }
                    _ => continue,
                };
                for e in events {
                    let unfoldable = |why: String| StoreError::Other {
                        code: 0,
                        message: format!("event at version {}: {why}", batch.version),
                    };
                    let event = AccountEvent::decode(e.event_type, &e.payload)
                        .map_err(|err| unfoldable(format!("undecodable: {err}")))?;
                    // The event's signed effect, by the fold's own rule.
                    let delta =
                        fold::apply(0, &event).map_err(|err| unfoldable(err.to_string()))?;
                    let next = if above {
                        balance.checked_add(delta)
                    } else {
                        balance.checked_sub(delta)
                    };
                    balance = next.ok_or_else(|| unfoldable("the balance overflows".into()))?;
                }
            }
        }
        whole.finish()?;
        Ok(balance)
    }
}

/// What one page holds of a request's event.
enum Found {
    /// (batch version, index in the batch, the event).
    Yes((u64, usize, AccountEvent)),
    No,
    Undecodable,
}

/// Looks for the event carrying `event_id` in `page`.
fn find_event(page: &[Batch], event_id: u128) -> Found {
    for batch in page {
        if let Some(at) = batch
            .events
            .iter()
            .position(|e| e.event_id == Some(event_id))
        {
            let e = &batch.events[at];
            return match AccountEvent::decode(e.event_type, &e.payload) {
                Ok(event) => Found::Yes((batch.version, at, event)),
                Err(_) => Found::Undecodable,
            };
        }
    }
    Found::No
}
