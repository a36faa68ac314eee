//! An API request takes an in-flight permit (`--max-concurrent-requests`) before its body is
//! read, so a request that is refused costs no more than its head: it waits for one at most
//! `--max-queue-wait-ms`, else it is shed with 503 and `Retry-After`
//! ([`Edge::admit`](crate::http::admission::Edge::admit) says why, and counts it). The
//! permit goes with the request in its slots (`RequestSlots`), for the body read to give
//! back while its client is slow (`body::read_json`), and is held until the answer. Probes, scrapes, the console and the
//! contract take none.

use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::Response;
use tower::{Layer, Service};

use crate::app::App;
use crate::http::admission::{Edge, InFlight};
use crate::http::error::ApiError;
use crate::http::router::{BoxFuture, Routed};
use crate::http::watch::HttpBody;

#[derive(Clone)]
pub struct AdmissionLayer {
    app: Arc<App>,
    edge: Arc<Edge>,
}

impl AdmissionLayer {
    pub fn new(app: Arc<App>, edge: Arc<Edge>) -> Self {
        AdmissionLayer { app, edge }
    }
}

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admit<S>;

    fn layer(&self, inner: S) -> Admit<S> {
        Admit {
            inner,
            app: self.app.clone(),
            edge: self.edge.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    app: Arc<App>,
    edge: Arc<Edge>,
}

impl<S> Service<Routed> for Admit<S>
where
    S: Service<Routed, Response = Response<HttpBody>, Error = ApiError, Future = BoxFuture>
        + Clone
        + Send
        + 'static,
{
    type Response = Response<HttpBody>;
    type Error = ApiError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ApiError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut routed: Routed) -> BoxFuture {
        if !routed.route().is_some_and(|r| r.is_api()) {
            return self.inner.call(routed);
        }
        // The service made ready goes with the request; its clone stays for the next one.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let (app, edge) = (self.app.clone(), self.edge.clone());
        Box::pin(async move {
            let in_flight = InFlight::admit(&edge, &app, routed.slots.conn.as_ref()).await?;
            routed.slots.in_flight = Some(in_flight.clone());
            let answer = inner.call(routed).await;
            drop(in_flight);
            answer
        })
    }
}
