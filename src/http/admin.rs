//! `--admin-listen`: `/metrics`, `/healthz` and `/readyz` on an address of their
//! own, so scrapes can stay on an internal network while the API faces callers. Every
//! other path is 404 here; the API listener then answers `/metrics` 404.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::admission::RequestSlots;
use super::error::ApiError;
use super::head::HeadGuard;
use super::router::{self, Route};
use super::serve::{ACCEPT_ERROR_PAUSE, http1_builder};
use super::write_stall::{StallLimited, WriteStall};
use crate::app::App;

/// The most admin connections open at once: scrapers and probes, a handful.
pub const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Serves the admin routes on `listener` until `shutdown` resolves.
pub async fn serve_admin(app: Arc<App>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    let builder = http1_builder(&app.config);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // A client that pipelines probes and reads no answers would otherwise hold one of
        // the few admin connections for as long as it likes.
        let stall = WriteStall::new(
            app.config.http.write_stall(),
            app.metrics.http_write_stalls.clone(),
        );
        let io = StallLimited::new(stream, stall);
        let io = TokioIo::new(HeadGuard::new(io, app.config.http.max_header_bytes));
        let app = app.clone();
        let svc = service_fn(move |req| {
            let app = app.clone();
            async move {
                let resp = match Route::resolve(req.method(), req.uri().path()) {
                    Ok(route @ (Route::Metrics | Route::Healthz | Route::Readyz)) => {
                        router::dispatch(&app, route, req, &RequestSlots::default()).await
                    }
                    Ok(route) => Err(ApiError::NotFound {
                        path: route.template().into(),
                    }),
                    Err(e) => Err(e),
                };
                Ok::<_, Infallible>(resp.unwrap_or_else(ApiError::into_response))
            }
        });
        let conn = builder.serve_connection(io, svc);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "admin connection ended with an error");
            }
        });
    }
}
