//! Black-box helpers: spawn Tally instances on port 0 (alone, or as a fleet over one shared
//! store) and talk to them over HTTP.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use reqwest::StatusCode;
use reqwest::header::HeaderMap;
use serde_json::Value;
use tally::app::App;
use tally::config::Config;
use tally::projection::Clock;
use tally::store::SharedLog;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One running instance.
pub struct TestApp {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

/// A configuration for tests: loopback, port 0, no demo accounts unless asked.
pub fn test_config(extra: &[&str]) -> Config {
    use clap::Parser;
    let mut args = vec![
        "tally",
        "--listen",
        "127.0.0.1:0",
        "--seed-demo-accounts",
        "false",
    ];
    args.extend_from_slice(extra);
    Config::parse_from(args)
}

pub async fn spawn(
    config: Config,
    store: Option<SharedLog>,
    clock: Option<Arc<dyn Clock>>,
) -> TestApp {
    let mut builder = App::builder(config);
    if let Some(s) = store {
        builder = builder.store(s);
    }
    if let Some(c) = clock {
        builder = builder.clock(c);
    }
    let app = builder.build().await.expect("app builds");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(tally::http::serve(app.clone(), listener, async {
        let _ = rx.await;
    }));
    TestApp {
        addr,
        app,
        client: reqwest::Client::new(),
        shutdown: Some(tx),
        server: Some(server),
    }
}

/// One instance over its own embedded store.
pub async fn spawn_default() -> TestApp {
    spawn(test_config(&[]), None, None).await
}

/// `n` instances sharing one store: a fleet in one process.
pub async fn spawn_fleet(n: usize, store: SharedLog, extra: &[&str]) -> Vec<TestApp> {
    let mut fleet = Vec::with_capacity(n);
    for _ in 0..n {
        fleet.push(spawn(test_config(extra), Some(store.clone()), None).await);
    }
    fleet
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub text: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub fn error_code(&self) -> &str {
        self.body["error"].as_str().unwrap_or("")
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn get(&self, path: &str) -> Reply {
        read(
            self.client
                .get(self.url(path))
                .send()
                .await
                .expect("GET sent"),
        )
        .await
    }

    /// POSTs JSON with an optional Idempotency-Key.
    pub async fn post(&self, path: &str, body: &Value, key: Option<&str>) -> Reply {
        let mut req = self.client.post(self.url(path)).json(body);
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        read(req.send().await.expect("POST sent")).await
    }

    pub async fn deposit(&self, account: &str, cents: i64, key: Option<&str>) -> Reply {
        self.post(
            &format!("/api/accounts/{account}/deposit"),
            &serde_json::json!({ "amountCents": cents }),
            key,
        )
        .await
    }

    pub async fn withdraw(&self, account: &str, cents: i64, key: Option<&str>) -> Reply {
        self.post(
            &format!("/api/accounts/{account}/withdraw"),
            &serde_json::json!({ "amountCents": cents }),
            key,
        )
        .await
    }

    pub async fn transfer(&self, from: &str, to: &str, cents: i64, key: Option<&str>) -> Reply {
        self.post(
            "/api/transfers",
            &serde_json::json!({ "fromAccountId": from, "toAccountId": to, "amountCents": cents }),
            key,
        )
        .await
    }

    pub async fn balance(&self, account: &str) -> (i64, u64) {
        let r = self.get(&format!("/api/accounts/{account}/balance")).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        (
            r.body["balanceCents"].as_i64().expect("balance"),
            r.body["aggregateVersion"].as_u64().expect("version"),
        )
    }

    /// Every event of the account's history, following pages.
    pub async fn history(&self, account: &str) -> Vec<Value> {
        let mut events = Vec::new();
        let mut from = 1u64;
        loop {
            let r = self
                .get(&format!(
                    "/api/accounts/{account}/history?fromVersion={from}&limit=1000"
                ))
                .await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.text);
            events.extend(r.body["events"].as_array().cloned().unwrap_or_default());
            match r.body["nextFromVersion"].as_u64() {
                Some(next) => from = next,
                None => return events,
            }
        }
    }

    /// Stops accepting and drains, as SIGTERM does; returns when the server has stopped.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.expect("server task");
        }
    }
}

async fn read(resp: reqwest::Response) -> Reply {
    let status = resp.status();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::Null);
    Reply {
        status,
        headers,
        body,
        text,
    }
}

/// A fresh random account id.
pub fn new_account() -> String {
    uuid::Uuid::new_v4().to_string()
}
