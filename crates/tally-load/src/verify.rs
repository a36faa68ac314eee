//! The exactly-once verifier: reads every touched account's full history (paged) and checks
//! each idempotency key against the answers the client saw.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::Method;
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio::time::Instant;
use uuid::Uuid;

use crate::cli::Config;
use crate::http::{Answer, Client, Target, exchange};
use crate::ledger::{Fate, KeyRecord};
use crate::workload::{OpKind, quote};

/// Events asked for per history page.
pub const HISTORY_PAGE_LIMIT: u32 = 500;
/// Most pages read per account before the read is declared runaway.
pub const MAX_HISTORY_PAGES: u32 = 10_000;
/// Attempts per history page on a retryable answer (409, 503, 5xx, no answer); each retry
/// goes to the next target, so a replica that is down does not leave the run unverified.
/// Enough that a replica answering 503 to a third of its reads (`--faults read-lag=0.3`)
/// leaves no page of thousands of accounts unread (5 did not).
pub const HISTORY_MAX_ATTEMPTS: u32 = 20;
/// Pause between history attempts, multiplied by the attempt number up to
/// [`HISTORY_BACKOFF_STEPS`]: at most about 20 s on one page.
pub const HISTORY_BACKOFF: Duration = Duration::from_millis(100);
pub const HISTORY_BACKOFF_STEPS: u32 = 20;
/// Re-reads of accounts where a key looked lost or half-applied (replicas may lag).
pub const SETTLE_ROUNDS: u32 = 5;
/// Pause before each settle round, multiplied by the round number.
pub const SETTLE_DELAY: Duration = Duration::from_millis(200);
/// Most accounts read at once.
pub const VERIFY_CONCURRENCY: usize = 32;
/// Hard ceiling on the whole verification.
pub const VERIFY_DEADLINE: Duration = Duration::from_secs(600);
/// Most violations listed in the report (all are counted).
pub const MAX_REPORTED_VIOLATIONS: usize = 50;

/// Overall result of the exactly-once check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every key checked out.
    Pass,
    /// At least one violation.
    Fail,
    /// Some history could not be read; no violation among what was read.
    Incomplete,
    /// `--verify false`.
    Skipped,
}

/// What went wrong for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// The key's event appears more than once in one leg's stream.
    Duplicate,
    /// Answered 2xx but missing from history.
    Lost,
    /// Answered only with a definitive 4xx, yet in history.
    Phantom,
    /// A transfer present in one leg's stream and absent from the other.
    Partial,
    /// The key's event has the wrong account, type, amount or counterparty.
    Misapplied,
    /// Two 2xx answers for the key carried different bodies.
    BodyMismatch,
}

/// One violation, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub key: Uuid,
    pub kind: ViolationKind,
    pub detail: String,
}

/// The verifier's findings.
#[derive(Debug, Clone, Serialize)]
pub struct ExactlyOnce {
    pub verdict: Verdict,
    /// Keys checked.
    pub checked: u64,
    /// Keys answered 2xx.
    pub succeeded: u64,
    /// Keys answered with a definitive 4xx only.
    pub rejected: u64,
    /// Keys answered only 409/503/5xx or not at all.
    pub unknown: u64,
    /// Unknown keys that turned out to have landed (once).
    pub unknown_landed: u64,
    pub accounts_read: u64,
    pub events_read: u64,
    /// Events whose eventId is not one of this run's keys (earlier runs, demo data).
    pub foreign_events: u64,
    pub violation_count: u64,
    /// The first violations, up to a fixed limit.
    pub violations: Vec<Violation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ExactlyOnce {
    /// The result when verification is turned off.
    pub fn skipped() -> Self {
        ExactlyOnce {
            verdict: Verdict::Skipped,
            checked: 0,
            succeeded: 0,
            rejected: 0,
            unknown: 0,
            unknown_landed: 0,
            accounts_read: 0,
            events_read: 0,
            foreign_events: 0,
            violation_count: 0,
            violations: Vec::new(),
            error: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HistoryPage {
    events: Vec<HistoryEvent>,
    next_from_version: Option<u64>,
}

/// One history event as the API returns it (fields the verifier needs; lenient so that an
/// unfamiliar event type does not stop the read).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEvent {
    pub aggregate_version: u64,
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub amount_cents: i64,
    #[serde(default)]
    pub to_account_id: Option<String>,
    #[serde(default)]
    pub from_account_id: Option<String>,
    #[serde(default)]
    pub event_id: Option<String>,
}

impl HistoryEvent {
    /// The idempotency key this event was written under, when it names one as a UUID.
    fn key(&self) -> Option<Uuid> {
        self.event_id
            .as_deref()
            .and_then(|id| Uuid::parse_str(id).ok())
    }

    /// The other account of a transfer leg, when given.
    fn counterparty(&self) -> Option<Uuid> {
        self.to_account_id
            .as_deref()
            .or(self.from_account_id.as_deref())
            .and_then(|id| Uuid::parse_str(id).ok())
    }
}

/// One account's history as read: only the events written under this run's keys are kept,
/// so long-lived accounts do not fill memory.
#[derive(Debug, Clone, Default)]
pub struct StreamRead {
    pub ours: Vec<HistoryEvent>,
    /// Every event in the stream, ours or not.
    pub total: u64,
}

/// Account streams read so far.
pub type Streams = HashMap<Uuid, StreamRead>;

/// Reads history for every account `records` touched and checks each key.
pub async fn verify(config: &Config, client: &Client, records: &[KeyRecord]) -> ExactlyOnce {
    let deadline = Instant::now() + VERIFY_DEADLINE;
    let accounts: BTreeSet<Uuid> = records
        .iter()
        .flat_map(|r| [Some(r.op.account), r.op.to])
        .flatten()
        .collect();
    let keys: Arc<HashSet<Uuid>> = Arc::new(records.iter().map(|r| r.key).collect());
    let (mut streams, mut error) = read_streams(
        config,
        client,
        &keys,
        accounts.into_iter().collect(),
        0,
        deadline,
    )
    .await;
    let mut round = 0;
    loop {
        let (mut found, unsettled) = evaluate(records, &streams);
        if unsettled.is_empty() || round >= SETTLE_ROUNDS || Instant::now() >= deadline {
            found.error = error;
            found.verdict = if found.violation_count > 0 {
                Verdict::Fail
            } else if found.error.is_some() {
                Verdict::Incomplete
            } else {
                Verdict::Pass
            };
            return found;
        }
        round += 1;
        tokio::time::sleep(SETTLE_DELAY * round).await;
        let (fresh, fresh_error) = read_streams(
            config,
            client,
            &keys,
            unsettled.into_iter().collect(),
            round as usize,
            deadline,
        )
        .await;
        streams.extend(fresh);
        error = error.or(fresh_error);
    }
}

/// Reads `accounts` concurrently, rotating targets by `round`; returns what was read and the
/// first error.
async fn read_streams(
    config: &Config,
    client: &Client,
    keys: &Arc<HashSet<Uuid>>,
    accounts: Vec<Uuid>,
    round: usize,
    deadline: Instant,
) -> (Streams, Option<String>) {
    let accounts = Arc::new(accounts);
    let next = Arc::new(AtomicUsize::new(0));
    let workers = VERIFY_CONCURRENCY
        .min(config.connections)
        .min(accounts.len())
        .max(1);
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let (accounts, next, keys) = (accounts.clone(), next.clone(), keys.clone());
        let (targets, client, timeout) = (config.targets.clone(), client.clone(), config.timeout);
        tasks.spawn(async move {
            let mut read = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&account) = accounts.get(i) else {
                    return (read, None);
                };
                let first = (i + round) % targets.len();
                let result = tokio::time::timeout_at(
                    deadline,
                    read_stream(&client, (&targets, first), account, &keys, timeout),
                )
                .await
                .unwrap_or_else(|_| Err("verification deadline reached".to_string()));
                match result {
                    Ok(events) => read.push((account, events)),
                    Err(e) => return (read, Some(e)),
                }
            }
        });
    }
    let mut streams = Streams::new();
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (read, error) = joined.unwrap_or_else(|e| (Vec::new(), Some(e.to_string())));
        streams.extend(read);
        first_error = first_error.or(error);
    }
    (streams, first_error)
}

/// One account's whole history, following `nextFromVersion` until it is absent; read from
/// `targets` starting at the given index, each page from the target that answered the last.
async fn read_stream(
    client: &Client,
    (targets, mut first): (&[Target], usize),
    account: Uuid,
    keys: &HashSet<Uuid>,
    timeout: Duration,
) -> Result<StreamRead, String> {
    let mut from = 0u64;
    let mut read = StreamRead::default();
    for _ in 0..MAX_HISTORY_PAGES {
        let path = format!(
            "/api/accounts/{account}/history?fromVersion={from}&limit={HISTORY_PAGE_LIMIT}"
        );
        let (answer, answered) = get_with_retries(client, (targets, first), &path, timeout).await?;
        first = answered;
        let page: HistoryPage = serde_json::from_slice(&answer.body).map_err(|e| {
            format!(
                "history of {account}: unexpected body ({e}): {}",
                quote(&answer.body)
            )
        })?;
        for event in page.events {
            // Pages start at `from`; anything below it was on an earlier page.
            if event.aggregate_version < from {
                continue;
            }
            read.total += 1;
            if event.key().is_some_and(|k| keys.contains(&k)) {
                read.ours.push(event);
            }
        }
        match page.next_from_version {
            None => return Ok(read),
            Some(next) if next > from => from = next,
            Some(next) => {
                return Err(format!(
                    "history of {account}: cursor did not advance ({from} -> {next})"
                ));
            }
        }
    }
    Err(format!(
        "history of {account}: more than {MAX_HISTORY_PAGES} pages"
    ))
}

/// GETs `path`, from `targets` starting at the given index and moving on to the next
/// target after each retryable answer; returns the answer and the index of the target that
/// gave it.
async fn get_with_retries(
    client: &Client,
    (targets, first): (&[Target], usize),
    path: &str,
    timeout: Duration,
) -> Result<(Answer, usize), String> {
    let mut last = String::new();
    for attempt in 1..=HISTORY_MAX_ATTEMPTS {
        let index = (first + attempt as usize - 1) % targets.len();
        let uri = targets[index].uri(path)?;
        match exchange(client, Method::GET, uri, None, None, timeout).await {
            Ok(a) if (200..300).contains(&a.status) => return Ok((a, index)),
            Ok(a) if a.status == 409 || a.status >= 500 => {
                last = format!("status {}: {}", a.status, quote(&a.body));
            }
            Ok(a) => {
                return Err(format!(
                    "GET {path}: status {}: {}",
                    a.status,
                    quote(&a.body)
                ));
            }
            Err(e) => last = format!("{}: {}", e.kind, e.detail),
        }
        tokio::time::sleep(HISTORY_BACKOFF * attempt.min(HISTORY_BACKOFF_STEPS)).await;
    }
    Err(format!(
        "GET {path}: gave up after {HISTORY_MAX_ATTEMPTS} attempts ({last})"
    ))
}

/// One event a key is expected to produce: account, type, counterparty.
struct ExpectedEvent {
    account: Uuid,
    kind: &'static str,
    counterparty: Option<Uuid>,
}

fn expected_legs(record: &KeyRecord) -> Vec<ExpectedEvent> {
    let op = &record.op;
    let single = |kind| {
        vec![ExpectedEvent {
            account: op.account,
            kind,
            counterparty: None,
        }]
    };
    match (op.kind, op.to) {
        (OpKind::Deposit, _) => single("Deposited"),
        (OpKind::Withdraw, _) => single("Withdrawn"),
        (OpKind::Transfer, Some(to)) => vec![
            ExpectedEvent {
                account: op.account,
                kind: "TransferredOut",
                counterparty: Some(to),
            },
            ExpectedEvent {
                account: to,
                kind: "TransferredIn",
                counterparty: Some(op.account),
            },
        ],
        (OpKind::Transfer, None) | (OpKind::Balance, _) => Vec::new(),
    }
}

/// Checks every key whose accounts were all read. Returns the findings (verdict not yet
/// set) and the accounts worth re-reading because a key looked lost or half-applied.
pub fn evaluate(records: &[KeyRecord], streams: &Streams) -> (ExactlyOnce, HashSet<Uuid>) {
    let index: HashMap<Uuid, usize> = records
        .iter()
        .enumerate()
        .map(|(i, r)| (r.key, i))
        .collect();
    let mut found = ExactlyOnce::skipped();
    found.accounts_read = streams.len() as u64;
    let mut seen: HashMap<usize, Vec<(Uuid, &HistoryEvent)>> = HashMap::new();
    for (&account, stream) in streams {
        found.events_read += stream.total;
        found.foreign_events += stream.total.saturating_sub(stream.ours.len() as u64);
        for event in &stream.ours {
            if let Some(&i) = event.key().and_then(|k| index.get(&k)) {
                seen.entry(i).or_default().push((account, event));
            }
        }
    }
    let mut unsettled = HashSet::new();
    let violate = |found: &mut ExactlyOnce, key, kind, detail: String| {
        found.violation_count += 1;
        if found.violations.len() < MAX_REPORTED_VIOLATIONS {
            found.violations.push(Violation { key, kind, detail });
        }
    };
    for (i, record) in records.iter().enumerate() {
        let legs = expected_legs(record);
        if legs.is_empty() || !legs.iter().all(|l| streams.contains_key(&l.account)) {
            continue;
        }
        found.checked += 1;
        let mut counts = vec![0u32; legs.len()];
        for (account, event) in seen.get(&i).map(Vec::as_slice).unwrap_or_default() {
            let leg = legs
                .iter()
                .position(|l| l.account == *account && l.kind == event.kind);
            let counterparty = event.counterparty();
            match leg {
                // The sign convention of debit amounts is the server's; compare magnitudes.
                Some(j)
                    if event.amount_cents.unsigned_abs()
                        == record.op.amount_cents.unsigned_abs()
                        && (counterparty.is_none() || counterparty == legs[j].counterparty) =>
                {
                    counts[j] += 1;
                }
                _ => violate(
                    &mut found,
                    record.key,
                    ViolationKind::Misapplied,
                    format!(
                        "{:?} of {} expected; found {} of {} in {account} at version {}",
                        record.op.kind,
                        record.op.amount_cents,
                        event.kind,
                        event.amount_cents,
                        event.aggregate_version
                    ),
                ),
            }
        }
        for (leg, &n) in legs.iter().zip(&counts) {
            if n > 1 {
                violate(
                    &mut found,
                    record.key,
                    ViolationKind::Duplicate,
                    format!(
                        "{} appears {n} times in {} (answers {:?})",
                        leg.kind, leg.account, record.statuses
                    ),
                );
            }
        }
        let present = counts.iter().filter(|&&n| n > 0).count();
        match record.fate() {
            Fate::Succeeded => {
                found.succeeded += 1;
                for (leg, _) in legs.iter().zip(&counts).filter(|(_, n)| **n == 0) {
                    unsettled.insert(leg.account);
                    violate(
                        &mut found,
                        record.key,
                        ViolationKind::Lost,
                        format!(
                            "answered {:?} but no {} in {}",
                            record.statuses, leg.kind, leg.account
                        ),
                    );
                }
            }
            Fate::Rejected => {
                found.rejected += 1;
                if present > 0 {
                    violate(
                        &mut found,
                        record.key,
                        ViolationKind::Phantom,
                        format!("answered {:?} yet found in history", record.statuses),
                    );
                }
            }
            Fate::Unknown => {
                found.unknown += 1;
                if present == legs.len() {
                    found.unknown_landed += 1;
                } else if present > 0 {
                    unsettled.extend(legs.iter().map(|l| l.account));
                    violate(
                        &mut found,
                        record.key,
                        ViolationKind::Partial,
                        format!(
                            "answered {:?}; {present} of {} legs in history",
                            record.statuses,
                            legs.len()
                        ),
                    );
                }
            }
        }
        if let (Some(first), Some(other)) = (&record.first_ok_body, &record.mismatched_body) {
            violate(
                &mut found,
                record.key,
                ViolationKind::BodyMismatch,
                format!("2xx bodies differ: {} vs {}", quote(first), quote(other)),
            );
        }
    }
    (found, unsettled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::Answer;
    use crate::workload::Op;
    use bytes::Bytes;

    fn ok(record: &mut KeyRecord, status: u16) {
        record.observe(&Ok(Answer {
            status,
            replayed: false,
            retry_after: None,
            body: Bytes::from_static(b"{}"),
        }));
    }

    fn event(version: u64, kind: &str, amount: i64, key: Uuid) -> HistoryEvent {
        HistoryEvent {
            aggregate_version: version,
            kind: kind.to_string(),
            amount_cents: amount,
            to_account_id: None,
            from_account_id: None,
            event_id: Some(key.to_string()),
        }
    }

    #[test]
    fn duplicate_lost_phantom_and_unknown() {
        let a = Uuid::from_u128(1);
        let mut dup = KeyRecord::new(Uuid::from_u128(10), Op::deposit(a, 5));
        ok(&mut dup, 200);
        let mut lost = KeyRecord::new(Uuid::from_u128(11), Op::deposit(a, 5));
        ok(&mut lost, 200);
        let mut phantom = KeyRecord::new(Uuid::from_u128(12), Op::deposit(a, 5));
        ok(&mut phantom, 422);
        let mut unknown = KeyRecord::new(Uuid::from_u128(13), Op::deposit(a, 5));
        ok(&mut unknown, 503);
        let streams = Streams::from([(
            a,
            StreamRead {
                ours: vec![
                    event(1, "Deposited", 5, dup.key),
                    event(2, "Deposited", 5, dup.key),
                    event(3, "Deposited", 5, phantom.key),
                    event(4, "Deposited", 5, unknown.key),
                ],
                total: 5,
            },
        )]);
        let (found, unsettled) = evaluate(&[dup, lost, phantom, unknown], &streams);
        let kinds: Vec<_> = found.violations.iter().map(|v| v.kind).collect();
        assert_eq!(
            kinds,
            [
                ViolationKind::Duplicate,
                ViolationKind::Lost,
                ViolationKind::Phantom
            ]
        );
        assert_eq!(
            (found.checked, found.unknown_landed, found.foreign_events),
            (4, 1, 1)
        );
        assert!(unsettled.contains(&a));
    }

    #[test]
    fn transfers_need_both_legs() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let transfer = || Op {
            kind: OpKind::Transfer,
            account: a,
            to: Some(b),
            amount_cents: 5,
        };
        let mut whole = KeyRecord::new(Uuid::from_u128(20), transfer());
        ok(&mut whole, 200);
        let mut half = KeyRecord::new(Uuid::from_u128(21), transfer());
        ok(&mut half, 409);
        let mut wrong = KeyRecord::new(Uuid::from_u128(22), Op::deposit(b, 5));
        ok(&mut wrong, 200);
        let leg = |v, kind: &str, other: Uuid, field_to: bool, key| {
            let mut e = event(v, kind, -5, key);
            let id = Some(other.to_string());
            if field_to {
                e.to_account_id = id;
            } else {
                e.from_account_id = id;
            }
            e
        };
        let streams = Streams::from([
            (
                a,
                StreamRead {
                    ours: vec![
                        leg(1, "TransferredOut", b, true, whole.key),
                        leg(2, "TransferredOut", b, true, half.key),
                    ],
                    total: 2,
                },
            ),
            (
                b,
                StreamRead {
                    ours: vec![
                        leg(1, "TransferredIn", a, false, whole.key),
                        event(2, "Deposited", 6, wrong.key),
                    ],
                    total: 2,
                },
            ),
        ]);
        let (found, unsettled) = evaluate(&[whole, half, wrong], &streams);
        let kinds: Vec<_> = found.violations.iter().map(|v| v.kind).collect();
        assert_eq!(
            kinds,
            [
                ViolationKind::Partial,
                ViolationKind::Misapplied,
                ViolationKind::Lost
            ]
        );
        assert_eq!(unsettled, HashSet::from([a, b]));
    }
}
