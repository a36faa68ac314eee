//! The route, resolved once, before anything else: every layer after reads it from the
//! [`Routed`] request, and the metrics and the log name a request by it even when it is
//! refused before its route is checked (a bad `Host`). A path that is no route, or a wrong
//! method, is answered by the handlers, after the `Host` check (RFC 9112 first).

use std::convert::Infallible;
use std::task::{Context, Poll};

use hyper::Response;
use tower::{Layer, Service};

use crate::http::router::{BoxFuture, Handed, Route, Routed};
use crate::http::watch::HttpBody;

#[derive(Clone, Copy)]
pub struct RouteLayer;

impl<S> Layer<S> for RouteLayer {
    type Service = ResolveRoute<S>;

    fn layer(&self, inner: S) -> ResolveRoute<S> {
        ResolveRoute { inner }
    }
}

#[derive(Clone)]
pub struct ResolveRoute<S> {
    inner: S,
}

impl<S> Service<Handed> for ResolveRoute<S>
where
    S: Service<
            Routed,
            Response = Response<HttpBody>,
            Error = Infallible,
            Future = BoxFuture<Infallible>,
        >,
{
    type Response = Response<HttpBody>;
    type Error = Infallible;
    type Future = BoxFuture<Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, handed: Handed) -> Self::Future {
        let Handed { req, slots } = handed;
        let route = Route::resolve(req.method(), req.uri().path());
        self.inner.call(Routed { route, req, slots })
    }
}
