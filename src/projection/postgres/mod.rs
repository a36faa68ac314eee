//! The Postgres projection backend: the account's cursor, balance, highest own client
//! sequence and recent-writes index live in two tables of one database that every replica
//! shares, and move together, one statement at a time.
//!
//! - the write path's record ([`PgProjection::record`]) is ONE statement: the index rows
//!   upserted (their times only ever raised) and the cursor bumped, guarded on the
//!   version the write expected. No replica can see the bump without the rows;
//! - catch-up ([`super::Projection::refresh`]) persists what it replays, index rows inside the
//!   retention and the cursor, in one statement per catch-up, guarded so the cursor never
//!   moves backwards ([`PgProjection::persist`]);
//! - the index lookup rides the read of the account row as a LEFT JOIN
//!   ([`PgProjection::load`]): never an extra round trip.
//!
//! An index row lives for the retention (`--idempotency-retention`), not only the window:
//! a retry of its key is answered from it, on any replica, until its expiry. Its window end
//! is kept beside the expiry. Only rows inside the window go into a replica's warm copy
//! (`warm.rs`), so a copy stays as small as the window makes it.
//!
//! Both times are in the store's server time (its commit timestamps), never a replica's or
//! the database's clock: a replayed row lives from its batch's commit time, a recorded
//! write from the replica's server-time estimate, and lookups and the sweep compare against
//! that same estimate (see `anchor.rs`).
//!
//! Files: this one (settings, pool, migrations, statements), `rows` (row <-> value
//! conversions), `catch_up` (the catch-up over the store that persists what it folds),
//! `warm` (the replica's complete copy of rows it has read, which takes the load off a
//! write's fast path).

mod catch_up;
mod records;
mod rows;
mod warm;

pub use records::{MAX_RECORD_ACCOUNTS, RECORD_QUEUE_CAPACITY, RECORD_STATEMENTS_IN_FLIGHT};
pub use rows::RowLife;
pub(crate) use warm::WarmUpdate;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use uuid::Uuid;

use super::state::{Broken, Snapshot};
use super::{RecentWrite, RecordedWrite};
use crate::account::AccountId;
use crate::metrics::Metrics;
use records::{RecordQueue, StatementRows};
use rows::IndexRows;

/// Connections in one replica's pool, unless configured.
pub const DEFAULT_POOL_SIZE: usize = 16;
/// The longest any one statement may run (server side), and the longest a request waits for
/// a pooled connection, unless configured.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most index rows past their retention one sweep statement deletes, so a sweep never holds locks or
/// runs long: a backlog is cleared over several statements.
pub const SWEEP_BATCH_ROWS: i64 = 10_000;
/// The most sweep statements one sweep pass runs (so at most this x [`SWEEP_BATCH_ROWS`]
/// rows per pass); the next pass continues.
pub const SWEEP_MAX_STATEMENTS: usize = 20;
/// The most live index rows an account may have for this replica to keep a warm copy of
/// it (see `warm.rs`): a load asks for at most one more. An account with more (a hot one
/// with a long window) is read from the database on every write instead, where batching
/// already spreads the round trip over many requests.
pub const WARM_MAX_ROWS_PER_ACCOUNT: usize = 1_024;
/// The most index rows inside the retention an account may have for this replica to keep
/// a warm copy of it: the copy remembers each key past the window as a fingerprint (a few
/// bytes, `keys/`), so a new key costs no row read. A load asks for at most one more. An
/// account with more is read from the database on every write instead.
pub const WARM_MAX_KEYS_PER_ACCOUNT: usize = 65_536;
/// How long migrations may wait for the migration lock and run, at start.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);
/// The advisory lock that serialises migrations when several replicas start at once.
const MIGRATION_LOCK: i64 = 0x7461_6c6c_795f_3134; // "tally_14"

/// Embedded migrations, applied in order, each once (recorded in `tally_schema_migrations`).
const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../../../migrations/0001_projection.sql")),
    (2, include_str!("../../../migrations/0002_store_epoch.sql")),
    (
        3,
        include_str!("../../../migrations/0003_key_retention.sql"),
    ),
];

/// How to reach the database.
#[derive(Clone, Debug)]
pub struct PostgresSettings {
    /// A libpq-style URL or key=value string. Never logged (it may hold a password).
    pub url: String,
    pub pool_size: usize,
    pub statement_timeout: Duration,
}

/// A database call failed. Retryable from the caller's point of view: nothing the
/// projection reports as done depends on it.
#[derive(Clone, Debug, thiserror::Error)]
#[error("projection database: {0}")]
pub struct PgError(String);

impl From<tokio_postgres::Error> for PgError {
    fn from(e: tokio_postgres::Error) -> Self {
        // `Display` of a db error is only "db error"; the detail says what.
        match e.as_db_error() {
            Some(db) => PgError(format!("{}: {}", db.code().code(), db.message())),
            None => PgError(e.to_string()),
        }
    }
}

impl From<deadpool_postgres::PoolError> for PgError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        PgError(format!("pool: {e}"))
    }
}

/// Where a database URL points, `host:port/dbname`, without its user or password: what a
/// log line may say of it. A URL that does not parse is named so (it is refused at start).
pub fn database_place(url: &str) -> String {
    use tokio_postgres::config::Host;
    let Ok(config) = url.parse::<tokio_postgres::Config>() else {
        return "(an unparsable --postgres-url)".into();
    };
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            };
            let port = config.get_ports().get(i).or(config.get_ports().first());
            port.map_or(host.clone(), |p| format!("{host}:{p}"))
        })
        .collect();
    format!(
        "{}/{}",
        hosts.join(","),
        config
            .get_dbname()
            .unwrap_or("(the user's default database)")
    )
}

/// `statement`, given up (as a failed statement) once `limit` has passed without an answer:
/// the server-side `statement_timeout` only bounds a database that answers.
async fn within<T>(
    limit: Duration,
    statement: impl std::future::Future<Output = Result<T, PgError>>,
) -> Result<T, PgError> {
    tokio::time::timeout(limit, statement)
        .await
        .unwrap_or_else(|_| {
            Err(PgError(format!(
                "no answer within {} ms",
                limit.as_millis()
            )))
        })
}

/// The account row as read, with the index rows the read asked for.
#[derive(Debug, Default)]
pub struct PgRow {
    /// `None`: no row yet (the account was never folded into this database).
    pub state: Option<(Snapshot, Option<Broken>)>,
    /// The commit time of the newest batch folded into the row (0 without one).
    pub server_ts_ms: u64,
    /// The rows of the keys looked up, inside their retention; each expires at the end of
    /// its retention.
    pub hits: Vec<(u128, RecentWrite)>,
    /// Every index row inside its retention above the `since` version the load was given,
    /// with its lifetimes, when it asked and there were at most
    /// [`WARM_MAX_KEYS_PER_ACCOUNT`]; `None` otherwise.
    pub delta: Option<Vec<(u128, RecentWrite, RowLife)>>,
}

/// One account's part of a recorded write: the row's new state and its index rows.
pub struct RecordRow<'a> {
    pub account: AccountId,
    pub write: &'a RecordedWrite<'a>,
}

pub struct PgProjection {
    pool: Pool,
    metrics: Arc<Metrics>,
    /// The longest a request waits for the database to answer one statement: a pooled
    /// connection, then the statement. `statement_timeout` only bounds a database that
    /// answers; this bounds one that hangs or a network that drops packets.
    answer_limit: Duration,
    /// Where the write path's records queue for a statement (`records.rs`).
    records: RecordQueue,
    /// Whether this replica's migrations have run: until then the tables may not exist, and
    /// a statement on them fails for that reason alone (`regress.rs` waits for it).
    migrated: AtomicBool,
}

impl PgProjection {
    /// Builds the pool (connections open lazily) and applies the embedded migrations.
    pub async fn connect(
        settings: &PostgresSettings,
        metrics: Arc<Metrics>,
    ) -> Result<Self, PgError> {
        let this = Self::new(settings, metrics)?;
        this.migrate().await?;
        Ok(this)
    }

    /// Builds the pool without contacting the database (connections open lazily), and
    /// starts the record queue's dispatcher (so it needs a tokio runtime): a database that
    /// is down at boot does not stop the replica. Run [`PgProjection::migrate`]
    /// before serving (the start-up step `postgresMigrations` does).
    pub fn new(settings: &PostgresSettings, metrics: Arc<Metrics>) -> Result<Self, PgError> {
        let mut pg: tokio_postgres::Config = settings
            .url
            .parse()
            .map_err(|e| PgError(format!("bad --postgres-url: {e}")))?;
        // Asynchronous commit: a statement returns before its WAL record is flushed. Safe for
        // a projection, because nothing in it is the source of truth: a crash of the database
        // loses the newest transactions whole (a consistent prefix, so a cursor is never
        // without its index rows), and catch-up replays from the store what they had moved.
        // It takes the WAL flush off every write's path.
        let timeout_ms = settings.statement_timeout.as_millis();
        let ours = format!("-c statement_timeout={timeout_ms} -c synchronous_commit=off");
        let options = match pg.get_options() {
            Some(o) if !o.is_empty() => format!("{o} {ours}"),
            _ => ours,
        };
        pg.options(&options);
        pg.application_name("tally");
        let manager = Manager::from_config(
            pg,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(settings.statement_timeout))
            .create_timeout(Some(settings.statement_timeout))
            .build()
            .map_err(|e| PgError(format!("pool: {e}")))?;
        // A write waits for its record at most two statement timeouts (one for a pooled
        // connection, one for the statement), queueing included.
        let wait_limit = settings.statement_timeout.saturating_mul(2);
        let records = RecordQueue::start(pool.clone(), metrics.clone(), wait_limit);
        Ok(Self {
            pool,
            metrics,
            answer_limit: wait_limit,
            records,
            migrated: AtomicBool::new(false),
        })
    }

    /// Counts one statement by kind and outcome.
    fn counted<T>(&self, statement: &str, r: Result<T, PgError>) -> Result<T, PgError> {
        counted(&self.metrics, statement, r)
    }

    /// Applies every embedded migration not applied yet, in one transaction under an
    /// advisory lock: replicas starting at once take turns, and the later ones find
    /// everything applied.
    pub async fn migrate(&self) -> Result<(), PgError> {
        // Longer than the server-side limit, so a database that answers says why.
        within(
            MIGRATION_TIMEOUT.saturating_add(self.answer_limit),
            self.migrate_now(),
        )
        .await?;
        self.migrated.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether [`PgProjection::migrate`] has succeeded on this replica.
    pub fn is_migrated(&self) -> bool {
        self.migrated.load(Ordering::Acquire)
    }

    /// Records `epoch` as the store these rows are folded from, unless one is recorded
    /// already; returns whether the recorded one is `epoch` (`regress.rs`).
    pub async fn bind_store_epoch(&self, epoch: u128) -> Result<bool, PgError> {
        within(self.answer_limit, async {
            let client = self.pool.get().await?;
            let epoch = Uuid::from_u128(epoch);
            client
                .execute(
                    "INSERT INTO tally_store_epoch (epoch) VALUES ($1) ON CONFLICT (only_row) DO NOTHING",
                    &[&epoch],
                )
                .await?;
            let recorded: Uuid = client
                .query_one("SELECT epoch FROM tally_store_epoch", &[])
                .await?
                .get(0);
            Ok(recorded == epoch)
        })
        .await
    }

    async fn migrate_now(&self) -> Result<(), PgError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.batch_execute(&format!(
            "SET LOCAL statement_timeout = {}",
            MIGRATION_TIMEOUT.as_millis()
        ))
        .await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS tally_schema_migrations (
                 version integer PRIMARY KEY,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
        let applied: Vec<i32> = tx
            .query("SELECT version FROM tally_schema_migrations", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for &(version, sql) in MIGRATIONS {
            if applied.contains(&version) {
                continue;
            }
            tracing::info!(version, "applying Postgres projection migration");
            tx.batch_execute(sql).await?;
            tx.execute(
                "INSERT INTO tally_schema_migrations (version) VALUES ($1)",
                &[&version],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The account row and, in the same statement (a LEFT JOIN), the index rows of
    /// `lookups` still inside their retention at `tip_ms` (server time) and, when `since` is
    /// given, every index row of the account inside its retention above version `since`,
    /// at most [`WARM_MAX_KEYS_PER_ACCOUNT`] of them (more: [`PgRow::delta`] is `None`). The
    /// delta is what keeps a replica's warm copy of the account complete (see `warm.rs`).
    pub async fn load(
        &self,
        account: AccountId,
        lookups: &[u128],
        tip_ms: u64,
        since: Option<u64>,
    ) -> Result<PgRow, PgError> {
        let loaded = within(self.answer_limit, async {
            let client = self.pool.get().await?;
            let stmt = client
                .prepare_cached(
                    "SELECT a.balance_cents, a.version, a.max_client_seq,
                        a.broken_version, a.broken_reason, a.trimmed_min_available,
                        a.server_ts_ms, r.event_id, r.balance_cents, r.version, r.event_kind,
                        r.amount_cents, r.counterparty, r.expires_at_ms, r.delta,
                        r.window_ends_ms
                 FROM (SELECT $1::uuid AS id) k
                 LEFT JOIN tally_accounts a ON a.account_id = k.id
                 LEFT JOIN LATERAL (
                     SELECT w.event_id, w.balance_cents, w.version, w.event_kind,
                            w.amount_cents, w.counterparty, w.expires_at_ms, false AS delta,
                            COALESCE(w.window_ends_ms, w.expires_at_ms) AS window_ends_ms
                     FROM tally_recent_writes w
                     WHERE w.account_id = k.id AND w.event_id = ANY($2::uuid[])
                       AND w.expires_at_ms > $3
                     UNION ALL
                     (SELECT w.event_id, w.balance_cents, w.version, w.event_kind,
                             w.amount_cents, w.counterparty, w.expires_at_ms, true,
                             COALESCE(w.window_ends_ms, w.expires_at_ms)
                      FROM tally_recent_writes w
                      WHERE $4::int8 >= 0 AND w.account_id = k.id AND w.version > $4
                        AND w.expires_at_ms > $3
                      LIMIT $5)
                 ) r ON true",
                )
                .await?;
            let ids: Vec<Uuid> = lookups.iter().map(|&id| Uuid::from_u128(id)).collect();
            let since_param = since.map_or(-1, rows::to_i64);
            let limit = i64::try_from(WARM_MAX_KEYS_PER_ACCOUNT + 1).unwrap_or(i64::MAX);
            let rows = client
                .query(
                    &stmt,
                    &[
                        &account.0,
                        &ids,
                        &rows::to_i64(tip_ms),
                        &since_param,
                        &limit,
                    ],
                )
                .await?;
            let mut row = rows::loaded(&rows).map_err(PgError)?;
            row.delta = match (since, row.delta.take()) {
                (None, _) => None,
                (Some(_), delta) => {
                    let delta = delta.unwrap_or_default();
                    (delta.len() <= WARM_MAX_KEYS_PER_ACCOUNT).then_some(delta)
                }
            };
            Ok(row)
        })
        .await;
        self.counted("load", loaded)
    }

    /// The write path's record, for every account a write touched, in ONE statement
    /// (shared with other writes' records under load: `records.rs`): each account's index
    /// rows upserted to live for `life` (a row's times only ever raised), and its cursor bumped only
    /// where it still stands at the version the write expected (a row is created only by a
    /// write that expected version 0). Returns the accounts whose row stood below the
    /// version the write expected (see `execute_record`).
    pub async fn record(
        &self,
        rows: &[RecordRow<'_>],
        life: RowLife,
    ) -> Result<Vec<AccountId>, PgError> {
        self.records.record(StatementRows::of(rows, life)).await
    }

    /// Catch-up's persistence, as ONE statement: the index rows it replayed inside the
    /// retention, each with its lifetimes, and the account row at the fold's state, moved
    /// only forward (or marked broken at the version it already holds).
    pub async fn persist(
        &self,
        account: AccountId,
        snap: Snapshot,
        broken: Option<&Broken>,
        replayed: &[(u128, RecentWrite, RowLife)],
        server_ts_ms: u64,
    ) -> Result<(), PgError> {
        let persisted = within(self.answer_limit, async {
            let mut index = IndexRows::default();
            for (event_id, w, life) in replayed {
                index.push(account, *event_id, w, *life);
            }
            let (broken_version, broken_reason, trimmed) = rows::broken_columns(broken);
            let (version, max_client_seq, server_ts) = (
                rows::to_i64(snap.version),
                rows::to_i64(snap.max_client_seq),
                rows::to_i64(server_ts_ms),
            );
            let client = self.pool.get().await?;
            let stmt = client
                .prepare_cached(&format!(
                    "WITH idx AS ({upsert})
                 INSERT INTO tally_accounts AS a (account_id, balance_cents, version,
                        max_client_seq, broken_version, broken_reason, trimmed_min_available,
                        server_ts_ms)
                 VALUES ($10, $11, $12, $13, $14, $15, $16, $17)
                 ON CONFLICT (account_id) DO UPDATE
                    SET balance_cents = EXCLUDED.balance_cents,
                        version = EXCLUDED.version,
                        max_client_seq = GREATEST(a.max_client_seq, EXCLUDED.max_client_seq),
                        broken_version = EXCLUDED.broken_version,
                        broken_reason = EXCLUDED.broken_reason,
                        trimmed_min_available = EXCLUDED.trimmed_min_available,
                        server_ts_ms = GREATEST(a.server_ts_ms, EXCLUDED.server_ts_ms)
                  WHERE a.version < EXCLUDED.version
                     OR (a.version = EXCLUDED.version AND a.broken_reason IS NULL
                         AND EXCLUDED.broken_reason IS NOT NULL)",
                    upsert = rows::INDEX_UPSERT,
                ))
                .await?;
            client
                .execute(
                    &stmt,
                    &index.params_then(&[
                        &account.0,
                        &snap.balance,
                        &version,
                        &max_client_seq,
                        &broken_version,
                        &broken_reason,
                        &trimmed,
                        &server_ts,
                    ]),
                )
                .await?;
            Ok(())
        })
        .await;
        self.counted("persist", persisted)
    }

    /// Deletes index rows past their retention at `tip_ms` (server time), at most
    /// [`SWEEP_BATCH_ROWS`] per statement and [`SWEEP_MAX_STATEMENTS`] statements. Returns
    /// how many rows went.
    pub async fn sweep(&self, tip_ms: u64) -> Result<u64, PgError> {
        let limit = self
            .answer_limit
            .saturating_mul(SWEEP_MAX_STATEMENTS as u32);
        within(limit, self.sweep_now(tip_ms)).await
    }

    async fn sweep_now(&self, tip_ms: u64) -> Result<u64, PgError> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "DELETE FROM tally_recent_writes r
                 USING (SELECT account_id, event_id FROM tally_recent_writes
                        WHERE expires_at_ms <= $1
                        ORDER BY expires_at_ms LIMIT $2) old
                 WHERE r.account_id = old.account_id AND r.event_id = old.event_id",
            )
            .await?;
        let mut total = 0;
        for _ in 0..SWEEP_MAX_STATEMENTS {
            let n = client
                .execute(&stmt, &[&rows::to_i64(tip_ms), &SWEEP_BATCH_ROWS])
                .await
                .map_err(PgError::from);
            let n = self.counted("sweep", n)?;
            total += n;
            if n < SWEEP_BATCH_ROWS as u64 {
                break;
            }
        }
        self.metrics.projection_db_rows_swept.inc_by(total);
        Ok(total)
    }
}

/// Counts one statement by kind and outcome.
fn counted<T>(metrics: &Metrics, statement: &str, r: Result<T, PgError>) -> Result<T, PgError> {
    let outcome = if r.is_ok() { "ok" } else { "error" };
    metrics
        .projection_db_statements
        .with_label_values(&[statement, outcome])
        .inc();
    r
}

/// Sends one record statement: every account row and index row of `record`. Returns the
/// accounts whose row its guard skipped because the row stood *below* the version the
/// write expected: the database lost a commit this replica counted on (asynchronous
/// commit, a crash or a failover). A row skipped because it is already at or past the write
/// (another replica's catch-up, or another statement of the account, got there first) is
/// harmless and not returned. The final SELECT sees the rows as they were before the
/// statement (a data-modifying CTE's changes are not visible to its own statement).
async fn execute_record(
    pool: &Pool,
    metrics: &Metrics,
    record: StatementRows,
) -> Result<Vec<Uuid>, PgError> {
    let c = record.columns();
    let client = pool.get().await?;
    let stmt = client
        .prepare_cached(&format!(
            "WITH idx AS ({upsert}),
             moved AS (
             INSERT INTO tally_accounts AS a (account_id, balance_cents, version, max_client_seq)
             SELECT u.id, u.balance, u.version, u.seq
             FROM unnest($10::uuid[], $11::int8[], $12::int8[], $13::int8[], $14::int8[])
                  AS u(id, balance, version, seq, expected)
             WHERE u.version = u.expected + 1
               AND (u.expected = 0 OR EXISTS
                    (SELECT 1 FROM tally_accounts x WHERE x.account_id = u.id))
             ON CONFLICT (account_id) DO UPDATE
                SET balance_cents = EXCLUDED.balance_cents,
                    version = EXCLUDED.version,
                    max_client_seq = GREATEST(a.max_client_seq, EXCLUDED.max_client_seq)
              WHERE a.version = EXCLUDED.version - 1 AND a.broken_reason IS NULL
             RETURNING a.account_id)
             SELECT u.id
             FROM unnest($10::uuid[], $14::int8[]) AS u(id, expected)
             LEFT JOIN tally_accounts x ON x.account_id = u.id
             WHERE u.id NOT IN (SELECT account_id FROM moved)
               AND x.broken_reason IS NULL
               AND COALESCE(x.version, 0) < u.expected",
            upsert = rows::INDEX_UPSERT,
        ))
        .await?;
    let behind = client
        .query(
            &stmt,
            &c.index
                .params_then(&[&c.ids, &c.balances, &c.versions, &c.seqs, &c.expected]),
        )
        .await
        .map_err(PgError::from);
    let rows = counted(metrics, "record", behind)?;
    rows.iter()
        .map(|r| r.try_get(0).map_err(PgError::from))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::database_place;

    /// Rule: what a log line says of the database names its place, never its credentials.
    #[test]
    fn a_database_is_named_by_its_place_without_credentials() {
        assert_eq!(
            database_place("postgres://tally:s3cret@db.internal:6543/ledger?sslmode=disable"),
            "db.internal:6543/ledger"
        );
        assert_eq!(
            database_place(
                "host=127.0.0.1 port=5432 user=postgres password=s3cret dbname=postgres"
            ),
            "127.0.0.1:5432/postgres"
        );
        assert!(!database_place("postgres://u:s3cret@h/d").contains("s3cret"));
    }
}
