//! Admission at the HTTP edge: how many connections are open and how many API requests are
//! served at once, and what the rest are told.
//!
//! Overload is handled the way HTTP/2 and gRPC servers bound concurrent streams: by making
//! the excess wait where waiting costs nothing, and refusing only what waited too long.
//! - **Connections**: at `--max-connections` the accept loop stops, so further clients wait
//!   in the kernel's accept queue (no task, no buffers, no CPU here) until one closes.
//! - **Requests**: past `--max-concurrent-requests` a request waits for a slot, first come
//!   first served, before its body is read and before any work is done for it, for at most
//!   `--max-queue-wait-ms`; then it is refused with 503, Retry-After and `Connection: close`.
//!
//! Refusing at once instead (the former behaviour, still `--max-queue-wait-ms 0`) collapses
//! goodput when clients re-send at once: each refusal costs about as much CPU as serving a
//! request (the loopback round trip dominates it), so the refused clients spin and crowd
//! out the admitted ones. Waiting holds them for free; closing the connection of a request
//! that did wait its full time sends its client to the back of the accept queue.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::InFlightGauge;
use super::error::ApiError;
use crate::app::App;
use crate::metrics::Metrics;

/// What a shed request is told.
pub(crate) const SHED: &str = "too many requests in flight; retry shortly";

/// An in-flight slot for one API request, waiting for it as configured. A refusal is
/// counted in `tally_http_requests_shed_total` here.
pub(crate) async fn admit(app: &App) -> Result<OwnedSemaphorePermit, ApiError> {
    let metrics = &app.metrics;
    if let Ok(permit) = app.limiter.clone().try_acquire_owned() {
        return Ok(permit);
    }
    let max_wait = app.config.max_queue_wait();
    let waited = if max_wait.is_zero() {
        None
    } else {
        let _queued = InFlightGauge::enter(&metrics.http_queued);
        let since = Instant::now();
        // The semaphore queues waiters in arrival order; a request whose client goes away
        // drops this future and leaves the queue.
        let permit = tokio::time::timeout(max_wait, app.limiter.clone().acquire_owned()).await;
        metrics
            .http_queue_wait
            .observe(since.elapsed().as_secs_f64());
        // The limiter is never closed: an error can only be the timeout.
        permit.ok().and_then(Result::ok)
    };
    waited.ok_or_else(|| {
        metrics.http_shed.inc();
        ApiError::Overloaded(SHED.into())
    })
}

/// The connection cap: one slot per open connection, held by its task.
pub(crate) struct ConnectionSlots {
    slots: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

/// One open connection's slot; gives it back (and updates the gauge) when dropped.
pub(crate) struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl ConnectionSlots {
    pub fn new(max_connections: usize, metrics: Arc<Metrics>) -> Self {
        ConnectionSlots {
            slots: Arc::new(Semaphore::new(max_connections)),
            metrics,
        }
    }

    /// A slot for the next connection, waiting (and counting the pause) while every slot is
    /// taken. Accept is not called meanwhile, so new clients wait in the kernel.
    pub async fn next(&self) -> ConnectionSlot {
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                self.metrics.http_accept_paused.inc();
                tracing::debug!("at the connection cap: not accepting until one closes");
                self.slots
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
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.metrics.http_connections.dec();
    }
}
