//! The service-side core of `POST /api/devices/{deviceId}/sync`: validate one run of a
//! device's events, write it to the store under the device's own client id, and classify the
//! store's answer.
//!
//! The write is unconditional and guarded only by idempotency: `expected_version: None`,
//! `enforce_client_idempotency: true`, `allow_create: true` (false with explicit accounts: the
//! store refuses a run to an account never opened, and the device keeps it queued until the
//! account is opened), one batch for the whole run. The
//! store judges a multi-event write by its lowest sequence, so a 2002 means "something at or
//! above the run's first sequence is already committed by this device". That proves the run
//! landed only if the reported mark reaches the run's last sequence; a mark inside the run can
//! only come from a device that renumbered or re-cut a run, and is answered as a typed error,
//! never as synced. Even a mark past the run is checked before the run is called synced: the
//! device's batches covering the run are read back and must hold these very events (same
//! sequence, event id and payload). A device restored from an old backup reissues sequences
//! for new events; without the check those sales would be swallowed as "already synced".
//! Events the store no longer has (trimmed) are never taken on the mark alone (a final
//! refusal for an operator); events a lagging read does not show yet make the answer a retry.
//!
//! Device batches never raise Tally's own client sequence: the projection only counts batches
//! whose client id is the service's, and a device may not use that id (nor the reference
//! service's, nor nil).

use std::collections::BTreeMap;

use uuid::Uuid;

use super::protocol::{SyncRequest, SyncResponse, SyncStatus, codes};
pub use super::run::{DeviceRun, RunEvent};
use super::{DeviceId, MAX_RUN_EVENTS};
use crate::account::{AccountId, AccountsMode, Identity, named_id};
use crate::store::{
    AggregateKey, AggregateWrite, Batch, BatchStream, Event, ReadFilter, SharedLog, StoreError,
    StoreResult, WholeRange, wall_clock_ms,
};

/// The namespace the store's event ids of device events are derived in. Never change it: a
/// resend across the change would carry different event ids (harmless to dedup, which is by
/// sequence, but it would break the stable naming of history entries).
pub const DEVICE_EVENT_NAMESPACE: Uuid = Uuid::from_u128(0x5d1c_7e2a_4b90_4f3e_8a61_c0de_de71_ce00);

/// Why the same run should be sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    /// 2013: a write holding these sequences is accepted but not yet durable: back off.
    InFlight,
    /// The write may or may not have landed: resend exactly the same run.
    OutcomeUnknown,
    /// The write was definitely not applied.
    NotApplied,
    /// The store's mark covers the run, but a read does not show its events yet (a lagging
    /// replica) or failed: ask again rather than call it synced unproven.
    Unverified,
}

/// Every way a device sync can fail, for this layer. The HTTP mapping lives with the routes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceSyncError {
    #[error("device id {0:?} is not a UUID")]
    InvalidDeviceId(String),
    #[error("device id {0} is reserved (a service's own client id, or nil)")]
    ReservedDeviceId(DeviceId),
    #[error("accountId {0:?} is not a UUID")]
    InvalidAccount(String),
    #[error("a sync run must carry at least one event")]
    EmptyRun,
    #[error("a sync run carries {len} events, more than the limit of {max}")]
    RunTooLong { len: usize, max: usize },
    #[error("bad sequence: {0}")]
    BadSequence(String),
    #[error("event {index}: unknown type {kind:?} (devices sync `deposit` or `withdraw` only)")]
    UnknownEventType { index: usize, kind: String },
    #[error("event {index}: {reason}")]
    InvalidAmount { index: usize, reason: String },
    #[error("event {index}: eventId {value:?} is not a UUID")]
    InvalidEventId { index: usize, value: String },
    /// Two events of one run name the same eventId, which readers take as unique.
    #[error("event {index}: eventId repeats event {first}'s; each event names its own")]
    RepeatedEventId { index: usize, first: usize },
    /// The store's mark for (account, device) is inside the run. Impossible for a device that
    /// follows the rules; resending cannot fix it.
    #[error(
        "the store holds sequence {mark} from this device, inside the run {first_seq}..={last_seq}: \
         the device renumbered events or changed a run's boundaries"
    )]
    RunStraddlesMark {
        mark: u64,
        first_seq: u64,
        last_seq: u64,
    },
    /// The store holds a different event under one of the run's sequences: the device
    /// reissued a sequence (e.g. its outbox was restored from an old copy). Never synced.
    #[error(
        "the store already holds a different event from this device under sequence {seq}: \
         the device reissued sequences (was its outbox restored from an old copy?)"
    )]
    RunConflictsWithStore { seq: u64 },
    /// A sequence of the run below the store's mark never landed: the read shows a later
    /// sequence of this device's and, below it, nothing under this one. The device synced out
    /// of order or skipped ahead; resending cannot help.
    #[error(
        "sequence {seq} of this device never landed, and the store already holds a later one: \
         the device synced out of order or skipped sequences"
    )]
    RunNeverLanded { seq: u64 },
    /// The store's mark covers the run but the batches that held it were trimmed away, so
    /// nothing can show that this is the run that landed (a device that reissued sequences
    /// would be told its new events were synced). An operator compares the device's queue
    /// with the account's history.
    #[error(
        "the store's mark covers sequence {seq} from this device, but the batches that held it \
         were trimmed away: this run cannot be proven to be the one that landed"
    )]
    RunTrimmed { seq: u64 },
    /// Send exactly the same run again (after a backoff).
    #[error("retry the same run ({reason:?}): {detail}")]
    Retry { reason: RetryReason, detail: String },
    /// Accounts are explicit and the store has no stream for the run's account: it was
    /// never opened. Nothing was written; the same run lands once the account is opened.
    #[error("account {0} was never opened; open it, then sync again")]
    AccountNotFound(AccountId),
    /// Any other store failure.
    #[error("store: {0}")]
    Store(StoreError),
}

impl DeviceSyncError {
    /// The error code of the response body.
    pub fn code(&self) -> &'static str {
        match self {
            DeviceSyncError::InvalidDeviceId(_) => codes::INVALID_DEVICE_ID,
            DeviceSyncError::ReservedDeviceId(_) => codes::DEVICE_ID_RESERVED,
            DeviceSyncError::InvalidAccount(_) => codes::INVALID_ACCOUNT,
            DeviceSyncError::EmptyRun => codes::EMPTY_RUN,
            DeviceSyncError::RunTooLong { .. } => codes::RUN_TOO_LONG,
            DeviceSyncError::BadSequence(_) => codes::BAD_SEQUENCE,
            DeviceSyncError::UnknownEventType { .. } => codes::UNKNOWN_EVENT_TYPE,
            DeviceSyncError::InvalidAmount { .. } => codes::INVALID_AMOUNT,
            DeviceSyncError::InvalidEventId { .. } | DeviceSyncError::RepeatedEventId { .. } => {
                codes::INVALID_EVENT_ID
            }
            DeviceSyncError::RunStraddlesMark { .. } => codes::RUN_STRADDLES_MARK,
            DeviceSyncError::RunConflictsWithStore { .. }
            | DeviceSyncError::RunNeverLanded { .. } => codes::RUN_CONFLICTS_WITH_STORE,
            DeviceSyncError::RunTrimmed { .. } => codes::RUN_TRIMMED,
            DeviceSyncError::Retry { reason, .. } => match reason {
                RetryReason::InFlight => codes::SYNC_IN_FLIGHT,
                RetryReason::OutcomeUnknown => codes::SYNC_OUTCOME_UNKNOWN,
                RetryReason::NotApplied => codes::SYNC_NOT_APPLIED,
                RetryReason::Unverified => codes::SYNC_UNVERIFIED,
            },
            DeviceSyncError::AccountNotFound(_) => codes::ACCOUNT_NOT_FOUND,
            DeviceSyncError::Store(_) => codes::STORE_ERROR,
        }
    }

    /// Whether the request itself is malformed (a 4xx: the caller must not resend it).
    pub fn is_invalid_request(&self) -> bool {
        !matches!(
            self,
            DeviceSyncError::RunStraddlesMark { .. }
                | DeviceSyncError::RunConflictsWithStore { .. }
                | DeviceSyncError::RunNeverLanded { .. }
                | DeviceSyncError::RunTrimmed { .. }
                | DeviceSyncError::Retry { .. }
                | DeviceSyncError::AccountNotFound(_)
                | DeviceSyncError::Store(_)
        )
    }

    /// Whether the run contradicts what the store holds from this device: a device that
    /// broke the sequence rules. Resending cannot fix it; an operator must look.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            DeviceSyncError::RunStraddlesMark { .. }
                | DeviceSyncError::RunConflictsWithStore { .. }
                | DeviceSyncError::RunNeverLanded { .. }
                | DeviceSyncError::RunTrimmed { .. }
        )
    }

    /// Whether resending the same run may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, DeviceSyncError::Retry { .. })
    }

    /// Whether the device should resend the same run (bounded by its attempts): a retry, or a
    /// store failure that may be transient. Resending a run is always safe.
    pub fn resend_may_help(&self) -> bool {
        matches!(
            self,
            DeviceSyncError::Retry { .. } | DeviceSyncError::Store(_)
        )
    }
}

/// What a sync did. Either way, every event of the run is in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncOutcome {
    /// This request appended the run as the account's batch `version`.
    Synced { version: u64, last_seq: u64 },
    /// An earlier attempt landed; the store's mark for (account, device) is `last_seq`.
    AlreadySynced { last_seq: u64 },
}

impl From<SyncOutcome> for SyncResponse {
    fn from(o: SyncOutcome) -> Self {
        match o {
            SyncOutcome::Synced { version, last_seq } => SyncResponse {
                status: SyncStatus::Synced,
                aggregate_version: Some(version),
                last_seq,
            },
            SyncOutcome::AlreadySynced { last_seq } => SyncResponse {
                status: SyncStatus::AlreadySynced,
                aggregate_version: None,
                last_seq,
            },
        }
    }
}

/// The service side of device sync, over the store port.
#[derive(Clone)]
pub struct DeviceSync {
    log: SharedLog,
    identity: Identity,
    max_run_events: usize,
    accounts: AccountsMode,
}

impl DeviceSync {
    /// A core accepting runs of up to [`MAX_RUN_EVENTS`] events, accounts implicit.
    pub fn new(log: SharedLog, identity: Identity) -> Self {
        Self {
            log,
            identity,
            max_run_events: MAX_RUN_EVENTS,
            accounts: AccountsMode::Implicit,
        }
    }

    /// With explicit accounts a run to an account never opened is refused.
    pub fn with_accounts(mut self, accounts: AccountsMode) -> Self {
        self.accounts = accounts;
        self
    }

    /// Lowers the run limit (clamped to 1..=[`MAX_RUN_EVENTS`]).
    pub fn with_max_run_events(mut self, max: usize) -> Self {
        self.max_run_events = max.clamp(1, MAX_RUN_EVENTS);
        self
    }

    pub fn max_run_events(&self) -> usize {
        self.max_run_events
    }

    /// Parses the path's device id and refuses the ids a device may never write under.
    pub fn device_id(&self, raw: &str) -> Result<DeviceId, DeviceSyncError> {
        let id: DeviceId = raw
            .parse()
            .map_err(|_| DeviceSyncError::InvalidDeviceId(raw.chars().take(64).collect()))?;
        let reserved = [
            Uuid::nil(),
            self.identity.client_id,
            named_id(Identity::REFERENCE_SERVICE_CLIENT),
            named_id(Identity::DEFAULT_CLIENT),
        ];
        if reserved.contains(&id.0) {
            return Err(DeviceSyncError::ReservedDeviceId(id));
        }
        Ok(id)
    }

    /// The handler logic of the endpoint: the path's device id and the parsed body in, the
    /// response body (or the typed error to map) out.
    pub async fn handle(
        &self,
        device_id: &str,
        req: &SyncRequest,
    ) -> Result<SyncResponse, DeviceSyncError> {
        let device = self.device_id(device_id)?;
        let run = DeviceRun::from_request(req, self.max_run_events)?;
        self.sync(device, &run).await.map(SyncResponse::from)
    }

    /// Writes one validated run under the device's client id and classifies the answer.
    pub async fn sync(
        &self,
        device: DeviceId,
        run: &DeviceRun,
    ) -> Result<SyncOutcome, DeviceSyncError> {
        let events = store_events(device, run, wall_clock_ms());
        let write = AggregateWrite {
            key: self.identity.key(run.account()),
            events: events.clone(),
            expected_version: None,
            allow_create: self.accounts == AccountsMode::Implicit,
            enforce_client_idempotency: true,
        };
        let (first_seq, last_seq) = (run.first_seq(), run.last_seq());
        match self.log.write(device.as_u128(), vec![write]).await {
            Ok(versions) => match versions.first() {
                Some(&version) => Ok(SyncOutcome::Synced { version, last_seq }),
                None => Err(DeviceSyncError::Store(StoreError::Other {
                    code: 0,
                    message: "the store acknowledged a write without a version".into(),
                })),
            },
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(mark),
                ..
            }) if mark >= last_seq => {
                self.check_landed(device, run, &events).await?;
                Ok(SyncOutcome::AlreadySynced { last_seq: mark })
            }
            // The server did not say where its mark is: only the stream can tell whether the
            // run landed, and a run it does not show is retried, never called a straddle.
            Err(StoreError::IdempotencyViolation { last_seq: None, .. }) => {
                self.check_landed(device, run, &events).await?;
                Ok(SyncOutcome::AlreadySynced { last_seq })
            }
            Err(StoreError::IdempotencyViolation {
                last_seq: Some(mark),
                ..
            }) => {
                tracing::warn!(
                    device = %device,
                    mark,
                    first_seq,
                    last_seq,
                    "device run straddles the store's mark"
                );
                Err(DeviceSyncError::RunStraddlesMark {
                    mark,
                    first_seq,
                    last_seq,
                })
            }
            Err(StoreError::InflightDuplicate) => Err(DeviceSyncError::Retry {
                reason: RetryReason::InFlight,
                detail: StoreError::InflightDuplicate.to_string(),
            }),
            Err(e @ StoreError::OutcomeUnknown { .. }) => Err(DeviceSyncError::Retry {
                reason: RetryReason::OutcomeUnknown,
                detail: e.to_string(),
            }),
            Err(e @ StoreError::NotApplied { .. }) => Err(DeviceSyncError::Retry {
                reason: RetryReason::NotApplied,
                detail: e.to_string(),
            }),
            // Existence is checked before idempotency: nothing of this device's can be on an
            // account that does not exist, so nothing of the run landed.
            Err(StoreError::AggregateNotFound) if self.accounts == AccountsMode::Explicit => {
                Err(DeviceSyncError::AccountNotFound(run.account()))
            }
            Err(e) => Err(DeviceSyncError::Store(e)),
        }
    }
}

impl DeviceSync {
    /// Proves a run the store's mark covers is really there: every event of the run must be
    /// read back from this device's batches with the same sequence, id, type and payload.
    async fn check_landed(
        &self,
        device: DeviceId,
        run: &DeviceRun,
        expected: &[Event],
    ) -> Result<(), DeviceSyncError> {
        let (first, last) = (run.first_seq(), run.last_seq());
        let RunRead {
            found,
            trimmed,
            max_seen,
            ..
        } = match tokio::time::timeout(READ_BACK_BUDGET, self.read_run(device, run)).await {
            Ok(Ok(read)) => read,
            Ok(Err(e)) => {
                return Err(DeviceSyncError::Retry {
                    reason: RetryReason::Unverified,
                    detail: format!("reading back run {first}..={last} failed: {e}"),
                });
            }
            Err(_) => {
                return Err(DeviceSyncError::Retry {
                    reason: RetryReason::Unverified,
                    detail: format!(
                        "reading back run {first}..={last} took longer than {} s",
                        READ_BACK_BUDGET.as_secs()
                    ),
                });
            }
        };
        for want in expected {
            match found.get(&want.client_seq) {
                Some(got)
                    if got.event_id == want.event_id
                        && got.event_type == want.event_type
                        && got.payload == want.payload => {}
                Some(_) => {
                    tracing::warn!(device = %device, seq = want.client_seq, "device reissued a sequence");
                    return Err(DeviceSyncError::RunConflictsWithStore {
                        seq: want.client_seq,
                    });
                }
                // Trimmed away: the mark says some event of this device's held the sequence,
                // not that it was this one. Never answered as synced on the mark alone.
                None if trimmed => {
                    tracing::warn!(device = %device, seq = want.client_seq, "device run below its mark was trimmed away");
                    return Err(DeviceSyncError::RunTrimmed {
                        seq: want.client_seq,
                    });
                }
                // The read shows a later sequence of this device's and every version where
                // this one could stand below it (see `read_run`): it is not there. The device
                // synced out of order (or skipped ahead), and resending cannot help.
                None if max_seen > want.client_seq => {
                    tracing::warn!(device = %device, seq = want.client_seq, "device run below its mark never landed");
                    return Err(DeviceSyncError::RunNeverLanded {
                        seq: want.client_seq,
                    });
                }
                None => {
                    return Err(DeviceSyncError::Retry {
                        reason: RetryReason::Unverified,
                        detail: format!(
                            "the store's mark covers sequence {} but a read does not show it yet",
                            want.client_seq
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// What this device's batches on the account show of the run (see [`RunRead`]).
    ///
    /// The service keeps nothing per device and a 2002 names only the mark, so the run may
    /// stand anywhere in the stream. The read goes down from the newest version,
    /// [`READ_BACK_WINDOW`] versions at a time, because that is where a resend after a lost
    /// answer finds its run, and because Celeriant serves recent versions from memory and
    /// older ones from disk (starting at version 1 made every page of a long account cost a
    /// walk of the whole account there: Celeriant e7c6df9).
    ///
    /// A device that names the version its latest synced run landed at (`lastSyncedVersion`)
    /// has the versions above that one read first, from both ends in turn, starting right
    /// above the hint: its run is its next batch after that one, so a resend after a long
    /// time offline is found there in one window, and so is a prompt one (on a Celeriant
    /// that just restarted, with nothing in memory, even the newest versions cost a disk
    /// read, so the window most likely to hold the run goes first). The hint only orders
    /// the read: until an event read above it places the run there, the versions below it
    /// are read as without it.
    ///
    /// It stops as soon as the answer is decided (see [`RunRead::decided`]) and gives up past
    /// [`MAX_RUN_READ_PAGES`] pages with [`StoreError::NotApplied`], which the caller answers
    /// as unverified (a retry).
    async fn read_run(&self, device: DeviceId, run: &DeviceRun) -> StoreResult<RunRead> {
        let key = self.identity.key(run.account());
        let details = match self.log.details(key).await {
            Ok(d) => d,
            Err(StoreError::AggregateNotFound) => return Ok(RunRead::new(run)),
            Err(e) => return Err(e),
        };
        let tip = details.max_version;
        let mut scan = Scan {
            device,
            key,
            read: RunRead::new(run),
            floor: details.min_available_version.max(1),
            trimmed: details.min_available_version > 1,
            pages: 0,
        };
        let hint = run
            .last_synced_version()
            .filter(|&h| h > scan.floor && h <= tip);
        let mut decided = false;
        let mut high = tip;
        if let Some(h) = hint {
            decided = self.scan(&mut scan, h, tip, Ends::Both).await?;
            high = h - 1;
        }
        if !decided {
            let low = scan.floor;
            self.scan(&mut scan, low, high, Ends::Top).await?;
        }
        let mut read = scan.read;
        // A trim only hides the run if nothing read places the run above it.
        read.trimmed = scan.trimmed && !read.earlier;
        Ok(read)
    }

    /// Reads versions `low..=high` a window at a time, from the top down, or from both ends
    /// in turn, bottom first (above a hint, the run is the device's next batch), until the
    /// answer is decided (true) or the range is read (false).
    async fn scan(
        &self,
        scan: &mut Scan,
        mut low: u64,
        mut high: u64,
        ends: Ends,
    ) -> StoreResult<bool> {
        let mut from_top = ends == Ends::Top;
        while low <= high {
            let (from, to) = if from_top {
                (high.saturating_sub(READ_BACK_WINDOW - 1).max(low), high)
            } else {
                (low, low.saturating_add(READ_BACK_WINDOW - 1).min(high))
            };
            match self.read_window(scan, from, to).await {
                Ok(()) => {}
                // Trimmed while we read: what is left starts higher up.
                Err(StoreError::Trimmed { min_available }) if min_available > low => {
                    scan.trimmed = true;
                    scan.floor = scan.floor.max(min_available);
                    low = min_available;
                    continue;
                }
                Err(e) => return Err(e),
            }
            if scan.read.decided(from_top) {
                return Ok(true);
            }
            if from_top {
                high = from - 1;
            } else {
                low = to + 1;
            }
            from_top = ends == Ends::Top || !from_top;
        }
        Ok(false)
    }

    /// Reads versions `from..=to` (every batch, so the read proves it saw them all), page by
    /// page, and takes this device's batches into the scan. A read that shows less than the
    /// whole window (a replica behind the tip the details call reported) is an error, which
    /// the caller answers as unverified: a verdict is only ever drawn from complete windows.
    async fn read_window(&self, scan: &mut Scan, from: u64, to: u64) -> StoreResult<()> {
        let filter = ReadFilter {
            to_version: Some(to),
            ..ReadFilter::from_version(from)
        };
        let device = scan.device.as_u128();
        let mut stream = BatchStream::new(self.log.as_ref(), scan.key, filter);
        let mut whole = WholeRange::new(from, to);
        loop {
            if scan.pages >= MAX_RUN_READ_PAGES {
                return Err(StoreError::NotApplied {
                    reason: format!("the read-back passed {MAX_RUN_READ_PAGES} pages"),
                });
            }
            scan.pages += 1;
            let batches = match stream.next_page().await {
                Ok(Some(batches)) => batches,
                Ok(None) | Err(StoreError::AggregateNotFound) => break,
                Err(e) => return Err(e),
            };
            for b in &batches {
                whole.saw(b.version)?;
            }
            scan.read
                .absorb(batches.iter().filter(|b| b.client_id == device));
            if !stream.has_more() {
                break;
            }
        }
        whole.finish()
    }
}

/// One read-back in progress.
struct Scan {
    device: DeviceId,
    key: AggregateKey,
    read: RunRead,
    /// The lowest version still readable.
    floor: u64,
    /// Part of the stream was trimmed away.
    trimmed: bool,
    /// Pages read so far, against [`MAX_RUN_READ_PAGES`].
    pages: usize,
}

/// Where a read-back takes its windows from: the top only, or both ends in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ends {
    Top,
    Both,
}

/// Versions one step of a device run's read-back covers: one Celeriant page.
pub const READ_BACK_WINDOW: u64 = 512;

/// The most pages one read-back of a device run may take (a Celeriant page spans at most
/// 512 versions: 256 pages are about 131,000 versions; it is paid only by a resend after a
/// lost answer). This caps how far below the newest version (or above the device's hint) a
/// resent run can still be proven: beyond it the answer is the retryable `SYNC_UNVERIFIED`,
/// never a guess.
pub const MAX_RUN_READ_PAGES: usize = 256;

/// The longest one read-back of a device run may take. A device sync's backstop covers its
/// store write and this (`http::route_deadline`), so a slow store's answer is the
/// documented retryable `SYNC_UNVERIFIED`, not the backstop's generic 503.
pub const READ_BACK_BUDGET: std::time::Duration = std::time::Duration::from_secs(4);

/// What a read of one device's batches on one account shows of a run.
///
/// A device's batches on an account hold rising sequences in rising versions (the store
/// refuses a sequence at or below the device's mark), so one event of the device's places the
/// run: below it when its sequence is higher than the run's, above it when lower.
struct RunRead {
    first: u64,
    last: u64,
    /// The run's sequences found, each with its event.
    found: BTreeMap<u64, Event>,
    /// Part of the stream was trimmed away and nothing read places the run above the trim.
    trimmed: bool,
    /// The highest sequence of this device's read (0: none). A missing sequence of the run
    /// below it never landed, once the read covers every version where it could stand.
    max_seen: u64,
    /// An event of this device's with a sequence below the run's was read.
    earlier: bool,
    /// The last window read held a later (or earlier) event than the run's: set per window
    /// by [`RunRead::absorb`], read by [`RunRead::decided`].
    window_later: bool,
    window_earlier: bool,
}

impl RunRead {
    fn new(run: &DeviceRun) -> Self {
        Self {
            first: run.first_seq(),
            last: run.last_seq(),
            found: BTreeMap::new(),
            trimmed: false,
            max_seen: 0,
            earlier: false,
            window_later: false,
            window_earlier: false,
        }
    }

    /// Takes in the device's batches of one page.
    fn absorb<'b>(&mut self, batches: impl Iterator<Item = &'b Batch>) {
        for e in batches.flat_map(|b| b.events.iter()) {
            if (self.first..=self.last).contains(&e.client_seq) {
                self.found.entry(e.client_seq).or_insert_with(|| e.clone());
            }
            self.max_seen = self.max_seen.max(e.client_seq);
            self.window_later |= e.client_seq > self.last;
            self.window_earlier |= e.client_seq < self.first;
        }
        self.earlier |= self.window_earlier;
    }

    /// Whether reading on can no longer change the verdict, after a window from the top
    /// (`from_top`) or the bottom of the unread range: every sequence of the run was found
    /// (runs have no gaps); or, from the top, an earlier sequence was, above which every
    /// version is read and below which none of the run's can stand; or, from the bottom
    /// (above the device's hint), a later one was, once an earlier one was read above the
    /// hint too: until then the run may stand below the hint, which says nothing for sure.
    fn decided(&mut self, from_top: bool) -> bool {
        let placed = if from_top {
            self.window_earlier
        } else {
            self.window_later && self.earlier
        };
        self.window_later = false;
        self.window_earlier = false;
        placed || self.found.len() as u64 > self.last - self.first
    }
}

/// The store events of a run: one per device event, named by [`store_event_id`].
fn store_events(device: DeviceId, run: &DeviceRun, now: u64) -> Vec<Event> {
    let mut events = Vec::with_capacity(run.events().len());
    for e in run.events() {
        // A device operation is a deposit or a withdrawal: exactly one leg, on the run's
        // account.
        for leg in e.operation.legs().as_slice() {
            events.push(Event {
                client_seq: e.client_seq,
                event_id: Some(store_event_id(device, run.account(), e)),
                event_type: leg.event.event_type(),
                payload: leg.event.encode(),
                timestamp_ms: e.recorded_at_ms.unwrap_or(now),
            });
        }
    }
    events
}

/// The store's event id for a device event: derived from the device id and the device's own
/// event id (or, without one, the account and sequence), in a namespace of its own, so the
/// same event always carries the same id and no device can name an id that an API caller's
/// idempotency key maps to by accident.
pub fn store_event_id(device: DeviceId, account: AccountId, e: &RunEvent) -> u128 {
    let mut name = Vec::with_capacity(40);
    name.extend_from_slice(device.0.as_bytes());
    match e.event_id {
        // 32 bytes here, 40 below: the two shapes never collide.
        Some(id) => name.extend_from_slice(id.as_bytes()),
        None => {
            name.extend_from_slice(account.0.as_bytes());
            name.extend_from_slice(&e.client_seq.to_be_bytes());
        }
    }
    Uuid::new_v5(&DEVICE_EVENT_NAMESPACE, &name).as_u128()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::device::protocol::SyncEvent;
    use crate::store::memory::MemoryLog;

    const ACCOUNT: &str = "00000000-0000-0000-0000-0000000000a1";
    const DEVICE: &str = "6f9619ff-8b86-4011-b42d-00c04fc964ff";

    fn event(seq: u64, kind: &str, cents: i64) -> SyncEvent {
        SyncEvent {
            client_seq: seq,
            kind: kind.into(),
            amount_cents: cents,
            event_id: None,
            recorded_at_ms: None,
        }
    }

    fn request(events: Vec<SyncEvent>) -> SyncRequest {
        SyncRequest {
            account_id: ACCOUNT.into(),
            first_seq: None,
            last_synced_version: None,
            events,
        }
    }

    fn core() -> (Arc<MemoryLog>, DeviceSync) {
        let log = Arc::new(MemoryLog::new());
        (log.clone(), DeviceSync::new(log, Identity::default()))
    }

    #[tokio::test]
    async fn a_device_may_not_write_under_a_service_client_id() {
        let (log, core) = core();
        let req = request(vec![event(1, "deposit", 1)]);
        let identity = Identity::default();
        for reserved in [
            identity.client_id,
            named_id(Identity::REFERENCE_SERVICE_CLIENT),
            Uuid::nil(),
        ] {
            let err = core.handle(&reserved.to_string(), &req).await.unwrap_err();
            assert!(matches!(err, DeviceSyncError::ReservedDeviceId(_)), "{err}");
            assert!(err.is_invalid_request() && !err.is_retryable());
        }
        let err = core.handle("pos-7", &req).await.unwrap_err();
        assert!(matches!(err, DeviceSyncError::InvalidDeviceId(_)));
        let key = identity.key(ACCOUNT.parse().unwrap());
        assert_eq!(log.batch_count(key), 0, "a refused run writes nothing");
    }

    #[tokio::test]
    async fn a_device_run_lands_once_and_its_resend_is_already_synced() {
        let (log, core) = core();
        let req = request((1..=3).map(|s| event(s, "deposit", 10)).collect());
        let first = core.handle(DEVICE, &req).await.unwrap();
        assert_eq!(first.status, SyncStatus::Synced);
        assert_eq!((first.aggregate_version, first.last_seq), (Some(1), 3));
        let again = core.handle(DEVICE, &req).await.unwrap();
        assert_eq!(again.status, SyncStatus::AlreadySynced);
        assert_eq!(again.last_seq, 3);
        let key = Identity::default().key(ACCOUNT.parse().unwrap());
        assert_eq!(log.batch_count(key), 1);
        let device: DeviceId = DEVICE.parse().unwrap();
        assert_eq!(log.client_mark(key, device.as_u128()), Some(3));
    }

    #[tokio::test]
    async fn a_mark_inside_the_run_is_never_answered_as_synced() {
        let (log, core) = core();
        core.handle(
            DEVICE,
            &request((1..=3).map(|s| event(s, "deposit", 1)).collect()),
        )
        .await
        .unwrap();
        // A device that re-cut its run (2..=5 after 1..=3 landed) would have 4 and 5 marked
        // synced on a 2002 although they were never written.
        let grown = request((2..=5).map(|s| event(s, "deposit", 1)).collect());
        let err = core.handle(DEVICE, &grown).await.unwrap_err();
        assert_eq!(
            err,
            DeviceSyncError::RunStraddlesMark {
                mark: 3,
                first_seq: 2,
                last_seq: 5
            }
        );
        assert!(!err.is_retryable() && !err.is_invalid_request());
        let key = Identity::default().key(ACCOUNT.parse().unwrap());
        assert_eq!(log.batch_count(key), 1);
    }

    /// The memory store, bent one way: 2002s that leave out the committed sequence, or
    /// reads that take longer than a read-back may.
    struct Bent {
        inner: Arc<MemoryLog>,
        hide_mark: bool,
        slow_reads: bool,
    }

    #[async_trait::async_trait]
    impl crate::store::EventLog for Bent {
        async fn write(
            &self,
            client_id: crate::store::ClientId,
            writes: Vec<crate::store::AggregateWrite>,
        ) -> crate::store::StoreResult<Vec<u64>> {
            match self.inner.write(client_id, writes).await {
                Err(StoreError::IdempotencyViolation { attempted_seq, .. }) if self.hide_mark => {
                    Err(StoreError::IdempotencyViolation {
                        last_seq: None,
                        attempted_seq,
                    })
                }
                other => other,
            }
        }
        async fn read(
            &self,
            key: crate::store::AggregateKey,
            filter: &crate::store::ReadFilter,
        ) -> crate::store::StoreResult<crate::store::ReadPage> {
            if self.slow_reads {
                tokio::time::sleep(READ_BACK_BUDGET * 2).await;
            }
            self.inner.read(key, filter).await
        }
        async fn details(
            &self,
            key: crate::store::AggregateKey,
        ) -> crate::store::StoreResult<crate::store::AggregateDetails> {
            self.inner.details(key).await
        }
        async fn trim_start(
            &self,
            key: crate::store::AggregateKey,
            keep_from_version: u64,
        ) -> crate::store::StoreResult<()> {
            self.inner.trim_start(key, keep_from_version).await
        }
    }

    fn bent(hide_mark: bool, slow_reads: bool) -> (Arc<MemoryLog>, DeviceSync) {
        let inner = Arc::new(MemoryLog::new());
        let log = Bent {
            inner: inner.clone(),
            hide_mark,
            slow_reads,
        };
        (inner, DeviceSync::new(Arc::new(log), Identity::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_back_slower_than_its_budget_is_unverified_within_it() {
        let (_log, core) = bent(false, true);
        let run = request((1..=3).map(|s| event(s, "deposit", 10)).collect());
        core.handle(DEVICE, &run).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = core.handle(DEVICE, &run).await.unwrap_err();
        assert_eq!(err.code(), codes::SYNC_UNVERIFIED, "{err}");
        assert_eq!(started.elapsed(), READ_BACK_BUDGET);
    }

    #[tokio::test]
    async fn a_2002_without_the_mark_is_settled_by_the_stream_never_called_a_straddle() {
        let (log, core) = bent(true, false);
        let run = request((1..=3).map(|s| event(s, "deposit", 10)).collect());
        core.handle(DEVICE, &run).await.unwrap();
        // A lost ack's resend: the stream shows the run, so it is synced.
        let again = core.handle(DEVICE, &run).await.unwrap();
        assert_eq!(again.status, SyncStatus::AlreadySynced);
        assert_eq!(again.last_seq, 3);
        // A run the stream shows only in part (the mark, unknown here, is inside it) is
        // retried, not refused for good.
        let grown = request((2..=5).map(|s| event(s, "deposit", 10)).collect());
        let err = core.handle(DEVICE, &grown).await.unwrap_err();
        assert!(err.is_retryable(), "{err}");
        let key = Identity::default().key(ACCOUNT.parse().unwrap());
        assert_eq!(log.batch_count(key), 1);
    }
}
