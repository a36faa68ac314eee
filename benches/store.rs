//! MemoryLog throughput: single-aggregate writes and point reads, on one and two threads.
//!
//! Every operation goes through the `EventLog` trait, as Tally calls it. Each thread drives
//! its share of the iterations inside one current-thread tokio runtime; a sample's time is
//! the wall time until every thread is done, so the two-thread figures are aggregate
//! throughput.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tally::store::memory::MemoryLog;
use tally::store::{AggregateKey, AggregateWrite, Event, EventLog, EventType, ReadFilter};

/// Payload size of a benchmark event, roughly an account event.
const PAYLOAD_BYTES: usize = 64;
/// Batches written before the read benchmarks start.
const READ_HISTORY: u64 = 1_000;

fn key(id: u128) -> AggregateKey {
    AggregateKey {
        org_id: 1,
        aggregate_type_id: 2,
        aggregate_id: id,
    }
}

fn one_event_write(key: AggregateKey, seq: u64) -> Vec<AggregateWrite> {
    vec![AggregateWrite {
        key,
        events: vec![Event {
            client_seq: seq,
            event_id: Some(u128::from(seq)),
            event_type: EventType { major: 1, minor: 0 },
            payload: Bytes::from_static(&[7; PAYLOAD_BYTES]),
            timestamp_ms: 0,
        }],
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: true,
    }]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime")
}

/// Runs `iters` operations split over `threads` threads; `op(log, thread, i)` is one.
fn run_split<F, Fut>(log: &Arc<MemoryLog>, threads: u64, iters: u64, op: F) -> Duration
where
    F: Fn(Arc<MemoryLog>, u64, u64) -> Fut + Send + Sync + Copy + 'static,
    Fut: Future<Output = ()>,
{
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let log = Arc::clone(log);
            let share = iters / threads + u64::from(t < iters % threads);
            thread::spawn(move || {
                runtime().block_on(async {
                    for i in 0..share {
                        op(Arc::clone(&log), t, i).await;
                    }
                })
            })
        })
        .collect();
    for h in handles {
        h.join().expect("bench thread");
    }
    start.elapsed()
}

fn writes(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_write_single_aggregate");
    group.throughput(Throughput::Elements(1));
    for threads in [1, 2] {
        group.bench_function(format!("{threads}_thread"), |b| {
            b.iter_custom(|iters| {
                // A fresh log per sample keeps memory bounded.
                let log = Arc::new(MemoryLog::new());
                run_split(&log, threads, iters, |log, t, i| async move {
                    // Each thread its own client id, so sequences never collide.
                    let client = u128::from(t) + 1;
                    let got = log.write(client, one_event_write(key(1), i + 1)).await;
                    assert!(got.is_ok(), "{got:?}");
                })
            });
        });
    }
    group.finish();
}

fn reads(c: &mut Criterion) {
    let log = Arc::new(MemoryLog::new());
    runtime().block_on(async {
        for seq in 1..=READ_HISTORY {
            let got = log.write(1, one_event_write(key(1), seq)).await;
            assert!(got.is_ok(), "{got:?}");
        }
    });
    let mut group = c.benchmark_group("memory_point_read_single_aggregate");
    group.throughput(Throughput::Elements(1));
    for threads in [1, 2] {
        group.bench_function(format!("{threads}_thread"), |b| {
            b.iter_custom(|iters| {
                run_split(&log, threads, iters, |log, t, i| async move {
                    let version = (i * 7 + t * 13) % READ_HISTORY + 1;
                    let filter = ReadFilter {
                        from_version: version,
                        to_version: Some(version),
                        ..ReadFilter::default()
                    };
                    let page = log.read(key(1), &filter).await;
                    assert!(page.is_ok_and(|p| p.batches.len() == 1));
                })
            });
        });
    }
    group.finish();
}

criterion_group!(benches, writes, reads);
criterion_main!(benches);
