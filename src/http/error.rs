//! Every error the API answers, and the one place it becomes a status, a JSON body
//! `{"error":"CODE","message":"..."}` and headers.

use hyper::StatusCode;
use hyper::header::{ALLOW, CONNECTION, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use serde_json::json;
use uuid::Uuid;

use super::response::{Resp, json_response};
use crate::account::RuleError;
use crate::auth::{AuthError, REALM};
use crate::device::error::{DeviceSyncError, SyncCode};
use crate::log_limit::{LogLimit, REPORT_INTERVAL};
use crate::projection::ProjectionError;
use crate::reader::ReadError;
use crate::store::StoreError;
use crate::write_loop::WriteError;

/// What a request to a replica that has not finished starting is told, before the steps
/// it waits for.
const STARTING: &str = "starting: not serving until its start-up steps are done";

/// Seconds a client should wait before retrying a retryable error.
const RETRY_AFTER_SECS: &str = "1";
/// Seconds a client should wait while the store cannot be reached: an outage outlasts a
/// shed request, and every retry during it is one more call against a store that is gone.
const STORE_RETRY_AFTER_SECS: &str = "2";

/// Store failures answered as a plain 503 are logged with their detail at most once per
/// interval; the answer itself carries a fixed phrase.
static STORE_FAILURE_LINES: LogLimit = LogLimit::new(REPORT_INTERVAL);

/// Every code an error answer's `error` field carries. An answer's status is its code's
/// ([`ErrorCode::status`]), the one table from codes to HTTP; the [`ApiError`] variant that
/// carries the code adds the headers and fields that go with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    // 400: the request is malformed.
    BadRequest,
    InvalidJson,
    InvalidId,
    InvalidDeviceId,
    InvalidIdempotencyKey,
    BadQuery,
    MinVersionBeyondTip,
    BadLastEventId,
    ResumeBeyondTip,
    ResumeTooFarBack,
    // 401 and 403: who is asking, and for what.
    Unauthorized,
    InvalidToken,
    Forbidden,
    InsufficientScope,
    HostNotAllowed,
    // 404, 405, 413, 414, 415 and 431: no such thing, or not in this shape.
    NotFound,
    AccountNotFound,
    KeyNotFound,
    HoldNotFound,
    MethodNotAllowed,
    PayloadTooLarge,
    UriTooLong,
    UnsupportedMediaType,
    HeadersTooLarge,
    // 409: retryable, or final (`AccountExists`, `HoldResolved`).
    Conflict,
    AccountExists,
    HoldResolved,
    // 422: well-formed, but against a rule.
    ValidationError,
    InsufficientFunds,
    HoldAmountExceeded,
    HoldLimit,
    IdempotencyKeyReused,
    LinkedItemFailed,
    DeviceRunOverLimit,
    // 429: the caller is over a limit.
    RateLimited,
    TooManyAuthFailures,
    TooManyStreams,
    // 500: a bug, or an account the replica cannot read.
    Internal,
    StreamRoute,
    AccountUnreadable,
    AccountTrimmed,
    CrossShard,
    // 503: retryable.
    ServiceUnavailable,
    StoreUnavailable,
    HoldsOff,
    /// A device sync's own code (the device protocol's); its status follows its kind.
    Sync(SyncCode),
}

impl ErrorCode {
    /// Every code, once.
    pub const ALL: [ErrorCode; 63] = [
        ErrorCode::BadRequest,
        ErrorCode::InvalidJson,
        ErrorCode::InvalidId,
        ErrorCode::InvalidDeviceId,
        ErrorCode::InvalidIdempotencyKey,
        ErrorCode::BadQuery,
        ErrorCode::MinVersionBeyondTip,
        ErrorCode::BadLastEventId,
        ErrorCode::ResumeBeyondTip,
        ErrorCode::ResumeTooFarBack,
        ErrorCode::Unauthorized,
        ErrorCode::InvalidToken,
        ErrorCode::Forbidden,
        ErrorCode::InsufficientScope,
        ErrorCode::HostNotAllowed,
        ErrorCode::NotFound,
        ErrorCode::AccountNotFound,
        ErrorCode::KeyNotFound,
        ErrorCode::HoldNotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::PayloadTooLarge,
        ErrorCode::UriTooLong,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::HeadersTooLarge,
        ErrorCode::Conflict,
        ErrorCode::AccountExists,
        ErrorCode::HoldResolved,
        ErrorCode::ValidationError,
        ErrorCode::InsufficientFunds,
        ErrorCode::HoldAmountExceeded,
        ErrorCode::HoldLimit,
        ErrorCode::IdempotencyKeyReused,
        ErrorCode::LinkedItemFailed,
        ErrorCode::DeviceRunOverLimit,
        ErrorCode::RateLimited,
        ErrorCode::TooManyAuthFailures,
        ErrorCode::TooManyStreams,
        ErrorCode::Internal,
        ErrorCode::StreamRoute,
        ErrorCode::AccountUnreadable,
        ErrorCode::AccountTrimmed,
        ErrorCode::CrossShard,
        ErrorCode::ServiceUnavailable,
        ErrorCode::StoreUnavailable,
        ErrorCode::HoldsOff,
        ErrorCode::Sync(SyncCode::InvalidDeviceId),
        ErrorCode::Sync(SyncCode::DeviceIdReserved),
        ErrorCode::Sync(SyncCode::InvalidAccount),
        ErrorCode::Sync(SyncCode::EmptyRun),
        ErrorCode::Sync(SyncCode::RunTooLong),
        ErrorCode::Sync(SyncCode::BadSequence),
        ErrorCode::Sync(SyncCode::UnknownEventType),
        ErrorCode::Sync(SyncCode::InvalidAmount),
        ErrorCode::Sync(SyncCode::InvalidEventId),
        ErrorCode::Sync(SyncCode::RunStraddlesMark),
        ErrorCode::Sync(SyncCode::RunConflictsWithStore),
        ErrorCode::Sync(SyncCode::RunTrimmed),
        ErrorCode::Sync(SyncCode::SyncInFlight),
        ErrorCode::Sync(SyncCode::SyncOutcomeUnknown),
        ErrorCode::Sync(SyncCode::SyncNotApplied),
        ErrorCode::Sync(SyncCode::SyncUnverified),
        ErrorCode::Sync(SyncCode::AccountNotFound),
        ErrorCode::Sync(SyncCode::StoreError),
    ];

    /// The code as the answer's `error` field spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "BAD_REQUEST",
            ErrorCode::InvalidJson => "INVALID_JSON",
            ErrorCode::InvalidId => "INVALID_ID",
            ErrorCode::InvalidDeviceId => "INVALID_DEVICE_ID",
            ErrorCode::InvalidIdempotencyKey => "INVALID_IDEMPOTENCY_KEY",
            ErrorCode::BadQuery => "BAD_QUERY",
            ErrorCode::MinVersionBeyondTip => "MIN_VERSION_BEYOND_TIP",
            ErrorCode::BadLastEventId => "BAD_LAST_EVENT_ID",
            ErrorCode::ResumeBeyondTip => "RESUME_BEYOND_TIP",
            ErrorCode::ResumeTooFarBack => "RESUME_TOO_FAR_BACK",
            ErrorCode::Unauthorized => "UNAUTHORIZED",
            ErrorCode::InvalidToken => "INVALID_TOKEN",
            ErrorCode::Forbidden => "FORBIDDEN",
            ErrorCode::InsufficientScope => "INSUFFICIENT_SCOPE",
            ErrorCode::HostNotAllowed => "HOST_NOT_ALLOWED",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::AccountNotFound => "ACCOUNT_NOT_FOUND",
            ErrorCode::KeyNotFound => "KEY_NOT_FOUND",
            ErrorCode::HoldNotFound => "HOLD_NOT_FOUND",
            ErrorCode::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            ErrorCode::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            ErrorCode::UriTooLong => "URI_TOO_LONG",
            ErrorCode::UnsupportedMediaType => "UNSUPPORTED_MEDIA_TYPE",
            ErrorCode::HeadersTooLarge => "HEADERS_TOO_LARGE",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::AccountExists => "ACCOUNT_EXISTS",
            ErrorCode::HoldResolved => "HOLD_RESOLVED",
            ErrorCode::ValidationError => "VALIDATION_ERROR",
            ErrorCode::InsufficientFunds => "INSUFFICIENT_FUNDS",
            ErrorCode::HoldAmountExceeded => "HOLD_AMOUNT_EXCEEDED",
            ErrorCode::HoldLimit => "HOLD_LIMIT",
            ErrorCode::IdempotencyKeyReused => "IDEMPOTENCY_KEY_REUSED",
            ErrorCode::LinkedItemFailed => "LINKED_ITEM_FAILED",
            ErrorCode::DeviceRunOverLimit => "DEVICE_RUN_OVER_LIMIT",
            ErrorCode::RateLimited => "RATE_LIMITED",
            ErrorCode::TooManyAuthFailures => "TOO_MANY_AUTH_FAILURES",
            ErrorCode::TooManyStreams => "TOO_MANY_STREAMS",
            ErrorCode::Internal => "INTERNAL",
            ErrorCode::StreamRoute => "STREAM_ROUTE",
            ErrorCode::AccountUnreadable => "ACCOUNT_UNREADABLE",
            ErrorCode::AccountTrimmed => "ACCOUNT_TRIMMED",
            ErrorCode::CrossShard => "CROSS_SHARD",
            ErrorCode::ServiceUnavailable => "SERVICE_UNAVAILABLE",
            ErrorCode::StoreUnavailable => "STORE_UNAVAILABLE",
            ErrorCode::HoldsOff => "HOLDS_OFF",
            ErrorCode::Sync(code) => code.as_str(),
        }
    }

    /// The status of an answer with this code: the one table from codes to HTTP.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::BadRequest
            | ErrorCode::InvalidJson
            | ErrorCode::InvalidId
            | ErrorCode::InvalidDeviceId
            | ErrorCode::InvalidIdempotencyKey
            | ErrorCode::BadQuery
            | ErrorCode::MinVersionBeyondTip
            | ErrorCode::BadLastEventId
            | ErrorCode::ResumeBeyondTip
            | ErrorCode::ResumeTooFarBack => StatusCode::BAD_REQUEST,
            ErrorCode::Unauthorized | ErrorCode::InvalidToken => StatusCode::UNAUTHORIZED,
            ErrorCode::Forbidden | ErrorCode::InsufficientScope | ErrorCode::HostNotAllowed => {
                StatusCode::FORBIDDEN
            }
            ErrorCode::NotFound
            | ErrorCode::AccountNotFound
            | ErrorCode::KeyNotFound
            | ErrorCode::HoldNotFound => StatusCode::NOT_FOUND,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::UriTooLong => StatusCode::URI_TOO_LONG,
            ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ErrorCode::Conflict | ErrorCode::AccountExists | ErrorCode::HoldResolved => {
                StatusCode::CONFLICT
            }
            ErrorCode::ValidationError
            | ErrorCode::InsufficientFunds
            | ErrorCode::HoldAmountExceeded
            | ErrorCode::HoldLimit
            | ErrorCode::IdempotencyKeyReused
            | ErrorCode::LinkedItemFailed
            | ErrorCode::DeviceRunOverLimit => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::RateLimited | ErrorCode::TooManyAuthFailures | ErrorCode::TooManyStreams => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ErrorCode::Internal
            | ErrorCode::StreamRoute
            | ErrorCode::AccountUnreadable
            | ErrorCode::AccountTrimmed
            | ErrorCode::CrossShard => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::ServiceUnavailable | ErrorCode::StoreUnavailable | ErrorCode::HoldsOff => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ErrorCode::Sync(code) => sync_status(code),
        }
    }
}

/// A device sync's status, by what its code says of the run: refused as sent (422), against
/// what the store holds (409, final), to be resent (503), its account never opened (404),
/// or a store failure of no known kind (500).
fn sync_status(code: SyncCode) -> StatusCode {
    match code {
        SyncCode::InvalidDeviceId
        | SyncCode::DeviceIdReserved
        | SyncCode::InvalidAccount
        | SyncCode::EmptyRun
        | SyncCode::RunTooLong
        | SyncCode::BadSequence
        | SyncCode::UnknownEventType
        | SyncCode::InvalidAmount
        | SyncCode::InvalidEventId => StatusCode::UNPROCESSABLE_ENTITY,
        SyncCode::RunStraddlesMark | SyncCode::RunConflictsWithStore | SyncCode::RunTrimmed => {
            StatusCode::CONFLICT
        }
        SyncCode::SyncInFlight
        | SyncCode::SyncOutcomeUnknown
        | SyncCode::SyncNotApplied
        | SyncCode::SyncUnverified => StatusCode::SERVICE_UNAVAILABLE,
        SyncCode::AccountNotFound => StatusCode::NOT_FOUND,
        SyncCode::StoreError => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: ErrorCode, message: String },
    #[error("request body exceeds {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// 414: a request line over the head limit (`--max-header-bytes`). Answered in place of
    /// hyper's own refusal, before there is a request to route (`super::head`); no handler
    /// returns it.
    #[error("{0}")]
    UriTooLong(String),
    /// 431: header fields over the head limit, or more than hyper's 100 of them; answered
    /// like [`ApiError::UriTooLong`].
    #[error("{0}")]
    HeadersTooLarge(String),
    #[error("no route for {path}")]
    NotFound { path: String },
    /// 404 `ACCOUNT_NOT_FOUND`: accounts are explicit and the account named was never
    /// opened. Nothing was written.
    #[error("{0}")]
    AccountNotFound(String),
    /// 404 `KEY_NOT_FOUND`: a key looked up on an account names no write that landed there
    /// within the retention, proven on a fold at the store's tip. A write sent under it now
    /// would be a new write.
    #[error("{0}")]
    KeyNotFound(String),
    /// `route` is the path's template, for the request's metrics and log line.
    #[error("method not allowed; allowed: {allow}")]
    MethodNotAllowed {
        allow: &'static str,
        route: &'static str,
    },
    /// The body's media type or content coding is not one the API reads.
    #[error("{0}")]
    UnsupportedMediaType(&'static str),
    #[error("{0}")]
    Validation(String),
    #[error("insufficient funds")]
    InsufficientFunds { balance: i64 },
    /// 422 `INSUFFICIENT_FUNDS` on an account with open holds: the body states what is
    /// available and what is held.
    #[error("{message}")]
    InsufficientAvailable {
        available: i64,
        held: i64,
        message: String,
    },
    /// 409 `HOLD_RESOLVED`, final: the hold already resolved, and the body names how.
    #[error("{message}")]
    HoldResolved {
        resolution: &'static str,
        message: String,
    },
    #[error("this Idempotency-Key was already used for a different operation or payload")]
    KeyReused,
    /// 422 with a code of its own: the request is well-formed JSON but breaks a rule of its
    /// endpoint (a device run with a gap, an unknown event type, ...). Final; nothing written.
    #[error("{message}")]
    Unprocessable { code: ErrorCode, message: String },
    /// 409 with a code of its own, final (no Retry-After): the request contradicts what the
    /// store already holds, and resending it cannot help.
    #[error("{message}")]
    StoreConflict { code: ErrorCode, message: String },
    /// Retryable: the write gave up or could not be verified. Nothing is known to be wrong
    /// with the request.
    #[error("{0}")]
    Conflict(String),
    /// Retryable: the store failed to answer, or the replica is not ready.
    #[error("{0}")]
    Unavailable(String),
    /// 503 `STORE_UNAVAILABLE`, retryable: no node of the event store could be reached, for
    /// reads and writes alike. A write's earlier attempt may have landed: its retry with the
    /// same key settles it.
    #[error(
        "the event store cannot be reached; retry after Retry-After (a write with the same Idempotency-Key)"
    )]
    StoreUnavailable,
    /// Retryable, 503 with a code of its own (a device sync's `SYNC_*`): resend the same
    /// request after `Retry-After`.
    #[error("{message}")]
    RetryLater { code: ErrorCode, message: String },
    /// Retryable: the replica is shedding load (no in-flight slot came free in time). At
    /// the connection cap it also closes the connection, so the client reconnects behind
    /// the clients waiting in the accept queue instead of keeping its place.
    #[error("too many requests in flight; retry shortly")]
    Shed { close_connection: bool },
    /// A bug, a poisoned stream, or a configuration the operator must fix.
    #[error("{message}")]
    Internal { code: ErrorCode, message: String },
    /// 401: no bearer token (`UNAUTHORIZED`) or one that was refused
    /// (`INVALID_TOKEN`, with a fixed reason, never the token). Nothing was read or written.
    #[error("{message}")]
    Unauthorized {
        code: ErrorCode,
        message: String,
        /// The fixed reason a token was refused, for `WWW-Authenticate`.
        reason: Option<&'static str>,
    },
    /// 403: the token is valid but does not grant this (`INSUFFICIENT_SCOPE`,
    /// naming the scope, or `FORBIDDEN` for an account or device it does not cover).
    #[error("{message}")]
    Forbidden {
        code: ErrorCode,
        message: String,
        scope: Option<&'static str>,
    },
    /// 429: the caller is over its rate limit; retry after the seconds given.
    #[error("too many requests from this caller; retry after {retry_after_secs} s")]
    RateLimited { retry_after_secs: u64 },
    /// 429 with a code of its own: a per-caller or per-peer limit other than the request
    /// rate (`TOO_MANY_STREAMS`, `TOO_MANY_AUTH_FAILURES`); retry after the seconds given.
    #[error("{message}")]
    Limited {
        code: ErrorCode,
        message: String,
        retry_after_secs: u64,
    },
}

impl ApiError {
    pub fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            code,
            message: message.into(),
        }
    }

    /// The 503 of a replica still starting: names the steps it waits for (`serverClock`,
    /// `seed:<demo name>`), fixed names that carry no request data.
    pub fn starting(waiting: &[String]) -> Self {
        ApiError::Unavailable(if waiting.is_empty() {
            format!("{STARTING}; retry shortly")
        } else {
            format!(
                "{STARTING} (waiting for {}); retry shortly",
                waiting.join(", ")
            )
        })
    }

    /// The answer's status: its code's ([`ErrorCode::status`]).
    pub fn status(&self) -> StatusCode {
        self.code().status()
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::BadRequest { code, .. }
            | ApiError::Internal { code, .. }
            | ApiError::Unprocessable { code, .. }
            | ApiError::StoreConflict { code, .. }
            | ApiError::Unauthorized { code, .. }
            | ApiError::Forbidden { code, .. }
            | ApiError::Limited { code, .. }
            | ApiError::RetryLater { code, .. } => *code,
            ApiError::RateLimited { .. } => ErrorCode::RateLimited,
            ApiError::PayloadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            ApiError::UriTooLong(_) => ErrorCode::UriTooLong,
            ApiError::HeadersTooLarge(_) => ErrorCode::HeadersTooLarge,
            ApiError::NotFound { .. } => ErrorCode::NotFound,
            ApiError::AccountNotFound(_) => ErrorCode::AccountNotFound,
            ApiError::KeyNotFound(_) => ErrorCode::KeyNotFound,
            ApiError::MethodNotAllowed { .. } => ErrorCode::MethodNotAllowed,
            ApiError::UnsupportedMediaType(_) => ErrorCode::UnsupportedMediaType,
            ApiError::Validation(_) => ErrorCode::ValidationError,
            ApiError::InsufficientFunds { .. } | ApiError::InsufficientAvailable { .. } => {
                ErrorCode::InsufficientFunds
            }
            ApiError::HoldResolved { .. } => ErrorCode::HoldResolved,
            ApiError::KeyReused => ErrorCode::IdempotencyKeyReused,
            ApiError::Conflict(_) => ErrorCode::Conflict,
            ApiError::Unavailable(_) | ApiError::Shed { .. } => ErrorCode::ServiceUnavailable,
            ApiError::StoreUnavailable => ErrorCode::StoreUnavailable,
        }
    }

    /// The response. A 500 carries an error id, logged here with the cause.
    pub fn into_response(self) -> Resp {
        let status = self.status();
        let mut body =
            json!({ "error": self.code().as_str(), "message": bounded_message(self.to_string()) });
        match &self {
            ApiError::InsufficientFunds { balance } => body["balanceCents"] = json!(balance),
            ApiError::InsufficientAvailable {
                available, held, ..
            } => {
                body["availableCents"] = json!(available);
                body["heldCents"] = json!(held);
            }
            ApiError::HoldResolved { resolution, .. } => body["resolution"] = json!(resolution),
            _ => {}
        }
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            let error_id = Uuid::new_v4();
            tracing::error!(%error_id, code = self.code().as_str(), message = %self, "request failed");
            body["errorId"] = json!(error_id.to_string());
        }
        let mut resp = json_response(status, &body);
        let headers = resp.headers_mut();
        match &self {
            ApiError::MethodNotAllowed { allow, .. } => {
                headers.insert(ALLOW, HeaderValue::from_static(allow));
            }
            ApiError::Conflict(_) | ApiError::Unavailable(_) | ApiError::RetryLater { .. } => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
            }
            ApiError::Unauthorized { reason, .. } => {
                let challenge = match reason {
                    None => format!("Bearer realm=\"{REALM}\""),
                    Some(r) => format!(
                        "Bearer realm=\"{REALM}\", error=\"invalid_token\", error_description=\"{r}\""
                    ),
                };
                if let Ok(v) = HeaderValue::from_str(&challenge) {
                    headers.insert(WWW_AUTHENTICATE, v);
                }
            }
            ApiError::Forbidden {
                scope: Some(scope), ..
            } => {
                let challenge = format!(
                    "Bearer realm=\"{REALM}\", error=\"insufficient_scope\", scope=\"{scope}\""
                );
                if let Ok(v) = HeaderValue::from_str(&challenge) {
                    headers.insert(WWW_AUTHENTICATE, v);
                }
            }
            ApiError::StoreUnavailable => {
                headers.insert(
                    RETRY_AFTER,
                    HeaderValue::from_static(STORE_RETRY_AFTER_SECS),
                );
            }
            ApiError::RateLimited { retry_after_secs }
            | ApiError::Limited {
                retry_after_secs, ..
            } => {
                headers.insert(RETRY_AFTER, HeaderValue::from(*retry_after_secs));
            }
            ApiError::Shed { close_connection } => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
                if *close_connection {
                    headers.insert(CONNECTION, HeaderValue::from_static("close"));
                }
            }
            _ => {}
        }
        resp
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        let message = e.to_string();
        match e {
            AuthError::Missing => ApiError::Unauthorized {
                code: ErrorCode::Unauthorized,
                message,
                reason: None,
            },
            AuthError::Invalid(reason) => ApiError::Unauthorized {
                code: ErrorCode::InvalidToken,
                message,
                reason: Some(reason),
            },
            AuthError::Scope(scope) => ApiError::Forbidden {
                code: ErrorCode::InsufficientScope,
                message,
                scope: Some(scope.as_str()),
            },
            AuthError::Resource(_) => ApiError::Forbidden {
                code: ErrorCode::Forbidden,
                message,
                scope: None,
            },
        }
    }
}

impl From<DeviceSyncError> for ApiError {
    fn from(e: DeviceSyncError) -> Self {
        let code = ErrorCode::Sync(e.code());
        let message = e.to_string();
        if let DeviceSyncError::AccountNotFound(_) = e {
            ApiError::AccountNotFound(message)
        } else if e.is_invalid_request() {
            ApiError::Unprocessable { code, message }
        } else if e.is_conflict() {
            ApiError::StoreConflict { code, message }
        } else if e.is_retryable() {
            ApiError::RetryLater { code, message }
        } else {
            ApiError::Internal { code, message }
        }
    }
}

impl From<RuleError> for ApiError {
    fn from(e: RuleError) -> Self {
        match e {
            RuleError::InsufficientFunds { balance } => ApiError::InsufficientFunds { balance },
            RuleError::Validation(_) | RuleError::Overflow => ApiError::Validation(e.to_string()),
            RuleError::AccountNotFound { .. } => ApiError::AccountNotFound(e.to_string()),
            // Final: the open is decided on state that reached the store's tip, and a retry
            // of the open that landed is replayed before anything is decided.
            RuleError::AccountExists { .. } => ApiError::StoreConflict {
                code: ErrorCode::AccountExists,
                message: e.to_string(),
            },
            RuleError::InsufficientAvailable { available, held } => {
                ApiError::InsufficientAvailable {
                    available,
                    held,
                    message: e.to_string(),
                }
            }
            RuleError::HoldNotFound { .. } => ApiError::Unprocessable {
                code: ErrorCode::HoldNotFound,
                message: e.to_string(),
            },
            // Final: a resolution is never undone, and a retry of the resolving write is
            // replayed before anything is decided.
            RuleError::HoldResolved { how, .. } => ApiError::HoldResolved {
                resolution: how.name(),
                message: e.to_string(),
            },
            RuleError::HoldExceeded { .. } => ApiError::Unprocessable {
                code: ErrorCode::HoldAmountExceeded,
                message: e.to_string(),
            },
            RuleError::HoldLimit => ApiError::Unprocessable {
                code: ErrorCode::HoldLimit,
                message: e.to_string(),
            },
        }
    }
}

impl From<ProjectionError> for ApiError {
    fn from(e: ProjectionError) -> Self {
        match e {
            ProjectionError::Poisoned { .. } => ApiError::Internal {
                code: ErrorCode::AccountUnreadable,
                message: e.to_string(),
            },
            ProjectionError::Trimmed { .. } => ApiError::Internal {
                code: ErrorCode::AccountTrimmed,
                message: e.to_string(),
            },
            ProjectionError::Store(s) => s.into(),
            ProjectionError::Database => ApiError::Unavailable(e.to_string()),
            ProjectionError::HoldsOff { .. } => ApiError::RetryLater {
                code: ErrorCode::HoldsOff,
                message: e.to_string(),
            },
        }
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::HistoryTipUnknown(s) if s.is_unreachable() => ApiError::StoreUnavailable,
            ReadError::NotVisibleYet { .. }
            | ReadError::HistoryBehindFold { .. }
            | ReadError::BalanceBehindHistory { .. }
            | ReadError::HistoryTipUnknown(_)
            | ReadError::StoreHidesEvents { .. }
            | ReadError::Database => ApiError::Unavailable(e.to_string()),
            ReadError::LimitOutOfRange { .. } => {
                ApiError::bad_request(ErrorCode::BadQuery, e.to_string())
            }
            ReadError::MinVersionBeyondTip { .. } => {
                ApiError::bad_request(ErrorCode::MinVersionBeyondTip, e.to_string())
            }
            ReadError::Unreadable { .. } => ApiError::Internal {
                code: ErrorCode::AccountUnreadable,
                message: e.to_string(),
            },
            ReadError::Trimmed { .. } => ApiError::Internal {
                code: ErrorCode::AccountTrimmed,
                message: e.to_string(),
            },
            ReadError::Store(s) => s.into(),
            ReadError::AccountNotFound { .. } => ApiError::AccountNotFound(e.to_string()),
            ReadError::HoldsOff(message) => ApiError::RetryLater {
                code: ErrorCode::HoldsOff,
                message,
            },
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::CrossShard => ApiError::Internal {
                code: ErrorCode::CrossShard,
                message: WriteError::CrossShard.to_string(),
            },
            e if e.is_unreachable() => ApiError::StoreUnavailable,
            other => {
                if let Some(report) = STORE_FAILURE_LINES.occurred() {
                    tracing::warn!(error = %other, occurrences = report.count, "a store failure was answered 503");
                }
                ApiError::Unavailable(format!(
                    "the event store did not answer ({}); retry shortly",
                    other.brief()
                ))
            }
        }
    }
}

impl From<WriteError> for ApiError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Rule(r) => r.into(),
            WriteError::KeyReused => ApiError::KeyReused,
            WriteError::StoreUnavailable => ApiError::StoreUnavailable,
            WriteError::Unverifiable { .. } | WriteError::GaveUp { .. } => {
                ApiError::Conflict(e.to_string())
            }
            WriteError::Account(p) => p.into(),
            WriteError::CrossShard => StoreError::CrossShard.into(),
            WriteError::Store(s) => s.into(),
            WriteError::Overloaded { .. } => ApiError::Unavailable(e.to_string()),
            WriteError::Invariant { .. } => ApiError::Internal {
                code: ErrorCode::Internal,
                message: e.to_string(),
            },
            WriteError::LinkedItemFailed => ApiError::Unprocessable {
                code: ErrorCode::LinkedItemFailed,
                message: e.to_string(),
            },
        }
    }
}

/// The longest message an error answer carries, in bytes. A message quotes what it refuses
/// (a path segment, a JSON field name), and an answer is no place to echo a request back
/// whole: beyond this it is cut at a character boundary and marked.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 512;

fn bounded_message(mut message: String) -> String {
    if message.len() > MAX_ERROR_MESSAGE_BYTES {
        let mut cut = MAX_ERROR_MESSAGE_BYTES;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::account::AccountId;
    use crate::device::error::RetryReason;

    /// Rule: an error answer never echoes a request back whole: its message is cut at
    /// [`MAX_ERROR_MESSAGE_BYTES`], on a character boundary.
    #[test]
    fn an_error_message_is_bounded_at_a_character_boundary() {
        let long = format!("{:?} is not a valid account id", "é".repeat(40_000));
        let cut = bounded_message(long.clone());
        assert!(
            cut.len() <= MAX_ERROR_MESSAGE_BYTES + '…'.len_utf8(),
            "{}",
            cut.len()
        );
        assert!(cut.ends_with('…'));
        assert!(long.starts_with(cut.trim_end_matches('…')));
        assert_eq!(bounded_message("short".into()), "short");
    }

    #[test]
    fn every_write_error_maps_to_one_status() {
        let cases = [
            (WriteError::KeyReused, 422),
            (
                WriteError::Rule(RuleError::InsufficientFunds { balance: 3 }),
                422,
            ),
            (WriteError::Unverifiable { reason: "x".into() }, 409),
            (
                WriteError::GaveUp {
                    attempts: 3,
                    last: "x".into(),
                },
                409,
            ),
            (WriteError::CrossShard, 500),
            (
                WriteError::Rule(RuleError::AccountNotFound {
                    account: AccountId(Uuid::from_u128(1)),
                }),
                404,
            ),
            (
                WriteError::Rule(RuleError::AccountExists {
                    account: AccountId(Uuid::from_u128(1)),
                }),
                409,
            ),
            (WriteError::Store(StoreError::shed("busy")), 503),
            (WriteError::Store(StoreError::unreachable("refused")), 503),
            (WriteError::StoreUnavailable, 503),
        ];
        for (e, status) in cases {
            assert_eq!(ApiError::from(e.clone()).status().as_u16(), status, "{e:?}");
        }
    }

    #[test]
    fn every_read_error_maps_to_one_status_and_code() {
        let account = AccountId(Uuid::from_u128(7));
        let cases = [
            (
                ReadError::NotVisibleYet { min_version: 3 },
                503,
                "SERVICE_UNAVAILABLE",
            ),
            (
                ReadError::HistoryBehindFold {
                    from_version: 3,
                    current: 4,
                },
                503,
                "SERVICE_UNAVAILABLE",
            ),
            // Whatever the store said, even an error that is a 500 as a read's own.
            (
                ReadError::HistoryTipUnknown(StoreError::CrossShard),
                503,
                "SERVICE_UNAVAILABLE",
            ),
            (ReadError::LimitOutOfRange { max: 1000 }, 400, "BAD_QUERY"),
            (
                ReadError::MinVersionBeyondTip {
                    min_version: 9,
                    current: 4,
                },
                400,
                "MIN_VERSION_BEYOND_TIP",
            ),
            (
                ReadError::Unreadable {
                    account,
                    version: 2,
                    reason: "x".into(),
                },
                500,
                "ACCOUNT_UNREADABLE",
            ),
            (
                ReadError::Trimmed {
                    account,
                    min_available: 2,
                },
                500,
                "ACCOUNT_TRIMMED",
            ),
            (ReadError::Store(StoreError::CrossShard), 500, "CROSS_SHARD"),
            (
                ReadError::AccountNotFound { account },
                404,
                "ACCOUNT_NOT_FOUND",
            ),
            (
                ReadError::Store(StoreError::shed("busy")),
                503,
                "SERVICE_UNAVAILABLE",
            ),
            (
                ReadError::Store(StoreError::unreachable("refused")),
                503,
                "STORE_UNAVAILABLE",
            ),
            (
                ReadError::HistoryTipUnknown(StoreError::unreachable("refused")),
                503,
                "STORE_UNAVAILABLE",
            ),
        ];
        for (e, status, code) in cases {
            let api = ApiError::from(e.clone());
            assert_eq!(
                (api.status().as_u16(), api.code().as_str()),
                (status, code),
                "{e:?}"
            );
        }
    }

    /// Rule: what the store's client said (node addresses, OS errors) never reaches an
    /// answer; the answer names the failure's class, and the log keeps the rest.
    #[test]
    fn a_store_failure_answers_a_fixed_phrase_without_the_clients_words() {
        let words = "last attempt to 127.0.0.1:18998 failed: Connection refused (os error 111)";
        let cases = [
            ApiError::from(StoreError::unreachable(words)),
            ApiError::from(StoreError::shed(words)),
            ApiError::from(StoreError::OutcomeUnknown {
                reason: words.into(),
            }),
            ApiError::from(StoreError::Other {
                code: 77,
                message: words.into(),
            }),
            ApiError::from(ReadError::HistoryTipUnknown(StoreError::shed(words))),
            ApiError::from(WriteError::Store(StoreError::unreachable(words))),
        ];
        for api in cases {
            let message = api.to_string();
            assert!(
                !message.contains("127.0.0.1") && !message.contains("os error"),
                "{api:?} answers {message}"
            );
            assert_eq!(api.status().as_u16(), 503, "{api:?}");
        }
        let resp = ApiError::StoreUnavailable.into_response();
        assert_eq!(resp.headers()[RETRY_AFTER], STORE_RETRY_AFTER_SECS);
    }

    /// A fold error answers the same (status, code and message) whether it reaches HTTP from
    /// the write loop or through the reader.
    #[test]
    fn a_fold_error_answers_the_same_through_the_reader() {
        let account = AccountId(Uuid::from_u128(7));
        let cases = [
            ProjectionError::Poisoned {
                account,
                version: 2,
                reason: "unknown event type 9.0".into(),
            },
            ProjectionError::Trimmed {
                account,
                min_available: 5,
            },
            ProjectionError::Store(StoreError::AggregateNotFound),
            ProjectionError::Store(StoreError::CrossShard),
        ];
        for e in cases {
            assert_eq!(
                ApiError::from(ReadError::from(e.clone())),
                ApiError::from(e.clone()),
                "{e:?}"
            );
        }
    }

    #[test]
    fn retryable_errors_say_when_to_retry() {
        let r = ApiError::Conflict("x".into()).into_response();
        assert_eq!(r.headers()[RETRY_AFTER], "1");
        let r = ApiError::MethodNotAllowed {
            allow: "GET",
            route: "/healthz",
        }
        .into_response();
        assert_eq!(r.headers()[ALLOW], "GET");
    }

    /// Rule: a device sync told to resend names why in `error` (the contract's `SYNC_*`
    /// codes), not only in the message. Else every one would read `SERVICE_UNAVAILABLE`.
    #[test]
    fn a_device_retry_carries_its_own_code() {
        let e = ApiError::from(DeviceSyncError::Retry {
            reason: crate::device::error::RetryReason::Unverified,
            detail: "x".into(),
        });
        assert_eq!(e.code().as_str(), "SYNC_UNVERIFIED");
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[RETRY_AFTER], "1");
    }

    /// Rule: a device sync error answers the status of its kind (the device layer's
    /// classification, which picks the variant and so the headers), through its code's one
    /// entry in the status table: the two cannot disagree.
    #[test]
    fn a_device_errors_status_follows_its_kind() {
        let cases = [
            DeviceSyncError::InvalidDeviceId("x".into()),
            DeviceSyncError::ReservedDeviceId(crate::device::DeviceId(Uuid::from_u128(1))),
            DeviceSyncError::InvalidAccount("x".into()),
            DeviceSyncError::EmptyRun,
            DeviceSyncError::RunTooLong { len: 2, max: 1 },
            DeviceSyncError::BadSequence("x".into()),
            DeviceSyncError::UnknownEventType {
                index: 0,
                kind: "x".into(),
            },
            DeviceSyncError::InvalidAmount {
                index: 0,
                reason: "x".into(),
            },
            DeviceSyncError::InvalidEventId {
                index: 0,
                value: "x".into(),
            },
            DeviceSyncError::RepeatedEventId { index: 1, first: 0 },
            DeviceSyncError::RunStraddlesMark {
                mark: 2,
                first_seq: 1,
                last_seq: 3,
            },
            DeviceSyncError::RunConflictsWithStore { seq: 1 },
            DeviceSyncError::RunNeverLanded { seq: 1 },
            DeviceSyncError::RunTrimmed { seq: 1 },
            DeviceSyncError::AccountNotFound(AccountId(Uuid::from_u128(1))),
            DeviceSyncError::Store(StoreError::CrossShard),
        ];
        let retries = [
            RetryReason::InFlight,
            RetryReason::OutcomeUnknown,
            RetryReason::NotApplied,
            RetryReason::Unverified,
        ]
        .map(|reason| DeviceSyncError::Retry {
            reason,
            detail: "x".into(),
        });
        for e in cases.into_iter().chain(retries) {
            let kind = if let DeviceSyncError::AccountNotFound(_) = e {
                StatusCode::NOT_FOUND
            } else if e.is_invalid_request() {
                StatusCode::UNPROCESSABLE_ENTITY
            } else if e.is_conflict() {
                StatusCode::CONFLICT
            } else if e.is_retryable() {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            };
            let code = e.code();
            let api = ApiError::from(e.clone());
            assert_eq!(api.status(), kind, "{e:?}");
            assert_eq!(api.code().as_str(), code.as_str(), "{e:?}");
        }
    }

    /// A shed request is told when to retry, in the usual JSON shape; its connection is
    /// closed only when asked (at the connection cap), as no other error closes one.
    #[test]
    fn a_shed_request_closes_its_connection_only_when_asked() {
        for close_connection in [false, true] {
            let r = ApiError::Shed { close_connection }.into_response();
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(r.headers()[RETRY_AFTER], "1");
            assert_eq!(r.headers()["content-type"], "application/json");
            assert_eq!(r.headers().get(CONNECTION).is_some(), close_connection);
        }
        let r = ApiError::Unavailable("store down".into()).into_response();
        assert!(r.headers().get(CONNECTION).is_none());
    }
}
