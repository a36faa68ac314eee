//! The outbox's SQLite schema and how a connection to it is opened and recognised.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use super::{OutboxError, OutboxResult, SCHEMA_VERSION};
use tally::device::DeviceId;

/// Marks the file as a Tally device outbox (`PRAGMA application_id`, "TLDV").
pub(super) const APPLICATION_ID: i64 = 0x544C_4456;

pub(super) const SCHEMA: &str = "
CREATE TABLE device (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    device_id TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE sequences (
    account TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL CHECK (last_seq > 0)
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    account TEXT NOT NULL,
    client_seq INTEGER NOT NULL CHECK (client_seq > 0),
    kind TEXT NOT NULL CHECK (kind IN ('deposit', 'withdraw')),
    amount_cents INTEGER NOT NULL CHECK (amount_cents > 0),
    event_id TEXT NOT NULL,
    recorded_at_ms INTEGER NOT NULL,
    synced_at_ms INTEGER,
    synced_version INTEGER,
    UNIQUE (account, client_seq)
);
CREATE INDEX events_unsynced ON events (synced_at_ms, id);
CREATE TABLE runs (
    account TEXT PRIMARY KEY,
    first_seq INTEGER NOT NULL CHECK (first_seq > 0),
    last_seq INTEGER NOT NULL CHECK (last_seq >= first_seq),
    created_at_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
);
CREATE TRIGGER events_are_never_renumbered
BEFORE UPDATE OF id, account, client_seq, kind, amount_cents, event_id, recorded_at_ms ON events
BEGIN SELECT RAISE(ABORT, 'a recorded event is immutable'); END;
CREATE TRIGGER synced_stays_synced
BEFORE UPDATE OF synced_at_ms ON events WHEN OLD.synced_at_ms IS NOT NULL
BEGIN SELECT RAISE(ABORT, 'a synced event stays synced'); END;
CREATE TRIGGER events_are_never_deleted
BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'a recorded event is never deleted'); END;
CREATE TRIGGER sequences_never_go_back
BEFORE UPDATE OF last_seq ON sequences WHEN NEW.last_seq <= OLD.last_seq
BEGIN SELECT RAISE(ABORT, 'a sequence counter never goes back'); END;
";

/// Durability first: WAL with a full sync on every commit, so a committed record survives a
/// power cut, not only a process crash.
/// Called only once the file is known to be an outbox, so a foreign file is never changed.
pub(super) fn configure(conn: &Connection) -> OutboxResult<()> {
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(())
}

pub(super) fn check_and_load(conn: &Connection, path: &Path) -> OutboxResult<DeviceId> {
    let foreign = |why: String| OutboxError::Foreign(path.display().to_string(), why);
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let app: i64 = conn.pragma_query_value(None, "application_id", |r| r.get(0))?;
    if version == 0 && app == 0 {
        return Err(OutboxError::NotInitialised(path.display().to_string()));
    }
    if app != APPLICATION_ID || version != SCHEMA_VERSION {
        return Err(foreign(format!(
            "application id {app:#x}, schema version {version}"
        )));
    }
    let raw: String = conn
        .query_row(
            "SELECT device_id FROM device WHERE singleton = 1",
            [],
            |r| r.get(0),
        )
        .optional()?
        .ok_or_else(|| foreign("no device identity".into()))?;
    raw.parse()
        .map_err(|_| OutboxError::Corrupt(format!("device id {raw:?} is not a UUID")))
}
