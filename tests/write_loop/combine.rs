//! Group commit ([`CombiningLog`]): writes of different accounts that are ready at once share
//! one store request, and every member is answered exactly as if it had written alone.
//!
//! The stack under test: `CombiningLog -> Recorder (what each request carried) -> FaultyLog ->
//! MemoryLog`. Writes are started together with `join!`, which polls each once (queueing it)
//! before any sender task runs, so which writes share a request is deterministic.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use tokio::time::Instant;

use tally::metrics::Metrics;
use tally::store::combine::{CombineConfig, CombiningLog};
use tally::store::faults::{Fault, FaultConfig, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, Event, EventLog, EventType,
    ReadFilter, ReadPage, SharedLog, StoreError, StoreResult,
};

use crate::common::required;

const CLIENT: ClientId = 7;
const ACCOUNTS: u128 = 1;

fn key(id: u128) -> AggregateKey {
    AggregateKey {
        org_id: 1,
        aggregate_type_id: ACCOUNTS,
        aggregate_id: id,
    }
}

/// One event at `seq` on aggregate `id`, guarded on `expected`.
fn write(id: u128, seq: u64, expected: u64) -> Vec<AggregateWrite> {
    vec![AggregateWrite {
        key: key(id),
        events: vec![Event {
            client_seq: seq,
            event_id: None,
            event_type: EventType { major: 1, minor: 0 },
            payload: Bytes::from_static(b"{}"),
            timestamp_ms: 0,
        }],
        expected_version: Some(expected),
        allow_create: true,
        enforce_client_idempotency: true,
    }]
}

/// Records the aggregates of every write request that reaches it; refuses a request of more
/// than one aggregate as a store whose accounts sit on different shards does, when asked.
struct Recorder {
    inner: SharedLog,
    requests: Mutex<Vec<Vec<AggregateKey>>>,
    cross_shard: bool,
}

impl Recorder {
    fn sizes(&self) -> Vec<usize> {
        self.requests.lock().iter().map(Vec::len).collect()
    }
}

#[async_trait]
impl EventLog for Recorder {
    async fn write(&self, client: ClientId, writes: Vec<AggregateWrite>) -> StoreResult<Vec<u64>> {
        self.requests
            .lock()
            .push(writes.iter().map(|w| w.key).collect());
        if self.cross_shard && writes.len() > 1 {
            return Err(StoreError::CrossShard);
        }
        self.inner.write(client, writes).await
    }
    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        self.inner.read(key, filter).await
    }
    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.inner.details(key).await
    }
    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.inner.trim_start(key, keep_from_version).await
    }
}

struct Stack {
    log: CombiningLog,
    recorder: Arc<Recorder>,
    faults: Arc<FaultyLog<MemoryLog>>,
    memory: Arc<MemoryLog>,
    metrics: Arc<Metrics>,
}

fn stack_with(config: CombineConfig, cross_shard: bool) -> Stack {
    let memory = Arc::new(MemoryLog::new());
    let faults = Arc::new(FaultyLog::new(memory.clone(), FaultConfig::default()));
    let recorder = Arc::new(Recorder {
        inner: faults.clone(),
        requests: Mutex::new(Vec::new()),
        cross_shard,
    });
    let metrics = Arc::new(Metrics::new());
    Stack {
        log: CombiningLog::new(recorder.clone(), config, metrics.clone()),
        recorder,
        faults,
        memory,
        metrics,
    }
}

fn stack() -> Stack {
    stack_with(CombineConfig::default(), false)
}

/// One store write in flight at a time: writes sent meanwhile wait for the next request.
fn one_in_flight() -> Stack {
    stack_with(
        CombineConfig {
            max_in_flight: 1,
            ..CombineConfig::default()
        },
        false,
    )
}

async fn version(memory: &MemoryLog, id: u128) -> u64 {
    match memory.details(key(id)).await {
        Ok(d) => d.max_version,
        Err(StoreError::AggregateNotFound) => 0,
        Err(e) => panic!("details of {id}: {e}"),
    }
}

fn splits(metrics: &Metrics, cause: &str) -> u64 {
    metrics.store_write_splits.with_label_values(&[cause]).get()
}

#[tokio::test(start_paused = true)]
async fn a_lone_write_goes_out_at_once_in_its_own_request() {
    let s = stack();
    let started = Instant::now();
    let versions = s.log.write(CLIENT, write(1, 1, 0)).await.expect("lands");
    assert_eq!(versions, vec![1]);
    // With time paused, any timer the write waited on would have moved the clock.
    assert_eq!(started.elapsed(), std::time::Duration::ZERO);
    assert_eq!(s.recorder.sizes(), vec![1]);
}

#[tokio::test]
async fn writes_ready_at_once_share_one_request_and_each_gets_its_own_versions() {
    let s = stack();
    s.log.write(CLIENT, write(2, 1, 0)).await.expect("lands");
    let (a, b, c) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 2, 1)),
        s.log.write(CLIENT, write(3, 3, 0)),
    );
    assert_eq!((a, b, c), (Ok(vec![1]), Ok(vec![2]), Ok(vec![1])));
    assert_eq!(s.recorder.sizes(), vec![1, 3]);
}

#[tokio::test]
async fn writes_ready_while_every_request_is_in_flight_fill_the_next_request() {
    let s = one_in_flight();
    let mut hold = s.faults.hold_next_write();
    let first = s.log.write(CLIENT, write(1, 1, 0));
    let later = async {
        assert!(hold.held().await, "the first write reaches the store");
        let joined = tokio::join!(
            s.log.write(CLIENT, write(2, 1, 0)),
            s.log.write(CLIENT, write(3, 1, 0)),
            s.log.write(CLIENT, write(4, 1, 0)),
            async {
                // The three are queued (polled once) before the store answers the first.
                drop(hold);
            }
        );
        (joined.0, joined.1, joined.2)
    };
    let (first, (b, c, d)) = tokio::join!(first, later);
    assert_eq!(first, Ok(vec![1]));
    assert_eq!((b, c, d), (Ok(vec![1]), Ok(vec![1]), Ok(vec![1])));
    assert_eq!(s.recorder.sizes(), vec![1, 3]);
}

#[tokio::test]
async fn a_stale_guard_refuses_only_its_own_member_and_the_others_land_after_one_more_trip() {
    let s = stack();
    s.log.write(CLIENT, write(1, 1, 0)).await.expect("lands");
    let (stale, b, c) = tokio::join!(
        s.log.write(CLIENT, write(1, 2, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
        s.log.write(CLIENT, write(3, 1, 0)),
    );
    assert_eq!(
        stale,
        Err(StoreError::Conflict {
            expected: 0,
            current: 1
        })
    );
    assert_eq!((b, c), (Ok(vec![1]), Ok(vec![1])));
    // The combined request, then each member alone, unchanged.
    assert_eq!(s.recorder.sizes(), vec![1, 3, 1, 1, 1]);
    assert_eq!(version(&s.memory, 1).await, 1);
    assert_eq!(splits(&s.metrics, "conflict"), 1);
}

#[tokio::test]
async fn a_used_sequence_refuses_only_its_own_member() {
    let s = stack();
    s.log.write(CLIENT, write(1, 5, 0)).await.expect("lands");
    let (used, fresh) = tokio::join!(
        s.log.write(CLIENT, write(1, 3, 1)),
        s.log.write(CLIENT, write(2, 3, 0)),
    );
    assert!(
        matches!(used, Err(StoreError::IdempotencyViolation { .. })),
        "{used:?}"
    );
    assert_eq!(fresh, Ok(vec![1]));
    assert_eq!(version(&s.memory, 1).await, 1);
    assert_eq!(splits(&s.metrics, "idempotency_violation"), 1);
}

#[tokio::test]
async fn a_lost_acknowledgement_is_unknown_to_every_member_and_applied_to_all() {
    let s = stack();
    s.faults.fail_next_write(Fault::LostAck);
    let (a, b, c) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
        s.log.write(CLIENT, write(3, 1, 0)),
    );
    for r in [&a, &b, &c] {
        assert!(matches!(r, Err(StoreError::OutcomeUnknown { .. })), "{r:?}");
    }
    assert_eq!(
        s.recorder.sizes(),
        vec![3],
        "an unknown outcome is not resent here"
    );
    for id in 1..=3 {
        assert_eq!(version(&s.memory, id).await, 1, "account {id}");
    }
}

#[tokio::test]
async fn a_lost_request_is_unknown_to_every_member_and_applied_to_none() {
    let s = stack();
    s.faults.fail_next_write(Fault::LostRequest);
    let (a, b) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
    );
    for r in [&a, &b] {
        assert!(matches!(r, Err(StoreError::OutcomeUnknown { .. })), "{r:?}");
    }
    for id in 1..=2 {
        assert_eq!(version(&s.memory, id).await, 0, "account {id}");
    }
    // Each member's own retry, with its held sequence, lands once.
    let (a, b) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
    );
    assert_eq!((a, b), (Ok(vec![1]), Ok(vec![1])));
}

#[tokio::test]
async fn accounts_on_different_shards_stop_combining_and_every_write_goes_alone() {
    let s = stack_with(CombineConfig::default(), true);
    let (a, b) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
    );
    assert_eq!((a, b), (Ok(vec![1]), Ok(vec![1])));
    assert!(!s.log.is_combining());
    assert_eq!(splits(&s.metrics, "cross_shard"), 1);
    let (c, d) = tokio::join!(
        s.log.write(CLIENT, write(3, 1, 0)),
        s.log.write(CLIENT, write(4, 1, 0)),
    );
    assert_eq!((c, d), (Ok(vec![1]), Ok(vec![1])));
    assert_eq!(s.recorder.sizes(), vec![2, 1, 1, 1, 1]);
}

#[tokio::test]
async fn one_account_never_appears_twice_in_one_request() {
    let s = one_in_flight();
    let (a, b, c) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(1, 2, 1)),
        s.log.write(CLIENT, write(2, 1, 0)),
    );
    assert_eq!((a, b, c), (Ok(vec![1]), Ok(vec![2]), Ok(vec![1])));
    let requests = s.recorder.requests.lock().clone();
    assert_eq!(requests, vec![vec![key(1), key(2)], vec![key(1)]]);
}

#[tokio::test]
async fn writes_of_another_client_or_aggregate_type_go_in_another_request() {
    let s = stack();
    let mut other_type = write(3, 1, 0);
    other_type[0].key.aggregate_type_id = ACCOUNTS + 1;
    let (a, b, c) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT + 1, write(2, 1, 0)),
        s.log.write(CLIENT, other_type),
    );
    assert_eq!((a, b, c), (Ok(vec![1]), Ok(vec![1]), Ok(vec![1])));
    assert_eq!(s.recorder.sizes(), vec![1, 1, 1]);
}

#[tokio::test]
async fn a_request_carries_at_most_the_configured_accounts() {
    let s = stack_with(
        CombineConfig {
            max_in_flight: 1,
            max_aggregates: 2,
            ..CombineConfig::default()
        },
        false,
    );
    let results = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
        s.log.write(CLIENT, write(3, 1, 0)),
        s.log.write(CLIENT, write(4, 1, 0)),
        s.log.write(CLIENT, write(5, 1, 0)),
    );
    assert_eq!(
        [results.0, results.1, results.2, results.3, results.4],
        [
            Ok(vec![1]),
            Ok(vec![1]),
            Ok(vec![1]),
            Ok(vec![1]),
            Ok(vec![1])
        ]
    );
    assert_eq!(s.recorder.sizes(), vec![2, 2, 1]);
}

#[tokio::test]
async fn a_caller_that_stopped_waiting_gets_nothing_sent() {
    let s = one_in_flight();
    let mut hold = s.faults.hold_next_write();
    let first = s.log.write(CLIENT, write(1, 1, 0));
    let later = async {
        assert!(hold.held().await);
        {
            // Queued, then abandoned before any sender is free.
            let abandoned = std::pin::pin!(s.log.write(CLIENT, write(2, 1, 0)));
            let _ = futures_poll_once(abandoned).await;
        }
        drop(hold);
        s.log.write(CLIENT, write(3, 1, 0)).await
    };
    let (first, third) = tokio::join!(first, later);
    assert_eq!((first, third), (Ok(vec![1]), Ok(vec![1])));
    assert_eq!(version(&s.memory, 2).await, 0);
    assert_eq!(s.recorder.sizes(), vec![1, 1]);
}

/// Polls `fut` once and gives it back unfinished (or its output).
async fn futures_poll_once<F: std::future::Future + Unpin>(mut fut: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut fut).poll(cx) {
        std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

#[tokio::test]
async fn combining_off_sends_every_write_alone() {
    let s = stack_with(
        CombineConfig {
            enabled: false,
            ..CombineConfig::default()
        },
        false,
    );
    let (a, b) = tokio::join!(
        s.log.write(CLIENT, write(1, 1, 0)),
        s.log.write(CLIENT, write(2, 1, 0)),
    );
    assert_eq!((a, b), (Ok(vec![1]), Ok(vec![1])));
    assert_eq!(s.recorder.sizes(), vec![1, 1]);
}

/// The same rules on a real Celeriant server (through `scripts/with-celeriant.sh`).
mod live {
    use super::*;
    use tally::store::celeriant::{CeleriantConfig, CeleriantLog};

    fn on(var: &str) -> Option<Stack> {
        let address = required::var(
            var,
            "run through scripts/with-celeriant.sh (make test does), which starts the servers",
        )?;
        let real: SharedLog = Arc::new(
            CeleriantLog::connect(&CeleriantConfig {
                address,
                ..CeleriantConfig::default()
            })
            .expect("valid config"),
        );
        let memory = Arc::new(MemoryLog::new());
        let recorder = Arc::new(Recorder {
            inner: real,
            requests: Mutex::new(Vec::new()),
            cross_shard: false,
        });
        let metrics = Arc::new(Metrics::new());
        Some(Stack {
            log: CombiningLog::new(recorder.clone(), CombineConfig::default(), metrics.clone()),
            recorder,
            faults: Arc::new(FaultyLog::new(memory.clone(), FaultConfig::default())),
            memory,
            metrics,
        })
    }

    /// Writes on fresh aggregates of one fresh org (each run meets a clean store).
    fn fresh(ids: &mut [u128]) {
        let base = uuid::Uuid::new_v4().as_u128() & !0xffff;
        for id in ids.iter_mut() {
            *id += base;
        }
    }

    #[tokio::test]
    async fn on_the_real_server_a_stale_member_is_answered_alone_and_the_others_land() {
        let Some(s) = on("CELERIANT_ADDRESS") else {
            return;
        };
        let mut ids = [1, 2, 3];
        fresh(&mut ids);
        let [a, b, c] = ids;
        s.log.write(CLIENT, write(a, 1, 0)).await.expect("lands");
        let (stale, fresh_b, fresh_c) = tokio::join!(
            s.log.write(CLIENT, write(a, 2, 0)),
            s.log.write(CLIENT, write(b, 1, 0)),
            s.log.write(CLIENT, write(c, 1, 0)),
        );
        assert!(
            matches!(stale, Err(StoreError::Conflict { .. })),
            "{stale:?}"
        );
        assert_eq!((fresh_b, fresh_c), (Ok(vec![1]), Ok(vec![1])));
        assert_eq!(s.recorder.sizes(), vec![1, 3, 1, 1, 1]);
        let (again_a, next_b) = tokio::join!(
            s.log.write(CLIENT, write(a, 2, 1)),
            s.log.write(CLIENT, write(b, 2, 1)),
        );
        assert_eq!((again_a, next_b), (Ok(vec![2]), Ok(vec![2])));
        assert_eq!(s.recorder.sizes().last(), Some(&2), "combined again");
    }

    #[tokio::test]
    async fn on_a_server_that_routes_accounts_apart_combining_turns_off_and_every_write_lands() {
        let Some(s) = on("CELERIANT_SHARDED_ADDRESS") else {
            return;
        };
        let mut ids: Vec<u128> = (1..=32).collect();
        fresh(&mut ids);
        let results =
            futures_join_all(ids.iter().map(|&id| s.log.write(CLIENT, write(id, 1, 0)))).await;
        for (id, r) in ids.iter().zip(&results) {
            assert_eq!(r, &Ok(vec![1]), "account {id}");
        }
        // 32 accounts over two shards by id: the request spanned both (all on one: 2^-31).
        assert!(!s.log.is_combining());
        assert_eq!(splits(&s.metrics, "cross_shard"), 1);
    }

    /// Polls every future together in one task, as `join!` does for a fixed number.
    async fn futures_join_all<F: std::future::Future>(
        futs: impl Iterator<Item = F>,
    ) -> Vec<F::Output> {
        let mut futs: Vec<_> = futs.map(Box::pin).collect();
        let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut done = true;
            for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
                if o.is_none() {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(v) => *o = Some(v),
                        std::task::Poll::Pending => done = false,
                    }
                }
            }
            if done {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        out.into_iter().map(|o| o.expect("finished")).collect()
    }
}
