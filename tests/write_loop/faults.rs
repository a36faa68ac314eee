//! FaultyLog: each fault does exactly what it says, is counted, and is reproducible by seed.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tally::store::faults::{Fault, FaultConfig, FaultCounts, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{
    AggregateKey, AggregateWrite, Event, EventLog, EventType, ReadFilter, SharedLog, StoreError,
};

const CLIENT: u128 = 0x7a11;

fn key(id: u128) -> AggregateKey {
    AggregateKey {
        org_id: 1,
        aggregate_type_id: 2,
        aggregate_id: id,
    }
}

fn write(key: AggregateKey, seqs: &[u64]) -> AggregateWrite {
    AggregateWrite {
        key,
        events: seqs
            .iter()
            .map(|&seq| Event {
                client_seq: seq,
                event_id: Some(u128::from(seq)),
                event_type: EventType { major: 1, minor: 0 },
                payload: Bytes::from_static(b"x"),
                timestamp_ms: 0,
            })
            .collect(),
        expected_version: None,
        allow_create: true,
        enforce_client_idempotency: true,
    }
}

fn faulty(config: FaultConfig) -> (Arc<MemoryLog>, Arc<FaultyLog<MemoryLog>>) {
    let inner = Arc::new(MemoryLog::new());
    let log = Arc::new(FaultyLog::new(Arc::clone(&inner), config));
    (inner, log)
}

/// `w` sent by CLIENT and held by the injector (not applied) until the handle releases it;
/// the task ends with the write's outcome.
async fn held_write(
    log: &Arc<FaultyLog<MemoryLog>>,
    w: AggregateWrite,
) -> (
    tally::store::faults::HoldHandle,
    tokio::task::JoinHandle<tally::store::StoreResult<Vec<u64>>>,
) {
    let mut hold = log.hold_next_write();
    let held = tokio::spawn({
        let log = Arc::clone(log);
        async move { log.write(CLIENT, vec![w]).await }
    });
    assert!(hold.held().await, "the write is held");
    (hold, held)
}

fn only(counts: FaultCounts, expected: FaultCounts) {
    assert_eq!(counts, expected);
}

async fn versions(log: &dyn EventLog, key: AggregateKey, filter: ReadFilter) -> Vec<u64> {
    let page = log.read(key, &filter).await.expect("read");
    page.batches.iter().map(|b| b.version).collect()
}

// --- The spec ---

#[test]
fn parse_reads_every_key() {
    let c = FaultConfig::parse(
        "lost-ack=0.1,lost-request=0.05,refused=0.05,inflight=0.1,read-lag=0.2,seed=42",
    )
    .expect("spec");
    assert_eq!(
        (
            c.lost_ack,
            c.lost_request,
            c.refused,
            c.inflight,
            c.read_lag,
            c.seed
        ),
        (0.1, 0.05, 0.05, 0.1, 0.2, 42)
    );
    let c: FaultConfig = " read-lag-batches = 3 , inflight-hold-ms=250 "
        .parse()
        .expect("spec");
    assert_eq!(c.read_lag_batches, 3);
    assert_eq!(c.inflight_hold, Duration::from_millis(250));
    assert_eq!(
        FaultConfig::parse("").expect("empty"),
        FaultConfig::default()
    );
}

#[test]
fn parse_rejects_unknown_keys_and_bad_values() {
    for bad in [
        "lost-acks=0.1",
        "lost-ack=1.5",
        "refused=-0.1",
        "inflight=NaN",
        "read-lag=abc",
        "seed=-1",
        "seed",
        "lost-ack=0.6,refused=0.6",
    ] {
        let err = FaultConfig::parse(bad).expect_err(bad);
        assert!(
            err.to_string().starts_with("invalid fault spec"),
            "{bad}: {err}"
        );
    }
    let err = FaultConfig::parse("bogus=1").expect_err("unknown key");
    assert!(err.to_string().contains("unknown key `bogus`"), "{err}");
    let err = FaultConfig::parse("lost-ack=2").expect_err("range");
    assert!(err.to_string().contains("[0, 1]"), "{err}");
}

// --- Write faults ---

#[tokio::test]
async fn lost_ack_applies_the_write_then_reports_outcome_unknown() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    log.fail_next_write(Fault::LostAck);
    let got = log.write(CLIENT, vec![write(k, &[1])]).await;
    assert!(
        matches!(got, Err(StoreError::OutcomeUnknown { .. })),
        "{got:?}"
    );
    assert_eq!(inner.batch_count(k), 1, "applied");
    only(
        log.counts(),
        FaultCounts {
            lost_ack: 1,
            ..FaultCounts::default()
        },
    );
    // One-shot: the retry goes through and meets the landed sequence.
    assert_eq!(
        log.write(CLIENT, vec![write(k, &[1])]).await,
        Err(StoreError::IdempotencyViolation {
            last_seq: Some(1),
            attempted_seq: Some(1)
        })
    );
}

#[tokio::test]
async fn lost_ack_hides_a_rejection_too() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    log.write(CLIENT, vec![write(k, &[1])]).await.expect("v1");
    log.fail_next_write(Fault::LostAck);
    let got = log.write(CLIENT, vec![write(k, &[1])]).await;
    assert!(
        matches!(got, Err(StoreError::OutcomeUnknown { .. })),
        "{got:?}"
    );
    assert_eq!(inner.batch_count(k), 1);
}

#[tokio::test]
async fn lost_request_reports_outcome_unknown_without_applying() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    log.fail_next_write(Fault::LostRequest);
    let got = log.write(CLIENT, vec![write(k, &[1])]).await;
    assert!(
        matches!(got, Err(StoreError::OutcomeUnknown { .. })),
        "{got:?}"
    );
    assert!(got.as_ref().is_err_and(StoreError::may_have_applied));
    assert_eq!(inner.batch_count(k), 0, "not applied");
    only(
        log.counts(),
        FaultCounts {
            lost_request: 1,
            ..FaultCounts::default()
        },
    );
    assert_eq!(log.write(CLIENT, vec![write(k, &[1])]).await, Ok(vec![1]));
}

#[tokio::test]
async fn refused_reports_not_applied_without_applying() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    log.fail_next_write(Fault::Refused);
    let got = log.write(CLIENT, vec![write(k, &[1])]).await;
    assert!(matches!(got, Err(StoreError::NotApplied { .. })), "{got:?}");
    assert_eq!(inner.batch_count(k), 0);
    only(
        log.counts(),
        FaultCounts {
            refused: 1,
            ..FaultCounts::default()
        },
    );
}

#[tokio::test]
async fn queued_faults_apply_in_order_one_per_write() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    log.fail_next_write(Fault::Refused);
    log.fail_next_write(Fault::LostAck);
    let first = log.write(CLIENT, vec![write(k, &[1])]).await;
    let second = log.write(CLIENT, vec![write(k, &[1])]).await;
    let third = log.write(CLIENT, vec![write(k, &[2])]).await;
    assert!(
        matches!(first, Err(StoreError::NotApplied { .. })),
        "{first:?}"
    );
    assert!(
        matches!(second, Err(StoreError::OutcomeUnknown { .. })),
        "{second:?}"
    );
    assert_eq!(third, Ok(vec![2]));
    assert_eq!(inner.batch_count(k), 2);
}

#[tokio::test]
async fn held_write_makes_an_overlapping_duplicate_inflight_then_idempotency_violation() {
    let (inner, log) = faulty(FaultConfig::default());
    let (k, other) = (key(1), key(2));
    let (hold, held) = held_write(&log, write(k, &[5, 6])).await;
    assert_eq!(inner.batch_count(k), 0, "not applied while held");

    // Any overlap with 5..=6 from the same client on the same aggregate is a 2013.
    for seqs in [&[5][..], &[6, 7], &[3, 4, 5], &[4, 9]] {
        assert_eq!(
            log.write(CLIENT, vec![write(k, seqs)]).await,
            Err(StoreError::InflightDuplicate),
            "{seqs:?}"
        );
    }
    // Not overlapping: another client id, another aggregate.
    assert_eq!(
        log.write(CLIENT + 1, vec![write(k, &[5])]).await,
        Ok(vec![1])
    );
    assert_eq!(
        log.write(CLIENT, vec![write(other, &[5])]).await,
        Ok(vec![1])
    );

    hold.release();
    assert_eq!(held.await.expect("task"), Ok(vec![2]), "completes normally");
    assert_eq!(
        log.write(CLIENT, vec![write(k, &[5])]).await,
        Err(StoreError::IdempotencyViolation {
            last_seq: Some(6),
            attempted_seq: Some(5)
        })
    );
    only(
        log.counts(),
        FaultCounts {
            inflight: 1,
            inflight_duplicate: 4,
            ..FaultCounts::default()
        },
    );
}

/// Rule (the store's check order): the version guard comes before idempotency, so a write
/// whose sequence is in flight but whose guard fails is a 2003, not a 2013, as on the real
/// server; one whose guard holds is the 2013.
#[tokio::test]
async fn an_inflight_duplicate_whose_version_guard_fails_is_a_conflict() {
    let (_inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    let (hold, held) = held_write(&log, write(k, &[5])).await;
    let guarded = |expected| AggregateWrite {
        expected_version: Some(expected),
        ..write(k, &[5])
    };
    assert_eq!(
        log.write(CLIENT, vec![guarded(0)]).await,
        Err(StoreError::InflightDuplicate),
        "the guard holds: 2013"
    );
    assert_eq!(
        log.write(CLIENT + 1, vec![write(k, &[1])]).await,
        Ok(vec![1])
    );
    assert_eq!(
        log.write(CLIENT, vec![guarded(0)]).await,
        Err(StoreError::Conflict {
            expected: 0,
            current: 1
        }),
        "the guard fails first: 2003"
    );
    hold.release();
    held.await.expect("task").expect("the held write lands");
    assert_eq!(log.counts().inflight_duplicate, 1);
}

#[tokio::test]
async fn unenforced_write_is_never_an_inflight_duplicate_and_the_held_write_gets_the_store_verdict()
{
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    let (hold, held) = held_write(&log, write(k, &[5])).await;
    let mut unenforced = write(k, &[5]);
    unenforced.enforce_client_idempotency = false;
    assert_eq!(log.write(CLIENT, vec![unenforced]).await, Ok(vec![1]));
    hold.release();
    // The unenforced write raised the mark to 5 first, so the held one is a 2002.
    assert_eq!(
        held.await.expect("task"),
        Err(StoreError::IdempotencyViolation {
            last_seq: Some(5),
            attempted_seq: Some(5)
        })
    );
    assert_eq!(inner.batch_count(k), 1);
    assert_eq!(log.counts().inflight_duplicate, 0);
}

#[tokio::test]
async fn held_write_whose_caller_gives_up_is_never_applied() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    let (hold, held) = held_write(&log, write(k, &[5])).await;
    held.abort();
    assert!(held.await.is_err_and(|e| e.is_cancelled()));
    hold.release();
    assert_eq!(inner.batch_count(k), 0);
    // Its range is free again.
    assert_eq!(log.write(CLIENT, vec![write(k, &[5])]).await, Ok(vec![1]));
}

#[tokio::test]
async fn dropping_a_hold_handle_releases_the_write() {
    let (inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    drop(log.hold_next_write());
    assert_eq!(log.write(CLIENT, vec![write(k, &[1])]).await, Ok(vec![1]));
    assert_eq!(inner.batch_count(k), 1);
    assert_eq!(log.counts().inflight, 1);
}

#[tokio::test(start_paused = true)]
async fn queued_inflight_fault_holds_for_the_configured_time_then_applies() {
    let hold = Duration::from_secs(5);
    let (inner, log) = faulty(FaultConfig {
        inflight_hold: hold,
        ..FaultConfig::default()
    });
    let k = key(1);
    log.fail_next_write(Fault::Inflight);
    let start = tokio::time::Instant::now();
    assert_eq!(log.write(CLIENT, vec![write(k, &[1])]).await, Ok(vec![1]));
    assert!(start.elapsed() >= hold, "held {:?}", start.elapsed());
    assert_eq!(inner.batch_count(k), 1);
    only(
        log.counts(),
        FaultCounts {
            inflight: 1,
            ..FaultCounts::default()
        },
    );
}

#[tokio::test]
async fn certain_probabilities_fault_every_write() {
    let k = key(1);
    let (inner, log) = faulty(FaultConfig::parse("lost-request=1").expect("spec"));
    for seq in 1..=5 {
        let got = log.write(CLIENT, vec![write(k, &[seq])]).await;
        assert!(
            matches!(got, Err(StoreError::OutcomeUnknown { .. })),
            "{got:?}"
        );
    }
    assert_eq!(inner.batch_count(k), 0);
    assert_eq!(log.counts().lost_request, 5);

    let (inner, log) = faulty(FaultConfig::parse("refused=1").expect("spec"));
    let got = log.write(CLIENT, vec![write(k, &[1])]).await;
    assert!(matches!(got, Err(StoreError::NotApplied { .. })), "{got:?}");
    assert_eq!(inner.batch_count(k), 0);

    let (inner, log) = faulty(FaultConfig::parse("lost-ack=1").expect("spec"));
    for seq in 1..=5 {
        let got = log.write(CLIENT, vec![write(k, &[seq])]).await;
        assert!(
            matches!(got, Err(StoreError::OutcomeUnknown { .. })),
            "{got:?}"
        );
    }
    assert_eq!(inner.batch_count(k), 5);
    assert_eq!(log.counts().lost_ack, 5);
}

// --- Read lag ---

#[tokio::test]
async fn lagged_read_hides_the_newest_batches_once() {
    let (_inner, log) = faulty(FaultConfig::default());
    let k = key(1);
    for seq in 1..=5 {
        log.write(CLIENT, vec![write(k, &[seq])])
            .await
            .expect("write");
    }
    log.lag_next_read(2);
    assert_eq!(
        versions(&*log, k, ReadFilter::default()).await,
        vec![1, 2, 3]
    );
    assert_eq!(log.counts().read_lag, 1);
    assert_eq!(
        versions(&*log, k, ReadFilter::default()).await,
        vec![1, 2, 3, 4, 5]
    );

    // The lag clamps an explicit upper bound, never raises it.
    log.lag_next_read(1);
    let to_two = ReadFilter {
        to_version: Some(2),
        ..ReadFilter::default()
    };
    assert_eq!(versions(&*log, k, to_two).await, vec![1, 2]);
    // A lag longer than the history hides everything.
    log.lag_next_read(9);
    let page = log.read(k, &ReadFilter::default()).await.expect("read");
    assert!(page.batches.is_empty());
    assert_eq!(page.next_version, None);
    assert_eq!(log.counts().read_lag, 3);
}

#[tokio::test]
async fn read_lag_never_touches_details() {
    let (_inner, log) = faulty(FaultConfig::parse("read-lag=1,read-lag-batches=2").expect("spec"));
    let k = key(1);
    for seq in 1..=4 {
        log.write(CLIENT, vec![write(k, &[seq])])
            .await
            .expect("write");
    }
    assert_eq!(log.details(k).await.expect("details").max_version, 4);
    assert_eq!(versions(&*log, k, ReadFilter::default()).await, vec![1, 2]);
    assert_eq!(versions(&*log, k, ReadFilter::default()).await, vec![1, 2]);
    assert_eq!(log.counts().read_lag, 2);
    assert_eq!(log.counts().lost_ack, 0);
}

#[tokio::test]
async fn lagged_read_of_a_missing_aggregate_is_not_found() {
    let (_inner, log) = faulty(FaultConfig::default());
    log.lag_next_read(1);
    let got = log.read(key(9), &ReadFilter::default()).await;
    assert!(matches!(got, Err(StoreError::AggregateNotFound)), "{got:?}");
}

// --- Determinism ---

/// One short label per outcome, so two runs can be compared.
fn label<T>(r: &Result<T, StoreError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(StoreError::OutcomeUnknown { .. }) => "unknown",
        Err(StoreError::NotApplied { .. }) => "refused",
        Err(StoreError::IdempotencyViolation { .. }) => "2002",
        Err(_) => "other",
    }
}

const MIXED: &str = "lost-ack=0.2,lost-request=0.2,refused=0.2,read-lag=0.3";

async fn run(seed: u64, queue_first: Option<Fault>) -> (Vec<&'static str>, FaultCounts) {
    let config = FaultConfig::parse(&format!("{MIXED},seed={seed}")).expect("spec");
    let (_inner, log) = faulty(config);
    if let Some(fault) = queue_first {
        log.fail_next_write(fault);
    }
    let k = key(1);
    let mut trace = Vec::new();
    for seq in 1..=200 {
        trace.push(label(&log.write(CLIENT, vec![write(k, &[seq])]).await));
        let read = log.read(k, &ReadFilter::default()).await;
        trace.push(match read {
            Ok(page)
                if page.batches.len() as u64
                    == log.details(k).await.map_or(0, |d| d.max_version) =>
            {
                "full"
            }
            Ok(_) => "lagged",
            Err(StoreError::AggregateNotFound) => "missing",
            Err(_) => "error",
        });
    }
    (trace, log.counts())
}

#[tokio::test]
async fn same_seed_gives_the_same_fault_sequence() {
    for seed in [0, 42, 0xdead_beef] {
        let (a, ca) = run(seed, None).await;
        let (b, cb) = run(seed, None).await;
        assert_eq!(a, b, "seed {seed}");
        assert_eq!(ca, cb, "seed {seed}");
        assert!(
            ca.lost_ack > 0 && ca.lost_request > 0 && ca.refused > 0 && ca.read_lag > 0,
            "seed {seed}: {ca:?}"
        );
    }
    let (a, _) = run(1, None).await;
    let (b, _) = run(2, None).await;
    assert_ne!(a, b, "seeds 1 and 2 should differ");
}

#[tokio::test]
async fn a_queued_fault_does_not_shift_the_seeded_sequence() {
    let seed = 7;
    let (plain, _) = run(seed, None).await;
    let (queued, _) = run(seed, Some(Fault::LostRequest)).await;
    assert_eq!(queued[0], "unknown", "seed {seed}");
    // Whether a write faults depends on its draw alone (the store state only decides
    // ok versus rejection), so the fault pattern of writes 2.. must be the same.
    let faults = |t: &[&'static str]| -> Vec<bool> {
        t.iter()
            .step_by(2)
            .skip(1)
            .map(|l| *l == "unknown" || *l == "refused")
            .collect()
    };
    assert_eq!(faults(&plain), faults(&queued), "seed {seed}");
}

// --- Sharing ---

#[tokio::test]
async fn faulty_log_wraps_and_is_a_shared_log() {
    let inner: SharedLog = Arc::new(MemoryLog::new());
    let log: SharedLog = Arc::new(FaultyLog::new(inner, FaultConfig::default()));
    let k = key(1);
    assert_eq!(log.write(CLIENT, vec![write(k, &[1])]).await, Ok(vec![1]));
    assert_eq!(log.write(CLIENT, vec![write(k, &[2])]).await, Ok(vec![2]));
    assert_eq!(log.details(k).await.expect("details").max_version, 2);
    log.trim_start(k, 2).await.expect("trim");
    assert_eq!(
        log.read(k, &ReadFilter::default())
            .await
            .map(|p| p.batches.len()),
        Err(StoreError::Trimmed { min_available: 2 })
    );
    assert_eq!(log.ping().await, Ok(()));
}
