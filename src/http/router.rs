//! Which route a request is: its template (the only path form used in metrics and logs),
//! its method, and the handler it goes to.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request};
use uuid::Uuid;

use super::body::Resp;
use super::error::ApiError;
use super::{accounts, console, devices, openapi, ops, writes};
use crate::account::AccountId;
use crate::app::App;

/// A matched route: its template and what it does.
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
    /// A device's run of offline events; the device id is parsed by the device layer.
    DeviceSync(Uuid),
    /// The API contract, `docs/openapi.json`.
    OpenApi,
    // Console and watch stream.
    Console,
    AccountEvents(AccountId),
    WatchStream,
    /// `POST /api/accounts`: opens an account.
    OpenAccount,
}

/// The nil id, for the listing below.
const NIL: AccountId = AccountId(Uuid::nil());

impl Route {
    /// Every route once (ids nil): what `docs/openapi.json` is checked against. A new route
    /// is added here and in [`Route::listed_at`] (whose exhaustive match fails to compile
    /// until it is), then to the spec.
    pub const ALL: [Route; 16] = [
        Route::Healthz,
        Route::Readyz,
        Route::Metrics,
        Route::Accounts,
        Route::Balance(NIL),
        Route::History(NIL),
        Route::Deposit(NIL),
        Route::Withdraw(NIL),
        Route::AccountTransfer(NIL),
        Route::Transfers,
        Route::DeviceSync(Uuid::nil()),
        Route::OpenApi,
        Route::Console,
        Route::AccountEvents(NIL),
        Route::WatchStream,
        Route::OpenAccount,
    ];

    /// The route's place in [`Route::ALL`].
    pub fn listed_at(&self) -> usize {
        match self {
            Route::Healthz => 0,
            Route::Readyz => 1,
            Route::Metrics => 2,
            Route::Accounts => 3,
            Route::Balance(_) => 4,
            Route::History(_) => 5,
            Route::Deposit(_) => 6,
            Route::Withdraw(_) => 7,
            Route::AccountTransfer(_) => 8,
            Route::Transfers => 9,
            Route::DeviceSync(_) => 10,
            Route::OpenApi => 11,
            Route::Console => 12,
            Route::AccountEvents(_) => 13,
            Route::WatchStream => 14,
            Route::OpenAccount => 15,
        }
    }

    /// The method the route is served on (GET routes answer HEAD too).
    pub fn method_str(&self) -> &'static str {
        if self.method() == Method::POST {
            "POST"
        } else {
            "GET"
        }
    }

    pub fn template(&self) -> &'static str {
        match self {
            Route::Healthz => "/healthz",
            Route::Readyz => "/readyz",
            Route::Metrics => "/metrics",
            Route::Accounts | Route::OpenAccount => "/api/accounts",
            Route::Balance(_) => "/api/accounts/{id}/balance",
            Route::History(_) => "/api/accounts/{id}/history",
            Route::Deposit(_) => "/api/accounts/{id}/deposit",
            Route::Withdraw(_) => "/api/accounts/{id}/withdraw",
            Route::AccountTransfer(_) => "/api/accounts/{id}/transfers",
            Route::Transfers => "/api/transfers",
            Route::DeviceSync(_) => "/api/devices/{id}/sync",
            Route::OpenApi => "/openapi.json",
            Route::Console => "/",
            Route::AccountEvents(_) => "/api/accounts/{id}/events",
            Route::WatchStream => "/api/watch/stream",
        }
    }

    fn method(&self) -> Method {
        match self {
            Route::Deposit(_)
            | Route::Withdraw(_)
            | Route::AccountTransfer(_)
            | Route::Transfers
            | Route::DeviceSync(_)
            | Route::OpenAccount => Method::POST,
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
        !matches!(
            self,
            Route::Healthz | Route::Readyz | Route::Metrics | Route::OpenApi | Route::Console
        )
    }

    /// The routes that run the write loop under an idempotency key.
    pub fn is_keyed_write(&self) -> bool {
        matches!(
            self,
            Route::Deposit(_)
                | Route::Withdraw(_)
                | Route::AccountTransfer(_)
                | Route::Transfers
                | Route::OpenAccount
        )
    }

    /// API routes without query parameters: a query on one is refused, never ignored.
    fn refuses_query(&self) -> bool {
        matches!(
            self,
            Route::Accounts
                | Route::OpenAccount
                | Route::Deposit(_)
                | Route::Withdraw(_)
                | Route::AccountTransfer(_)
                | Route::Transfers
                | Route::DeviceSync(_)
        )
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
            ["openapi.json"] => Route::OpenApi,
            // One path, two routes: the list (GET, HEAD) and the open (POST).
            ["api", "accounts"] if *method == Method::POST => Route::OpenAccount,
            ["api", "accounts"] => Route::Accounts,
            ["api", "transfers"] => Route::Transfers,
            [""] => Route::Console,
            ["api", "watch", "stream"] => Route::WatchStream,
            ["api", "devices", device, "sync"] => {
                // The method before the id, as for accounts: a wrong method is 405 either way.
                Route::DeviceSync(Uuid::nil()).check_method(method)?;
                Route::DeviceSync(device.parse().map_err(|_| {
                    ApiError::bad_request(
                        "INVALID_DEVICE_ID",
                        format!("{device:?} is not a valid device id (a UUID)"),
                    )
                })?)
            }
            ["api", "accounts", acct, action] => {
                let make: fn(AccountId) -> Route = match *action {
                    "balance" => Route::Balance,
                    "history" => Route::History,
                    "deposit" => Route::Deposit,
                    "withdraw" => Route::Withdraw,
                    "transfers" => Route::AccountTransfer,
                    "events" => Route::AccountEvents,
                    _ => return Err(not_found(path)),
                };
                // Resolve the method before the id, so a wrong method is 405 either way.
                make(AccountId(Uuid::nil())).check_method(method)?;
                return Ok(make(id(acct)?));
            }
            _ => return Err(not_found(path)),
        };
        route.check_method(method)?;
        Ok(route)
    }

    /// 405, naming the methods this route takes, unless it takes `method`.
    fn check_method(&self, method: &Method) -> Result<(), ApiError> {
        if !self.accepts(method) {
            return Err(ApiError::MethodNotAllowed {
                allow: self.method_name(),
                route: self.template(),
            });
        }
        Ok(())
    }

    fn method_name(&self) -> &'static str {
        if matches!(self, Route::Accounts | Route::OpenAccount) {
            "GET, HEAD, POST"
        } else if self.method() == Method::POST {
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

/// Runs the route's handler. Every handler returns `Result<Resp, ApiError>`; errors become
/// responses in one place ([`ApiError::into_response`]).
pub async fn dispatch(
    app: &Arc<App>,
    route: Route,
    req: Request<Incoming>,
) -> Result<Resp, ApiError> {
    let names_a_parameter = |q: &str| form_urlencoded::parse(q.as_bytes()).next().is_some();
    if route.refuses_query() && req.uri().query().is_some_and(names_a_parameter) {
        // A write never silently ignores a parameter it does not know (`?dryRun=true`
        // must not move money), as reads refuse theirs. A query of separators alone
        // (`?&`) names none, on a write as on a read (else 200 and 400).
        return Err(ApiError::bad_request(
            "BAD_QUERY",
            format!("{} takes no query parameters", route.template()),
        ));
    }
    match route {
        Route::Healthz => Ok(ops::healthz()),
        Route::Readyz => ops::readyz(app).await,
        Route::Metrics => Ok(ops::metrics(app)),
        Route::Accounts => Ok(accounts::list(app, req.extensions().get())),
        Route::OpenAccount => writes::open_account(app, req).await,
        Route::Balance(account) => accounts::balance(app, account, req.uri().query()).await,
        Route::History(account) => accounts::history(app, account, req.uri().query()).await,
        Route::Deposit(account) => writes::deposit(app, account, req).await,
        Route::Withdraw(account) => writes::withdraw(app, account, req).await,
        Route::AccountTransfer(from) => writes::account_transfer(app, from, req).await,
        Route::Transfers => writes::transfer(app, req).await,
        Route::DeviceSync(device) => devices::sync(app, device, req).await,
        Route::OpenApi => Ok(openapi::document()),
        Route::Console => Ok(console::page()),
        // `http::handle` serves the streams before it dispatches; reaching here is a bug.
        Route::AccountEvents(_) | Route::WatchStream => Err(ApiError::Internal {
            code: "STREAM_ROUTE",
            message: "an event-stream route reached the JSON dispatcher".into(),
        }),
    }
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
            Err(ApiError::MethodNotAllowed {
                allow: "POST",
                route: "/api/accounts/{id}/deposit"
            })
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
        assert_eq!(
            Route::resolve(&Method::POST, "/api/accounts"),
            Ok(Route::OpenAccount)
        );
        assert_eq!(
            Route::resolve(&Method::HEAD, "/api/accounts"),
            Ok(Route::Accounts)
        );
        assert_eq!(
            Route::resolve(&Method::PUT, "/api/accounts"),
            Err(ApiError::MethodNotAllowed {
                allow: "GET, HEAD, POST",
                route: "/api/accounts"
            })
        );
    }

    /// Rule: a wrong method is 405 whatever the id in the path, on every route with an id.
    #[test]
    fn a_wrong_method_is_405_before_a_bad_id_is_400() {
        for (method, path, allow, route) in [
            (
                Method::GET,
                "/api/accounts/nope/deposit",
                "POST",
                "/api/accounts/{id}/deposit",
            ),
            (
                Method::POST,
                "/api/accounts/nope/balance",
                "GET, HEAD",
                "/api/accounts/{id}/balance",
            ),
            (
                Method::GET,
                "/api/devices/nope/sync",
                "POST",
                "/api/devices/{id}/sync",
            ),
            (
                Method::DELETE,
                "/api/devices/nope/sync",
                "POST",
                "/api/devices/{id}/sync",
            ),
        ] {
            // Named with its route, which counts it (else under `unmatched`).
            assert_eq!(
                Route::resolve(&method, path),
                Err(ApiError::MethodNotAllowed { allow, route }),
                "{method} {path}"
            );
        }
        assert!(matches!(
            Route::resolve(&Method::POST, "/api/devices/nope/sync"),
            Err(ApiError::BadRequest {
                code: "INVALID_DEVICE_ID",
                ..
            })
        ));
    }

    #[test]
    fn every_route_is_listed_once_in_order() {
        for (i, route) in Route::ALL.iter().enumerate() {
            assert_eq!(route.listed_at(), i, "{route:?}");
        }
    }
}
