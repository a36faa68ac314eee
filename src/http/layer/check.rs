//! A layer that only checks a request: it refuses the request with the check's error, or
//! passes it on as it is, handing its inner service's future back unboxed. The `Host`
//! rules, authentication and readiness are such checks; each says in its own file what it
//! checks and why, and this file is the service around them.

use std::task::{Context, Poll};

use hyper::Response;
use tower::{Layer, Service};

use crate::http::error::ApiError;
use crate::http::router::{BoxFuture, Routed, refused};
use crate::http::watch::HttpBody;

/// What a checking layer asks of a request. It may leave something on the request for the
/// handlers (the authenticated caller).
pub trait Check: Clone {
    fn check(&self, routed: &mut Routed) -> Result<(), ApiError>;
}

/// The layer of one check.
#[derive(Clone, Copy)]
pub struct CheckLayer<C>(pub C);

impl<C: Check, S> Layer<S> for CheckLayer<C> {
    type Service = Checked<C, S>;

    fn layer(&self, inner: S) -> Checked<C, S> {
        Checked {
            check: self.0.clone(),
            inner,
        }
    }
}

#[derive(Clone)]
pub struct Checked<C, S> {
    check: C,
    inner: S,
}

impl<C, S> Service<Routed> for Checked<C, S>
where
    C: Check,
    S: Service<Routed, Response = Response<HttpBody>, Error = ApiError, Future = BoxFuture>,
{
    type Response = Response<HttpBody>;
    type Error = ApiError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut routed: Routed) -> BoxFuture {
        match self.check.check(&mut routed) {
            Ok(()) => self.inner.call(routed),
            Err(e) => refused(e),
        }
    }
}
