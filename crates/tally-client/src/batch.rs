//! `POST /api/batch`: many writes in one request, each under its own key, with the retry
//! contract kept per item.
//!
//! Each round sends the items not yet settled. An item answered 2xx or final is settled
//! and never sent again. An item answered 409 `CONFLICT`, 429, 500 or 503 stays for the
//! next round, under its key. A round with no usable answer (a broken connection, a
//! timeout, a 502, 503 or 504 of the whole) keeps every item it carried. Each item has its
//! own window; the attempts and time bounds are the call's.

use bytes::Bytes;
use hyper::Method;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use uuid::Uuid;

use crate::client::{Answer, Call, Reach, api_error};
use crate::policy::{Meaning, meaning};
use crate::{
    AmountCents, ApiError, Balance, Client, Error, Failure, IdempotencyKey, Transferred, Written,
};

/// What one batch item does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemOp {
    Deposit {
        account: Uuid,
        amount: AmountCents,
    },
    Withdraw {
        account: Uuid,
        amount: AmountCents,
    },
    Transfer {
        from: Uuid,
        to: Uuid,
        amount: AmountCents,
    },
}

/// One write of a batch and the key it goes under. Made by [`BatchItem::deposit`],
/// [`BatchItem::withdraw`] or [`BatchItem::transfer`] with a minted key; give your own with
/// [`BatchItem::key`]. An item shares the single routes' key space: an item and a single
/// request with the same key and body are one write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchItem {
    op: ItemOp,
    key: IdempotencyKey,
}

impl BatchItem {
    pub fn deposit(account: Uuid, amount: AmountCents) -> Self {
        BatchItem::new(ItemOp::Deposit { account, amount })
    }

    pub fn withdraw(account: Uuid, amount: AmountCents) -> Self {
        BatchItem::new(ItemOp::Withdraw { account, amount })
    }

    pub fn transfer(from: Uuid, to: Uuid, amount: AmountCents) -> Self {
        BatchItem::new(ItemOp::Transfer { from, to, amount })
    }

    fn new(op: ItemOp) -> Self {
        BatchItem {
            op,
            key: IdempotencyKey::mint(),
        }
    }

    /// The key for this item's intent, in place of the minted one.
    pub fn key(mut self, key: IdempotencyKey) -> Self {
        self.key = key;
        self
    }

    pub fn idempotency_key(&self) -> &IdempotencyKey {
        &self.key
    }

    pub fn op(&self) -> ItemOp {
        self.op
    }
}

/// A settled item's answer: a deposit's or a withdrawal's balance, or a transfer's legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemValue {
    Balance(Balance),
    Transferred(Transferred),
}

/// One item's outcome, aligned with the items given to [`Client::batch`]:
///
/// - `Ok`: the item's 2xx, with its key, `replayed`, and the requests that carried it.
/// - [`Error::Refused`]: a final answer for this item (a 422, 400, 403, ...); it wrote
///   nothing.
/// - [`Error::WindowClosed`] or [`Error::Exhausted`]: it may have landed
///   ([`Error::outcome_unknown`]); resend it under its key within the window, or read the
///   account.
/// - [`Error::Unreachable`]: no request carrying it ever reached a connection.
/// - [`Error::Decode`]: a 2xx whose body is not the answer its type expects.
pub type ItemResult = Result<Written<ItemValue>, Error>;

/// An item as the batch body carries it: the single route's body plus the type and key.
#[derive(Serialize)]
#[serde(
    tag = "type",
    rename_all = "lowercase",
    rename_all_fields = "camelCase"
)]
enum WireItem<'a> {
    Deposit {
        account_id: Uuid,
        amount_cents: AmountCents,
        idempotency_key: &'a str,
    },
    Withdraw {
        account_id: Uuid,
        amount_cents: AmountCents,
        idempotency_key: &'a str,
    },
    Transfer {
        from_account_id: Uuid,
        to_account_id: Uuid,
        amount_cents: AmountCents,
        idempotency_key: &'a str,
    },
}

impl<'a> From<&'a BatchItem> for WireItem<'a> {
    fn from(item: &'a BatchItem) -> Self {
        let idempotency_key = item.key.as_str();
        match item.op {
            ItemOp::Deposit { account, amount } => WireItem::Deposit {
                account_id: account,
                amount_cents: amount,
                idempotency_key,
            },
            ItemOp::Withdraw { account, amount } => WireItem::Withdraw {
                account_id: account,
                amount_cents: amount,
                idempotency_key,
            },
            ItemOp::Transfer { from, to, amount } => WireItem::Transfer {
                from_account_id: from,
                to_account_id: to,
                amount_cents: amount,
                idempotency_key,
            },
        }
    }
}

#[derive(Serialize)]
struct WireBatch<'a> {
    items: Vec<WireItem<'a>>,
}

#[derive(Deserialize)]
struct WireAnswer {
    results: Vec<WireResult>,
}

/// One item's result as the server answers it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireResult {
    status: u16,
    #[serde(default)]
    body: serde_json::Value,
    idempotency_key: Option<String>,
    #[serde(default)]
    replayed: bool,
    /// Seconds a resend of the key stays safe, from this answer.
    idempotency_window: Option<u64>,
}

/// Where one item stands.
enum Slot {
    /// Not settled: sent again next round, if the window and the bounds allow.
    Open {
        /// The latest time a resend of its key is known safe (the least of its answers'
        /// windows, each from its own arrival).
        resend_by: Option<Instant>,
        reach: Reach,
        /// What its last round ended with (none before the first).
        last: Option<Failure>,
    },
    Settled(ItemResult),
}

/// How a round ended for the batch as a whole.
enum Round {
    /// Every item of the round got its own result.
    Answered,
    /// No item got its own result: every item sent stays open with this failure.
    Failed(Failure),
    /// The batch as a whole got a final answer (over a limit, not JSON, not allowed).
    Refused { status: u16, error: ApiError },
}

impl Client {
    /// `POST /api/batch`: sends every item, then resends, under the same keys, only the
    /// items not yet settled, as the retry contract allows each of them. Returns one
    /// [`ItemResult`] per item, in the order given.
    ///
    /// An error for the whole call means nothing was written: the batch was refused as a
    /// whole on its first send (400, 413, 415, 401, ...), or the base URL cannot be used.
    /// An empty list sends nothing and returns no results.
    ///
    /// ```no_run
    /// use tally_client::{AmountCents, BatchItem, Client, Error, IdempotencyKey};
    ///
    /// # async fn example(tally: &Client, accounts: &[uuid::Uuid]) -> Result<(), Error> {
    /// let items = accounts
    ///     .iter()
    ///     .enumerate()
    ///     .map(|(n, &account)| {
    ///         let key = IdempotencyKey::new(format!("payout-7-{n}"))?;
    ///         Ok(BatchItem::deposit(account, AmountCents::new(1_000)?).key(key))
    ///     })
    ///     .collect::<Result<Vec<_>, Error>>()?;
    /// for (account, result) in accounts.iter().zip(tally.batch(items).await?) {
    ///     match result {
    ///         Ok(written) => println!("{account}: landed under {}", written.key),
    ///         Err(e) if e.outcome_unknown() => println!("{account}: may have landed ({e})"),
    ///         Err(e) => println!("{account}: refused ({e})"),
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn batch(&self, items: Vec<BatchItem>) -> Result<Vec<ItemResult>, Error> {
        let uri = self.uri("/api/batch")?;
        let mut slots: Vec<Slot> = items
            .iter()
            .map(|_| Slot::Open {
                resend_by: None,
                reach: Reach::Nothing,
                last: None,
            })
            .collect();
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            let open: Vec<usize> = (0..slots.len())
                .filter(|&i| matches!(slots[i], Slot::Open { .. }))
                .collect();
            if open.is_empty() {
                break;
            }
            attempt += 1;
            let wire = WireBatch {
                items: open.iter().map(|&i| WireItem::from(&items[i])).collect(),
            };
            let call = Call {
                method: Method::POST,
                uri: uri.clone(),
                // Serialising plain structs with string keys cannot fail.
                body: Some(Bytes::from(serde_json::to_vec(&wire).unwrap_or_default())),
                key: None,
            };
            let budget = self.policy().total.saturating_sub(started.elapsed());
            let limit = self.policy().attempt_timeout.min(budget);
            let (round, asked) = match self.attempt(&call, limit).await {
                Ok(answer) => {
                    let asked = answer.retry_after;
                    (settle(&items, &open, &mut slots, attempt, answer), asked)
                }
                Err(failure) => (Round::Failed(failure), None),
            };
            match round {
                Round::Answered => {}
                Round::Failed(failure) => {
                    for &i in &open {
                        if let Slot::Open { reach, last, .. } = &mut slots[i] {
                            if !matches!(failure, Failure::Connect(_)) {
                                *reach = Reach::Maybe;
                            }
                            *last = Some(failure.clone());
                        }
                    }
                }
                Round::Refused { status, error } if attempt == 1 => {
                    return Err(Error::Refused {
                        status,
                        error,
                        key: None,
                    });
                }
                Round::Refused { status, error } => {
                    for &i in &open {
                        slots[i] = Slot::Settled(Err(Error::Refused {
                            status,
                            error: error.clone(),
                            key: Some(items[i].key.clone()),
                        }));
                    }
                }
            }
            let due = Instant::now() + self.wait_before_retry(attempt, asked);
            let mut resending = false;
            for &i in &open {
                if let Some(ended) =
                    self.may_resend_item(&items[i], &slots[i], attempt, started, due)
                {
                    slots[i] = Slot::Settled(Err(ended));
                }
                resending |= matches!(slots[i], Slot::Open { .. });
            }
            if resending {
                tokio::time::sleep_until(due).await;
            }
        }
        Ok(slots
            .into_iter()
            .map(|slot| match slot {
                Slot::Settled(result) => result,
                // The loop ends only once every slot is settled.
                Slot::Open { .. } => unreachable!("an open item after the last round"),
            })
            .collect())
    }

    /// Why an open item may not be sent at `due`: its window, the attempts, or the total
    /// time. `None` when it may (or when it is settled).
    fn may_resend_item(
        &self,
        item: &BatchItem,
        slot: &Slot,
        attempts: u32,
        started: Instant,
        due: Instant,
    ) -> Option<Error> {
        let Slot::Open {
            resend_by,
            reach,
            last,
        } = slot
        else {
            return None;
        };
        let last = last
            .clone()
            .unwrap_or(Failure::Timeout(self.policy().attempt_timeout));
        let key = item.key.clone();
        if resend_by.is_some_and(|by| due >= by) {
            return Some(Error::WindowClosed {
                key,
                attempts,
                last,
            });
        }
        let policy = self.policy();
        if attempts < policy.max_attempts && due - started < policy.total {
            return None;
        }
        let elapsed = started.elapsed();
        let key = Some(key);
        Some(match reach {
            Reach::Nothing => Error::Unreachable {
                key,
                attempts,
                elapsed,
                last,
            },
            Reach::Maybe => Error::Exhausted {
                key,
                attempts,
                elapsed,
                last,
            },
        })
    }
}

/// Applies one answer to the round's `open` items: settles the 2xx and final ones, keeps
/// the retryable ones open with their windows.
fn settle(
    items: &[BatchItem],
    open: &[usize],
    slots: &mut [Slot],
    attempt: u32,
    answer: Answer,
) -> Round {
    let arrived = Instant::now();
    if !(200..300).contains(&answer.status) {
        let error = api_error(&answer.body);
        return match meaning(answer.status, Some(&error)) {
            Meaning::Final => Round::Refused {
                status: answer.status,
                error,
            },
            // A 2xx is handled below; anything else is retried whole.
            Meaning::Retry | Meaning::Success => {
                if let Some(window) = answer.window {
                    for &i in open {
                        narrow_window(&mut slots[i], arrived + window);
                    }
                }
                Round::Failed(Failure::Answer {
                    status: answer.status,
                    error: Some(Box::new(error)),
                    retry_after: answer.retry_after,
                })
            }
        };
    }
    let results = match read_results(items, open, &answer) {
        Ok(results) => results,
        Err(detail) => {
            return Round::Failed(Failure::Unreadable {
                status: answer.status,
                detail,
            });
        }
    };
    for (&i, result) in open.iter().zip(results) {
        let error = (!(200..300).contains(&result.status)).then(|| item_error(&result.body));
        match meaning(result.status, error.as_ref()) {
            Meaning::Success => {
                slots[i] = Slot::Settled(decode_value(&items[i], &result).map(|value| Written {
                    value,
                    key: items[i].key.clone(),
                    replayed: result.replayed,
                    attempts: attempt,
                }));
            }
            Meaning::Final => {
                slots[i] = Slot::Settled(Err(Error::Refused {
                    status: result.status,
                    error: error.unwrap_or_else(|| item_error(&result.body)),
                    key: Some(items[i].key.clone()),
                }));
            }
            Meaning::Retry => {
                if let Some(secs) = result.idempotency_window {
                    narrow_window(
                        &mut slots[i],
                        arrived + std::time::Duration::from_secs(secs),
                    );
                }
                if let Slot::Open { reach, last, .. } = &mut slots[i] {
                    *reach = Reach::Maybe;
                    *last = Some(Failure::Answer {
                        status: result.status,
                        error: error.map(Box::new),
                        retry_after: answer.retry_after,
                    });
                }
            }
        }
    }
    Round::Answered
}

/// The answer's results, one per item sent, each naming its item's key when it names one.
fn read_results(
    items: &[BatchItem],
    open: &[usize],
    answer: &Answer,
) -> Result<Vec<WireResult>, String> {
    let wire: WireAnswer =
        serde_json::from_slice(&answer.body).map_err(|e| format!("not a batch answer: {e}"))?;
    if wire.results.len() != open.len() {
        return Err(format!(
            "{} results for {} items",
            wire.results.len(),
            open.len()
        ));
    }
    for (n, (&i, result)) in open.iter().zip(&wire.results).enumerate() {
        if let Some(key) = &result.idempotency_key
            && key != items[i].key.as_str()
        {
            return Err(format!(
                "result {n} names key {key:?}, its item {:?}",
                items[i].key.as_str()
            ));
        }
    }
    Ok(wire.results)
}

/// An item's error body, or (not Tally's shape) its text as the message.
fn item_error(body: &serde_json::Value) -> ApiError {
    serde_json::from_value(body.clone()).unwrap_or_else(|_| {
        let text = body.to_string();
        ApiError {
            code: String::new(),
            message: text.chars().take(200).collect(),
            error_id: None,
        }
    })
}

fn decode_value(item: &BatchItem, result: &WireResult) -> Result<ItemValue, Error> {
    let decoded = match item.op {
        ItemOp::Deposit { .. } | ItemOp::Withdraw { .. } => {
            serde_json::from_value(result.body.clone()).map(ItemValue::Balance)
        }
        ItemOp::Transfer { .. } => {
            serde_json::from_value(result.body.clone()).map(ItemValue::Transferred)
        }
    };
    decoded.map_err(|e| Error::Decode {
        status: result.status,
        detail: e.to_string(),
    })
}

/// Keeps the earlier of an open item's resend limit and `by`.
fn narrow_window(slot: &mut Slot, by: Instant) {
    if let Slot::Open { resend_by, .. } = slot {
        *resend_by = Some(resend_by.map_or(by, |b| b.min(by)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: an item on the wire is the single route's body plus its type and key, in
    /// camelCase, as the batch endpoint takes it.
    #[test]
    fn items_are_the_single_routes_bodies_with_a_type_and_a_key() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let amount = AmountCents::new(7).unwrap();
        let key = |k: &str| IdempotencyKey::new(k).unwrap();
        let items = [
            BatchItem::deposit(a, amount).key(key("d")),
            BatchItem::withdraw(a, amount).key(key("w")),
            BatchItem::transfer(a, b, amount).key(key("t")),
        ];
        let wire = WireBatch {
            items: items.iter().map(WireItem::from).collect(),
        };
        assert_eq!(
            serde_json::to_value(&wire).unwrap(),
            serde_json::json!({"items": [
                {"type": "deposit", "accountId": a, "amountCents": 7, "idempotencyKey": "d"},
                {"type": "withdraw", "accountId": a, "amountCents": 7, "idempotencyKey": "w"},
                {"type": "transfer", "fromAccountId": a, "toAccountId": b, "amountCents": 7,
                 "idempotencyKey": "t"},
            ]})
        );
    }

    #[test]
    fn items_get_minted_keys_unless_given_one() {
        let amount = AmountCents::new(1).unwrap();
        let (x, y) = (
            BatchItem::deposit(Uuid::nil(), amount),
            BatchItem::deposit(Uuid::nil(), amount),
        );
        assert_ne!(x.idempotency_key(), y.idempotency_key());
        let given = IdempotencyKey::new("mine").unwrap();
        assert_eq!(x.key(given.clone()).idempotency_key(), &given);
    }
}
