//! One API operation: what it does, and how it is sent.

use std::time::Duration;

use bytes::Bytes;
use hyper::Method;
use uuid::Uuid;

use crate::conn::WorkerConn;
use crate::http::{Client, Outcome, Target, TransportError, exchange};

/// What one operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Deposit,
    Withdraw,
    Transfer,
    Balance,
}

/// One API operation; `to` is set for transfers only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    pub account: Uuid,
    pub to: Option<Uuid>,
    pub amount_cents: i64,
}

impl Op {
    /// A deposit of `amount_cents` into `account`.
    pub fn deposit(account: Uuid, amount_cents: i64) -> Self {
        Op {
            kind: OpKind::Deposit,
            account,
            to: None,
            amount_cents,
        }
    }

    /// True for operations that carry an idempotency key.
    pub fn is_write(&self) -> bool {
        self.kind != OpKind::Balance
    }

    /// This write as an item of `POST /api/batch`: the single route's body plus its type
    /// and `key`. None for a read, which the batch endpoint does not take.
    pub fn batch_item(&self, key: Uuid) -> Option<serde_json::Value> {
        let key = key.to_string();
        let single = |kind: &str| {
            serde_json::json!({
                "type": kind,
                "accountId": self.account.to_string(),
                "amountCents": self.amount_cents,
                "idempotencyKey": key,
            })
        };
        match (self.kind, self.to) {
            (OpKind::Deposit, _) => Some(single("deposit")),
            (OpKind::Withdraw, _) => Some(single("withdraw")),
            (OpKind::Transfer, Some(to)) => Some(serde_json::json!({
                "type": "transfer",
                "fromAccountId": self.account.to_string(),
                "toAccountId": to.to_string(),
                "amountCents": self.amount_cents,
                "idempotencyKey": key,
            })),
            (OpKind::Transfer, None) | (OpKind::Balance, _) => None,
        }
    }

    fn method(&self) -> Method {
        if self.is_write() {
            Method::POST
        } else {
            Method::GET
        }
    }

    fn path(&self) -> String {
        let suffix = match self.kind {
            OpKind::Deposit => "deposit",
            OpKind::Withdraw => "withdraw",
            OpKind::Transfer => "transfers",
            OpKind::Balance => "balance",
        };
        format!("/api/accounts/{}/{suffix}", self.account)
    }

    fn body(&self) -> Option<Bytes> {
        let value = match (self.kind, self.to) {
            (OpKind::Balance, _) => return None,
            (OpKind::Transfer, Some(to)) => serde_json::json!({
                "toAccountId": to.to_string(),
                "amountCents": self.amount_cents,
            }),
            _ => serde_json::json!({ "amountCents": self.amount_cents }),
        };
        Some(Bytes::from(value.to_string()))
    }
}

/// Sends `op` to `target`, with `key` as its Idempotency-Key when given.
pub async fn send_op(
    client: &Client,
    target: &Target,
    op: &Op,
    key: Option<Uuid>,
    timeout: Duration,
) -> Outcome {
    let uri = target.uri(&op.path()).map_err(|detail| TransportError {
        kind: "request",
        detail,
    })?;
    let key = key.map(|k| k.to_string());
    exchange(client, op.method(), uri, key.as_deref(), op.body(), timeout).await
}

/// Sends `op` over a worker's own connection, with `key` as its Idempotency-Key when given.
pub async fn send_op_on(
    conn: &mut WorkerConn,
    op: &Op,
    key: Option<Uuid>,
    timeout: Duration,
) -> Outcome {
    let key = key.map(|k| k.to_string());
    conn.exchange(op.method(), &op.path(), key.as_deref(), op.body(), timeout)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_camel_case_json() {
        let a = Uuid::nil();
        let t = Op {
            kind: OpKind::Transfer,
            account: a,
            to: Some(a),
            amount_cents: 7,
        };
        let v: serde_json::Value = serde_json::from_slice(&t.body().unwrap()).unwrap();
        assert_eq!(v["amountCents"], 7);
        assert_eq!(v["toAccountId"], a.to_string());
        assert_eq!(t.path(), format!("/api/accounts/{a}/transfers"));
    }

    /// Rule: a batch item is the single route's body plus its type and key; a read is no item.
    #[test]
    fn batch_items_name_their_type_accounts_and_key() {
        let (a, b, k) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        let t = Op {
            kind: OpKind::Transfer,
            account: a,
            to: Some(b),
            amount_cents: 7,
        };
        assert_eq!(
            t.batch_item(k).unwrap(),
            serde_json::json!({"type": "transfer", "fromAccountId": a.to_string(),
                "toAccountId": b.to_string(), "amountCents": 7, "idempotencyKey": k.to_string()})
        );
        let w = Op {
            kind: OpKind::Withdraw,
            to: None,
            ..t
        };
        assert_eq!(
            w.batch_item(k).unwrap(),
            serde_json::json!({"type": "withdraw", "accountId": a.to_string(),
                "amountCents": 7, "idempotencyKey": k.to_string()})
        );
        assert_eq!(Op::deposit(a, 7).batch_item(k).unwrap()["type"], "deposit");
        let read = Op {
            kind: OpKind::Balance,
            to: None,
            ..t
        };
        assert_eq!(read.batch_item(k), None);
    }
}
