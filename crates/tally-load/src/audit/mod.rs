//! The exactly-once audit that ends a run: reads every touched account's full history
//! (paged) and holds each idempotency key against the answers the client saw.
//!
//! `history` reads the streams back, `check` applies the rules (pure), `findings` is what
//! the report shows; [`audit`] re-reads the accounts where a key looked lost or
//! half-applied, since replicas may lag, before it settles the verdict.

mod check;
mod findings;
mod history;

pub use check::evaluate;
pub use findings::{ExactlyOnce, MAX_REPORTED_VIOLATIONS, Verdict, Violation, ViolationKind};
pub use history::{
    HISTORY_BACKOFF, HISTORY_BACKOFF_STEPS, HISTORY_MAX_ATTEMPTS, HISTORY_PAGE_LIMIT, HistoryEvent,
    MAX_HISTORY_PAGES, READ_CONCURRENCY, StreamRead, Streams,
};

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::cli::Config;
use crate::http::Client;
use crate::ledger::KeyRecord;
use history::read_streams;

/// Re-reads of accounts where a key looked lost or half-applied (replicas may lag).
pub const SETTLE_ROUNDS: u32 = 5;
/// Pause before each settle round, multiplied by the round number.
pub const SETTLE_DELAY: Duration = Duration::from_millis(200);
/// Hard ceiling on the whole audit.
pub const AUDIT_DEADLINE: Duration = Duration::from_secs(600);

/// Reads history for every account `records` touched and checks each key.
pub async fn audit(config: &Config, client: &Client, records: &[KeyRecord]) -> ExactlyOnce {
    let deadline = Instant::now() + AUDIT_DEADLINE;
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
        let (found, unsettled) = evaluate(records, &streams);
        if unsettled.is_empty() || round >= SETTLE_ROUNDS || Instant::now() >= deadline {
            return found.conclude(error);
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
