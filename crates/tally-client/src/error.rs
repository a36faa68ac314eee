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
    /// A 2xx whose body is not the answer this call expects.
    #[error("unexpected answer {status}: {detail}")]
    Decode { status: u16, detail: String },
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
    /// only under the same key, and only within the window.
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
    /// No complete answer within the attempt's time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection could not be opened, or broke before the answer was read.
    #[error("connection: {0}")]
    Connection(String),
}
