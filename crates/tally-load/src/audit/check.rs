//! The exactly-once rules, pure: what each key's answers promise, held against the events
//! its accounts' histories carry.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::findings::{ExactlyOnce, Violation, ViolationKind};
use super::history::{HistoryEvent, Streams};
use crate::ledger::{Fate, KeyRecord};
use crate::op::OpKind;
use crate::workload::quote;

/// One event a key is expected to produce: account, type, counterparty.
struct ExpectedEvent {
    account: Uuid,
    kind: &'static str,
    counterparty: Option<Uuid>,
}

/// The key's events found in history, with the account each was found in.
type Found<'a> = [(Uuid, &'a HistoryEvent)];

/// What one key's answers and events came to.
struct KeyFindings {
    fate: Fate,
    /// An unknown key found whole in history.
    landed: bool,
    /// In the order the report lists them.
    violations: Vec<Violation>,
    /// Accounts worth re-reading: a leg looked lost or half-applied (replicas may lag).
    recheck: Vec<Uuid>,
}

/// Checks every key whose accounts were all read. Returns the findings (verdict not yet
/// set) and the accounts worth re-reading because a key looked lost or half-applied.
pub fn evaluate(records: &[KeyRecord], streams: &Streams) -> (ExactlyOnce, HashSet<Uuid>) {
    let mut found = ExactlyOnce::skipped();
    count_streams(&mut found, streams);
    let seen = events_by_record(records, streams);
    let mut unsettled = HashSet::new();
    for (i, record) in records.iter().enumerate() {
        let legs = expected_legs(record);
        if legs.is_empty() || !legs.iter().all(|l| streams.contains_key(&l.account)) {
            continue;
        }
        let events = seen.get(&i).map(Vec::as_slice).unwrap_or_default();
        let key = check_key(record, &legs, events);
        found.checked += 1;
        match key.fate {
            Fate::Succeeded => found.succeeded += 1,
            Fate::Rejected => found.rejected += 1,
            Fate::Unknown => found.unknown += 1,
        }
        found.unknown_landed += u64::from(key.landed);
        unsettled.extend(key.recheck);
        for violation in key.violations {
            found.note(violation);
        }
    }
    (found, unsettled)
}

/// Accounts and events read, and the events that are not this run's.
fn count_streams(found: &mut ExactlyOnce, streams: &Streams) {
    found.accounts_read = streams.len() as u64;
    for stream in streams.values() {
        found.events_read += stream.total;
        found.foreign_events += stream.total.saturating_sub(stream.ours.len() as u64);
    }
}

/// Each record's events (by its index in `records`), with the account each was found in.
fn events_by_record<'a>(
    records: &[KeyRecord],
    streams: &'a Streams,
) -> HashMap<usize, Vec<(Uuid, &'a HistoryEvent)>> {
    let index: HashMap<Uuid, usize> = records
        .iter()
        .enumerate()
        .map(|(i, r)| (r.key, i))
        .collect();
    let mut seen: HashMap<usize, Vec<(Uuid, &HistoryEvent)>> = HashMap::new();
    for (&account, stream) in streams {
        for event in &stream.ours {
            if let Some(&i) = event.key().and_then(|k| index.get(&k)) {
                seen.entry(i).or_default().push((account, event));
            }
        }
    }
    seen
}

/// The events `record`'s operation must leave: one for a deposit or a withdrawal, one in
/// each account for a transfer, none for a read.
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

/// Holds one key's `events` against its expected `legs` and its answers.
fn check_key(record: &KeyRecord, legs: &[ExpectedEvent], events: &Found) -> KeyFindings {
    let (counts, mut violations) = match_legs(record, legs, events);
    violations.extend(duplicates(record, legs, &counts));
    let fate = record.fate();
    let present = counts.iter().filter(|&&n| n > 0).count();
    let mut landed = false;
    let mut recheck = Vec::new();
    match fate {
        Fate::Succeeded => {
            for (leg, _) in legs.iter().zip(&counts).filter(|(_, n)| **n == 0) {
                recheck.push(leg.account);
                violations.push(lost(record, leg));
            }
        }
        Fate::Rejected if present > 0 => violations.push(phantom(record)),
        Fate::Rejected => {}
        Fate::Unknown if present == legs.len() => landed = true,
        Fate::Unknown if present > 0 => {
            recheck.extend(legs.iter().map(|l| l.account));
            violations.push(partial(record, present, legs.len()));
        }
        Fate::Unknown => {}
    }
    violations.extend(body_mismatch(record));
    KeyFindings {
        fate,
        landed,
        violations,
        recheck,
    }
}

/// How many times each leg appears among `events`, and a violation for every event that
/// matches no leg.
fn match_legs(
    record: &KeyRecord,
    legs: &[ExpectedEvent],
    events: &Found,
) -> (Vec<u32>, Vec<Violation>) {
    let mut counts = vec![0u32; legs.len()];
    let mut misapplied = Vec::new();
    for (account, event) in events {
        let leg = legs
            .iter()
            .position(|l| l.account == *account && l.kind == event.kind);
        let counterparty = event.counterparty();
        match leg {
            // The sign convention of debit amounts is the server's; compare magnitudes.
            Some(j)
                if event.amount_cents.unsigned_abs() == record.op.amount_cents.unsigned_abs()
                    && (counterparty.is_none() || counterparty == legs[j].counterparty) =>
            {
                counts[j] += 1;
            }
            _ => misapplied.push(violation(
                record,
                ViolationKind::Misapplied,
                format!(
                    "{:?} of {} expected; found {} of {} in {account} at version {}",
                    record.op.kind,
                    record.op.amount_cents,
                    event.kind,
                    event.amount_cents,
                    event.aggregate_version
                ),
            )),
        }
    }
    (counts, misapplied)
}

/// A violation for every leg that appears more than once.
fn duplicates(record: &KeyRecord, legs: &[ExpectedEvent], counts: &[u32]) -> Vec<Violation> {
    legs.iter()
        .zip(counts)
        .filter(|(_, n)| **n > 1)
        .map(|(leg, n)| {
            violation(
                record,
                ViolationKind::Duplicate,
                format!(
                    "{} appears {n} times in {} (answers {:?})",
                    leg.kind, leg.account, record.statuses
                ),
            )
        })
        .collect()
}

/// Answered 2xx, yet `leg` is not in history.
fn lost(record: &KeyRecord, leg: &ExpectedEvent) -> Violation {
    violation(
        record,
        ViolationKind::Lost,
        format!(
            "answered {:?} but no {} in {}",
            record.statuses, leg.kind, leg.account
        ),
    )
}

/// Answered only with a definitive 4xx, yet in history.
fn phantom(record: &KeyRecord) -> Violation {
    violation(
        record,
        ViolationKind::Phantom,
        format!("answered {:?} yet found in history", record.statuses),
    )
}

/// Never answered for sure, and only `present` of its `legs` legs in history.
fn partial(record: &KeyRecord, present: usize, legs: usize) -> Violation {
    violation(
        record,
        ViolationKind::Partial,
        format!(
            "answered {:?}; {present} of {legs} legs in history",
            record.statuses
        ),
    )
}

/// Two 2xx answers for the key whose bodies differ.
fn body_mismatch(record: &KeyRecord) -> Option<Violation> {
    let (Some(first), Some(other)) = (&record.first_ok_body, &record.mismatched_body) else {
        return None;
    };
    Some(violation(
        record,
        ViolationKind::BodyMismatch,
        format!("2xx bodies differ: {} vs {}", quote(first), quote(other)),
    ))
}

fn violation(record: &KeyRecord, kind: ViolationKind, detail: String) -> Violation {
    Violation {
        key: record.key,
        kind,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::history::StreamRead;
    use crate::http::Answer;
    use crate::op::Op;
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
