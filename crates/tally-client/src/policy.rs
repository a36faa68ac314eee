//! The retry contract as pure functions: what an answer means, and how long to wait.

use std::time::Duration;

use crate::ApiError;

/// The bounds every call runs within. [`RetryPolicy::default`] gives each field the default
/// its doc names: at most 6 requests within 30 s, 10 s each, waits from 100 ms doubling to
/// 2 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Requests per call, the first included. Default 6.
    pub max_attempts: u32,
    /// Time per call from the first send, waits included; no attempt starts or runs past it.
    /// At most [`MAX_CALL_TIME`]: below the server's window less a write's life (82 s on the
    /// embedded store and 77 s on Celeriant with the defaults), so that a write that never
    /// got an answer is never resent once its key may be forgotten. Default 30 s.
    pub total: Duration,
    /// Time per attempt for a complete answer. Default 10 s.
    pub attempt_timeout: Duration,
    /// The wait before the first retry, doubled for each one after it. Default 100 ms.
    pub backoff: Duration,
    /// The longest wait the doubling reaches (a `Retry-After` may ask for longer). Default
    /// 2 s.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 6,
            total: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(10),
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
        }
    }
}

/// The longest [`RetryPolicy::total`] a client accepts: below the server's default window less
/// a write's life (77 s on Celeriant), with room to spare, so that no resend of a write that
/// never got an answer (and so no window) goes out after its key may be forgotten.
pub const MAX_CALL_TIME: std::time::Duration = std::time::Duration::from_secs(60);

impl RetryPolicy {
    /// Why this policy cannot be used, if it cannot.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.max_attempts == 0 {
            return Err("max_attempts must be at least 1");
        }
        if self.total.is_zero() || self.attempt_timeout.is_zero() {
            return Err("total and attempt_timeout must be above zero");
        }
        if self.total > MAX_CALL_TIME {
            return Err("total is above MAX_CALL_TIME (a resend could outlive the key's window)");
        }
        Ok(())
    }

    /// The wait after attempt `attempt` (1-based) failed without a `Retry-After`.
    pub fn backoff_after(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(16);
        self.backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }
}

/// What an answer's status and error code mean for the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// The answer: 2xx.
    Success,
    /// Not known to have landed (or shed before it was read): the same request again, under
    /// the same key.
    Retry,
    /// Final: a rule's refusal, bad input, a missing account. Never retried.
    Final,
}

/// Classifies an answer. A 409 is a retry only as `CONFLICT` (in flight, or not known to
/// have landed); `ACCOUNT_EXISTS` and every other 409 are final. A 500 is retried because it
/// can follow a write whose outcome is unknown (and replays it if it landed).
pub fn meaning(status: u16, error: Option<&ApiError>) -> Meaning {
    match status {
        200..=299 => Meaning::Success,
        409 => match error {
            Some(e) if e.code == "CONFLICT" => Meaning::Retry,
            _ => Meaning::Final,
        },
        429 | 500 | 502 | 503 | 504 => Meaning::Retry,
        _ => Meaning::Final,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(c: &str) -> ApiError {
        ApiError {
            code: c.into(),
            message: String::new(),
            error_id: None,
        }
    }

    #[test]
    fn only_a_conflict_409_is_retried() {
        assert_eq!(meaning(409, Some(&code("CONFLICT"))), Meaning::Retry);
        assert_eq!(meaning(409, Some(&code("ACCOUNT_EXISTS"))), Meaning::Final);
        assert_eq!(meaning(409, None), Meaning::Final);
    }

    #[test]
    fn refusals_are_final_and_unknown_outcomes_retried() {
        for s in [400, 401, 403, 404, 413, 415, 422] {
            assert_eq!(meaning(s, Some(&code("X"))), Meaning::Final, "{s}");
        }
        for s in [429, 500, 502, 503, 504] {
            assert_eq!(meaning(s, None), Meaning::Retry, "{s}");
        }
        assert_eq!(meaning(201, None), Meaning::Success);
    }

    #[test]
    fn a_call_may_not_outlive_the_window() {
        assert_eq!(RetryPolicy::default().check(), Ok(()));
        let long = RetryPolicy {
            total: MAX_CALL_TIME + Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        assert!(long.check().is_err());
        let none = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert!(none.check().is_err());
    }

    /// A duration as the README writes it: whole seconds as "N s", else "N ms".
    fn as_written(d: Duration) -> String {
        if d.subsec_millis() == 0 {
            format!("{} s", d.as_secs())
        } else {
            format!("{} ms", d.as_millis())
        }
    }

    /// Rule: the crate's README states the policy's defaults as the code has them: its
    /// table row for each field names the default value.
    #[test]
    fn the_readme_states_the_default_policy() {
        let readme = include_str!("../README.md");
        let p = RetryPolicy::default();
        let rows = [
            ("max_attempts", p.max_attempts.to_string()),
            ("total", as_written(p.total)),
            ("attempt_timeout", as_written(p.attempt_timeout)),
            ("backoff", as_written(p.backoff)),
            ("max_backoff", as_written(p.max_backoff)),
        ];
        for (field, value) in rows {
            let row = format!("| `{field}` | {value} |");
            assert!(readme.contains(&row), "README.md lacks the row {row}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_ceiling() {
        let p = RetryPolicy::default();
        let waits: Vec<_> = (1..=7).map(|a| p.backoff_after(a).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(p.backoff_after(u32::MAX), p.max_backoff);
    }
}
