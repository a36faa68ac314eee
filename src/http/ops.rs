//! Probes and scrapes: `/healthz` (the process answers), `/readyz` (started, not shutting
//! down, and the store answers) and `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use serde_json::json;

use super::body::{Resp, json_response, text_response};
use super::error::ApiError;
use crate::app::App;

/// How long a readiness probe waits for the store.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub fn healthz() -> Resp {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

pub async fn readyz(app: &Arc<App>) -> Result<Resp, ApiError> {
    if app.is_shutting_down() {
        return Err(ApiError::Unavailable("shutting down".into()));
    }
    if !app.is_started() {
        return Err(ApiError::Unavailable(super::STARTING.into()));
    }
    match tokio::time::timeout(READY_PROBE_TIMEOUT, app.log.ping()).await {
        Ok(Ok(())) => Ok(json_response(StatusCode::OK, &json!({"status": "ready"}))),
        Ok(Err(e)) => Err(ApiError::Unavailable(format!("store not reachable: {e}"))),
        Err(_) => Err(ApiError::Unavailable("store did not answer in time".into())),
    }
}

pub fn metrics(app: &App) -> Resp {
    text_response(
        StatusCode::OK,
        "text/plain; version=0.0.4",
        app.metrics.render(),
    )
}
