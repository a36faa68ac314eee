//! The edge check: with `--auth jwt`, every API route needs a bearer token whose
//! scopes cover the route and whose accounts cover the account it names, and each caller is
//! paced. Runs before the body is read and before anything is written: a refused request
//! changes nothing. Probes, `/metrics` and `/openapi.json` stay open. What each route asks
//! ([`Access`]) is the route's own (`Route::access`); this module checks it.
//!
//! The scopes:
//! - `accounts:read`: the account list, a balance, a history;
//! - `accounts:write`: open, deposit, withdraw, both transfer routes;
//! - `devices:sync`: a device's sync, and only for the device the token names (`sub` is the
//!   device id): a device proves it is that device, and cannot write another's run.
//!
//! A token that lists `accounts` may touch only those: the account in the path, the one an
//! open names (in its body, or derived from its key; checked once the body is read), the source
//! of a transfer (`/api/transfers` names it in the body: checked in `writes` once the body
//! is read, still before anything is written) and a device run's account. The destination
//! of a transfer is not checked: paying into an account is what a transfer is for.

use std::net::IpAddr;

use hyper::HeaderMap;
use hyper::header::AUTHORIZATION;
use uuid::Uuid;

use super::error::{ApiError, ErrorCode};
use super::headers::at_most_one;
use crate::account::{AccountId, Operation};
use crate::app::App;
use crate::auth::{AuthError, Caller, Scope};
use crate::metrics::{auth_outcome, rate_outcome};

/// What a route asks of its caller: a scope, and what it names that the token must cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub scope: Scope,
    pub names: Named,
}

/// What a route names in its path that a token limited to some accounts (or a device's
/// token) must cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    /// Nothing in the path (accounts a body names are checked once it is read).
    Nothing,
    /// The account in the path.
    Account(AccountId),
    /// Every account's writes (the fleet-wide stream): only for a caller limited to none.
    EveryAccount,
    /// A device: only the device the token names (its `sub`).
    Device(Uuid),
}

/// Authenticates and authorizes a request from its head; paces its caller, and counts a
/// failed authentication against its `peer` address. `Ok(None)` when authentication is off
/// or the route is open (`access` is `None`).
pub fn check(
    app: &App,
    access: Option<Access>,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
) -> Result<Option<Caller>, ApiError> {
    if !app.auth.is_on() {
        return Ok(None);
    }
    let Some(Access { scope, names }) = access else {
        return Ok(None);
    };
    let m = &app.metrics;
    let refuse = |outcome: &str, e: AuthError| {
        m.auth_outcomes.with_label_values(&[outcome]).inc();
        Err(ApiError::from(e))
    };
    // A missing or refused token counts against its peer: past the allowance the answer
    // is 429, so guessing at tokens is paced as a valid caller's requests are.
    let failed = |outcome: &str, e: AuthError| {
        if let Some(wait) = peer.and_then(|p| app.auth.note_failure(p).err()) {
            m.auth_outcomes
                .with_label_values(&[auth_outcome::PEER_LIMITED])
                .inc();
            return Err(ApiError::Limited {
                code: ErrorCode::TooManyAuthFailures,
                message: "too many requests without a valid token from this address; retry later"
                    .into(),
                retry_after_secs: whole_secs(wait),
            });
        }
        refuse(outcome, e)
    };
    let Ok(value) = at_most_one(headers, AUTHORIZATION) else {
        return failed(
            auth_outcome::INVALID,
            AuthError::Invalid("send one Authorization header"),
        );
    };
    let caller = match app.auth.verify(value.map(|v| v.as_bytes())) {
        Ok(caller) => caller,
        Err(e @ AuthError::Missing) => return failed(auth_outcome::MISSING, e),
        Err(e) => return failed(auth_outcome::INVALID, e),
    };
    if !caller.has(scope) {
        return refuse(auth_outcome::FORBIDDEN, AuthError::Scope(scope));
    }
    if let Some(resource) = uncovered(&caller, names) {
        return refuse(auth_outcome::FORBIDDEN, AuthError::Resource(resource));
    }
    m.auth_outcomes.with_label_values(&[auth_outcome::OK]).inc();
    if let Err(wait) = app.auth.admit(&caller) {
        m.rate_limit_decisions
            .with_label_values(&[rate_outcome::LIMITED])
            .inc();
        return Err(ApiError::RateLimited {
            retry_after_secs: whole_secs(wait),
        });
    }
    m.rate_limit_decisions
        .with_label_values(&[rate_outcome::ALLOWED])
        .inc();
    Ok(Some(caller))
}

/// A wait in whole seconds, rounded up and at least one: a client retrying at once would be
/// refused again.
fn whole_secs(wait: std::time::Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

/// What of `names` the caller's token does not cover, if anything.
fn uncovered(caller: &Caller, names: Named) -> Option<&'static str> {
    match names {
        Named::Nothing => None,
        Named::Account(account) => (!caller.may_touch(account.0)).then_some("account"),
        Named::EveryAccount => (!caller.may_touch_all()).then_some("account"),
        Named::Device(device) => {
            (Uuid::try_parse(&caller.id).ok() != Some(device)).then_some("device")
        }
    }
}

/// Whether the caller may touch this account (named in a body, once it is read).
pub fn authorize_account(
    app: &App,
    caller: Option<&Caller>,
    account: Uuid,
) -> Result<(), ApiError> {
    match caller {
        Some(c) if !c.may_touch(account) => {
            app.metrics
                .auth_outcomes
                .with_label_values(&[auth_outcome::FORBIDDEN])
                .inc();
            Err(AuthError::Resource("account").into())
        }
        _ => Ok(()),
    }
}

/// Whether the caller may make this write: the account it deposits into or takes money
/// from.
pub fn authorize_operation(
    app: &App,
    caller: Option<&Caller>,
    op: &Operation,
) -> Result<(), ApiError> {
    authorize_account(app, caller, op.account().0)
}
