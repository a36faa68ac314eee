//! Admission at the HTTP edge: how many connections are open and how many API requests are
//! served at once, and what the rest are told.
//!
//! In front of the in-flight limit below stands the gate (`super::gate`), which bounds the
//! requests worked on at once *before they are read*, adaptively. A request reaches this
//! limit when its gate wait ran out, when it was let through unread on purpose, or when the
//! gate's ceiling is configured above `--max-concurrent-requests`.
//!
//! Overload is handled the way HTTP/2 and gRPC servers bound concurrent streams: the excess
//! waits where waiting costs nothing, and only what waited too long is refused.
//! - **Connections**: at `--max-connections` the accept loop stops, so further clients wait
//!   in the kernel's accept queue (no task, no buffers, no CPU here) until one closes.
//! - **Requests**: past `--max-concurrent-requests` a request waits for a slot, first come
//!   first served, before its body is read and before any work is done for it, for at most
//!   `--max-queue-wait-ms`; then it is shed with 503 and Retry-After. At the connection cap
//!   the answer also closes the connection, so its client goes to the back of the accept
//!   queue and a waiting client gets the slot (below the cap a reconnect would only double
//!   the refusal's cost).
//!
//! Refusing at once instead (the former behaviour, still `--max-queue-wait-ms 0`) collapses
//! goodput when clients re-send at once: a refusal costs a third to a half of a served
//! request's CPU (the loopback round trip dominates it), so refused clients spin and crowd
//! out admitted ones. Shed requests are logged one by one at debug only, with a warning at
//! most once per [`crate::log_limit::REPORT_INTERVAL`]: the access-log line alone is a
//! quarter of a refusal's cost.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::config::HEADER_READ_TIMEOUT;
use super::error::ApiError;
use super::gate::{ConnSlot, Gate};
use super::gauge::InFlightGauge;
use crate::app::App;
use crate::log_limit::LogLimit;
use crate::metrics::Metrics;

/// How long a request's body may take to arrive before its in-flight slot is given back for
/// the wait: longer than a second segment or an `Expect: 100-continue` round trip takes on
/// a network, far shorter than a client trickling its body holds it.
pub const SLOW_BODY_GRACE: Duration = Duration::from_millis(20);

/// The edge's own state, shared by the accept loop and every request.
pub struct Edge {
    /// Requests worked on at once, taken before a request is read (see `gate`).
    pub gate: Arc<Gate>,
    /// One permit per open connection.
    connections: Arc<Semaphore>,
    metrics: Arc<Metrics>,
    /// Shedding is reported at most once per interval.
    shed_log: LogLimit,
}

/// One open connection's slot; gives it back (and updates the gauge) when dropped.
pub struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.metrics.http_connections.dec();
    }
}

impl Edge {
    pub fn new(app: &App) -> Self {
        Edge {
            gate: Gate::new(
                app.config.http.min_active_requests,
                app.config.http.max_active_requests,
                // Past this a request is read without a slot, and the in-flight limit
                // decides; under half the head-read timeout, which would close the
                // connection unanswered.
                app.config
                    .http
                    .max_queue_wait()
                    .min(HEADER_READ_TIMEOUT / 2),
                app.metrics.clone(),
            ),
            connections: Arc::new(Semaphore::new(app.config.http.max_connections)),
            metrics: app.metrics.clone(),
            shed_log: LogLimit::new(crate::log_limit::REPORT_INTERVAL),
        }
    }

    /// A slot for the next connection, waiting (and counting the pause) while every slot is
    /// taken. Accept is not called meanwhile, so new clients wait in the kernel.
    pub async fn next_connection(&self) -> ConnectionSlot {
        let permit = match self.connections.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                self.metrics.http_accept_paused.inc();
                tracing::debug!("at the connection cap: not accepting until one closes");
                self.connections
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the connection slots are never closed")
            }
        };
        self.metrics.http_connections.inc();
        ConnectionSlot {
            _permit: permit,
            metrics: self.metrics.clone(),
        }
    }

    /// An in-flight slot for one API request, waiting for it as configured. A refusal is
    /// counted in `tally_http_requests_shed_total` and reported (see [`Edge::note_shed`]).
    pub async fn admit(
        &self,
        app: &App,
        conn: Option<&Arc<ConnSlot>>,
    ) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(permit) = app.limiter.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let max_wait = app.config.http.max_queue_wait();
        if !max_wait.is_zero() {
            let _queued = InFlightGauge::enter(&self.metrics.http_queued);
            let since = Instant::now();
            // The semaphore queues waiters in arrival order; a request whose client goes away
            // leaves the queue (nothing has been done for it yet).
            let wait = tokio::time::timeout(max_wait, app.limiter.clone().acquire_owned());
            let waited = match conn {
                Some(conn) => tokio::select! {
                    waited = wait => waited,
                    _ = conn.client_gone() => {
                        self.metrics.http_shed.inc();
                        return Err(ApiError::Shed { close_connection: true });
                    }
                },
                None => wait.await,
            };
            self.metrics
                .http_queue_wait
                .observe(since.elapsed().as_secs_f64());
            // The limiter is never closed: an error can only be the timeout.
            if let Ok(Ok(permit)) = waited {
                return Ok(permit);
            }
        }
        self.metrics.http_shed.inc();
        self.note_shed();
        Err(ApiError::Shed {
            close_connection: self.connections.available_permits() == 0,
        })
    }

    /// Counts one shed request and, at most once per interval, warns with the number shed
    /// since the last warning.
    fn note_shed(&self) {
        if let Some(report) = self.shed_log.occurred() {
            tracing::warn!(
                shed = report.count,
                since_ms = report.since_ms,
                "shedding load: requests waited --max-queue-wait-ms for an in-flight slot and were refused"
            );
        }
    }
}

/// What a request holds at the edge, handed down explicitly from the accept loop through
/// the layers to the handlers: its connection's side of the gate (none on the admin
/// listener) and, once admitted, its in-flight slot. The body read gives both back while
/// its client is slow (`body::read_json`); an event stream gives the gate's back for as
/// long as it lasts.
#[derive(Clone, Default)]
pub struct RequestSlots {
    pub conn: Option<Arc<ConnSlot>>,
    pub in_flight: Option<Arc<InFlight>>,
}

impl RequestSlots {
    /// A request's slots on `conn`, before its admission.
    pub fn on(conn: Arc<ConnSlot>) -> Self {
        RequestSlots {
            conn: Some(conn),
            in_flight: None,
        }
    }
}

/// An admitted API request's in-flight slot. Like the gate's slot (rule 5), it is given back
/// while the handler waits on its client for the rest of the body, and taken again after, so
/// clients that trickle their bodies cannot hold the in-flight limit against everyone else.
pub struct InFlight {
    edge: Arc<Edge>,
    app: Arc<App>,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

impl InFlight {
    /// Admits one API request (see [`Edge::admit`]).
    pub async fn admit(
        edge: &Arc<Edge>,
        app: &Arc<App>,
        conn: Option<&Arc<ConnSlot>>,
    ) -> Result<Arc<Self>, ApiError> {
        let permit = edge.admit(app, conn).await?;
        Ok(Arc::new(InFlight {
            edge: edge.clone(),
            app: app.clone(),
            permit: Mutex::new(Some(permit)),
        }))
    }

    /// Runs `body` (a read of the request's body). A body that has not arrived within
    /// [`SLOW_BODY_GRACE`] (a second TCP segment, or the round trip of `Expect:
    /// 100-continue`, comes sooner) is waited for without the slot; taking the slot again
    /// after waits, or is shed, like any admission. A read that failed needs no slot: its
    /// error is the answer.
    pub async fn while_client_sends<F, T, E>(&self, body: F) -> Result<Result<T, E>, ApiError>
    where
        F: Future<Output = Result<T, E>>,
    {
        let mut body = pin!(body);
        if let Ok(done) = tokio::time::timeout(SLOW_BODY_GRACE, body.as_mut()).await {
            return Ok(done);
        }
        let had = self.permit.lock().take().is_some();
        let done = body.await;
        if had && done.is_ok() {
            let permit = self.edge.admit(&self.app, None).await?;
            *self.permit.lock() = Some(permit);
        }
        Ok(done)
    }
}
