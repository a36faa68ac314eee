//! The balance read: from the fold, caught up first, or with `min_version` from the local
//! fold when it already has that version (read-your-writes for a client that wrote through
//! another replica), else after a few catch-ups.

use std::time::Duration;

use crate::account::AccountId;
use crate::projection::Snapshot;

use super::{AccountReader, ReadError};

/// Catch-ups a `min_version` balance read tries before giving up with
/// [`ReadError::NotVisibleYet`].
pub(super) const MIN_VERSION_ATTEMPTS: u32 = 5;
const MIN_VERSION_BACKOFF: Duration = Duration::from_millis(20);

/// An account's balance at a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Balance {
    pub balance_cents: i64,
    pub version: u64,
    /// The sum of the open holds (0 with holds off).
    pub held_cents: i64,
}

impl From<Snapshot> for Balance {
    fn from(s: Snapshot) -> Self {
        Self {
            balance_cents: s.balance,
            version: s.version,
            held_cents: s.held,
        }
    }
}

impl AccountReader {
    /// The account's balance. With `min_version`, at that version or newer: read-your-writes
    /// for a client that wrote through another replica. Answers from the local fold when it
    /// already has that version, else catches up (a few times, with a pause between) and
    /// gives up with [`ReadError::NotVisibleYet`]. Without it, always catches up first.
    pub async fn balance(
        &self,
        account: AccountId,
        min_version: Option<u64>,
    ) -> Result<Balance, ReadError> {
        // A read-your-writes read this replica can already satisfy needs no store round trip.
        if let Some(min) = min_version
            && let Some(snap) = self.local_snapshot(account).await?
            && snap.version >= min.max(1)
        {
            return Ok(snap.into());
        }
        let mut attempt = 0;
        loop {
            let snap = self.projection.refresh(account, &[]).await?.snap;
            if min_version.is_none_or(|min| snap.version >= min) {
                self.confirm_empty(account, snap.version).await?;
                return Ok(snap.into());
            }
            let min = min_version.expect("only a min version can be unmet");
            if attempt == 0 {
                self.check_reachable(account, min).await?;
            }
            attempt += 1;
            if attempt >= MIN_VERSION_ATTEMPTS {
                return Err(ReadError::NotVisibleYet { min_version: min });
            }
            tokio::time::sleep(MIN_VERSION_BACKOFF).await;
        }
    }

    /// On the first miss of a `min_version` read, asks the store how far the account goes
    /// (one details call, only when this replica's catch-up fell short): a version the store
    /// has not reached is refused at once, as the watch route refuses a resume beyond the
    /// tip, instead of a retryable 503 that no retry can turn into an answer. A version the
    /// store has is this replica's lag, and the catch-ups go on. Decides nothing (the read
    /// stays retryable) when the details call fails, or says the account has no version
    /// yet: a Celeriant server was found to hide a new account's create from its details
    /// call as well as its reads (docs/stores.md), so "no version" may be a create that
    /// landed, and a final 400 for the version its writer was given would be wrong.
    async fn check_reachable(&self, account: AccountId, min_version: u64) -> Result<(), ReadError> {
        let current = match self.projection.store_version(account).await {
            Ok(v) if v > 0 => v,
            Ok(_) | Err(_) => return Ok(()),
        };
        if min_version > current {
            return Err(ReadError::MinVersionBeyondTip {
                min_version,
                current,
            });
        }
        Ok(())
    }

    /// The account's state when the projection can answer without a store read (the memory
    /// fold: caught up at least once and not broken; Postgres: the shared row). The write
    /// loop makes the same check before a first attempt at the local cursor.
    async fn local_snapshot(&self, account: AccountId) -> Result<Option<Snapshot>, ReadError> {
        Ok(self
            .projection
            .current(account, &[])
            .await?
            .map(|loaded| loaded.snap))
    }
}
