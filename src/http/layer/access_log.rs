//! The access log: each request ends with one line, its method, route template, status and
//! latency, its peer address and authenticated caller (`sub`, never the token), and what the request's note (`crate::request_note`) gathered on the way: the
//! key hash, and a write's attempts and outcome. `served` at info, or `shed` at debug, since
//! shed requests are reported by the edge in one warning per interval and a line each would
//! cost a quarter of a refusal's CPU (`super::super::admission`). The request runs in a
//! `request` span at debug level (method and route), which gives the other lines a request
//! logs its context when debug logging is on, and costs nothing when it is off.
//!
//! Here errors become responses ([`ApiError::into_response`], the one mapping to HTTP):
//! every layer inside answers `Result<_, ApiError>`, and the line must see the error to tell
//! a shed request from the rest.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http_body_util::Either;
use hyper::Response;
use tower::{Layer, Service};
use tracing::Instrument;

use crate::http::error::ApiError;
use crate::http::peer::Peer;
use crate::http::router::{BoxFuture, Routed, method_label};
use crate::http::watch::HttpBody;
use crate::request_note::RequestNote;

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
        let (method, route) = (method_label(routed.req.method()), routed.template());
        let span = tracing::debug_span!("request", method, route);
        let note = Arc::new(RequestNote::default());
        let peer = routed.req.extensions().get::<Peer>().map(|p| p.0);
        // The layers inside check the request as they are called: in the span and with the
        // note too (authentication notes the caller there).
        let answer = span.in_scope(|| note.clone().sync_scope(|| self.inner.call(routed)));
        Box::pin(async move {
            let answer = note.clone().scope(answer).instrument(span).await;
            let shed = matches!(answer, Err(ApiError::Shed { .. }));
            let resp = answer.unwrap_or_else(|e| e.into_response().map(Either::Left));
            let (status, latency_us) = (resp.status().as_u16(), started.elapsed().as_micros());
            let latency_us = latency_us as u64;
            let key_hash = note.noted_key_hash();
            let caller = note.noted_caller();
            let run = note.noted_run();
            let (attempts, outcome) = (run.map(|r| r.attempts), run.map(|r| r.outcome));
            if shed {
                tracing::debug!(
                    method,
                    route,
                    status,
                    latency_us,
                    peer = peer.map(tracing::field::display),
                    "shed"
                );
            } else {
                tracing::info!(
                    method = %method,
                    route = %route,
                    caller,
                    peer = peer.map(tracing::field::display),
                    key_hash = key_hash.map(tracing::field::display),
                    attempts,
                    outcome = outcome.map(tracing::field::display),
                    status,
                    latency_us,
                    "served"
                );
            }
            Ok(resp)
        })
    }
}
