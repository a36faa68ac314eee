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

mod result;
mod run;
mod slot;

use std::sync::Arc;

use hyper::Request;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use self::slot::Slot;
use super::admission::RequestSlots;
use super::body::read_json_within;
use super::deadline::{request_deadline, took_too_long};
use super::error::{ApiError, ErrorCode};
use super::idempotency::IdempotencyKey;
use super::response::Resp;
use super::writes::{from_account_id, refuse_if_stood_still, to_account_id};
use crate::account::{AccountId, AmountCents, Operation};
use crate::app::App;
use crate::auth::Caller;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    items: Vec<Slot>,
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
    Ok(result::answer(&results))
}

/// The linked group an item names, whatever else is wrong with it (a group is refused whole
/// when any of its items is).
fn group_of(item: &Slot) -> Option<String> {
    match item.get("group")? {
        Value::String(name) => Some(name.clone()),
        Value::Null => None,
        // Not a name: grouped under what it is, so the group's refusal still reaches it.
        other => Some(other.to_string()),
    }
}

/// The item typed. An item with exactly the fields of the kind its `type` names is read
/// straight from them. Any other item is read as the tree it is, through the tagged enum,
/// whose error says what is wrong.
fn typed(item: Slot) -> Result<Item, ApiError> {
    let invalid = |e: serde_json::Error| ApiError::Validation(e.to_string());
    match item.plain_kind() {
        Some("deposit") => item.typed().map(Item::Deposit),
        Some("withdraw") => item.typed().map(Item::Withdraw),
        Some("transfer") => item.typed().map(Item::Transfer),
        _ => serde_json::from_value(item.into_value()),
    }
    .map_err(invalid)
}

/// An item's key and write, or why it is refused (its own 400, 422 or 403).
fn prepare(app: &App, caller: Option<&Caller>, item: Slot) -> Result<Ready, ApiError> {
    let (raw_key, op) = match typed(item)? {
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

#[cfg(test)]
mod tests {

    use super::*;

    /// What an item read as: its key and accounts, or the refusal's message.
    fn read(result: Result<Item, String>) -> Result<(String, Vec<Uuid>), String> {
        result.map(|item| match item {
            Item::Deposit(i) | Item::Withdraw(i) => (i.idempotency_key, vec![i.account_id]),
            Item::Transfer(i) => (i.idempotency_key, vec![i.from_account_id, i.to_account_id]),
        })
    }

    /// Rule: an item reads as the tagged enum reads the tree of its JSON: it is accepted or
    /// refused alike, with the same message, and names the same group. Items with exactly
    /// one kind's fields take the direct way; the others, the tree's.
    #[test]
    fn an_item_reads_as_the_tagged_enum_reads_its_tree() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let items = [
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":"k"}}"#
            ),
            format!(
                r#"{{"type":"withdraw","accountId":"{a}","amountCents":5,"idempotencyKey":"k","group":"g"}}"#
            ),
            format!(
                r#"{{"type":"transfer","fromAccountId":"{a}","toAccountId":"{b}","amountCents":5,"idempotencyKey":"k"}}"#
            ),
            format!(r#"{{"type":"deposit","accountId":"{a}","idempotencyKey":"k"}}"#),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":"k","extra":1}}"#
            ),
            format!(
                r#"{{"type":"deposit","fromAccountId":"{a}","toAccountId":"{b}","amountCents":5,"idempotencyKey":"k"}}"#
            ),
            format!(
                r#"{{"type":"transfer","accountId":"{a}","amountCents":5,"idempotencyKey":"k"}}"#
            ),
            r#"{"type":"deposit","accountId":"not-a-uuid","amountCents":5,"idempotencyKey":"k"}"#
                .to_owned(),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":"5","idempotencyKey":"k"}}"#
            ),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5.5,"idempotencyKey":"k"}}"#
            ),
            format!(r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":7}}"#),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":null}}"#
            ),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":"k","group":3}}"#
            ),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":"k","group":null}}"#
            ),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"amountCents":6,"idempotencyKey":"k"}}"#
            ),
            format!(
                r#"{{"type":"withdraw","type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":"k"}}"#
            ),
            format!(
                r#"{{"type":"deposit","accountId":"{a}","amountCents":5,"idempotencyKey":"k","group":"g","group":[1]}}"#
            ),
            format!(
                r#"{{"type":"refund","accountId":"{a}","amountCents":5,"idempotencyKey":"k"}}"#
            ),
            format!(r#"{{"type":1,"accountId":"{a}","amountCents":5,"idempotencyKey":"k"}}"#),
            format!(r#"{{"accountId":"{a}","amountCents":5,"idempotencyKey":"k"}}"#),
            format!(r#"["deposit","{a}",5,"k"]"#),
            r#""deposit""#.to_owned(),
            "12.5".to_owned(),
            "null".to_owned(),
            "{}".to_owned(),
        ];
        for text in items {
            let tree: Value = serde_json::from_str(&text).expect("JSON");
            let slot: Slot = serde_json::from_str(&text).expect("any JSON reads as a slot");
            assert_eq!(slot.clone().into_value(), tree, "{text}");
            let group = tree.get("group").map(|g| match g {
                Value::String(name) => Some(name.clone()),
                Value::Null => None,
                other => Some(other.to_string()),
            });
            assert_eq!(group_of(&slot), group.flatten(), "{text}");
            let tagged = serde_json::from_value::<Item>(tree).map_err(|e| e.to_string());
            let direct = typed(slot).map_err(|e| match e {
                ApiError::Validation(message) => message,
                other => format!("not a validation error: {other}"),
            });
            assert_eq!(read(direct), read(tagged), "{text}");
        }
    }
}
