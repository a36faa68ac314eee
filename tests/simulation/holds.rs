//! Holds under the fleet's faults, restarts and moving server time.
//!
//! A seed fixes a fleet (2-3 replicas with `--holds true` over one store, as in the fleet
//! runs), its store faults, latency and write-loop tuning, and a run of rounds. Before each
//! round simulated time jumps: the store's server clock moves, and each replica's local clock
//! moves a little less (its estimate of the server's now trails, as a real one does, until a
//! read or an anchor raises it). Between rounds the fleet restarts a replica (it folds cold,
//! from checkpoints when the seed writes them), sweeps due holds, re-anchors and writes
//! checkpoints, all drawn from the seed. The replicas' own sweepers run too, on virtual time.
//!
//! In a round, callers send deposits, withdrawals, transfers, placements (some with a
//! destination, some with an expiry of a few seconds), posts (of part or the whole, to the
//! hold's destination when it has one) and voids of holds whose placement was acknowledged,
//! each under its key, retried, duplicated to two replicas and replayed as the fleet runs do.
//! A post or void first expires its hold when due, and every write first expires its
//! accounts' due holds, as the HTTP routes do. At the end server time passes every expiry and
//! a replica over the bare store expires what is left.
//!
//! The rules, checked against the streams read back:
//! - every key that got a success landed exactly once (each leg), every key at most once, and
//!   each success is the stream's answer; an expiry lands only under its hold's derived key;
//! - each account's stream folds to a balance and an available amount never below zero;
//! - every hold resolves at most once, after its placement, a post at most what it held;
//! - no hold expires before its time in server time (the batches' commit times), and every
//!   hold with an expiry has resolved once server time passed it;
//! - money is conserved: the balances sum to the deposits less the withdrawals and the posts
//!   without a destination (transfers and posts to a destination move it whole);
//! - a refusal names an available amount and held sum the account had, below what was asked;
//!   a 409 `HOLD_RESOLVED` names how the stream resolved the hold, by another write; an
//!   acknowledged hold is never `HOLD_NOT_FOUND`; without faults nothing is retryable;
//! - every replica, and a fresh one, folds each account's balance, version, held sum and open
//!   holds to what the stream says.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tally::account::holds::{HoldId, Resolution};
use tally::account::{AccountEvent, AccountId, AmountCents, Operation, RuleError};
use tally::app::App;
use tally::projection::ManualClock;
use tally::store::faults::FaultCounts;
use tally::write_loop::expiry::expiry_event_id;
use tally::write_loop::{WriteError, WriteOutcome, WriteRequest};
use uuid::Uuid;

use super::{
    DUPLICATE, FaultCeilings, GIVE_UP, MAX_TRIES, Plan, REPLAY_AFTER_SUCCESS, Store, Truth, Tuning,
    assert_reproduces, build_replica, check_replicas, env_u64, read_truth, run_and_total, store,
    stream_answer, unambiguous, virtual_pause,
};

/// Seeds a plain `cargo test` runs (`TALLY_SIM_HOLDS_SEEDS` overrides).
pub const DEFAULT_HOLDS_SEEDS: u64 = 40;
/// The longest expiry a simulated placement asks for, in seconds: a run's time jumps cross
/// it several times.
const MAX_EXPIRY_S: u32 = 6;
/// The most a round moves server time.
const MAX_JUMP_MS: u64 = 2_500;
/// The most a replica's local clock falls behind the server's in one jump: as across hours.
const CLOCK_LAG_MS: u64 = super::hours::CLOCK_LAG_MS;
/// Virtual time the run waits after its last round, so writes the callers left behind (a
/// held write, a sweeper's expiry) land before the streams are read. Paused time: this costs
/// nothing real, and nothing else signals that the store has gone quiet.
const SETTLE: Duration = Duration::from_millis(200);
/// The store faults' ceilings: the runs across hours' (a fleet run's are higher), since a
/// post or void reads before it writes and so meets more faults a request.
const HOLDS_FAULT_CEILINGS: FaultCeilings = super::hours::HOURS_FAULT_CEILINGS;

// --- The plan ---

#[derive(Clone, Debug)]
pub struct HoldsPlan {
    /// The store, faults, latency and fleet shape; its flags, plus holds.
    base: Plan,
    rounds: usize,
    /// `--hold-sweep-interval-ms` of the replicas (virtual time).
    sweep_interval_ms: u64,
}

impl HoldsPlan {
    pub fn new(seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0401_d500);
        let accounts = (0..rng.gen_range(3..=4))
            .map(|_| AccountId(Uuid::from_u128(rng.r#gen())))
            .collect();
        let faults_on = !rng.gen_bool(0.25);
        let faults = faults_on.then(|| HOLDS_FAULT_CEILINGS.draw(&mut rng, seed));
        let base = Plan {
            seed,
            replicas: rng.gen_range(2..=3),
            accounts,
            callers: rng.gen_range(2..=4),
            ops_per_caller: rng.gen_range(1..=3),
            faults,
            tuning: Tuning::draw(&mut rng, faults_on),
            postgres: None,
            checkpoint_every: rng.gen_bool(0.5).then(|| rng.gen_range(1..=4)),
            combine_in_flight: [1, 2, 4, super::DEFAULT_MAX_IN_FLIGHT][rng.gen_range(0..4)],
        };
        Self {
            base,
            rounds: rng.gen_range(6..=12),
            sweep_interval_ms: rng.gen_range(200..=3_000),
        }
    }

    fn flags(&self) -> Vec<String> {
        let mut flags = self.base.flags();
        flags.extend([
            "--holds".into(),
            "true".into(),
            "--hold-sweep-interval-ms".into(),
            self.sweep_interval_ms.to_string(),
        ]);
        flags
    }
}

// --- The fleet, with clocks the run moves ---

struct Node {
    app: Arc<App>,
    clock: Arc<ManualClock>,
    /// How far its local clock fell behind the server's since its last anchor.
    lag_ms: u64,
}

async fn start_node(plan: &HoldsPlan, log: tally::store::SharedLog) -> Node {
    // Any origin: the replica anchors its estimate of the server's now at start.
    let clock = Arc::new(ManualClock::new(1_000_000));
    let app = build_replica(&plan.flags(), log, clock.clone()).await;
    Node {
        app,
        clock,
        lag_ms: 0,
    }
}

/// Moves the server's clock by `ms`, and each replica's local clock by a little less: its
/// estimate of the server's now never runs ahead of the server.
fn advance(store: &Store, nodes: &mut [Node], rng: &mut ChaCha8Rng, ms: u64) {
    store.server.advance(ms);
    for node in nodes {
        let lag = rng.gen_range(0..=CLOCK_LAG_MS.min(ms));
        node.clock.advance_ms(ms - lag);
        node.lag_ms += lag;
    }
}

// --- What callers saw ---

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Ok {
        legs: Vec<(AccountId, i64, u64)>,
        replayed: bool,
    },
    /// Not enough available: what the refusal named.
    Refused {
        available: i64,
        held: i64,
    },
    /// 409 `HOLD_RESOLVED`.
    Resolved(Resolution),
    /// 404 `HOLD_NOT_FOUND`.
    NotFound,
    Retryable(String),
    Unexpected(String),
}

impl Seen {
    fn from_answer(answer: Result<WriteOutcome, WriteError>) -> Self {
        match answer {
            Ok(o) => Seen::Ok {
                legs: o
                    .legs
                    .iter()
                    .map(|l| (l.account, l.balance, l.version))
                    .collect(),
                replayed: o.replayed,
            },
            Err(WriteError::Rule(RuleError::InsufficientFunds { balance })) => Seen::Refused {
                available: balance,
                held: 0,
            },
            Err(WriteError::Rule(RuleError::InsufficientAvailable { available, held })) => {
                Seen::Refused { available, held }
            }
            Err(WriteError::Rule(RuleError::HoldResolved { how, .. })) => Seen::Resolved(how),
            Err(WriteError::Rule(RuleError::HoldNotFound { .. })) => Seen::NotFound,
            Err(e @ (WriteError::Unverifiable { .. } | WriteError::GaveUp { .. })) => {
                Seen::Retryable(e.to_string())
            }
            Err(e) => Seen::Unexpected(format!("{e:?}")),
        }
    }
}

#[derive(Clone, Debug)]
struct Obs {
    round: usize,
    key: u128,
    replica: usize,
    /// A second copy sent at once, or a resend after a success.
    extra: bool,
    seen: Seen,
}

/// A hold whose placement was acknowledged: what a post of it needs.
#[derive(Clone, Copy, Debug)]
struct Placed {
    account: AccountId,
    hold: HoldId,
    amount: i64,
    to: Option<AccountId>,
}

#[derive(Default)]
struct Journal {
    ops: BTreeMap<u128, Operation>,
    obs: Vec<Obs>,
    /// Acknowledged placements, in the order their success arrived.
    placed: Vec<Placed>,
    upkeep: Vec<String>,
}

fn amount(rng: &mut ChaCha8Rng, max: i64) -> AmountCents {
    AmountCents::new(rng.gen_range(1..=max)).expect("amount")
}

/// A caller's next operation and its key. Posts and voids name an acknowledged hold (often
/// one another caller may resolve at the same time).
fn next_op(rng: &mut ChaCha8Rng, accounts: &[AccountId], placed: &[Placed]) -> (u128, Operation) {
    let key: u128 = rng.r#gen();
    let account = accounts[rng.gen_range(0..accounts.len())];
    let other = |rng: &mut ChaCha8Rng| loop {
        let to = accounts[rng.gen_range(0..accounts.len())];
        if to != account {
            break to;
        }
    };
    let roll: f64 = rng.r#gen();
    let op = if roll < 0.3 || (roll >= 0.65 && placed.is_empty()) {
        Operation::Deposit {
            account,
            amount: amount(rng, 100),
        }
    } else if roll < 0.4 {
        Operation::Withdraw {
            account,
            amount: amount(rng, 60),
        }
    } else if roll < 0.47 {
        let to = other(rng);
        Operation::transfer(account, to, amount(rng, 60)).expect("two accounts")
    } else if roll < 0.65 {
        Operation::PlaceHold {
            account,
            hold: HoldId(Uuid::from_u128(key)),
            amount: amount(rng, 60),
            to: rng.gen_bool(0.4).then(|| other(rng)),
            expires_in_secs: rng
                .gen_bool(0.6)
                .then(|| NonZeroU32::new(rng.gen_range(1..=MAX_EXPIRY_S)).expect("non-zero")),
        }
    } else {
        // The newest holds most often: those are the likeliest still open.
        let newest = placed.len().saturating_sub(6);
        let h = placed[rng.gen_range(newest..placed.len())];
        if rng.gen_bool(0.65) {
            let whole = rng.gen_bool(0.5);
            Operation::PostHold {
                account: h.account,
                hold: h.hold,
                amount: if whole {
                    AmountCents::new(h.amount).expect("amount")
                } else {
                    amount(rng, h.amount)
                },
                to: h.to,
            }
        } else {
            Operation::VoidHold {
                account: h.account,
                hold: h.hold,
            }
        }
    };
    (key, op)
}

/// Sends `op` under `key` to `app` as the HTTP routes run it: a post or void first expires
/// its hold when due, and every write first expires its accounts' due holds.
async fn send(app: Arc<App>, key: u128, op: Operation) -> Seen {
    if let Operation::PostHold { account, .. } | Operation::VoidHold { account, .. } = op {
        // A failure here is left to the write itself, as the route leaves it.
        let _ = app.writes.expire_due(account).await;
    }
    for leg in op.legs().as_slice() {
        app.writes.expire_before_write(leg.account).await;
    }
    let req = WriteRequest { op, event_id: key };
    Seen::from_answer(app.writes.execute(req).await)
}

async fn caller(
    apps: Arc<Vec<Arc<App>>>,
    journal: Arc<Mutex<Journal>>,
    plan: Arc<HoldsPlan>,
    round: usize,
    mut rng: ChaCha8Rng,
) {
    let n = apps.len();
    let record = |key, replica, extra, seen: &Seen| {
        journal.lock().obs.push(Obs {
            round,
            key,
            replica,
            extra,
            seen: seen.clone(),
        });
    };
    for _ in 0..plan.base.ops_per_caller {
        if rng.gen_bool(0.5) {
            tokio::time::sleep(virtual_pause(&mut rng, 3_000)).await;
        }
        let (key, op) = {
            let mut j = journal.lock();
            let (key, op) = next_op(&mut rng, &plan.base.accounts, &j.placed);
            j.ops.insert(key, op);
            (key, op)
        };
        let mut success = false;
        for tries in 1..=MAX_TRIES {
            let first = rng.gen_range(0..n);
            let seen = if rng.gen_bool(DUPLICATE) {
                let second = rng.gen_range(0..n);
                let (a, b) = tokio::join!(
                    send(apps[first].clone(), key, op),
                    send(apps[second].clone(), key, op)
                );
                record(key, first, false, &a);
                record(key, second, true, &b);
                vec![a, b]
            } else {
                let a = send(apps[first].clone(), key, op).await;
                record(key, first, false, &a);
                vec![a]
            };
            success = seen.iter().any(|s| matches!(s, Seen::Ok { .. }));
            if success
                || !seen.iter().all(|s| matches!(s, Seen::Retryable(_)))
                || tries == MAX_TRIES
                || rng.gen_bool(GIVE_UP)
            {
                break;
            }
            tokio::time::sleep(virtual_pause(&mut rng, 20_000)).await;
        }
        if !success {
            continue;
        }
        if let Operation::PlaceHold {
            account,
            hold,
            amount,
            to,
            ..
        } = op
        {
            journal.lock().placed.push(Placed {
                account,
                hold,
                amount: amount.get(),
                to,
            });
        }
        if rng.gen_bool(REPLAY_AFTER_SUCCESS) {
            tokio::time::sleep(virtual_pause(&mut rng, 10_000)).await;
            let replica = rng.gen_range(0..n);
            let seen = send(apps[replica].clone(), key, op).await;
            record(key, replica, true, &seen);
        }
    }
}

/// What the fleet does between rounds, each drawn from the seed: a restart, re-anchors,
/// sweeps and checkpoints. Failures (faults) are part of the run, never errors.
async fn upkeep(
    plan: &HoldsPlan,
    store: &Store,
    nodes: &mut [Node],
    journal: &Mutex<Journal>,
    rng: &mut ChaCha8Rng,
    round: usize,
) {
    let mut did = Vec::new();
    if round > 0 && rng.gen_bool(0.15) {
        let i = rng.gen_range(0..nodes.len());
        nodes[i] = start_node(plan, store.shared.clone()).await;
        did.push(format!("restart {i}"));
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        // The replica's own resync runs every minute of its tokio time, which barely moves
        // here: the run stands in for it.
        if node.lag_ms > 500 || rng.gen_bool(0.2) {
            let ok = node.app.projection.sync_server_clock().await.is_ok();
            node.lag_ms = if ok { 0 } else { node.lag_ms };
            did.push(format!("anchor {i} {ok}"));
        }
        if rng.gen_bool(0.3) {
            let pass = node.app.writes.sweep_holds_once(64).await;
            did.push(format!("sweep {i} {pass:?}"));
        }
    }
    if rng.gen_bool(0.3) {
        let i = rng.gen_range(0..nodes.len());
        let account = plan.base.accounts[rng.gen_range(0..plan.base.accounts.len())];
        let p = &nodes[i].app.projection;
        if p.refresh(account, &[]).await.is_ok() {
            p.write_checkpoint(account).await;
            did.push(format!("checkpoint {i} {account}"));
        }
    }
    if !did.is_empty() {
        journal
            .lock()
            .upkeep
            .push(format!("before round {round}: {}", did.join(", ")));
    }
}

// --- One run ---

pub struct HoldsResult {
    pub stats: HoldsStats,
    pub trace_hash: String,
    pub faults: FaultCounts,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct HoldsStats {
    pub keys: usize,
    pub successes: usize,
    pub replays: usize,
    pub refusals: usize,
    pub retryable: usize,
    pub placed: usize,
    pub posted: usize,
    pub posted_to: usize,
    pub voided: usize,
    pub expired: usize,
    /// 409 `HOLD_RESOLVED` answers: a resolution that lost to another.
    pub lost_races: usize,
}

impl HoldsStats {
    pub fn add(&mut self, o: &HoldsStats) {
        self.keys += o.keys;
        self.successes += o.successes;
        self.replays += o.replays;
        self.refusals += o.refusals;
        self.retryable += o.retryable;
        self.placed += o.placed;
        self.posted += o.posted;
        self.posted_to += o.posted_to;
        self.voided += o.voided;
        self.expired += o.expired;
        self.lost_races += o.lost_races;
    }
}

/// One seed on its own single-threaded runtime with paused time.
pub fn run_holds_seed(seed: u64) -> Result<HoldsResult, String> {
    let plan = HoldsPlan::new(seed);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(run_holds(&plan))
        .map_err(|v| format!("{v}\n  plan: {plan:?}"))
}

async fn run_holds(plan: &HoldsPlan) -> Result<HoldsResult, String> {
    let store = store(&plan.base);
    let mut rng = ChaCha8Rng::seed_from_u64(plan.base.seed ^ 0x401d_0b0e);
    let mut nodes = Vec::with_capacity(plan.base.replicas);
    for _ in 0..plan.base.replicas {
        nodes.push(start_node(plan, store.shared.clone()).await);
    }
    let journal = Arc::new(Mutex::new(Journal::default()));
    let shared_plan = Arc::new(plan.clone());
    for round in 0..plan.rounds {
        let jump = rng.gen_range(0..=MAX_JUMP_MS);
        advance(&store, &mut nodes, &mut rng, jump);
        upkeep(plan, &store, &mut nodes, &journal, &mut rng, round).await;
        let apps = Arc::new(nodes.iter().map(|n| n.app.clone()).collect::<Vec<_>>());
        let tasks: Vec<_> = (0..plan.base.callers)
            .map(|_| {
                let task_rng = ChaCha8Rng::seed_from_u64(rng.r#gen());
                tokio::spawn(caller(
                    apps.clone(),
                    journal.clone(),
                    shared_plan.clone(),
                    round,
                    task_rng,
                ))
            })
            .collect();
        for t in tasks {
            t.await.expect("caller task");
        }
    }
    tokio::time::sleep(SETTLE).await;
    // Server time passes every expiry; a replica over the bare store (no faults) expires
    // what is left on every account.
    let past = u64::from(MAX_EXPIRY_S) * 1_000 + 1;
    advance(&store, &mut nodes, &mut rng, past);
    let closer = start_node(plan, store.mem.clone()).await;
    for &account in &plan.base.accounts {
        loop {
            match closer.app.writes.expire_due(account).await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => return Err(format!("closing {account}: expiry failed: {e}")),
            }
        }
    }
    tokio::time::sleep(SETTLE).await;
    let identity = nodes[0].app.identity;
    let truth = read_truth(&plan.base, &store.mem, identity.client(), |a| {
        identity.key(a)
    })
    .await?;
    let faults = store.fault_counts();
    let (stats, trace_hash) = {
        let journal = journal.lock();
        let stats = check_holds(plan, &journal, &truth).map_err(|v| story(v, &journal, &truth))?;
        (stats, trace_hash(&journal, &truth, &faults))
    };
    let apps: Vec<Arc<App>> = nodes.iter().map(|n| n.app.clone()).collect();
    let fresh = start_node(plan, store.mem.clone()).await;
    check_replicas(&apps, &fresh.app, &truth).await?;
    check_replica_holds(&apps, &fresh.app, &truth, &plan.base.accounts).await?;
    Ok(HoldsResult {
        stats,
        trace_hash,
        faults,
    })
}

// --- The rules ---

/// One hold as the streams show it.
#[derive(Clone, Copy, Debug)]
struct StreamHold {
    amount: i64,
    expires_in_secs: Option<NonZeroU32>,
    placed_ms: u64,
    /// The first resolution: how, and under which event id.
    resolved: Option<(Resolution, u128)>,
}

/// What every account's stream says of holds and money, checked event by event.
#[derive(Default)]
struct Folded {
    holds: BTreeMap<HoldId, StreamHold>,
    /// Per account: every (balance, held) it had, (0, 0) before its first event.
    states: BTreeMap<AccountId, BTreeSet<(i64, i64)>>,
    /// Per account: the sum of its open holds at the end.
    held: BTreeMap<AccountId, i64>,
}

fn fold_streams(truth: &Truth) -> Result<Folded, String> {
    let mut f = Folded::default();
    let mut held: BTreeMap<AccountId, i64> = BTreeMap::new();
    for (id, l) in &truth.stream {
        let account = l.account;
        let h = held.entry(account).or_default();
        let at = format!("{account} v{} ({:?}, id {id:x})", l.version, l.event);
        match l.event {
            AccountEvent::HoldPlaced {
                amount,
                expires_in_secs,
                ..
            } => {
                let hold = HoldId(Uuid::from_u128(*id));
                if f.holds.contains_key(&hold) {
                    return Err(format!("{at}: hold {hold} is placed twice"));
                }
                f.holds.insert(
                    hold,
                    StreamHold {
                        amount,
                        expires_in_secs,
                        placed_ms: l.at_ms,
                        resolved: None,
                    },
                );
                *h += amount;
            }
            AccountEvent::HoldPosted { hold, .. }
            | AccountEvent::HoldVoided { hold }
            | AccountEvent::HoldExpired { hold } => {
                let how = match l.event {
                    AccountEvent::HoldPosted { .. } => Resolution::Posted,
                    AccountEvent::HoldVoided { .. } => Resolution::Voided,
                    _ => Resolution::Expired,
                };
                let Some(s) = f.holds.get_mut(&hold) else {
                    return Err(format!("{at}: resolves hold {hold}, never placed before"));
                };
                if let Some(first) = s.resolved {
                    return Err(format!(
                        "{at}: hold {hold} resolves a second time; it was {first:?}"
                    ));
                }
                if let AccountEvent::HoldPosted { amount, .. } = l.event
                    && amount > s.amount
                {
                    return Err(format!("{at}: posts {amount} of a hold of {}", s.amount));
                }
                if how == Resolution::Expired {
                    let Some(secs) = s.expires_in_secs else {
                        return Err(format!("{at}: expires hold {hold}, which has no expiry"));
                    };
                    let due = s.placed_ms + u64::from(secs.get()) * 1_000;
                    if l.at_ms < due {
                        return Err(format!(
                            "{at}: hold {hold} expired at server time {} ms, {} ms before its time {due} ms",
                            l.at_ms,
                            due - l.at_ms
                        ));
                    }
                    if *id != expiry_event_id(hold) {
                        return Err(format!("{at}: an expiry not under its hold's derived key"));
                    }
                }
                s.resolved = Some((how, *id));
                *h -= s.amount;
            }
            _ => {}
        }
        if l.balance - *h < 0 || *h < 0 {
            return Err(format!(
                "{at}: balance {} with {} held: the available amount is below zero",
                l.balance, *h
            ));
        }
        f.states
            .entry(account)
            .or_insert_with(|| BTreeSet::from([(0, 0)]))
            .insert((l.balance, *h));
    }
    f.held = held;
    Ok(f)
}

fn check_holds(plan: &HoldsPlan, journal: &Journal, truth: &Truth) -> Result<HoldsStats, String> {
    let f = fold_streams(truth)?;
    let mut stats = HoldsStats {
        keys: journal.ops.len(),
        ..HoldsStats::default()
    };
    // Every landed event belongs to a request (each leg exactly once) or is an expiry.
    for (key, landed) in &truth.by_key {
        let Some(op) = journal.ops.get(key) else {
            if landed.len() == 1
                && let AccountEvent::HoldExpired { hold } = landed[0].event
                && expiry_event_id(hold) == *key
            {
                stats.expired += 1;
                continue;
            }
            return Err(format!(
                "an event for unknown key {key:x} is in the stream: {landed:?}"
            ));
        };
        let legs = op.legs();
        if landed.len() != legs.as_slice().len()
            || legs.as_slice().iter().any(|leg| {
                landed
                    .iter()
                    .filter(|l| l.account == leg.account && l.event == leg.event)
                    .count()
                    != 1
            })
        {
            return Err(format!(
                "key {key:x} ({op:?}) landed as {landed:?}: not each leg exactly once"
            ));
        }
        match op {
            Operation::PlaceHold { .. } => stats.placed += 1,
            Operation::PostHold { to: Some(_), .. } => stats.posted_to += 1,
            Operation::PostHold { .. } => stats.posted += 1,
            Operation::VoidHold { .. } => stats.voided += 1,
            _ => {}
        }
    }
    // Money: what the landed writes put in and took out is what the balances hold.
    let mut expected = 0i64;
    for key in truth.by_key.keys() {
        match journal.ops.get(key) {
            Some(Operation::Deposit { amount, .. }) => expected += amount.get(),
            Some(Operation::Withdraw { amount, .. }) => expected -= amount.get(),
            Some(Operation::PostHold {
                amount, to: None, ..
            }) => expected -= amount.get(),
            _ => {}
        }
    }
    let total: i64 = truth.accounts.values().map(|a| a.0).sum();
    if total != expected {
        return Err(format!(
            "money is not conserved: the balances sum to {total}, the landed writes to {expected}"
        ));
    }
    // Every hold with an expiry resolved once server time passed it.
    for (hold, s) in &f.holds {
        if s.expires_in_secs.is_some() && s.resolved.is_none() {
            return Err(format!("hold {hold} ({s:?}) is still open past its expiry"));
        }
    }
    // Per key: every answer is one the streams bear out.
    let mut by_key: BTreeMap<u128, Vec<&Obs>> = BTreeMap::new();
    for o in &journal.obs {
        by_key.entry(o.key).or_default().push(o);
    }
    let faults = plan.base.faults.is_some();
    for (key, obs) in &by_key {
        let op = journal.ops[key];
        let landed = truth.by_key.get(key);
        let story = |what: String, o: &Obs| {
            format!(
                "key {key:x} ({op:?}) in round {} to replica {}{}: {what}",
                o.round,
                o.replica,
                if o.extra { " (a copy or a resend)" } else { "" }
            )
        };
        let mut first_hand = 0;
        let mut any_ok = false;
        for o in obs {
            match &o.seen {
                Seen::Ok { legs, replayed } => {
                    any_ok = true;
                    stats.successes += 1;
                    if *replayed {
                        stats.replays += 1;
                    } else {
                        first_hand += 1;
                    }
                    let Some(landed) = landed else {
                        return Err(story(format!("a success {legs:?}, not in the stream"), o));
                    };
                    let want = stream_answer(&op, landed);
                    if *legs != want {
                        return Err(story(
                            format!(
                                "answered {legs:?} (replayed {replayed}), the stream says {want:?}"
                            ),
                            o,
                        ));
                    }
                }
                Seen::Refused { available, held } => {
                    stats.refusals += 1;
                    let asked = match op {
                        Operation::Withdraw { amount, .. }
                        | Operation::Transfer { amount, .. }
                        | Operation::PlaceHold { amount, .. } => amount.get(),
                        _ => return Err(story(format!("refused for funds: {:?}", o.seen), o)),
                    };
                    let account = op.account();
                    // An account never written had nothing: (0, 0).
                    let had = &f
                        .states
                        .get(&account)
                        .cloned()
                        .unwrap_or_else(|| BTreeSet::from([(0, 0)]));
                    if *available >= asked || !had.contains(&(available + held, *held)) {
                        return Err(story(
                            format!(
                                "refused naming {available} available and {held} held for {asked}; \
                                 {account} had (balance, held) {had:?}"
                            ),
                            o,
                        ));
                    }
                }
                Seen::Resolved(how) => {
                    stats.lost_races += 1;
                    let hold = match op {
                        Operation::PostHold { hold, .. } | Operation::VoidHold { hold, .. } => hold,
                        _ => return Err(story("HOLD_RESOLVED for no hold".into(), o)),
                    };
                    let first = f.holds.get(&hold).and_then(|s| s.resolved);
                    if landed.is_some() || first.is_none_or(|(h, by)| h != *how || by == *key) {
                        return Err(story(
                            format!(
                                "HOLD_RESOLVED {how:?}; the stream resolved it {first:?}, and this key landed: {}",
                                landed.is_some()
                            ),
                            o,
                        ));
                    }
                }
                Seen::NotFound => {
                    return Err(story("HOLD_NOT_FOUND for an acknowledged hold".into(), o));
                }
                Seen::Retryable(why) => {
                    stats.retryable += 1;
                    if !faults {
                        return Err(story(format!("retryable with no faults on: {why}"), o));
                    }
                }
                Seen::Unexpected(e) => {
                    return Err(story(format!("an unexpected error: {e}"), o));
                }
            }
        }
        if !faults {
            unambiguous(*key, &op, landed.is_some(), any_ok, first_hand, obs)?;
        }
    }
    Ok(stats)
}

/// Each replica, and a fresh one, holds each account's open holds as the stream does: the
/// same held sum and the same open holds.
async fn check_replica_holds(
    replicas: &[Arc<App>],
    fresh: &Arc<App>,
    truth: &Truth,
    accounts: &[AccountId],
) -> Result<(), String> {
    let mut open: BTreeMap<AccountId, BTreeSet<HoldId>> = BTreeMap::new();
    let mut held: BTreeMap<AccountId, i64> = BTreeMap::new();
    let f = fold_streams(truth)?;
    for (id, l) in &truth.stream {
        if let AccountEvent::HoldPlaced { .. } = l.event {
            let hold = HoldId(Uuid::from_u128(*id));
            if f.holds[&hold].resolved.is_none() {
                open.entry(l.account).or_default().insert(hold);
            }
        }
    }
    for (a, h) in &f.held {
        held.insert(*a, *h);
    }
    for (i, app) in replicas.iter().chain(std::iter::once(fresh)).enumerate() {
        for account in accounts {
            let mut seen = None;
            for _ in 0..100 {
                if let Ok(loaded) = app.projection.refresh(*account, &[]).await
                    && loaded.snap.version >= truth.accounts.get(account).map_or(0, |a| a.1)
                {
                    seen = app.projection.open_holds(&loaded.view);
                    break;
                }
            }
            let Some((snap, list)) = seen else {
                return Err(format!("replica {i} never caught up on {account}"));
            };
            let ids: BTreeSet<HoldId> = list.iter().map(|(id, _)| *id).collect();
            let want_held = held.get(account).copied().unwrap_or(0);
            let want_open = open.get(account).cloned().unwrap_or_default();
            if snap.held != want_held || ids != want_open {
                return Err(format!(
                    "replica {i} holds {} on {account} in {ids:?}; the stream holds {want_held} in {want_open:?} (replica {} is fresh)",
                    snap.held,
                    replicas.len()
                ));
            }
        }
    }
    Ok(())
}

/// With `TALLY_SIM_TRACE` set, a violation carries the whole run.
fn story(violation: String, journal: &Journal, truth: &Truth) -> String {
    let answers = journal
        .obs
        .iter()
        .map(|o| format!("{o:?} {:?}", journal.ops[&o.key]));
    super::tell_story(violation, &journal.upkeep, answers, truth)
}

fn trace_hash(journal: &Journal, truth: &Truth, faults: &FaultCounts) -> String {
    let obs = journal.obs.iter().map(|o| format!("{o:?}"));
    super::hash_trace(obs.chain(journal.upkeep.iter().cloned()), truth, faults)
}

// --- The tests ---

/// The seeds the holds runs take: `TALLY_SIM_SEED` alone, or `TALLY_SIM_FIRST_SEED`
/// onwards, `TALLY_SIM_HOLDS_SEEDS` of them (default [`DEFAULT_HOLDS_SEEDS`]).
fn holds_seeds() -> Vec<u64> {
    if let Some(seed) = env_u64("TALLY_SIM_SEED") {
        return vec![seed];
    }
    let first = env_u64("TALLY_SIM_FIRST_SEED").unwrap_or(0);
    let count = env_u64("TALLY_SIM_HOLDS_SEEDS").unwrap_or(DEFAULT_HOLDS_SEEDS);
    (first..first + count).collect()
}

/// Holds placed, posted, voided and expired by a fleet under faults, restarts and moving
/// server time: each resolves at most once and never early, the available amount never goes
/// below zero, money is conserved, and every acknowledged write landed exactly once.
#[test]
fn seeded_fleet_runs_with_holds_resolve_each_hold_once_never_early_and_conserve_money() {
    let (total, runs) = run_and_total(
        "with holds",
        "holds::",
        &holds_seeds(),
        run_holds_seed,
        |r| (&r.stats, r.trace_hash.as_str(), &r.faults),
        HoldsStats::add,
    );
    // A run that never posted, voided, expired or lost a race proves nothing about them.
    if runs >= 10 {
        assert!(
            total.posted > 0
                && total.posted_to > 0
                && total.voided > 0
                && total.expired > 0
                && total.lost_races > 0
                && total.refusals > 0,
            "the runs did not cover every resolution: {total:?}"
        );
    }
}

/// The same seed with holds gives the same run: the same answers, streams and upkeep.
#[test]
fn a_seed_with_holds_reproduces_the_same_run() {
    for seed in 0..3 {
        assert_reproduces(seed, "with holds", run_holds_seed, |r| {
            r.trace_hash.as_str()
        });
    }
}
