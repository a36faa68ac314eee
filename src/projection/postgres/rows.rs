//! Conversions between the projection's values and the Postgres rows that hold them.

use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, ToSql};
use uuid::Uuid;

use super::PgRow;
use crate::account::events::{pack_placement, unpack_placement};
use crate::account::holds::HoldId;
use crate::account::{AccountEvent, AccountId};
use crate::projection::RecentWrite;
use crate::projection::state::{Broken, Snapshot};

/// The index rows' upsert, the first half of every statement that moves a cursor. Arrays
/// `$1..$9` are one row each: account, event id, balance, version, kind, amount,
/// counterparty, expiry (the end of the retention), end of the window. A row already there
/// keeps the later of each pair of times, and is never taken back to an older landing of
/// its key (a record that ran late, after the key was written again past its retention,
/// would otherwise answer later retries with the old response). A row an older release
/// wrote has no window end: its expiry was its window's end.
pub(super) const INDEX_UPSERT: &str = "INSERT INTO tally_recent_writes AS r
        (account_id, event_id, balance_cents, version, event_kind, amount_cents,
         counterparty, expires_at_ms, window_ends_ms)
     SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int8[], $4::int8[], $5::int2[],
                          $6::int8[], $7::uuid[], $8::int8[], $9::int8[])
     ON CONFLICT (account_id, event_id) DO UPDATE
        SET balance_cents = EXCLUDED.balance_cents,
            version = EXCLUDED.version,
            event_kind = EXCLUDED.event_kind,
            amount_cents = EXCLUDED.amount_cents,
            counterparty = EXCLUDED.counterparty,
            expires_at_ms = GREATEST(r.expires_at_ms, EXCLUDED.expires_at_ms),
            window_ends_ms = GREATEST(COALESCE(r.window_ends_ms, r.expires_at_ms),
                                      EXCLUDED.window_ends_ms)
      WHERE r.version <= EXCLUDED.version";

/// The two lifetimes of an index row, in server time (epoch ms of the store's clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLife {
    /// The end of the window: until then the row is one of the account's recent writes,
    /// which a replica may hold in its warm copy.
    pub window_ends_ms: u64,
    /// The end of the retention: until then a retry of its key is answered from it, and
    /// then the sweep deletes it.
    pub expires_at_ms: u64,
}

/// The reason stored for a stream trimmed above the cursor.
const TRIMMED: &str = "trimmed";

/// Versions, sequences and server times are u64 in Tally and bigint in Postgres; none
/// comes near 2^63, and one that did is clamped rather than wrapped negative.
pub(super) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A column the projection wrote from a `u64`: a negative value is a row this code never
/// wrote (or a schema it does not know), refused rather than read as 0, a new account.
fn to_u64(v: i64, what: &str) -> Result<u64, String> {
    u64::try_from(v).map_err(|_| format!("the account row's {what} is negative ({v})"))
}

/// Column `i` of `row`, or why not (NULL where a value is due, another type): a row this
/// code did not write is an error to answer, never a panic.
fn col<'a, T: FromSql<'a>>(row: &'a Row, i: usize) -> Result<T, String> {
    row.try_get(i)
        .map_err(|e| format!("the account row's column {i} is unreadable: {e}"))
}

/// Index rows, column by column, for `unnest`.
#[derive(Default)]
pub(super) struct IndexRows {
    pub accounts: Vec<Uuid>,
    pub event_ids: Vec<Uuid>,
    pub balances: Vec<i64>,
    pub versions: Vec<i64>,
    pub kinds: Vec<i16>,
    pub amounts: Vec<i64>,
    pub parties: Vec<Option<Uuid>>,
    pub expires: Vec<i64>,
    pub window_ends: Vec<i64>,
}

impl IndexRows {
    /// One row: `w`'s answer (its own expiry is not used), living for `life`.
    pub fn push(&mut self, account: AccountId, event_id: u128, w: &RecentWrite, life: RowLife) {
        let (kind, amount, party) = match w.event {
            AccountEvent::Deposited { amount } => (1, amount, None),
            AccountEvent::Withdrawn { amount } => (2, amount, None),
            AccountEvent::TransferredOut { amount, to } => (3, amount, Some(to.0)),
            AccountEvent::TransferredIn { amount, from } => (4, amount, Some(from.0)),
            // The event's type major, as for the others (not in the first migration's list:
            // the column takes any kind, and an open has no amount).
            AccountEvent::Opened => (5, 0, None),
            // A placement keeps its expiry beside the amount, as the index does.
            AccountEvent::HoldPlaced {
                amount,
                to,
                expires_in_secs,
            } => (6, pack_placement(amount, expires_in_secs), to.map(|t| t.0)),
            AccountEvent::HoldPosted { hold, amount } => (7, amount, Some(hold.0)),
            AccountEvent::HoldVoided { hold } => (8, 0, Some(hold.0)),
            AccountEvent::HoldExpired { hold } => (9, 0, Some(hold.0)),
        };
        self.accounts.push(account.0);
        self.event_ids.push(Uuid::from_u128(event_id));
        self.balances.push(w.balance);
        self.versions.push(to_i64(w.version));
        self.kinds.push(kind);
        self.amounts.push(amount);
        self.parties.push(party);
        self.expires.push(to_i64(life.expires_at_ms));
        self.window_ends.push(to_i64(life.window_ends_ms));
    }

    /// The parameters `$1..$9` of [`INDEX_UPSERT`], in its column order, then `rest`: the
    /// embedding statement's own, from `$10`.
    pub fn params_then<'a>(
        &'a self,
        rest: &[&'a (dyn ToSql + Sync)],
    ) -> Vec<&'a (dyn ToSql + Sync)> {
        let mut params: Vec<&'a (dyn ToSql + Sync)> = vec![
            &self.accounts,
            &self.event_ids,
            &self.balances,
            &self.versions,
            &self.kinds,
            &self.amounts,
            &self.parties,
            &self.expires,
            &self.window_ends,
        ];
        params.extend_from_slice(rest);
        params
    }
}

fn event_of(kind: i16, amount: i64, party: Option<Uuid>) -> Result<AccountEvent, String> {
    Ok(match (kind, party) {
        (1, _) => AccountEvent::Deposited { amount },
        (2, _) => AccountEvent::Withdrawn { amount },
        (5, None) => AccountEvent::Opened,
        (3, Some(to)) => AccountEvent::TransferredOut {
            amount,
            to: AccountId(to),
        },
        (4, Some(from)) => AccountEvent::TransferredIn {
            amount,
            from: AccountId(from),
        },
        (6, to) => {
            let (amount, expires_in_secs) = unpack_placement(amount);
            AccountEvent::HoldPlaced {
                amount,
                to: to.map(AccountId),
                expires_in_secs,
            }
        }
        (7, Some(hold)) => AccountEvent::HoldPosted {
            hold: HoldId(hold),
            amount,
        },
        (8, Some(hold)) => AccountEvent::HoldVoided { hold: HoldId(hold) },
        (9, Some(hold)) => AccountEvent::HoldExpired { hold: HoldId(hold) },
        _ => return Err(format!("index row with event kind {kind} is malformed")),
    })
}

/// The columns that say why an account cannot be folded: (version, reason, trim point).
pub(super) fn broken_columns(b: Option<&Broken>) -> (Option<i64>, Option<String>, Option<i64>) {
    match b {
        None => (None, None, None),
        Some(Broken::Poisoned { version, reason }) => {
            (Some(to_i64(*version)), Some(reason.clone()), None)
        }
        Some(Broken::Trimmed { min_available }) => {
            (None, Some(TRIMMED.into()), Some(to_i64(*min_available)))
        }
        // Read back as poisoned: the Postgres projection never runs with holds on.
        Some(Broken::HoldsOff { version }) => (
            Some(to_i64(*version)),
            Some("a hold event, and the Postgres projection does not carry holds".into()),
            None,
        ),
    }
}

/// The rows of the load query: one per index row (a lookup hit, or a delta row when column
/// 14 says so; column 15 is its window's end), or one with NULL index columns.
pub(super) fn loaded(rows: &[Row]) -> Result<PgRow, String> {
    let mut out = PgRow::default();
    let Some(first) = rows.first() else {
        return Err("the account read returned no row".into());
    };
    let version: Option<i64> = col(first, 1)?;
    if let Some(version) = version {
        let snap = Snapshot {
            balance: col(first, 0)?,
            version: to_u64(version, "version")?,
            max_client_seq: to_u64(col(first, 2)?, "max_client_seq")?,
            held: 0,
            open_holds: 0,
            generation: 0,
        };
        let reason: Option<String> = col(first, 4)?;
        let broken = match reason {
            None => None,
            Some(r) if r == TRIMMED => Some(Broken::Trimmed {
                min_available: to_u64(col(first, 5)?, "trimmed_min_available")?,
            }),
            Some(reason) => Some(Broken::Poisoned {
                version: to_u64(col(first, 3)?, "broken_version")?,
                reason,
            }),
        };
        out.state = Some((snap, broken));
        out.server_ts_ms = to_u64(col(first, 6)?, "server timestamp")?;
    }
    for row in rows {
        let Some(event_id) = col::<Option<Uuid>>(row, 7)? else {
            continue;
        };
        let event = event_of(col(row, 10)?, col(row, 11)?, col(row, 12)?)?;
        let entry = (
            event_id.as_u128(),
            RecentWrite {
                balance: col(row, 8)?,
                version: to_u64(col(row, 9)?, "index version")?,
                expires_at_ms: to_u64(col(row, 13)?, "index expiry")?,
                event,
                // The table keeps no sequence: a run that lost an answer takes a landing
                // found here as possibly its own.
                write_tag: None,
            },
        );
        if col::<Option<bool>>(row, 14)? == Some(true) {
            let life = RowLife {
                window_ends_ms: to_u64(col(row, 15)?, "index window end")?,
                expires_at_ms: entry.1.expires_at_ms,
            };
            let (id, w) = entry;
            out.delta.get_or_insert_with(Vec::new).push((id, w, life));
        } else {
            out.hits.push(entry);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event an index row can hold reads back as itself: the open (kind 5, no amount,
    /// no counterparty) among them.
    #[test]
    fn every_event_kind_round_trips_through_an_index_row() {
        let party = AccountId(Uuid::from_u128(9));
        let events = [
            AccountEvent::Deposited { amount: 5 },
            AccountEvent::Withdrawn { amount: 6 },
            AccountEvent::TransferredOut {
                amount: 7,
                to: party,
            },
            AccountEvent::TransferredIn {
                amount: 8,
                from: party,
            },
            AccountEvent::Opened,
        ];
        let mut rows = IndexRows::default();
        for (i, &event) in events.iter().enumerate() {
            let w = RecentWrite {
                balance: 0,
                version: 1,
                expires_at_ms: 1,
                event,
                write_tag: None,
            };
            let life = RowLife {
                window_ends_ms: 1,
                expires_at_ms: 2,
            };
            rows.push(party, i as u128, &w, life);
        }
        for (i, &event) in events.iter().enumerate() {
            assert_eq!(
                event_of(rows.kinds[i], rows.amounts[i], rows.parties[i]),
                Ok(event)
            );
        }
        assert!(
            event_of(5, 0, Some(party.0)).is_err(),
            "an open names no party"
        );
    }
}
