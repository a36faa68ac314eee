//! Which route a request is: its template (the only path form used in metrics and logs),
//! its method, what it asks of its caller, and the handler it goes to ([`Endpoint`], the
//! innermost service of the edge's stack, `super::layer`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body_util::Either;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use uuid::Uuid;

use super::admission::RequestSlots;
use super::auth::{Access, Named};
use super::error::{ApiError, ErrorCode};
use super::response::Resp;
use super::watch::{self, HttpBody};
use super::{accounts, batch, console, devices, holds, openapi, ops, write_lookup, writes};
use crate::account::AccountId;
use crate::account::holds::HoldId;
use crate::app::App;
use crate::auth::Scope;

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
    /// A write on the account looked up by its idempotency key (the path's last segment,
    /// read by the handler: it is no part of the route's identity).
    WriteLookup(AccountId),
    /// `POST /api/batch`: many writes, each item under its own key.
    Batch,
    /// An account's open holds (GET) and a new hold on it (POST), `--holds true`.
    Holds(AccountId),
    PlaceHold(AccountId),
    /// One hold, and its post and void.
    Hold(AccountId, HoldId),
    PostHold(AccountId, HoldId),
    VoidHold(AccountId, HoldId),
}

/// The nil hold id, for the listing below.
const NIL_HOLD: HoldId = HoldId(Uuid::nil());

/// The nil id, for the listing below.
const NIL: AccountId = AccountId(Uuid::nil());

impl Route {
    /// Every route once (ids nil): what `docs/openapi.json` is checked against. A new route
    /// is added here and in [`Route::listed_at`] (whose exhaustive match fails to compile
    /// until it is), then to the spec.
    pub const ALL: [Route; 23] = [
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
        Route::WriteLookup(NIL),
        Route::Batch,
        Route::Holds(NIL),
        Route::PlaceHold(NIL),
        Route::Hold(NIL, NIL_HOLD),
        Route::PostHold(NIL, NIL_HOLD),
        Route::VoidHold(NIL, NIL_HOLD),
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
            Route::WriteLookup(_) => 16,
            Route::Batch => 17,
            Route::Holds(_) => 18,
            Route::PlaceHold(_) => 19,
            Route::Hold(..) => 20,
            Route::PostHold(..) => 21,
            Route::VoidHold(..) => 22,
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
            Route::WriteLookup(_) => "/api/accounts/{id}/writes/{idempotencyKey}",
            Route::Batch => "/api/batch",
            Route::Holds(_) | Route::PlaceHold(_) => "/api/accounts/{id}/holds",
            Route::Hold(..) => "/api/accounts/{id}/holds/{holdId}",
            Route::PostHold(..) => "/api/accounts/{id}/holds/{holdId}/post",
            Route::VoidHold(..) => "/api/accounts/{id}/holds/{holdId}/void",
        }
    }

    fn method(&self) -> Method {
        match self {
            Route::Deposit(_)
            | Route::Withdraw(_)
            | Route::AccountTransfer(_)
            | Route::Transfers
            | Route::DeviceSync(_)
            | Route::OpenAccount
            | Route::Batch
            | Route::PlaceHold(_)
            | Route::PostHold(..)
            | Route::VoidHold(..) => Method::POST,
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

    /// The routes that run the write loop under an idempotency key (a batch, under one per
    /// item): each bounds its own wait, so its late answer still names its keys.
    pub fn is_keyed_write(&self) -> bool {
        matches!(
            self,
            Route::Deposit(_)
                | Route::Withdraw(_)
                | Route::AccountTransfer(_)
                | Route::Transfers
                | Route::OpenAccount
                | Route::Batch
                | Route::PlaceHold(_)
                | Route::PostHold(..)
                | Route::VoidHold(..)
        )
    }

    /// What the route asks of its caller with `--auth jwt`; `None` for the open routes. Every
    /// route decides here (the match is exhaustive, so a new route cannot be added without
    /// deciding). The console is a static page: the data it shows comes from API routes that
    /// check.
    pub fn access(&self) -> Option<Access> {
        use Named::{Account, Device, EveryAccount, Nothing};
        let (scope, names) = match *self {
            Route::Healthz | Route::Readyz | Route::Metrics | Route::OpenApi | Route::Console => {
                return None;
            }
            Route::Accounts => (Scope::AccountsRead, Nothing),
            // A write looked up by its key shows what the account's balance read shows.
            Route::Balance(a)
            | Route::History(a)
            | Route::AccountEvents(a)
            | Route::WriteLookup(a)
            | Route::Holds(a)
            | Route::Hold(a, _) => (Scope::AccountsRead, Account(a)),
            Route::WatchStream => (Scope::AccountsRead, EveryAccount),
            Route::Deposit(a)
            | Route::Withdraw(a)
            | Route::AccountTransfer(a)
            | Route::PlaceHold(a)
            | Route::PostHold(a, _)
            | Route::VoidHold(a, _) => (Scope::AccountsWrite, Account(a)),
            // A batch's items name their accounts: each is checked on its own
            // (`http::batch`), and one the token may not write is that item's 403.
            Route::Transfers | Route::OpenAccount | Route::Batch => (Scope::AccountsWrite, Nothing),
            Route::DeviceSync(device) => (Scope::DevicesSync, Device(device)),
        };
        Some(Access { scope, names })
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
                | Route::WriteLookup(_)
                | Route::Batch
                | Route::Holds(_)
                | Route::PlaceHold(_)
                | Route::Hold(..)
                | Route::PostHold(..)
                | Route::VoidHold(..)
        )
    }

    /// Matches a path, then the method. Unknown paths are 404; known paths with another
    /// method are 405; a malformed account id is 400.
    pub fn resolve(method: &Method, path: &str) -> Result<Route, ApiError> {
        let segs: Vec<&str> = path.split('/').skip(1).collect();
        let id = |s: &str| -> Result<AccountId, ApiError> {
            s.parse().map_err(|_| {
                ApiError::bad_request(
                    ErrorCode::InvalidId,
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
            ["api", "batch"] => Route::Batch,
            [""] => Route::Console,
            ["api", "watch", "stream"] => Route::WatchStream,
            ["api", "devices", device, "sync"] => {
                // The method before the id, as for accounts: a wrong method is 405 either way.
                Route::DeviceSync(Uuid::nil()).check_method(method)?;
                Route::DeviceSync(device.parse().map_err(|_| {
                    ApiError::bad_request(
                        ErrorCode::InvalidDeviceId,
                        format!("{device:?} is not a valid device id (a UUID)"),
                    )
                })?)
            }
            ["api", "accounts", acct, "holds"] => {
                let route = if *method == Method::POST {
                    Route::PlaceHold(NIL)
                } else {
                    Route::Holds(NIL)
                };
                route.check_method(method)?;
                return Ok(match route {
                    Route::PlaceHold(_) => Route::PlaceHold(id(acct)?),
                    _ => Route::Holds(id(acct)?),
                });
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
            ["api", "accounts", acct, "holds", hold] => {
                Route::Hold(NIL, NIL_HOLD).check_method(method)?;
                return Ok(Route::Hold(id(acct)?, hold_id(hold)?));
            }
            ["api", "accounts", acct, "holds", hold, action] => {
                let make: fn(AccountId, HoldId) -> Route = match *action {
                    "post" => Route::PostHold,
                    "void" => Route::VoidHold,
                    _ => return Err(not_found(path)),
                };
                make(NIL, NIL_HOLD).check_method(method)?;
                return Ok(make(id(acct)?, hold_id(hold)?));
            }
            // The key is read by the handler, after the caller is known (keys are the
            // caller's own): any segment is the route, and a malformed key its 400.
            ["api", "accounts", acct, "writes", _key] => {
                Route::WriteLookup(NIL).check_method(method)?;
                return Ok(Route::WriteLookup(id(acct)?));
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
        if matches!(
            self,
            Route::Accounts | Route::OpenAccount | Route::Holds(_) | Route::PlaceHold(_)
        ) {
            "GET, HEAD, POST"
        } else if self.method() == Method::POST {
            "POST"
        } else {
            "GET, HEAD"
        }
    }
}

/// The scope a route needs; `None` for the open routes ([`Route::access`]).
pub fn required_scope(route: &Route) -> Option<Scope> {
    route.access().map(|access| access.scope)
}

/// A hold id in a path: a UUID, or 400 `INVALID_ID`.
fn hold_id(s: &str) -> Result<HoldId, ApiError> {
    s.parse().map(HoldId).map_err(|_| {
        ApiError::bad_request(
            ErrorCode::InvalidId,
            format!("{s:?} is not a valid hold id (a UUID)"),
        )
    })
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
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    let names_a_parameter = |q: &str| form_urlencoded::parse(q.as_bytes()).next().is_some();
    if route.refuses_query() && req.uri().query().is_some_and(names_a_parameter) {
        // A write never silently ignores a parameter it does not know (`?dryRun=true`
        // must not move money), as reads refuse theirs. A query of separators alone
        // (`?&`) names none, on a write as on a read (else 200 and 400).
        return Err(ApiError::bad_request(
            ErrorCode::BadQuery,
            format!("{} takes no query parameters", route.template()),
        ));
    }
    match route {
        Route::Healthz => Ok(ops::healthz()),
        Route::Readyz => ops::readyz(app).await,
        Route::Metrics => Ok(ops::metrics(app)),
        Route::Accounts => Ok(accounts::list(app, req.extensions().get())),
        Route::OpenAccount => writes::open_account(app, req, slots).await,
        Route::Balance(account) => accounts::balance(app, account, req.uri().query()).await,
        Route::History(account) => accounts::history(app, account, req.uri().query()).await,
        Route::Deposit(account) => writes::deposit(app, account, req, slots).await,
        Route::Withdraw(account) => writes::withdraw(app, account, req, slots).await,
        Route::AccountTransfer(from) => writes::account_transfer(app, from, req, slots).await,
        Route::Transfers => writes::transfer(app, req, slots).await,
        Route::Batch => batch::batch(app, req, slots).await,
        Route::Holds(account) => holds::list(app, account).await,
        Route::PlaceHold(account) => holds::place(app, account, req, slots).await,
        Route::Hold(account, hold) => holds::get(app, account, hold).await,
        Route::PostHold(account, hold) => holds::post(app, account, hold, req, slots).await,
        Route::VoidHold(account, hold) => holds::void(app, account, hold, req, slots).await,
        Route::WriteLookup(account) => write_lookup::find(app, account, &req).await,
        Route::DeviceSync(device) => devices::sync(app, device, req, slots).await,
        Route::OpenApi => Ok(openapi::document()),
        Route::Console => Ok(console::page()),
        // `Endpoint` serves the streams before it dispatches; reaching here is a bug.
        Route::AccountEvents(_) | Route::WatchStream => Err(ApiError::Internal {
            code: ErrorCode::StreamRoute,
            message: "an event-stream route reached the JSON dispatcher".into(),
        }),
    }
}

/// What the edge's services answer: a response, or the error it becomes (in one place,
/// [`ApiError::into_response`], called by `layer::access_log`).
pub type Answer<E = ApiError> = Result<Response<HttpBody>, E>;

/// The future every service of the edge's stack answers with. Boxed once where an answer is
/// awaited; a layer that only checks a request before passing it on hands its inner
/// service's future back as it is.
pub type BoxFuture<E = ApiError> = Pin<Box<dyn Future<Output = Answer<E>> + Send>>;

/// A layer's refusal, as the future its service answers with.
pub fn refused(e: ApiError) -> BoxFuture {
    Box::pin(std::future::ready(Err(e)))
}

/// A request as the accept loop hands it to the edge's stack, with what it holds there.
pub struct Handed {
    pub req: Request<Incoming>,
    pub slots: RequestSlots,
}

/// A request and its route, resolved once, first (`layer::route`): every layer after reads
/// the route here, and the handlers get it with the request.
pub struct Routed {
    /// The route, or why there is none (404, 405, 400 `INVALID_ID`): answered by
    /// [`Endpoint`], after the `Host` check.
    pub route: Result<Route, ApiError>,
    pub req: Request<Incoming>,
    /// What the request holds at the edge: the admission layer adds its in-flight slot.
    pub slots: RequestSlots,
}

impl Routed {
    /// The route, if the request has one.
    pub fn route(&self) -> Option<Route> {
        self.route.as_ref().ok().copied()
    }

    /// The name the request is counted and logged under: its route's template (a known path
    /// with a wrong method, 405, too), else `unmatched`.
    pub fn template(&self) -> &'static str {
        match &self.route {
            Ok(route) => route.template(),
            Err(ApiError::MethodNotAllowed { route, .. }) => route,
            Err(_) => "unmatched",
        }
    }
}

/// The handlers, as the innermost service of the edge's stack.
#[derive(Clone)]
pub struct Endpoint {
    app: Arc<App>,
}

impl Endpoint {
    pub fn new(app: Arc<App>) -> Self {
        Endpoint { app }
    }
}

impl tower::Service<Routed> for Endpoint {
    type Response = Response<HttpBody>;
    type Error = ApiError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, routed: Routed) -> BoxFuture {
        let app = self.app.clone();
        Box::pin(async move { answer(&app, routed).await })
    }
}

/// A routed request's answer. A request without a route is refused here, after the layers
/// (none of which acts on a request without one). Event streams answer a body that never
/// ends by itself; every other route a whole one.
async fn answer(app: &Arc<App>, routed: Routed) -> Answer {
    let Routed { route, req, slots } = routed;
    let route = route?;
    // With --admin-listen, /metrics is served there only.
    if route == Route::Metrics && app.config.admin_listen.is_some() {
        return Err(ApiError::NotFound {
            path: route.template().into(),
        });
    }
    match route {
        Route::AccountEvents(account) => watch::account_events(app, account, &req, &slots).await,
        Route::WatchStream => watch::all(app, &req, &slots).await,
        _ => Ok(dispatch(app, route, req, &slots).await?.map(Either::Left)),
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
                code: ErrorCode::InvalidId,
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
                code: ErrorCode::InvalidDeviceId,
                ..
            })
        ));
    }

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

    #[test]
    fn every_route_is_listed_once_in_order() {
        for (i, route) in Route::ALL.iter().enumerate() {
            assert_eq!(route.listed_at(), i, "{route:?}");
        }
    }
}
