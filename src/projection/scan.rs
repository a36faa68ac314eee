//! Scan on miss, opt-in: the guide's last resort for a retry older than the
//! recent-writes window. When the index misses a request, the account's newest versions up
//! to the state it was given are read, window by window from the top, and the request's event
//! id looked for among this service's batches committed after the newest server time this
//! replica has seen minus the scan window (never the local clock). A request found this way
//! answers like any replay.
//!
//! Every window is read unfiltered and proven whole (`store::read_whole`): a filtered read cannot
//! tell a batch it dropped from one a replica behind the tip never showed, and a miss drawn
//! from such a read wrote the request again (under `read-lag` faults).
//! Nothing above the state is read: a write decided on a miss expects the state's version,
//! so anything above it bounces that write, and the next attempt scans the newer state.
//!
//! Cost: one read per [`SCAN_PAGE_VERSIONS`] versions committed within the scan window, from
//! the top, for every request the index misses (every new request); one more on a hit, to
//! rebuild the balance right after the found event. Bounded: the scan never starts more than
//! [`SCAN_MAX_VERSIONS`] below the state, and reads at most [`SCAN_MAX_PAGES`] windows.

use super::{Projection, Snapshot};
use crate::account::{AccountEvent, AccountId, fold};
use crate::store::{AggregateKey, Batch, ClientId, StoreError, read_whole};

/// How far below the state it is given a scan starts, in versions: a retry is looked for
/// among the account's newest versions, and one further back is a miss (as past the
/// window). On Celeriant, 20 windows of 512 versions.
pub const SCAN_MAX_VERSIONS: u64 = 10_240;

/// The versions one scan read asks for: Celeriant's read window.
pub const SCAN_PAGE_VERSIONS: u64 = 512;

/// The most reads one scan makes before it gives up (counted as `bounded`, answered as a
/// miss): [`SCAN_MAX_VERSIONS`] in [`SCAN_PAGE_VERSIONS`] windows, and four more for
/// windows a trim or a short page splits.
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
        let oldest_ms = self.server_tip_ms().saturating_sub(window_ms);
        let floor = (snap.version + 1).saturating_sub(SCAN_MAX_VERSIONS).max(1);
        let key = self.identity.key(account);
        let mut top = snap.version;
        let mut pages = 0usize;
        let found = loop {
            // Read down to version 1: a miss. Stopped by the version or the read bound while
            // every batch read was still inside the window: bounded (answered as a miss).
            if top < floor && floor == 1 {
                break None;
            }
            if top < floor || pages == SCAN_MAX_PAGES {
                self.metrics
                    .idem_scans
                    .with_label_values(&["bounded"])
                    .inc();
                return Ok(None);
            }
            pages += 1;
            let low = top.saturating_sub(SCAN_PAGE_VERSIONS - 1).max(floor);
            let Some(batches) = self.read_whole(key, low, top).await? else {
                break None; // trimmed away: nothing older can be found either
            };
            match find_event(&batches, event_id, self.identity.client(), oldest_ms) {
                Found::Yes(hit) => break Some(hit),
                // Undecodable: the fold reports the account as poisoned; no answer here.
                Found::Undecodable => return Ok(None),
                Found::No => {}
            }
            // Commit times rise with versions: below a batch older than the window, every
            // batch is older too.
            if batches
                .first()
                .is_none_or(|b| b.server_timestamp_ms < oldest_ms)
            {
                break None;
            }
            top = low - 1;
        };
        let Some((version, at, event)) = found else {
            self.metrics.idem_scans.with_label_values(&["miss"]).inc();
            return Ok(None);
        };
        self.metrics.idem_scans.with_label_values(&["hit"]).inc();
        let balance = self.balance_after(account, version, at, snap).await?;
        Ok(Some(ScanHit {
            version,
            event,
            balance,
        }))
    }

    /// Every batch of versions `from..=to`, proven whole (`store::read_whole`): a scan that
    /// drew a miss from a read served behind the tip would write a request again. `None`
    /// when the range was trimmed away entirely; a range trimmed in part is read from the
    /// trim.
    async fn read_whole(
        &self,
        key: AggregateKey,
        from: u64,
        to: u64,
    ) -> Result<Option<Vec<Batch>>, StoreError> {
        let mut from = from;
        loop {
            match read_whole(self.log.as_ref(), key, from, to).await {
                Ok(batches) => return Ok(Some(batches)),
                Err(StoreError::Trimmed { min_available }) if min_available > from => {
                    if min_available > to {
                        return Ok(None);
                    }
                    from = min_available;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The balance right after event `at` of batch `version`, from the state's: every event
    /// after it up to the state taken back out, any writer's, since all of them moved the
    /// balance. A scan finds nothing above the state it was given.
    async fn balance_after(
        &self,
        account: AccountId,
        version: u64,
        at: usize,
        snap: Snapshot,
    ) -> Result<i64, StoreError> {
        assert!(
            version <= snap.version,
            "a scan found version {version} above the state it read to ({})",
            snap.version
        );
        // Every version between them, or the rebuilt balance is not the one answered then.
        let key = self.identity.key(account);
        let batches = read_whole(self.log.as_ref(), key, version, snap.version).await?;
        let mut balance = snap.balance;
        for batch in &batches {
            let events = if batch.version == version {
                batch.events.get(at + 1..).unwrap_or(&[])
            } else {
                &batch.events[..]
            };
            for e in events {
                let unfoldable = |why: String| StoreError::Other {
                    code: 0,
                    message: format!("event at version {}: {why}", batch.version),
                };
                let event = AccountEvent::decode(e.event_type, &e.payload)
                    .map_err(|err| unfoldable(format!("undecodable: {err}")))?;
                // The event's signed effect, by the fold's own rule.
                let delta = fold::apply(0, &event).map_err(|err| unfoldable(err.to_string()))?;
                balance = balance
                    .checked_sub(delta)
                    .ok_or_else(|| unfoldable("the balance overflows".into()))?;
            }
        }
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

/// Looks for the event carrying `event_id` among `batches` this service wrote (client
/// `client`) at or after `oldest_ms`, newest first.
fn find_event(batches: &[Batch], event_id: u128, client: ClientId, oldest_ms: u64) -> Found {
    let ours = |b: &&Batch| b.client_id == client && b.server_timestamp_ms >= oldest_ms;
    for batch in batches.iter().rev().filter(ours) {
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
