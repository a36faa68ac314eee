//! The service side of `POST /api/devices/{deviceId}/sync`: validate one run of a device's
//! events, write it to the store under the device's own client id, and classify the store's
//! answer. Not a server: the route in `http::devices` calls it, and so does the device's
//! in-process transport in tests.
//!
//! The write is unconditional and guarded only by idempotency: `expected_version: None`,
//! `enforce_client_idempotency: true`, `allow_create: true` (false with explicit accounts: the
//! store refuses a run to an account never opened, and the device keeps it queued until the
//! account is opened), one batch for the whole run. The
//! store judges a multi-event write by its lowest sequence, so a 2002 means "something at or
//! above the run's first sequence is already committed by this device". That proves the run
//! landed only if the reported mark reaches the run's last sequence; a mark inside the run can
//! only come from a device that renumbered or re-cut a run, and is answered as a typed error,
//! never as synced. Even a mark past the run is read back before the run is called synced
//! (`read_back.rs`).
//!
//! Device batches never raise Tally's own client sequence: the projection only counts batches
//! whose client id is the service's, and a device may not use that id (nor the reference
//! service's, nor nil).

mod read_back;

use uuid::Uuid;

pub use self::read_back::{MAX_RUN_READ_PAGES, READ_BACK_BUDGET, READ_BACK_WINDOW};
use super::error::{DeviceSyncError, RetryReason};
use super::protocol::{SyncRequest, SyncResponse, SyncStatus};
use super::run::{DeviceRun, RunEvent};
use super::{DeviceId, MAX_RUN_EVENTS};
use crate::account::{AccountId, AccountsMode, Identity, named_id};
use crate::store::{AggregateKey, AggregateWrite, Event, SharedLog, StoreError, wall_clock_ms};

/// The namespace the store's event ids of device events are derived in. Never change it: a
/// resend across the change would carry different event ids (harmless to dedup, which is by
/// sequence, but it would break the stable naming of history entries).
pub const DEVICE_EVENT_NAMESPACE: Uuid = Uuid::from_u128(0x5d1c_7e2a_4b90_4f3e_8a61_c0de_de71_ce00);

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
        let key = self.identity.key(run.account());
        let write = AggregateWrite {
            key,
            events: events.clone(),
            expected_version: None,
            allow_create: self.accounts == AccountsMode::Implicit,
            enforce_client_idempotency: true,
        };
        match self.log.write(device.as_u128(), vec![write]).await {
            Ok(versions) => match versions.first() {
                Some(&version) => Ok(SyncOutcome::Synced {
                    version,
                    last_seq: run.last_seq(),
                }),
                None => Err(DeviceSyncError::Store(StoreError::Other {
                    code: 0,
                    message: "the store acknowledged a write without a version".into(),
                })),
            },
            Err(e) => self.not_written(e, key, device, run, &events).await,
        }
    }

    /// What a run the store did not append comes to: already synced (read back first), a
    /// typed refusal, or a retry.
    async fn not_written(
        &self,
        e: StoreError,
        key: AggregateKey,
        device: DeviceId,
        run: &DeviceRun,
        events: &[Event],
    ) -> Result<SyncOutcome, DeviceSyncError> {
        let (first_seq, last_seq) = (run.first_seq(), run.last_seq());
        match e {
            StoreError::IdempotencyViolation {
                last_seq: Some(mark),
                ..
            } if mark >= last_seq => {
                read_back::check_landed(self.log.as_ref(), key, device, run, events).await?;
                Ok(SyncOutcome::AlreadySynced { last_seq: mark })
            }
            // The server did not say where its mark is: only the stream can tell whether the
            // run landed, and a run it does not show is retried, never called a straddle.
            StoreError::IdempotencyViolation { last_seq: None, .. } => {
                read_back::check_landed(self.log.as_ref(), key, device, run, events).await?;
                Ok(SyncOutcome::AlreadySynced { last_seq })
            }
            StoreError::IdempotencyViolation {
                last_seq: Some(mark),
                ..
            } => {
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
            // Existence is checked before idempotency: nothing of this device's can be on an
            // account that does not exist, so nothing of the run landed.
            StoreError::AggregateNotFound if self.accounts == AccountsMode::Explicit => {
                Err(DeviceSyncError::AccountNotFound(run.account()))
            }
            e => Err(retry_or_store_error(e)),
        }
    }
}

/// A store error that says nothing about whether the run landed: a retry when resending the
/// same run can succeed, else the store's error.
fn retry_or_store_error(e: StoreError) -> DeviceSyncError {
    let reason = match &e {
        StoreError::InflightDuplicate => RetryReason::InFlight,
        StoreError::OutcomeUnknown { .. } => RetryReason::OutcomeUnknown,
        StoreError::NotApplied { .. } => RetryReason::NotApplied,
        _ => return DeviceSyncError::Store(e),
    };
    DeviceSyncError::Retry {
        reason,
        detail: e.to_string(),
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

    pub(super) const ACCOUNT: &str = "00000000-0000-0000-0000-0000000000a1";
    pub(super) const DEVICE: &str = "6f9619ff-8b86-4011-b42d-00c04fc964ff";

    pub(super) fn event(seq: u64, kind: &str, cents: i64) -> SyncEvent {
        SyncEvent {
            client_seq: seq,
            kind: kind.into(),
            amount_cents: cents,
            event_id: None,
            recorded_at_ms: None,
        }
    }

    pub(super) fn request(events: Vec<SyncEvent>) -> SyncRequest {
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
}
