//! The edge check: with `--auth jwt`, every API route needs a bearer token whose
//! scopes cover the route and whose accounts cover the account it names, and each caller is
//! paced. Runs before the body is read and before anything is written: a refused request
//! changes nothing. Probes, `/metrics` and `/openapi.json` stay open.
//!
//! Which scope a route needs:
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

use hyper::HeaderMap;
use hyper::header::AUTHORIZATION;
use uuid::Uuid;

use super::error::ApiError;
use super::router::Route;
use crate::account::{AccountId, Operation};
use crate::app::App;
use crate::auth::{AuthError, Caller, Scope};
use crate::metrics::{auth_outcome, rate_outcome};

/// The scope a route needs; `None` for the open routes. Every route decides here (the match
/// is exhaustive, so a new route cannot be added without deciding).
pub fn required_scope(route: &Route) -> Option<Scope> {
    match route {
        // The console is a static page: the data it shows comes from API routes that check.
        Route::Healthz | Route::Readyz | Route::Metrics | Route::OpenApi | Route::Console => None,
        Route::Accounts
        | Route::Balance(_)
        | Route::History(_)
        | Route::AccountEvents(_)
        | Route::WatchStream => Some(Scope::AccountsRead),
        Route::Deposit(_)
        | Route::Withdraw(_)
        | Route::AccountTransfer(_)
        | Route::Transfers
        | Route::OpenAccount => Some(Scope::AccountsWrite),
        Route::DeviceSync(_) => Some(Scope::DevicesSync),
    }
}

/// The account a route names in its path, if any.
fn path_account(route: &Route) -> Option<AccountId> {
    match *route {
        Route::Balance(a)
        | Route::History(a)
        | Route::AccountEvents(a)
        | Route::Deposit(a)
        | Route::Withdraw(a)
        | Route::AccountTransfer(a) => Some(a),
        _ => None,
    }
}

/// Authenticates and authorizes a request from its head; paces its caller. `Ok(None)` when
/// authentication is off or the route is open.
pub fn check(app: &App, route: &Route, headers: &HeaderMap) -> Result<Option<Caller>, ApiError> {
    if !app.auth.is_on() {
        return Ok(None);
    }
    let Some(scope) = required_scope(route) else {
        return Ok(None);
    };
    let m = &app.metrics;
    let refuse = |outcome: &str, e: AuthError| {
        m.auth_outcomes.with_label_values(&[outcome]).inc();
        Err(ApiError::from(e))
    };
    let Ok(value) = super::at_most_one(headers, AUTHORIZATION) else {
        return refuse(
            auth_outcome::INVALID,
            AuthError::Invalid("send one Authorization header"),
        );
    };
    let caller = match app.auth.verify(value.map(|v| v.as_bytes())) {
        Ok(caller) => caller,
        Err(e @ AuthError::Missing) => return refuse(auth_outcome::MISSING, e),
        Err(e) => return refuse(auth_outcome::INVALID, e),
    };
    if !caller.has(scope) {
        return refuse(auth_outcome::FORBIDDEN, AuthError::Scope(scope));
    }
    if let Some(account) = path_account(route)
        && !caller.may_touch(account.0)
    {
        return refuse(auth_outcome::FORBIDDEN, AuthError::Resource("account"));
    }
    // The fleet-wide stream names every account's writes: only for a caller limited to none.
    if *route == Route::WatchStream && !caller.may_touch_all() {
        return refuse(auth_outcome::FORBIDDEN, AuthError::Resource("account"));
    }
    if let Route::DeviceSync(device) = route
        && Uuid::try_parse(&caller.id).ok() != Some(*device)
    {
        return refuse(auth_outcome::FORBIDDEN, AuthError::Resource("device"));
    }
    m.auth_outcomes.with_label_values(&[auth_outcome::OK]).inc();
    if let Err(wait) = app.auth.admit(&caller) {
        m.rate_limit_decisions
            .with_label_values(&[rate_outcome::LIMITED])
            .inc();
        // Whole seconds, rounded up: a client retrying at once would be refused again.
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        return Err(ApiError::RateLimited {
            retry_after_secs: secs.max(1),
        });
    }
    m.rate_limit_decisions
        .with_label_values(&[rate_outcome::ALLOWED])
        .inc();
    Ok(Some(caller))
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
    let account = match op {
        Operation::Deposit { account, .. }
        | Operation::Withdraw { account, .. }
        | Operation::Open { account } => account,
        Operation::Transfer { from, .. } => from,
    };
    authorize_account(app, caller, account.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_route_needs_a_scope_and_probes_stay_open() {
        for route in Route::ALL {
            assert_eq!(
                required_scope(&route).is_none(),
                !route.is_api(),
                "{route:?}: a route outside the API is open, every API route needs a scope"
            );
        }
    }
}
