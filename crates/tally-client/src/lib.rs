//! A client for Tally's HTTP API with the retry contract built in.
//!
//! Every write Tally takes is safe to retry, exactly once, on any replica, **if** the retry
//! follows the rules of `docs/idempotency.md`. This crate follows them for you:
//!
//! - **A key on every write.** Give one with [`WriteCall::key`] (do, when the intent may be
//!   retried after this process gives up: a crash, a timeout of your own), or one is minted.
//!   [`Written::key`] and the error name it.
//! - **The same key on every retry**, and a retry only of what is not known to have landed:
//!   a 409 `CONFLICT` (in flight, or not known to have landed), a 503, a 500 (it can follow a
//!   write whose outcome is unknown), a 429, a balancer's 502 or 504, a timeout, a broken or
//!   refused connection.
//! - **`Retry-After` honoured**: no retry is sent before it (the backoff in
//!   [`RetryPolicy`] applies when the server asks for less or nothing).
//! - **The window respected**: a write-side answer's `Idempotency-Window` says how long a
//!   resend of its key stays safe. A retry that would go later is not sent: the call ends
//!   with [`Error::WindowClosed`], since the key may be forgotten by then and a resend could
//!   write twice.
//! - **A final answer is never retried**: a 422 (`INSUFFICIENT_FUNDS`,
//!   `IDEMPOTENCY_KEY_REUSED`, `VALIDATION_ERROR`), a 400, a 404, a 409 `ACCOUNT_EXISTS`
//!   and every other 4xx end the call with [`Error::Refused`]. A rule's refusal wrote
//!   nothing and is not remembered: to try the intent again later, use a new key.
//! - **Bounded**: at most [`RetryPolicy::max_attempts`] requests and
//!   [`RetryPolicy::total`] of time per call; then [`Error::Exhausted`] (or
//!   [`Error::Unreachable`] when no connection ever opened). `total` is at most
//!   [`MAX_CALL_TIME`], below the server's window less a write's life, so that even a write
//!   that never got an answer (and so no window) is not resent after its key may be gone.
//! - **Amounts checked before sending**: a write takes an [`AmountCents`], 1 to
//!   [`MAX_AMOUNT_CENTS`], the API's range. An amount Tally would refuse fails at
//!   [`AmountCents::new`], never at the server.
//!
//! - **Batches kept per item**: [`Client::batch`] sends many writes in one request, each
//!   under its own key. Each round resends only the items not yet settled (retryable
//!   answers, or a round the whole batch got no answer to), under the same keys, within each
//!   item's window and the call's bounds. An item answered 2xx or final is never resent.
//!
//! After [`Error::Exhausted`] or [`Error::WindowClosed`] on a write
//! ([`Error::outcome_unknown`]), the write may or may not have landed: never resend it under
//! a new key; read the account, or resend under the same key while the window lasts.
//! [`Error::Unreachable`] is different: no connection ever opened, so nothing was sent and
//! nothing was written.
//!
//! ```no_run
//! use tally_client::{AmountCents, Client, Error, IdempotencyKey};
//! use uuid::Uuid;
//!
//! # async fn example() -> Result<(), Error> {
//! let tally = Client::new("http://127.0.0.1:8080")?;
//! let alice = Uuid::new_v4();
//!
//! // The caller's own key: the order this deposit pays for.
//! let key = IdempotencyKey::new("order-42")?;
//! let deposit = tally
//!     .deposit(alice, AmountCents::new(5_000)?)
//!     .key(key)
//!     .send()
//!     .await?;
//! println!(
//!     "balance {} at version {} after {} attempt(s){}",
//!     deposit.value.balance_cents,
//!     deposit.value.aggregate_version,
//!     deposit.attempts,
//!     if deposit.replayed { ", replayed" } else { "" },
//! );
//!
//! match tally.withdraw(alice, AmountCents::new(9_000)?).send().await {
//!     Ok(w) => println!("now {}", w.value.balance_cents),
//!     Err(Error::Refused { status: 422, error, .. }) => println!("refused: {}", error.code),
//!     Err(e) if e.outcome_unknown() => println!("may have landed: read the account ({e})"),
//!     Err(e) => return Err(e),
//! }
//!
//! // Read your own write on any replica.
//! let read = tally
//!     .balance(alice, Some(deposit.value.aggregate_version))
//!     .await?;
//! assert!(read.aggregate_version >= deposit.value.aggregate_version);
//! # Ok(())
//! # }
//! ```
//!
//! HTTP is hyper's own client (a keep-alive pool per [`Client`], HTTP/1, no TLS: Tally
//! serves plain HTTP behind its balancer). With `--auth jwt`, give the token to
//! [`ClientBuilder::bearer_token`]: keys then belong to the token's caller, and are sent byte
//! for byte as given.

mod amount;
mod batch;
mod client;
mod error;
mod key;
mod policy;
mod types;

pub use amount::{AmountCents, MAX_AMOUNT_CENTS};
pub use batch::{BatchItem, ItemOp, ItemResult, ItemValue};
pub use client::{Client, ClientBuilder, MAX_ANSWER_BYTES, WriteCall};
pub use error::{Error, Failure};
pub use key::{IdempotencyKey, MAX_KEY_LEN};
pub use policy::{MAX_CALL_TIME, Meaning, RetryPolicy, meaning};
pub use types::{
    ApiError, Balance, EventKind, History, HistoryEvent, Opened, Transferred, Writer, Written,
};
