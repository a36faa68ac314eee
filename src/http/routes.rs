//! Routes and handlers. Every handler returns `Result<Resp, ApiError>`; errors become
//! responses in one place ([`ApiError::into_response`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing::Instrument;
use uuid::Uuid;

use super::body::{Resp, json_response, read_json, text_response};
use super::error::ApiError;
use super::idempotency::{self, IdempotencyKey};
use crate::account::{AccountEvent, AccountId, AmountCents, Operation};
use crate::app::App;
use crate::store::{BatchStream, ReadFilter, StoreError};
use crate::write_loop::{LegResult, WriteOutcome, WriteRequest};

/// History page size when the caller names none, and the most it may ask for.
pub const DEFAULT_HISTORY_LIMIT: usize = 100;
pub const MAX_HISTORY_LIMIT: usize = 1000;
/// How long a readiness probe waits for the store.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Catch-ups a `minVersion` balance read tries before answering 503.
const MIN_VERSION_ATTEMPTS: u32 = 5;
const MIN_VERSION_BACKOFF: Duration = Duration::from_millis(20);
/// A backstop on any one request, beyond the write loop's own deadline.
const REQUEST_DEADLINE_MARGIN: Duration = Duration::from_secs(5);

/// A matched route: its template (the only path form used in metrics and logs) and what it
/// does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Healthz,
    Readyz,
    Metrics,
    Accounts,
    Balance(AccountId),
    History(AccountId),
    Deposit(AccountId),
    Withdraw(AccountId),
    AccountTransfer(AccountId),
    Transfers,
}

impl Route {
    pub fn template(&self) -> &'static str {
        match self {
            Route::Healthz => "/healthz",
            Route::Readyz => "/readyz",
            Route::Metrics => "/metrics",
            Route::Accounts => "/api/accounts",
            Route::Balance(_) => "/api/accounts/{id}/balance",
            Route::History(_) => "/api/accounts/{id}/history",
            Route::Deposit(_) => "/api/accounts/{id}/deposit",
            Route::Withdraw(_) => "/api/accounts/{id}/withdraw",
            Route::AccountTransfer(_) => "/api/accounts/{id}/transfers",
            Route::Transfers => "/api/transfers",
        }
    }

    fn method(&self) -> Method {
        match self {
            Route::Deposit(_)
            | Route::Withdraw(_)
            | Route::AccountTransfer(_)
            | Route::Transfers => Method::POST,
            _ => Method::GET,
        }
    }

    /// GET routes also answer HEAD (hyper sends the headers without the body).
    fn accepts(&self, method: &Method) -> bool {
        let own = self.method();
        *method == own || (own == Method::GET && *method == Method::HEAD)
    }

    /// Whether the route counts against the concurrency limit (probes and scrapes do not).
    pub fn is_api(&self) -> bool {
        !matches!(self, Route::Healthz | Route::Readyz | Route::Metrics)
    }

    /// Matches a path, then the method. Unknown paths are 404; known paths with another
    /// method are 405; a malformed account id is 400.
    pub fn resolve(method: &Method, path: &str) -> Result<Route, ApiError> {
        let segs: Vec<&str> = path.split('/').skip(1).collect();
        let id = |s: &str| -> Result<AccountId, ApiError> {
            s.parse().map_err(|_| {
                ApiError::bad_request(
                    "INVALID_ID",
                    format!("{s:?} is not a valid account id (a UUID)"),
                )
            })
        };
        let route = match segs.as_slice() {
            ["healthz"] => Route::Healthz,
            ["readyz"] => Route::Readyz,
            ["metrics"] => Route::Metrics,
            ["api", "accounts"] => Route::Accounts,
            ["api", "transfers"] => Route::Transfers,
            ["api", "accounts", acct, action] => {
                let make: fn(AccountId) -> Route = match *action {
                    "balance" => Route::Balance,
                    "history" => Route::History,
                    "deposit" => Route::Deposit,
                    "withdraw" => Route::Withdraw,
                    "transfers" => Route::AccountTransfer,
                    _ => return Err(not_found(path)),
                };
                // Resolve the method before the id, so a wrong method is 405 either way.
                let probe = make(AccountId(Uuid::nil()));
                if !probe.accepts(method) {
                    return Err(ApiError::MethodNotAllowed {
                        allow: probe.method_name(),
                    });
                }
                return Ok(make(id(acct)?));
            }
            _ => return Err(not_found(path)),
        };
        if !route.accepts(method) {
            return Err(ApiError::MethodNotAllowed {
                allow: route.method_name(),
            });
        }
        Ok(route)
    }

    fn method_name(&self) -> &'static str {
        if self.method() == Method::POST {
            "POST"
        } else {
            "GET, HEAD"
        }
    }
}

fn not_found(path: &str) -> ApiError {
    let mut shown: String = path.chars().take(200).collect();
    if shown.len() < path.len() {
        shown.push('…');
    }
    ApiError::NotFound { path: shown }
}

pub async fn dispatch(
    app: &Arc<App>,
    route: Route,
    req: Request<Incoming>,
) -> Result<Resp, ApiError> {
    match route {
        Route::Healthz => Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
        Route::Readyz => readyz(app).await,
        Route::Metrics => Ok(text_response(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            app.metrics.render(),
        )),
        Route::Accounts => Ok(list_accounts(app)),
        Route::Balance(account) => balance(app, account, req.uri().query()).await,
        Route::History(account) => history(app, account, req.uri().query()).await,
        Route::Deposit(account) => {
            write(app, req, move |b: AmountBody| {
                Ok(Operation::Deposit {
                    account,
                    amount: AmountCents::new(b.amount_cents)?,
                })
            })
            .await
        }
        Route::Withdraw(account) => {
            write(app, req, move |b: AmountBody| {
                Ok(Operation::Withdraw {
                    account,
                    amount: AmountCents::new(b.amount_cents)?,
                })
            })
            .await
        }
        Route::AccountTransfer(from) => {
            write(app, req, move |b: AccountTransferBody| {
                Ok(Operation::transfer(
                    from,
                    AccountId(b.to_account_id),
                    AmountCents::new(b.amount_cents)?,
                )?)
            })
            .await
        }
        Route::Transfers => {
            write(app, req, |b: TransferBody| {
                Ok(Operation::transfer(
                    AccountId(b.from_account_id),
                    AccountId(b.to_account_id),
                    AmountCents::new(b.amount_cents)?,
                )?)
            })
            .await
        }
    }
}

pub fn request_deadline(app: &App) -> Duration {
    app.config.write().deadline + REQUEST_DEADLINE_MARGIN
}

async fn readyz(app: &Arc<App>) -> Result<Resp, ApiError> {
    if app.is_shutting_down() {
        return Err(ApiError::Unavailable("shutting down".into()));
    }
    if !app.is_started() {
        return Err(ApiError::Unavailable(super::STARTING.into()));
    }
    match tokio::time::timeout(READY_PROBE_TIMEOUT, app.log.ping()).await {
        Ok(Ok(())) => Ok(json_response(StatusCode::OK, &json!({"status": "ready"}))),
        Ok(Err(e)) => Err(ApiError::Unavailable(format!("store not reachable: {e}"))),
        Err(_) => Err(ApiError::Unavailable("store did not answer in time".into())),
    }
}

fn list_accounts(app: &App) -> Resp {
    let accounts: Vec<_> = app
        .demo_accounts()
        .into_iter()
        .map(|(id, name)| json!({"id": id.to_string(), "name": name}))
        .collect();
    json_response(StatusCode::OK, &json!({ "accounts": accounts }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AmountBody {
    amount_cents: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AccountTransferBody {
    to_account_id: Uuid,
    amount_cents: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TransferBody {
    from_account_id: Uuid,
    to_account_id: Uuid,
    amount_cents: i64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct BalanceBody {
    balance_cents: i64,
    aggregate_version: u64,
}

impl From<&LegResult> for BalanceBody {
    fn from(l: &LegResult) -> Self {
        Self {
            balance_cents: l.balance,
            aggregate_version: l.version,
        }
    }
}

/// A write: parse the key and body (changing nothing on bad input), run the write loop
/// detached from the connection (a client that disconnects must not cancel a store write
/// half-way; its outcome is recorded for the retry that follows), and answer with the
/// window and key headers.
async fn write<B, F>(app: &Arc<App>, req: Request<Incoming>, build: F) -> Result<Resp, ApiError>
where
    B: serde::de::DeserializeOwned,
    F: FnOnce(B) -> Result<Operation, ApiError>,
{
    let key = IdempotencyKey::from_headers(req.headers())?;
    tracing::Span::current().record("key_hash", key.short_hash().as_str());
    let body: B = read_json(req).await?;
    let op = build(body)?;
    if key.minted {
        app.metrics.idem_keys_minted.inc();
    }
    let writes = app.writes.clone();
    let request = WriteRequest {
        op,
        event_id: key.event_id.as_u128(),
    };
    let span = tracing::Span::current();
    let answer = tokio::spawn(async move { writes.execute(request).await }.instrument(span))
        .await
        .map_err(|e| ApiError::Internal {
            code: "INTERNAL",
            message: format!("the write task failed: {e}"),
        })?;
    let mut resp = match answer {
        Ok(outcome) => outcome_response(&outcome),
        Err(e) => ApiError::from(e).into_response(),
    };
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&key.echo) {
        h.insert(idempotency::HEADER, v);
    }
    h.insert(
        idempotency::WINDOW_HEADER,
        HeaderValue::from(app.config.idempotency_window),
    );
    Ok(resp)
}

fn outcome_response(outcome: &WriteOutcome) -> Resp {
    let mut resp = match outcome.legs.as_slice() {
        [from, to] => json_response(
            StatusCode::OK,
            &json!({ "from": BalanceBody::from(from), "to": BalanceBody::from(to) }),
        ),
        [one] => json_response(StatusCode::OK, &BalanceBody::from(one)),
        _ => {
            return ApiError::Internal {
                code: "INTERNAL",
                message: "a write produced no legs".into(),
            }
            .into_response();
        }
    };
    if outcome.replayed {
        resp.headers_mut().insert(
            idempotency::REPLAYED_HEADER,
            HeaderValue::from_static("true"),
        );
    }
    resp
}

/// Parses a query of non-negative integer parameters: percent-decoded, each named in
/// `allowed` (a typo never silently changes what is read), each at most once, each plain
/// decimal digits.
fn query_u64s(query: Option<&str>, allowed: &[&str]) -> Result<Vec<(String, u64)>, ApiError> {
    let bad = |message: String| ApiError::bad_request("BAD_QUERY", message);
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

async fn balance(
    app: &Arc<App>,
    account: AccountId,
    query: Option<&str>,
) -> Result<Resp, ApiError> {
    let min_version = query_u64s(query, &["minVersion"])?
        .into_iter()
        .map(|(_, v)| v)
        .next_back();
    // A read-your-writes read this replica can already satisfy needs no store round trip.
    if let Some(min) = min_version
        && let Some(slot) = app.projection.resident_slot(account)
    {
        let st = slot.state.lock();
        if st.warm && st.broken.is_none() && st.version >= min {
            let body = BalanceBody {
                balance_cents: st.balance,
                aggregate_version: st.version,
            };
            drop(st);
            return Ok(json_response(StatusCode::OK, &body));
        }
    }
    let mut attempt = 0;
    loop {
        let (_, snap) = app.projection.catch_up(account).await?;
        if min_version.is_none_or(|min| snap.version >= min) {
            return Ok(json_response(
                StatusCode::OK,
                &BalanceBody {
                    balance_cents: snap.balance,
                    aggregate_version: snap.version,
                },
            ));
        }
        attempt += 1;
        if attempt >= MIN_VERSION_ATTEMPTS {
            return Err(ApiError::Unavailable(format!(
                "this replica has not yet seen version {} of the account",
                min_version.unwrap_or(0)
            )));
        }
        tokio::time::sleep(MIN_VERSION_BACKOFF).await;
    }
}

async fn history(
    app: &Arc<App>,
    account: AccountId,
    query: Option<&str>,
) -> Result<Resp, ApiError> {
    let mut from_version = 1;
    let mut limit = DEFAULT_HISTORY_LIMIT;
    for (name, v) in query_u64s(query, &["fromVersion", "limit"])? {
        match name.as_str() {
            "fromVersion" => from_version = v.max(1),
            _ => {
                if v == 0 || v > MAX_HISTORY_LIMIT as u64 {
                    return Err(ApiError::bad_request(
                        "BAD_QUERY",
                        format!("limit must be 1..={MAX_HISTORY_LIMIT}"),
                    ));
                }
                limit = v as usize;
            }
        }
    }
    let key = app.identity.key(account);
    // The balance comes from the fold; a stream the fold cannot derive (trimmed) still has
    // a readable history, just no balance.
    let (balance, current) = match app.projection.catch_up(account).await {
        Ok((_, snap)) => (Some(snap.balance), snap.version),
        Err(crate::projection::ProjectionError::Store(e)) => return Err(e.into()),
        Err(_) => (
            None,
            app.log
                .details(key)
                .await
                .map(|d| d.max_version)
                .unwrap_or(0),
        ),
    };
    let mut first_available = None;
    let filter = |from| ReadFilter {
        from_version: from,
        // Every batch holds at least one event, so this bounds the read to one page's worth.
        to_version: Some(from.saturating_add(limit as u64 - 1)),
        ..ReadFilter::default()
    };
    let mut events = Vec::with_capacity(limit.min(DEFAULT_HISTORY_LIMIT));
    // The version after which the next page starts: the last batch returned, or the one
    // before where this page started.
    let mut last_version = from_version.saturating_sub(1);
    // The newest version any read showed (the fold's `current` may lag a read).
    let mut newest_read = 0;
    let mut stream = BatchStream::new(app.log.as_ref(), key, filter(from_version));
    'pages: loop {
        let page = match stream.next_page().await {
            Ok(Some(page)) => page,
            Ok(None) | Err(StoreError::AggregateNotFound) => break,
            Err(StoreError::Trimmed { min_available }) if first_available.is_none() => {
                first_available = Some(min_available);
                last_version = min_available - 1;
                stream = BatchStream::new(app.log.as_ref(), key, filter(min_available));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        for batch in &page {
            newest_read = newest_read.max(batch.version);
            // A page ends on a batch boundary (a version is the unit `fromVersion` names),
            // and holds at most `limit` events, unless one batch alone holds more.
            if !events.is_empty() && events.len() + batch.events.len() > limit {
                break 'pages;
            }
            for e in batch.events.iter() {
                let event = AccountEvent::decode(e.event_type, &e.payload).map_err(|err| {
                    ApiError::Internal {
                        code: "ACCOUNT_UNREADABLE",
                        message: format!(
                            "account {account} is unreadable at version {}: {err}",
                            batch.version
                        ),
                    }
                })?;
                events.push(history_event(
                    batch.version,
                    batch.server_timestamp_ms,
                    e.event_id,
                    &event,
                ));
            }
            last_version = batch.version;
            if events.len() >= limit {
                break 'pages;
            }
        }
    }
    let current = current.max(newest_read);
    let mut body = json!({
        "events": events,
        "currentAggregateVersion": current,
        "balanceCents": balance,
    });
    // More exists: a full page, or a read that came back short of the version the fold has
    // (a lagging read). A client that follows `nextFromVersion` gets all of it, and every
    // page moves it forward: a read that showed nothing at all where the fold has events
    // is a retryable 503, never an empty page pointing at itself.
    if last_version < current {
        if events.is_empty() {
            return Err(ApiError::Unavailable(format!(
                "the store's read shows nothing from version {from_version}, but the account is at {current}; retry"
            )));
        }
        body["nextFromVersion"] = json!(last_version + 1);
    }
    if let Some(v) = first_available {
        body["firstAvailableVersion"] = json!(v);
    }
    Ok(json_response(StatusCode::OK, &body))
}

fn history_event(
    version: u64,
    ts: u64,
    event_id: Option<u128>,
    e: &AccountEvent,
) -> serde_json::Value {
    let mut v = json!({
        "aggregateVersion": version,
        "timestamp": ts,
        "type": e.name(),
        "amountCents": e.amount(),
    });
    match e {
        AccountEvent::TransferredOut { to, .. } => v["toAccountId"] = json!(to.to_string()),
        AccountEvent::TransferredIn { from, .. } => v["fromAccountId"] = json!(from.to_string()),
        _ => {}
    }
    if let Some(id) = event_id {
        v["eventId"] = json!(Uuid::from_u128(id).to_string());
    }
    v
}

/// Wraps a handler's result as a response.
pub fn finish(result: Result<Resp, ApiError>) -> Response<Full<Bytes>> {
    result.unwrap_or_else(ApiError::into_response)
}

/// A coarse, bounded method label for metrics.
pub fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        _ => "OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_resolve_by_path_then_method() {
        let id = Uuid::new_v4();
        let p = format!("/api/accounts/{id}/deposit");
        assert_eq!(
            Route::resolve(&Method::POST, &p),
            Ok(Route::Deposit(AccountId(id)))
        );
        assert_eq!(
            Route::resolve(&Method::GET, &p),
            Err(ApiError::MethodNotAllowed { allow: "POST" })
        );
        assert!(matches!(
            Route::resolve(&Method::POST, "/api/accounts/nope/deposit"),
            Err(ApiError::BadRequest {
                code: "INVALID_ID",
                ..
            })
        ));
        assert!(matches!(
            Route::resolve(&Method::GET, "/api/nothing"),
            Err(ApiError::NotFound { .. })
        ));
        assert_eq!(Route::resolve(&Method::GET, "/healthz"), Ok(Route::Healthz));
    }

    #[test]
    fn unknown_query_parameters_are_refused() {
        assert!(query_u64s(Some("minVersion=3"), &["minVersion"]).is_ok());
        assert!(query_u64s(Some("minversion=3"), &["minVersion"]).is_err());
        assert!(query_u64s(Some("minVersion=-1"), &["minVersion"]).is_err());
    }
}
