//! What the outbox holds, per account: pending, in flight, synced.

use serde::Serialize;

use super::{Outbox, OutboxError, OutboxResult, from_sql};

/// One account's queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AccountStatus {
    pub account: String,
    /// Recorded, not in a run yet.
    pub pending: u64,
    /// In the open run (sent at least once, or about to be).
    pub in_flight: u64,
    pub synced: u64,
    /// The last sequence assigned for this account.
    pub last_seq: u64,
    pub run_attempts: Option<u64>,
    pub last_error: Option<String>,
}

/// The whole outbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub device_id: String,
    pub pending: u64,
    pub in_flight: u64,
    pub synced: u64,
    pub accounts: Vec<AccountStatus>,
}

impl Outbox {
    /// Pending, in-flight and synced counts, per account and in total.
    pub fn status(&self) -> OutboxResult<Status> {
        let mut stmt = self.conn.prepare(
            "SELECT s.account, s.last_seq,
                    sum(e.synced_at_ms IS NOT NULL),
                    sum(e.synced_at_ms IS NULL AND r.account IS NOT NULL
                        AND e.client_seq BETWEEN r.first_seq AND r.last_seq),
                    count(e.id), r.attempts, r.last_error
             FROM sequences s
             JOIN events e ON e.account = s.account
             LEFT JOIN runs r ON r.account = s.account
             GROUP BY s.account ORDER BY s.account",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, Option<i64>>(5)?,
                r.get::<_, Option<String>>(6)?,
            ))
        })?;
        let mut status = Status {
            device_id: self.device.to_string(),
            pending: 0,
            in_flight: 0,
            synced: 0,
            accounts: Vec::new(),
        };
        for row in rows {
            let (account, last_seq, synced, in_flight, total, attempts, last_error) = row?;
            let (synced, in_flight, total) =
                (from_sql(synced)?, from_sql(in_flight)?, from_sql(total)?);
            let pending = total
                .checked_sub(synced + in_flight)
                .ok_or_else(|| OutboxError::Corrupt(format!("counts of {account} disagree")))?;
            status.pending += pending;
            status.in_flight += in_flight;
            status.synced += synced;
            status.accounts.push(AccountStatus {
                account,
                pending,
                in_flight,
                synced,
                last_seq: from_sql(last_seq)?,
                run_attempts: attempts.map(from_sql).transpose()?,
                last_error,
            });
        }
        Ok(status)
    }
}
