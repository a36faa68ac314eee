//! `POST /api/devices/{deviceId}/sync`: the one path by which a device's client id reaches
//! the store. It parses the run and hands it to the device layer ([`crate::device::ingest`]),
//! which writes it under the device's id with enforced idempotency and no expected version;
//! errors map to HTTP in [`super::error`].

use std::sync::Arc;

use hyper::Request;
use hyper::StatusCode;
use hyper::body::Incoming;
use uuid::Uuid;

use super::admission::RequestSlots;
use super::body::read_json;
use super::error::{ApiError, ErrorCode};
use super::response::{Resp, json_response};
use crate::app::App;
use crate::auth::Caller;
use crate::device::protocol::{SyncRequest, SyncStatus};
use crate::metrics::device_outcome;

pub async fn sync(
    app: &Arc<App>,
    device: Uuid,
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Resp, ApiError> {
    // A token that lists accounts may sync only runs of those.
    let caller = req.extensions().get::<Caller>().cloned();
    let body: SyncRequest = read_json(req, slots).await?;
    if let Ok(account) = Uuid::try_parse(&body.account_id) {
        super::auth::authorize_account(app, caller.as_ref(), account)?;
    }
    refuse_over_limit(app.config.device_max_run_withdrawal_cents, &body)?;
    let events = body.events.len() as u64;
    let m = &app.metrics;
    match app.devices.handle(&device.to_string(), &body).await {
        Ok(resp) => {
            let outcome = match resp.status {
                SyncStatus::Synced => device_outcome::SYNCED,
                SyncStatus::AlreadySynced => device_outcome::ALREADY_SYNCED,
            };
            m.device_sync_runs.with_label_values(&[outcome]).inc();
            m.device_sync_events.inc_by(events);
            Ok(json_response(StatusCode::OK, &resp))
        }
        Err(e) => {
            let outcome = if e.is_invalid_request() {
                device_outcome::REFUSED
            } else if e.is_conflict() {
                device_outcome::CONFLICT
            } else {
                device_outcome::RETRY
            };
            m.device_sync_runs.with_label_values(&[outcome]).inc();
            Err(e.into())
        }
    }
}

/// Refuses a run whose withdrawals add up to more than `limit` cents (0: no limit), before
/// anything of it is written. Offline there is no balance to check, so this is how an
/// operator bounds what one run of one device can take; the token's account list bounds
/// which accounts it can take it from.
fn refuse_over_limit(limit: u64, run: &SyncRequest) -> Result<(), ApiError> {
    if limit == 0 {
        return Ok(());
    }
    // Amounts are positive and bounded (the run's own checks refuse others); saturating,
    // a sum past u64 is over any limit.
    let withdrawn = run
        .events
        .iter()
        .filter(|e| e.kind == "withdraw")
        .fold(0u64, |sum, e| {
            sum.saturating_add(u64::try_from(e.amount_cents).unwrap_or(0))
        });
    if withdrawn <= limit {
        return Ok(());
    }
    Err(ApiError::Unprocessable {
        code: ErrorCode::DeviceRunOverLimit,
        message: format!(
            "this run withdraws {withdrawn} cents, more than a device run may ({limit}, --device-max-run-withdrawal-cents); nothing was written"
        ),
    })
}
