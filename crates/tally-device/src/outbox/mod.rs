//! The device's outbox: one SQLite file holding the device identity, every recorded event with
//! its sequence, and the boundaries of the run being sent.
//!
//! The rules it enforces:
//! - recording assigns the account's next `ClientSeq` and stores the event with it in ONE
//!   transaction, before any network attempt; nothing is ever renumbered (triggers refuse any
//!   change to a recorded event other than marking it synced, and any delete);
//! - a run (the consecutive unsynced events of one account being sent) has its boundaries
//!   committed before its first send and kept until it is marked synced, so a resend after an
//!   ambiguous failure carries exactly the same events, and an event recorded meanwhile never
//!   joins it;
//! - runs are taken in recording order (the account of the oldest unsynced event), each from
//!   that account's first unsynced sequence: never skipping ahead.
//!
//! Schema (version [`SCHEMA_VERSION`], in `PRAGMA user_version`):
//! - `device(singleton = 1, device_id, created_at_ms)`: the client id, generated once;
//! - `sequences(account, last_seq)`: the last `ClientSeq` assigned per account, so a sequence
//!   is never reissued even if old events were ever pruned;
//! - `events(id, account, client_seq, kind, amount_cents, event_id, recorded_at_ms,
//!   synced_at_ms, synced_version)`: `id` is the recording order; `(account, client_seq)` is
//!   unique; `synced_at_ms` is NULL until the server confirmed the event is in the store;
//! - `runs(account, first_seq, last_seq, created_at_ms, attempts, last_error)`: at most one
//!   open run per account.
//!
//! The API is synchronous (SQLite is); the one sync loop calls it between awaits.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::time::Duration;

mod schema;
mod status;

use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};
use serde::Serialize;
use uuid::Uuid;

use self::schema::{APPLICATION_ID, SCHEMA, check_and_load, configure};
pub use self::status::{AccountStatus, Status};
use tally::account::{AccountId, AmountCents, Operation};
use tally::device::DeviceId;
use tally::device::protocol::{SyncEvent, SyncRequest, TYPE_DEPOSIT, TYPE_WITHDRAW};

use crate::crash::{CrashPoint, Crashed, Hooks};

/// The outbox schema this code reads and writes.
pub const SCHEMA_VERSION: i64 = 1;
/// How long a statement waits for another process's lock (e.g. `record` while `sync` runs).
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything the outbox can refuse or fail at. One enum for the device's storage layer.
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("no outbox at {0} (run `tally-device init` first)")]
    NotInitialised(String),
    #[error("{0} is not a Tally device outbox of schema version {SCHEMA_VERSION}: {1}")]
    Foreign(String, String),
    /// Transfers are refused offline. Their two legs live on two accounts with two
    /// independent device sequences. Recorded offline, they would either couple both
    /// accounts' queues into one cross-account write (which the store refuses across shards),
    /// or land as two separate writes with money missing in between. And a transfer offline
    /// would skip the payer's balance check, the reason to make it online.
    #[error("transfers are not recorded offline: make them online (POST /api/transfers)")]
    TransferOffline,
    /// Opening an account is an online decision (is the id free?) the service makes.
    #[error(
        "accounts are not opened offline: open the account through the Tally API (POST /api/accounts)"
    )]
    OpenOffline,
    /// Holds reserve money against the account's live balance, which a device offline
    /// cannot know.
    #[error("holds are not placed, posted or voided offline: use the Tally API")]
    HoldOffline,
    #[error("another sync of this outbox is running")]
    SyncRunning,
    #[error("io: {0}")]
    Io(String),
    /// The outbox contradicts its own invariants. Never papered over.
    #[error("outbox invariant broken: {0}")]
    Corrupt(String),
    #[error(transparent)]
    Crashed(#[from] Crashed),
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

pub type OutboxResult<T> = Result<T, OutboxError>;

/// A recorded event's type: the two a device records offline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Deposit,
    Withdraw,
}

impl Kind {
    pub fn wire(self) -> &'static str {
        match self {
            Kind::Deposit => TYPE_DEPOSIT,
            Kind::Withdraw => TYPE_WITHDRAW,
        }
    }

    fn parse(s: &str) -> OutboxResult<Self> {
        match s {
            TYPE_DEPOSIT => Ok(Kind::Deposit),
            TYPE_WITHDRAW => Ok(Kind::Withdraw),
            other => Err(OutboxError::Corrupt(format!("unknown kind {other:?}"))),
        }
    }
}

/// One event as the outbox holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredEvent {
    #[serde(serialize_with = "account_str")]
    pub account: AccountId,
    pub client_seq: u64,
    pub kind: Kind,
    pub amount_cents: i64,
    pub event_id: Uuid,
    pub recorded_at_ms: u64,
    pub synced: bool,
}

fn account_str<S: serde::Serializer>(a: &AccountId, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(a)
}

/// An account's open run (its row in `runs`): the run being sent, exactly these events
/// every attempt, from before its first send until it is marked synced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenRun {
    pub account: AccountId,
    pub first_seq: u64,
    pub last_seq: u64,
    /// Attempts made so far, across every sync that tried it.
    pub attempts: u64,
    /// The version the account's latest run synced by this device landed at, when the
    /// server said (a `synced` answer): sent as a hint for the read-back of a resend.
    pub last_synced_version: Option<u64>,
    pub events: Vec<StoredEvent>,
}

impl OpenRun {
    /// The request body for this run.
    pub fn request(&self) -> SyncRequest {
        SyncRequest {
            account_id: self.account.to_string(),
            first_seq: Some(self.first_seq),
            last_synced_version: self.last_synced_version,
            events: self
                .events
                .iter()
                .map(|e| SyncEvent {
                    client_seq: e.client_seq,
                    kind: e.kind.wire().to_owned(),
                    amount_cents: e.amount_cents,
                    event_id: Some(e.event_id.hyphenated().to_string()),
                    recorded_at_ms: Some(e.recorded_at_ms),
                })
                .collect(),
        }
    }
}

/// An open outbox.
pub struct Outbox {
    conn: Connection,
    device: DeviceId,
    path: PathBuf,
}

/// Held while a sync loop runs: an exclusive OS lock on `<outbox>.sync-lock`, released when
/// dropped or when the process dies, so a crashed sync never blocks the next one.
#[derive(Debug)]
pub struct SyncLock {
    _file: File,
}

fn to_sql(n: u64) -> OutboxResult<i64> {
    i64::try_from(n).map_err(|_| OutboxError::Corrupt(format!("{n} does not fit SQLite")))
}

pub(super) fn from_sql(n: i64) -> OutboxResult<u64> {
    u64::try_from(n).map_err(|_| OutboxError::Corrupt(format!("negative value {n}")))
}

fn parse_account(s: &str) -> OutboxResult<AccountId> {
    s.parse()
        .map_err(|_| OutboxError::Corrupt(format!("account {s:?} is not a UUID")))
}

impl Outbox {
    /// Creates the outbox and the device identity, or opens an existing one unchanged.
    /// Returns the outbox and whether it was created now. Never regenerates an identity.
    pub fn init(path: &Path, now_ms: u64) -> OutboxResult<(Self, bool)> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE;
        let mut conn = Connection::open_with_flags(path, flags)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let version: i64 = tx.pragma_query_value(None, "user_version", |r| r.get(0))?;
        let created = if version == 0 {
            let tables: i64 =
                tx.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))?;
            if tables != 0 {
                return Err(OutboxError::Foreign(
                    path.display().to_string(),
                    "it already holds other tables".into(),
                ));
            }
            tx.execute_batch(SCHEMA)?;
            tx.execute(
                "INSERT INTO device (singleton, device_id, created_at_ms) VALUES (1, ?1, ?2)",
                params![DeviceId::generate().to_string(), to_sql(now_ms)?],
            )?;
            tx.pragma_update(None, "application_id", APPLICATION_ID)?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
            true
        } else {
            false
        };
        tx.commit()?;
        let device = check_and_load(&conn, path)?;
        configure(&conn)?;
        Ok((
            Self {
                conn,
                device,
                path: path.to_path_buf(),
            },
            created,
        ))
    }

    /// Opens an existing, initialised outbox. Never creates one.
    pub fn open(path: &Path) -> OutboxResult<Self> {
        if !path.exists() {
            return Err(OutboxError::NotInitialised(path.display().to_string()));
        }
        let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let device = check_and_load(&conn, path)?;
        configure(&conn)?;
        Ok(Self {
            conn,
            device,
            path: path.to_path_buf(),
        })
    }

    /// The device's client id.
    pub fn device_id(&self) -> DeviceId {
        self.device
    }

    /// Takes the one-sync-loop lock, or says another sync is running. Two loops would send
    /// the same run twice at once (harmless to the store, but each would then find the
    /// other's run closed).
    pub fn lock_sync(&self) -> OutboxResult<SyncLock> {
        let mut name = self.path.clone().into_os_string();
        name.push(".sync-lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&name)
            .map_err(|e| OutboxError::Io(format!("{}: {e}", PathBuf::from(&name).display())))?;
        match file.try_lock() {
            Ok(()) => Ok(SyncLock { _file: file }),
            Err(TryLockError::WouldBlock) => Err(OutboxError::SyncRunning),
            Err(TryLockError::Error(e)) => Err(OutboxError::Io(e.to_string())),
        }
    }

    /// Records a deposit or withdrawal: assigns the account's next sequence and stores the
    /// event with it in one transaction. Transfers, opens and holds are refused
    /// ([`OutboxError::TransferOffline`], [`OutboxError::OpenOffline`],
    /// [`OutboxError::HoldOffline`]).
    pub fn record(
        &mut self,
        operation: Operation,
        now_ms: u64,
        hooks: &mut dyn Hooks,
    ) -> OutboxResult<StoredEvent> {
        let (account, kind, amount): (AccountId, Kind, AmountCents) = match operation {
            Operation::Deposit { account, amount } => (account, Kind::Deposit, amount),
            Operation::Withdraw { account, amount } => (account, Kind::Withdraw, amount),
            Operation::Transfer { .. } => return Err(OutboxError::TransferOffline),
            Operation::Open { .. } => return Err(OutboxError::OpenOffline),
            Operation::PlaceHold { .. }
            | Operation::PostHold { .. }
            | Operation::VoidHold { .. }
            | Operation::ExpireHold { .. } => return Err(OutboxError::HoldOffline),
        };
        let event_id = Uuid::new_v4();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let key = account.to_string();
        let last: Option<i64> = tx
            .query_row(
                "SELECT last_seq FROM sequences WHERE account = ?1",
                [&key],
                |r| r.get(0),
            )
            .optional()?;
        let seq = match last {
            Some(last) => from_sql(last)?
                .checked_add(1)
                .ok_or_else(|| OutboxError::Corrupt("sequence overflow".into()))?,
            None => 1,
        };
        tx.execute(
            "INSERT INTO sequences (account, last_seq) VALUES (?1, ?2)
             ON CONFLICT (account) DO UPDATE SET last_seq = excluded.last_seq",
            params![key, to_sql(seq)?],
        )?;
        tx.execute(
            "INSERT INTO events (account, client_seq, kind, amount_cents, event_id, recorded_at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                key,
                to_sql(seq)?,
                kind.wire(),
                amount.get(),
                event_id.hyphenated().to_string(),
                to_sql(now_ms)?
            ],
        )?;
        // A crash here rolls the whole record back: neither the sequence nor the event.
        hooks.at(CrashPoint::RecordBeforeCommit)?;
        tx.commit()?;
        hooks.at(CrashPoint::RecordCommitted)?;
        Ok(StoredEvent {
            account,
            client_seq: seq,
            kind,
            amount_cents: amount.get(),
            event_id,
            recorded_at_ms: now_ms,
            synced: false,
        })
    }

    /// The run to send next: the open run of the account whose unsynced event is oldest, or
    /// a new run of up to `max_events` of that account's unsynced events, committed before
    /// it is returned. `None` when everything is synced.
    pub fn next_run(&mut self, max_events: usize, now_ms: u64) -> OutboxResult<Option<OpenRun>> {
        let max_events = max_events.max(1);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let oldest: Option<String> = tx
            .query_row(
                "SELECT account FROM events WHERE synced_at_ms IS NULL ORDER BY id LIMIT 1",
                [],
                |r| r.get(0),
            )
            .optional()?;
        let Some(key) = oldest else {
            return Ok(None);
        };
        let account = parse_account(&key)?;
        let (first_seq, last_seq, attempts) = match open_run_bounds(&tx, &key)? {
            Some(open) => open,
            None => {
                let (first, last) = cut_run(&tx, &key, max_events, now_ms)?;
                (first, last, 0)
            }
        };
        let events = load_events(&tx, &key, first_seq, last_seq)?;
        check_run(&tx, &key, account, first_seq, last_seq, &events)?;
        let last_synced_version = last_synced_version(&tx, &key)?;
        tx.commit()?;
        Ok(Some(OpenRun {
            account,
            first_seq,
            last_seq,
            attempts,
            last_synced_version,
            events,
        }))
    }

    /// Counts one attempt at `run` and keeps why it failed (`None` when it succeeded).
    pub fn note_attempt(&mut self, run: &OpenRun, error: Option<&str>) -> OutboxResult<()> {
        let changed = self.conn.execute(
            "UPDATE runs SET attempts = attempts + 1, last_error = ?4
             WHERE account = ?1 AND first_seq = ?2 AND last_seq = ?3",
            params![
                run.account.to_string(),
                to_sql(run.first_seq)?,
                to_sql(run.last_seq)?,
                error
            ],
        )?;
        if changed != 1 {
            return Err(OutboxError::Corrupt(format!(
                "run {}..={} of {} is not open",
                run.first_seq, run.last_seq, run.account
            )));
        }
        Ok(())
    }

    /// Marks every event of `run` synced and closes the run, in one transaction. Call only
    /// with the server's proof that the whole run is in the store.
    pub fn mark_synced(
        &mut self,
        run: &OpenRun,
        version: Option<u64>,
        now_ms: u64,
    ) -> OutboxResult<()> {
        let key = run.account.to_string();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let closed = tx.execute(
            "DELETE FROM runs WHERE account = ?1 AND first_seq = ?2 AND last_seq = ?3",
            params![key, to_sql(run.first_seq)?, to_sql(run.last_seq)?],
        )?;
        if closed != 1 {
            return Err(OutboxError::Corrupt(format!(
                "run {}..={} of {} is not open",
                run.first_seq, run.last_seq, run.account
            )));
        }
        let version = version.map(to_sql).transpose()?;
        let marked = tx.execute(
            "UPDATE events SET synced_at_ms = ?4, synced_version = ?5
             WHERE account = ?1 AND client_seq BETWEEN ?2 AND ?3 AND synced_at_ms IS NULL",
            params![
                key,
                to_sql(run.first_seq)?,
                to_sql(run.last_seq)?,
                to_sql(now_ms)?,
                version
            ],
        )?;
        if marked != run.events.len() {
            return Err(OutboxError::Corrupt(format!(
                "marking run {}..={} of {} touched {marked} events, not {}",
                run.first_seq,
                run.last_seq,
                run.account,
                run.events.len()
            )));
        }
        tx.commit()?;
        Ok(())
    }

    /// Every event of `account`, in sequence order.
    pub fn events(&self, account: AccountId) -> OutboxResult<Vec<StoredEvent>> {
        load_events(&self.conn, &account.to_string(), 1, i64::MAX as u64)
    }
}

/// The account's open run, if it has one: its first and last sequence and attempts so far.
fn open_run_bounds(conn: &Connection, key: &str) -> OutboxResult<Option<(u64, u64, u64)>> {
    let open: Option<(i64, i64, i64)> = conn
        .query_row(
            "SELECT first_seq, last_seq, attempts FROM runs WHERE account = ?1",
            [key],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    open.map(|(first, last, attempts)| Ok((from_sql(first)?, from_sql(last)?, from_sql(attempts)?)))
        .transpose()
}

/// Opens a new run of the account: up to `max_events` of its unsynced events from its first
/// unsynced sequence, its boundaries committed with the transaction. Returns its first and
/// last sequence.
fn cut_run(
    conn: &Connection,
    key: &str,
    max_events: usize,
    now_ms: u64,
) -> OutboxResult<(u64, u64)> {
    let first: i64 = conn.query_row(
        "SELECT min(client_seq) FROM events WHERE account = ?1 AND synced_at_ms IS NULL",
        [key],
        |r| r.get(0),
    )?;
    let first = from_sql(first)?;
    let span = u64::try_from(max_events - 1).unwrap_or(u64::MAX);
    let last: i64 = conn.query_row(
        "SELECT max(client_seq) FROM events
         WHERE account = ?1 AND synced_at_ms IS NULL AND client_seq <= ?2",
        params![key, to_sql(first.saturating_add(span))?],
        |r| r.get(0),
    )?;
    let last = from_sql(last)?;
    conn.execute(
        "INSERT INTO runs (account, first_seq, last_seq, created_at_ms)
         VALUES (?1, ?2, ?3, ?4)",
        params![key, to_sql(first)?, to_sql(last)?, to_sql(now_ms)?],
    )?;
    Ok((first, last))
}

/// The version the account's newest synced event landed at, if the server said. Runs land
/// in sequence order, so it is the highest version (one step down the (account,
/// client_seq) index).
fn last_synced_version(conn: &Connection, key: &str) -> OutboxResult<Option<u64>> {
    let version: Option<i64> = conn
        .query_row(
            "SELECT synced_version FROM events
             WHERE account = ?1 AND synced_version IS NOT NULL
             ORDER BY client_seq DESC LIMIT 1",
            [key],
            |r| r.get(0),
        )
        .optional()?;
    version.map(from_sql).transpose()
}

fn load_events(
    conn: &Connection,
    key: &str,
    first_seq: u64,
    last_seq: u64,
) -> OutboxResult<Vec<StoredEvent>> {
    let mut stmt = conn.prepare(
        "SELECT account, client_seq, kind, amount_cents, event_id, recorded_at_ms,
                synced_at_ms IS NOT NULL
         FROM events WHERE account = ?1 AND client_seq BETWEEN ?2 AND ?3 ORDER BY client_seq",
    )?;
    let rows = stmt.query_map(params![key, to_sql(first_seq)?, to_sql(last_seq)?], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, String>(4)?,
            r.get::<_, i64>(5)?,
            r.get::<_, bool>(6)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (account, seq, kind, amount, event_id, recorded, synced) = row?;
        out.push(StoredEvent {
            account: parse_account(&account)?,
            client_seq: from_sql(seq)?,
            kind: Kind::parse(&kind)?,
            amount_cents: amount,
            event_id: event_id
                .parse()
                .map_err(|_| OutboxError::Corrupt(format!("event id {event_id:?}")))?,
            recorded_at_ms: from_sql(recorded)?,
            synced,
        });
    }
    Ok(out)
}

/// A run must be the account's first unsynced events, consecutive and all unsynced.
fn check_run(
    conn: &Connection,
    key: &str,
    account: AccountId,
    first_seq: u64,
    last_seq: u64,
    events: &[StoredEvent],
) -> OutboxResult<()> {
    let consecutive = events
        .iter()
        .zip(first_seq..=last_seq)
        .all(|(e, seq)| e.client_seq == seq && !e.synced);
    let expected = last_seq - first_seq + 1;
    if !consecutive || u64::try_from(events.len()).ok() != Some(expected) {
        return Err(OutboxError::Corrupt(format!(
            "run {first_seq}..={last_seq} of {account} is not {expected} consecutive unsynced events"
        )));
    }
    let synced_max: Option<i64> = conn.query_row(
        "SELECT max(client_seq) FROM events WHERE account = ?1 AND synced_at_ms IS NOT NULL",
        [key],
        |r| r.get(0),
    )?;
    let next = synced_max.map(from_sql).transpose()?.unwrap_or(0) + 1;
    if next != first_seq {
        return Err(OutboxError::Corrupt(format!(
            "run of {account} starts at {first_seq}, but the first unsynced sequence is {next}"
        )));
    }
    Ok(())
}
