//! Simulated hours: keys retried at every age, against the two horizons.
//!
//! A seed fixes a fleet (2-3 replicas over one store, as in the fleet runs), a short window
//! (2-5 s) and a retention of 20-60 minutes, so a run crosses the retention several times
//! while staying fast. Simulated time moves in jumps: the store's server clock and every
//! replica's local clock advance together (each replica's a little less, a lag only a
//! re-anchor or a read takes back). Between jumps nothing moves but the virtual time of
//! backoff and faults, which is milliseconds.
//!
//! At chosen moments callers send new keys. Each key is then retried later, at an age drawn
//! from one of these bands, measured from its write's commit in server time:
//! - inside the window (the recent-writes index answers);
//! - just past the window, and anywhere between the window and the retention (the key
//!   memory answers);
//! - near the retention, where either answer is allowed (see [`MARGIN_MS`]);
//! - past the retention (the key is forgotten: the retry is a new write).
//!
//! A retry goes to a random replica, often to one restarted since (cold: it loads the
//! account from checkpoints and the stream), sometimes to two at once. Between moments the
//! fleet restarts replicas, sweeps, re-anchors, writes checkpoints and trims accounts (by
//! hand with a random history kept, zero included, which must never cut a remembered key's
//! batch), all drawn from the seed, with the fleet runs' store faults on most seeds.
//!
//! The rules, checked per key and moment against the streams read back at the end:
//! - a retry inside the retention of the key's latest landing writes nothing and answers
//!   that landing (same balance and version, marked as a replay);
//! - a retry past it lands again, and every success answers the new landing;
//! - a key lands at most once per moment, and only at a moment it was sent;
//! - refusals name a balance the account had; without faults nothing is retryable;
//! - every replica, and a fresh one, folds each account to what the stream says.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tally::account::{AccountId, Operation};
use tally::app::App;
use tally::projection::ManualClock;
use tally::store::SharedLog;
use tally::store::faults::FaultCounts;
use tally::store::memory;
use tally::write_loop::WriteRequest;
use uuid::Uuid;

use super::{
    FaultCeilings, MAX_TRIES, Plan, Seen, Truth, Tuning, build_replica, check_replicas, random_op,
    store, virtual_pause,
};

/// Seeds a plain `cargo test` runs across hours (`TALLY_SIM_HOURS_SEEDS` overrides).
pub const DEFAULT_HOURS_SEEDS: u64 = 12;

/// How far from the retention a retry's age must be for its answer to be certain. Inside
/// this band either answer is right: a replica's estimate of the server's now trails the
/// server by up to a round trip (the anchor is a lower bound), and here also by the clock
/// lag the harness gives each replica (re-anchored before it reaches half of this).
const MARGIN_MS: u64 = 2_000;
/// The most a replica's local clock falls behind the server's in one jump.
pub const CLOCK_LAG_MS: u64 = 20;
/// The write deadline: a write's life must fit in the window, which is 2 s at least.
const DEADLINE_MS: u64 = 1_000;
/// Virtual time a moment waits after its requests answered, so writes they left behind
/// (a held write, a checkpoint) land at this moment and not at the next one. Paused time:
/// this costs nothing real, and nothing else signals that the store has gone quiet.
const SETTLE: Duration = Duration::from_millis(200);
/// The oldest a retry past the retention gets, beyond the retention.
const PAST_RETENTION_MS: u64 = 30 * 60_000;
/// The most each store fault's probability may be across hours (a fleet run's are higher).
pub const HOURS_FAULT_CEILINGS: FaultCeilings = FaultCeilings {
    lost_ack: 0.1,
    lost_request: 0.05,
    refused: 0.05,
    inflight: 0.05,
    read_lag: 0.2,
};

// --- The plan ---

#[derive(Clone, Debug)]
pub struct HoursPlan {
    /// The store, faults, latency and fleet shape (its flags are not used).
    base: Plan,
    window_s: u64,
    retention_s: u64,
    checkpoint_every: u64,
    /// `--retain-history-secs`: each checkpoint written trims below an older one.
    retain_history_s: Option<u64>,
    /// When new keys are sent, in simulated ms from the start.
    write_moments: Vec<u64>,
}

impl HoursPlan {
    pub fn new(seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0480_0125);
        let accounts = (0..rng.gen_range(2..=4))
            .map(|_| AccountId(Uuid::from_u128(rng.r#gen())))
            .collect();
        let faults_on = !rng.gen_bool(0.25);
        let faults = faults_on.then(|| HOURS_FAULT_CEILINGS.draw(&mut rng, seed));
        let window_s = rng.gen_range(2..=5);
        let retention_s = rng.gen_range(20..=60) * 60;
        // The history kept must cover the retention (a shorter one is refused at start); a
        // trim by hand may ask for less (see `upkeep`).
        let retain_history_s = match rng.gen_range(0..3) {
            0 => None,
            1 => Some(retention_s - window_s),
            _ => Some(retention_s + rng.gen_range(0..600)),
        };
        // New keys over one and a half retentions, so the last are retried past it too.
        let span = retention_s * 1_500;
        let mut write_moments: Vec<u64> = (0..rng.gen_range(8..=14))
            .map(|_| rng.gen_range(0..span))
            .collect();
        write_moments.push(0);
        write_moments.sort_unstable();
        write_moments.dedup();
        let base = Plan {
            seed,
            replicas: rng.gen_range(2..=3),
            accounts,
            callers: 0,
            ops_per_caller: 0,
            faults,
            tuning: Tuning::draw(&mut rng, faults_on),
            postgres: None,
            checkpoint_every: None,
            combine_in_flight: [1, 2, 4, super::DEFAULT_MAX_IN_FLIGHT][rng.gen_range(0..4)],
        };
        Self {
            base,
            window_s,
            retention_s,
            checkpoint_every: rng.gen_range(1..=4),
            retain_history_s,
            write_moments,
        }
    }

    fn window_ms(&self) -> u64 {
        self.window_s * 1_000
    }

    fn retention_ms(&self) -> u64 {
        self.retention_s * 1_000
    }

    fn flags(&self) -> Vec<String> {
        let mut flags: Vec<String> = [
            "--write-deadline-ms",
            &DEADLINE_MS.to_string(),
            "--idempotency-window",
            &self.window_s.to_string(),
            "--idempotency-retention",
            &self.retention_s.to_string(),
            "--checkpoint-every-events",
            &self.checkpoint_every.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        flags.extend(self.base.write_loop_flags());
        if let Some(secs) = self.retain_history_s {
            flags.extend(["--retain-history-secs".into(), secs.to_string()]);
        }
        flags
    }
}

// --- The fleet, with clocks the harness moves ---

/// One replica and the local clock it runs on.
struct Node {
    app: Arc<App>,
    clock: Arc<ManualClock>,
    /// How far its local clock fell behind the server's since its last anchor.
    lag_ms: u64,
    /// Simulated ms at which it started: a key that landed before this is cold here.
    started_ms: u64,
}

async fn start_node(plan: &HoursPlan, log: SharedLog, now: u64) -> Node {
    // Any origin: the replica anchors its estimate of the server's now at start.
    let clock = Arc::new(ManualClock::new(1_000_000 + now));
    let app = build_replica(&plan.flags(), log, clock.clone()).await;
    Node {
        app,
        clock,
        lag_ms: 0,
        started_ms: now,
    }
}

// --- What callers saw ---

#[derive(Clone, Debug)]
struct Obs {
    /// The simulated moment (ms from the start) it was sent at.
    at: u64,
    key: u128,
    replica: usize,
    /// When that replica started (simulated ms).
    replica_started: u64,
    /// A retry of a key sent at an earlier moment, with the age band it was drawn from.
    retry: Option<Band>,
    duplicate: bool,
    seen: Seen,
}

#[derive(Default)]
struct Journal {
    ops: BTreeMap<u128, Operation>,
    obs: Vec<Obs>,
    /// What the fleet did between moments, for the trace hash and a violation's story.
    upkeep: Vec<String>,
}

/// The band a retry's age was drawn from (the check classifies by the age the streams
/// show, which differs when a key landed later than sent or landed again).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Band {
    InsideWindow,
    JustPastWindow,
    BeforeRetention,
    NearRetention,
    PastRetention,
}

fn draw_age(rng: &mut ChaCha8Rng, plan: &HoursPlan) -> (Band, u64) {
    let (window, retention) = (plan.window_ms(), plan.retention_ms());
    let roll: f64 = rng.r#gen();
    if roll < 0.25 {
        (Band::InsideWindow, rng.gen_range(1..window))
    } else if roll < 0.4 {
        (Band::JustPastWindow, rng.gen_range(window..window + 2_000))
    } else if roll < 0.7 {
        (
            Band::BeforeRetention,
            rng.gen_range(window..retention - MARGIN_MS),
        )
    } else if roll < 0.8 {
        (
            Band::NearRetention,
            rng.gen_range(retention - MARGIN_MS..=retention + MARGIN_MS),
        )
    } else {
        (
            Band::PastRetention,
            rng.gen_range(retention + MARGIN_MS..retention + PAST_RETENTION_MS),
        )
    }
}

/// Sends `key` until a success, a final answer, the try cap or a give-up, all at one moment;
/// each copy's answer is recorded.
#[allow(clippy::too_many_arguments)]
async fn send_key(
    apps: Arc<Vec<(Arc<App>, u64)>>,
    journal: Arc<Mutex<Journal>>,
    at: u64,
    key: u128,
    op: Operation,
    retry: Option<Band>,
    prefer: Option<usize>,
    mut rng: ChaCha8Rng,
) {
    let n = apps.len();
    let record = |replica: usize, duplicate: bool, seen: &Seen| {
        journal.lock().obs.push(Obs {
            at,
            key,
            replica,
            replica_started: apps[replica].1,
            retry,
            duplicate,
            seen: seen.clone(),
        });
    };
    let send = |replica: usize| {
        let app = apps[replica].0.clone();
        async move {
            let req = WriteRequest { op, event_id: key };
            Seen::from_answer(app.writes.execute(req).await)
        }
    };
    for tries in 1..=MAX_TRIES {
        let first = match prefer {
            Some(r) if tries == 1 => r,
            _ => rng.gen_range(0..n),
        };
        let seen = if rng.gen_bool(super::DUPLICATE) {
            let second = rng.gen_range(0..n);
            let (a, b) = tokio::join!(send(first), send(second));
            record(first, false, &a);
            record(second, true, &b);
            vec![a, b]
        } else {
            let a = send(first).await;
            record(first, false, &a);
            vec![a]
        };
        if seen.iter().any(|s| matches!(s, Seen::Ok { .. }))
            || !seen.iter().all(|s| matches!(s, Seen::Retryable(_)))
            || rng.gen_bool(super::GIVE_UP)
        {
            return;
        }
        tokio::time::sleep(virtual_pause(&mut rng, 20_000)).await;
    }
}

// --- One run ---

pub struct HoursResult {
    pub stats: HoursStats,
    pub trace_hash: String,
    pub faults: FaultCounts,
}

/// One seed on its own single-threaded runtime with paused time.
pub fn run_hours_seed(seed: u64) -> Result<HoursResult, String> {
    let plan = HoursPlan::new(seed);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(run_hours(&plan)).map_err(|v| {
        format!(
            "{v}\n  plan: window {} s, retention {} s, checkpoint every {} events, \
             retain history {:?}, {} replicas, faults {:?}",
            plan.window_s,
            plan.retention_s,
            plan.checkpoint_every,
            plan.retain_history_s,
            plan.base.replicas,
            plan.base.faults
        )
    })
}

async fn run_hours(plan: &HoursPlan) -> Result<HoursResult, String> {
    let store = store(&plan.base);
    let mut rng = ChaCha8Rng::seed_from_u64(plan.base.seed ^ 0x7153_0b0e);
    let mut nodes = Vec::with_capacity(plan.base.replicas);
    for _ in 0..plan.base.replicas {
        nodes.push(start_node(plan, store.shared.clone(), 0).await);
    }
    let journal = Arc::new(Mutex::new(Journal::default()));
    // Retries due, by simulated ms: (key, band).
    let mut due: BTreeMap<u64, Vec<(u128, Band)>> = BTreeMap::new();
    let mut writes = plan.write_moments.iter().copied().peekable();
    let mut now = 0u64;
    let mut restarted: Option<usize> = None;
    let identity = nodes[0].app.identity;
    let key_of = |a| identity.key(a);
    // Read on after every moment: trims (by hand, and after checkpoints) drop what lies
    // below a checkpoint older than the window, which a moment later the truth has read.
    let mut truth = Truth::default();
    loop {
        let next = writes
            .peek()
            .copied()
            .into_iter()
            .chain(due.keys().next().copied())
            .min();
        let Some(next) = next else { break };
        advance(&store.server, &mut nodes, &mut rng, next - now);
        now = next;
        upkeep(
            plan,
            &store,
            &mut nodes,
            &mut restarted,
            &journal,
            &mut rng,
            now,
        )
        .await;
        let apps: Arc<Vec<(Arc<App>, u64)>> = Arc::new(
            nodes
                .iter()
                .map(|n| (n.app.clone(), n.started_ms))
                .collect(),
        );
        // Each key's sends run as a task of their own, recorded against this moment.
        let send_at_now = |key, op, retry, prefer, task_rng| {
            tokio::spawn(send_key(
                apps.clone(),
                journal.clone(),
                now,
                key,
                op,
                retry,
                prefer,
                task_rng,
            ))
        };
        let mut tasks = Vec::new();
        let mut new_keys = Vec::new();
        if writes.next_if_eq(&now).is_some() {
            for _ in 0..rng.gen_range(1..=4) {
                let op = random_op(&mut rng, &plan.base.accounts);
                let key: u128 = rng.r#gen();
                journal.lock().ops.insert(key, op);
                new_keys.push(key);
                let task_rng = ChaCha8Rng::seed_from_u64(rng.r#gen());
                tasks.push(send_at_now(key, op, None, None, task_rng));
            }
        }
        for (key, band) in due.remove(&now).unwrap_or_default() {
            let op = journal.lock().ops[&key];
            // Often the replica restarted last, which knows the key only from the store.
            let prefer = restarted.filter(|_| rng.gen_bool(0.4));
            let task_rng = ChaCha8Rng::seed_from_u64(rng.r#gen());
            tasks.push(send_at_now(key, op, Some(band), prefer, task_rng));
        }
        for t in tasks {
            t.await.expect("sender task");
        }
        tokio::time::sleep(SETTLE).await;
        truth
            .read_on(&plan.base, &store.mem, identity.client(), key_of)
            .await?;
        for key in new_keys {
            for _ in 0..rng.gen_range(1..=2) {
                let (band, age) = draw_age(&mut rng, plan);
                let at = now + age;
                // One send of a key per moment: a retry that would share one is dropped.
                if !due
                    .get(&at)
                    .is_some_and(|v| v.iter().any(|(k, _)| *k == key))
                {
                    due.entry(at).or_default().push((key, band));
                }
            }
        }
    }
    let apps: Vec<Arc<App>> = nodes.iter().map(|n| n.app.clone()).collect();
    let faults = store.fault_counts();
    let (stats, trace_hash) = {
        let journal = journal.lock();
        let stats = check_hours(plan, &journal, &truth).map_err(|v| story(v, &journal, &truth))?;
        (stats, trace_hash(&journal, &truth, &faults))
    };
    let fresh = start_node(plan, store.mem.clone(), now).await;
    check_replicas(&apps, &fresh.app, &truth).await?;
    Ok(HoursResult {
        stats,
        trace_hash,
        faults,
    })
}

/// Moves the server's clock by `ms`, and each replica's local clock by a little less (its
/// estimate of the server's now falls behind until a read or an anchor raises it).
fn advance(server: &memory::ServerClock, nodes: &mut [Node], rng: &mut ChaCha8Rng, ms: u64) {
    server.advance(ms);
    for node in nodes {
        let lag = rng.gen_range(0..=CLOCK_LAG_MS.min(ms));
        node.clock.advance_ms(ms - lag);
        node.lag_ms += lag;
    }
}

/// What the fleet does between moments, each drawn from the seed: restarts, re-anchors,
/// sweeps, checkpoints and trims. Failures (faults) are part of the run, never errors.
async fn upkeep(
    plan: &HoursPlan,
    store: &super::Store,
    nodes: &mut [Node],
    restarted: &mut Option<usize>,
    journal: &Mutex<Journal>,
    rng: &mut ChaCha8Rng,
    now: u64,
) {
    let mut did = Vec::new();
    // Rare: a replica costs milliseconds of real time to build.
    if now > 0 && rng.gen_bool(0.05) {
        let i = rng.gen_range(0..nodes.len());
        nodes[i] = start_node(plan, store.shared.clone(), now).await;
        *restarted = Some(i);
        did.push(format!("restart {i}"));
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        // The replica's own resync runs every minute of its tokio time, which barely moves
        // here: the harness stands in for it.
        if node.lag_ms > MARGIN_MS / 2 || rng.gen_bool(0.2) {
            let ok = node.app.projection.sync_server_clock().await.is_ok();
            node.lag_ms = if ok { 0 } else { node.lag_ms };
            did.push(format!("anchor {i} {ok}"));
        }
        if rng.gen_bool(0.25) {
            let s = node.app.projection.sweep();
            did.push(format!("sweep {i} {s:?}"));
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
    if rng.gen_bool(0.2) {
        let i = rng.gen_range(0..nodes.len());
        let account = plan.base.accounts[rng.gen_range(0..plan.base.accounts.len())];
        let retain = match rng.gen_range(0..3) {
            0 => Duration::ZERO,
            1 => Duration::from_millis(rng.gen_range(0..plan.retention_ms())),
            _ => Duration::from_millis(plan.retention_ms()),
        };
        let r = nodes[i].app.projection.trim_account(account, retain).await;
        did.push(format!("trim {i} {account} keeping {retain:?}: {r:?}"));
    }
    if !did.is_empty() {
        journal
            .lock()
            .upkeep
            .push(format!("at {now} ms: {}", did.join(", ")));
    }
}

// --- The rules ---

/// One landing of a key: each leg's (account, balance, version), and when it committed
/// (simulated ms).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Landing {
    legs: Vec<(AccountId, i64, u64)>,
    at: u64,
}

/// Retries checked, by what the streams say their age was.
#[derive(Clone, Copy, Debug, Default)]
pub struct HoursStats {
    pub keys: usize,
    pub landings: usize,
    /// Retries inside the window that replayed (on a replica started after the write: cold).
    pub window_replays: usize,
    pub window_replays_cold: usize,
    /// Retries between the window and the retention that replayed.
    pub remembered_replays: usize,
    pub remembered_replays_cold: usize,
    /// Retries near the retention (either answer right).
    pub near_retention: usize,
    /// Retries past (or near) the retention that landed again.
    pub past_retention_landed: usize,
    pub retryable: usize,
}

/// The landings of every key: the i-th event of a key on each leg's account is its i-th
/// landing (legs of one landing commit together).
fn landings(journal: &Journal, truth: &Truth) -> Result<BTreeMap<u128, Vec<Landing>>, String> {
    let start = super::STORE_START_MS;
    let mut out = BTreeMap::new();
    for (key, landed) in &truth.by_key {
        let Some(op) = journal.ops.get(key) else {
            return Err(format!("an event for unknown key {key:x} is in the stream"));
        };
        let legs = op.legs();
        let per_leg: Vec<Vec<&super::Landed>> = legs
            .as_slice()
            .iter()
            .map(|leg| {
                landed
                    .iter()
                    .filter(|l| l.account == leg.account && l.event == leg.event)
                    .collect()
            })
            .collect();
        let n = per_leg[0].len();
        if per_leg.iter().any(|l| l.len() != n) || n * per_leg.len() != landed.len() {
            return Err(format!(
                "key {key:x} ({op:?}): its events are not whole landings (all legs each time): {landed:?}"
            ));
        }
        let mut list = Vec::with_capacity(n);
        for i in 0..n {
            let at = per_leg[0][i].at_ms;
            if per_leg.iter().any(|l| l[i].at_ms != at) {
                return Err(format!(
                    "key {key:x} ({op:?}): landing {i}'s legs committed apart: {landed:?}"
                ));
            }
            list.push(Landing {
                legs: per_leg
                    .iter()
                    .map(|l| (l[i].account, l[i].balance, l[i].version))
                    .collect(),
                at: at - start,
            });
        }
        out.insert(*key, list);
    }
    Ok(out)
}

/// How a key's send relates to its latest earlier landing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Never landed before: a new write.
    New,
    /// Landed within the retention: the same answer, nothing written.
    Replay,
    /// Near the retention: either.
    Either,
    /// Landed longer ago than the retention: a new write.
    Forgotten,
}

fn check_hours(plan: &HoursPlan, journal: &Journal, truth: &Truth) -> Result<HoursStats, String> {
    let landings = landings(journal, truth)?;
    let mut stats = HoursStats {
        keys: journal.ops.len(),
        landings: landings.values().map(Vec::len).sum(),
        ..HoursStats::default()
    };
    // In time order, so the first violation reported is the earliest.
    let mut moments: BTreeMap<(u64, u128), Vec<&Obs>> = BTreeMap::new();
    for o in &journal.obs {
        moments.entry((o.at, o.key)).or_default().push(o);
    }
    // A landing only at a moment its key was sent.
    for (key, list) in &landings {
        for l in list {
            if !moments.contains_key(&(l.at, *key)) {
                return Err(format!(
                    "key {key:x} landed at {} ms, a moment it was not sent at: {list:?}",
                    l.at
                ));
            }
        }
    }
    let faults = plan.base.faults.is_some();
    let retention = plan.retention_ms();
    let none = Vec::new();
    for (&(at, key), obs) in &moments {
        let op = journal.ops[&key];
        let list = landings.get(&key).unwrap_or(&none);
        let here: Vec<&Landing> = list.iter().filter(|l| l.at == at).collect();
        if here.len() > 1 {
            return Err(format!(
                "key {key:x} ({op:?}) landed {} times at {at} ms: {list:?}",
                here.len()
            ));
        }
        let new = here.first().copied();
        let prior = list.iter().rev().find(|l| l.at < at);
        let age = prior.map(|p| at - p.at);
        let expect = match age {
            None => Expect::New,
            Some(a) if a + MARGIN_MS <= retention => Expect::Replay,
            Some(a) if a >= retention + MARGIN_MS => Expect::Forgotten,
            Some(_) => Expect::Either,
        };
        let story = |what: &str, o: &Obs| {
            format!(
                "key {key:x} ({op:?}) sent at {at} ms{}{} to replica {}{} ({}): {what}; \
                 its landings (ms, legs): {list:?}",
                age.map_or(String::new(), |a| format!(
                    ", {a} ms after its landing (window {} ms, retention {retention} ms)",
                    plan.window_ms()
                )),
                o.retry
                    .map_or(String::new(), |b| format!(", a retry drawn {b:?}")),
                o.replica,
                if o.duplicate { " (a second copy)" } else { "" },
                if prior.is_some_and(|p| o.replica_started > p.at) {
                    "started after that landing: cold"
                } else {
                    "warm"
                },
            )
        };
        if expect == Expect::Replay
            && let Some(n) = new
        {
            return Err(story(
                &format!(
                    "inside the retention it wrote again, at version(s) {:?}",
                    n.legs
                ),
                obs[0],
            ));
        }
        let mut first_hand = 0;
        for o in obs {
            let cold = prior.is_some_and(|p| o.replica_started > p.at);
            match &o.seen {
                Seen::Ok { legs, replayed } => {
                    let is_new = new.is_some_and(|n| n.legs == *legs);
                    let is_prior = prior.is_some_and(|p| p.legs == *legs);
                    // Past the retention a retry is decided anew. But a retry whose held
                    // sequence meets its old landing on the store's own guard (a 2002 read
                    // back as ours) has the store's proof that it landed: it is answered
                    // from the account's state then, unmarked. Nothing lands twice, and the
                    // state is one the account had, at or past that landing.
                    let proven_old = new.is_none()
                        && !*replayed
                        && prior.is_some_and(|p| {
                            legs.len() == p.legs.len()
                                && legs.iter().zip(&p.legs).all(|(l, pl)| {
                                    l.0 == pl.0
                                        && l.2 >= pl.2
                                        && truth.accounts[&l.0].3.contains(&l.1)
                                })
                        });
                    let right = match expect {
                        Expect::Replay => is_prior && *replayed,
                        // Near the retention a replica that finds the old landing on its way
                        // may answer it as its own.
                        Expect::Either => is_new || is_prior || proven_old,
                        Expect::Forgotten => is_new || proven_old,
                        Expect::New => is_new,
                    };
                    if !right {
                        return Err(story(
                            &format!(
                                "it answered {legs:?} (replayed {replayed}), expected {}",
                                match expect {
                                    Expect::Replay => "its landing's answer, as a replay",
                                    Expect::Either => "its landing's or a new landing's",
                                    _ => "a new landing's answer",
                                }
                            ),
                            o,
                        ));
                    }
                    if !replayed {
                        first_hand += 1;
                    }
                    if is_prior && o.retry.is_some() {
                        match (age, expect) {
                            (_, Expect::Either) => stats.near_retention += 1,
                            (Some(a), _) if a < plan.window_ms() => {
                                stats.window_replays += 1;
                                stats.window_replays_cold += usize::from(cold);
                            }
                            _ => {
                                stats.remembered_replays += 1;
                                stats.remembered_replays_cold += usize::from(cold);
                            }
                        }
                    }
                }
                Seen::Refused { balance } => {
                    if expect == Expect::Replay {
                        return Err(story(
                            &format!("it was refused (balance {balance}) instead of replayed"),
                            o,
                        ));
                    }
                    let debit = op.legs().as_slice()[0];
                    let had = &truth.accounts[&debit.account].3;
                    if *balance >= debit.event.amount() || !had.contains(balance) {
                        return Err(story(
                            &format!(
                                "refused naming balance {balance}, which {} never had or which \
                                 covers {}; it had {had:?}",
                                debit.account,
                                debit.event.amount()
                            ),
                            o,
                        ));
                    }
                }
                Seen::Retryable(why) => {
                    stats.retryable += 1;
                    if !faults {
                        return Err(story(&format!("retryable with no faults on: {why}"), o));
                    }
                }
                Seen::Unexpected(e) => {
                    return Err(story(&format!("an unexpected error: {e}"), o));
                }
            }
        }
        if new.is_some() && prior.is_some() {
            stats.past_retention_landed += 1;
        }
        // Without faults nothing is ambiguous: a new landing is answered first-hand once.
        if !faults && new.is_some() && first_hand != 1 {
            return Err(story(
                &format!("{first_hand} answers not marked as replays, expected exactly 1"),
                obs[0],
            ));
        }
    }
    Ok(stats)
}

fn story(violation: String, journal: &Journal, truth: &Truth) -> String {
    let answers = journal.obs.iter().map(|o| format!("{o:?}"));
    super::tell_story(violation, &journal.upkeep, answers, truth)
}

fn trace_hash(journal: &Journal, truth: &Truth, faults: &FaultCounts) -> String {
    let obs = journal.obs.iter().map(|o| format!("{o:?}"));
    super::hash_trace(obs.chain(journal.upkeep.iter().cloned()), truth, faults)
}

impl HoursStats {
    pub fn add(&mut self, o: &HoursStats) {
        self.keys += o.keys;
        self.landings += o.landings;
        self.window_replays += o.window_replays;
        self.window_replays_cold += o.window_replays_cold;
        self.remembered_replays += o.remembered_replays;
        self.remembered_replays_cold += o.remembered_replays_cold;
        self.near_retention += o.near_retention;
        self.past_retention_landed += o.past_retention_landed;
        self.retryable += o.retryable;
    }
}
