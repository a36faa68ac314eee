//! `GET /api/accounts/{id}/writes/{idempotencyKey}`: a write looked up by its key, without
//! resending it. A caller that lost a write's answer (a crash, a timeout) asks here whether
//! it landed, and gets the answer the write gave.
//!
//! The key names the same event a write's `Idempotency-Key` header does (with
//! authentication on, the caller's own: another caller's key names another event). The
//! answer is 200 with `{"status", "body"}`: the original answer's status and body. The status
//! of the lookup itself says only that the lookup worked, so a client never mistakes a
//! found 201 for a new account, nor a lookup's own error for the write's.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, StatusCode};
use percent_encoding::percent_decode_str;
use serde_json::json;

use super::answer::{Shown, landed};
use super::error::{ApiError, ErrorCode};
use super::idempotency::IdempotencyKey;
use super::response::{Resp, json_response};
use crate::account::AccountId;
use crate::app::App;
use crate::auth::Caller;
use crate::request_note::RequestNote;
use crate::write_loop::Found;

/// `GET /api/accounts/{id}/writes/{idempotencyKey}`: 200 with the original answer when a
/// write under the key landed on the account within the retention (a transfer from either
/// of its accounts); 404 `KEY_NOT_FOUND` once it is proven that none did; a retryable 409 or
/// 503 while that is not known.
pub async fn find(
    app: &Arc<App>,
    account: AccountId,
    req: &Request<Incoming>,
) -> Result<Resp, ApiError> {
    let caller = req.extensions().get::<Caller>();
    // The route matched `/api/accounts/{id}/writes/{key}`: the key is the last segment.
    let segment = req.uri().path().rsplit('/').next().unwrap_or_default();
    let key = path_key(segment, caller)?;
    RequestNote::key_hash(|| key.short_hash());
    match app
        .writes
        .find_write(account, key.event_id.as_u128())
        .await?
    {
        Found::Landed { op, outcome } => {
            let original = landed(&outcome, Shown::to(caller, &op))?;
            Ok(json_response(
                StatusCode::OK,
                &json!({ "status": original.status.as_u16(), "body": original.body }),
            ))
        }
        Found::NotLanded => Err(ApiError::KeyNotFound(format!(
            "account {account} remembers no write under this key (its horizon is the retention, or less where a cap made it forget sooner); a write sent under it now is a new write"
        ))),
    }
}

/// The key a path segment names: percent-decoded, then read as the `Idempotency-Key` header
/// is (quoted or bare, at most [`super::idempotency::MAX_KEY_LEN`] characters), for the same
/// caller.
fn path_key(segment: &str, caller: Option<&Caller>) -> Result<IdempotencyKey, ApiError> {
    let decoded = percent_decode_str(segment).decode_utf8().map_err(|_| {
        ApiError::bad_request(
            ErrorCode::InvalidIdempotencyKey,
            "the key in the path must be visible ASCII, percent-encoded",
        )
    })?;
    IdempotencyKey::parse(&decoded, caller.map(|c| c.id.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a key in the path names the event its header names, once percent-decoded: the
    /// same key, however it is spelled in the URL.
    #[test]
    fn a_path_key_names_the_event_its_header_names() {
        let header = |k: &str| IdempotencyKey::parse(k, None).unwrap().event_id;
        let path = |s: &str| path_key(s, None).unwrap().event_id;
        assert_eq!(path("order-42"), header("order-42"));
        assert_eq!(path("a%2Fb%3Fc%25"), header("a/b?c%"));
        assert_eq!(path("%22a%20b%22"), header("\"a b\""));
        for bad in ["", "a%20b", "%C3%A9", "%FF", &"k".repeat(256)] {
            let e = path_key(bad, None).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidIdempotencyKey, "{bad:?}");
        }
    }
}
