//! Requests and answers as Tally's JSON has them (docs/openapi.json), camelCase on the wire.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{AmountCents, IdempotencyKey};

/// A balance and the account version it was read at (or that a write produced).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Balance {
    pub balance_cents: i64,
    pub aggregate_version: u64,
}

/// A transfer's legs. The payee's is `None` when the caller may not read the payee's
/// account: the server then answers the payer's leg only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Transferred {
    pub from: Balance,
    #[serde(default)]
    pub to: Option<Balance>,
}

/// An account opened (`--accounts explicit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Opened {
    pub account_id: Uuid,
    pub balance_cents: i64,
    pub aggregate_version: u64,
}

/// One page of an account's history.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct History {
    pub events: Vec<HistoryEvent>,
    pub current_aggregate_version: u64,
    pub balance_cents: Option<i64>,
    /// Present while there is more: the `from_version` of the next page.
    pub next_from_version: Option<u64>,
    /// On a trimmed stream, where history starts.
    pub first_available_version: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEvent {
    pub aggregate_version: u64,
    pub timestamp: i64,
    #[serde(rename = "type")]
    pub kind: EventKind,
    pub amount_cents: i64,
    pub to_account_id: Option<Uuid>,
    pub from_account_id: Option<Uuid>,
    pub event_id: Option<Uuid>,
    pub writer: Writer,
    pub writer_id: Option<Uuid>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum EventKind {
    Deposited,
    Withdrawn,
    TransferredOut,
    TransferredIn,
    AccountOpened,
}

/// Who wrote an event: this service, or another writer (its id in `writer_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Writer {
    Service,
    Client,
}

/// Tally's error body: `{"error":"CODE","message":"..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiError {
    /// The code (`INSUFFICIENT_FUNDS`, `CONFLICT`, ...); empty when the body was not Tally's.
    #[serde(rename = "error")]
    pub code: String,
    pub message: String,
    /// On a 500: the id the server logged it under.
    pub error_id: Option<String>,
}

/// A write's answer with what the retry contract adds to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written<T> {
    pub value: T,
    /// The key the write went under (the caller's, or the one minted for it).
    pub key: IdempotencyKey,
    /// The answer is the replay of an earlier attempt's (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// Requests sent for this write, the answered one included.
    pub attempts: u32,
}

/// The JSON bodies of the writes.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct AmountBody {
    pub amount_cents: AmountCents,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TransferBody {
    pub from_account_id: Uuid,
    pub to_account_id: Uuid,
    pub amount_cents: AmountCents,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct OpenBody {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub account_id: Option<Uuid>,
}
