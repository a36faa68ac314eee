//! One run of a device's events, validated: consecutive positive sequences of one account,
//! deposits and withdrawals of valid amounts, at most the run limit.

use uuid::Uuid;

use super::error::DeviceSyncError;
use super::protocol::{SyncEvent, SyncRequest, TYPE_DEPOSIT, TYPE_WITHDRAW};
use crate::account::{AccountId, AmountCents, Operation};

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
    /// The device's hint: the version its latest synced run of the account landed at.
    last_synced_version: Option<u64>,
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
        repeated_event_id(&events)?;
        Ok(DeviceRun {
            account,
            events,
            last_synced_version: req.last_synced_version,
        })
    }

    pub fn account(&self) -> AccountId {
        self.account
    }

    pub fn events(&self) -> &[RunEvent] {
        &self.events
    }

    /// Where the device says its latest synced run of the account landed. Unverified: it
    /// only orders a read-back, never decides one.
    pub fn last_synced_version(&self) -> Option<u64> {
        self.last_synced_version
    }

    pub fn first_seq(&self) -> u64 {
        self.events.first().map_or(0, |e| e.client_seq)
    }

    pub fn last_seq(&self) -> u64 {
        self.events.last().map_or(0, |e| e.client_seq)
    }
}

/// Refuses a run in which two events name the same eventId (a run holds at most
/// `MAX_RUN_EVENTS`, so the quadratic check is a few thousand comparisons at worst).
fn repeated_event_id(events: &[RunEvent]) -> Result<(), DeviceSyncError> {
    for (index, e) in events.iter().enumerate() {
        let Some(id) = e.event_id else { continue };
        if let Some(first) = events[..index].iter().position(|p| p.event_id == Some(id)) {
            return Err(DeviceSyncError::RepeatedEventId { index, first });
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    const ACCOUNT: &str = "00000000-0000-0000-0000-0000000000a1";

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
        // One eventId on two events of a run (else both would land, and history
        // would show it twice).
        let id = "7b0e9a52-4c1d-4a8e-9c57-2f1e6f3b9d10";
        let mut twice = vec![
            event(1, "deposit", 1),
            event(2, "deposit", 1),
            event(3, "deposit", 1),
        ];
        twice[0].event_id = Some(id.into());
        twice[2].event_id = Some(id.into());
        let err = refused(&request(twice));
        assert_eq!(err, DeviceSyncError::RepeatedEventId { index: 2, first: 0 });
        assert_eq!(err.code(), crate::device::error::SyncCode::InvalidEventId);
        let mut bad_account = request(vec![event(1, "deposit", 1)]);
        bad_account.account_id = "acc-1".into();
        assert!(matches!(
            refused(&bad_account),
            DeviceSyncError::InvalidAccount(_)
        ));
    }
}
