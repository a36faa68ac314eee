//! A landed write's answer, built in one place: the write routes answer it (`writes.rs`), and
//! the key lookup hands it back as it was (`write_lookup.rs`). One builder, so the two cannot
//! drift apart.

use hyper::StatusCode;
use hyper::header::HeaderValue;
use serde::Serialize;
use serde_json::json;

use super::accounts::BalanceBody;
use super::error::{ApiError, ErrorCode};
use super::idempotency;
use super::response::{Resp, json_response};
use std::num::NonZeroU32;

use crate::account::holds::{HoldId, Resolution};
use crate::account::{AccountId, Operation};
use crate::auth::Caller;
use crate::write_loop::{LegResult, WriteOutcome};

impl From<&LegResult> for BalanceBody {
    fn from(l: &LegResult) -> Self {
        Self {
            balance_cents: l.balance,
            aggregate_version: l.version,
        }
    }
}

/// What a landed write's answer shows its caller. A transfer's destination is not the
/// caller's to read unless its token could read that balance: paying into an account is
/// allowed, learning its balance is not. Decided from the caller at each answer, so a
/// replay under the same key shows the same caller the same shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shown {
    /// An open: 201 with the account's id.
    Opened,
    /// Every leg's balance.
    EveryLeg,
    /// A transfer's source leg only: its caller may not read the destination.
    SourceLeg,
    /// A hold placed: 201 with the hold.
    HoldPlaced {
        hold: HoldId,
        amount: i64,
        to: Option<AccountId>,
        expires_in_secs: Option<NonZeroU32>,
    },
    /// A hold posted, voided or expired: the hold and the held account's balance.
    HoldResolved {
        hold: HoldId,
        how: Resolution,
        amount: i64,
    },
}

impl Shown {
    pub(super) fn to(caller: Option<&Caller>, op: &Operation) -> Shown {
        match op {
            Operation::Open { .. } => Shown::Opened,
            Operation::Transfer { to, .. } if caller.is_some_and(|c| !c.may_read(to.0)) => {
                Shown::SourceLeg
            }
            Operation::PlaceHold {
                hold,
                amount,
                to,
                expires_in_secs,
                ..
            } => Shown::HoldPlaced {
                hold: *hold,
                amount: amount.get(),
                to: *to,
                expires_in_secs: *expires_in_secs,
            },
            Operation::PostHold { hold, amount, .. } => Shown::HoldResolved {
                hold: *hold,
                how: Resolution::Posted,
                amount: amount.get(),
            },
            Operation::VoidHold { hold, .. } => Shown::HoldResolved {
                hold: *hold,
                how: Resolution::Voided,
                amount: 0,
            },
            Operation::ExpireHold { hold, .. } => Shown::HoldResolved {
                hold: *hold,
                how: Resolution::Expired,
                amount: 0,
            },
            _ => Shown::EveryLeg,
        }
    }
}

/// A landed write's body. A single leg is written field by field, in the struct's order;
/// the other shapes are JSON objects.
#[derive(Serialize)]
#[serde(untagged)]
pub(super) enum LandedBody {
    Leg(BalanceBody),
    Object(serde_json::Value),
}

/// A landed write's answer, before it is a response.
pub(super) struct Landed {
    pub(super) status: StatusCode,
    pub(super) body: LandedBody,
    /// Where an opened account's balance is read.
    pub(super) location: Option<String>,
}

/// A landed write's answer: 200 with the balance (each leg's for a transfer, or the source's
/// alone, [`Shown`]), or for an open 201 with the account's id and where its balance is read.
/// An outcome without legs is a bug, answered as one.
pub(super) fn landed(outcome: &WriteOutcome, shown: Shown) -> Result<Landed, ApiError> {
    let answer = |status, body| Landed {
        status,
        body,
        location: None,
    };
    if let Some(landed) = hold_answer(outcome, shown) {
        return Ok(landed);
    }
    Ok(match outcome.legs.as_slice() {
        [from, _] if shown == Shown::SourceLeg => answer(
            StatusCode::OK,
            LandedBody::Object(json!({ "from": BalanceBody::from(from) })),
        ),
        [from, to] => answer(
            StatusCode::OK,
            LandedBody::Object(
                json!({ "from": BalanceBody::from(from), "to": BalanceBody::from(to) }),
            ),
        ),
        [one] if shown == Shown::Opened => Landed {
            status: StatusCode::CREATED,
            body: LandedBody::Object(json!({
                "accountId": one.account.to_string(),
                "balanceCents": one.balance,
                "aggregateVersion": one.version,
            })),
            location: Some(format!("/api/accounts/{}/balance", one.account)),
        },
        [one] => answer(StatusCode::OK, LandedBody::Leg(BalanceBody::from(one))),
        _ => {
            return Err(ApiError::Internal {
                code: ErrorCode::Internal,
                message: "a write produced no legs".into(),
            });
        }
    })
}

/// A hold write's answer: its first leg is the held account's. `None` for any other write.
fn hold_answer(outcome: &WriteOutcome, shown: Shown) -> Option<Landed> {
    let leg = outcome.legs.first()?;
    let mut body = json!({
        "accountId": leg.account.to_string(),
        "balanceCents": leg.balance,
        "aggregateVersion": leg.version,
    });
    let (status, location) = match shown {
        Shown::HoldPlaced {
            hold,
            amount,
            to,
            expires_in_secs,
        } => {
            body["holdId"] = json!(hold.to_string());
            body["status"] = json!("open");
            body["amountCents"] = json!(amount);
            if let Some(to) = to {
                body["toAccountId"] = json!(to.to_string());
            }
            if let Some(secs) = expires_in_secs {
                body["expiresInSecs"] = json!(secs.get());
            }
            let at = format!("/api/accounts/{}/holds/{hold}", leg.account);
            (StatusCode::CREATED, Some(at))
        }
        Shown::HoldResolved { hold, how, amount } => {
            body["holdId"] = json!(hold.to_string());
            body["status"] = json!(how.name());
            if how == Resolution::Posted {
                body["amountCents"] = json!(amount);
            }
            (StatusCode::OK, None)
        }
        Shown::Opened | Shown::EveryLeg | Shown::SourceLeg => return None,
    };
    Some(Landed {
        status,
        body: LandedBody::Object(body),
        location,
    })
}

/// A landed write's answer as a response ([`landed`]), marked replayed when it is one.
pub(super) fn outcome_response(outcome: &WriteOutcome, shown: Shown) -> Resp {
    let answer = match landed(outcome, shown) {
        Ok(answer) => answer,
        Err(e) => return e.into_response(),
    };
    let mut resp = json_response(answer.status, &answer.body);
    if let Some(v) = answer.location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        resp.headers_mut().insert(hyper::header::LOCATION, v);
    }
    if outcome.replayed {
        resp.headers_mut()
            .insert(idempotency::REPLAYED_NAME, HeaderValue::from_static("true"));
    }
    resp
}
