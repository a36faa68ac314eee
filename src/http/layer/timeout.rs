//! The backstop on a request, beyond the write loop's own deadline: past it the answer is a
//! retryable 503 (nothing is known to have been done). A keyed write bounds its own wait
//! (`writes::write`): its late answer must still name its key, and the write goes on after
//! it. For an event stream the deadline covers opening it, not the stream.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Response;
use tower::{Layer, Service};

use crate::app::App;
use crate::http::deadline::{request_deadline, took_too_long};
use crate::http::error::ApiError;
use crate::http::router::{BoxFuture, Route, Routed};
use crate::http::watch::HttpBody;

/// A device sync's backstop past its store write and read-back (see [`device_sync_deadline`]).
const DEVICE_SYNC_MARGIN: Duration = Duration::from_secs(1);

/// The backstops, fixed by the configuration.
#[derive(Clone, Copy)]
pub struct TimeoutLayer {
    request: Duration,
    device_sync: Duration,
}

impl TimeoutLayer {
    pub fn new(app: &Arc<App>) -> Self {
        let request = request_deadline(app);
        TimeoutLayer {
            request,
            device_sync: device_sync_deadline(request, app.config.store_request_timeout()),
        }
    }
}

impl<S> Layer<S> for TimeoutLayer {
    type Service = Backstop<S>;

    fn layer(&self, inner: S) -> Backstop<S> {
        Backstop {
            inner,
            deadlines: *self,
        }
    }
}

#[derive(Clone)]
pub struct Backstop<S> {
    inner: S,
    deadlines: TimeoutLayer,
}

impl<S> Service<Routed> for Backstop<S>
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
        let deadline = match routed.route() {
            Some(route) if route.is_keyed_write() => return self.inner.call(routed),
            Some(Route::DeviceSync(_)) => self.deadlines.device_sync,
            _ => self.deadlines.request,
        };
        let answer = tokio::time::timeout(deadline, self.inner.call(routed));
        Box::pin(async move { answer.await.unwrap_or_else(|_| Err(took_too_long())) })
    }
}

/// A device sync's backstop. Its store write runs to the store's own request timeout (it has
/// no write deadline of its own), then a resent run's read-back takes up to
/// `READ_BACK_BUDGET`: its backstop covers both, so a slow store answers the documented
/// `SYNC_UNVERIFIED`, never the backstop's generic 503 (else with a short
/// `--write-deadline-ms` the backstop would come first).
fn device_sync_deadline(request_deadline: Duration, store_request_timeout: Duration) -> Duration {
    let needs = store_request_timeout + crate::device::ingest::READ_BACK_BUDGET;
    request_deadline.max(needs + DEVICE_SYNC_MARGIN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ingest::READ_BACK_BUDGET;
    use crate::http::deadline::REQUEST_DEADLINE_MARGIN;

    /// Rule: a device sync's backstop outlasts its store write (the store's whole request
    /// timeout) and a resent run's read-back, however short `--write-deadline-ms` is, so a
    /// slow store answers `SYNC_UNVERIFIED`, not the backstop's generic 503.
    #[test]
    fn a_device_syncs_backstop_outlasts_its_store_write_and_read_back() {
        let store_timeout = Duration::from_secs(5);
        let short = device_sync_deadline(
            Duration::from_secs(1) + REQUEST_DEADLINE_MARGIN,
            store_timeout,
        );
        assert!(short > store_timeout + READ_BACK_BUDGET, "{short:?}");
        // A longer request deadline is kept.
        let long = Duration::from_secs(60);
        assert_eq!(device_sync_deadline(long, store_timeout), long);
    }
}
