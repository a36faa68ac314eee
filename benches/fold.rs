//! Fold throughput: a cold catch-up of one long account.
//!
//! One account of [`EVENTS`] single-event batches, alternating `Deposited` / `Withdrawn`
//! `{"AmountCents":100}`, every event with an event id, all written by our own client id.
//! Two shapes of the same history:
//! - `in_window`: every batch is younger than the window, so every event enters the index
//!   (the worst case, and the one `reference-fold` measures);
//! - `past_window`: every batch is older than the window (decode + apply + sequence only).
//!
//! Two groups:
//! - `fold`: `AccountState::fold` over a pre-built `Vec<Batch>` with a `FoldContext`, the
//!   measure comparable with `/work/shared/bench/reference-fold`;
//! - `catch_up`: `Projection::catch_up` of a cold projection over a `MemoryLog` (paged reads,
//!   batch clones, locking and metrics included).
//!
//! Throughput is reported in events: criterion's "elem/s" is events/s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use tally::account::events::{DEPOSITED, WITHDRAWN};
use tally::account::{AccountId, Identity};
use tally::metrics::Metrics;
use tally::projection::{AccountState, FoldContext, ManualClock, Projection, ProjectionConfig};
use tally::store::memory::{MemoryLog, MemoryOptions, ServerClock};
use tally::store::{AggregateWrite, Batch, Event, SharedLog};
use uuid::Uuid;

/// Events (= batches) in the account.
const EVENTS: u64 = 1_000_000;
/// The projection's window, as in production.
const WINDOW_MS: u64 = 90_000;
/// Server time of the first batch.
const START_MS: u64 = 1_700_000_000_000;
/// Batches per millisecond of server time: the whole history spans 10 s, inside the window.
const BATCHES_PER_MS: u64 = 100;
/// Local monotonic "now" of the fold.
const NOW_MS: u64 = 1_000;

fn server_ts(version: u64) -> u64 {
    START_MS + version / BATCHES_PER_MS
}

/// The server time of the newest batch.
fn last_ts() -> u64 {
    server_ts(EVENTS)
}

/// A tip that makes every batch older than the window.
fn tip_past_window() -> u64 {
    last_ts() + WINDOW_MS + 1
}

fn event(version: u64) -> Event {
    Event {
        client_seq: version,
        event_id: Some(u128::from(version).wrapping_mul(31) | (1 << 100)),
        event_type: if version.is_multiple_of(2) {
            DEPOSITED
        } else {
            WITHDRAWN
        },
        payload: Bytes::from_static(br#"{"AmountCents":100}"#),
        timestamp_ms: server_ts(version),
    }
}

fn batches(client_id: u128) -> Vec<Batch> {
    (1..=EVENTS)
        .map(|v| Batch {
            version: v,
            client_id,
            server_timestamp_ms: server_ts(v),
            events: vec![event(v)].into(),
        })
        .collect()
}

fn context(client_id: u128, tip_ms: u64) -> FoldContext {
    FoldContext {
        client_id,
        window_ms: WINDOW_MS,
        // Keys are remembered exactly where entries are indexed: the bench measures both.
        retention_ms: WINDOW_MS,
        tip_ms,
        now_ms: NOW_MS,
        holds: false,
    }
}

/// Checks the fold did what the bench claims: every event applied, the balance right, and
/// the index holding every event (in window) or none (past it).
fn check(state: &AccountState, applied: u64, indexed: bool) {
    assert_eq!(applied, EVENTS);
    assert_eq!(state.version, EVENTS);
    assert_eq!(state.max_client_seq, EVENTS);
    // Withdraw first, then deposit, alternating: an even count nets to zero.
    assert_eq!(
        state.balance,
        if EVENTS.is_multiple_of(2) { 0 } else { -100 }
    );
    let want = if indexed { EVENTS as usize } else { 0 };
    assert_eq!(state.recent.len(), want);
}

fn pure_fold(c: &mut Criterion) {
    let identity = Identity::default();
    let client = identity.client();
    let history = batches(client);
    let mut group = c.benchmark_group("fold");
    group.throughput(Throughput::Elements(EVENTS));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    for (name, tip, indexed) in [
        ("in_window", last_ts(), true),
        ("past_window", tip_past_window(), false),
    ] {
        let ctx = context(client, tip);
        // Correctness of the measured work, once, outside the timing.
        let mut state = AccountState::default();
        let applied = state.fold(&history, &ctx).expect("fold");
        check(&state, applied, indexed);
        drop(state);
        group.bench_function(name, |b| {
            // A fresh (cold) state per iteration; dropping the filled index is not timed.
            b.iter_batched(
                AccountState::default,
                |mut state| {
                    let applied = state.fold(&history, &ctx).expect("fold");
                    assert_eq!(applied, EVENTS);
                    state
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

fn populated_log(identity: &Identity, account: AccountId) -> Arc<MemoryLog> {
    let clock = Arc::new(ServerClock::new(START_MS));
    let log = Arc::new(MemoryLog::with_options(MemoryOptions {
        clock: clock.clone(),
        ..MemoryOptions::default()
    }));
    for v in 1..=EVENTS {
        clock.set(server_ts(v));
        let write = AggregateWrite {
            key: identity.key(account),
            events: vec![event(v)],
            expected_version: Some(v - 1),
            allow_create: true,
            enforce_client_idempotency: true,
        };
        log.write_now(identity.client(), vec![write])
            .expect("populate");
    }
    log
}

fn catch_up(c: &mut Criterion) {
    let identity = Identity::default();
    let account = AccountId(Uuid::from_u128(0xacc));
    let log = populated_log(&identity, account);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let projection = |tip: u64| {
        let shared: SharedLog = log.clone();
        let p = Projection::new(
            shared,
            identity,
            ProjectionConfig::default(),
            Arc::new(ManualClock::new(NOW_MS)),
            Arc::new(Metrics::new()),
        );
        // The replica has already seen this server time (on this or another account).
        p.observe_server_time(tip);
        p
    };
    let mut group = c.benchmark_group("catch_up");
    group.throughput(Throughput::Elements(EVENTS));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(15));
    for (name, tip, indexed) in [
        ("in_window", last_ts(), true),
        ("past_window", tip_past_window(), false),
    ] {
        let p = projection(tip);
        let (slot, snap) = runtime.block_on(p.catch_up(account)).expect("catch up");
        assert_eq!(snap.version, EVENTS);
        check(&slot.state.lock(), EVENTS, indexed);
        drop((slot, p));
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let p = projection(tip);
                    let started = Instant::now();
                    let (_, snap) = runtime.block_on(p.catch_up(account)).expect("catch up");
                    total += started.elapsed();
                    assert_eq!(snap.version, EVENTS);
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, pure_fold, catch_up);
criterion_main!(benches);
