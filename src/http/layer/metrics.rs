//! The request metrics: requests in flight (`tally_http_in_flight`), and each answer counted
//! by route template, method and status class and timed by route. Outside every other layer,
//! so a request refused anywhere (a bad `Host`, a token, start-up, shedding, the backstop)
//! is counted like one served; labels are bounded (templates, never a path or an id).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use hyper::{Response, StatusCode};
use tower::{Layer, Service};

use crate::http::gauge::InFlightGauge;
use crate::http::router::{BoxFuture, Routed, method_label};
use crate::http::watch::HttpBody;
use crate::metrics::Metrics;

#[derive(Clone)]
pub struct MetricsLayer {
    metrics: Arc<Metrics>,
}

impl MetricsLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        MetricsLayer { metrics }
    }
}

impl<S> Layer<S> for MetricsLayer {
    type Service = RequestMetrics<S>;

    fn layer(&self, inner: S) -> RequestMetrics<S> {
        RequestMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RequestMetrics<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<Routed> for RequestMetrics<S>
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

    fn call(&mut self, routed: Routed) -> Self::Future {
        let started = Instant::now();
        let (template, method) = (routed.template(), method_label(routed.req.method()));
        // Entered before the layers inside check anything, so it counts their work too.
        let in_flight = InFlightGauge::enter(&self.metrics.http_in_flight);
        let answer = self.inner.call(routed);
        let m = self.metrics.clone();
        Box::pin(async move {
            let Ok(resp) = answer.await;
            drop(in_flight);
            m.http_requests
                .with_label_values(&[template, method, status_class(resp.status())])
                .inc();
            m.http_duration
                .with_label_values(&[template])
                .observe(started.elapsed().as_secs_f64());
            Ok(resp)
        })
    }
}

fn status_class(s: StatusCode) -> &'static str {
    match s.as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
