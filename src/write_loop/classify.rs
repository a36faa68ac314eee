//! What one store write's outcome means for the run, as pure functions: the write's result
//! becomes a [`Step`], and a 2002's point read becomes a [`Settlement`]. The run applies them.
//!
//! The seed's rule in one line: **conflict means re-derive; ambiguous means hold the
//! sequence and refresh the version.**

use super::arm::Arm;
use super::error::WriteError;
use super::verify::SeqOwnership;
use crate::store::StoreError;

/// Why an attempt did not end its run: what a give-up says, and whether the store was out
/// of reach (which a give-up answers as the store's outage, not as a conflict).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Failure {
    /// Safe to answer: a store error's class and numbers, never its free text
    /// ([`StoreError::brief`]).
    pub what: String,
    pub cause: Cause,
}

/// What kind of failure a [`Failure`] is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Cause {
    /// The store answered, or the run stopped itself (a deadline, a lagging read).
    #[default]
    Other,
    /// No node of the store that could take the call was reached.
    StoreUnreachable,
}

impl Failure {
    pub fn other(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            cause: Cause::Other,
        }
    }

    /// A store call's failure, prefixed with what the call was for.
    pub fn store(context: &str, e: &StoreError) -> Self {
        Self {
            what: format!("{context}{}", e.brief()),
            cause: if e.is_unreachable() {
                Cause::StoreUnreachable
            } else {
                Cause::Other
            },
        }
    }
}

/// The next step after one write.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// This write applied: one new version per aggregate, in write order.
    Applied { versions: Vec<u64> },
    /// 2003: rejected, nothing appended, so our sequences were never used. Release them;
    /// the next attempt catches up, re-decides and derives fresh ones.
    ///
    /// `store_behind`: the conflict's current version, when it is below the version the write
    /// expected (the store shows fewer versions than were folded: `projection/regress.rs`).
    Rejected {
        arm: Arm,
        failure: Failure,
        store_behind: Option<Behind>,
    },
    /// May have landed, or an earlier attempt is not durable yet: hold the sequences; the
    /// next attempt's catch-up refreshes the version and checks the index.
    Hold {
        arm: Arm,
        failure: Failure,
        this_write: ThisWrite,
    },
    /// Definitely not applied: send the same again after the backoff.
    Retry { arm: Arm, failure: Failure },
    /// 2002: someone landed one of our sequences; the stream knows who.
    Contested,
    /// Nothing the loop can fix: answer every open request with this error.
    Fail { arm: Arm, error: WriteError },
}

/// What a held write itself may have done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ThisWrite {
    /// Its outcome is unknown: it may have applied, so a landing found later may be this
    /// run's own.
    MayHaveLanded,
    /// It was turned away (an earlier attempt is not yet durable): only an earlier write
    /// may stand.
    DidNotLand,
}

/// A conflict's versions, when the store stood below what the write expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Behind {
    pub expected: u64,
    pub current: u64,
}

/// Classifies a write's result.
pub(super) fn classify(result: Result<Vec<u64>, StoreError>) -> Step {
    match result {
        Ok(versions) => Step::Applied { versions },
        Err(StoreError::Conflict { expected, current }) => Step::Rejected {
            arm: Arm::Conflict,
            failure: Failure::other("version conflict"),
            store_behind: (current < expected).then_some(Behind { expected, current }),
        },
        Err(e @ StoreError::OutcomeUnknown { .. }) => Step::Hold {
            arm: Arm::OutcomeUnknown,
            failure: Failure::store("", &e),
            this_write: ThisWrite::MayHaveLanded,
        },
        Err(StoreError::InflightDuplicate) => Step::Hold {
            arm: Arm::InflightDuplicate,
            failure: Failure::other("an earlier attempt is still in flight"),
            this_write: ThisWrite::DidNotLand,
        },
        Err(e @ StoreError::NotApplied { .. }) => Step::Retry {
            arm: Arm::NotApplied,
            failure: Failure::store("", &e),
        },
        Err(StoreError::IdempotencyViolation { .. }) => Step::Contested,
        // Only a write that may not create is refused so (explicit accounts), and only when
        // the state it was decided on showed the account: the store says otherwise now (it
        // went backwards, or a read showed what it no longer has). Nothing was appended;
        // decide again on a fresh read, which refuses the write if the account is gone.
        Err(StoreError::AggregateNotFound) => Step::Rejected {
            arm: Arm::StoreError,
            failure: Failure::other("the store holds no stream for an account of this write"),
            store_behind: None,
        },
        Err(StoreError::CrossShard) => Step::Fail {
            arm: Arm::StoreError,
            error: WriteError::CrossShard,
        },
        Err(e) => Step::Fail {
            arm: Arm::StoreError,
            error: WriteError::Store(e),
        },
    }
}

/// What a 2002's point read settles, for the whole write (it was all or nothing).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Settlement {
    /// Our event id holds a contested sequence: the write landed. Never write it again;
    /// read it back at once (no backoff).
    Ours,
    /// A sibling's event holds it: ours never landed. Release the sequences and re-derive.
    Sibling { failure: Failure },
    /// Nothing visible holds it: refuse to guess, answer the batch retryably.
    Unverifiable { error: WriteError },
}

/// The settlement for a write, given every contested sequence's verdict.
pub(super) fn settle(combined: SeqOwnership) -> Settlement {
    match combined {
        SeqOwnership::Ours { .. } => Settlement::Ours,
        SeqOwnership::Sibling => Settlement::Sibling {
            failure: Failure::other("a sibling request holds the sequence"),
        },
        SeqOwnership::Unwritten => Settlement::Unverifiable {
            error: WriteError::Unverifiable {
                reason: "the store reports the sequence used, but no event holds it".into(),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: conflict means re-derive; ambiguous means hold the sequence and refresh the
    /// version.
    #[test]
    fn conflict_releases_the_sequence_and_ambiguity_holds_it() {
        assert!(matches!(
            classify(Err(StoreError::Conflict {
                expected: 1,
                current: 2
            })),
            Step::Rejected { .. }
        ));
        assert!(matches!(
            classify(Err(StoreError::OutcomeUnknown {
                reason: "timeout".into()
            })),
            Step::Hold {
                this_write: ThisWrite::MayHaveLanded,
                ..
            }
        ));
        assert!(matches!(
            classify(Err(StoreError::InflightDuplicate)),
            Step::Hold {
                this_write: ThisWrite::DidNotLand,
                ..
            }
        ));
        assert!(matches!(
            classify(Err(StoreError::shed("refused"))),
            Step::Retry { .. }
        ));
        assert_eq!(
            classify(Err(StoreError::IdempotencyViolation {
                last_seq: Some(3),
                attempted_seq: Some(3)
            })),
            Step::Contested
        );
    }

    /// Rule: a write the store could not be reached for is retried as is, and its failure
    /// says the store was out of reach (a give-up then answers the outage), without the
    /// client's own words (node addresses, OS errors).
    #[test]
    fn an_unreachable_store_is_a_retry_that_names_the_outage_without_its_addresses() {
        let step = classify(Err(StoreError::unreachable(
            "Connection failed: last attempt to 127.0.0.1:11000 failed: os error 111",
        )));
        let Step::Retry { failure, .. } = step else {
            panic!("{step:?}");
        };
        assert_eq!(failure.cause, Cause::StoreUnreachable);
        assert!(!failure.what.contains("127.0.0.1"), "{}", failure.what);
        let Step::Retry { failure, .. } = classify(Err(StoreError::shed("busy"))) else {
            panic!("a shed write is retried");
        };
        assert_eq!(failure.cause, Cause::Other);
    }

    /// Rule: the store's "no such aggregate" on a write (explicit accounts, on a state that
    /// showed the account) appended nothing: decided again on fresh state, never a failure
    /// answered at once.
    #[test]
    fn a_write_the_store_finds_no_aggregate_for_is_rejected_and_decided_again() {
        assert!(matches!(
            classify(Err(StoreError::AggregateNotFound)),
            Step::Rejected {
                store_behind: None,
                ..
            }
        ));
    }

    /// Rule: a 2002 is never taken at face value; only our own event id proves a landing,
    /// and nothing visible is not a verdict.
    #[test]
    fn only_our_event_id_settles_a_2002_as_landed() {
        assert_eq!(settle(SeqOwnership::Ours { version: 4 }), Settlement::Ours);
        assert!(matches!(
            settle(SeqOwnership::Sibling),
            Settlement::Sibling { .. }
        ));
        assert!(matches!(
            settle(SeqOwnership::Unwritten),
            Settlement::Unverifiable { .. }
        ));
    }
}
