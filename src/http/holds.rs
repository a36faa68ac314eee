//! The hold routes (`--holds true`): place a hold, post or void it, read one or an
//! account's open holds. Each write runs through the write loop under its key, as every
//! write does; a post first reads the hold, since what it moves and where is the hold's.

use std::num::NonZeroU32;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, StatusCode};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::admission::RequestSlots;
use super::answer::Shown;
use super::error::{ApiError, ErrorCode};
use super::response::{Resp, json_response};
use super::writes::{KeyedHead, answer_keyed, keyed_answer, parse_keyed, to_account_id};
use crate::account::holds::{Due, HoldId, MAX_HOLD_EXPIRY_SECS, OpenHold, Resolution};
use crate::account::{AccountId, AmountCents, Operation, RuleError};
use crate::app::App;
use crate::projection::HoldView;
use crate::write_loop::{Found, WriteError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PlaceBody {
    #[serde(deserialize_with = "crate::account::deserialize_amount_cents")]
    amount_cents: i64,
    #[serde(default, deserialize_with = "some_to_account_id")]
    to_account_id: Option<Uuid>,
    #[serde(default)]
    expires_in_secs: Option<u64>,
}

fn some_to_account_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Uuid>, D::Error> {
    to_account_id(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PostBody {
    #[serde(default, deserialize_with = "some_amount_cents")]
    amount_cents: Option<i64>,
}

fn some_amount_cents<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    crate::account::deserialize_amount_cents(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VoidBody {}

/// Hold routes answer 503 `HOLDS_OFF` on a replica with holds off, as an account with holds
/// does there: a replica with holds on may serve it.
fn holds_on(app: &App) -> Result<(), ApiError> {
    if app.config.holds {
        return Ok(());
    }
    Err(ApiError::RetryLater {
        code: ErrorCode::HoldsOff,
        message: "holds are off on this replica (--holds false)".into(),
    })
}

/// `POST /api/accounts/{id}/holds`: 201 with the hold; its id is the request's key's.
pub async fn place(
    app: &Arc<App>,
    account: AccountId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    holds_on(app)?;
    let keyed = parse_keyed::<PlaceBody>(app, req, slots).await?;
    let b = keyed.body;
    let to = b.to_account_id.map(AccountId);
    if to == Some(account) {
        return Err(RuleError::Validation(
            "toAccountId must be another account than the held one".into(),
        )
        .into());
    }
    let expires_in_secs = match b.expires_in_secs {
        None => None,
        Some(secs) => Some(expiry(secs)?),
    };
    let op = Operation::PlaceHold {
        account,
        hold: HoldId(keyed.head.key.event_id),
        amount: AmountCents::new(b.amount_cents)?,
        to,
        expires_in_secs,
    };
    answer_keyed(app, keyed.head, op).await
}

fn expiry(secs: u64) -> Result<NonZeroU32, ApiError> {
    u32::try_from(secs)
        .ok()
        .filter(|s| *s <= MAX_HOLD_EXPIRY_SECS)
        .and_then(NonZeroU32::new)
        .ok_or_else(|| {
            RuleError::Validation(format!(
                "expiresInSecs must be an integer from 1 to {MAX_HOLD_EXPIRY_SECS}, got {secs}"
            ))
            .into()
        })
}

/// `POST /api/accounts/{id}/holds/{holdId}/post`: posts the amount given, or the whole
/// hold; the rest is released. A hold with a destination moves the money there, both legs
/// in one write.
pub async fn post(
    app: &Arc<App>,
    account: AccountId,
    hold: HoldId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    let keyed = parse_resolution::<PostBody>(app, account, req, slots).await?;
    let asked = keyed.body.amount_cents.map(AmountCents::new).transpose()?;
    let Some(was) = placed_hold(app, account, hold).await? else {
        return Ok(unknown_hold(app, account, hold, keyed.head).await);
    };
    let op = Operation::PostHold {
        account,
        hold,
        amount: match asked {
            Some(amount) => amount,
            None => AmountCents::new(was.amount)?,
        },
        to: was.to,
    };
    answer_keyed(app, keyed.head, op).await
}

/// `POST /api/accounts/{id}/holds/{holdId}/void`: releases the hold.
pub async fn void(
    app: &Arc<App>,
    account: AccountId,
    hold: HoldId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    let keyed = parse_resolution::<VoidBody>(app, account, req, slots).await?;
    // A due hold expires first: a void never lands after its hold's expiry is known here.
    placed_hold(app, account, hold).await?;
    answer_keyed(app, keyed.head, Operation::VoidHold { account, hold }).await
}

/// A post's or a void's key and body, once the caller may write the account: checked before
/// the hold is read, since reading it may write its expiry.
async fn parse_resolution<B: serde::de::DeserializeOwned>(
    app: &Arc<App>,
    account: AccountId,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<super::writes::Keyed<B>, ApiError> {
    holds_on(app)?;
    let keyed = parse_keyed::<B>(app, req, slots).await?;
    super::auth::authorize_account(app, keyed.head.caller.as_ref(), account.0)?;
    Ok(keyed)
}

/// The hold as placed, open or resolved: from this replica's copy of the account when it
/// knows the hold (what a hold moves and where never changes, and the write loop decides on
/// current state anyway), else from the account caught up. When it is open and due in
/// server time, its expiry is written first: a post or void never lands after an expiry
/// this replica can prove. `None` when the account's fold knows no such hold.
async fn placed_hold(
    app: &Arc<App>,
    account: AccountId,
    hold: HoldId,
) -> Result<Option<OpenHold>, ApiError> {
    let projection = &app.projection;
    let known = match projection.current(account, &[]).await? {
        Some(copy) => projection.hold_view(&copy.view, hold),
        None => None,
    };
    let view = match known {
        Some(view) => Some(view),
        None => {
            let loaded = projection.refresh(account, &[]).await?;
            projection.hold_view(&loaded.view, hold)
        }
    };
    if let Some(HoldView::Open(open)) = view
        && open.due(projection.server_tip_ms()) != Due::No
    {
        app.writes.expire_due(account).await?;
    }
    Ok(match view {
        Some(HoldView::Open(open)) => Some(open),
        Some(HoldView::Resolved(r)) => Some(r.was),
        None => None,
    })
}

/// A post of a hold the account does not know: the original answer when a write under this
/// key landed (a retry after the hold was forgotten), else 404 `HOLD_NOT_FOUND`; with the key
/// and window headers, as every keyed write's answer.
async fn unknown_hold(app: &Arc<App>, account: AccountId, hold: HoldId, head: KeyedHead) -> Resp {
    // What a refusal shows is its error alone; a landed post shows itself.
    let mut shown = Shown::HoldResolved {
        hold,
        how: Resolution::Posted,
        amount: 0,
    };
    let answer = match app
        .writes
        .find_write(account, head.key.event_id.as_u128())
        .await
    {
        Ok(Found::Landed { op, outcome }) => match op {
            Operation::PostHold { hold: h, .. } if h == hold => {
                shown = Shown::to(head.caller.as_ref(), &op);
                Ok(outcome)
            }
            _ => Err(WriteError::KeyReused),
        },
        Ok(Found::NotLanded) => Err(WriteError::Rule(RuleError::HoldNotFound { hold })),
        Err(e) => Err(e),
    };
    let since = head.started.elapsed();
    let horizon = app.projection.key_horizon(&[account]);
    keyed_answer(app, &head.key, answer, shown, (since, horizon))
}

/// `GET /api/accounts/{id}/holds/{holdId}`
pub async fn get(app: &Arc<App>, account: AccountId, hold: HoldId) -> Result<Resp, ApiError> {
    holds_on(app)?;
    let loaded = app.projection.refresh(account, &[]).await?;
    app.projection
        .learn_placement_commits(account, &loaded.view, Some(hold))
        .await?;
    let body = match app.projection.hold_view(&loaded.view, hold) {
        Some(HoldView::Open(open)) => hold_body(account, hold, &open, "open"),
        Some(HoldView::Resolved(r)) => {
            let mut body = hold_body(account, hold, &r.was, r.how.name());
            if r.posted > 0 {
                body["postedCents"] = json!(r.posted);
            }
            body
        }
        None => return Err(RuleError::HoldNotFound { hold }.into()),
    };
    Ok(json_response(StatusCode::OK, &body))
}

/// `GET /api/accounts/{id}/holds`: the open holds, in id order.
pub async fn list(app: &Arc<App>, account: AccountId) -> Result<Resp, ApiError> {
    holds_on(app)?;
    let loaded = app.projection.refresh(account, &[]).await?;
    app.projection
        .learn_placement_commits(account, &loaded.view, None)
        .await?;
    let Some((snap, open)) = app.projection.open_holds(&loaded.view) else {
        return Err(ApiError::Internal {
            code: ErrorCode::Internal,
            message: "holds need the memory projection".into(),
        });
    };
    let holds: Vec<_> = open
        .iter()
        .map(|(id, h)| hold_body(account, *id, h, "open"))
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "accountId": account.to_string(),
            "holds": holds,
            "heldCents": snap.held,
            "balanceCents": snap.balance,
            "availableCents": snap.balance.saturating_sub(snap.held),
            "aggregateVersion": snap.version,
        }),
    ))
}

fn hold_body(account: AccountId, hold: HoldId, h: &OpenHold, status: &str) -> serde_json::Value {
    let mut body = json!({
        "holdId": hold.to_string(),
        "accountId": account.to_string(),
        "status": status,
        "amountCents": h.amount,
        "placedVersion": h.placed_version,
    });
    if let Some(to) = h.to {
        body["toAccountId"] = json!(to.to_string());
    }
    if let Some(secs) = h.expires_in_secs {
        body["expiresInSecs"] = json!(secs.get());
    }
    if let Some(at) = h.expires_at_ms() {
        body["expiresAt"] = json!(at);
    }
    body
}
