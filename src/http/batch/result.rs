//! An item's result, and the batch's answer written from them.
//!
//! An item's body is what its single route answered, already JSON. It goes into the batch's
//! answer as written, never read back into a tree and written again: that round trip cost
//! more instructions than the item's own write (BENCHMARKS.md, "Batches"). The answer is
//! written by hand around those bodies, since serde_json embeds ready JSON only with a
//! feature this build does not enable; every other value in it goes through serde_json.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use hyper::{Response, StatusCode};
use serde::de::IgnoredAny;

use super::super::idempotency;
use super::super::response::{Resp, no_sniff};

const KEY: HeaderName = idempotency::KEY_NAME;
const REPLAYED: HeaderName = idempotency::REPLAYED_NAME;
const WINDOW: HeaderName = idempotency::WINDOW_NAME;
const RETENTION: HeaderName = idempotency::RETENTION_NAME;

/// One item's result: the status and body its single route answered, and what that
/// answer's headers said of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ItemResult {
    pub status: u16,
    /// The route's body as it wrote it; `None` when it was not JSON (written as `null`).
    pub body: Option<Bytes>,
    pub replayed: bool,
    pub key: Option<String>,
    pub window: Option<u64>,
    pub retention: Option<u64>,
    pub retry_after: Option<u64>,
}

impl ItemResult {
    /// The result of a single route's answer.
    pub async fn of(resp: Resp) -> Self {
        let (parts, body) = resp.into_parts();
        let bytes = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(never) => match never {},
        };
        // Checked, not trusted: a body that is not JSON must not break the answer around it.
        let body = serde_json::from_slice::<IgnoredAny>(&bytes)
            .is_ok()
            .then_some(bytes);
        let headers = &parts.headers;
        let text = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        let number = |name: &HeaderName| text(name).and_then(|v| v.parse::<u64>().ok());
        ItemResult {
            status: parts.status.as_u16(),
            body,
            replayed: text(&REPLAYED) == Some("true"),
            key: text(&KEY).map(str::to_owned),
            window: number(&WINDOW),
            retention: number(&RETENTION),
            retry_after: number(&RETRY_AFTER),
        }
    }

    /// The label this item's status is counted under.
    pub fn class(&self) -> &'static str {
        match self.status {
            200..=299 => "2xx",
            409 => "409",
            503 => "503",
            400..=499 => "4xx",
            _ => "5xx",
        }
    }

    /// This result as one JSON object, appended to `out`.
    fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"status\":");
        write_value(out, &self.status);
        out.extend_from_slice(b",\"body\":");
        match &self.body {
            Some(body) => out.extend_from_slice(body),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"replayed\":");
        write_value(out, &self.replayed);
        if let Some(key) = &self.key {
            out.extend_from_slice(b",\"idempotencyKey\":");
            write_value(out, key);
        }
        let numbers = [
            (&b",\"idempotencyWindow\":"[..], self.window),
            (b",\"idempotencyRetention\":", self.retention),
            (b",\"retryAfter\":", self.retry_after),
        ];
        for (name, value) in numbers {
            if let Some(value) = value {
                out.extend_from_slice(name);
                write_value(out, &value);
            }
        }
        out.push(b'}');
    }
}

/// One value as serde_json writes it (escaped, numbers without `fmt`).
fn write_value(out: &mut Vec<u8>, value: &impl serde::Serialize) {
    // Writing a plain value into a Vec cannot fail.
    let written = serde_json::to_writer(&mut *out, value);
    debug_assert!(written.is_ok(), "a plain value failed to serialise");
}

/// The batch's answer: 200 `{"results":[...]}` in item order, with the longest wait any
/// retryable item asks for as its `Retry-After`, so a client that resends the open items
/// together waits enough for each.
pub(super) fn answer(results: &[ItemResult]) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(results_json(results))));
    let headers: &mut HeaderMap = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    no_sniff(headers);
    if let Some(after) = results.iter().filter_map(|r| r.retry_after).max() {
        headers.insert(RETRY_AFTER, HeaderValue::from(after));
    }
    *resp.status_mut() = StatusCode::OK;
    resp
}

/// `{"results":[...]}`, each result as [`ItemResult::write_json`] writes it.
fn results_json(results: &[ItemResult]) -> Vec<u8> {
    // About what an item's fields besides its body take, so the buffer rarely grows.
    const FIELDS_BYTES: usize = 160;
    let bodies: usize = results
        .iter()
        .map(|r| r.body.as_ref().map_or(4, Bytes::len))
        .sum();
    let mut out = Vec::with_capacity(16 + bodies + results.len() * FIELDS_BYTES);
    out.extend_from_slice(b"{\"results\":[");
    for (i, result) in results.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        result.write_json(&mut out);
    }
    out.extend_from_slice(b"]}");
    out
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::http::response::json_response;

    fn answered(status: StatusCode, body: &Value, headers: &[(&HeaderName, &str)]) -> Resp {
        let mut resp = json_response(status, body);
        for (name, value) in headers {
            let value = HeaderValue::from_str(value).expect("a header value");
            resp.headers_mut().insert(*name, value);
        }
        resp
    }

    /// Rule: an item's result carries its route's status and body unchanged, its key as the
    /// route echoed it (escaped as JSON needs), and only the horizons the route stated; the
    /// answer is JSON that reads back as those values.
    #[tokio::test]
    async fn a_result_carries_the_routes_status_body_and_key_headers_as_json() {
        let landed = json!({"accountId": "a", "balanceCents": 7, "note": "quote \" and \\ é"});
        let key = "k\"ey\\with-quote";
        let first = ItemResult::of(answered(
            StatusCode::OK,
            &landed,
            &[
                (&KEY, key),
                (&REPLAYED, "true"),
                (&WINDOW, "86400"),
                (&RETENTION, "3600"),
            ],
        ))
        .await;
        let refused = json!({"error": "SERVICE_UNAVAILABLE", "message": "retry"});
        let second = ItemResult::of(answered(
            StatusCode::SERVICE_UNAVAILABLE,
            &refused,
            &[(&RETRY_AFTER, "2")],
        ))
        .await;
        let resp = answer(&[first.clone(), second.clone()]);
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[RETRY_AFTER], "2");
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
        let bytes = resp.into_body().collect().await.expect("a body").to_bytes();
        let read: Value = serde_json::from_slice(&bytes).expect("the answer is JSON");
        assert_eq!(
            read,
            json!({"results": [
                {"status": 200, "body": landed, "replayed": true, "idempotencyKey": key,
                 "idempotencyWindow": 86400, "idempotencyRetention": 3600},
                {"status": 503, "body": refused, "replayed": false, "retryAfter": 2},
            ]})
        );
        assert_eq!((first.class(), second.class()), ("2xx", "503"));
    }

    /// Rule: a route's body that is not JSON is written as `null`, never spliced into the
    /// answer, so the answer stays JSON.
    #[tokio::test]
    async fn a_body_that_is_not_json_is_null() {
        let mut resp = Response::new(Full::new(Bytes::from_static(b"{\"cut\":")));
        *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        let result = ItemResult::of(resp).await;
        assert_eq!(result.body, None);
        let bytes = answer(&[result])
            .into_body()
            .collect()
            .await
            .expect("a body")
            .to_bytes();
        let read: Value = serde_json::from_slice(&bytes).expect("the answer is JSON");
        assert_eq!(read["results"][0]["body"], Value::Null);
        assert_eq!(read["results"][0]["status"], 500);
    }
}
