//! Probes and scrapes: `/healthz` (the process answers), `/readyz` (started, not shutting
//! down, and the store answers) and `/metrics`.
//!
//! A `/readyz` that is not ready answers 503 with the API's JSON error (`error`, `message`,
//! `Retry-After`) plus `status`, which says which check failed: `shuttingDown`, `starting`
//! (with `waiting`, the start-up steps still pending) or `storeUnreachable`.

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use serde_json::json;

use super::error::ApiError;
use super::response::{Resp, json_response, text_response};
use crate::app::App;

/// How long a readiness probe waits for the store.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub fn healthz() -> Resp {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

pub async fn readyz(app: &Arc<App>) -> Result<Resp, ApiError> {
    if app.is_shutting_down() {
        return Ok(not_ready(
            "shuttingDown",
            ApiError::Unavailable("shutting down".into()),
            None,
        ));
    }
    let waiting = app.startup_waiting();
    if !waiting.is_empty() {
        return Ok(not_ready(
            "starting",
            ApiError::starting(&waiting),
            Some(waiting),
        ));
    }
    // One ping a second at most, however many probes ask (`SharedPing`).
    let Err(unreachable) = app
        .store_ping
        .ping(app.log.as_ref(), READY_PROBE_TIMEOUT)
        .await
    else {
        return Ok(json_response(StatusCode::OK, &json!({"status": "ready"})));
    };
    Ok(not_ready(
        "storeUnreachable",
        ApiError::Unavailable(unreachable),
        None,
    ))
}

/// The error's own response (status, JSON error body, `Retry-After`), with `status` (and,
/// while starting, `waiting`) added to the body.
fn not_ready(status: &'static str, err: ApiError, waiting: Option<Vec<String>>) -> Resp {
    let mut body =
        json!({ "status": status, "error": err.code().as_str(), "message": err.to_string() });
    if let Some(waiting) = waiting {
        body["waiting"] = json!(waiting);
    }
    let status = err.status();
    let mut resp = json_response(status, &body);
    // The error's own headers (`Retry-After`), on the body above.
    for (name, value) in err.into_response().headers() {
        resp.headers_mut().insert(name, value.clone());
    }
    resp
}

pub fn metrics(app: &App) -> Resp {
    text_response(
        StatusCode::OK,
        "text/plain; version=0.0.4",
        app.metrics.render(),
    )
}
