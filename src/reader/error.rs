//! [`ReadError`]: why a read cannot be answered, retryable or final, and how a projection
//! error becomes one. `http::error` maps it to a response.

use crate::account::AccountId;
use crate::projection::ProjectionError;
use crate::store::StoreError;

/// Why a read cannot be answered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// Retryable: this replica has not seen the asked-for version yet (read-your-writes
    /// against another replica's write).
    #[error("this replica has not yet seen version {min_version} of the account")]
    NotVisibleYet { min_version: u64 },
    /// Final: the store itself says the account has not reached `min_version`, so no
    /// replica can answer it (a version no write has produced; retrying cannot help).
    #[error(
        "minVersion {min_version} is beyond the account's newest version ({current}) in the store"
    )]
    MinVersionBeyondTip { min_version: u64, current: u64 },
    /// Retryable: the history read showed nothing where the fold has events (a lagging
    /// read). An empty page pointing at itself would stop a client that follows the pages.
    #[error(
        "the store's read shows nothing from version {from_version}, but the account is at {current}; retry"
    )]
    HistoryBehindFold { from_version: u64, current: u64 },
    /// Retryable: the history read showed versions the fold could not reach even after
    /// folding again (a lagging read), so no balance at the page's current version can be
    /// given. Never a balance of an older version next to a newer `currentAggregateVersion`.
    #[error("the account's fold lags behind version {seen} of its history; retry")]
    BalanceBehindHistory { seen: u64 },
    /// Retryable: the fold cannot say how far the stream goes (it is trimmed or poisoned),
    /// and the store's details call that would say it failed. Without the tip a full page
    /// would look like the last one, and a client following the pages would stop early.
    #[error("the store could not say where the account's stream ends ({}); retry", .0.brief())]
    HistoryTipUnknown(StoreError),
    /// The page size asked for is outside `1..=MAX_HISTORY_LIMIT`.
    #[error("limit must be 1..={max}")]
    LimitOutOfRange { max: usize },
    /// An event in the stream could not be decoded or applied: the account is poisoned.
    #[error("account {account} is unreadable at version {version}: {reason}")]
    Unreadable {
        account: AccountId,
        version: u64,
        reason: String,
    },
    /// The stream was trimmed above the fold's cursor, so the balance cannot be derived.
    #[error(
        "account {account} stream is trimmed below version {min_available}; its balance cannot be folded"
    )]
    Trimmed {
        account: AccountId,
        min_available: u64,
    },
    /// The store did not answer, or answered an error.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The Postgres projection's database did not answer. Retryable.
    #[error("the projection database did not answer; retry shortly")]
    Database,
    /// Retryable: the store's reads show none of the account's events, but the store says
    /// the account is at `version`. Never a balance of 0 at version 0 for an account that
    /// exists (a server found to hide a new aggregate's head from reads; docs/stores.md).
    #[error(
        "the store says the account is at version {version}, but its reads show none of its events yet; retry"
    )]
    StoreHidesEvents { version: u64 },
    /// Accounts are explicit and the store has no stream for this one: it was never opened.
    #[error("account {account} was never opened")]
    AccountNotFound { account: AccountId },
    /// The account has holds and this replica runs with holds off.
    #[error("{0}")]
    HoldsOff(String),
}

impl From<ProjectionError> for ReadError {
    fn from(e: ProjectionError) -> Self {
        match e {
            ProjectionError::Poisoned {
                account,
                version,
                reason,
            } => ReadError::Unreadable {
                account,
                version,
                reason,
            },
            ProjectionError::Trimmed {
                account,
                min_available,
            } => ReadError::Trimmed {
                account,
                min_available,
            },
            ProjectionError::Store(s) => ReadError::Store(s),
            ProjectionError::Database => ReadError::Database,
            e @ ProjectionError::HoldsOff { .. } => ReadError::HoldsOff(e.to_string()),
        }
    }
}
