//! The service-side core of `POST /api/devices/{deviceId}/sync`: validate one run of a
//! device's events, write it to the store under the device's own client id, and classify the
//! store's answer.
//!
//! The write is unconditional and guarded only by idempotency: `expected_version: None`,
//! `enforce_client_idempotency: true`, `allow_create: true`, one batch for the whole run. The
//! store judges a multi-event write by its lowest sequence, so a 2002 means "something at or
//! above the run's first sequence is already committed by this device". That proves the run
//! landed only if the reported mark reaches the run's last sequence; a mark inside the run can
//! only come from a device that renumbered or re-cut a run, and is answered as a typed error,
//! never as synced.
//!
//! Device batches never raise Tally's own client sequence: the projection only counts batches
//! whose client id is the service's, and a device may not use that id (nor the reference
//! service's, nor nil).

use std::time::{SystemTime, UNIX_EPOCH};

use uuid::Uuid;

use super::protocol::{
    SyncEvent, SyncRequest, SyncResponse, SyncStatus, TYPE_DEPOSIT, TYPE_WITHDRAW, codes,
};
use super::{DeviceId, MAX_RUN_EVENTS};
use crate::account::{AccountId, AmountCents, Identity, Operation, named_id};
use crate::store::{AggregateWrite, Event, SharedLog, StoreError};

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
    /// Send exactly the same run again (after a backoff).
    #[error("retry the same run ({reason:?}): {detail}")]
    Retry { reason: RetryReason, detail: String },
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
            DeviceSyncError::InvalidEventId { .. } => codes::INVALID_EVENT_ID,
            DeviceSyncError::RunStraddlesMark { .. } => codes::RUN_STRADDLES_MARK,
            DeviceSyncError::Retry { reason, .. } => match reason {
                RetryReason::InFlight => codes::SYNC_IN_FLIGHT,
                RetryReason::OutcomeUnknown => codes::SYNC_OUTCOME_UNKNOWN,
                RetryReason::NotApplied => codes::SYNC_NOT_APPLIED,
            },
            DeviceSyncError::Store(_) => codes::STORE_ERROR,
        }
    }

    /// Whether the request itself is wrong (the caller must not resend it as is).
    pub fn is_invalid_request(&self) -> bool {
        !matches!(
            self,
            DeviceSyncError::RunStraddlesMark { .. }
                | DeviceSyncError::Retry { .. }
                | DeviceSyncError::Store(_)
        )
    }

    /// Whether resending the same run may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, DeviceSyncError::Retry { .. })
    }
}

/// One validated event of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunEvent {
    pub client_seq: u64,
    /// A deposit or a withdrawal of the run's account.
    pub operation: Operation,
    pub event_id: Option<Uuid>,
    pub recorded_at_ms: Option<u64>,
}

/// A validated run: consecutive sequences of one account, at most the batch limit. Only
/// [`DeviceRun::from_request`] builds one, so every run the core writes was checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRun {
    account: AccountId,
    events: Vec<RunEvent>,
}

impl DeviceRun {
    /// Validates a request body. Never panics on input.
    pub fn from_request(req: &SyncRequest, max_events: usize) -> Result<Self, DeviceSyncError> {
        let account: AccountId = req
            .account_id
            .parse()
            .map_err(|_| DeviceSyncError::InvalidAccount(req.account_id.clone()))?;
        let Some(first) = req.events.first() else {
            return Err(DeviceSyncError::EmptyRun);
        };
        if req.events.len() > max_events {
            return Err(DeviceSyncError::RunTooLong {
                len: req.events.len(),
                max: max_events,
            });
        }
        if first.client_seq == 0 {
            return Err(DeviceSyncError::BadSequence(
                "clientSeq starts at 1; 0 is not a sequence".into(),
            ));
        }
        if let Some(declared) = req.first_seq
            && declared != first.client_seq
        {
            return Err(DeviceSyncError::BadSequence(format!(
                "firstSeq {declared} differs from the first event's clientSeq {}",
                first.client_seq
            )));
        }
        for (index, pair) in req.events.windows(2).enumerate() {
            if pair[0].client_seq.checked_add(1) != Some(pair[1].client_seq) {
                return Err(DeviceSyncError::BadSequence(format!(
                    "event {}: clientSeq {} does not follow {} (a run has no gaps and never goes back)",
                    index + 1,
                    pair[1].client_seq,
                    pair[0].client_seq
                )));
            }
        }
        let events = req
            .events
            .iter()
            .enumerate()
            .map(|(index, e)| run_event(index, account, e))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceRun { account, events })
    }

    pub fn account(&self) -> AccountId {
        self.account
    }

    pub fn events(&self) -> &[RunEvent] {
        &self.events
    }

    pub fn first_seq(&self) -> u64 {
        self.events.first().map_or(0, |e| e.client_seq)
    }

    pub fn last_seq(&self) -> u64 {
        self.events.last().map_or(0, |e| e.client_seq)
    }
}

fn run_event(index: usize, account: AccountId, e: &SyncEvent) -> Result<RunEvent, DeviceSyncError> {
    let amount =
        AmountCents::new(e.amount_cents).map_err(|err| DeviceSyncError::InvalidAmount {
            index,
            reason: err.to_string(),
        })?;
    let operation = match e.kind.as_str() {
        TYPE_DEPOSIT => Operation::Deposit { account, amount },
        TYPE_WITHDRAW => Operation::Withdraw { account, amount },
        other => {
            return Err(DeviceSyncError::UnknownEventType {
                index,
                kind: other.chars().take(64).collect(),
            });
        }
    };
    let event_id = match &e.event_id {
        None => None,
        Some(raw) => Some(
            Uuid::parse_str(raw).map_err(|_| DeviceSyncError::InvalidEventId {
                index,
                value: raw.chars().take(64).collect(),
            })?,
        ),
    };
    Ok(RunEvent {
        client_seq: e.client_seq,
        operation,
        event_id,
        recorded_at_ms: e.recorded_at_ms,
    })
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
}

impl DeviceSync {
    /// A core accepting runs of up to [`MAX_RUN_EVENTS`] events.
    pub fn new(log: SharedLog, identity: Identity) -> Self {
        Self {
            log,
            identity,
            max_run_events: MAX_RUN_EVENTS,
        }
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
        if run.events.is_empty() {
            return Err(DeviceSyncError::EmptyRun);
        }
        let now = now_ms();
        let mut events = Vec::with_capacity(run.events.len());
        for e in &run.events {
            // A device operation is a deposit or a withdrawal: exactly one leg, on the run's
            // account.
            for leg in e.operation.legs().as_slice() {
                events.push(Event {
                    client_seq: e.client_seq,
                    event_id: Some(store_event_id(device, run.account, e)),
                    event_type: leg.event.event_type(),
                    payload: leg.event.encode(),
                    timestamp_ms: e.recorded_at_ms.unwrap_or(now),
                });
            }
        }
        let write = AggregateWrite {
            key: self.identity.key(run.account),
            events,
            expected_version: None,
            allow_create: true,
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
            Err(StoreError::IdempotencyViolation { last_seq: mark, .. }) if mark >= last_seq => {
                Ok(SyncOutcome::AlreadySynced { last_seq: mark })
            }
            Err(StoreError::IdempotencyViolation { last_seq: mark, .. }) => {
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
            Err(e) => Err(DeviceSyncError::Store(e)),
        }
    }
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

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
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
            events,
        }
    }

    fn core() -> (Arc<MemoryLog>, DeviceSync) {
        let log = Arc::new(MemoryLog::new());
        (log.clone(), DeviceSync::new(log, Identity::default()))
    }

    fn refused(req: &SyncRequest) -> DeviceSyncError {
        DeviceRun::from_request(req, 4).expect_err("the run must be refused")
    }

    #[test]
    fn device_runs_have_consecutive_positive_sequences() {
        let ok = request(vec![event(3, "deposit", 1), event(4, "withdraw", 2)]);
        let run = DeviceRun::from_request(&ok, 4).unwrap();
        assert_eq!((run.first_seq(), run.last_seq()), (3, 4));
        for events in [
            vec![event(0, "deposit", 1)],
            vec![event(1, "deposit", 1), event(3, "deposit", 1)],
            vec![event(2, "deposit", 1), event(1, "deposit", 1)],
            vec![event(2, "deposit", 1), event(2, "deposit", 1)],
            vec![event(u64::MAX, "deposit", 1), event(0, "deposit", 1)],
        ] {
            assert!(matches!(
                refused(&request(events)),
                DeviceSyncError::BadSequence(_)
            ));
        }
        let mut declared = request(vec![event(5, "deposit", 1)]);
        declared.first_seq = Some(4);
        assert!(matches!(
            refused(&declared),
            DeviceSyncError::BadSequence(_)
        ));
    }

    #[test]
    fn device_runs_are_bounded_and_never_empty() {
        assert_eq!(refused(&request(vec![])), DeviceSyncError::EmptyRun);
        let five = (1..=5).map(|s| event(s, "deposit", 1)).collect();
        assert_eq!(
            refused(&request(five)),
            DeviceSyncError::RunTooLong { len: 5, max: 4 }
        );
    }

    #[test]
    fn device_events_are_deposits_or_withdrawals_of_valid_amounts() {
        for kind in ["transfer", "Deposited", ""] {
            assert!(matches!(
                refused(&request(vec![event(1, kind, 1)])),
                DeviceSyncError::UnknownEventType { index: 0, .. }
            ));
        }
        for cents in [0, -1, crate::account::MAX_AMOUNT_CENTS + 1] {
            assert!(matches!(
                refused(&request(vec![
                    event(1, "deposit", 1),
                    event(2, "withdraw", cents)
                ])),
                DeviceSyncError::InvalidAmount { index: 1, .. }
            ));
        }
        let mut bad_id = event(1, "deposit", 1);
        bad_id.event_id = Some("not-a-uuid".into());
        assert!(matches!(
            refused(&request(vec![bad_id])),
            DeviceSyncError::InvalidEventId { index: 0, .. }
        ));
        let mut bad_account = request(vec![event(1, "deposit", 1)]);
        bad_account.account_id = "acc-1".into();
        assert!(matches!(
            refused(&bad_account),
            DeviceSyncError::InvalidAccount(_)
        ));
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
}
