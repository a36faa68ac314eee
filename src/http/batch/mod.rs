//! `POST /api/batch`: many writes in one request. Each item is one write of the single
//! routes, under its own key, through the same write loop: the batch is a way to send
//! writes, never a second way to write.
//!
//! The rules (docs/api.md, "Batches"):
//! - The batch is checked whole before anything runs: JSON, at most `--batch-max-bytes`, 1 to
//!   `--batch-max-items` items. Otherwise it is refused whole, and nothing is written.
//! - Each item is then on its own: bad input, a refused account, a rule's refusal or a
//!   retryable answer is that item's result, and the others run.
//! - Items on one account run in the order given: an item waits for the item before it on
//!   each of its accounts. So a key sent twice on one account is as if sent again after the
//!   first answered: a replay, or 422 for another body.
//! - At most `--batch-items-in-flight` items of one batch run at once. Each holds a
//!   live-write permit as a single request does (`--max-live-writes`), and batch items
//!   together hold at most half of them (`WriteService::execute_batch_item`): an item waits
//!   for that share rather than being refused, and single requests keep the other half.
//! - Items that name one `group` are linked: they go out in one store write, or none does
//!   (`WriteService::execute_linked`). At most 16 items on 16 accounts, each key once. A
//!   final refusal of one is its own answer, and the others are 422 `LINKED_ITEM_FAILED`; a
//!   retryable answer of one is every item's. A group runs where its first item stands.
//! - The answer comes once every item has its result: for each, exactly the status and body
//!   the single route would have answered, with its key, whether it was a replay, and the
//!   window and retention it states.

mod run;

use std::sync::Arc;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::admission::RequestSlots;
use super::body::read_json_within;
use super::deadline::{request_deadline, took_too_long};
use super::error::{ApiError, ErrorCode};
use super::idempotency::{self, IdempotencyKey};
use super::response::{Resp, json_response};
use super::writes::{from_account_id, refuse_if_stood_still, to_account_id};
use crate::account::{AccountId, AmountCents, Operation};
use crate::app::App;
use crate::auth::Caller;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    items: Vec<Value>,
}

/// One item, as the single routes' bodies with a type and the key.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
enum Item {
    Deposit(AccountItem),
    Withdraw(AccountItem),
    Transfer(TransferItem),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AccountItem {
    #[serde(deserialize_with = "account_id")]
    account_id: Uuid,
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    amount_cents: i64,
    idempotency_key: String,
    /// Read from the raw item before this parse (`group_of`), so that an item refused here
    /// still belongs to its group; here only its type is checked.
    #[serde(default, rename = "group")]
    _group: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TransferItem {
    #[serde(deserialize_with = "from_account_id")]
    from_account_id: Uuid,
    #[serde(deserialize_with = "to_account_id")]
    to_account_id: Uuid,
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    amount_cents: i64,
    idempotency_key: String,
    /// Read from the raw item before this parse (`group_of`), so that an item refused here
    /// still belongs to its group; here only its type is checked.
    #[serde(default, rename = "group")]
    _group: Option<String>,
}

fn account_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Uuid, D::Error> {
    super::writes::account_id_field(d, "accountId")
}

/// An item ready to run: its key and its write.
struct Ready {
    key: IdempotencyKey,
    op: Operation,
}

/// An item as read: the linked group it names, and its write or why it is refused.
struct Prepared {
    group: Option<String>,
    ready: Result<Ready, ApiError>,
}

/// `POST /api/batch`.
pub async fn batch(
    app: &Arc<App>,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    let caller = req.extensions().get::<Caller>().cloned();
    let limits = &app.config.http;
    let body: BatchBody = tokio::time::timeout(
        request_deadline(app),
        read_json_within(req, slots, limits.batch_max_bytes),
    )
    .await
    .map_err(|_| took_too_long())??;
    let n = body.items.len();
    if n == 0 || n > limits.batch_max_items {
        return Err(ApiError::bad_request(
            ErrorCode::BadRequest,
            format!(
                "a batch carries 1 to {} items; this one has {n}, and nothing was written",
                limits.batch_max_items
            ),
        ));
    }
    refuse_if_stood_still(app)?;
    app.metrics.batch_items.observe(n as f64);
    let items: Vec<Prepared> = body
        .items
        .into_iter()
        .map(|item| Prepared {
            group: group_of(&item),
            ready: prepare(app, caller.as_ref(), item),
        })
        .collect();
    let results = run::run_in_order(app, caller.as_ref(), items).await;
    let mut resp = json_response(StatusCode::OK, &json!({ "results": results }));
    // The longest wait any retryable item asks for, so a client that resends the open
    // items together waits enough for each.
    if let Some(after) = results
        .iter()
        .filter_map(|r| r["retryAfter"].as_u64())
        .max()
    {
        resp.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from(after),
        );
    }
    Ok(resp)
}

/// The linked group an item names, whatever else is wrong with it (a group is refused whole
/// when any of its items is).
fn group_of(item: &Value) -> Option<String> {
    match item.get("group")? {
        Value::String(name) => Some(name.clone()),
        Value::Null => None,
        // Not a name: grouped under what it is, so the group's refusal still reaches it.
        other => Some(other.to_string()),
    }
}

/// An item's key and write, or why it is refused (its own 400, 422 or 403).
fn prepare(app: &App, caller: Option<&Caller>, item: Value) -> Result<Ready, ApiError> {
    let item: Item =
        serde_json::from_value(item).map_err(|e| ApiError::Validation(e.to_string()))?;
    let (raw_key, op) = match item {
        Item::Deposit(i) => (
            i.idempotency_key,
            Operation::Deposit {
                account: AccountId(i.account_id),
                amount: AmountCents::new(i.amount_cents)?,
            },
        ),
        Item::Withdraw(i) => (
            i.idempotency_key,
            Operation::Withdraw {
                account: AccountId(i.account_id),
                amount: AmountCents::new(i.amount_cents)?,
            },
        ),
        Item::Transfer(i) => (
            i.idempotency_key,
            Operation::transfer(
                AccountId(i.from_account_id),
                AccountId(i.to_account_id),
                AmountCents::new(i.amount_cents)?,
            )?,
        ),
    };
    let key = IdempotencyKey::parse(&raw_key, caller.map(|c| c.id.as_str()))?;
    super::auth::authorize_operation(app, caller, &op)?;
    Ok(Ready { key, op })
}

/// An item's result: the status and body its single route answered, and what that answer's
/// headers said of its key.
pub(super) async fn result_of(resp: Resp) -> Value {
    let (parts, body) = resp.into_parts();
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    };
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let number = |name: &str| header(name).and_then(|v| v.parse::<u64>().ok());
    let mut result = json!({
        "status": parts.status.as_u16(),
        "body": body,
        "replayed": header(idempotency::REPLAYED_HEADER) == Some("true"),
    });
    if let Some(key) = header(idempotency::HEADER) {
        result["idempotencyKey"] = json!(key);
    }
    if let Some(w) = number(idempotency::WINDOW_HEADER) {
        result["idempotencyWindow"] = json!(w);
    }
    if let Some(r) = number(idempotency::RETENTION_HEADER) {
        result["idempotencyRetention"] = json!(r);
    }
    if let Some(after) = number("retry-after") {
        result["retryAfter"] = json!(after);
    }
    result
}

/// The label an item's status is counted under.
pub(super) fn status_class(status: u64) -> &'static str {
    match status {
        200..=299 => "2xx",
        409 => "409",
        503 => "503",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
