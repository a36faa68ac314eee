//! What can go wrong, as one enum: a final answer, a retry the contract forbids, or a bound
//! reached. A write's error says whether its outcome is known ([`Error::outcome_unknown`]).

use std::time::Duration;

use crate::{ApiError, IdempotencyKey};

/// Why a call did not return an answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A final answer (a 422, a 400, a 404, a 409 `ACCOUNT_EXISTS`, ...): never retried. For
    /// a write it means nothing was written by this attempt; a new attempt at the same intent
    /// after a rule's refusal is decided again, so send it under a new key.
    #[error("refused with {status} {}: {}", .error.code, .error.message)]
    Refused {
        status: u16,
        error: ApiError,
        key: Option<IdempotencyKey>,
    },
    /// The server said the key can no longer be resent safely (`Idempotency-Window` ran out
    /// before the next attempt was due): a resend could write a second time. The write may
    /// or may not have landed; read the account to find out.
    #[error("key {key}: the idempotency window closed before a retry was safe (last: {last})")]
    WindowClosed {
        key: IdempotencyKey,
        attempts: u32,
        last: Failure,
    },
    /// The attempts or the total time ran out on answers that were not final. For a write the
    /// outcome is unknown: resend under the same key within the window, or read the account.
    #[error("gave up after {attempts} attempts in {elapsed:?} (last: {last})")]
    Exhausted {
        key: Option<IdempotencyKey>,
        attempts: u32,
        elapsed: Duration,
        last: Failure,
    },
    /// Every attempt failed to open a connection (refused, or no connection within the
    /// attempt's time), so no request left this process: nothing was written. The same call
    /// may be sent again, under the same key or a new one.
    #[error("no attempt reached the server: {attempts} attempts in {elapsed:?} (last: {last})")]
    Unreachable {
        key: Option<IdempotencyKey>,
        attempts: u32,
        elapsed: Duration,
        last: Failure,
    },
    /// A 2xx whose body is not the answer this call expects.
    #[error("unexpected answer {status}: {detail}")]
    Decode { status: u16, detail: String },
    /// An amount the API refuses: below 1 or above
    /// [`MAX_AMOUNT_CENTS`](crate::MAX_AMOUNT_CENTS).
    #[error("amountCents must be an integer from 1 to {max}, got {0}", max = crate::MAX_AMOUNT_CENTS)]
    InvalidAmount(i64),
    /// A key Tally would refuse (empty, too long, not visible ASCII).
    #[error("invalid idempotency key {0:?}")]
    InvalidKey(String),
    /// A [`RetryPolicy`](crate::RetryPolicy) that [`RetryPolicy::check`](crate::RetryPolicy::check) refuses.
    #[error("invalid retry policy: {0}")]
    InvalidPolicy(&'static str),
    /// A base URL this client cannot use (not `http://host[:port][/prefix]`).
    #[error("invalid base URL {url:?}: {why}")]
    InvalidUrl { url: String, why: &'static str },
}

impl Error {
    /// True when a write may have landed although this call returned an error: resend it
    /// only under the same key, and only within the window. False for
    /// [`Error::Unreachable`]: no attempt left this process.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            Error::WindowClosed { .. } | Error::Exhausted { key: Some(_), .. }
        )
    }
}

/// What one attempt that was not final ended with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// An answer that invites a retry (409 `CONFLICT`, 429, 500, 502, 503, 504).
    #[error("{status} {}", .error.as_ref().map_or("", |e| e.code.as_str()))]
    Answer {
        status: u16,
        /// Boxed: it is rare to look at, and keeps every `Result` of this crate small.
        error: Option<Box<ApiError>>,
        retry_after: Option<Duration>,
    },
    /// The connection could not be opened (refused, or not within the attempt's time): the
    /// request was not sent.
    #[error("connect: {0}")]
    Connect(String),
    /// No complete answer within the attempt's time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection broke after the request may have been sent, before the answer was
    /// read.
    #[error("connection: {0}")]
    Connection(String),
    /// A batch answer that cannot be matched to its items (not the `results` shape, or not
    /// one result per item sent). Its items may have landed, so they are resent under their
    /// keys, as after a lost answer.
    #[error("unreadable batch answer {status}: {detail}")]
    Unreadable { status: u16, detail: String },
}
