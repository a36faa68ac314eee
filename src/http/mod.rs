//! The hyper front end: accept loop, per-request limits, metrics and access logs, and
//! graceful shutdown.

mod accounts;
mod admin;
mod admission;
pub mod auth;
pub mod body;
pub mod config;
mod console;
mod devices;
pub mod error;
pub mod gate;
pub mod head;
pub mod idempotency;
pub mod openapi;
mod ops;
pub mod router;
pub mod watch;
mod write_stall;
mod writes;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Either;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tracing::Instrument;

use crate::app::App;
pub use admin::serve_admin;
use error::ApiError;
use router::Route;
use watch::HttpBody;

/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// hyper's smallest read buffer cap (its `max_buf_size` panics below this).
const MIN_READ_BUFFER_BYTES: usize = 8192;
/// Pause after a failed accept (for example out of file descriptors) before trying again.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// A backstop on any one request, beyond the write loop's own deadline.
const REQUEST_DEADLINE_MARGIN: Duration = Duration::from_secs(5);
/// A device sync's backstop past its store write and read-back (see [`route_deadline`]).
const DEVICE_SYNC_MARGIN: Duration = Duration::from_secs(1);

/// The HTTP/1 settings both listeners serve with.
fn http1_builder(config: &crate::config::Config) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        // A client may close its sending side once its request is sent and wait for the
        // answer (RFC 9112, 9.6); without this hyper took the end of input for an abort and
        // closed the connection unanswered, even while the request's write went on and
        // landed.
        .half_close(true)
        // hyper refuses a head longer than this and closes the connection (without it, only
        // its ~400 KB read-buffer limit applies); more than 100 headers too, hyper's default.
        // Its empty 431 is answered in the API's shape by `head::HeadGuard`.
        .max_header_size(config.http.max_header_bytes)
        // The read buffer's cap: without it hyper grows a connection's buffer to ~400 KB
        // while its client keeps pipelined requests waiting, and never shrinks it (else
        // 4,096 such connections could hold 1.6 GB). A head must fit, and hyper's own floor.
        // hyper applies the same cap to what it buffers of pipelined answers before writing.
        .max_buf_size(config.http.max_header_bytes.max(MIN_READ_BUFFER_BYTES));
    builder
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, lets in-flight
/// requests finish within the configured grace period, and returns. At most
/// `--max-connections` are open at once: at the cap, accepting waits for one to close.
pub async fn serve(app: Arc<App>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let builder = http1_builder(&app.config);
    let edge = Arc::new(admission::Edge::new(&app));
    let _ticking = edge.gate.start_ticking();
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = edge.next_connection() => slot,
            _ = &mut shutdown => break,
        };
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (app, edge) = (app.clone(), edge.clone());
                let (io, gated) =
                    gate::GatedIo::new(stream, edge.gate.clone(), app.config.http.write_stall());
                let io = TokioIo::new(head::HeadGuard::new(io, app.config.http.max_header_bytes));
                let svc = service_fn(move |mut req: Request<Incoming>| {
                    let (app, edge, gated) = (app.clone(), edge.clone(), gated.clone());
                    let serving = gated.serve();
                    async move {
                        serving.hold_slot().await;
                        // For the body read, which gives the slot back while its client is slow.
                        req.extensions_mut().insert(gated);
                        Ok::<_, Infallible>(handle(app, &edge, req).await)
                    }
                });
                let conn = graceful.watch(builder.serve_connection(io, svc));
                tokio::spawn(async move {
                    // Held while the connection is open.
                    let _slot = slot;
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    app.begin_shutdown();
    drop(listener);
    let grace = Duration::from_secs(app.config.http.shutdown_grace_secs);
    tracing::info!(
        grace_secs = grace.as_secs(),
        "shutting down: draining in-flight requests"
    );
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all connections closed"),
        _ = tokio::time::sleep(grace) => tracing::warn!("grace period over; closing remaining connections"),
    }
}

/// A header sent more than once where the API reads one.
pub(crate) struct RepeatedHeader;

/// The value of a header a request may carry at most once (`Idempotency-Key`,
/// `Authorization`, `Content-Type`, `Last-Event-ID`): two of them name no one value, and
/// taking the first would act on what the sender may have meant as the other.
pub(crate) fn at_most_one<K: hyper::header::AsHeaderName>(
    headers: &hyper::HeaderMap,
    name: K,
) -> Result<Option<&hyper::header::HeaderValue>, RepeatedHeader> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    match values.next() {
        Some(_) => Err(RepeatedHeader),
        None => Ok(first),
    }
}

/// RFC 9112, 3.2: an HTTP/1.1 request names its host, and no request names two; a server
/// must answer either with 400 (else both would be served).
fn check_host(req: &Request<Incoming>) -> Result<(), ApiError> {
    let several = || ApiError::bad_request("BAD_REQUEST", "send one Host header, not several");
    let host = at_most_one(req.headers(), hyper::header::HOST).map_err(|_| several())?;
    // A proxy that joined two Host fields into one list sent two hosts.
    if host.is_some_and(|h| h.as_bytes().contains(&b',')) {
        return Err(several());
    }
    // The field is `uri-host [":" port]` (RFC 9110, 7.2; an http URI's host is never empty):
    // no user, no path, no spaces (else `Host: a b/c@d` would be served).
    if host.is_some_and(|h| !is_host_and_port(h.as_bytes())) {
        return Err(ApiError::bad_request(
            "BAD_REQUEST",
            "the Host header is not a host with an optional port",
        ));
    }
    if host.is_none() && req.version() == hyper::Version::HTTP_11 {
        return Err(ApiError::bad_request(
            "BAD_REQUEST",
            "an HTTP/1.1 request must carry a Host header",
        ));
    }
    Ok(())
}

/// Whether `value` is `uri-host [":" port]` (RFC 9110, 7.2): an authority without a user, a
/// host that is not empty, and a port, if any, of 1 to 5 digits within 0..=65535 (else
/// `:80`, `host:abc` and `[::1]x` would be served).
fn is_host_and_port(value: &[u8]) -> bool {
    if value.contains(&b'@') || hyper::http::uri::Authority::try_from(value).is_err() {
        return false;
    }
    let split = match value.first() {
        // An IP literal: the port, if any, follows its closing bracket.
        Some(b'[') => value.iter().position(|&b| b == b']').map(|end| end + 1),
        _ => Some(value.iter().position(|&b| b == b':').unwrap_or(value.len())),
    };
    let Some(split) = split else {
        return false;
    };
    let (host, rest) = value.split_at(split);
    let port_ok = match rest {
        [] => true,
        [b':', digits @ ..] => {
            (1..=5).contains(&digits.len())
                && std::str::from_utf8(digits).is_ok_and(|d| d.parse::<u16>().is_ok())
        }
        _ => false,
    };
    !host.is_empty() && port_ok
}

/// What a request to a replica that has not finished starting is told, before the steps
/// it waits for.
pub(crate) const STARTING: &str = "starting: not serving until its start-up steps are done";

/// The 503 of a replica still starting: names the steps it waits for (`serverClock`,
/// `seed:<demo name>`), fixed names that carry no request data.
pub(crate) fn starting(waiting: &[String]) -> ApiError {
    ApiError::Unavailable(if waiting.is_empty() {
        format!("{STARTING}; retry shortly")
    } else {
        format!(
            "{STARTING} (waiting for {}); retry shortly",
            waiting.join(", ")
        )
    })
}

/// One request: route, admit, dispatch, then count and log it.
async fn handle(
    app: Arc<App>,
    edge: &Arc<admission::Edge>,
    mut req: Request<Incoming>,
) -> Response<HttpBody> {
    let started = Instant::now();
    let method = router::method_label(req.method());
    let routed = Route::resolve(req.method(), req.uri().path());
    // A known path with a wrong method (405) is counted under its route.
    let template = match &routed {
        Ok(route) => route.template(),
        Err(ApiError::MethodNotAllowed { route, .. }) => route,
        Err(_) => "unmatched",
    };
    let span = tracing::info_span!(
        "request",
        method,
        route = template,
        key_hash = tracing::field::Empty,
        attempts = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let m = &app.metrics;
    let in_flight = InFlightGauge::enter(&m.http_in_flight);
    let resp = async {
        // Probes are answered whatever their Host: a health checker written without one
        // (an old HAProxy `httpchk` line) would otherwise mark every replica down at once.
        if !matches!(routed, Ok(Route::Healthz | Route::Readyz)) {
            check_host(&req)?;
        }
        let route = routed?;
        // With --admin-listen, /metrics is served there only.
        if route == Route::Metrics && app.config.admin_listen.is_some() {
            return Err(ApiError::NotFound {
                path: route.template().into(),
            });
        }
        // Who is calling, before anything else is looked at; the handlers find
        // the caller (for its own idempotency keys and body accounts) on the request.
        if let Some(caller) = auth::check(&app, &route, req.headers())? {
            req.extensions_mut().insert(caller);
        }
        if route.is_api() && !app.is_started() {
            // Until it is anchored to the server's clock, the fold cannot age the
            // recent-writes index, and until the demo accounts are seeded a write could
            // take their first version: the store is needed for either, so retry shortly.
            return Err(starting(&app.startup_waiting()));
        }
        // Before the body is read: a request that is refused costs no more than its head.
        // Held here until the answer; the body read gives the slot back while its client
        // is slow (`body::read_json`).
        let _in_flight = if route.is_api() {
            let conn = req.extensions().get::<Arc<gate::ConnSlot>>().cloned();
            let in_flight = admission::InFlight::admit(edge, &app, conn.as_ref()).await?;
            req.extensions_mut().insert(in_flight.clone());
            Some(in_flight)
        } else {
            None
        };
        // A keyed write bounds its own wait (`writes::write`): its late answer must still
        // name its key, and the write goes on after it.
        if route.is_keyed_write() {
            return serve_route(&app, route, req).await;
        }
        match tokio::time::timeout(route_deadline(&app, &route), serve_route(&app, route, req))
            .await
        {
            Ok(result) => result,
            Err(_) => Err(took_too_long()),
        }
    }
    .instrument(span.clone())
    .await;
    // Shed requests are reported by the edge, not one access-log line each.
    let shed = matches!(resp, Err(ApiError::Shed { .. }));
    // Errors become responses in one place.
    let resp = resp.unwrap_or_else(|e| e.into_response().map(Either::Left));
    drop(in_flight);
    let status = resp.status();
    m.http_requests
        .with_label_values(&[template, method, status_class(status)])
        .inc();
    let elapsed = started.elapsed();
    m.http_duration
        .with_label_values(&[template])
        .observe(elapsed.as_secs_f64());
    span.in_scope(|| {
        let (status, latency_us) = (status.as_u16(), elapsed.as_micros() as u64);
        if shed {
            tracing::debug!(status, latency_us, "shed");
        } else {
            tracing::info!(status, latency_us, "served");
        }
    });
    resp
}

/// Event streams answer a body that never ends by itself; every other route a
/// whole one. The deadline covers opening a stream, not the stream.
async fn serve_route(
    app: &Arc<App>,
    route: Route,
    req: Request<Incoming>,
) -> Result<Response<HttpBody>, ApiError> {
    match route {
        Route::AccountEvents(account) => watch::account_events(app, account, &req).await,
        Route::WatchStream => watch::all(app, &req).await,
        _ => Ok(router::dispatch(app, route, req).await?.map(Either::Left)),
    }
}

fn request_deadline(app: &App) -> Duration {
    app.config.write().deadline + REQUEST_DEADLINE_MARGIN
}

/// A route's backstop. A device sync's store write runs to the store's own request timeout
/// (it has no write deadline of its own), then a resent run's read-back takes up to
/// `READ_BACK_BUDGET`: its backstop covers both, so a slow store answers the documented
/// `SYNC_UNVERIFIED`, never the backstop's generic 503 (else with a short
/// `--write-deadline-ms` the backstop would come first).
fn route_deadline(app: &App, route: &Route) -> Duration {
    match route {
        Route::DeviceSync(_) => {
            device_sync_deadline(request_deadline(app), app.config.store_request_timeout())
        }
        _ => request_deadline(app),
    }
}

fn device_sync_deadline(request_deadline: Duration, store_request_timeout: Duration) -> Duration {
    let needs = store_request_timeout + crate::device::ingest::READ_BACK_BUDGET;
    request_deadline.max(needs + DEVICE_SYNC_MARGIN)
}

/// The backstop's answer: nothing is known to have been done, so retry.
fn took_too_long() -> ApiError {
    ApiError::Unavailable("the request took too long; retry it".into())
}

/// Counts a request on a gauge (in flight, queued for a slot, or waiting at the gate) until it
/// is dropped, however it ends: an error, a panic, the backstop, or its client gone while it
/// waited for admission. (Not the write loop's in-flight write, which followers of one key wait on.)
struct InFlightGauge<'a>(&'a prometheus::IntGauge);

impl<'a> InFlightGauge<'a> {
    fn enter(gauge: &'a prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for InFlightGauge<'_> {
    fn drop(&mut self) {
        self.0.dec();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_a_host_and_an_optional_port() {
        for good in [
            "tally",
            "tally:8080",
            "10.0.0.1",
            "10.0.0.1:80",
            "[::1]",
            "[::1]:80",
            "[fe80::1%25eth0]:80",
            "Example.COM.",
            "xn--bcher-kva.example:65535",
        ] {
            assert!(is_host_and_port(good.as_bytes()), "{good}");
        }
        for bad in [
            "",
            ":80",
            "host:",
            "host:abc",
            "host:65536",
            "host:123456",
            "[::1]x",
            "[::1",
            "::1",
            "host:80:80",
            "u@host",
            "a b",
            "a/b",
            "host?",
        ] {
            assert!(!is_host_and_port(bad.as_bytes()), "{bad}");
        }
    }
    use crate::device::ingest::READ_BACK_BUDGET;

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
