//! What the audit concludes: the verdict, each violation, and the counts the report prints.

use serde::Serialize;
use uuid::Uuid;

/// Most violations listed in the report (all are counted).
pub const MAX_REPORTED_VIOLATIONS: usize = 50;

/// Overall result of the exactly-once check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every key checked out.
    Pass,
    /// At least one violation.
    Fail,
    /// Some history could not be read; no violation among what was read.
    Incomplete,
    /// `--verify false`.
    Skipped,
}

/// What went wrong for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// The key's event appears more than once in one leg's stream.
    Duplicate,
    /// Answered 2xx but missing from history.
    Lost,
    /// Answered only with a definitive 4xx, yet in history.
    Phantom,
    /// A transfer present in one leg's stream and absent from the other.
    Partial,
    /// The key's event has the wrong account, type, amount or counterparty.
    Misapplied,
    /// Two 2xx answers for the key carried different bodies.
    BodyMismatch,
}

/// One violation, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub key: Uuid,
    pub kind: ViolationKind,
    pub detail: String,
}

/// The audit's findings.
#[derive(Debug, Clone, Serialize)]
pub struct ExactlyOnce {
    pub verdict: Verdict,
    /// Keys checked.
    pub checked: u64,
    /// Keys answered 2xx.
    pub succeeded: u64,
    /// Keys answered with a definitive 4xx only.
    pub rejected: u64,
    /// Keys answered only 409/503/5xx or not at all.
    pub unknown: u64,
    /// Unknown keys that turned out to have landed (once).
    pub unknown_landed: u64,
    pub accounts_read: u64,
    pub events_read: u64,
    /// Events whose eventId is not one of this run's keys (earlier runs, demo data).
    pub foreign_events: u64,
    pub violation_count: u64,
    /// The first violations, up to a fixed limit.
    pub violations: Vec<Violation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ExactlyOnce {
    /// The result when verification is turned off.
    pub fn skipped() -> Self {
        ExactlyOnce {
            verdict: Verdict::Skipped,
            checked: 0,
            succeeded: 0,
            rejected: 0,
            unknown: 0,
            unknown_landed: 0,
            accounts_read: 0,
            events_read: 0,
            foreign_events: 0,
            violation_count: 0,
            violations: Vec::new(),
            error: None,
        }
    }

    /// Counts `violation`, and lists it while the list has room.
    pub(super) fn note(&mut self, violation: Violation) {
        self.violation_count += 1;
        if self.violations.len() < MAX_REPORTED_VIOLATIONS {
            self.violations.push(violation);
        }
    }

    /// Settles the verdict once the last read is in: `error` is the first read that failed.
    pub(super) fn conclude(mut self, error: Option<String>) -> Self {
        self.verdict = verdict(self.violation_count, error.is_some());
        self.error = error;
        self
    }
}

/// A violation outweighs a read that failed; a failed read leaves the run unproven.
fn verdict(violations: u64, read_failed: bool) -> Verdict {
    if violations > 0 {
        Verdict::Fail
    } else if read_failed {
        Verdict::Incomplete
    } else {
        Verdict::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn violation(n: u128) -> Violation {
        Violation {
            key: Uuid::from_u128(n),
            kind: ViolationKind::Lost,
            detail: String::new(),
        }
    }

    #[test]
    fn a_violation_outweighs_a_failed_read_and_a_failed_read_leaves_it_incomplete() {
        assert_eq!(verdict(1, true), Verdict::Fail);
        assert_eq!(verdict(1, false), Verdict::Fail);
        assert_eq!(verdict(0, true), Verdict::Incomplete);
        assert_eq!(verdict(0, false), Verdict::Pass);
        let e = ExactlyOnce::skipped().conclude(Some("gone".into()));
        assert_eq!(
            (e.verdict, e.error.as_deref()),
            (Verdict::Incomplete, Some("gone"))
        );
    }

    #[test]
    fn every_violation_is_counted_and_only_the_first_are_listed() {
        let mut found = ExactlyOnce::skipped();
        for n in 0..MAX_REPORTED_VIOLATIONS as u128 + 3 {
            found.note(violation(n));
        }
        assert_eq!(found.violation_count, MAX_REPORTED_VIOLATIONS as u64 + 3);
        assert_eq!(found.violations.len(), MAX_REPORTED_VIOLATIONS);
        assert_eq!(found.violations[0].key, Uuid::from_u128(0));
    }
}
