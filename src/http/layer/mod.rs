//! The edge's concerns as layers around the handlers ([`tower`] services), each in its own
//! file with its reason, in the order a request meets them:
//!
//! 1. [`route`]: the route, resolved once; everything after reads it.
//! 2. [`metrics`]: requests in flight, counted by route, method and status class, and timed.
//! 3. [`access_log`]: the request's span and its one line; errors become responses here.
//! 4. [`host`]: RFC 9112's `Host` rules and the host names served (probes exempt); this and
//!    the next two only check a request, each a [`check::Check`] in the one service of
//!    [`check`].
//! 5. [`auth`]: with `--auth jwt`, the caller's token against what the route asks.
//! 6. [`readiness`]: 503 for the API while start-up steps are pending.
//! 7. [`admission`]: an in-flight permit, waited for or shed.
//! 8. [`timeout`]: the backstop on a request (a keyed write bounds its own).
//!
//! Then the handlers ([`Endpoint`]), which answer a request without a route (404, 405, 400)
//! too: no layer acts on one. Below them all, under hyper, the socket gate (`super::gate`)
//! and the head guard (`super::head`) work on the connection, and `super::serve` hands each
//! request over.
//!
//! Every service in the stack answers with a [`BoxFuture`]: a layer that only checks a
//! request passes its inner service's future on as it is, so a request costs one allocation
//! per layer that awaits (metrics, the log, admission, the timeout, the handler).

mod access_log;
mod admission;
mod auth;
mod check;
mod host;
mod metrics;
mod readiness;
mod route;
mod timeout;

use std::convert::Infallible;
use std::sync::Arc;

use tower::{Service, ServiceBuilder};

use self::check::CheckLayer;
use super::admission::Edge;
use super::router::{BoxFuture, Endpoint, Handed};
use super::watch::HttpBody;
use crate::app::App;

/// The API listener's stack, in the order above.
pub fn stack(
    app: &Arc<App>,
    edge: &Arc<Edge>,
) -> impl Service<
    Handed,
    Response = hyper::Response<HttpBody>,
    Error = Infallible,
    Future = BoxFuture<Infallible>,
> + Clone
+ Send
+ 'static {
    ServiceBuilder::new()
        .layer(route::RouteLayer)
        .layer(metrics::MetricsLayer::new(app.metrics.clone()))
        .layer(access_log::AccessLogLayer)
        .layer(CheckLayer(host::HostRules::new(app)))
        .layer(CheckLayer(auth::Authenticate::new(app.clone())))
        .layer(CheckLayer(readiness::Started::new(app.clone())))
        .layer(admission::AdmissionLayer::new(app.clone(), edge.clone()))
        .layer(timeout::TimeoutLayer::new(app))
        .service(Endpoint::new(app.clone()))
}
