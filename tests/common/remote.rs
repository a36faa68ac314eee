//! A plain HTTP client for one base URL (nginx in front of replicas, or one `tally`
//! process): the API's keyed writes and its reads, each answer read whole.

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Reply, leg};

/// History page size: small, so that following `nextFromVersion` is exercised.
pub const HISTORY_PAGE: u64 = 3;
/// Most history pages read for one stream before the read counts as runaway.
pub const MAX_HISTORY_PAGES: usize = 1000;

/// A plain HTTP client for one base URL (nginx or one replica).
#[derive(Clone)]
pub struct Remote {
    pub base: String,
    pub client: reqwest::Client,
}

impl Remote {
    pub fn new(base: &str, client: &reqwest::Client) -> Self {
        Remote {
            base: base.to_owned(),
            client: client.clone(),
        }
    }

    /// `host:port`, as nginx names an upstream in `X-Tally-Upstream`.
    pub fn authority(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    pub async fn get(&self, path: &str) -> Reply {
        let resp = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {}{path}: {e}", self.base));
        super::read(resp).await
    }

    pub async fn post(&self, path: &str, body: &Value, key: &str) -> Reply {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {}{path}: {e}", self.base));
        super::read(resp).await
    }

    pub async fn deposit(&self, account: &str, cents: i64, key: &str) -> Reply {
        let path = format!("/api/accounts/{account}/deposit");
        self.post(&path, &json!({ "amountCents": cents }), key)
            .await
    }

    pub async fn withdraw(&self, account: &str, cents: i64, key: &str) -> Reply {
        let path = format!("/api/accounts/{account}/withdraw");
        self.post(&path, &json!({ "amountCents": cents }), key)
            .await
    }

    /// `POST /api/transfers` (nginx spreads these at random).
    pub async fn transfer(&self, from: &str, to: &str, cents: i64, key: &str) -> Reply {
        let body = json!({ "fromAccountId": from, "toAccountId": to, "amountCents": cents });
        self.post("/api/transfers", &body, key).await
    }

    /// `POST /api/accounts/{from}/transfers` (nginx routes these by the payer).
    pub async fn account_transfer(&self, from: &str, to: &str, cents: i64, key: &str) -> Reply {
        let body = json!({ "toAccountId": to, "amountCents": cents });
        self.post(&format!("/api/accounts/{from}/transfers"), &body, key)
            .await
    }

    pub async fn balance(&self, account: &str) -> (i64, u64) {
        let r = self.get(&format!("/api/accounts/{account}/balance")).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "balance on {}: {}",
            self.base,
            r.text
        );
        leg(&r.body)
    }

    /// Every event of the stream, following `nextFromVersion` over small pages.
    pub async fn history(&self, account: &str) -> Vec<Value> {
        let mut events: Vec<Value> = Vec::new();
        let mut from = 1u64;
        for _ in 0..MAX_HISTORY_PAGES {
            let r = self
                .get(&format!(
                    "/api/accounts/{account}/history?fromVersion={from}&limit={HISTORY_PAGE}"
                ))
                .await;
            assert_eq!(
                r.status,
                StatusCode::OK,
                "history on {}: {}",
                self.base,
                r.text
            );
            let page = r.body["events"].as_array().cloned().unwrap_or_default();
            assert!(
                page.len() as u64 <= HISTORY_PAGE,
                "a page holds at most its limit: {}",
                r.text
            );
            for e in &page {
                let v = e["aggregateVersion"].as_u64().expect("aggregateVersion");
                let last = events.last().and_then(|l| l["aggregateVersion"].as_u64());
                assert!(
                    last.is_none_or(|l| v > l),
                    "history versions rise across pages: {v} after {last:?}"
                );
            }
            events.extend(page);
            match r.body["nextFromVersion"].as_u64() {
                Some(next) => {
                    assert!(next > from, "nextFromVersion moves on: {}", r.text);
                    from = next;
                }
                None => return events,
            }
        }
        panic!("history of {account} on {} did not end", self.base);
    }
}
