//! The waits between a run's attempts: the one backoff ([`crate::backoff`]) with the write
//! loop's bounds, jittered by a draw from the run's first event id. A leaf beside its one
//! caller ([`super::Run::drive`]): the bounds are the write loop's, so they stay out of the
//! shared backoff, which knows no loop.

use std::time::Duration;

use crate::backoff::Backoff;

/// First backoff between attempts; doubles per attempt up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_millis(2);
const MAX_BACKOFF: Duration = Duration::from_millis(200);
/// The waits between attempts (see [`wait`]).
const ATTEMPT_BACKOFF: Backoff = Backoff::new(BASE_BACKOFF, MAX_BACKOFF);

/// Sleeps before attempt `attempt` (the second and later), growing per attempt.
pub(super) async fn sleep(attempt: u32, salt: u128) {
    tokio::time::sleep(wait(attempt, salt)).await;
}

/// The wait before attempt `attempt`: attempt 2 is the first retry. The jitter is drawn
/// from the salt (the run's first event id) and the attempt, deterministic, so siblings
/// spread apart without a global RNG and the simulation replays every wait.
fn wait(attempt: u32, salt: u128) -> Duration {
    let draw = (salt as u64 ^ (salt >> 64) as u64 ^ u64::from(attempt))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ATTEMPT_BACKOFF.wait(attempt.saturating_sub(1), draw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: the waits between attempts are pinned: 2 ms doubling per attempt to 200 ms,
    /// jittered into the upper half by the salt and attempt. The simulation's traces run
    /// through these waits, so a change to any of them is a change of behaviour.
    #[test]
    fn the_waits_between_attempts_are_pinned() {
        let salt: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
        let waits: Vec<u128> = (2..=10).map(|a| wait(a, salt).as_nanos()).collect();
        assert_eq!(
            waits,
            [
                1_507_777,
                3_860_908,
                6_214_039,
                11_015_554,
                21_368_685,
                42_170_200,
                124_523_331,
                134_876_462,
                111_677_977
            ]
        );
        for attempt in 2..40 {
            let wait = wait(attempt, salt);
            assert!(wait >= ATTEMPT_BACKOFF.bound(attempt - 1) / 2 && wait < MAX_BACKOFF);
        }
    }
}
