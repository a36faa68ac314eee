//! Every way a device sync can fail on the service side, and why a run should be resent.
//! Its own module so that run validation (`run`) and the core that writes runs
//! (`ingest`) both use it without depending on each other. The HTTP mapping lives
//! with the routes.

use super::DeviceId;
use super::protocol::codes;
use crate::account::AccountId;
use crate::store::StoreError;

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

/// The error code a device sync's answer carries, one per kind of failure; its wire string
/// is the protocol's ([`codes`]), which the device reads back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncCode {
    InvalidDeviceId,
    DeviceIdReserved,
    InvalidAccount,
    EmptyRun,
    RunTooLong,
    BadSequence,
    UnknownEventType,
    InvalidAmount,
    InvalidEventId,
    RunStraddlesMark,
    RunConflictsWithStore,
    RunTrimmed,
    SyncInFlight,
    SyncOutcomeUnknown,
    SyncNotApplied,
    SyncUnverified,
    AccountNotFound,
    StoreError,
}

impl SyncCode {
    /// The code as the answer's `error` field spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncCode::InvalidDeviceId => codes::INVALID_DEVICE_ID,
            SyncCode::DeviceIdReserved => codes::DEVICE_ID_RESERVED,
            SyncCode::InvalidAccount => codes::INVALID_ACCOUNT,
            SyncCode::EmptyRun => codes::EMPTY_RUN,
            SyncCode::RunTooLong => codes::RUN_TOO_LONG,
            SyncCode::BadSequence => codes::BAD_SEQUENCE,
            SyncCode::UnknownEventType => codes::UNKNOWN_EVENT_TYPE,
            SyncCode::InvalidAmount => codes::INVALID_AMOUNT,
            SyncCode::InvalidEventId => codes::INVALID_EVENT_ID,
            SyncCode::RunStraddlesMark => codes::RUN_STRADDLES_MARK,
            SyncCode::RunConflictsWithStore => codes::RUN_CONFLICTS_WITH_STORE,
            SyncCode::RunTrimmed => codes::RUN_TRIMMED,
            SyncCode::SyncInFlight => codes::SYNC_IN_FLIGHT,
            SyncCode::SyncOutcomeUnknown => codes::SYNC_OUTCOME_UNKNOWN,
            SyncCode::SyncNotApplied => codes::SYNC_NOT_APPLIED,
            SyncCode::SyncUnverified => codes::SYNC_UNVERIFIED,
            SyncCode::AccountNotFound => codes::ACCOUNT_NOT_FOUND,
            SyncCode::StoreError => codes::STORE_ERROR,
        }
    }
}

/// Written as its wire string.
impl serde::Serialize for SyncCode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
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
    /// Answered with the error's class only: the client's words (node addresses, OS
    /// errors) stay out of an answer.
    #[error("store: {}", .0.brief())]
    Store(StoreError),
}

impl DeviceSyncError {
    /// The error code of the response body.
    pub fn code(&self) -> SyncCode {
        match self {
            DeviceSyncError::InvalidDeviceId(_) => SyncCode::InvalidDeviceId,
            DeviceSyncError::ReservedDeviceId(_) => SyncCode::DeviceIdReserved,
            DeviceSyncError::InvalidAccount(_) => SyncCode::InvalidAccount,
            DeviceSyncError::EmptyRun => SyncCode::EmptyRun,
            DeviceSyncError::RunTooLong { .. } => SyncCode::RunTooLong,
            DeviceSyncError::BadSequence(_) => SyncCode::BadSequence,
            DeviceSyncError::UnknownEventType { .. } => SyncCode::UnknownEventType,
            DeviceSyncError::InvalidAmount { .. } => SyncCode::InvalidAmount,
            DeviceSyncError::InvalidEventId { .. } | DeviceSyncError::RepeatedEventId { .. } => {
                SyncCode::InvalidEventId
            }
            DeviceSyncError::RunStraddlesMark { .. } => SyncCode::RunStraddlesMark,
            DeviceSyncError::RunConflictsWithStore { .. }
            | DeviceSyncError::RunNeverLanded { .. } => SyncCode::RunConflictsWithStore,
            DeviceSyncError::RunTrimmed { .. } => SyncCode::RunTrimmed,
            DeviceSyncError::Retry { reason, .. } => match reason {
                RetryReason::InFlight => SyncCode::SyncInFlight,
                RetryReason::OutcomeUnknown => SyncCode::SyncOutcomeUnknown,
                RetryReason::NotApplied => SyncCode::SyncNotApplied,
                RetryReason::Unverified => SyncCode::SyncUnverified,
            },
            DeviceSyncError::AccountNotFound(_) => SyncCode::AccountNotFound,
            DeviceSyncError::Store(_) => SyncCode::StoreError,
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
