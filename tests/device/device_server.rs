//! The service-side core of device sync against the store port: the device's own client id,
//! no version guard, the classification of every store answer, and the projection.

use crate::common;

use std::sync::Arc;

use common::windowed_log::{CELERIANT_WINDOW, WindowedLog, one_deposit};
use tally::account::{AccountEvent, AccountId, Identity};
use tally::device::DeviceId;
use tally::device::error::{DeviceSyncError, RetryReason};
use tally::device::ingest::{DeviceSync, MAX_RUN_READ_PAGES, store_event_id};
use tally::device::protocol::{SyncEvent, SyncRequest, SyncStatus};
use tally::metrics::Metrics;
use tally::projection::{ManualClock, Projection, ProjectionConfig};
use tally::store::faults::{Fault, FaultConfig, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{AggregateWrite, Batch, Event, EventLog, ReadFilter, SharedLog};

const ACCOUNT: &str = "00000000-0000-0000-0000-00000000acc1";
const DEVICE: &str = "0b6c3a9e-51f4-4a3e-9a77-2d1f0e5c7b11";

fn account() -> AccountId {
    ACCOUNT.parse().unwrap()
}

fn device() -> DeviceId {
    DEVICE.parse().unwrap()
}

fn run(first: u64, last: u64, cents: i64) -> SyncRequest {
    SyncRequest {
        account_id: ACCOUNT.into(),
        first_seq: Some(first),
        last_synced_version: None,
        events: (first..=last)
            .map(|seq| SyncEvent {
                client_seq: seq,
                kind: if seq % 3 == 0 { "withdraw" } else { "deposit" }.into(),
                amount_cents: cents,
                event_id: None,
                recorded_at_ms: Some(1_000 + seq),
            })
            .collect(),
    }
}

fn faulty() -> (Arc<MemoryLog>, Arc<FaultyLog<MemoryLog>>, DeviceSync) {
    let memory = Arc::new(MemoryLog::new());
    let faulty = Arc::new(FaultyLog::new(memory.clone(), FaultConfig::default()));
    let core = DeviceSync::new(faulty.clone() as SharedLog, Identity::default());
    (memory, faulty, core)
}

fn batches(log: &MemoryLog) -> Vec<Batch> {
    let key = Identity::default().key(account());
    match log.read_now(key, &ReadFilter::from_version(1)) {
        Ok(page) => page.batches,
        Err(_) => Vec::new(),
    }
}

#[tokio::test]
async fn device_runs_are_written_under_the_device_client_id_without_a_version_guard() {
    let (memory, _, core) = faulty();
    let identity = Identity::default();
    // The account already has history written by Tally itself: a device does not need to
    // know its version, and does not conflict with it.
    memory
        .write_now(
            identity.client(),
            vec![AggregateWrite {
                key: identity.key(account()),
                events: vec![Event {
                    client_seq: 1,
                    event_id: Some(7),
                    event_type: AccountEvent::Deposited { amount: 100 }.event_type(),
                    payload: AccountEvent::Deposited { amount: 100 }.encode(),
                    timestamp_ms: 0,
                }],
                expected_version: Some(0),
                allow_create: true,
                enforce_client_idempotency: true,
            }],
        )
        .unwrap();
    let answer = core.handle(DEVICE, &run(1, 4, 5)).await.unwrap();
    assert_eq!(answer.status, SyncStatus::Synced);
    assert_eq!(answer.aggregate_version, Some(2));
    let stored = batches(&memory);
    assert_eq!(stored.len(), 2);
    let batch = &stored[1];
    assert_eq!(batch.client_id, device().as_u128());
    let seqs: Vec<u64> = batch.events.iter().map(|e| e.client_seq).collect();
    assert_eq!(
        seqs,
        vec![1, 2, 3, 4],
        "the device's own sequences, as sent"
    );
    let decoded: Vec<AccountEvent> = batch
        .events
        .iter()
        .map(|e| AccountEvent::decode(e.event_type, &e.payload).unwrap())
        .collect();
    assert_eq!(decoded[2], AccountEvent::Withdrawn { amount: 5 });
    assert_eq!(decoded[3], AccountEvent::Deposited { amount: 5 });
    assert_eq!(batch.events[0].timestamp_ms, 1_001);
}

#[tokio::test]
async fn a_device_resend_after_a_lost_ack_is_already_synced_and_lands_once() {
    let (memory, faulty, core) = faulty();
    faulty.fail_next_write(Fault::LostAck);
    let err = core.handle(DEVICE, &run(1, 3, 10)).await.unwrap_err();
    assert!(matches!(
        err,
        DeviceSyncError::Retry {
            reason: RetryReason::OutcomeUnknown,
            ..
        }
    ));
    assert!(err.is_retryable());
    // Two hours later, far past any idempotency window: the store's own guard answers.
    let answer = core.handle(DEVICE, &run(1, 3, 10)).await.unwrap();
    assert_eq!(answer.status, SyncStatus::AlreadySynced);
    assert_eq!(answer.last_seq, 3);
    assert_eq!(batches(&memory).len(), 1);
}

#[tokio::test]
async fn a_refused_or_lost_device_write_is_retryable_and_changes_nothing() {
    let (memory, faulty, core) = faulty();
    faulty.fail_next_write(Fault::Refused);
    faulty.fail_next_write(Fault::LostRequest);
    for reason in [RetryReason::NotApplied, RetryReason::OutcomeUnknown] {
        match core.handle(DEVICE, &run(1, 2, 10)).await {
            Err(DeviceSyncError::Retry { reason: r, .. }) => assert_eq!(r, reason),
            other => panic!("expected a retry, got {other:?}"),
        }
        assert!(batches(&memory).is_empty());
    }
    let answer = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    assert_eq!(answer.status, SyncStatus::Synced);
    assert_eq!(batches(&memory).len(), 1);
}

#[tokio::test]
async fn a_device_resend_meeting_its_write_in_flight_is_told_to_retry() {
    let (memory, faulty, core) = faulty();
    let mut hold = faulty.hold_next_write();
    let first = tokio::spawn({
        let core = core.clone();
        async move { core.handle(DEVICE, &run(1, 2, 10)).await }
    });
    assert!(hold.held().await);
    let err = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap_err();
    assert_eq!(err.code().as_str(), "SYNC_IN_FLIGHT");
    assert!(matches!(
        err,
        DeviceSyncError::Retry {
            reason: RetryReason::InFlight,
            ..
        }
    ));
    hold.release();
    assert_eq!(first.await.unwrap().unwrap().status, SyncStatus::Synced);
    let again = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
    assert_eq!(batches(&memory).len(), 1);
}

#[tokio::test]
async fn device_event_ids_are_stable_and_namespaced_per_device() {
    let (memory, _, core) = faulty();
    let mut req = run(1, 2, 10);
    let own = "8c1f2e3d-4b5a-4697-a8b9-c0d1e2f3a4b5";
    req.events[0].event_id = Some(own.into());
    core.handle(DEVICE, &req).await.unwrap();
    let stored = batches(&memory);
    let ids: Vec<u128> = stored[0]
        .events
        .iter()
        .map(|e| e.event_id.unwrap())
        .collect();
    let validated =
        tally::device::run::DeviceRun::from_request(&req, tally::device::MAX_RUN_EVENTS).unwrap();
    let expected: Vec<u128> = validated
        .events()
        .iter()
        .map(|e| store_event_id(device(), account(), e))
        .collect();
    assert_eq!(ids, expected);
    assert_ne!(ids[0], own.parse::<uuid::Uuid>().unwrap().as_u128());
    let other: DeviceId = "1b6c3a9e-51f4-4a3e-9a77-2d1f0e5c7b11".parse().unwrap();
    assert_ne!(
        store_event_id(other, account(), &validated.events()[0]),
        ids[0],
        "two devices never name the same event id"
    );
}

#[tokio::test]
async fn device_events_never_raise_the_service_client_sequence() {
    let memory = Arc::new(MemoryLog::new());
    let log: SharedLog = memory.clone();
    let identity = Identity::default();
    // Tally's own write, at its own sequence 5.
    let deposit = AccountEvent::Deposited { amount: 1_000 };
    log.write(
        identity.client(),
        vec![AggregateWrite {
            key: identity.key(account()),
            events: vec![Event {
                client_seq: 5,
                event_id: Some(1),
                event_type: deposit.event_type(),
                payload: deposit.encode(),
                timestamp_ms: 0,
            }],
            expected_version: Some(0),
            allow_create: true,
            enforce_client_idempotency: true,
        }],
    )
    .await
    .unwrap();
    let projection = Projection::new(
        log.clone(),
        identity,
        ProjectionConfig::default(),
        Arc::new(ManualClock::new(0)),
        Arc::new(Metrics::new()),
    );
    let (_, before) = projection.catch_up(account()).await.unwrap();
    assert_eq!((before.max_client_seq, before.version), (5, 1));
    // The device's sequences go far past Tally's: 1..=40.
    let core = DeviceSync::new(log.clone(), identity);
    core.handle(DEVICE, &run(1, 40, 10)).await.unwrap();
    let (_, after) = projection.catch_up(account()).await.unwrap();
    assert_eq!(after.version, 2, "the device batch was folded");
    let withdrawals = (1..=40).filter(|s| s % 3 == 0).count() as i64;
    assert_eq!(after.balance, 1_000 + (40 - 2 * withdrawals) * 10);
    assert_eq!(
        after.max_client_seq, 5,
        "a device batch must not move Tally's own client sequence"
    );
}

#[tokio::test]
async fn a_reissued_sequence_is_never_answered_as_already_synced() {
    let (memory, _, core) = faulty();
    let mut original = run(1, 3, 10);
    for e in &mut original.events {
        e.event_id = Some(uuid::Uuid::new_v4().to_string());
    }
    core.handle(DEVICE, &original).await.unwrap();
    // The device's outbox was restored from a copy taken before 2 and 3 were recorded: it
    // records a new sale and numbers it 2 again.
    let mut reissued = run(2, 2, 10);
    reissued.events[0].event_id = Some(uuid::Uuid::new_v4().to_string());
    let err = core.handle(DEVICE, &reissued).await.unwrap_err();
    assert_eq!(err, DeviceSyncError::RunConflictsWithStore { seq: 2 });
    assert!(err.is_conflict() && !err.resend_may_help());
    assert_eq!(err.code().as_str(), "DEVICE_RUN_CONFLICTS_WITH_STORE");
    // Without event ids the payload still tells them apart.
    let (_, _, bare) = faulty();
    bare.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    let err = bare.handle(DEVICE, &run(1, 2, 11)).await.unwrap_err();
    assert_eq!(err, DeviceSyncError::RunConflictsWithStore { seq: 1 });
    // The genuine resend is still already synced.
    let again = core.handle(DEVICE, &original).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
    assert_eq!(batches(&memory).len(), 1);
}

#[tokio::test]
async fn a_covered_run_a_lagging_read_cannot_show_is_retried_not_synced() {
    let (_, faulty, core) = faulty();
    core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    faulty.lag_next_read(1);
    let err = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap_err();
    assert!(matches!(
        err,
        DeviceSyncError::Retry {
            reason: RetryReason::Unverified,
            ..
        }
    ));
    let again = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
}

/// Rule: a covered run whose batches were trimmed away is never answered as synced on the
/// mark alone: the mark says some event of the device's held each sequence, not that it was
/// this one, and a device that reissued sequences (restored from an old copy) would be told
/// its new events landed. It is a final refusal for an operator, never a guess.
#[tokio::test]
async fn a_covered_run_whose_batches_were_trimmed_is_never_answered_synced() {
    let (memory, faulty, core) = faulty();
    core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    core.handle(DEVICE, &run(3, 3, 10)).await.unwrap();
    let key = Identity::default().key(account());
    faulty.trim_start(key, 2).await.unwrap();
    assert_eq!(memory.batch_count(key), 1);
    // The same run, and a different one under the same sequences: nothing tells them apart.
    for resent in [run(1, 2, 10), run(1, 2, 999)] {
        let err = core.handle(DEVICE, &resent).await.unwrap_err();
        assert_eq!(err, DeviceSyncError::RunTrimmed { seq: 1 });
        assert_eq!(err.code().as_str(), "DEVICE_RUN_TRIMMED");
        assert!(err.is_conflict() && !err.is_retryable());
    }
    assert_eq!(memory.batch_count(key), 1, "nothing written");
}

/// Rule: a verdict is drawn only from windows read whole. A lagging read (a replica behind
/// the tip the store reported) that hides a landed run on a trimmed account is a retry,
/// never the final `DEVICE_RUN_TRIMMED` (else the device would stop syncing a run
/// that had landed).
#[tokio::test]
async fn a_lagging_read_never_turns_a_landed_run_into_a_final_refusal() {
    let (memory, faulty, core) = faulty();
    service_batches(&memory, 1, 3);
    let key = Identity::default().key(account());
    faulty.trim_start(key, 3).await.unwrap();
    faulty.fail_next_write(Fault::LostAck);
    let lost = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap_err();
    assert!(lost.is_retryable(), "{lost:?}");
    assert_eq!(memory.batch_count(key), 2, "the run landed");

    faulty.lag_next_read(1);
    let lagged = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap_err();
    assert_eq!(lagged.code().as_str(), "SYNC_UNVERIFIED", "{lagged:?}");
    let again = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
}

/// Rule: a trim hides a run only if nothing read places the run above it. A missing
/// sequence between two of the device's events above the trim never landed (a final
/// conflict, as without a trim), and is not blamed on the trim.
#[tokio::test]
async fn a_run_placed_above_the_trim_is_judged_on_what_the_read_shows() {
    let (memory, faulty, core) = faulty();
    for seq in [1, 2, 4] {
        core.handle(DEVICE, &run(seq, seq, 10)).await.unwrap();
    }
    let key = Identity::default().key(account());
    faulty.trim_start(key, 2).await.unwrap();
    let err = core.handle(DEVICE, &run(3, 3, 10)).await.unwrap_err();
    assert_eq!(err, DeviceSyncError::RunNeverLanded { seq: 3 });
    let err = core.handle(DEVICE, &run(1, 1, 10)).await.unwrap_err();
    assert_eq!(err, DeviceSyncError::RunTrimmed { seq: 1 });
    assert_eq!(memory.batch_count(key), 2, "nothing written");
}

/// Rule: a run the device's mark covers but that never landed, proven by a read that shows a
/// later sequence of the device's (and every version before it), is a final conflict: the
/// device synced out of order. Before, it was a retryable 503 for ever. A read that does not
/// reach the later sequence proves nothing, and stays a retry.
#[tokio::test]
async fn a_run_below_the_mark_that_never_landed_is_a_conflict_not_a_retry() {
    let (memory, faulty, core) = faulty();
    core.handle(DEVICE, &run(10, 10, 5)).await.unwrap();
    faulty.lag_next_read(1);
    let err = core.handle(DEVICE, &run(5, 5, 5)).await.unwrap_err();
    assert!(
        matches!(
            err,
            DeviceSyncError::Retry {
                reason: RetryReason::Unverified,
                ..
            }
        ),
        "a lagging read: {err:?}"
    );
    let err = core.handle(DEVICE, &run(5, 5, 5)).await.unwrap_err();
    assert_eq!(err, DeviceSyncError::RunNeverLanded { seq: 5 });
    assert!(err.is_conflict() && !err.resend_may_help());
    assert_eq!(batches(&memory).len(), 1, "nothing written");
}

/// A device core over the embedded store paged in Celeriant's windows, counting its reads.
fn windowed() -> (Arc<MemoryLog>, Arc<WindowedLog>, DeviceSync) {
    let memory = Arc::new(MemoryLog::new());
    let windowed = Arc::new(WindowedLog::new(memory.clone(), CELERIANT_WINDOW));
    let core = DeviceSync::new(windowed.clone() as SharedLog, Identity::default());
    (memory, windowed, core)
}

/// Appends `n` one-event batches by the service's own client id (sequences from `seq`):
/// versions a device's read-back filters out but, on Celeriant, still pages through.
fn service_batches(memory: &MemoryLog, seq: u64, n: u64) {
    let identity = Identity::default();
    for s in seq..seq + n {
        memory
            .write_now(
                identity.client(),
                vec![one_deposit(
                    identity.key(account()),
                    s,
                    Some(u128::from(s)),
                    1,
                )],
            )
            .expect("service write");
    }
}

/// Rule: a resent run's read-back goes down from the newest version and stops as soon as
/// the answer is decided: at the run's own batch (already synced), or at an earlier
/// sequence of the device's (below which none of the run's can stand). It used to read from
/// version 1 to the run: on Celeriant, where a read far below the newest version costs in
/// proportion to the distance, every page of a long account cost the whole account.
#[tokio::test]
async fn a_resent_runs_read_back_stops_once_the_answer_is_decided() {
    let (memory, windowed, core) = windowed();
    service_batches(&memory, 1, 20 * CELERIANT_WINDOW);
    core.handle(DEVICE, &run(1, 3, 10)).await.unwrap();
    core.handle(DEVICE, &run(10, 10, 10)).await.unwrap();
    service_batches(&memory, 100_000, 3 * CELERIANT_WINDOW);

    windowed.reset();
    let again = core.handle(DEVICE, &run(1, 3, 10)).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
    assert_eq!(
        windowed.reads(),
        4,
        "three windows of others' writes, then the run's"
    );

    windowed.reset();
    let err = core.handle(DEVICE, &run(5, 5, 10)).await.unwrap_err();
    assert_eq!(err, DeviceSyncError::RunNeverLanded { seq: 5 });
    assert_eq!(
        windowed.reads(),
        4,
        "the window that holds an earlier sequence"
    );
}

/// Rule: a resend after a lost answer finds its run near the top of the stream, however long
/// the stream below it.
#[tokio::test]
async fn a_resent_run_near_the_top_of_a_long_stream_is_proven_in_one_window() {
    let (memory, windowed, core) = windowed();
    core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    service_batches(&memory, 1, 2 * MAX_RUN_READ_PAGES as u64 * CELERIANT_WINDOW);
    core.handle(DEVICE, &run(3, 4, 10)).await.unwrap();
    service_batches(&memory, 1_000_000, 40);

    windowed.reset();
    let again = core.handle(DEVICE, &run(3, 4, 10)).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
    assert_eq!(windowed.reads(), 1, "the newest window holds the run");

    // The same sequences under another payload: told apart in the same window.
    windowed.reset();
    let reissued = core.handle(DEVICE, &run(3, 4, 11)).await.unwrap_err();
    assert_eq!(reissued, DeviceSyncError::RunConflictsWithStore { seq: 3 });
    assert_eq!(windowed.reads(), 1);
}

/// `run(first, last, cents)` carrying the device's hint: where its latest synced run landed.
fn hinted(first: u64, last: u64, cents: i64, hint: u64) -> SyncRequest {
    SyncRequest {
        last_synced_version: Some(hint),
        ..run(first, last, cents)
    }
}

/// Rule: a device that names where its latest synced run landed has its resend found right
/// above that version, however far below the newest version it stands (a device that lost
/// an answer and then stayed offline while the account grew). Without the hint the same
/// resend is past the page cap: unverified, for ever.
#[tokio::test]
async fn a_resend_far_below_the_top_is_found_above_the_devices_hint() {
    let (memory, windowed, core) = windowed();
    service_batches(&memory, 1, 3 * CELERIANT_WINDOW);
    let synced = core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    let hint = synced.aggregate_version.expect("a synced run's version");
    core.handle(DEVICE, &run(3, 4, 10)).await.unwrap();
    service_batches(
        &memory,
        100_000,
        MAX_RUN_READ_PAGES as u64 * CELERIANT_WINDOW,
    );

    windowed.reset();
    let again = core.handle(DEVICE, &hinted(3, 4, 10, hint)).await.unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
    assert_eq!(windowed.reads(), 1, "the window right above the hint");

    let err = core.handle(DEVICE, &run(3, 4, 10)).await.unwrap_err();
    assert_eq!(err.code().as_str(), "SYNC_UNVERIFIED", "{err:?}");
}

/// Rule: the hint only orders the read. A hint above the run (a buggy or restored device)
/// never turns a landed run into a refusal, nor a run that never landed into a success: a
/// later sequence read above the hint decides nothing until an earlier one is read there too.
#[tokio::test]
async fn a_wrong_hint_never_changes_the_verdict() {
    let (memory, _, core) = windowed();
    core.handle(DEVICE, &run(1, 2, 10)).await.unwrap();
    let landed = core.handle(DEVICE, &run(3, 3, 10)).await.unwrap();
    let at = landed.aggregate_version.expect("a synced run's version");
    service_batches(&memory, 1, 5);
    core.handle(DEVICE, &run(4, 4, 10)).await.unwrap();
    service_batches(&memory, 100, 3 * CELERIANT_WINDOW);

    let again = core
        .handle(DEVICE, &hinted(3, 3, 10, at + 2))
        .await
        .unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
    let err = core
        .handle(DEVICE, &hinted(3, 3, 11, at + 2))
        .await
        .unwrap_err();
    assert_eq!(err, DeviceSyncError::RunConflictsWithStore { seq: 3 });
    // A hint past the newest version is ignored.
    let again = core
        .handle(DEVICE, &hinted(3, 3, 10, u64::MAX))
        .await
        .unwrap();
    assert_eq!(again.status, SyncStatus::AlreadySynced);
}

/// Rule: a sequence of the run that is missing below a later sequence of the device's never
/// landed, also when the later one is the run's own last: the run's tail landed on its own
/// and its head never did (a hand-built client re-cut its runs). Else this would be a
/// retryable 503 for ever.
#[tokio::test]
async fn a_run_whose_head_never_landed_below_its_landed_tail_is_a_conflict() {
    let (memory, _, core) = windowed();
    core.handle(DEVICE, &run(1, 1, 10)).await.unwrap();
    core.handle(DEVICE, &run(5, 5, 10)).await.unwrap();
    for resent in [run(4, 5, 10), run(3, 5, 10)] {
        let err = core.handle(DEVICE, &resent).await.unwrap_err();
        let seq = resent.events[0].client_seq;
        assert_eq!(err, DeviceSyncError::RunNeverLanded { seq });
    }
    let key = Identity::default().key(account());
    assert_eq!(memory.batch_count(key), 2, "nothing written");
}

/// Rule: the read-back takes at most `MAX_RUN_READ_PAGES` pages; a run further below the
/// newest version than that (and not above a hint) is answered unverified (a retryable
/// 503), never synced or refused on a read that did not reach it.
#[tokio::test]
async fn a_run_beyond_the_read_back_page_cap_is_unverified_not_a_verdict() {
    let (memory, windowed, core) = windowed();
    core.handle(DEVICE, &run(1, 3, 10)).await.unwrap();
    service_batches(&memory, 1, MAX_RUN_READ_PAGES as u64 * CELERIANT_WINDOW);

    windowed.reset();
    let err = core.handle(DEVICE, &run(1, 3, 10)).await.unwrap_err();
    assert!(
        matches!(
            err,
            DeviceSyncError::Retry {
                reason: RetryReason::Unverified,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.code().as_str(), "SYNC_UNVERIFIED");
    assert_eq!(windowed.reads(), MAX_RUN_READ_PAGES);
    let key = Identity::default().key(account());
    let written = MAX_RUN_READ_PAGES as u64 * CELERIANT_WINDOW + 1;
    assert_eq!(memory.batch_count(key) as u64, written, "nothing written");
}
