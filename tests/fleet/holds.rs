//! Holds on real `tally` processes (`--holds true`) over the live Celeriant server named by
//! `CELERIANT_ADDRESS` (unset, skipped outside CI and a failure under `CI=true`).
//!
//! - A post on one replica races a void of the same hold on another, round after round from
//!   a seed: exactly one lands, the other is 409 `HOLD_RESOLVED` naming it, the winner's
//!   retries replay on both replicas, and the stream holds one resolution.
//! - A hold with a short expiry is expired once, by a replica's sweeper, and every replica
//!   then reads the same hold, balance and history; the expiry lands no earlier than the
//!   placement's server time plus the expiry.
//! - A fresh replica folds an account's open holds and held amount exactly, from the stream
//!   alone and from a checkpoint with events after it, and writes on what it folded.
//! - A replica with holds off on the same store refuses an account with holds (503
//!   `HOLDS_OFF`) for reads and writes, and writes nothing.
//!
//! Every wait polls a condition against a deadline. Account ids and keys are fresh per run:
//! the server is shared and durable.

use crate::aged_keys::Replica;
use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::remote::Remote;
use common::{Reply, assert_error, metric_sample, new_account};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::time::Instant;
use uuid::Uuid;

/// The races' seed; `TALLY_HOLDS_SEED` replays another run's.
const DEFAULT_SEED: u64 = 0x4564_6f6c_6473;
/// Post-against-void races, each on a fresh account and hold.
const RACE_ROUNDS: usize = 24;
/// Each race account's one deposit.
const RACE_FUNDS: i64 = 10_000;
/// How often a sweeper looks for due holds: often, so an expiry is seen soon after it is due.
const SWEEP_INTERVAL_MS: &str = "100";
/// Events past a checkpoint that call for the next one: low, so one account gets several.
const CHECKPOINT_EVERY_EVENTS: &str = "8";
/// The short expiry, in seconds.
const SHORT_EXPIRY_SECS: u64 = 2;
/// How long after its expiry a hold may take to read as expired on every replica.
const EXPIRY_BOUND: Duration = Duration::from_secs(20);
/// How long a checkpoint may take to be written once it is due.
const CHECKPOINT_BOUND: Duration = Duration::from_secs(20);
/// Pause between polls of a condition.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// The checkpoint writer's count of checkpoints written.
const CHECKPOINTS_WRITTEN: &str = r#"tally_checkpoint_writes_total{outcome="written"}"#;
/// A cold fold that started from a checkpoint.
const CHECKPOINT_USED: &str = r#"tally_checkpoint_loads_total{result="used"}"#;

/// The flags of a replica with holds on.
const HOLDS_ON: [&str; 6] = [
    "--holds",
    "true",
    "--hold-sweep-interval-ms",
    SWEEP_INTERVAL_MS,
    "--checkpoint-every-events",
    CHECKPOINT_EVERY_EVENTS,
];

/// A small seeded generator (splitmix64): a failing round replays from its seed.
struct Rng(u64);

impl Rng {
    fn from_env() -> Rng {
        let seed = std::env::var("TALLY_HOLDS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(DEFAULT_SEED);
        eprintln!("holds: seed {seed} (TALLY_HOLDS_SEED replays it)");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// From 1 to `n`.
    fn upto(&mut self, n: i64) -> i64 {
        1 + (self.next() % n as u64) as i64
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn new_key() -> String {
    Uuid::new_v4().to_string()
}

// --- The hold routes, on any replica ---------------------------------------------------------

async fn place(
    r: &Remote,
    account: &str,
    cents: i64,
    to: Option<&str>,
    expires_in_secs: Option<u64>,
    key: &str,
) -> Reply {
    let mut body = json!({ "amountCents": cents });
    if let Some(to) = to {
        body["toAccountId"] = json!(to);
    }
    if let Some(secs) = expires_in_secs {
        body["expiresInSecs"] = json!(secs);
    }
    r.post(&format!("/api/accounts/{account}/holds"), &body, key)
        .await
}

async fn post_hold(r: &Remote, account: &str, hold: &str, cents: Option<i64>, key: &str) -> Reply {
    let body = cents.map_or_else(|| json!({}), |c| json!({ "amountCents": c }));
    r.post(
        &format!("/api/accounts/{account}/holds/{hold}/post"),
        &body,
        key,
    )
    .await
}

async fn void_hold(r: &Remote, account: &str, hold: &str, key: &str) -> Reply {
    let path = format!("/api/accounts/{account}/holds/{hold}/void");
    r.post(&path, &json!({}), key).await
}

async fn get_hold(r: &Remote, account: &str, hold: &str) -> Reply {
    r.get(&format!("/api/accounts/{account}/holds/{hold}"))
        .await
}

/// The body of a read asserted 200.
async fn read_ok(r: &Remote, path: &str) -> Value {
    let reply = r.get(path).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "{path} on {}: {}",
        r.base,
        reply.text
    );
    reply.body
}

/// The account's open holds and amounts.
async fn open_holds(r: &Remote, account: &str) -> Value {
    read_ok(r, &format!("/api/accounts/{account}/holds")).await
}

/// The balance read's body.
async fn balance_read(r: &Remote, account: &str) -> Value {
    read_ok(r, &format!("/api/accounts/{account}/balance")).await
}

/// Places a hold and asserts the 201: its id is its key.
async fn placed(
    r: &Remote,
    account: &str,
    cents: i64,
    to: Option<&str>,
    expires_in_secs: Option<u64>,
) -> String {
    let key = new_key();
    let reply = place(r, account, cents, to, expires_in_secs, &key).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text);
    assert_eq!(reply.body["holdId"], key.as_str(), "a hold's id is its key");
    assert_eq!(reply.body["status"], "open", "{}", reply.text);
    key
}

/// A fresh account holding one deposit of `cents` made on `r`.
async fn funded(r: &Remote, cents: i64) -> String {
    let account = new_account();
    let reply = r.deposit(&account, cents, &new_key()).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    account
}

/// Asserts that `retry` is `original` replayed: same status and body, marked replayed.
#[track_caller]
fn assert_replayed(original: &Reply, retry: &Reply, on: &str) {
    assert_eq!(
        (retry.status, &retry.body),
        (original.status, &original.body),
        "a retry on {on} gets the original answer: {}",
        retry.text
    );
    assert!(
        retry.replayed(),
        "marked replayed on {on}: {:?}",
        retry.headers
    );
}

/// The resolution events (posted, voided, expired) of `hold` in a history.
fn resolutions<'a>(history: &'a [Value], hold: &str) -> Vec<&'a Value> {
    history
        .iter()
        .filter(|e| e["holdId"] == hold && e["type"] != "HoldPlaced")
        .collect()
}

/// The one event of `kind` naming `hold`.
#[track_caller]
fn event_of<'a>(history: &'a [Value], hold: &str, kind: &str) -> &'a Value {
    let found: Vec<&Value> = history
        .iter()
        .filter(|e| e["holdId"] == hold && e["type"] == kind)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} of {hold}: {history:#?}");
    found[0]
}

/// Asserts every replica reads the same history of `account`, and returns it.
async fn same_history(replicas: &[&Replica], account: &str) -> Vec<Value> {
    let first = replicas[0].history(account).await;
    for r in &replicas[1..] {
        assert_eq!(
            r.history(account).await,
            first,
            "{} reads the history {} reads",
            r.name,
            replicas[0].name
        );
    }
    first
}

/// Polls `series` on `r` until it reaches `at_least`, within `bound`.
async fn wait_for_metric(r: &Replica, series: &str, at_least: f64, bound: Duration) {
    let deadline = Instant::now() + bound;
    loop {
        let value = metric_sample(&r.metrics().await, series);
        if value >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{series} on {} is {value}, not {at_least}, after {bound:?}",
            r.name
        );
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

// --- Scenario (a): a post races a void ------------------------------------------------------

/// The request that landed in one race, kept to check its retries.
struct Won {
    how: &'static str,
    reply: Reply,
    key: String,
    posted: i64,
}

/// Rule: a post on one replica racing a void of the same hold on another resolves it once.
/// One gets 200, the other 409 `HOLD_RESOLVED` naming the winner; the winner's retries
/// replay on both replicas; the stream holds exactly one resolution; the money moved once.
async fn post_races_void(a: &Replica, b: &Replica, rng: &mut Rng) {
    let mut wins: BTreeMap<&str, usize> = BTreeMap::new();
    for round in 0..RACE_ROUNDS {
        let account = funded(a, RACE_FUNDS).await;
        let to = rng.coin().then(new_account);
        let held = rng.upto(RACE_FUNDS);
        let hold = placed(a, &account, held, to.as_deref(), None).await;
        // Both replicas fold the hold first, so they race on the resolution itself.
        for r in [a, b] {
            let open = get_hold(r, &account, &hold).await;
            assert_eq!(open.body["status"], "open", "round {round}: {}", open.text);
        }
        let (poster, voider) = if rng.coin() { (a, b) } else { (b, a) };
        let asked = rng.coin().then(|| rng.upto(held));
        let (pk, vk) = (new_key(), new_key());
        let (p, v) = tokio::join!(
            post_hold(poster, &account, &hold, asked, &pk),
            void_hold(voider, &account, &hold, &vk),
        );
        let (won, lost) = match (p.status.as_u16(), v.status.as_u16()) {
            (200, 409) => {
                let posted = asked.unwrap_or(held);
                assert_eq!(p.body["amountCents"], posted, "round {round}: {}", p.text);
                let lost = (voider, v, vk.clone());
                (
                    Won {
                        how: "posted",
                        reply: p,
                        key: pk,
                        posted,
                    },
                    lost,
                )
            }
            (409, 200) => {
                let lost = (poster, p, pk.clone());
                (
                    Won {
                        how: "voided",
                        reply: v,
                        key: vk,
                        posted: 0,
                    },
                    lost,
                )
            }
            _ => panic!(
                "round {round}: exactly one of a post and a void lands:\npost on {}: {}\nvoid on {}: {}",
                poster.name, p.text, voider.name, v.text
            ),
        };
        *wins.entry(won.how).or_default() += 1;
        let (loser, lost, lost_key) = lost;
        assert_error(&lost, 409, "HOLD_RESOLVED");
        assert_eq!(
            lost.body["resolution"], won.how,
            "round {round}: the loser on {} names the winner: {}",
            loser.name, lost.text
        );
        assert_eq!(
            won.reply.body["status"], won.how,
            "round {round}: {}",
            won.reply.text
        );
        assert!(
            !won.reply.replayed(),
            "round {round}: the winner is no replay"
        );
        let balance = RACE_FUNDS - won.posted;
        assert_eq!(won.reply.body["balanceCents"], balance, "round {round}");

        // The winner's retries replay on both replicas; the loser's stay refused.
        for r in [a, b] {
            let retry = match won.how {
                "posted" => post_hold(r, &account, &hold, asked, &won.key).await,
                _ => void_hold(r, &account, &hold, &won.key).await,
            };
            assert_replayed(&won.reply, &retry, r.name);
            let again = match won.how {
                "posted" => void_hold(r, &account, &hold, &lost_key).await,
                _ => post_hold(r, &account, &hold, asked, &lost_key).await,
            };
            assert_error(&again, 409, "HOLD_RESOLVED");
            assert_eq!(
                again.body["resolution"], won.how,
                "round {round}: {}",
                again.text
            );
        }

        // One resolution in the stream, read the same on both replicas.
        let history = same_history(&[a, b], &account).await;
        let resolved = resolutions(&history, &hold);
        let kind = if won.how == "posted" {
            "HoldPosted"
        } else {
            "HoldVoided"
        };
        assert_eq!(
            resolved.len(),
            1,
            "round {round}: one resolution: {history:#?}"
        );
        assert_eq!(resolved[0]["type"], kind, "round {round}");
        assert_eq!(resolved[0]["eventId"], won.key.as_str(), "round {round}");
        assert_eq!(history.len(), 3, "round {round}: deposit, hold, resolution");
        for r in [a, b] {
            let read = balance_read(r, &account).await;
            assert_eq!(
                read,
                json!({
                    "balanceCents": balance, "aggregateVersion": 3,
                    "availableCents": balance, "heldCents": 0,
                }),
                "round {round} on {}",
                r.name
            );
            let shown = get_hold(r, &account, &hold).await;
            assert_eq!(
                shown.body["status"], won.how,
                "round {round}: {}",
                shown.text
            );
            if let Some(to) = &to {
                let (cents, _) = r.balance(to).await;
                assert_eq!(
                    cents, won.posted,
                    "round {round}: the destination got the post"
                );
            }
        }
    }
    eprintln!("holds: {RACE_ROUNDS} post-void races won: {wins:?}");
}

// --- Scenario (b): an expiry is seen by every replica ---------------------------------------

/// Rule: a hold past its expiry is expired once, and then every replica reads the same
/// hold, balance, open holds and history. The expiry's server time is no earlier than the
/// placement's plus the expiry; a hold without expiry stays open.
async fn expiry_seen_everywhere(replicas: [&Replica; 3]) {
    let [a, ..] = replicas;
    let account = funded(a, 5_000).await;
    let short = placed(a, &account, 1_200, None, Some(SHORT_EXPIRY_SECS)).await;
    let lasting = placed(a, &account, 300, None, None).await;
    // Every replica holds the account, so each one's sweeper covers it.
    for r in replicas {
        let read = get_hold(r, &account, &short).await;
        assert_eq!(read.status, StatusCode::OK, "on {}: {}", r.name, read.text);
    }
    let deadline = Instant::now() + Duration::from_secs(SHORT_EXPIRY_SECS) + EXPIRY_BOUND;
    for r in replicas {
        loop {
            let read = get_hold(r, &account, &short).await;
            match read.body["status"].as_str() {
                Some("expired") => break,
                Some("open") => {}
                _ => panic!("the hold on {} is open or expired: {}", r.name, read.text),
            }
            assert!(
                Instant::now() < deadline,
                "not expired on {} in time",
                r.name
            );
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    }

    let history = same_history(&replicas, &account).await;
    let at = |e: &Value| e["timestamp"].as_u64().expect("a server timestamp");
    let placed_at = at(event_of(&history, &short, "HoldPlaced"));
    let due_at = placed_at + SHORT_EXPIRY_SECS * 1000;
    let expired = event_of(&history, &short, "HoldExpired");
    assert!(
        at(expired) >= due_at,
        "expired at {} in server time, before its due time {due_at}",
        at(expired)
    );
    assert_eq!(resolutions(&history, &short).len(), 1, "{history:#?}");
    assert!(resolutions(&history, &lasting).is_empty(), "{history:#?}");
    assert_eq!(
        history.len(),
        4,
        "deposit, two holds, one expiry: {history:#?}"
    );

    let mut shown: Option<Value> = None;
    for r in replicas {
        let mut read = get_hold(r, &account, &short).await.body;
        // The placing replica may know only a lower bound of the placement's time; any
        // replica that states the expiry states the one the stream fixes.
        if let Some(expires_at) = read.as_object_mut().and_then(|o| o.remove("expiresAt")) {
            assert_eq!(expires_at, due_at, "expiresAt on {}", r.name);
        }
        match &shown {
            None => shown = Some(read),
            Some(first) => assert_eq!(&read, first, "the hold on {}", r.name),
        }
        assert_eq!(
            balance_read(r, &account).await,
            json!({
                "balanceCents": 5_000, "aggregateVersion": 4,
                "availableCents": 4_700, "heldCents": 300,
            }),
            "balance on {}",
            r.name
        );
        let open = open_holds(r, &account).await;
        let ids: Vec<&Value> = open["holds"].as_array().expect("holds").iter().collect();
        assert_eq!(ids.len(), 1, "on {}: {open}", r.name);
        assert_eq!(ids[0]["holdId"], lasting.as_str(), "on {}", r.name);
        let late = post_hold(r, &account, &short, None, &new_key()).await;
        assert_error(&late, 409, "HOLD_RESOLVED");
        assert_eq!(late.body["resolution"], "expired", "{}", late.text);
    }
    assert_eq!(shown.expect("three replicas")["status"], "expired");
}

// --- Scenarios (c) and (d): a fresh replica, and one with holds off -------------------------

/// What the test expects of one account's holds.
#[derive(Default)]
struct Book {
    balance: i64,
    /// Open holds: id → the hold as listed (expiresAt aside).
    open: BTreeMap<String, Value>,
}

impl Book {
    fn held(&self) -> i64 {
        self.open
            .values()
            .map(|h| h["amountCents"].as_i64().unwrap_or(0))
            .sum()
    }
}

/// One account's writes on A, tracked in a [`Book`].
struct Ledger<'a> {
    on: &'a Replica,
    account: String,
    version: u64,
    book: Book,
}

impl<'a> Ledger<'a> {
    async fn open(on: &'a Replica, cents: i64) -> Ledger<'a> {
        let account = funded(on, cents).await;
        Ledger {
            on,
            account,
            version: 1,
            book: Book {
                balance: cents,
                ..Book::default()
            },
        }
    }

    async fn place(&mut self, cents: i64, to: Option<&str>, expires: Option<u64>) -> String {
        let hold = placed(self.on, &self.account, cents, to, expires).await;
        self.version += 1;
        let mut listed = json!({
            "holdId": hold, "accountId": self.account, "status": "open",
            "amountCents": cents, "placedVersion": self.version,
        });
        if let Some(to) = to {
            listed["toAccountId"] = json!(to);
        }
        if let Some(secs) = expires {
            listed["expiresInSecs"] = json!(secs);
        }
        self.book.open.insert(hold.clone(), listed);
        hold
    }

    /// Posts `cents` of the hold, or all of it; returns the amount posted and its payee.
    async fn post(&mut self, hold: &str, cents: Option<i64>) -> (i64, Option<String>) {
        let r = post_hold(self.on, &self.account, hold, cents, &new_key()).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        let was = self.book.open.remove(hold).expect("an open hold");
        let posted = cents.unwrap_or_else(|| was["amountCents"].as_i64().unwrap_or(0));
        self.book.balance -= posted;
        self.version += 1;
        (posted, was["toAccountId"].as_str().map(str::to_owned))
    }

    async fn void(&mut self, hold: &str) {
        let r = void_hold(self.on, &self.account, hold, &new_key()).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        self.book.open.remove(hold).expect("an open hold");
        self.version += 1;
    }

    /// Asserts `r` lists exactly the open holds and amounts the book expects.
    async fn assert_folded(&self, r: &Replica) {
        let mut listed = open_holds(r, &self.account).await;
        let mut holds: BTreeMap<String, Value> = BTreeMap::new();
        for mut h in listed["holds"]
            .take()
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            h.as_object_mut().map(|o| o.remove("expiresAt"));
            holds.insert(h["holdId"].as_str().unwrap_or("").to_owned(), h);
        }
        assert_eq!(
            holds, self.book.open,
            "open holds of {} on {}",
            self.account, r.name
        );
        let (balance, held) = (self.book.balance, self.book.held());
        assert_eq!(
            listed,
            json!({
                "accountId": self.account, "holds": null, "heldCents": held,
                "balanceCents": balance, "availableCents": balance - held,
                "aggregateVersion": self.version,
            }),
            "amounts of {} on {}",
            self.account,
            r.name
        );
        assert_eq!(
            balance_read(r, &self.account).await,
            json!({
                "balanceCents": balance, "aggregateVersion": self.version,
                "availableCents": balance - held, "heldCents": held,
            }),
            "balance of {} on {}",
            self.account,
            r.name
        );
    }
}

/// Places `n` holds on `l` with amounts from `rng`, some paying `payee` when posted, some
/// with a distant expiry.
async fn mixed_holds(l: &mut Ledger<'_>, n: usize, payee: &str, rng: &mut Rng) -> Vec<String> {
    let mut holds = Vec::new();
    for _ in 0..n {
        let to = rng.coin().then_some(payee);
        let expires = rng.coin().then_some(3_600);
        holds.push(l.place(rng.upto(900), to, expires).await);
    }
    holds
}

/// Rule: a fresh replica folds open holds and the held amount exactly: an account folded
/// from its stream alone, and one folded from a checkpoint that carries open holds with
/// posts, voids and placements after it. It then writes on what it folded.
async fn fresh_replica_folds_holds(a: &Replica, celeriant: &str, rng: &mut Rng) -> String {
    let payee = funded(a, 1).await;
    let mut paid = 1;
    let mut pay = |(cents, to): (i64, Option<String>)| {
        if to.as_deref() == Some(payee.as_str()) {
            paid += cents;
        }
    };

    // Below the checkpoint threshold: folded from the stream alone.
    let mut short = Ledger::open(a, 10_000).await;
    let holds = mixed_holds(&mut short, 3, &payee, rng).await;
    pay(short.post(&holds[0], Some(1)).await);
    short.void(&holds[1]).await;

    // Past it: a checkpoint with open holds, then posts, voids and placements after it.
    let written = metric_sample(&a.metrics().await, CHECKPOINTS_WRITTEN);
    let mut long = Ledger::open(a, 100_000).await;
    let holds = mixed_holds(&mut long, 12, &payee, rng).await;
    // The next checkpoint is spaced a quarter window later: the resolutions and placements
    // below all lie past this one, and a cold fold applies them to the holds it carries.
    wait_for_metric(a, CHECKPOINTS_WRITTEN, written + 1.0, CHECKPOINT_BOUND).await;
    for (i, hold) in holds.iter().enumerate().take(6) {
        let amount = long.book.open[hold]["amountCents"].as_i64().unwrap_or(0);
        match i % 3 {
            0 => pay(long.post(hold, None).await),
            1 => pay(long.post(hold, Some(1 + amount / 2)).await),
            _ => long.void(hold).await,
        }
    }
    let more = mixed_holds(&mut long, 3, &payee, rng).await;
    long.void(&more[0]).await;
    pay(long.post(&holds[6], None).await);

    let c = Replica::start_with("C", celeriant, &HOLDS_ON).await;
    let before = c.metrics().await;
    long.assert_folded(&c).await;
    let used = metric_sample(&c.metrics().await, CHECKPOINT_USED)
        - metric_sample(&before, CHECKPOINT_USED);
    assert_eq!(
        used, 1.0,
        "C's cold fold of the long account started from a checkpoint"
    );
    short.assert_folded(&c).await;
    long.assert_folded(a).await;
    short.assert_folded(a).await;
    for r in [a, &c] {
        assert_eq!(
            r.balance(&payee).await.0,
            paid,
            "the payee's balance on {}",
            r.name
        );
    }

    // C writes on its fold: a hold over the available amount is refused with it, one within
    // it lands, and a resolved hold stays resolved.
    let available = long.book.balance - long.book.held();
    let over = place(&c, &long.account, available + 1, None, None, &new_key()).await;
    assert_error(&over, 422, "INSUFFICIENT_FUNDS");
    assert_eq!(over.body["availableCents"], available, "{}", over.text);
    assert_eq!(over.body["heldCents"], long.book.held(), "{}", over.text);
    let voided = void_hold(&c, &long.account, &holds[2], &new_key()).await;
    assert_error(&voided, 409, "HOLD_RESOLVED");
    assert_eq!(voided.body["resolution"], "voided", "{}", voided.text);
    let mut on_c = Ledger { on: &c, ..long };
    let last = on_c.place(available, None, None).await;
    on_c.post(&last, None).await;
    on_c.assert_folded(&c).await;
    on_c.assert_folded(a).await;
    on_c.account
}

/// Rule: a replica with holds off on the same store refuses an account whose stream holds a
/// hold event, for reads and writes alike (503 `HOLDS_OFF`), and writes nothing; an account
/// without holds it serves as ever.
async fn holds_off_replica_refuses(a: &Replica, celeriant: &str, account: &str) {
    let d = Replica::start_with("D", celeriant, &[]).await;
    let before = a.history(account).await;
    let plain = funded(&d, 700).await;
    assert_eq!(
        d.balance(&plain).await,
        (700, 1),
        "D serves an account without holds"
    );
    let hold = before
        .iter()
        .find_map(|e| {
            (e["type"] == "HoldPlaced").then(|| e["holdId"].as_str().unwrap_or("").to_owned())
        })
        .expect("a hold in the stream");
    let path = |tail: &str| format!("/api/accounts/{account}{tail}");
    let answers = [
        ("balance", d.get(&path("/balance")).await),
        ("deposit", d.deposit(account, 5, &new_key()).await),
        ("withdraw", d.withdraw(account, 5, &new_key()).await),
        ("transfer", d.transfer(account, &plain, 5, &new_key()).await),
        ("place", place(&d, account, 5, None, None, &new_key()).await),
        ("void", void_hold(&d, account, &hold, &new_key()).await),
        ("list", d.get(&path("/holds")).await),
    ];
    for (what, r) in &answers {
        assert_eq!(r.status.as_u16(), 503, "{what} on D: {}", r.text);
        assert_eq!(r.error_code(), "HOLDS_OFF", "{what} on D: {}", r.text);
    }
    assert_eq!(
        a.history(account).await,
        before,
        "D wrote nothing to the account"
    );
    assert_eq!(
        d.balance(&plain).await,
        (700, 1),
        "nor to the other account"
    );
}

// --- The tests -------------------------------------------------------------------------------

/// Scenario (a) on replicas A and B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_racing_a_void_on_another_replica_resolves_the_hold_once() {
    let Some(celeriant) = common::required::celeriant_address() else {
        return;
    };
    let (a, b) = tokio::join!(
        Replica::start_with("A", &celeriant, &HOLDS_ON),
        Replica::start_with("B", &celeriant, &HOLDS_ON),
    );
    post_races_void(&a, &b, &mut Rng::from_env()).await;
}

/// Scenario (b) on replicas A, B and C.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiry_is_seen_by_every_replica_no_earlier_than_its_time() {
    let Some(celeriant) = common::required::celeriant_address() else {
        return;
    };
    let (a, b, c) = tokio::join!(
        Replica::start_with("A", &celeriant, &HOLDS_ON),
        Replica::start_with("B", &celeriant, &HOLDS_ON),
        Replica::start_with("C", &celeriant, &HOLDS_ON),
    );
    expiry_seen_everywhere([&a, &b, &c]).await;
}

/// Scenarios (c) and (d): replica A writes; C starts fresh after, and D with holds off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_replica_folds_them_exactly_and_one_with_holds_off_refuses_them() {
    let Some(celeriant) = common::required::celeriant_address() else {
        return;
    };
    let a = Replica::start_with("A", &celeriant, &HOLDS_ON).await;
    let mut rng = Rng::from_env();
    let account = fresh_replica_folds_holds(&a, &celeriant, &mut rng).await;
    holds_off_replica_refuses(&a, &celeriant, &account).await;
}
