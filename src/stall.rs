//! A replica that was not running: stopped (SIGSTOP), a frozen container or VM, a host that
//! stalled. While it stood still, requests kept arriving in its sockets, unread; once it
//! runs again it reads them as if they had just been sent. A write's life (its deadline,
//! which the idempotency window must outlast) starts when the request is read, so a write
//! that waited unread longer than the window minus that life can land after a retry of it
//! landed elsewhere and fell out of the index: written twice (e.g. a
//! replica paused for 95 s with the default 90 s window). And a write that waited unread a
//! few seconds can land after its client, retrying elsewhere, was told a final 422.
//!
//! So a thread of its own (not a runtime task: a busy runtime runs late, a stopped process
//! does not run at all) ticks every [`TICK`]; a tick later than [`THRESHOLD`] by the
//! monotonic or the wall clock (a paused VM may stop the first) means the process stood
//! still. For [`FENCE`] after that (plus a request's own waits, see [`StallWatch::start`]),
//! keyed writes are answered with a retryable 503 before anything is decided: whatever
//! waited unread through the stall is read in that time, and its client's retry is decided
//! afresh (or replayed, if a retry already landed). A write does not wait for the thread to
//! notice: on resuming, the runtime may read a waiting request before the thread runs, so a
//! last tick older than [`THRESHOLD`], by either clock, is a stall too.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use crate::metrics::Metrics;

/// How often the watch thread looks at the clocks.
pub const TICK: Duration = Duration::from_millis(100);
/// A tick this much late means the process stood still. Far above any scheduling delay of a
/// runnable thread on a loaded host, far below the margin between a write's life and the
/// idempotency window (85 s on the embedded store, 80 s on Celeriant, by default).
pub const THRESHOLD: Duration = Duration::from_secs(2);
/// How long keyed writes are refused after a stall, at least: long enough for every request
/// that waited unread through it to be read. A request's own waits once read (at the gate,
/// for an in-flight slot, again after a slow body) are each bounded by
/// `--max-queue-wait-ms`, which [`StallWatch::start`] adds three times.
pub const FENCE: Duration = Duration::from_secs(5);

/// Whether the replica stood still recently.
pub struct StallWatch {
    origin: Instant,
    /// Whether the watch thread runs (only then does a stale tick mean anything).
    watching: AtomicBool,
    /// Milliseconds since `origin` at the thread's last tick, and the wall clock then (ms
    /// since the Unix epoch): a stop the monotonic clock does not show may show on the other.
    last_tick_ms: AtomicU64,
    last_tick_wall_ms: AtomicU64,
    /// How long keyed writes are refused after a stall.
    fence: Duration,
    /// Milliseconds since `origin` until which keyed writes are refused (0: never fenced).
    fenced_until_ms: AtomicU64,
    /// How long the last stall lasted, in ms, for the refusal's message.
    last_stall_ms: AtomicU64,
    metrics: Arc<Metrics>,
}

impl StallWatch {
    /// A watch with its thread running until the returned value is dropped; a stall fences
    /// keyed writes for [`FENCE`] plus three times `max_queue_wait`.
    pub fn start(metrics: Arc<Metrics>, max_queue_wait: Duration) -> Arc<Self> {
        let mut watch = Self::new(metrics);
        watch.fence = FENCE.saturating_add(max_queue_wait.saturating_mul(3));
        let watch = Arc::new(watch);
        let weak = Arc::downgrade(&watch);
        let spawned = std::thread::Builder::new()
            .name("tally-stall-watch".into())
            .spawn(move || watch_clocks(weak));
        watch.watching.store(spawned.is_ok(), Ordering::Release);
        if let Err(e) = spawned {
            // Not fatal: the replica runs unwatched, as before this existed; said loudly.
            tracing::error!(error = %e, "could not start the stall watch thread");
        }
        watch
    }

    fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            origin: Instant::now(),
            watching: AtomicBool::new(false),
            last_tick_ms: AtomicU64::new(0),
            last_tick_wall_ms: AtomicU64::new(wall_ms(SystemTime::now())),
            fence: FENCE,
            fenced_until_ms: AtomicU64::new(0),
            last_stall_ms: AtomicU64::new(0),
            metrics,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// One tick, sampled at `at` (monotonic) and `wall`, late by `late` (the larger of the
    /// two clocks'): past [`THRESHOLD`], a stall. The tick is recorded as of its sample, so
    /// a stop between sampling and recording still shows as silence.
    pub fn observe(&self, late: Duration, at: Instant, wall: SystemTime) {
        let tick_ms = u64::try_from(at.saturating_duration_since(self.origin).as_millis())
            .unwrap_or(u64::MAX);
        if late >= THRESHOLD {
            self.fence_after(late);
        }
        // After the fence: a write between the two must not find neither.
        self.last_tick_ms.fetch_max(tick_ms, Ordering::AcqRel);
        self.last_tick_wall_ms
            .fetch_max(wall_ms(wall), Ordering::AcqRel);
    }

    /// [`StallWatch::observe`] for a tick sampled now.
    pub fn observe_now(&self, late: Duration) {
        self.observe(late, Instant::now(), SystemTime::now());
    }

    fn fence_after(&self, late: Duration) {
        let stalled_ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX);
        let fence_ms = u64::try_from(self.fence.as_millis()).unwrap_or(u64::MAX);
        let until = self.now_ms().saturating_add(fence_ms);
        self.last_stall_ms.store(stalled_ms, Ordering::Relaxed);
        self.fenced_until_ms.fetch_max(until, Ordering::AcqRel);
        self.metrics.process_stalls.inc();
        tracing::warn!(
            stalled_ms,
            fence_ms,
            "this replica stood still (stopped or frozen); refusing keyed writes retryably while what waited unread is read"
        );
    }

    /// `Some(how long the stall was, in ms)` while keyed writes are refused after one, or
    /// while the thread has not ticked for longer than [`THRESHOLD`] (it has not run since
    /// the process resumed).
    pub fn fenced(&self) -> Option<u64> {
        let now = self.now_ms();
        if self.watching.load(Ordering::Acquire) {
            let silent = now.saturating_sub(self.last_tick_ms.load(Ordering::Acquire));
            let wall_silent = wall_ms(SystemTime::now())
                .saturating_sub(self.last_tick_wall_ms.load(Ordering::Acquire));
            let silent = silent.max(wall_silent);
            if silent >= THRESHOLD.as_millis() as u64 {
                return Some(silent);
            }
        }
        (now < self.fenced_until_ms.load(Ordering::Acquire))
            .then(|| self.last_stall_ms.load(Ordering::Relaxed))
    }
}

/// The watch thread: ticks until the watch is dropped.
fn watch_clocks(watch: Weak<StallWatch>) {
    let (mut mono, mut wall) = (Instant::now(), SystemTime::now());
    loop {
        std::thread::sleep(TICK);
        let Some(watch) = watch.upgrade() else {
            return;
        };
        let (mono_now, wall_now) = (Instant::now(), SystemTime::now());
        let mono_late = mono_now.duration_since(mono).saturating_sub(TICK);
        // A wall clock stepped backwards says nothing; one stepped forwards by NTP looks
        // like a stall, which costs a few seconds of retryable refusals, never a wrong answer.
        let wall_late = wall_now
            .duration_since(wall)
            .unwrap_or_default()
            .saturating_sub(TICK);
        watch.observe(mono_late.max(wall_late), mono_now, wall_now);
        (mono, wall) = (mono_now, wall_now);
    }
}

/// Milliseconds since the Unix epoch (0 for a clock set before it).
fn wall_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_tick_fences_keyed_writes_and_a_punctual_one_does_not() {
        let watch = StallWatch::new(Arc::new(Metrics::new()));
        watch.observe_now(THRESHOLD - Duration::from_millis(1));
        assert_eq!(watch.fenced(), None);
        assert_eq!(watch.metrics.process_stalls.get(), 0);
        watch.observe_now(Duration::from_secs(95));
        assert_eq!(watch.fenced(), Some(95_000));
        assert_eq!(watch.metrics.process_stalls.get(), 1);
    }

    #[test]
    fn a_watch_thread_silent_past_the_threshold_fences_before_it_notices() {
        let mut watch = StallWatch::new(Arc::new(Metrics::new()));
        // A watch started a while ago, so a tick THRESHOLD ago is on its clock.
        watch.origin = Instant::now()
            .checked_sub(THRESHOLD * 5)
            .expect("the host has been up a while");
        watch.watching.store(true, Ordering::Release);
        watch.observe_now(Duration::ZERO);
        assert_eq!(watch.fenced(), None);
        // As if the last tick was THRESHOLD ago: the process resumed, the thread not yet.
        let stale = watch.now_ms().saturating_sub(THRESHOLD.as_millis() as u64);
        watch.last_tick_ms.store(stale, Ordering::Release);
        assert!(
            watch
                .fenced()
                .is_some_and(|ms| ms >= THRESHOLD.as_millis() as u64)
        );
        // A stop only the wall clock shows (a frozen VM whose clock is set on resume).
        watch.last_tick_ms.store(watch.now_ms(), Ordering::Release);
        assert_eq!(watch.fenced(), None);
        let wall_stale = wall_ms(SystemTime::now()) - THRESHOLD.as_millis() as u64;
        watch.last_tick_wall_ms.store(wall_stale, Ordering::Release);
        assert!(watch.fenced().is_some());
        // Unwatched (the thread never started), a stale tick means nothing.
        watch.watching.store(false, Ordering::Release);
        assert_eq!(watch.fenced(), None);
    }

    #[test]
    fn the_fence_ends_after_its_time() {
        let watch = StallWatch::new(Arc::new(Metrics::new()));
        watch.observe_now(THRESHOLD);
        assert!(watch.fenced().is_some());
        // As if FENCE had passed since: the fence is a point on the watch's own clock.
        watch
            .fenced_until_ms
            .store(watch.now_ms(), Ordering::Release);
        assert_eq!(watch.fenced(), None);
    }
}
