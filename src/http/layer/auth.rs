//! Who is calling, before anything else about the request is looked at (its body is not
//! read yet, nothing is written): with `--auth jwt`, the caller's token against what the
//! route asks ([`Route::access`](crate::http::router::Route::access), checked by
//! [`auth::check`]), and the caller paced. An admitted caller rides on the request, where
//! the handlers find it (for its own idempotency keys and the accounts a body names).

use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::Response;
use tower::{Layer, Service};

use crate::app::App;
use crate::http::auth;
use crate::http::error::ApiError;
use crate::http::router::{BoxFuture, Routed, refused};
use crate::http::watch::HttpBody;

#[derive(Clone)]
pub struct AuthLayer {
    app: Arc<App>,
}

impl AuthLayer {
    pub fn new(app: Arc<App>) -> Self {
        AuthLayer { app }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Authenticate<S>;

    fn layer(&self, inner: S) -> Authenticate<S> {
        Authenticate {
            inner,
            app: self.app.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Authenticate<S> {
    inner: S,
    app: Arc<App>,
}

impl<S> Service<Routed> for Authenticate<S>
where
    S: Service<Routed, Response = Response<HttpBody>, Error = ApiError, Future = BoxFuture>,
{
    type Response = Response<HttpBody>;
    type Error = ApiError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut routed: Routed) -> BoxFuture {
        // A request without a route is refused as such, whoever sends it.
        if let Some(route) = routed.route() {
            match auth::check(&self.app, route.access(), routed.req.headers()) {
                Ok(Some(caller)) => {
                    routed.req.extensions_mut().insert(caller);
                }
                Ok(None) => {}
                Err(e) => return refused(e),
            }
        }
        self.inner.call(routed)
    }
}
