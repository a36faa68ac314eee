//! The port's check order for a rejected multi-aggregate write, as pure functions.
//!
//! The server checks one aggregate completely before the next, in hash order; the port checks
//! existence on every leg, then every version guard, then idempotency. The adapter
//! (`CeleriantLog::in_port_order`) reads each leg's current version after such a rejection;
//! these functions decide, from what it saw, which error the port would have given.

use crate::store::{AggregateKey, StoreError};

/// One aggregate of a write, as far as the version checks go.
#[derive(Clone, Copy, Debug)]
pub(super) struct AggregateGuard {
    pub(super) key: AggregateKey,
    pub(super) expected: Option<u64>,
    pub(super) allow_create: bool,
}

/// A leg's state after a rejected write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Observed {
    Skipped,
    Missing,
    At(u64),
}

/// The port's answer for a rejected multi-aggregate write: the first leg (in request order)
/// that must exist and does not, else the first stale version guard, else the server's
/// answer.
pub(super) fn port_order(
    legs: &[AggregateGuard],
    observed: &[Observed],
    server: StoreError,
) -> StoreError {
    let pairs = || legs.iter().zip(observed);
    if pairs().any(|(leg, seen)| !leg.allow_create && *seen == Observed::Missing) {
        return StoreError::AggregateNotFound;
    }
    for (leg, seen) in pairs() {
        let current = match seen {
            Observed::At(v) => *v,
            Observed::Missing => 0,
            Observed::Skipped => continue,
        };
        if let Some(expected) = leg.expected
            && expected != current
        {
            // A details read below the guard is not the server's word that the aggregate
            // went back (a lagging replica, or a create the server hides, shows less): the
            // conflict then claims no current version below the expected one, which would
            // drop the fold (`projection/regress.rs`).
            let current = current.max(expected);
            return StoreError::Conflict { expected, current };
        }
    }
    server
}

/// Whether a multi-aggregate rejection may name a later check than the port would.
pub(super) fn order_sensitive(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Conflict { .. }
            | StoreError::IdempotencyViolation { .. }
            | StoreError::InflightDuplicate
    )
}
