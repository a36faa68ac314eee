//! Every error the API answers, and the one place it becomes a status, a JSON body
//! `{"error":"CODE","message":"..."}` and headers.

use hyper::StatusCode;
use hyper::header::{ALLOW, CONNECTION, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use serde_json::json;
use uuid::Uuid;

use super::response::{Resp, json_response};
use crate::account::RuleError;
use crate::auth::{AuthError, REALM};
use crate::device::error::DeviceSyncError;
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

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
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
    #[error("this Idempotency-Key was already used for a different operation or payload")]
    KeyReused,
    /// 422 with a code of its own: the request is well-formed JSON but breaks a rule of its
    /// endpoint (a device run with a gap, an unknown event type, ...). Final; nothing written.
    #[error("{message}")]
    Unprocessable { code: &'static str, message: String },
    /// 409 with a code of its own, final (no Retry-After): the request contradicts what the
    /// store already holds, and resending it cannot help.
    #[error("{message}")]
    StoreConflict { code: &'static str, message: String },
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
    RetryLater { code: &'static str, message: String },
    /// Retryable: the replica is shedding load (no in-flight slot came free in time). At
    /// the connection cap it also closes the connection, so the client reconnects behind
    /// the clients waiting in the accept queue instead of keeping its place.
    #[error("too many requests in flight; retry shortly")]
    Shed { close_connection: bool },
    /// A bug, a poisoned stream, or a configuration the operator must fix.
    #[error("{message}")]
    Internal { code: &'static str, message: String },
    /// 401: no bearer token (`UNAUTHORIZED`) or one that was refused
    /// (`INVALID_TOKEN`, with a fixed reason, never the token). Nothing was read or written.
    #[error("{message}")]
    Unauthorized {
        code: &'static str,
        message: String,
        /// The fixed reason a token was refused, for `WWW-Authenticate`.
        reason: Option<&'static str>,
    },
    /// 403: the token is valid but does not grant this (`INSUFFICIENT_SCOPE`,
    /// naming the scope, or `FORBIDDEN` for an account or device it does not cover).
    #[error("{message}")]
    Forbidden {
        code: &'static str,
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
        code: &'static str,
        message: String,
        retry_after_secs: u64,
    },
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
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

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UriTooLong(_) => StatusCode::URI_TOO_LONG,
            ApiError::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::NotFound { .. } | ApiError::AccountNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Validation(_)
            | ApiError::InsufficientFunds { .. }
            | ApiError::KeyReused
            | ApiError::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Conflict(_) | ApiError::StoreConflict { .. } => StatusCode::CONFLICT,
            ApiError::Unavailable(_)
            | ApiError::StoreUnavailable
            | ApiError::RetryLater { .. }
            | ApiError::Shed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::RateLimited { .. } | ApiError::Limited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest { code, .. }
            | ApiError::Internal { code, .. }
            | ApiError::Unprocessable { code, .. }
            | ApiError::StoreConflict { code, .. }
            | ApiError::Unauthorized { code, .. }
            | ApiError::Forbidden { code, .. }
            | ApiError::Limited { code, .. }
            | ApiError::RetryLater { code, .. } => code,
            ApiError::RateLimited { .. } => "RATE_LIMITED",
            ApiError::PayloadTooLarge { .. } => "PAYLOAD_TOO_LARGE",
            ApiError::UriTooLong(_) => "URI_TOO_LONG",
            ApiError::HeadersTooLarge(_) => "HEADERS_TOO_LARGE",
            ApiError::NotFound { .. } => "NOT_FOUND",
            ApiError::AccountNotFound(_) => "ACCOUNT_NOT_FOUND",
            ApiError::MethodNotAllowed { .. } => "METHOD_NOT_ALLOWED",
            ApiError::UnsupportedMediaType(_) => "UNSUPPORTED_MEDIA_TYPE",
            ApiError::Validation(_) => "VALIDATION_ERROR",
            ApiError::InsufficientFunds { .. } => "INSUFFICIENT_FUNDS",
            ApiError::KeyReused => "IDEMPOTENCY_KEY_REUSED",
            ApiError::Conflict(_) => "CONFLICT",
            ApiError::Unavailable(_) | ApiError::Shed { .. } => "SERVICE_UNAVAILABLE",
            ApiError::StoreUnavailable => "STORE_UNAVAILABLE",
        }
    }

    /// The response. A 500 carries an error id, logged here with the cause.
    pub fn into_response(self) -> Resp {
        let status = self.status();
        let mut body =
            json!({ "error": self.code(), "message": bounded_message(self.to_string()) });
        if let ApiError::InsufficientFunds { balance } = &self {
            body["balanceCents"] = json!(balance);
        }
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            let error_id = Uuid::new_v4();
            tracing::error!(%error_id, code = self.code(), message = %self, "request failed");
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
                code: "UNAUTHORIZED",
                message,
                reason: None,
            },
            AuthError::Invalid(reason) => ApiError::Unauthorized {
                code: "INVALID_TOKEN",
                message,
                reason: Some(reason),
            },
            AuthError::Scope(scope) => ApiError::Forbidden {
                code: "INSUFFICIENT_SCOPE",
                message,
                scope: Some(scope.as_str()),
            },
            AuthError::Resource(_) => ApiError::Forbidden {
                code: "FORBIDDEN",
                message,
                scope: None,
            },
        }
    }
}

impl From<DeviceSyncError> for ApiError {
    fn from(e: DeviceSyncError) -> Self {
        let code = e.code();
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
                code: "ACCOUNT_EXISTS",
                message: e.to_string(),
            },
        }
    }
}

impl From<ProjectionError> for ApiError {
    fn from(e: ProjectionError) -> Self {
        match e {
            ProjectionError::Poisoned { .. } => ApiError::Internal {
                code: "ACCOUNT_UNREADABLE",
                message: e.to_string(),
            },
            ProjectionError::Trimmed { .. } => ApiError::Internal {
                code: "ACCOUNT_TRIMMED",
                message: e.to_string(),
            },
            ProjectionError::Store(s) => s.into(),
            ProjectionError::Database => ApiError::Unavailable(e.to_string()),
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
            ReadError::LimitOutOfRange { .. } => ApiError::bad_request("BAD_QUERY", e.to_string()),
            ReadError::MinVersionBeyondTip { .. } => {
                ApiError::bad_request("MIN_VERSION_BEYOND_TIP", e.to_string())
            }
            ReadError::Unreadable { .. } => ApiError::Internal {
                code: "ACCOUNT_UNREADABLE",
                message: e.to_string(),
            },
            ReadError::Trimmed { .. } => ApiError::Internal {
                code: "ACCOUNT_TRIMMED",
                message: e.to_string(),
            },
            ReadError::Store(s) => s.into(),
            ReadError::AccountNotFound { .. } => ApiError::AccountNotFound(e.to_string()),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::CrossShard => ApiError::Internal {
                code: "CROSS_SHARD",
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
                code: "INTERNAL",
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
            assert_eq!((api.status().as_u16(), api.code()), (status, code), "{e:?}");
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
        assert_eq!(e.code(), "SYNC_UNVERIFIED");
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[RETRY_AFTER], "1");
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
