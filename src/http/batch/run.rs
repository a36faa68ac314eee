//! How a batch's items run: as units (an item alone, or a linked group whole), each after
//! the unit before it on each of its accounts, at most `--batch-items-in-flight` items at
//! once, every item through the one write loop and answered as its single route would be.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, watch};
use tracing::Instrument;

use super::super::answer::Shown;
use super::super::detach::Detached;
use super::super::error::{ApiError, ErrorCode};
use super::super::response::Resp;
use super::super::writes::{Admission, keyed_answer, run_write};
use super::result::ItemResult;
use super::{Prepared, Ready};
use crate::account::AccountId;
use crate::app::App;
use crate::auth::Caller;
use crate::request_note::RequestNote;
use crate::write_loop::{AnsweringAttempt, WriteError, WriteOutcome, WriteRequest};

/// The most items one linked group holds.
pub const MAX_GROUP_ITEMS: usize = 16;
/// The most accounts one linked group touches.
pub const MAX_GROUP_ACCOUNTS: usize = 16;
/// The longest name a linked group may have.
pub const MAX_GROUP_NAME: usize = 64;

/// A linked group's item as read: its place in the batch, and its write or refusal.
type Member = (usize, Result<Ready, ApiError>);

/// What runs as one: an item alone, or a linked group's items (in item order).
enum Unit {
    Alone(usize, Ready),
    Group(Vec<(usize, Ready)>),
}

impl Unit {
    fn items(&self) -> Vec<usize> {
        match self {
            Unit::Alone(i, _) => vec![*i],
            Unit::Group(items) => items.iter().map(|(i, _)| *i).collect(),
        }
    }

    fn accounts(&self) -> Vec<AccountId> {
        let mut seen = Vec::new();
        let each = |r: &Ready, seen: &mut Vec<AccountId>| {
            for leg in r.op.legs().as_slice() {
                if !seen.contains(&leg.account) {
                    seen.push(leg.account);
                }
            }
        };
        match self {
            Unit::Alone(_, r) => each(r, &mut seen),
            Unit::Group(items) => items.iter().for_each(|(_, r)| each(r, &mut seen)),
        }
        seen
    }
}

/// Runs the items and gives every item its result, in item order.
pub(super) async fn run_in_order(
    app: &Arc<App>,
    caller: Option<&Caller>,
    items: Vec<Prepared>,
) -> Vec<ItemResult> {
    let n = items.len();
    let mut results: Vec<Option<ItemResult>> = vec![None; n];
    let (units, refused) = units_of(items);
    for (i, e) in refused {
        results[i] = Some(ItemResult::of(e.into_response()).await);
    }
    // Each unit waits for the unit before it on each of its accounts.
    let mut last_on: HashMap<AccountId, usize, foldhash::fast::RandomState> =
        HashMap::with_capacity_and_hasher(units.len(), Default::default());
    let after: Vec<Vec<usize>> = units
        .iter()
        .enumerate()
        .map(|(u, unit)| {
            let mut deps: Vec<usize> = unit
                .accounts()
                .into_iter()
                .filter_map(|a| last_on.insert(a, u))
                .collect();
            deps.dedup();
            deps
        })
        .collect();
    // A unit says it is done only when a later unit waits for it: most units share no
    // account with another, and a channel each cost a tenth of an item's own write.
    let mut waited_for = vec![false; units.len()];
    for &d in after.iter().flatten() {
        waited_for[d] = true;
    }
    let done: Vec<Option<watch::Sender<bool>>> = waited_for
        .into_iter()
        .map(|w| w.then(|| watch::Sender::new(false)))
        .collect();
    let capacity = app.config.http.batch_items_in_flight;
    let in_flight = Semaphore::new(capacity);
    let runs = units.into_iter().enumerate().map(|(u, unit)| {
        let (after, done, in_flight) = (&after[u], &done, &in_flight);
        async move {
            for done in after.iter().filter_map(|&d| done[d].as_ref()) {
                // Never dropped while this batch runs: the wait ends when it is set.
                let _ = done.subscribe().wait_for(|d| *d).await;
            }
            let items = unit.items();
            let take = u32::try_from(items.len().min(capacity)).unwrap_or(1);
            let _permits = in_flight.acquire_many(take).await;
            let resps = match unit {
                Unit::Alone(_, ready) => vec![run_item(app, caller, ready).await],
                Unit::Group(members) => run_group(app, caller, members).await,
            };
            if let Some(done) = &done[u] {
                done.send_replace(true);
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, resp) in items.into_iter().zip(resps) {
                out.push((i, ItemResult::of(resp).await));
            }
            out
        }
    });
    for (i, result) in futures_util::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
    {
        results[i] = Some(result);
    }
    let results: Vec<ItemResult> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| internal("an item was never run")))
        .collect();
    count_classes(app, &results);
    results
}

/// Counts the items' results by status class: one counter update per class, not per item.
fn count_classes(app: &App, results: &[ItemResult]) {
    let mut counts: Vec<(&'static str, u64)> = Vec::new();
    for r in results {
        let class = r.class();
        match counts.iter_mut().find(|(c, _)| *c == class) {
            Some((_, n)) => *n += 1,
            None => counts.push((class, 1)),
        }
    }
    for (class, n) in counts {
        app.metrics
            .batch_item_results
            .with_label_values(&[class])
            .inc_by(n);
    }
}

/// The units to run, in the order of their first items, and the items refused before
/// anything runs: their own refusal, and a linked group's other items `LINKED_ITEM_FAILED`
/// (or all its items 400 when the group itself is malformed).
fn units_of(items: Vec<Prepared>) -> (Vec<Unit>, Vec<(usize, ApiError)>) {
    let mut refused = Vec::new();
    let mut groups: BTreeMap<usize, (String, Vec<Member>)> = BTreeMap::new();
    let mut first_of: HashMap<String, usize> = HashMap::new();
    let mut alone = Vec::new();
    for (i, Prepared { group, ready: item }) in items.into_iter().enumerate() {
        match group {
            Some(name) => {
                let first = *first_of.entry(name.clone()).or_insert(i);
                groups
                    .entry(first)
                    .or_insert_with(|| (name, Vec::new()))
                    .1
                    .push((i, item));
            }
            None => match item {
                Ok(ready) => alone.push((i, Unit::Alone(i, ready))),
                Err(e) => refused.push((i, e)),
            },
        }
    }
    for (first, (name, members)) in groups {
        match check_group(&name, &members) {
            Ok(()) => {
                let ready = members
                    .into_iter()
                    .filter_map(|(i, r)| r.ok().map(|r| (i, r)))
                    .collect();
                alone.push((first, Unit::Group(ready)));
            }
            Err(why) => {
                for (i, item) in members {
                    // An item refused on its own keeps its own refusal.
                    let own = item.err().filter(|_| why.is_item_failed());
                    refused.push((i, own.unwrap_or_else(|| why.error())));
                }
            }
        }
    }
    alone.sort_by_key(|(first, _)| *first);
    (alone.into_iter().map(|(_, u)| u).collect(), refused)
}

/// Why a linked group does not run.
enum GroupRefused {
    /// The group itself breaks a rule: every item of it gets this.
    Malformed(ApiError),
    /// An item of it was refused on its own: that item keeps its refusal, the others are
    /// `LINKED_ITEM_FAILED`.
    ItemFailed,
}

impl GroupRefused {
    fn is_item_failed(&self) -> bool {
        matches!(self, GroupRefused::ItemFailed)
    }

    fn error(&self) -> ApiError {
        match self {
            GroupRefused::Malformed(e) => e.clone(),
            GroupRefused::ItemFailed => WriteError::LinkedItemFailed.into(),
        }
    }
}

/// A group runs only whole: at most [`MAX_GROUP_ITEMS`] items on [`MAX_GROUP_ACCOUNTS`]
/// accounts, every key once, every item valid.
fn check_group(name: &str, members: &[Member]) -> Result<(), GroupRefused> {
    let shown = if name.len() <= MAX_GROUP_NAME {
        format!("{name:?}")
    } else {
        format!("of a {}-character name", name.len())
    };
    let bad = |why: String| {
        Err(GroupRefused::Malformed(ApiError::bad_request(
            ErrorCode::BadRequest,
            format!("linked group {shown}: {why}; nothing of it was written"),
        )))
    };
    if name.is_empty() || name.len() > MAX_GROUP_NAME {
        return bad(format!(
            "a group is named in 1 to {MAX_GROUP_NAME} characters"
        ));
    }
    if members.len() > MAX_GROUP_ITEMS {
        return bad(format!(
            "{} items, at most {MAX_GROUP_ITEMS}",
            members.len()
        ));
    }
    let ready: Vec<&Ready> = members
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .collect();
    let accounts: HashSet<AccountId> = ready
        .iter()
        .flat_map(|r| {
            r.op.legs()
                .as_slice()
                .iter()
                .map(|l| l.account)
                .collect::<Vec<_>>()
        })
        .collect();
    if accounts.len() > MAX_GROUP_ACCOUNTS {
        return bad(format!(
            "{} accounts, at most {MAX_GROUP_ACCOUNTS}",
            accounts.len()
        ));
    }
    let keys: HashSet<u128> = ready.iter().map(|r| r.key.event_id.as_u128()).collect();
    if keys.len() < ready.len() {
        return bad("a key appears twice in it".into());
    }
    if ready.len() < members.len() {
        return Err(GroupRefused::ItemFailed);
    }
    Ok(())
}

/// One item through the write loop, answered as its single route answers.
async fn run_item(app: &Arc<App>, caller: Option<&Caller>, ready: Ready) -> Resp {
    let started = Instant::now();
    let Ready { key, op, .. } = ready;
    let attempt = Arc::new(AnsweringAttempt::default());
    let request = WriteRequest {
        op,
        event_id: key.event_id.as_u128(),
    };
    // As long as a write may live: a batch admitted whole waits its turn rather than
    // refuse items a moment later.
    let wait = app.config.write().deadline;
    let answer = run_write(app, request, &attempt, Admission::BatchItem { wait }).await;
    let since = attempt
        .arrived()
        .map_or(Duration::ZERO, |a| a.elapsed())
        .max(started.elapsed());
    answered(app, caller, &key, &op, answer, since)
}

/// A linked group through the write loop as one run, each item answered as its single
/// route answers. Detached as a single write is: a client that hangs up does not cut the
/// group's store write short.
async fn run_group(
    app: &Arc<App>,
    caller: Option<&Caller>,
    members: Vec<(usize, Ready)>,
) -> Vec<Resp> {
    let started = Instant::now();
    let wait = app.config.write().deadline;
    let reqs: Vec<WriteRequest> = members
        .iter()
        .map(|(_, r)| WriteRequest {
            op: r.op,
            event_id: r.key.event_id.as_u128(),
        })
        .collect();
    let writes = app.writes.clone();
    let (span, note) = (
        tracing::Span::current(),
        RequestNote::current().unwrap_or_default(),
    );
    let run = Detached::new(
        note.scope(async move { writes.execute_linked(reqs, wait).await })
            .instrument(span),
    );
    let backstop = super::super::deadline::request_deadline(app) + wait;
    let answers: Vec<Result<WriteOutcome, WriteError>> = match tokio::time::timeout(backstop, run)
        .await
    {
        Ok(Ok(answers)) => answers,
        Ok(Err(_)) => members
            .iter()
            .map(|_| {
                Err(WriteError::Invariant {
                    what: "the linked group's write panicked".into(),
                })
            })
            .collect(),
        Err(_) => {
            app.metrics.write_answer_timeouts.inc();
            members
                .iter()
                .map(|_| {
                    Err(WriteError::Unverifiable {
                        reason: "no answer within the request's deadline; the group may still land"
                            .into(),
                    })
                })
                .collect()
        }
    };
    let since = started.elapsed();
    members
        .iter()
        .zip(answers)
        .map(|((_, r), answer)| answered(app, caller, &r.key, &r.op, answer, since))
        .collect()
}

/// An item's answer, with its key and horizons, as its single route gives it.
fn answered(
    app: &Arc<App>,
    caller: Option<&Caller>,
    key: &super::super::idempotency::IdempotencyKey,
    op: &crate::account::Operation,
    answer: Result<WriteOutcome, WriteError>,
    since: Duration,
) -> Resp {
    let accounts: Vec<_> = op.legs().as_slice().iter().map(|l| l.account).collect();
    let horizon = app.projection.key_horizon(&accounts);
    keyed_answer(app, key, answer, Shown::to(caller, op), (since, horizon))
}

/// A result for a state the batch's own logic rules out.
fn internal(what: &str) -> ItemResult {
    debug_assert!(false, "batch invariant broken: {what}");
    let body = serde_json::json!({ "error": "INTERNAL", "message": what });
    ItemResult {
        status: 500,
        body: serde_json::to_vec(&body).ok().map(bytes::Bytes::from),
        replayed: false,
        key: None,
        window: None,
        retention: None,
        retry_after: None,
    }
}
