//! The device outbox: identity kept once, sequences assigned with the event in one
//! transaction and never renumbered, run boundaries persisted until marked synced.

use crate::OutboxDir;
use tally::account::{AccountId, AmountCents, Operation};
use tally_device::crash::{CrashPoint, Crashed, Hooks, NoHooks};
use tally_device::outbox::{Kind, Outbox, OutboxError};

fn acct(n: u128) -> AccountId {
    AccountId(uuid::Uuid::from_u128(n))
}

fn deposit(account: AccountId, cents: i64) -> Operation {
    Operation::Deposit {
        account,
        amount: AmountCents::new(cents).unwrap(),
    }
}

fn withdraw(account: AccountId, cents: i64) -> Operation {
    Operation::Withdraw {
        account,
        amount: AmountCents::new(cents).unwrap(),
    }
}

/// Crashes at one step.
struct CrashAt(CrashPoint);

impl Hooks for CrashAt {
    fn at(&mut self, step: CrashPoint) -> Result<(), Crashed> {
        if step == self.0 {
            return Err(Crashed(step));
        }
        Ok(())
    }
}

#[test]
fn the_device_identity_is_generated_once_and_kept() {
    let dir = OutboxDir::new("outbox", "identity");
    assert!(matches!(
        Outbox::open(&dir.file()),
        Err(OutboxError::NotInitialised(_))
    ));
    let (outbox, created) = Outbox::init(&dir.file(), 1).unwrap();
    assert!(created);
    let id = outbox.device_id();
    drop(outbox);
    let (again, created) = Outbox::init(&dir.file(), 2).unwrap();
    assert!(!created, "init on an existing outbox creates nothing");
    assert_eq!(again.device_id(), id);
    assert_eq!(Outbox::open(&dir.file()).unwrap().device_id(), id);
    let other = OutboxDir::new("outbox", "identity-other");
    let (fresh, _) = Outbox::init(&other.file(), 1).unwrap();
    assert_ne!(fresh.device_id(), id, "each device has its own client id");
}

#[test]
fn a_foreign_sqlite_file_is_not_taken_for_an_outbox() {
    let dir = OutboxDir::new("outbox", "foreign");
    let conn = rusqlite::Connection::open(dir.file()).unwrap();
    conn.execute_batch("CREATE TABLE notes (x TEXT);").unwrap();
    drop(conn);
    assert!(matches!(
        Outbox::init(&dir.file(), 1),
        Err(OutboxError::Foreign(..))
    ));
    assert!(Outbox::open(&dir.file()).is_err());
}

#[test]
fn sequences_are_per_account_and_survive_a_reopen() {
    let dir = OutboxDir::new("outbox", "seqs");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let (a, b) = (acct(1), acct(2));
    let seqs: Vec<u64> = [deposit(a, 1), deposit(b, 2), withdraw(a, 3), deposit(a, 4)]
        .into_iter()
        .map(|op| outbox.record(op, 10, &mut NoHooks).unwrap().client_seq)
        .collect();
    assert_eq!(seqs, vec![1, 1, 2, 3]);
    drop(outbox);
    let mut outbox = Outbox::open(&dir.file()).unwrap();
    let events = outbox.events(a).unwrap();
    let view: Vec<(u64, Kind, i64)> = events
        .iter()
        .map(|e| (e.client_seq, e.kind, e.amount_cents))
        .collect();
    assert_eq!(
        view,
        vec![
            (1, Kind::Deposit, 1),
            (2, Kind::Withdraw, 3),
            (3, Kind::Deposit, 4)
        ]
    );
    assert_eq!(
        outbox
            .record(deposit(b, 5), 11, &mut NoHooks)
            .unwrap()
            .client_seq,
        2
    );
}

#[test]
fn a_crash_before_commit_records_nothing_and_after_commit_keeps_the_event() {
    let dir = OutboxDir::new("outbox", "record-crash");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let a = acct(1);
    let err = outbox
        .record(
            deposit(a, 7),
            1,
            &mut CrashAt(CrashPoint::RecordBeforeCommit),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        OutboxError::Crashed(Crashed(CrashPoint::RecordBeforeCommit))
    ));
    drop(outbox);
    let mut outbox = Outbox::open(&dir.file()).unwrap();
    assert!(outbox.events(a).unwrap().is_empty());
    assert!(
        outbox
            .record(deposit(a, 8), 2, &mut CrashAt(CrashPoint::RecordCommitted))
            .is_err()
    );
    drop(outbox);
    let mut outbox = Outbox::open(&dir.file()).unwrap();
    let events = outbox.events(a).unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].client_seq, events[0].amount_cents), (1, 8));
    assert_eq!(
        outbox
            .record(deposit(a, 9), 3, &mut NoHooks)
            .unwrap()
            .client_seq,
        2
    );
}

#[test]
fn transfers_are_refused_offline_and_record_nothing() {
    let dir = OutboxDir::new("outbox", "transfer");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let op = Operation::transfer(acct(1), acct(2), AmountCents::new(5).unwrap()).unwrap();
    assert!(matches!(
        outbox.record(op, 0, &mut NoHooks),
        Err(OutboxError::TransferOffline)
    ));
    assert_eq!(outbox.status().unwrap().pending, 0);
}

#[test]
fn a_run_keeps_its_boundaries_until_marked_synced() {
    let dir = OutboxDir::new("outbox", "runs");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let a = acct(1);
    for cents in 1..=3 {
        outbox.record(deposit(a, cents), 0, &mut NoHooks).unwrap();
    }
    let run = outbox.next_run(2, 0).unwrap().unwrap();
    assert_eq!((run.first_seq, run.last_seq), (1, 2));
    // Recorded while the run is in flight, and a crash: the resent run is exactly 1..=2.
    outbox.record(deposit(a, 4), 0, &mut NoHooks).unwrap();
    drop(outbox);
    let mut outbox = Outbox::open(&dir.file()).unwrap();
    let again = outbox.next_run(100, 0).unwrap().unwrap();
    assert_eq!(again, run, "the same run, not a grown one");
    outbox.note_attempt(&again, Some("lost")).unwrap();
    let status = outbox.status().unwrap();
    assert_eq!((status.pending, status.in_flight, status.synced), (2, 2, 0));
    assert_eq!(status.accounts[0].run_attempts, Some(1));
    outbox.mark_synced(&again, Some(1), 5).unwrap();
    let next = outbox.next_run(100, 0).unwrap().unwrap();
    assert_eq!((next.first_seq, next.last_seq), (3, 4));
    assert_eq!(next.attempts, 0);
    outbox.mark_synced(&next, None, 6).unwrap();
    assert_eq!(outbox.next_run(100, 0).unwrap(), None);
    let status = outbox.status().unwrap();
    assert_eq!((status.pending, status.in_flight, status.synced), (0, 0, 4));
    assert!(matches!(
        outbox.mark_synced(&next, None, 7),
        Err(OutboxError::Corrupt(_))
    ));
}

/// Rule: a run carries, as its read-back hint, the version the account's latest run synced
/// by this device landed at (per account; an `alreadySynced` answer names none, so the
/// version before it stands).
#[test]
fn a_run_names_where_the_accounts_latest_synced_run_landed() {
    let dir = OutboxDir::new("outbox", "hint");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let (a, b) = (acct(1), acct(2));
    for op in [deposit(a, 1), deposit(b, 2)] {
        outbox.record(op, 0, &mut NoHooks).unwrap();
    }
    let first = outbox.next_run(1, 0).unwrap().unwrap();
    assert_eq!(first.last_synced_version, None);
    outbox.mark_synced(&first, Some(41), 0).unwrap();
    let other = outbox.next_run(1, 0).unwrap().unwrap();
    assert_eq!((other.account, other.last_synced_version), (b, None));
    outbox.mark_synced(&other, Some(7), 0).unwrap();

    outbox.record(deposit(a, 3), 0, &mut NoHooks).unwrap();
    let second = outbox.next_run(1, 0).unwrap().unwrap();
    assert_eq!(second.last_synced_version, Some(41));
    assert_eq!(second.request().last_synced_version, Some(41));
    outbox.mark_synced(&second, None, 0).unwrap();
    outbox.record(deposit(a, 4), 0, &mut NoHooks).unwrap();
    let third = outbox.next_run(1, 0).unwrap().unwrap();
    assert_eq!(
        third.last_synced_version,
        Some(41),
        "already synced: no newer version"
    );
}

#[test]
fn runs_are_taken_in_recording_order_across_accounts() {
    let dir = OutboxDir::new("outbox", "order");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let (a, b) = (acct(1), acct(2));
    for op in [deposit(b, 1), deposit(a, 2), deposit(b, 3)] {
        outbox.record(op, 0, &mut NoHooks).unwrap();
    }
    let mut order = Vec::new();
    while let Some(run) = outbox.next_run(10, 0).unwrap() {
        order.push((run.account, run.first_seq, run.last_seq));
        outbox.mark_synced(&run, Some(1), 0).unwrap();
    }
    assert_eq!(order, vec![(b, 1, 2), (a, 1, 1)]);
}

#[test]
fn recorded_events_can_never_be_renumbered_or_deleted() {
    let dir = OutboxDir::new("outbox", "immutable");
    let (mut outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    outbox.record(deposit(acct(1), 1), 0, &mut NoHooks).unwrap();
    drop(outbox);
    let conn = rusqlite::Connection::open(dir.file()).unwrap();
    for sql in [
        "UPDATE events SET client_seq = 9",
        "UPDATE events SET amount_cents = 2",
        "DELETE FROM events",
        "UPDATE sequences SET last_seq = 0",
    ] {
        assert!(conn.execute(sql, []).is_err(), "{sql} must be refused");
    }
    conn.execute("UPDATE events SET synced_at_ms = 1", [])
        .unwrap();
    assert!(
        conn.execute("UPDATE events SET synced_at_ms = NULL", [])
            .is_err(),
        "a synced event stays synced"
    );
}

#[test]
fn only_one_sync_loop_runs_per_outbox() {
    let dir = OutboxDir::new("outbox", "lock");
    let (outbox, _) = Outbox::init(&dir.file(), 0).unwrap();
    let other = Outbox::open(&dir.file()).unwrap();
    let held = outbox.lock_sync().unwrap();
    assert!(matches!(other.lock_sync(), Err(OutboxError::SyncRunning)));
    drop(held);
    assert!(
        other.lock_sync().is_ok(),
        "the lock is released with its holder"
    );
}
