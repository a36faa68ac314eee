//! What the client saw for each idempotency key, and what that implies about whether the
//! write may, must, or must not have landed.

use bytes::Bytes;
use uuid::Uuid;

use crate::http::Outcome;
use crate::op::Op;

/// Status recorded for an attempt that got no answer (or, behind `tally-client`, none that
/// was a success or final).
pub const NO_ANSWER: u16 = 0;
/// Status recorded for a success `tally-client` returned (its answer's status is a 2xx).
const SUCCESS_SEEN_BY_CLIENT: u16 = 200;

/// True for a 4xx that says the write was not applied (409, 408, 425 and 429 are retryable).
pub fn is_definitive_failure(status: u16) -> bool {
    (400..500).contains(&status) && !matches!(status, 408 | 409 | 425 | 429)
}

fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// What the answers imply for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Some attempt was answered 2xx: the write must be in history exactly once.
    Succeeded,
    /// No 2xx and the last answer was a definitive 4xx: it must not be in history.
    Rejected,
    /// Only retryable answers (409, 503, 5xx) or no answer: it may be there at most once.
    Unknown,
}

/// Everything observed for one idempotency key.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    pub key: Uuid,
    pub op: Op,
    /// Status of each attempt in order; [`NO_ANSWER`] for a transport error.
    pub statuses: Vec<u16>,
    /// Body of the first 2xx answer.
    pub first_ok_body: Option<Bytes>,
    /// Body of a later 2xx answer that differed from the first.
    pub mismatched_body: Option<Bytes>,
}

impl KeyRecord {
    /// A key about to be sent for `op`.
    pub fn new(key: Uuid, op: Op) -> Self {
        KeyRecord {
            key,
            op,
            statuses: Vec::with_capacity(2),
            first_ok_body: None,
            mismatched_body: None,
        }
    }

    /// Notes one attempt's outcome.
    pub fn observe(&mut self, outcome: &Outcome) {
        let Ok(answer) = outcome else {
            self.statuses.push(NO_ANSWER);
            return;
        };
        self.statuses.push(answer.status);
        if !is_success(answer.status) {
            return;
        }
        match &self.first_ok_body {
            None => self.first_ok_body = Some(answer.body.clone()),
            Some(first) => {
                if self.mismatched_body.is_none() && !same_body(first, &answer.body) {
                    self.mismatched_body = Some(answer.body.clone());
                }
            }
        }
    }

    /// Notes a write the client saw answered 2xx on its `attempts`-th attempt, the earlier
    /// ones not known to have landed (their answers stay inside the client).
    pub fn landed(&mut self, attempts: u32) {
        self.unanswered(attempts.saturating_sub(1));
        self.statuses.push(SUCCESS_SEEN_BY_CLIENT);
    }

    /// Notes `attempts` attempts that ended without a 2xx or a final answer.
    pub fn unanswered(&mut self, attempts: u32) {
        self.statuses
            .extend(std::iter::repeat_n(NO_ANSWER, attempts as usize));
    }

    /// What the answers imply.
    pub fn fate(&self) -> Fate {
        if self.statuses.iter().any(|&s| is_success(s)) {
            Fate::Succeeded
        } else if self
            .statuses
            .last()
            .is_some_and(|&s| is_definitive_failure(s))
        {
            Fate::Rejected
        } else {
            Fate::Unknown
        }
    }
}

/// Equal bytes, or equal JSON values (so key order and spacing do not matter).
pub fn same_body(a: &[u8], b: &[u8]) -> bool {
    if a == b {
        return true;
    }
    match (
        serde_json::from_slice::<serde_json::Value>(a),
        serde_json::from_slice::<serde_json::Value>(b),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{Answer, TransportError};

    fn answer(status: u16, body: &'static str) -> Outcome {
        Ok(Answer {
            status,
            replayed: false,
            retry_after: None,
            body: Bytes::from_static(body.as_bytes()),
        })
    }

    fn record(outcomes: &[Outcome]) -> KeyRecord {
        let mut r = KeyRecord::new(Uuid::nil(), Op::deposit(Uuid::nil(), 1));
        for o in outcomes {
            r.observe(o);
        }
        r
    }

    #[test]
    fn fates() {
        let lost = Err(TransportError {
            kind: "timeout",
            detail: String::new(),
        });
        assert_eq!(
            record(&[answer(503, ""), answer(200, "{}")]).fate(),
            Fate::Succeeded
        );
        assert_eq!(
            record(&[answer(503, ""), answer(422, "")]).fate(),
            Fate::Rejected
        );
        assert_eq!(
            record(&[answer(422, ""), answer(409, "")]).fate(),
            Fate::Unknown
        );
        assert_eq!(record(&[lost]).fate(), Fate::Unknown);
        assert_eq!(record(&[]).fate(), Fate::Unknown);
    }

    #[test]
    fn bodies_compare_as_json() {
        let same = record(&[
            answer(200, r#"{"a":1,"b":2}"#),
            answer(200, r#"{ "b":2, "a":1 }"#),
        ]);
        assert!(same.mismatched_body.is_none());
        let differ = record(&[answer(200, r#"{"a":1}"#), answer(201, r#"{"a":2}"#)]);
        assert!(differ.mismatched_body.is_some());
    }
}
