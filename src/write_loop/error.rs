//! How a write fails: the loop's one error type, and what the loop does when a state its
//! invariants rule out turns up. A leaf: every part of the loop uses it, so it uses no part
//! of the loop.

use crate::account::RuleError;
use crate::projection::ProjectionError;
use crate::store::StoreError;

/// Why a write did not produce an outcome.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Rule(#[from] RuleError),
    #[error("this idempotency key was used for a different operation or payload")]
    KeyReused,
    /// Could not prove whether an earlier attempt landed. Retryable.
    #[error("the write's outcome could not be verified ({reason}); retry the request")]
    Unverifiable { reason: String },
    /// The store could not be reached on the run's last attempt. An earlier attempt may have
    /// landed, so a retry with the same key settles it. Retryable.
    #[error(
        "the event store cannot be reached; retry the request with the same Idempotency-Key after Retry-After"
    )]
    StoreUnavailable,
    /// Attempts or deadline exhausted. Retryable.
    #[error("{}", gave_up_message(*attempts, last))]
    GaveUp { attempts: u32, last: String },
    #[error(transparent)]
    Account(#[from] ProjectionError),
    #[error(
        "the accounts of this transfer are on different store shards; route every account to one shard"
    )]
    CrossShard,
    #[error("store error: {0}")]
    Store(StoreError),
    /// Refused before anything was sent: the write side is at a limit (live writes, the
    /// account's queue, a deadline passed while queued). Retryable.
    #[error("not written: {reason}; retry shortly")]
    Overloaded { reason: String },
    /// A state the loop's invariants rule out. Never answered as success; the request may
    /// or may not have landed, so a retry with the same key settles it.
    #[error("internal invariant broken: {what}")]
    Invariant { what: String },
    /// Another item of its linked group was refused for good, so nothing of the group was
    /// written. Final, as that refusal is.
    #[error("another item of this linked group was refused; nothing of the group was written")]
    LinkedItemFailed,
}

impl WriteError {
    /// Whether the same request may land if sent again (nothing is known to be wrong with
    /// it); the others are final refusals.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            WriteError::Unverifiable { .. }
                | WriteError::StoreUnavailable
                | WriteError::GaveUp { .. }
                | WriteError::Overloaded { .. }
                | WriteError::Invariant { .. }
                | WriteError::Store(_)
        )
    }
}

/// A give-up's message. Zero attempts is a run whose time ran out before one was counted
/// (a first touch's bounce is not an attempt): it says so rather than "after 0 attempts".
fn gave_up_message(attempts: u32, last: &str) -> String {
    let detail = if last.is_empty() {
        "no store answer"
    } else {
        last
    };
    if attempts == 0 {
        format!(
            "the write ran out of time before its first attempt ended ({detail}); retry the request"
        )
    } else {
        format!(
            "the write did not complete after {attempts} attempts ({detail}); retry the request"
        )
    }
}

/// An invariant the loop relies on did not hold: asserted in tests, a 500 (never a 2xx) in
/// production.
pub(super) fn invariant(what: &str) -> WriteError {
    debug_assert!(false, "write-loop invariant broken: {what}");
    tracing::error!(what, "write-loop invariant broken");
    WriteError::Invariant { what: what.into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a give-up names what happened; a run whose time ran out before an attempt was
    /// counted (a late first touch) does not claim "after 0 attempts".
    #[test]
    fn a_give_up_message_says_what_ran_out() {
        let late = WriteError::GaveUp {
            attempts: 0,
            last: "version conflict: expected 0, current 4".into(),
        };
        assert_eq!(
            late.to_string(),
            "the write ran out of time before its first attempt ended \
             (version conflict: expected 0, current 4); retry the request"
        );
        let spent = WriteError::GaveUp {
            attempts: 12,
            last: String::new(),
        };
        assert!(
            spent
                .to_string()
                .contains("after 12 attempts (no store answer)")
        );
    }
}
