//! The one write loop, shared by every operation (deposit, withdraw, transfer, and batches of
//! single-account operations on a hot account).
//!
//! Each attempt: get fresh state (catch up; on the first attempt of a warm account, the
//! local fold, trusting the version guard to bounce a stale decision), answer from the
//! recent-writes index if the request already landed, decide on that state, then append
//! with `expected_version` + `client_seq` + `event_id`, and classify the outcome:
//!
//! | outcome | what it means | next |
//! |---|---|---|
//! | success | landed | index it, bump the cursor, answer |
//! | `Conflict` (2003) | rejected; the world changed | catch up, re-decide, fresh sequence |
//! | `OutcomeUnknown` | may have landed | hold the sequence; catch up (refreshing the version and checking the index) before writing again |
//! | `InflightDuplicate` (2013) | an earlier attempt is not yet durable | hold, back off, retry |
//! | `IdempotencyViolation` (2002) | someone landed this sequence | point-read it: ours = landed; a sibling's = re-derive; nothing visible = refuse to guess |
//! | `NotApplied` | definitely not applied | retry as is after backoff |
//!
//! A sequence is re-derived only on fresh state, after a catch-up that checked the index:
//! never straight after an ambiguous failure. A business-rule rejection is final only on state
//! that reached the store's tip: a local fold or a lagging read may hide an earlier landing of
//! the very request being rejected.
//!
//! Where each part lives:
//! - [`service`]: the entry point, and the one place that leads a request through the
//!   parts below: admission, coalescing, its account's lane, the run;
//! - `coalesce`: duplicates of one key on this replica wait for the first (`Coalescer`,
//!   `Leader::follow`) and share its answer;
//! - `lanes`: the write side's per-account lane (the gate one writer holds, and the queue),
//!   and batching (`Lane::join`, `Lane::turn`, `Lane::take_batch`): a writer takes the
//!   queue out as one batch;
//! - `run`: one run of the loop over one request or one batch: each member's `Phase`,
//!   `SeqHold` and `EarlierAttempts`, and the `drive` function that owns every branch;
//! - `decide`: the business rules over a run's members, as a pure function;
//! - `classify`: what a store outcome means for the run, as a pure function;
//! - `find`: a write found by its key without resending it ([`WriteService::find_write`]),
//!   proven landed, proven absent, or a retryable error;
//! - [`verify`]: who owns a contested sequence (the 2002 arm's point read);
//! - leaves that use no other part: `error` ([`WriteError`], and what a broken invariant
//!   answers) and `arm` (the arm a step took, with its metric label).

mod arm;
mod classify;
mod coalesce;
pub mod config;
mod decide;
mod error;
pub mod expiry;
mod find;
mod lanes;
mod run;
pub mod service;
pub mod sweeper;
pub mod verify;

use std::time::Duration;

use crate::account::{AccountId, AccountsMode, Operation};

pub use coalesce::AnsweringAttempt;
pub use error::WriteError;
pub use find::Found;
pub use service::WriteService;

/// Store writes one request may make before it gives up with a retryable error.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 12;
/// How long one request may spend in the loop before it gives up with a retryable error.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);
/// The most single-account operations written together as one batch.
pub const DEFAULT_MAX_BATCH_EVENTS: usize = 64;
/// The most requests alive on the write side of one replica at once (running, queued in a
/// lane, or waiting for a duplicate's answer). It bounds what runs, not what HTTP admits:
/// a write goes on after its client disconnects, and it still counts here until it ends.
pub const DEFAULT_MAX_LIVE_WRITES: usize = 1024;
/// The most single-account requests waiting in one account's lane. Beyond it a request waits
/// for a place (first come first served) and is refused retryably (503) only when its
/// deadline passes first: at most `max_batch_events` go per store write, so a queue several
/// batches deep already waits several store round trips, and a longer one would only hold
/// more requests that time out. Those waiting for a place are bounded by the live-writes cap.
pub const DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT: usize = 256;

#[derive(Clone, Copy, Debug)]
pub struct WriteConfig {
    pub max_attempts: u32,
    pub deadline: Duration,
    /// First attempt on a warm account writes at the local cursor without a catch-up read.
    pub one_round_trip: bool,
    /// Single-account operations on one account queue behind one writer and go together.
    pub batching: bool,
    pub max_batch_events: usize,
    /// See [`DEFAULT_MAX_LIVE_WRITES`].
    pub max_live_writes: usize,
    /// See [`DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT`].
    pub max_queued_per_account: usize,
    /// Whether a write needs an account that exists (`--accounts`).
    pub accounts: AccountsMode,
}

impl Default for WriteConfig {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            deadline: DEFAULT_DEADLINE,
            one_round_trip: true,
            batching: true,
            max_batch_events: DEFAULT_MAX_BATCH_EVENTS,
            max_live_writes: DEFAULT_MAX_LIVE_WRITES,
            max_queued_per_account: DEFAULT_MAX_QUEUED_WRITES_PER_ACCOUNT,
            accounts: AccountsMode::Implicit,
        }
    }
}

/// One caller intent: an operation and the request's event id (its idempotency key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRequest {
    pub op: Operation,
    pub event_id: u128,
}

/// One account's part of a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LegResult {
    pub account: AccountId,
    pub balance: i64,
    pub version: u64,
}

/// A write that is proven to have landed, with the response it produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteOutcome {
    /// In the operation's leg order (a transfer: payer, then payee).
    pub legs: Vec<LegResult>,
    /// Answered from an earlier request's result, not from this request's own write.
    pub replayed: bool,
}

/// What a request gets back from the write loop.
pub type Answer = Result<WriteOutcome, WriteError>;
