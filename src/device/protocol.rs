//! The JSON shapes of `POST /api/devices/{deviceId}/sync`, shared by the service-side core
//! (`ingest`) and the device's HTTP transport (the `tally-device` crate).
//!
//! Request (camelCase, unknown fields refused):
//! `{"accountId":"…","firstSeq":1,"lastSyncedVersion":6,"events":[{"clientSeq":1,"type":"deposit",
//! "amountCents":500,"eventId":"…","recordedAtMs":…}]}` where `firstSeq`, `lastSyncedVersion`,
//! `eventId` and `recordedAtMs` are optional. Types are `deposit` or `withdraw`.
//!
//! Success (200): `{"status":"synced","aggregateVersion":7,"lastSeq":12}` when this request
//! appended the run, `{"status":"alreadySynced","lastSeq":12}` when the store already holds
//! the run (an earlier attempt landed and its answer was lost); `lastSeq` is then the
//! store's high-water mark for (account, device).
//!
//! Errors use the service's body `{"error":"CODE","message":"…"}`; the codes are below. A
//! retryable error asks for the same run again; a refusal is final for that run.
//!
//! How the device reads a status (`tally_device::transport::classify_http`): 200 with this
//! body syncs the run; 400, 404, 405, 413, 415 and 422, or a body whose code is one of the two
//! conflict codes (whatever the status), stop the sync with the run kept; anything else (409,
//! 429, 5xx, a lost or unreadable answer) resends the same run after a backoff.

use serde::{Deserialize, Serialize};

/// The wire name of a deposit.
pub const TYPE_DEPOSIT: &str = "deposit";
/// The wire name of a withdrawal.
pub const TYPE_WITHDRAW: &str = "withdraw";

/// Error codes of the device sync layer.
pub mod codes {
    pub const INVALID_DEVICE_ID: &str = "INVALID_DEVICE_ID";
    pub const DEVICE_ID_RESERVED: &str = "DEVICE_ID_RESERVED";
    pub const INVALID_ACCOUNT: &str = "INVALID_ACCOUNT";
    pub const EMPTY_RUN: &str = "EMPTY_RUN";
    pub const RUN_TOO_LONG: &str = "RUN_TOO_LONG";
    pub const BAD_SEQUENCE: &str = "BAD_SEQUENCE";
    pub const UNKNOWN_EVENT_TYPE: &str = "UNKNOWN_EVENT_TYPE";
    pub const INVALID_AMOUNT: &str = "INVALID_AMOUNT";
    pub const INVALID_EVENT_ID: &str = "INVALID_EVENT_ID";
    /// The store's mark for (account, device) lies inside the run: the device broke the
    /// rules (renumbered, or changed a run's boundaries). Never answered as synced.
    pub const RUN_STRADDLES_MARK: &str = "DEVICE_RUN_STRADDLES_MARK";
    /// The store holds a different event of this device under one of the run's sequences:
    /// the device reissued sequences. Never answered as synced.
    pub const RUN_CONFLICTS_WITH_STORE: &str = "DEVICE_RUN_CONFLICTS_WITH_STORE";
    /// The store's mark covers the run, but the batches that would prove it were trimmed
    /// away: it cannot be shown to be the run that landed. Never answered as synced.
    pub const RUN_TRIMMED: &str = "DEVICE_RUN_TRIMMED";
    /// Retryable: a write holding these sequences is in flight (2013).
    pub const SYNC_IN_FLIGHT: &str = "SYNC_IN_FLIGHT";
    /// Retryable: the write may or may not have landed; resend the same run.
    pub const SYNC_OUTCOME_UNKNOWN: &str = "SYNC_OUTCOME_UNKNOWN";
    /// Retryable: the write was definitely not applied.
    pub const SYNC_NOT_APPLIED: &str = "SYNC_NOT_APPLIED";
    /// Retryable: the run looks landed but could not be read back yet.
    pub const SYNC_UNVERIFIED: &str = "SYNC_UNVERIFIED";
    /// Accounts are explicit and the run's account was never opened (404): the run is kept
    /// and lands once the account is opened.
    pub const ACCOUNT_NOT_FOUND: &str = "ACCOUNT_NOT_FOUND";
    /// Any other store failure.
    pub const STORE_ERROR: &str = "STORE_ERROR";
}

/// One sync request: a run of consecutive events of one account, in sequence order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SyncRequest {
    pub account_id: String,
    /// When present, must equal the first event's `clientSeq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seq: Option<u64>,
    /// The account version at which this device's latest synced run of the account landed
    /// (a `synced` answer's `aggregateVersion`). Optional, and only a hint: a resend's
    /// read-back looks above it first, since this run can only have landed after that one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_synced_version: Option<u64>,
    #[serde(deserialize_with = "events_as_objects")]
    pub events: Vec<SyncEvent>,
}

/// Reads `events` as JSON objects only: serde's derived reading of a struct also takes an
/// array of its fields by position, which the contract does not allow (else
/// `[[1,"deposit",5]]` would be written as a deposit).
fn events_as_objects<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<SyncEvent>, D::Error> {
    use serde::de::Error;
    Vec::<serde_json::Map<String, serde_json::Value>>::deserialize(d)?
        .into_iter()
        .map(|e| serde_json::from_value(serde_json::Value::Object(e)).map_err(D::Error::custom))
        .collect()
}

/// One recorded event as it travels.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SyncEvent {
    pub client_seq: u64,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    pub amount_cents: i64,
    /// The device's UUID for this event. The store keeps a name derived from it and the
    /// device id, so it can never alias an API caller's idempotency key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// When the device recorded it, epoch milliseconds. Informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_at_ms: Option<u64>,
}

/// Whether this request landed the run or found it already landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum SyncStatus {
    Synced,
    AlreadySynced,
}

/// A successful answer. Either status means every event of the run is in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncResponse {
    pub status: SyncStatus,
    /// The account's version after this request's batch (only when `synced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate_version: Option<u64>,
    /// The highest sequence of this device that the store holds for the account.
    pub last_seq: u64,
}

/// The service's error body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default)]
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_sync_request_uses_the_documented_field_names() {
        let body = r#"{"accountId":"a","firstSeq":3,"events":[
            {"clientSeq":3,"type":"deposit","amountCents":5,"eventId":"e","recordedAtMs":9}]}"#;
        let req: SyncRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.first_seq, Some(3));
        assert_eq!(req.events[0].kind, TYPE_DEPOSIT);
        assert_eq!(req.events[0].recorded_at_ms, Some(9));
        let back = serde_json::to_value(&req).unwrap();
        assert_eq!(back["events"][0]["type"], "deposit");
        assert_eq!(back["events"][0]["clientSeq"], 3);
    }

    #[test]
    fn device_sync_events_are_objects_never_arrays() {
        let body = r#"{"accountId":"a","events":[[1,"deposit",5]]}"#;
        assert!(serde_json::from_str::<SyncRequest>(body).is_err());
        let body =
            r#"{"accountId":"a","events":[{"clientSeq":1,"type":"deposit","amountCents":5}]}"#;
        assert_eq!(
            serde_json::from_str::<SyncRequest>(body)
                .unwrap()
                .events
                .len(),
            1
        );
    }

    #[test]
    fn device_sync_request_refuses_unknown_fields() {
        let body = r#"{"accountId":"a","events":[{"clientSeq":1,"type":"deposit","amount":5}]}"#;
        assert!(serde_json::from_str::<SyncRequest>(body).is_err());
    }

    #[test]
    fn device_sync_response_spells_statuses_in_camel_case() {
        let r = SyncResponse {
            status: SyncStatus::AlreadySynced,
            aggregate_version: None,
            last_seq: 4,
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"status":"alreadySynced","lastSeq":4}"#
        );
    }
}
