//! The account read routes: the demo account list, a balance and a history page. Each
//! parses the query, asks the [`AccountReader`](crate::reader::AccountReader) and shapes
//! the answer; a [`ReadError`](crate::reader::ReadError) becomes a response in
//! `super::error`.

use std::sync::Arc;

use hyper::StatusCode;
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use super::body::{Resp, json_response};
use super::error::{ApiError, ErrorCode};
use crate::account::{AccountEvent, AccountId};
use crate::app::App;
use crate::auth::Caller;
use crate::reader::{Balance, HistoryEntry, Writer};

/// A balance at a version: the body of a balance read and of each leg of a write.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct BalanceBody {
    pub(super) balance_cents: i64,
    pub(super) aggregate_version: u64,
}

/// A balance read's body: with holds on, also what is available and what is held.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct BalanceRead {
    balance_cents: i64,
    aggregate_version: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    available_cents: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held_cents: Option<i64>,
}

impl BalanceRead {
    fn of(b: Balance, holds: bool) -> Self {
        Self {
            balance_cents: b.balance_cents,
            aggregate_version: b.version,
            available_cents: holds.then(|| b.balance_cents.saturating_sub(b.held_cents)),
            held_cents: holds.then_some(b.held_cents),
        }
    }
}

/// `GET /api/accounts`
/// `GET /api/accounts`: the demo accounts; with a token that lists accounts, only those.
pub fn list(app: &App, caller: Option<&Caller>) -> Resp {
    let accounts: Vec<_> = app
        .demo_accounts()
        .into_iter()
        .filter(|(id, _)| caller.is_none_or(|c| c.may_touch(id.0)))
        .map(|(id, name)| json!({"id": id.to_string(), "name": name}))
        .collect();
    json_response(StatusCode::OK, &json!({ "accounts": accounts }))
}

/// `GET /api/accounts/{id}/balance[?minVersion=N]`
pub async fn balance(
    app: &Arc<App>,
    account: AccountId,
    query: Option<&str>,
) -> Result<Resp, ApiError> {
    let min_version = query_u64s(query, &["minVersion"])?
        .into_iter()
        .map(|(_, v)| v)
        .next_back();
    let balance = app.reader.balance(account, min_version).await?;
    Ok(json_response(
        StatusCode::OK,
        &BalanceRead::of(balance, app.config.holds),
    ))
}

/// `GET /api/accounts/{id}/history[?fromVersion=N&limit=N]`
pub async fn history(
    app: &Arc<App>,
    account: AccountId,
    query: Option<&str>,
) -> Result<Resp, ApiError> {
    let mut from_version = 1;
    let mut limit = None;
    for (name, v) in query_u64s(query, &["fromVersion", "limit"])? {
        match name.as_str() {
            "fromVersion" => from_version = v,
            _ => limit = Some(v),
        }
    }
    let page = app.reader.history(account, from_version, limit).await?;
    let events: Vec<_> = page.events.iter().map(history_event).collect();
    let mut body = json!({
        "events": events,
        "currentAggregateVersion": page.current_version,
        "balanceCents": page.balance_cents,
    });
    if let Some(next) = page.next_from_version {
        body["nextFromVersion"] = json!(next);
    }
    if let Some(v) = page.first_available_version {
        body["firstAvailableVersion"] = json!(v);
    }
    Ok(json_response(StatusCode::OK, &body))
}

pub(super) fn history_event(entry: &HistoryEntry) -> serde_json::Value {
    let e = &entry.event;
    let mut v = json!({
        "aggregateVersion": entry.version,
        "timestamp": entry.server_timestamp_ms,
        "type": e.name(),
        "amountCents": e.amount(),
    });
    match e {
        AccountEvent::TransferredOut { to, .. } => v["toAccountId"] = json!(to.to_string()),
        AccountEvent::TransferredIn { from, .. } => v["fromAccountId"] = json!(from.to_string()),
        AccountEvent::HoldPlaced {
            to,
            expires_in_secs,
            ..
        } => {
            // A hold's id is the id of the event that placed it.
            if let Some(id) = entry.event_id {
                v["holdId"] = json!(Uuid::from_u128(id).to_string());
            }
            if let Some(to) = to {
                v["toAccountId"] = json!(to.to_string());
            }
            if let Some(secs) = expires_in_secs {
                v["expiresInSecs"] = json!(secs.get());
            }
        }
        AccountEvent::HoldPosted { hold, .. }
        | AccountEvent::HoldVoided { hold }
        | AccountEvent::HoldExpired { hold } => v["holdId"] = json!(hold.to_string()),
        _ => {}
    }
    if let Some(id) = entry.event_id {
        v["eventId"] = json!(Uuid::from_u128(id).to_string());
    }
    match entry.writer {
        Writer::Service => v["writer"] = json!("service"),
        Writer::Client(id) => {
            v["writer"] = json!("client");
            v["writerId"] = json!(Uuid::from_u128(id).to_string());
        }
    }
    v
}

/// Parses a query of non-negative integer parameters: percent-decoded, each named in
/// `allowed` (a typo never silently changes what is read), each at most once, each plain
/// decimal digits.
fn query_u64s(query: Option<&str>, allowed: &[&str]) -> Result<Vec<(String, u64)>, ApiError> {
    let bad = |message: String| ApiError::bad_request(ErrorCode::BadQuery, message);
    let mut out: Vec<(String, u64)> = Vec::new();
    for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if !allowed.contains(&name.as_ref()) {
            return Err(bad(format!(
                "unknown query parameter {name:?}; allowed: {}",
                allowed.join(", ")
            )));
        }
        if out.iter().any(|(n, _)| *n == name) {
            return Err(bad(format!("{name} is given more than once")));
        }
        let n = Some(value.as_ref())
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                bad(format!(
                    "{name} must be a non-negative integer, got {value:?}"
                ))
            })?;
        out.push((name.into_owned(), n));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_query_parameters_are_refused() {
        assert!(query_u64s(Some("minVersion=3"), &["minVersion"]).is_ok());
        assert!(query_u64s(Some("minversion=3"), &["minVersion"]).is_err());
        assert!(query_u64s(Some("minVersion=-1"), &["minVersion"]).is_err());
    }
}
