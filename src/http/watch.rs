//! The watch routes, as server-sent events:
//!
//! - `GET /api/accounts/{id}/events`: every committed event of the account as it lands, from
//!   any writer on any replica. Each event is `event: <type>` (`Deposited`, `Withdrawn`,
//!   `TransferredOut`, `TransferredIn`) and `data:` the history event's JSON plus
//!   `balanceCents` after it and `accountId`; the last event of a batch carries `id:` = the
//!   batch's version, so a reconnect with `Last-Event-ID` (or a first connect with
//!   `?fromVersion=N`) resumes at the next whole batch, without a gap or a duplicate. A
//!   fresh stream starts with `event: snapshot` (version and balance now).
//! - `GET /api/watch/stream`: the replaced service's fleet-wide stream: one unnamed event per
//!   write to any account, `data: {"aggregateId","operation":"Write","toAggregateVersion"}`.
//!
//! Typed control events: `trimmed` (the resume point is below the trim point; the stream
//! goes on from the first available version), and one final event when the replica ends a
//! stream: `lagged` (the client fell behind its buffer), `shutdown`, `gap` (the store's
//! feed lost notifications; reconnect), `expired` (the bearer token it was opened with is no
//! longer accepted; reconnect with a fresh one) or `error`. A `: keep-alive` comment is sent on an
//! idle stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use serde_json::json;
use tokio::sync::mpsc;

use super::accounts::history_event;
use super::admission::RequestSlots;
use super::error::{ApiError, ErrorCode};
use super::gate::Streaming;
use crate::account::AccountId;
use crate::app::App;
use crate::auth::Caller;
use crate::auth::keys::Keys;
use crate::watch::{AccountFrame, EndReason, Item, Resume, WatchError, WriteFrame};

/// Every response's body: a whole JSON (or page) body, or an event stream.
pub type HttpBody = Either<Full<Bytes>, SseBody>;

/// Items put into one chunk when several are ready at once.
const MAX_ITEMS_PER_CHUNK: usize = 64;

/// The most digits a `Last-Event-ID` has (`docs/openapi.json`'s pattern): every version a
/// stream sends fits, with room.
const MAX_EVENT_ID_DIGITS: usize = 19;

/// How long a browser waits before reconnecting a dropped stream, sent first, in ms.
const RETRY_MS: u64 = 1000;

/// `GET /api/accounts/{id}/events[?fromVersion=N]`, resuming after `Last-Event-ID`.
pub async fn account_events(
    app: &Arc<App>,
    account: AccountId,
    req: &Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Response<HttpBody>, ApiError> {
    let resume = resume_point(req)?;
    let sub = app
        .watch
        .subscribe_account(caller_id(req), account, resume)
        .await?;
    Ok(stream_response(
        app,
        sub.items,
        req,
        slots,
        resumed_after(resume),
    ))
}

/// The last version a resumed stream's client holds. A stream that falls behind before it
/// sent anything still says where to resume: where it was asked to (else it
/// would say `null`, and a client that followed it would reconnect from now, past what it had not
/// been sent).
fn resumed_after(resume: Resume) -> Option<u64> {
    match resume {
        Resume::From(from) => Some(from.saturating_sub(1)),
        Resume::Live => None,
    }
}

/// `GET /api/watch/stream`
pub async fn all(
    app: &Arc<App>,
    req: &Request<Incoming>,
    slots: &RequestSlots,
) -> Result<Response<HttpBody>, ApiError> {
    if let Some(q) = req.uri().query().filter(|q| !q.is_empty()) {
        return Err(ApiError::bad_request(
            ErrorCode::BadQuery,
            format!("this stream takes no query parameters, got {q:?}"),
        ));
    }
    let sub = app.watch.subscribe_all(caller_id(req)).await?;
    Ok(stream_response(app, sub.items, req, slots, None))
}

/// Where to start: after `Last-Event-ID` (what a browser sends when it reconnects, so it
/// wins over the `fromVersion` still in the URL), at `?fromVersion=N`, or from now. The
/// query is checked either way: an unknown parameter is refused even next to the header.
fn resume_point(req: &Request<Incoming>) -> Result<Resume, ApiError> {
    let from = from_version(req)?;
    let last_event_id =
        super::headers::at_most_one(req.headers(), "last-event-id").map_err(|_| {
            ApiError::bad_request(
                ErrorCode::BadLastEventId,
                "send one Last-Event-ID header, not several",
            )
        })?;
    if let Some(v) = last_event_id {
        let n = v
            .to_str()
            .ok()
            .map(str::trim)
            // The published pattern: 1 to 19 digits. A longer number names no version a
            // stream sent (else 2^64-1 would be read as a resume point, +1 saturating).
            .filter(|s| (1..=MAX_EVENT_ID_DIGITS).contains(&s.len()))
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::bad_request(
                    ErrorCode::BadLastEventId,
                    "Last-Event-ID must be a version this stream sent (a non-negative integer)",
                )
            })?;
        return Ok(Resume::From(n.saturating_add(1)));
    }
    Ok(from.map_or(Resume::Live, Resume::From))
}

/// `?fromVersion=N`, the stream's one query parameter (at most once).
fn from_version(req: &Request<Incoming>) -> Result<Option<u64>, ApiError> {
    let mut from = None;
    for (name, value) in form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes()) {
        if name != "fromVersion" {
            return Err(ApiError::bad_request(
                ErrorCode::BadQuery,
                format!("unknown query parameter {name:?}; allowed: fromVersion"),
            ));
        }
        if from.is_some() {
            return Err(ApiError::bad_request(
                ErrorCode::BadQuery,
                "fromVersion is given more than once",
            ));
        }
        let n = Some(value.as_ref())
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::bad_request(
                    ErrorCode::BadQuery,
                    format!("fromVersion must be a non-negative integer, got {value:?}"),
                )
            })?;
        from = Some(n.max(1));
    }
    Ok(from)
}

impl From<WatchError> for ApiError {
    fn from(e: WatchError) -> Self {
        match e {
            WatchError::BeyondTip { .. } => {
                ApiError::bad_request(ErrorCode::ResumeBeyondTip, e.to_string())
            }
            WatchError::TooFarBack { .. } => {
                ApiError::bad_request(ErrorCode::ResumeTooFarBack, e.to_string())
            }
            WatchError::CallerFull { .. } => ApiError::Limited {
                code: ErrorCode::TooManyStreams,
                message: e.to_string(),
                retry_after_secs: crate::watch::CALLER_FULL_RETRY_AFTER_SECS,
            },
            WatchError::ReplicaFull { .. }
            | WatchError::AccountFull { .. }
            | WatchError::ShuttingDown
            | WatchError::Store(_) => ApiError::Unavailable(e.to_string()),
        }
    }
}

/// The authenticated caller's id, whose streams are counted together (`None` without
/// authentication: no caller to count).
fn caller_id(req: &Request<Incoming>) -> Option<&str> {
    req.extensions().get::<Caller>().map(|c| c.id.as_str())
}

/// How long the caller's token is still accepted (`None`: no token, or no expiry).
fn token_time_left(req: &Request<Incoming>) -> Option<Duration> {
    req.extensions().get::<Caller>().and_then(Caller::time_left)
}

/// A stream's response; it ends with `event: expired` after `token_left`, when the token
/// it was opened with stops being accepted: access lasts as long as the token, not as long
/// as the connection. `resumed_after` is the version a resumed stream starts after.
fn stream_response(
    app: &App,
    items: mpsc::Receiver<Item>,
    req: &Request<Incoming>,
    slots: &RequestSlots,
    resumed_after: Option<u64>,
) -> Response<HttpBody> {
    // Rule 6 of the gate: the stream gives its slot back and its reads take none.
    let streaming = slots.conn.as_ref().map(|conn| conn.stream_started());
    let mut resp = Response::new(Either::Right(SseBody {
        items,
        preamble: true,
        expires: token_time_left(req).map(|left| Box::pin(tokio::time::sleep(left))),
        key: KeyWatch::of(app, req),
        last_id: resumed_after,
        told_end: false,
        expired: false,
        streaming,
    }));
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    super::response::no_sniff(h);
    // nginx: pass each event on at once instead of filling a buffer first.
    h.insert(
        HeaderName::from_static("x-accel-buffering"),
        HeaderValue::from_static("no"),
    );
    resp
}

/// A stream's body: its subscription's items as SSE text. Dropped when the client goes
/// away, which ends the subscription.
pub struct SseBody {
    items: mpsc::Receiver<Item>,
    preamble: bool,
    /// When the token the stream was opened with stops being accepted.
    expires: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The key the stream's token was checked with, watched for revocation.
    key: Option<KeyWatch>,
    /// The id of the last event or snapshot written to the body.
    last_id: Option<u64>,
    /// A final event went out: the subscription ended with a reason.
    told_end: bool,
    /// The `expired` event was sent: the body ends.
    expired: bool,
    /// Keeps the connection's reads off the gate while the stream lasts, and tells when its
    /// client hung up.
    streaming: Option<Streaming>,
}

/// A stream's token key, checked again whenever the key set changed: a JWKS reload that
/// removes the key (revokes it) ends the stream, as it refuses every new request.
struct KeyWatch {
    keys: Arc<Keys>,
    caller: Caller,
    /// The key set's generation last checked against.
    generation: u64,
}

impl KeyWatch {
    fn of(app: &App, req: &Request<Incoming>) -> Option<KeyWatch> {
        Some(KeyWatch {
            keys: app.auth.keys()?.clone(),
            caller: req.extensions().get::<Caller>()?.clone(),
            // Checked at the first item: a reload may have come since the token's check.
            generation: u64::MAX,
        })
    }

    fn revoked(&mut self) -> bool {
        let now = self.keys.generation();
        if now == self.generation {
            return false;
        }
        self.generation = now;
        !self.caller.key_still_in(&self.keys)
    }
}

impl SseBody {
    /// Why the stream's token no longer holds (run out, or its key revoked), if it does not.
    fn token_ended(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Option<&'static str> {
        let expired = self
            .expires
            .as_mut()
            .is_some_and(|expires| expires.as_mut().poll(cx).is_ready());
        if expired {
            return Some(
                "the bearer token this stream was opened with has expired; reconnect with a fresh one (Last-Event-ID resumes)",
            );
        }
        let revoked = self.key.as_mut().is_some_and(KeyWatch::revoked);
        revoked.then_some(
            "the key that signed this stream's token is no longer accepted; reconnect with a fresh token (Last-Event-ID resumes)",
        )
    }

    /// Encodes into `chunk` the items ready now, at most [`MAX_ITEMS_PER_CHUNK`]; whether the
    /// subscription ended.
    fn drain_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>, chunk: &mut BytesMut) -> bool {
        for _ in 0..MAX_ITEMS_PER_CHUNK {
            match self.items.poll_recv(cx) {
                Poll::Ready(Some(item)) => {
                    match &item {
                        Item::Events(frame) => self.last_id = Some(frame.version),
                        Item::Snapshot { version, .. } => self.last_id = Some(*version),
                        Item::End(_) => self.told_end = true,
                        _ => {}
                    }
                    encode(&item, chunk);
                }
                Poll::Ready(None) => return true,
                Poll::Pending => return false,
            }
        }
        false
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.expired {
            return Poll::Ready(None);
        }
        // A client that hung up ends its stream (and its subscription) at once.
        if self
            .streaming
            .as_ref()
            .is_some_and(|s| s.poll_client_gone(cx))
        {
            return Poll::Ready(None);
        }
        let mut chunk = BytesMut::new();
        if std::mem::take(&mut self.preamble) {
            chunk.extend_from_slice(format!("retry: {RETRY_MS}\n\n").as_bytes());
        }
        // Nothing more once the token has run out, or its key was revoked, however much is
        // ready. A revocation is seen at the stream's next item: a keep-alive at the latest.
        if let Some(message) = self.as_mut().token_ended(cx) {
            self.expired = true;
            let data = json!({ "message": message });
            chunk.extend_from_slice(format!("event: expired\ndata: {data}\n\n").as_bytes());
            return Poll::Ready(Some(Ok(Frame::data(chunk.freeze()))));
        }
        let ended = self.as_mut().drain_ready(cx, &mut chunk);
        // A subscription that ended without a final event gave up on a client that took
        // nothing for its stall limit (its final event could not be handed over either):
        // the client, reading again, is told it fell behind and where to resume.
        if ended && !self.told_end {
            self.told_end = true;
            let last_version = self.last_id;
            encode(&Item::End(EndReason::Lagged { last_version }), &mut chunk);
        }
        if !chunk.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(chunk.freeze()))));
        }
        if ended {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

/// Appends one item's SSE text.
fn encode(item: &Item, out: &mut BytesMut) {
    match item {
        Item::Events(frame) => out.extend_from_slice(frame.encoded.get_or_init(|| events(frame))),
        Item::Write(frame) => out.extend_from_slice(frame.encoded.get_or_init(|| write(frame))),
        Item::Snapshot {
            account,
            version,
            balance_cents,
        } => {
            let data = json!({
                "accountId": account.to_string(),
                "aggregateVersion": version,
                "balanceCents": balance_cents,
            });
            out.extend_from_slice(
                format!("id: {version}\nevent: snapshot\ndata: {data}\n\n").as_bytes(),
            );
        }
        Item::Trimmed {
            from_version,
            first_available,
        } => {
            let data = json!({
                "fromVersion": from_version,
                "firstAvailableVersion": first_available,
                "message": "the stream is trimmed below firstAvailableVersion; it goes on from there",
            });
            out.extend_from_slice(format!("event: trimmed\ndata: {data}\n\n").as_bytes());
        }
        Item::KeepAlive => out.extend_from_slice(b": keep-alive\n\n"),
        Item::End(reason) => {
            let (event, data) = end(reason);
            out.extend_from_slice(format!("event: {event}\ndata: {data}\n\n").as_bytes());
        }
    }
}

/// A batch: one SSE event per event, the last carrying the batch's version as its id.
fn events(frame: &AccountFrame) -> Bytes {
    let mut out = String::new();
    let last = frame.entries.len().saturating_sub(1);
    for (i, entry) in frame.entries.iter().enumerate() {
        let mut data = history_event(&entry.history);
        data["balanceCents"] = json!(entry.balance_cents);
        data["accountId"] = json!(frame.account.to_string());
        if i == last {
            out.push_str(&format!("id: {}\n", frame.version));
        }
        out.push_str(&format!(
            "event: {}\ndata: {data}\n\n",
            entry.history.event.name()
        ));
    }
    Bytes::from(out)
}

/// The replaced service's shape, as an unnamed event (its clients listen on `message`).
fn write(frame: &WriteFrame) -> Bytes {
    let data = json!({
        "aggregateId": frame.account.to_string(),
        "operation": "Write",
        "toAggregateVersion": frame.version,
    });
    Bytes::from(format!("data: {data}\n\n"))
}

fn end(reason: &EndReason) -> (&'static str, serde_json::Value) {
    match reason {
        EndReason::Lagged { last_version } => (
            "lagged",
            json!({
                "lastEventId": last_version,
                "message": "this stream fell behind its buffer and was closed; reconnect with Last-Event-ID to resume",
            }),
        ),
        EndReason::Shutdown => (
            "shutdown",
            json!({"message": "the replica is shutting down; reconnect to resume"}),
        ),
        EndReason::FeedGap => (
            "gap",
            json!({"message": "the replica may have missed writes; reconnect (an account stream resumes with Last-Event-ID)"}),
        ),
        EndReason::StoreError(message) => (
            "error",
            json!({"error": ErrorCode::StoreUnavailable.as_str(), "message": message}),
        ),
        EndReason::Unreadable { version, reason } => (
            "error",
            json!({"error": ErrorCode::AccountUnreadable.as_str(), "message": format!("version {version}: {reason}")}),
        ),
    }
}

#[cfg(test)]
#[path = "watch_spec.rs"]
mod spec;

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use uuid::Uuid;

    /// A stream's body over `items`, with no token, key or gate.
    pub(super) fn body(items: mpsc::Receiver<Item>) -> SseBody {
        resumed_body(items, None)
    }

    fn resumed_body(items: mpsc::Receiver<Item>, last_id: Option<u64>) -> SseBody {
        SseBody {
            items,
            preamble: true,
            expires: None,
            key: None,
            last_id,
            told_end: false,
            expired: false,
            streaming: None,
        }
    }

    pub(super) async fn text(body: SseBody) -> String {
        let bytes = body.collect().await.expect("infallible").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    }

    fn snapshot(version: u64) -> Item {
        Item::Snapshot {
            account: AccountId(Uuid::from_u128(1)),
            version,
            balance_cents: Some(5),
        }
    }

    /// Rule: a stream whose subscription ended without a final event (it gave up on a client
    /// that took nothing, and could not hand the final event over either) ends with
    /// `event: lagged` and the last id the client was sent, so the client knows to resume.
    #[tokio::test]
    async fn a_subscription_that_ends_without_a_reason_tells_the_client_it_fell_behind() {
        let (tx, rx) = mpsc::channel(8);
        tx.send(snapshot(7)).await.unwrap();
        drop(tx);
        let out = text(body(rx)).await;
        assert!(out.contains("event: snapshot"), "{out}");
        assert!(
            out.ends_with("event: lagged\ndata: {\"lastEventId\":7,\"message\":\"this stream fell behind its buffer and was closed; reconnect with Last-Event-ID to resume\"}\n\n"),
            "{out}"
        );
        // A subscription that ended with its reason is not told twice.
        let (tx, rx) = mpsc::channel(8);
        tx.send(snapshot(3)).await.unwrap();
        tx.send(Item::End(EndReason::Shutdown)).await.unwrap();
        drop(tx);
        let out = text(body(rx)).await;
        assert!(out.ends_with("event: shutdown\ndata: {\"message\":\"the replica is shutting down; reconnect to resume\"}\n\n"), "{out}");
        assert!(!out.contains("lagged"), "{out}");
    }

    /// Rule: a resumed stream that ends as lagged before it sent anything names the resume
    /// point its client asked for, never `null` (a client following `null` would reconnect
    /// from now, past what it was never sent).
    #[tokio::test]
    async fn a_resumed_stream_that_lags_before_sending_anything_names_its_resume_point() {
        assert_eq!(resumed_after(Resume::From(42)), Some(41));
        assert_eq!(resumed_after(Resume::From(1)), Some(0));
        assert_eq!(resumed_after(Resume::Live), None);
        let (tx, rx) = mpsc::channel(8);
        drop(tx);
        let out = text(resumed_body(rx, resumed_after(Resume::From(42)))).await;
        assert!(
            out.contains(
                r#"event: lagged
data: {"lastEventId":41,"#
            ),
            "{out}"
        );
    }
}
