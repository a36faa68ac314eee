//! The one sync loop: drains the outbox in order, one run at a time, never skipping ahead.
//!
//! For each run (see [`Outbox::next_run`]): send it with idempotency enforced and no expected
//! version; on success or "already synced" mark it synced; on an ambiguous failure, a
//! refusal to apply or an in-flight duplicate, back off (exponential, with seeded jitter) and
//! resend exactly the same run. A refusal of the run itself, or `max_attempts` failed sends,
//! stops the loop with the reason and leaves the queue intact: the next sync resends the same
//! run, with the same sequences, however much later.
//!
//! Marking synced is not atomic with the ack: a crash between them makes the next sync resend
//! the run, and the store answers "already committed", which marks it then.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::crash::{CrashPoint, Crashed, Hooks};
use crate::outbox::{OpenRun, Outbox, OutboxError};
use tally::account::AccountId;
use tally::backoff::Backoff;
use tally::device::protocol::{SyncRequest, SyncResponse, SyncStatus};
use tally::device::{DeviceId, MAX_RUN_EVENTS};
use tally::store::wall_clock_ms;

/// Events per sync request unless `--batch-size` says otherwise (at most [`MAX_RUN_EVENTS`]).
pub const DEFAULT_BATCH_SIZE: usize = 64;
/// Sends of one run before a sync gives up (the run stays queued).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 8;
/// The first backoff; each failed send of a run doubles it, up to [`MAX_BACKOFF`].
pub const BASE_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait between two sends of a run.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How the loop is bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncOptions {
    /// Events per run, 1..=[`MAX_RUN_EVENTS`].
    pub batch_size: usize,
    /// Sends of one run before the loop stops, at least 1.
    pub max_attempts: u32,
    pub base_backoff: Duration,
    pub max_backoff: Duration,
    /// Seeds the backoff jitter, so a test replays the same waits.
    pub jitter_seed: u64,
}

impl Default for SyncOptions {
    fn default() -> Self {
        Self {
            batch_size: DEFAULT_BATCH_SIZE,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            base_backoff: BASE_BACKOFF,
            max_backoff: MAX_BACKOFF,
            jitter_seed: 0,
        }
    }
}

/// Why a send did not sync the run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// Resend the same run after a backoff: unreachable, timed out, answer lost, not applied,
    /// or a write holding these sequences still in flight.
    #[error("{detail}")]
    Retry { in_flight: bool, detail: String },
    /// The server refused this run; resending it unchanged cannot succeed.
    #[error("refused ({code}): {detail}")]
    Refused { code: String, detail: String },
}

/// How the loop reaches a server.
#[async_trait]
pub trait SyncTransport: Send + Sync {
    /// Sends one run. `Ok` only when the server says every event of it is in the store.
    async fn send(
        &self,
        device: DeviceId,
        request: &SyncRequest,
    ) -> Result<SyncResponse, TransportError>;
}

/// Why a sync stopped with events still queued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    AttemptsExhausted {
        account: AccountId,
        first_seq: u64,
        last_seq: u64,
        attempts: u32,
        last_error: String,
    },
    Refused {
        account: AccountId,
        first_seq: u64,
        last_seq: u64,
        code: String,
        detail: String,
    },
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::AttemptsExhausted {
                account,
                first_seq,
                last_seq,
                attempts,
                last_error,
            } => write!(
                f,
                "gave up after {attempts} attempts at run {first_seq}..={last_seq} of account \
                 {account} (last error: {last_error}); the queue is intact, sync again later"
            ),
            StopReason::Refused {
                account,
                first_seq,
                last_seq,
                code,
                detail,
            } => write!(
                f,
                "the server refused run {first_seq}..={last_seq} of account {account} ({code}: \
                 {detail}); the queue is intact"
            ),
        }
    }
}

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Runs this sync appended to the store.
    pub runs_synced: u64,
    /// Runs found already in the store (an earlier answer was lost).
    pub runs_already_synced: u64,
    pub events_synced: u64,
    /// Failed sends that were retried or ended the sync.
    pub failed_sends: u64,
    pub in_flight_duplicates: u64,
    /// `None` when the outbox is fully synced.
    pub stopped: Option<StopReason>,
}

/// Why the loop could not run to a verdict.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Outbox(#[from] OutboxError),
    #[error(transparent)]
    Crashed(#[from] Crashed),
}

/// The backoff before send number `attempt + 1`: exponential from `base`, capped at `max`
/// (the server's [`Backoff`] bound), drawn uniformly from its upper half so that devices
/// coming back together spread out. The draw comes from the loop's generator (seeded by
/// `--jitter-seed`), not a hash of the attempt, and may reach the bound itself: kept so, a
/// seed replays the waits it always gave.
pub fn backoff(options: &SyncOptions, attempt: u32, rng: &mut impl Rng) -> Duration {
    let full = Backoff::new(options.base_backoff, options.max_backoff).bound(attempt);
    let half = full / 2;
    let span = u64::try_from((full - half).as_millis()).unwrap_or(u64::MAX);
    half + Duration::from_millis(rng.gen_range(0..=span))
}

/// The one sync loop of a device.
pub struct SyncLoop<'a, T: SyncTransport + ?Sized> {
    outbox: &'a mut Outbox,
    transport: &'a T,
    options: SyncOptions,
    rng: ChaCha8Rng,
}

impl<'a, T: SyncTransport + ?Sized> SyncLoop<'a, T> {
    pub fn new(outbox: &'a mut Outbox, transport: &'a T, options: SyncOptions) -> Self {
        let options = SyncOptions {
            batch_size: options.batch_size.clamp(1, MAX_RUN_EVENTS),
            max_attempts: options.max_attempts.max(1),
            ..options
        };
        Self {
            outbox,
            transport,
            rng: ChaCha8Rng::seed_from_u64(options.jitter_seed),
            options,
        }
    }

    /// Drains the outbox, or stops with a reason. `hooks` is called at every crash point.
    pub async fn run(&mut self, hooks: &mut dyn Hooks) -> Result<SyncReport, SyncError> {
        let _one_loop = self.outbox.lock_sync()?;
        let device = self.outbox.device_id();
        let mut report = SyncReport::default();
        while let Some(run) = self
            .outbox
            .next_run(self.options.batch_size, wall_clock_ms())?
        {
            hooks.at(CrashPoint::RunPersisted)?;
            let request = run.request();
            let mut attempt = 0u32;
            let answer = loop {
                attempt += 1;
                let failure = match self.transport.send(device, &request).await {
                    Ok(answer) => match covers(&run, &answer) {
                        Ok(()) => break answer,
                        Err(detail) => TransportError::Refused {
                            code: "ANSWER_DOES_NOT_COVER_RUN".into(),
                            detail,
                        },
                    },
                    Err(e) => e,
                };
                report.failed_sends += 1;
                self.outbox.note_attempt(&run, Some(&failure.to_string()))?;
                match failure {
                    TransportError::Refused { code, detail } => {
                        tracing::warn!(%code, %detail, "device sync run refused");
                        report.stopped = Some(StopReason::Refused {
                            account: run.account,
                            first_seq: run.first_seq,
                            last_seq: run.last_seq,
                            code,
                            detail,
                        });
                        return Ok(report);
                    }
                    TransportError::Retry { in_flight, detail } => {
                        report.in_flight_duplicates += u64::from(in_flight);
                        if attempt >= self.options.max_attempts {
                            report.stopped = Some(StopReason::AttemptsExhausted {
                                account: run.account,
                                first_seq: run.first_seq,
                                last_seq: run.last_seq,
                                attempts: attempt,
                                last_error: detail,
                            });
                            return Ok(report);
                        }
                        let wait = backoff(&self.options, attempt, &mut self.rng);
                        tracing::debug!(attempt, wait_ms = wait.as_millis() as u64, %detail, "resending the same run");
                        tokio::time::sleep(wait).await;
                    }
                }
            };
            hooks.at(CrashPoint::Acked)?;
            let version = answer.aggregate_version;
            self.outbox.mark_synced(&run, version, wall_clock_ms())?;
            match answer.status {
                SyncStatus::Synced => report.runs_synced += 1,
                SyncStatus::AlreadySynced => report.runs_already_synced += 1,
            }
            report.events_synced += run.events.len() as u64;
            hooks.at(CrashPoint::MarkedSynced)?;
        }
        Ok(report)
    }
}

/// Whether a success answer proves the whole run is in the store. A server that says less is
/// not believed: nothing is marked synced on it.
fn covers(run: &OpenRun, answer: &SyncResponse) -> Result<(), String> {
    let ok = match answer.status {
        SyncStatus::Synced => answer.last_seq == run.last_seq && answer.aggregate_version.is_some(),
        SyncStatus::AlreadySynced => answer.last_seq >= run.last_seq,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the answer {:?} (lastSeq {}) does not cover run {}..={}",
            answer.status, answer.last_seq, run.first_seq, run.last_seq
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_backoff_doubles_within_jittered_bounds_and_is_capped() {
        let options = SyncOptions {
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            ..SyncOptions::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for attempt in 1..=12u32 {
            let full = Duration::from_millis(100 * (1u64 << (attempt - 1).min(30)))
                .min(Duration::from_millis(1000));
            let wait = backoff(&options, attempt, &mut rng);
            assert!(
                wait >= full / 2 && wait <= full,
                "attempt {attempt}: {wait:?}"
            );
        }
    }

    /// Rule: a seed's waits are pinned (the defaults: 200 ms doubling to 30 s, each drawn
    /// from its upper half in whole milliseconds), so `--jitter-seed` replays them.
    #[test]
    fn device_backoff_waits_are_pinned_per_seed() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let waits: Vec<u128> = (1..=10)
            .map(|a| backoff(&SyncOptions::default(), a, &mut rng).as_millis())
            .collect();
        assert_eq!(
            waits,
            [
                171, 346, 641, 866, 2_959, 4_366, 7_681, 17_719, 22_819, 18_859
            ]
        );
    }

    #[test]
    fn device_backoff_jitter_is_replayed_by_its_seed() {
        let options = SyncOptions::default();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (1..8)
                .map(|a| backoff(&options, a, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }
}
