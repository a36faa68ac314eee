//! Which arm of the loop a step took: the run branches on it, and the metrics count it
//! under its label. A leaf: the labels themselves are the metrics' own
//! ([`crate::metrics::arm`]), so a dashboard's series keep their names.

use crate::metrics::arm;

/// One arm of the write loop (`tally_write_outcomes_total`'s `arm` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arm {
    Success,
    /// 2003: the version guard bounced the write.
    Conflict,
    OutcomeUnknown,
    /// 2013: an earlier attempt is not yet durable.
    InflightDuplicate,
    /// 2002 settled: our event holds the sequence.
    SeqOurs,
    /// 2002 settled: a sibling's event holds the sequence.
    SeqSibling,
    /// 2002 unsettled: nothing visible holds the sequence.
    Unverifiable,
    NotApplied,
    GaveUp,
    /// A business rule refused a request.
    Rejected,
    /// The read-back answered a request that had landed.
    Replayed,
    StoreError,
    /// The run ended because the store could not be reached.
    StoreUnreachable,
    /// A first touch bounced off the version guard: the account exists. Not contention.
    FirstTouchBounce,
}

impl Arm {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Arm::Success => arm::SUCCESS,
            Arm::Conflict => arm::CONFLICT,
            Arm::OutcomeUnknown => arm::OUTCOME_UNKNOWN,
            Arm::InflightDuplicate => arm::INFLIGHT_DUPLICATE,
            Arm::SeqOurs => arm::SEQ_OURS,
            Arm::SeqSibling => arm::SEQ_SIBLING,
            Arm::Unverifiable => arm::UNVERIFIABLE,
            Arm::NotApplied => arm::NOT_APPLIED,
            Arm::GaveUp => arm::GAVE_UP,
            Arm::Rejected => arm::REJECTED,
            Arm::Replayed => arm::REPLAYED,
            Arm::StoreError => arm::STORE_ERROR,
            Arm::StoreUnreachable => arm::STORE_UNREACHABLE,
            Arm::FirstTouchBounce => arm::FIRST_TOUCH_BOUNCE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: every arm counts under exactly one of the metrics' labels, and every label
    /// that exists from start has its arm, in the same order.
    #[test]
    fn each_arm_counts_under_its_own_metric_label() {
        let labels = [
            Arm::Success,
            Arm::Conflict,
            Arm::OutcomeUnknown,
            Arm::InflightDuplicate,
            Arm::SeqOurs,
            Arm::SeqSibling,
            Arm::Unverifiable,
            Arm::NotApplied,
            Arm::GaveUp,
            Arm::Rejected,
            Arm::Replayed,
            Arm::StoreError,
            Arm::StoreUnreachable,
            Arm::FirstTouchBounce,
        ]
        .map(Arm::label);
        assert_eq!(labels, arm::ALL);
    }
}
