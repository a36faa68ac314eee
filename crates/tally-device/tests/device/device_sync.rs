//! The device sync loop over the in-process transport: bounded attempts, refusals, lost acks,
//! in-flight duplicates, and runs that never grow.

use std::sync::Arc;
use std::time::Duration;

use crate::OutboxDir;
use tally::account::{AccountEvent, AccountId, AccountsMode, AmountCents, Identity, Operation};
use tally::device::ingest::DeviceSync;
use tally::store::faults::{Fault, FaultConfig, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{AggregateWrite, Event, ReadFilter, SharedLog};
use tally_device::crash::{CrashPoint, Crashed, Hooks, NoHooks};
use tally_device::outbox::Outbox;
use tally_device::sync::{StopReason, SyncLoop, SyncOptions};
use tally_device::transport::InProcessTransport;

const ACCOUNT: AccountId = AccountId(uuid::Uuid::from_u128(0xacc));

fn deposit(cents: i64) -> Operation {
    Operation::Deposit {
        account: ACCOUNT,
        amount: AmountCents::new(cents).unwrap(),
    }
}

struct World {
    _dir: OutboxDir,
    outbox: Outbox,
    memory: Arc<MemoryLog>,
    faulty: Arc<FaultyLog<MemoryLog>>,
}

fn world(name: &str, events: i64) -> World {
    let dir = OutboxDir::new("sync", name);
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    for cents in 1..=events {
        outbox.record(deposit(cents), 0, &mut NoHooks).unwrap();
    }
    let memory = Arc::new(MemoryLog::new());
    let faulty = Arc::new(FaultyLog::new(
        memory.clone(),
        FaultConfig {
            inflight_hold: Duration::from_millis(500),
            ..FaultConfig::default()
        },
    ));
    World {
        _dir: dir,
        outbox,
        memory,
        faulty,
    }
}

impl World {
    fn transport(&self, timeout: Option<Duration>) -> InProcessTransport {
        InProcessTransport::new(
            DeviceSync::new(self.faulty.clone() as SharedLog, Identity::default()),
            timeout,
        )
    }

    /// Each device batch in the store, as its list of sequences.
    fn batches(&self) -> Vec<Vec<u64>> {
        let key = Identity::default().key(ACCOUNT);
        match self.memory.read_now(key, &ReadFilter::from_version(1)) {
            Ok(page) => page
                .batches
                .iter()
                .map(|b| b.events.iter().map(|e| e.client_seq).collect())
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

fn options(batch_size: usize, max_attempts: u32) -> SyncOptions {
    SyncOptions {
        batch_size,
        max_attempts,
        base_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        jitter_seed: 11,
    }
}

#[tokio::test(start_paused = true)]
async fn a_sync_stops_after_max_attempts_with_the_queue_intact_and_resumes_later() {
    let mut w = world("attempts", 3);
    let transport = w.transport(None);
    transport.set_offline(true);
    let report = SyncLoop::new(&mut w.outbox, &transport, options(2, 3))
        .run(&mut NoHooks)
        .await
        .unwrap();
    match &report.stopped {
        Some(StopReason::AttemptsExhausted {
            first_seq: 1,
            last_seq: 2,
            attempts: 3,
            last_error,
            ..
        }) => assert!(last_error.contains("offline"), "{last_error}"),
        other => panic!("expected a stop after 3 attempts, got {other:?}"),
    }
    assert_eq!(report.failed_sends, 3);
    let status = w.outbox.status().unwrap();
    assert_eq!((status.pending, status.in_flight, status.synced), (1, 2, 0));
    assert_eq!(status.accounts[0].run_attempts, Some(3));
    assert!(w.batches().is_empty());

    transport.set_offline(false);
    let report = SyncLoop::new(&mut w.outbox, &transport, options(2, 3))
        .run(&mut NoHooks)
        .await
        .unwrap();
    assert_eq!(report.stopped, None);
    assert_eq!(report.events_synced, 3);
    assert_eq!(w.batches(), vec![vec![1, 2], vec![3]]);
}

#[tokio::test(start_paused = true)]
async fn a_refused_run_stops_the_sync_and_is_kept() {
    let mut w = world("refused", 2);
    // The server's run limit is below the device's batch size: resending cannot help.
    let transport = InProcessTransport::new(
        DeviceSync::new(w.faulty.clone() as SharedLog, Identity::default()).with_max_run_events(1),
        None,
    );
    let report = SyncLoop::new(&mut w.outbox, &transport, options(2, 5))
        .run(&mut NoHooks)
        .await
        .unwrap();
    match &report.stopped {
        Some(StopReason::Refused { code, .. }) => assert_eq!(code, "RUN_TOO_LONG"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(report.failed_sends, 1, "a refusal is not retried");
    let status = w.outbox.status().unwrap();
    assert_eq!(status.in_flight, 2);
    assert!(
        status.accounts[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("RUN_TOO_LONG"))
    );
}

/// Records one event at the first `RunPersisted`, through a second connection.
struct RecordMeanwhile {
    side: Outbox,
    done: bool,
}

impl Hooks for RecordMeanwhile {
    fn at(&mut self, step: CrashPoint) -> Result<(), Crashed> {
        if step == CrashPoint::RunPersisted && !self.done {
            self.done = true;
            self.side.record(deposit(99), 0, &mut NoHooks).unwrap();
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_lost_ack_resends_the_same_run_which_an_event_recorded_meanwhile_never_joins() {
    let mut w = world("lost-ack", 2);
    w.faulty.fail_next_write(Fault::LostAck);
    let transport = w.transport(None);
    let mut hooks = RecordMeanwhile {
        side: Outbox::open(&w._dir.file()).unwrap(),
        done: false,
    };
    let report = SyncLoop::new(&mut w.outbox, &transport, options(10, 3))
        .run(&mut hooks)
        .await
        .unwrap();
    assert_eq!(report.stopped, None);
    assert_eq!(
        (report.runs_already_synced, report.runs_synced),
        (1, 1),
        "the resend of 1..=2 is answered by the store's guard; 3 goes in a run of its own"
    );
    assert_eq!(w.batches(), vec![vec![1, 2], vec![3]]);
    assert_eq!(w.outbox.status().unwrap().synced, 3);
}

#[tokio::test(start_paused = true)]
async fn a_resend_that_meets_its_write_in_flight_backs_off_and_resends() {
    let mut w = world("inflight", 2);
    // Held for 500 ms; the client gives up after 50 ms and resends into the hold.
    w.faulty.fail_next_write(Fault::Inflight);
    let transport = w.transport(Some(Duration::from_millis(50)));
    let report = SyncLoop::new(&mut w.outbox, &transport, options(10, 20))
        .run(&mut NoHooks)
        .await
        .unwrap();
    assert_eq!(report.stopped, None);
    assert!(report.in_flight_duplicates >= 1, "{report:?}");
    assert_eq!(
        w.faulty.counts().inflight_duplicate,
        report.in_flight_duplicates
    );
    assert_eq!(report.runs_already_synced, 1);
    assert_eq!(w.batches(), vec![vec![1, 2]]);
}

/// Rule: with explicit accounts a run to an account never opened is refused (the service
/// answers `ACCOUNT_NOT_FOUND`), nothing lands, and the sync stops with the queue intact;
/// once the account is opened, the same run (the same sequences) lands, once.
#[tokio::test(start_paused = true)]
async fn with_explicit_accounts_a_run_to_an_account_never_opened_is_kept_until_it_is_opened() {
    let mut w = world("explicit", 2);
    let core = DeviceSync::new(w.faulty.clone() as SharedLog, Identity::default())
        .with_accounts(AccountsMode::Explicit);
    let transport = InProcessTransport::new(core, None);
    let report = SyncLoop::new(&mut w.outbox, &transport, options(2, 3))
        .run(&mut NoHooks)
        .await
        .unwrap();
    match &report.stopped {
        Some(StopReason::Refused {
            code,
            first_seq: 1,
            last_seq: 2,
            ..
        }) => assert_eq!(code, "ACCOUNT_NOT_FOUND"),
        other => panic!("expected the run refused, got {other:?}"),
    }
    assert!(w.batches().is_empty(), "nothing landed");
    let status = w.outbox.status().unwrap();
    assert_eq!(status.synced, 0);
    assert_eq!(status.pending + status.in_flight, 2, "the queue is intact");

    // The service opens the account: its first event, under the service's client id.
    let identity = Identity::default();
    let opened = AccountEvent::Opened;
    w.memory
        .write_now(
            identity.client(),
            vec![AggregateWrite {
                key: identity.key(ACCOUNT),
                events: vec![Event {
                    client_seq: 1,
                    event_id: Some(1),
                    event_type: opened.event_type(),
                    payload: opened.encode(),
                    timestamp_ms: 0,
                }],
                expected_version: Some(0),
                allow_create: true,
                enforce_client_idempotency: true,
            }],
        )
        .expect("opened");
    let report = SyncLoop::new(&mut w.outbox, &transport, options(2, 3))
        .run(&mut NoHooks)
        .await
        .unwrap();
    assert_eq!(report.stopped, None);
    assert_eq!(
        w.batches(),
        vec![vec![1], vec![1, 2]],
        "the open, then the run"
    );
    assert_eq!(w.outbox.status().unwrap().synced, 2);
}
