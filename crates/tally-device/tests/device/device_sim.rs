//! A deterministic, seeded simulation of an offline device: random records, syncs, crashes at
//! every crash point (simulated by dropping all in-memory state and reopening the SQLite
//! file), events recorded while a run is in flight, lost acks, lost and refused requests,
//! writes held in flight past the client's timeout (so resends meet them: 2013), lagging reads
//! (so the server cannot yet prove an "already committed" run and asks for a retry), and long
//! offline periods.
//!
//! Invariant, checked after every step: the outbox holds exactly what was recorded, numbered
//! 1, 2, 3… per account; the store holds a prefix of it, each event once, in recorded order;
//! nothing is marked synced that is not in the store. At the end, with the faults gone, one
//! sync lands everything exactly once.
//!
//! `DEVICE_SIM_SEED=N` replays one seed; `DEVICE_SIM_SEEDS=N` runs seeds 0..N (default
//! [`DEFAULT_SEEDS`]). A failure prints its seed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::test_dir::TestDir;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tally::account::{AccountEvent, AccountId, AmountCents, Identity, Operation};
use tally::device::DeviceId;
use tally::device::ingest::DeviceSync;
use tally::store::faults::{FaultConfig, FaultCounts, FaultyLog};
use tally::store::memory::MemoryLog;
use tally::store::{ReadFilter, SharedLog};
use tally_device::crash::{CrashPoint, Crashed, Hooks, NoHooks};
use tally_device::outbox::{Kind, Outbox, OutboxError};
use tally_device::sync::{StopReason, SyncError, SyncLoop, SyncOptions};
use tally_device::transport::InProcessTransport;

const DEFAULT_SEEDS: u64 = 32;
const STEPS: usize = 120;
const ACCOUNTS: u128 = 3;
/// The client gives up on an answer after this; a held write stays in flight longer.
const CLIENT_TIMEOUT: Duration = Duration::from_millis(100);
const INFLIGHT_HOLD: Duration = Duration::from_millis(400);
/// An offline period: far past any idempotency window the service has.
const LONG_OFFLINE: Duration = Duration::from_secs(2 * 3600);

/// (sequence, kind, cents): an event as the simulation knows it was recorded.
type Recorded = (u64, Kind, i64);

/// Prints the seed if the simulation panics.
struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "device_sim failed with seed {0}; replay with DEVICE_SIM_SEED={0}",
                self.0
            );
        }
    }
}

/// What the seeds exercised, summed, so the test can prove it covered every fault.
#[derive(Debug, Default)]
struct Coverage {
    crashes: BTreeMap<&'static str, u64>,
    recorded_meanwhile: u64,
    already_synced_runs: u64,
    exhausted_stops: u64,
    offline_periods: u64,
    faults: FaultCounts,
}

fn random_op(rng: &mut ChaCha8Rng) -> Operation {
    let account = AccountId(uuid::Uuid::from_u128(rng.gen_range(1..=ACCOUNTS)));
    let amount = AmountCents::new(rng.gen_range(1..=1_000)).unwrap();
    if rng.gen_bool(0.7) {
        Operation::Deposit { account, amount }
    } else {
        Operation::Withdraw { account, amount }
    }
}

fn recorded_of(op: &Operation) -> (AccountId, Kind, i64) {
    match *op {
        Operation::Deposit { account, amount } => (account, Kind::Deposit, amount.get()),
        Operation::Withdraw { account, amount } => (account, Kind::Withdraw, amount.get()),
        _ => unreachable!("the simulation records deposits and withdrawals only"),
    }
}

/// The simulation's own ledger of what the outbox confirmed.
#[derive(Default)]
struct Expected(BTreeMap<AccountId, Vec<Recorded>>);

impl Expected {
    fn push(&mut self, op: &Operation) {
        let (account, kind, cents) = recorded_of(op);
        let list = self.0.entry(account).or_default();
        list.push((list.len() as u64 + 1, kind, cents));
    }
}

/// Crash points of a sync: may record an event meanwhile, may crash.
struct SimHooks<'a> {
    rng: &'a mut ChaCha8Rng,
    side: &'a mut Outbox,
    expected: &'a mut Expected,
    coverage: &'a mut Coverage,
}

impl Hooks for SimHooks<'_> {
    fn at(&mut self, step: CrashPoint) -> Result<(), Crashed> {
        if matches!(step, CrashPoint::RunPersisted | CrashPoint::Acked) && self.rng.gen_bool(0.3) {
            let op = random_op(self.rng);
            self.side.record(op, 0, &mut NoHooks).unwrap();
            self.expected.push(&op);
            self.coverage.recorded_meanwhile += 1;
        }
        if self.rng.gen_bool(0.08) {
            *self.coverage.crashes.entry(step.name()).or_default() += 1;
            return Err(Crashed(step));
        }
        Ok(())
    }
}

/// Crashes a record at one step.
struct CrashAt(CrashPoint);

impl Hooks for CrashAt {
    fn at(&mut self, step: CrashPoint) -> Result<(), Crashed> {
        if step == self.0 {
            return Err(Crashed(step));
        }
        Ok(())
    }
}

/// The device's events in the store, per account, in store order.
fn landed(memory: &MemoryLog, device: DeviceId) -> BTreeMap<AccountId, Vec<Recorded>> {
    let identity = Identity::default();
    let mut out = BTreeMap::new();
    for n in 1..=ACCOUNTS {
        let account = AccountId(uuid::Uuid::from_u128(n));
        let filter = ReadFilter {
            include_client_id: Some(device.as_u128()),
            ..ReadFilter::from_version(1)
        };
        let Ok(page) = memory.read_now(identity.key(account), &filter) else {
            continue;
        };
        assert!(page.next_version.is_none(), "one page holds the simulation");
        let list: Vec<Recorded> = page
            .batches
            .iter()
            .flat_map(|b| b.events.iter())
            .map(|e| {
                let kind = match AccountEvent::decode(e.event_type, &e.payload).unwrap() {
                    AccountEvent::Deposited { amount } => (Kind::Deposit, amount),
                    AccountEvent::Withdrawn { amount } => (Kind::Withdraw, amount),
                    other => panic!("a device wrote {other:?}"),
                };
                (e.client_seq, kind.0, kind.1)
            })
            .collect();
        out.insert(account, list);
    }
    out
}

/// The invariant; `complete` also demands that everything landed and is marked synced.
fn check(memory: &MemoryLog, outbox: &Outbox, expected: &Expected, complete: bool) {
    let store = landed(memory, outbox.device_id());
    for n in 1..=ACCOUNTS {
        let account = AccountId(uuid::Uuid::from_u128(n));
        let want = expected.0.get(&account).cloned().unwrap_or_default();
        let held = outbox.events(account).unwrap();
        let held_view: Vec<Recorded> = held
            .iter()
            .map(|e| (e.client_seq, e.kind, e.amount_cents))
            .collect();
        assert_eq!(
            held_view, want,
            "the outbox lost or renumbered {account}'s events"
        );
        let got = store.get(&account).cloned().unwrap_or_default();
        assert!(
            got.len() <= want.len() && got[..] == want[..got.len()],
            "{account}: the store is not a prefix of what was recorded (twice, out of order \
             or never recorded)\nstore: {got:?}\nrecorded: {want:?}"
        );
        let synced = held.iter().take_while(|e| e.synced).count();
        assert!(
            held[synced..].iter().all(|e| !e.synced),
            "{account}: synced events are not a prefix"
        );
        assert!(
            synced <= got.len(),
            "{account}: {synced} events marked synced but only {} landed",
            got.len()
        );
        if complete {
            assert_eq!(got, want, "{account}: not everything landed");
            assert_eq!(
                synced,
                want.len(),
                "{account}: not everything marked synced"
            );
        }
    }
}

async fn simulate(seed: u64, coverage: &mut Coverage) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // In memory where the machine allows: a simulated crash drops state in process, so the
    // fsyncs of every commit would only cost time here.
    let dir = TestDir::in_memory(&format!("device-sim-{seed}"));
    let path = dir.join("outbox.sqlite");
    let memory = Arc::new(MemoryLog::new());
    let faulty = Arc::new(FaultyLog::new(
        memory.clone(),
        FaultConfig {
            lost_ack: 0.15,
            lost_request: 0.05,
            refused: 0.1,
            inflight: 0.15,
            inflight_hold: INFLIGHT_HOLD,
            // A lagging read makes the proof check of an "already committed" answer retry.
            read_lag: 0.2,
            seed,
            ..FaultConfig::default()
        },
    ));
    let identity = Identity::default();
    let transport = InProcessTransport::new(
        DeviceSync::new(faulty.clone() as SharedLog, identity),
        Some(CLIENT_TIMEOUT),
    );
    let mut expected = Expected::default();
    let (mut outbox, _) = Outbox::init(&path, 0).unwrap();
    let mut offline_for = 0u32;

    for _ in 0..STEPS {
        transport.set_offline(offline_for > 0);
        offline_for = offline_for.saturating_sub(1);
        match rng.gen_range(0..100) {
            0..=44 => {
                let op = random_op(&mut rng);
                let crash = match rng.gen_range(0..10) {
                    0 => Some(CrashPoint::RecordBeforeCommit),
                    1 => Some(CrashPoint::RecordCommitted),
                    _ => None,
                };
                let result = match crash {
                    Some(step) => outbox.record(op, 0, &mut CrashAt(step)),
                    None => outbox.record(op, 0, &mut NoHooks),
                };
                match result {
                    Ok(_) | Err(OutboxError::Crashed(Crashed(CrashPoint::RecordCommitted))) => {
                        expected.push(&op)
                    }
                    Err(OutboxError::Crashed(Crashed(CrashPoint::RecordBeforeCommit))) => {}
                    Err(e) => panic!("record failed: {e}"),
                }
                if let Some(step) = crash {
                    *coverage.crashes.entry(step.name()).or_default() += 1;
                    drop(outbox);
                    outbox = Outbox::open(&path).unwrap();
                }
            }
            45..=84 => {
                let options = SyncOptions {
                    batch_size: rng.gen_range(1..=5),
                    max_attempts: rng.gen_range(1..=6),
                    base_backoff: Duration::from_millis(50),
                    max_backoff: Duration::from_secs(2),
                    jitter_seed: rng.r#gen(),
                };
                let mut side = Outbox::open(&path).unwrap();
                let mut hooks = SimHooks {
                    rng: &mut rng,
                    side: &mut side,
                    expected: &mut expected,
                    coverage,
                };
                let result = SyncLoop::new(&mut outbox, &transport, options)
                    .run(&mut hooks)
                    .await;
                match result {
                    Ok(report) => {
                        coverage.already_synced_runs += report.runs_already_synced;
                        match report.stopped {
                            None => {
                                let status = outbox.status().unwrap();
                                assert_eq!(
                                    status.pending + status.in_flight,
                                    0,
                                    "a sync that did not stop leaves nothing queued"
                                );
                            }
                            Some(StopReason::AttemptsExhausted { .. }) => {
                                coverage.exhausted_stops += 1
                            }
                            Some(stop @ StopReason::Refused { .. }) => {
                                panic!("a valid run was refused: {stop}")
                            }
                        }
                    }
                    Err(SyncError::Crashed(_)) => {
                        drop(outbox);
                        outbox = Outbox::open(&path).unwrap();
                    }
                    Err(e) => panic!("sync failed: {e}"),
                }
            }
            85..=91 => {
                coverage.offline_periods += 1;
                offline_for = rng.gen_range(1..=6);
                tokio::time::advance(LONG_OFFLINE).await;
            }
            _ => {
                // A crash while idle.
                drop(outbox);
                outbox = Outbox::open(&path).unwrap();
            }
        }
        check(&memory, &outbox, &expected, false);
    }

    // Faults over: let held writes finish, then one clean sync must land the rest.
    tokio::time::sleep(INFLIGHT_HOLD * 2).await;
    let clean = InProcessTransport::new(DeviceSync::new(memory.clone(), identity), None);
    let report = SyncLoop::new(
        &mut outbox,
        &clean,
        SyncOptions {
            max_attempts: 1,
            ..SyncOptions::default()
        },
    )
    .run(&mut NoHooks)
    .await
    .unwrap();
    assert_eq!(report.stopped, None, "a clean sync drains the outbox");
    coverage.already_synced_runs += report.runs_already_synced;
    check(&memory, &outbox, &expected, true);
    let f = faulty.counts();
    let c = &mut coverage.faults;
    c.lost_ack += f.lost_ack;
    c.lost_request += f.lost_request;
    c.refused += f.refused;
    c.inflight += f.inflight;
    c.inflight_duplicate += f.inflight_duplicate;
    c.read_lag += f.read_lag;
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("DEVICE_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let n = std::env::var("DEVICE_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEEDS);
    (0..n).collect()
}

#[test]
fn every_recorded_device_event_lands_exactly_once_in_order_through_crashes_and_faults() {
    let seeds = seeds();
    let mut coverage = Coverage::default();
    for &seed in &seeds {
        let _guard = SeedGuard(seed);
        // Paused time: backoffs, holds and offline periods take no wall time, and the one
        // thread makes every interleaving a function of the seed.
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(simulate(seed, &mut coverage));
    }
    eprintln!(
        "device_sim coverage over {} seeds: {coverage:?}",
        seeds.len()
    );
    if seeds.len() as u64 >= DEFAULT_SEEDS {
        // The default seeds must actually exercise every fault and every crash point.
        for step in CrashPoint::ALL {
            assert!(
                coverage.crashes.get(step.name()).copied().unwrap_or(0) > 0,
                "no crash at {step}"
            );
        }
        let f = &coverage.faults;
        assert!(f.lost_ack > 0 && f.refused > 0 && f.lost_request > 0);
        assert!(
            f.inflight_duplicate > 0,
            "no resend met its write in flight"
        );
        assert!(coverage.recorded_meanwhile > 0 && coverage.already_synced_runs > 0);
        assert!(coverage.exhausted_stops > 0 && coverage.offline_periods > 0);
    }
}
