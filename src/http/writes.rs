//! The write routes: open, deposit, withdraw and transfers. Each parses the key and the body
//! (changing nothing on bad input), builds one [`Operation`] and runs it through the write
//! loop.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;
use uuid::Uuid;

use super::admission::RequestSlots;
use super::answer::{Shown, outcome_response};
use super::body::read_json;
use super::deadline::{request_deadline, took_too_long};
use super::detach::{Detached, WritePanicked};
use super::error::ApiError;
use super::idempotency::{self, IdempotencyKey};
use super::response::Resp;
use crate::account::{AccountId, AmountCents, Operation};
use crate::app::App;
use crate::auth::Caller;
use crate::request_note::RequestNote;
use crate::write_loop::{AnsweringAttempt, WriteError, WriteOutcome, WriteRequest};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct OpenBody {
    #[serde(default, deserialize_with = "named_uuid")]
    account_id: Option<Uuid>,
}

/// `accountId` may be left out (the id is then derived from the key), but a `null` is no
/// UUID: taking it as "left out" would open an account the caller did not name.
fn named_uuid<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Uuid>, D::Error> {
    account_id_field(d, "accountId").map(Some)
}

pub(super) fn to_account_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Uuid, D::Error> {
    account_id_field(d, "toAccountId")
}

pub(super) fn from_account_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Uuid, D::Error> {
    account_id_field(d, "fromAccountId")
}

/// Reads an account id field, refused in the API's words: the field's name and what was
/// sent. The derived reading answers in the uuid crate's words (`UUID parsing failed:
/// invalid character ...`), which name neither the field nor what it takes.
pub(super) fn account_id_field<'de, D: serde::Deserializer<'de>>(
    d: D,
    field: &str,
) -> Result<Uuid, D::Error> {
    use serde::de::Error;
    let value = serde_json::Value::deserialize(d)?;
    value
        .as_str()
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or_else(|| {
            D::Error::custom(format!(
                "{field} must be an account id (a UUID), got {}",
                crate::account::json_shown(&value)
            ))
        })
}

/// The namespace an opened account's id is derived in from the request's event id, when the
/// body names none: the same key (and caller) names the same account on every replica, so a
/// retry opens, and is answered for, the account its first attempt opened. Never change it:
/// a retry across the change would open a second account.
pub const OPENED_ACCOUNT_NAMESPACE: Uuid =
    Uuid::from_u128(0x6f70_656e_2d61_4c63_8c6f_756e_7449_6430);

/// The id an open without `accountId` gives its account: UUIDv5 of the event id.
pub fn derived_account_id(event_id: Uuid) -> AccountId {
    AccountId(Uuid::new_v5(&OPENED_ACCOUNT_NAMESPACE, event_id.as_bytes()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AmountBody {
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    amount_cents: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AccountTransferBody {
    #[serde(deserialize_with = "to_account_id")]
    to_account_id: Uuid,
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    amount_cents: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TransferBody {
    #[serde(deserialize_with = "from_account_id")]
    from_account_id: Uuid,
    #[serde(deserialize_with = "to_account_id")]
    to_account_id: Uuid,
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    amount_cents: i64,
}

/// `POST /api/accounts`: opens the account the body names, or one whose id is derived from
/// the request's key. `201` with the account; a retry under the same key replays it.
pub async fn open_account(
    app: &Arc<App>,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    write(app, req, slots, |b: OpenBody, event_id| {
        Ok(Operation::Open {
            account: b
                .account_id
                .map_or_else(|| derived_account_id(event_id), AccountId),
        })
    })
    .await
}

/// `POST /api/accounts/{id}/deposit`
pub async fn deposit(
    app: &Arc<App>,
    account: AccountId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    write(app, req, slots, move |b: AmountBody, _| {
        Ok(Operation::Deposit {
            account,
            amount: AmountCents::new(b.amount_cents)?,
        })
    })
    .await
}

/// `POST /api/accounts/{id}/withdraw`
pub async fn withdraw(
    app: &Arc<App>,
    account: AccountId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    write(app, req, slots, move |b: AmountBody, _| {
        Ok(Operation::Withdraw {
            account,
            amount: AmountCents::new(b.amount_cents)?,
        })
    })
    .await
}

/// `POST /api/accounts/{id}/transfers`: a transfer from the account in the path.
pub async fn account_transfer(
    app: &Arc<App>,
    from: AccountId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    write(app, req, slots, move |b: AccountTransferBody, _| {
        Ok(Operation::transfer(
            from,
            AccountId(b.to_account_id),
            AmountCents::new(b.amount_cents)?,
        )?)
    })
    .await
}

/// `POST /api/transfers`
pub async fn transfer(
    app: &Arc<App>,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    write(app, req, slots, |b: TransferBody, _| {
        Ok(Operation::transfer(
            AccountId(b.from_account_id),
            AccountId(b.to_account_id),
            AmountCents::new(b.amount_cents)?,
        )?)
    })
    .await
}

/// The `Idempotency-Window` of an answer: the window in seconds on a 2xx or a rule's refusal
/// (`rule_refusal`: a 422, or with explicit accounts a 404 or 409 of its own code).
/// Any other answer may be told to retry long after what was written under the key landed
/// (else a retry 89.7 s after a 409 that said 90 would write again): there it is how
/// long from now a retry can be sent and still find that landing, rounded down. `since` is
/// how long ago the landing can have been: since this attempt arrived, or, for a duplicate
/// coalesced onto one already running, since that one did, whether or not it answered in
/// time ([`AnsweringAttempt`]; a fixed write's life for it would take that life
/// off every answer, and fall short of a first attempt that ran on past it). `lookup`
/// is how long after it is sent a retry may still look for it
/// ([`crate::config::Config::retry_lookup_room`]; else a retry sent inside the
/// stated time would look only after its own catch-up, and find the entry expired).
fn window_header(
    status: StatusCode,
    rule_refusal: bool,
    window_secs: u64,
    since: std::time::Duration,
    lookup: std::time::Duration,
) -> u64 {
    if status.is_success() || status == StatusCode::UNPROCESSABLE_ENTITY || rule_refusal {
        return window_secs;
    }
    let gone_ms = u64::try_from((since + lookup).as_millis()).unwrap_or(u64::MAX);
    window_secs.saturating_mul(1000).saturating_sub(gone_ms) / 1000
}

/// A write: parse the key and body (changing nothing on bad input), run the write loop so
/// that it outlives the connection if it must ([`Detached`]: a client that disconnects must
/// not cancel a store write half-way; its outcome is recorded for the retry that follows),
/// and answer with the window and key headers.
async fn write<B, F>(
    app: &Arc<App>,
    req: Request<Incoming>,
    slots: &RequestSlots,
    build: F,
) -> Result<Resp, ApiError>
where
    B: DeserializeOwned,
    F: FnOnce(B, Uuid) -> Result<Operation, ApiError>,
{
    let keyed = parse_keyed(app, req, slots).await?;
    let op = build(keyed.body, keyed.head.key.event_id)?;
    answer_keyed(app, keyed.head, op).await
}

/// A keyed write's request, read: its key and caller, when it began, and its body.
pub(super) struct Keyed<B> {
    pub(super) head: KeyedHead,
    pub(super) body: B,
}

/// What a keyed write's answer needs of its request.
pub(super) struct KeyedHead {
    pub(super) key: IdempotencyKey,
    pub(super) caller: Option<Caller>,
    /// Before anything of this attempt can land: what it writes is remembered from its
    /// landing, so at least from here.
    pub(super) started: std::time::Instant,
}

/// The write's key and body, from the request's headers and body (changing nothing on bad
/// input). With authentication on, keys belong to their caller.
pub(super) async fn parse_keyed<B: DeserializeOwned>(
    app: &Arc<App>,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Keyed<B>, ApiError> {
    let started = std::time::Instant::now();
    let caller = req.extensions().get::<Caller>().cloned();
    let key = IdempotencyKey::from_headers(req.headers(), caller.as_ref().map(|c| c.id.as_str()))?;
    RequestNote::key_hash(|| key.short_hash());
    // The body read is bounded as any request is; the write is bounded below.
    let body: B = tokio::time::timeout(request_deadline(app), read_json(req, slots))
        .await
        .map_err(|_| took_too_long())??;
    Ok(Keyed {
        head: KeyedHead {
            key,
            caller,
            started,
        },
        body,
    })
}

/// Runs `op` under the request's key and answers it with the window and key headers. A body
/// account (the source of `/api/transfers`) is checked before anything is written.
pub(super) async fn answer_keyed(
    app: &Arc<App>,
    head: KeyedHead,
    op: Operation,
) -> Result<Resp, ApiError> {
    let KeyedHead {
        key,
        caller,
        started,
    } = head;
    super::auth::authorize_operation(app, caller.as_ref(), &op)?;
    refuse_if_stood_still(app)?;
    if app.config.holds {
        // Whichever replica next writes an account expires its due holds first.
        for leg in op.legs().as_slice() {
            app.writes.expire_before_write(leg.account).await;
        }
    }
    if key.minted {
        app.metrics.idem_keys_minted.inc();
    }
    let attempt = Arc::new(AnsweringAttempt::default());
    let request = WriteRequest {
        op,
        event_id: key.event_id.as_u128(),
    };
    let answer = run_write(app, request, &attempt, Admission::Single).await;
    // How long ago what this answer speaks for can have landed: since this request began,
    // or since the attempt it waits on arrived, known even when that one has not answered.
    let since = attempt
        .arrived()
        .map_or(Duration::ZERO, |a| a.elapsed())
        .max(started.elapsed());
    let shown = Shown::to(caller.as_ref(), &op);
    let accounts: Vec<_> = op.legs().as_slice().iter().map(|l| l.account).collect();
    let horizon = app.projection.key_horizon(&accounts);
    Ok(keyed_answer(app, &key, answer, shown, (since, horizon)))
}

/// Read just after the replica stood still, the request may have waited unread through the
/// stall, longer than a write may live (`stall.rs`): nothing is decided on it.
pub(super) fn refuse_if_stood_still(app: &App) -> Result<(), ApiError> {
    let Some(stalled_ms) = app.stall.fenced() else {
        return Ok(());
    };
    app.metrics
        .write_refused
        .with_label_values(&[crate::metrics::refused::STALL])
        .inc();
    Err(ApiError::Unavailable(format!(
        "this replica stood still for {stalled_ms} ms (stopped or frozen), so this write may have waited unread; nothing was written: retry it"
    )))
}

/// How a write gets onto the write side.
#[derive(Clone, Copy, Debug)]
pub(super) enum Admission {
    /// A request of its own: a live-write permit now, or a refusal.
    Single,
    /// A batch's item: it may wait this long for its batch share first.
    BatchItem { wait: Duration },
}

/// Runs the write loop within the request's deadline. The loop stops trying at its deadline,
/// but a store call under way then runs to its own timeout: past this backstop the answer is
/// "not known yet", and the write goes on, detached, to record the outcome for the retry. A
/// batch item's backstop is later by the wait for its share: its write's deadline starts
/// after it.
pub(super) async fn run_write(
    app: &Arc<App>,
    request: WriteRequest,
    attempt: &Arc<AnsweringAttempt>,
    admission: Admission,
) -> Result<WriteOutcome, WriteError> {
    let writes = app.writes.clone();
    let (span, note) = (
        tracing::Span::current(),
        RequestNote::current().unwrap_or_default(),
    );
    let write = Detached::new({
        let attempt = attempt.clone();
        note.scope(async move {
            match admission {
                Admission::Single => writes.execute_tracked(request, &attempt).await,
                Admission::BatchItem { wait } => {
                    writes.execute_batch_item(request, &attempt, wait).await
                }
            }
        })
        .instrument(span)
    });
    let backstop = match admission {
        Admission::Single => request_deadline(app),
        Admission::BatchItem { wait } => request_deadline(app) + wait,
    };
    match tokio::time::timeout(backstop, write).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(WritePanicked)) => Err(WriteError::Invariant {
            what: "the write panicked".into(),
        }),
        Err(_) => {
            app.metrics.write_answer_timeouts.inc();
            Err(WriteError::Unverifiable {
                reason: "no answer within the request's deadline; the write may still land".into(),
            })
        }
    }
}

/// The write's answer with its key echoed and the window its client may still retry in.
pub(super) fn keyed_answer(
    app: &App,
    key: &IdempotencyKey,
    answer: Result<WriteOutcome, WriteError>,
    shown: Shown,
    (since, horizon): (Duration, Duration),
) -> Resp {
    let horizon_secs = horizon.as_secs();
    let rule_refusal = matches!(answer, Err(WriteError::Rule(_)));
    let mut resp = match answer {
        Ok(outcome) => outcome_response(&outcome, shown),
        Err(e) => ApiError::from(e).into_response(),
    };
    let (status, lookup) = (resp.status(), app.config.retry_lookup_room());
    let window = window_header(
        status,
        rule_refusal,
        app.config.idempotency_window,
        since,
        lookup,
    );
    // The retention follows the window's rule, from the horizon the written accounts keep
    // now: a cap that made an account forget sooner is stated, never hidden.
    let retention = window_header(status, rule_refusal, horizon_secs, since, lookup);
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&key.echo) {
        h.insert(idempotency::KEY_NAME, v);
    }
    h.insert(idempotency::WINDOW_NAME, HeaderValue::from(window));
    h.insert(idempotency::RETENTION_NAME, HeaderValue::from(retention));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retryable_answer_states_what_is_left_of_the_window_and_others_the_window() {
        let (since, lookup) = (Duration::from_millis(15_300), Duration::from_millis(7_750));
        let w = |status| window_header(status, false, 90, since, lookup);
        assert_eq!(w(StatusCode::CONFLICT), 66);
        assert_eq!(w(StatusCode::SERVICE_UNAVAILABLE), 66);
        assert_eq!(w(StatusCode::INTERNAL_SERVER_ERROR), 66);
        assert_eq!(w(StatusCode::OK), 90);
        assert_eq!(w(StatusCode::UNPROCESSABLE_ENTITY), 90);
        let none_left = window_header(StatusCode::CONFLICT, false, 20, since, lookup);
        assert_eq!(none_left, 0);
        // A rule's refusal (an open of an existing account, a write to one never opened)
        // says how long a write under the key would be remembered, whatever its status.
        assert_eq!(
            window_header(StatusCode::CONFLICT, true, 90, since, lookup),
            90
        );
        assert_eq!(
            window_header(StatusCode::NOT_FOUND, true, 90, since, lookup),
            90
        );
    }
}
