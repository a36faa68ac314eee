//! A replica that has not finished starting answers the API 503 (naming the steps it waits
//! for): until it is anchored to the server's clock, the fold cannot age the recent-writes
//! index, and until the demo accounts are seeded a write could take their first version.
//! The store is needed for either, so the client retries shortly. Probes, scrapes and the
//! console are served meanwhile (`/readyz` says `starting` itself).

use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::Response;
use tower::{Layer, Service};

use crate::app::App;
use crate::http::error::ApiError;
use crate::http::router::{BoxFuture, Routed, refused};
use crate::http::watch::HttpBody;

#[derive(Clone)]
pub struct ReadinessLayer {
    app: Arc<App>,
}

impl ReadinessLayer {
    pub fn new(app: Arc<App>) -> Self {
        ReadinessLayer { app }
    }
}

impl<S> Layer<S> for ReadinessLayer {
    type Service = WhenStarted<S>;

    fn layer(&self, inner: S) -> WhenStarted<S> {
        WhenStarted {
            inner,
            app: self.app.clone(),
        }
    }
}

#[derive(Clone)]
pub struct WhenStarted<S> {
    inner: S,
    app: Arc<App>,
}

impl<S> Service<Routed> for WhenStarted<S>
where
    S: Service<Routed, Response = Response<HttpBody>, Error = ApiError, Future = BoxFuture>,
{
    type Response = Response<HttpBody>;
    type Error = ApiError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, routed: Routed) -> BoxFuture {
        if routed.route().is_some_and(|r| r.is_api()) && !self.app.is_started() {
            return refused(ApiError::starting(&self.app.startup_waiting()));
        }
        self.inner.call(routed)
    }
}
