//! The API listener: the accept loop (at most `--max-connections` open), each connection's
//! socket under the gate and the head guard, each request handed to the edge's stack
//! (`super::layer`), and graceful shutdown.

use std::future::{Future, poll_fn};
use std::sync::Arc;
use std::time::Duration;

use hyper::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower::Service;

use super::admission::{Edge, RequestSlots};
use super::config::HEADER_READ_TIMEOUT;
use super::peer::Peer;
use super::router::Handed;
use super::{gate, head, layer};
use crate::app::App;

/// hyper's smallest read buffer cap (its `max_buf_size` panics below this).
const MIN_READ_BUFFER_BYTES: usize = 8192;
/// Pause after a failed accept (for example out of file descriptors) before trying again.
pub(super) const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// The HTTP/1 settings both listeners serve with.
pub(super) fn http1_builder(config: &crate::config::Config) -> http1::Builder {
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
    let edge = Arc::new(Edge::new(&app));
    let _ticking = edge.gate.start_ticking();
    let stack = layer::stack(&app, &edge);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = edge.next_connection() => slot,
            _ = &mut shutdown => break,
        };
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok((stream, peer)) => (stream, Peer(peer)),
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (io, gated) =
                    gate::GatedIo::new(stream, edge.gate.clone(), app.config.http.write_stall());
                let io = TokioIo::new(head::HeadGuard::new(io, app.config.http.max_header_bytes));
                let stack = stack.clone();
                let svc = service_fn(move |mut req: Request<Incoming>| {
                    // When hyper hands the request over, before its future is first polled
                    // (rule 4 of the gate): hyper-util's `TowerToHyperService` would call the
                    // stack only once polled, so the hand-over stays here.
                    let serving = gated.serve();
                    let (gated, mut stack) = (gated.clone(), stack.clone());
                    async move {
                        serving.hold_slot().await;
                        req.extensions_mut().insert(peer);
                        poll_fn(|cx| stack.poll_ready(cx)).await?;
                        // The connection's side of the gate goes with the request: for the
                        // body read, which gives the slot back while its client is slow.
                        let slots = RequestSlots::on(gated);
                        stack.call(Handed { req, slots }).await
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
