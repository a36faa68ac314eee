//! The access log: each request runs in a `request` span (method, route template, and the
//! key hash, attempts and outcome the write path records), and ends with one line, its
//! status and latency: `served` at info, or `shed` at debug, since shed requests are
//! reported by the edge in one warning per interval and a line each would cost a quarter of
//! a refusal's CPU (`super::super::admission`).
//!
//! Here errors become responses ([`ApiError::into_response`], the one mapping to HTTP):
//! every layer inside answers `Result<_, ApiError>`, and the line must see the error to tell
//! a shed request from the rest. The mapping runs outside the span, as the line's own
//! fields say what it was.

use std::convert::Infallible;
use std::task::{Context, Poll};
use std::time::Instant;

use http_body_util::Either;
use hyper::Response;
use tower::{Layer, Service};
use tracing::Instrument;

use crate::http::error::ApiError;
use crate::http::router::{BoxFuture, Routed, method_label};
use crate::http::watch::HttpBody;

#[derive(Clone, Copy)]
pub struct AccessLogLayer;

impl<S> Layer<S> for AccessLogLayer {
    type Service = AccessLog<S>;

    fn layer(&self, inner: S) -> AccessLog<S> {
        AccessLog { inner }
    }
}

#[derive(Clone)]
pub struct AccessLog<S> {
    inner: S,
}

impl<S> Service<Routed> for AccessLog<S>
where
    S: Service<Routed, Response = Response<HttpBody>, Error = ApiError, Future = BoxFuture>,
{
    type Response = Response<HttpBody>;
    type Error = Infallible;
    type Future = BoxFuture<Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The services inside are always ready; one that could not take a request would
        // answer it with its error when called.
        self.inner.poll_ready(cx).map(|_| Ok(()))
    }

    fn call(&mut self, routed: Routed) -> Self::Future {
        let started = Instant::now();
        let span = tracing::info_span!(
            "request",
            method = method_label(routed.req.method()),
            route = routed.template(),
            key_hash = tracing::field::Empty,
            attempts = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        // The layers inside check the request as they are called: in the span too.
        let answer = span.in_scope(|| self.inner.call(routed));
        Box::pin(async move {
            let answer = answer.instrument(span.clone()).await;
            let shed = matches!(answer, Err(ApiError::Shed { .. }));
            let resp = answer.unwrap_or_else(|e| e.into_response().map(Either::Left));
            span.in_scope(|| {
                let (status, latency_us) = (resp.status().as_u16(), started.elapsed().as_micros());
                let latency_us = latency_us as u64;
                if shed {
                    tracing::debug!(status, latency_us, "shed");
                } else {
                    tracing::info!(status, latency_us, "served");
                }
            });
            Ok(resp)
        })
    }
}
