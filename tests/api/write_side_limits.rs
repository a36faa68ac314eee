//! The write side's own limits: every request alive on the write side holds a permit until
//! it ends (so the bound covers writes whose HTTP caller went away), a hot account's queue is
//! capped, a queued request whose deadline passed is answered without being sent, and a key
//! is scoped to the account it writes, for overlapping duplicates as for later ones.
//!
//! A write is held in flight with the fault injector's explicit hold, and a request is put
//! in its queue by polling its future once: signals, never sleeps.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tally::account::{AccountId, AmountCents, Identity, Operation};
use tally::metrics::{Metrics, refused};
use tally::projection::{ManualClock, Projection, ProjectionConfig};
use tally::store::faults::{FaultConfig, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{BatchStream, EventLog, ReadFilter};
use tally::write_loop::{WriteConfig, WriteError, WriteRequest, WriteService};
use uuid::Uuid;

struct Env {
    mem: Arc<MemoryLog>,
    faulty: Arc<FaultyLog<MemoryLog>>,
    svc: Arc<WriteService>,
    metrics: Arc<Metrics>,
    identity: Identity,
}

fn env(config: WriteConfig) -> Env {
    env_with(ProjectionConfig::default(), config)
}

fn env_with(projection_config: ProjectionConfig, config: WriteConfig) -> Env {
    let mem = Arc::new(MemoryLog::new());
    let faulty = Arc::new(FaultyLog::new(mem.clone(), FaultConfig::default()));
    let metrics = Arc::new(Metrics::new());
    let identity = Identity::default();
    let projection = Arc::new(Projection::new(
        faulty.clone(),
        identity,
        projection_config,
        Arc::new(ManualClock::new(0)),
        metrics.clone(),
    ));
    Env {
        mem,
        faulty,
        svc: Arc::new(WriteService::new(projection, config)),
        metrics,
        identity,
    }
}

impl Env {
    /// The event ids on an account's stream, in order.
    async fn event_ids(&self, account: AccountId) -> Vec<u128> {
        let mut stream = BatchStream::new(
            self.mem.as_ref() as &dyn EventLog,
            self.identity.key(account),
            ReadFilter::from_version(1),
        );
        let mut ids = Vec::new();
        while let Ok(Some(page)) = stream.next_page().await {
            for b in &page {
                ids.extend(b.events.iter().filter_map(|e| e.event_id));
            }
        }
        ids
    }

    fn refused(&self, reason: &str) -> u64 {
        self.metrics
            .write_refused
            .with_label_values(&[reason])
            .get()
    }
}

fn acct(n: u128) -> AccountId {
    AccountId(Uuid::from_u128(n))
}

fn deposit(account: AccountId, cents: i64, event_id: u128) -> WriteRequest {
    WriteRequest {
        op: Operation::Deposit {
            account,
            amount: AmountCents::new(cents).expect("amount"),
        },
        event_id,
    }
}

type Pending = Pin<Box<dyn Future<Output = Result<tally::write_loop::WriteOutcome, WriteError>>>>;

/// Starts a request and polls it once, so it has done everything it does before its first
/// wait (taking a permit, joining its account's queue).
async fn start(svc: &Arc<WriteService>, req: WriteRequest) -> Pending {
    let svc = svc.clone();
    let mut fut: Pending = Box::pin(async move { svc.execute(req).await });
    tokio::select! {
        biased;
        got = &mut fut => panic!("expected the request to wait, got {got:?}"),
        _ = std::future::ready(()) => {}
    }
    fut
}

/// Starts `req` on its own task and holds its store write in flight (the store has it, no
/// answer yet) until the returned handle releases it.
async fn in_flight(
    env: &Env,
    req: WriteRequest,
) -> (
    tally::store::faults::HoldHandle,
    tokio::task::JoinHandle<Result<tally::write_loop::WriteOutcome, WriteError>>,
) {
    let mut hold = env.faulty.hold_next_write();
    let task = tokio::spawn({
        let svc = env.svc.clone();
        async move { svc.execute(req).await }
    });
    assert!(hold.held().await, "the first write is in flight");
    (hold, task)
}

/// Rule: the live-writes bound counts a request for as long as it lives on the write side,
/// not for as long as an HTTP caller waits: a write held in flight keeps its permit, and
/// the next request is refused at once, without touching the store.
#[tokio::test]
async fn a_write_in_flight_holds_its_live_permit_until_it_ends() {
    let env = env(WriteConfig {
        max_live_writes: 1,
        ..WriteConfig::default()
    });
    let (hold, first) = in_flight(&env, deposit(acct(1), 10, 1)).await;

    let refused = env.svc.execute(deposit(acct(2), 10, 2)).await;
    assert!(
        matches!(refused, Err(WriteError::Overloaded { .. })),
        "{refused:?}"
    );
    assert_eq!(env.refused(refused::LIVE_WRITES), 1);
    assert!(env.event_ids(acct(2)).await.is_empty(), "nothing written");

    hold.release();
    assert!(first.await.expect("task").is_ok());
    assert!(env.svc.execute(deposit(acct(2), 10, 2)).await.is_ok());
    assert_eq!(env.event_ids(acct(2)).await, vec![2]);
}

/// Rule: a hot account's queue is capped; a request beyond the cap waits for a place (it is
/// not refused while the writer is about to drain the queue) and lands after the ones
/// queued before it, in arrival order.
#[tokio::test]
async fn a_request_over_a_full_account_queue_waits_for_a_place_and_lands_in_order() {
    let env = env(WriteConfig {
        max_queued_per_account: 2,
        ..WriteConfig::default()
    });
    let x = acct(1);
    let (hold, first) = in_flight(&env, deposit(x, 10, 1)).await;
    let second = start(&env.svc, deposit(x, 20, 2)).await;
    let third = start(&env.svc, deposit(x, 30, 3)).await;
    let fourth = start(&env.svc, deposit(x, 40, 4)).await;

    hold.release();
    assert_eq!(
        first.await.expect("task").expect("lands").legs[0].balance,
        10
    );
    assert_eq!(second.await.expect("lands").legs[0].balance, 30);
    assert_eq!(third.await.expect("lands").legs[0].balance, 60);
    assert_eq!(fourth.await.expect("lands").legs[0].balance, 100);
    assert_eq!(env.refused(refused::ACCOUNT_QUEUE), 0);
    assert_eq!(env.event_ids(x).await, vec![1, 2, 3, 4]);
}

/// Rule: waiting for a place in a full account queue is bounded by the request's deadline;
/// a request still waiting when it passes is refused retryably and never written.
#[tokio::test(start_paused = true)]
async fn a_request_waiting_for_a_place_past_its_deadline_is_refused_and_never_written() {
    let deadline = Duration::from_secs(1);
    let env = env(WriteConfig {
        max_queued_per_account: 1,
        deadline,
        ..WriteConfig::default()
    });
    let x = acct(1);
    let (hold, first) = in_flight(&env, deposit(x, 10, 1)).await;
    let queued = start(&env.svc, deposit(x, 20, 2)).await;
    let waiting = start(&env.svc, deposit(x, 30, 3)).await;

    tokio::time::advance(deadline * 2).await;
    let refused = waiting.await;
    assert!(
        matches!(refused, Err(WriteError::Overloaded { .. })),
        "{refused:?}"
    );
    assert_eq!(env.refused(refused::ACCOUNT_QUEUE), 1);

    hold.release();
    assert!(first.await.expect("task").is_ok(), "already sent: it lands");
    let expired = queued.await;
    assert!(
        matches!(expired, Err(WriteError::Overloaded { .. })),
        "{expired:?}"
    );
    assert_eq!(env.event_ids(x).await, vec![1], "neither was sent");
}

/// Rule: a request's deadline counts from its arrival; one that waited its whole deadline in
/// its account's queue was never sent, so it is answered retryably and not written.
#[tokio::test(start_paused = true)]
async fn a_queued_write_past_its_deadline_is_answered_without_being_sent() {
    let deadline = Duration::from_secs(1);
    let env = env(WriteConfig {
        deadline,
        ..WriteConfig::default()
    });
    let x = acct(1);
    let (hold, first) = in_flight(&env, deposit(x, 10, 1)).await;
    let queued = start(&env.svc, deposit(x, 20, 2)).await;

    tokio::time::advance(deadline * 2).await;
    hold.release();
    assert!(first.await.expect("task").is_ok(), "already sent: it lands");
    let got = queued.await;
    assert!(matches!(got, Err(WriteError::Overloaded { .. })), "{got:?}");
    assert_eq!(env.refused(refused::QUEUED_PAST_DEADLINE), 1);
    assert_eq!(
        env.event_ids(x).await,
        vec![1],
        "the expired one was never sent"
    );
}

/// Rule: a key is scoped to the account it writes (as the recent-writes index is): the same
/// key on two accounts is two requests whether or not they overlap in time, and a
/// duplicate on the same account is coalesced.
#[tokio::test]
async fn the_same_key_on_two_accounts_is_two_requests_even_when_they_overlap() {
    let env = env(WriteConfig::default());
    let key = 0xC0FFEE;
    let (hold, on_x) = in_flight(&env, deposit(acct(1), 10, key)).await;
    // Overlapping, on another account: not a follower of the first.
    let on_y = env.svc.execute(deposit(acct(2), 20, key)).await;
    assert_eq!(on_y.expect("lands").legs[0].balance, 20);
    // Overlapping, on the same account: coalesced with the first.
    let dup_x = start(&env.svc, deposit(acct(1), 10, key)).await;
    hold.release();
    let first = on_x.await.expect("task").expect("lands");
    let dup = dup_x.await.expect("replayed");
    assert!(!first.replayed && dup.replayed);
    assert_eq!(dup.legs, first.legs);
    // Later, on a third account: a new request too.
    let on_z = env.svc.execute(deposit(acct(3), 30, key)).await;
    assert!(!on_z.expect("lands").replayed);
    for (n, cents) in [(1, 10), (2, 20), (3, 30)] {
        assert_eq!(
            env.event_ids(acct(n)).await,
            vec![key],
            "account {n} ({cents})"
        );
    }
}

/// Rule: the index cap bounds memory by refusing new writes, never by forgetting answers: at
/// the cap a new write is refused retryably and not sent, while a retry of a landed write is
/// still replayed from the index.
#[tokio::test]
async fn a_full_index_refuses_new_writes_but_still_replays_landed_ones() {
    let env = env_with(
        ProjectionConfig {
            max_index_entries: 1,
            ..ProjectionConfig::default()
        },
        WriteConfig::default(),
    );
    let x = acct(1);
    let first = env.svc.execute(deposit(x, 10, 1)).await.expect("lands");

    let refused = env.svc.execute(deposit(x, 20, 2)).await;
    let Err(e @ WriteError::Overloaded { .. }) = refused else {
        panic!("{refused:?}");
    };
    let message = e.to_string();
    assert!(message.contains("at its cap of 1"), "{message}");
    assert_eq!(message.matches("retry").count(), 1, "said once: {message}");
    assert_eq!(env.metrics.writes_refused_index_full.get(), 1);
    let replay = env.svc.execute(deposit(x, 10, 1)).await.expect("replayed");
    assert!(replay.replayed);
    assert_eq!(replay.legs, first.legs);
    assert_eq!(
        env.event_ids(x).await,
        vec![1],
        "the refused write was never sent"
    );
}
