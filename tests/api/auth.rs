//! Black box: callers prove who they are, may do only what their token grants,
//! own their idempotency keys, and are paced; every refusal is answered correctly and writes
//! nothing (checked by reading the balance and history back with a valid token).

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::test_auth::{AUDIENCE, ISSUER, SECRET, secret_file, token};
use common::{Reply, TestApp, assert_error, metric_sample, new_account, read, spawn, test_config};
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tally::store::SharedLog;
use tally::store::memory::MemoryLog;

/// The flags of a replica checking HS256 tokens over the harness's secret.
fn hs_flags(secret: &str, rate: &'static str) -> Vec<String> {
    [
        "--auth",
        "jwt",
        "--auth-secret-file",
        secret,
        "--rate-limit-per-caller",
        rate,
        "--rate-limit-burst",
        rate,
    ]
    .map(String::from)
    .to_vec()
}

async fn replica(flags: &[String], store: Option<SharedLog>) -> TestApp {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    spawn(test_config(&flags), store, None).await
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

/// A request with this bearer token (none for `None`).
async fn send(
    t: &TestApp,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
    key: Option<&str>,
) -> Reply {
    let mut req = t.client.request(method, t.url(path));
    if let Some(tok) = token {
        req = req.bearer_auth(tok);
    }
    if let Some(b) = body {
        req = req.json(b);
    }
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    read(req.send().await.expect("sent")).await
}

/// A GET with `token` (if any).
async fn get(t: &TestApp, token: Option<&str>, path: &str) -> Reply {
    send(t, reqwest::Method::GET, path, token, None, None).await
}

async fn deposit(
    t: &TestApp,
    token: Option<&str>,
    account: &str,
    cents: i64,
    key: Option<&str>,
) -> Reply {
    send(
        t,
        reqwest::Method::POST,
        &format!("/api/accounts/{account}/deposit"),
        token,
        Some(&json!({ "amountCents": cents })),
        key,
    )
    .await
}

/// Balance, version and history as a fully privileged reader sees them.
async fn observe(t: &TestApp, account: &str) -> (Value, Value) {
    let reader = token(json!({}));
    let b = get(
        t,
        Some(&reader),
        &format!("/api/accounts/{account}/balance"),
    )
    .await;
    assert_eq!(b.status, StatusCode::OK, "{}", b.text);
    let h = get(
        t,
        Some(&reader),
        &format!("/api/accounts/{account}/history"),
    )
    .await;
    assert_eq!(h.status, StatusCode::OK, "{}", h.text);
    (b.body, h.body["events"].clone())
}

fn signed_with(claims: &Value, secret: &[u8]) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(secret).unwrap(),
    )
    .unwrap()
}

fn valid_claims() -> Value {
    json!({"sub": "alice", "scope": "accounts:read accounts:write", "iss": ISSUER,
           "aud": AUDIENCE, "exp": now() + 600})
}

fn with(change: impl FnOnce(&mut Value)) -> Value {
    let mut c = valid_claims();
    change(&mut c);
    c
}

/// `alg: none`: the claims of a valid token under the header {"alg":"none","typ":"JWT"},
/// with no signature.
fn alg_none() -> String {
    let valid = signed_with(&valid_claims(), SECRET.as_bytes());
    let claims = valid.split('.').nth(1).unwrap();
    format!("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.{claims}.")
}

#[tokio::test]
async fn every_refused_token_is_answered_and_writes_nothing() {
    let t = replica(&hs_flags(&secret_file(), "0"), None).await;
    let account = new_account();
    let other = new_account();
    let r = deposit(&t, Some(&token(json!({}))), &account, 1_000, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let before = observe(&t, &account).await;

    let read_only = json!({"scope": "accounts:read"});
    let cases: Vec<(&str, Option<String>, u16, &str, &str)> = vec![
        (
            "no token",
            None,
            401,
            "UNAUTHORIZED",
            "Bearer realm=\"tally\"",
        ),
        (
            "expired",
            Some(signed_with(
                &with(|c| c["exp"] = json!(now() - 120)),
                SECRET.as_bytes(),
            )),
            401,
            "INVALID_TOKEN",
            "token expired",
        ),
        (
            "not yet valid",
            Some(signed_with(
                &with(|c| c["nbf"] = json!(now() + 120)),
                SECRET.as_bytes(),
            )),
            401,
            "INVALID_TOKEN",
            "token not yet valid",
        ),
        (
            "wrong audience",
            Some(signed_with(
                &with(|c| c["aud"] = json!("someone-else")),
                SECRET.as_bytes(),
            )),
            401,
            "INVALID_TOKEN",
            "wrong audience",
        ),
        (
            "wrong issuer",
            Some(signed_with(
                &with(|c| c["iss"] = json!("mallory")),
                SECRET.as_bytes(),
            )),
            401,
            "INVALID_TOKEN",
            "wrong issuer",
        ),
        (
            "bad signature",
            Some(signed_with(
                &valid_claims(),
                b"not the replica's secret, but long enough",
            )),
            401,
            "INVALID_TOKEN",
            "bad signature",
        ),
        (
            "alg none",
            Some(alg_none()),
            401,
            "INVALID_TOKEN",
            "invalid_token",
        ),
        (
            "garbage",
            Some("not.a.jwt".into()),
            401,
            "INVALID_TOKEN",
            "invalid_token",
        ),
        (
            "another account",
            Some(token(json!({"accounts": [other]}))),
            403,
            "FORBIDDEN",
            "",
        ),
        (
            "read-only on a write",
            Some(token(read_only)),
            403,
            "INSUFFICIENT_SCOPE",
            "scope=\"accounts:write\"",
        ),
    ];
    for (name, tok, status, code, challenge) in &cases {
        let r = deposit(&t, tok.as_deref(), &account, 5, Some(&format!("k-{name}"))).await;
        assert_error(&r, *status, code);
        let www = r.header("www-authenticate").unwrap_or("");
        assert!(www.contains(challenge), "{name}: WWW-Authenticate {www:?}");
        if *status == 401 {
            assert!(www.starts_with("Bearer realm=\"tally\""), "{name}: {www:?}");
        }
        // The answer never echoes the token.
        if let Some(tok) = tok {
            assert!(
                !r.text.contains(tok.as_str()),
                "{name}: the token leaked: {}",
                r.text
            );
        }
    }
    // Transfers out of an account the token does not cover, by path and by body.
    let limited = token(json!({"accounts": [other]}));
    let r = send(
        &t,
        reqwest::Method::POST,
        &format!("/api/accounts/{account}/transfers"),
        Some(&limited),
        Some(&json!({"toAccountId": other, "amountCents": 5})),
        None,
    )
    .await;
    assert_error(&r, 403, "FORBIDDEN");
    let r = send(
        &t,
        reqwest::Method::POST,
        "/api/transfers",
        Some(&limited),
        Some(&json!({"fromAccountId": account, "toAccountId": other, "amountCents": 5})),
        None,
    )
    .await;
    assert_error(&r, 403, "FORBIDDEN");
    // A write-only token cannot read.
    let write_only = token(json!({"scope": "accounts:write"}));
    let r = get(
        &t,
        Some(&write_only),
        &format!("/api/accounts/{account}/balance"),
    )
    .await;
    assert_error(&r, 403, "INSUFFICIENT_SCOPE");

    assert_eq!(
        observe(&t, &account).await,
        before,
        "a refused request wrote something"
    );
    assert_eq!(observe(&t, &other).await.0["aggregateVersion"], 0);
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(&metrics, "tally_auth_requests_total{outcome=\"missing\"}"),
        1.0
    );
    assert_eq!(
        metric_sample(&metrics, "tally_auth_requests_total{outcome=\"invalid\"}"),
        7.0
    );
    assert_eq!(
        metric_sample(&metrics, "tally_auth_requests_total{outcome=\"forbidden\"}"),
        5.0
    );
    assert!(!metrics.contains("alice"), "no caller id in metrics");
    t.shutdown().await;
}

#[tokio::test]
async fn a_token_limited_to_accounts_may_use_them() {
    let t = replica(&hs_flags(&secret_file(), "0"), None).await;
    let (mine, payee) = (new_account(), new_account());
    let tok = token(json!({"accounts": [mine]}));
    assert_eq!(
        deposit(&t, Some(&tok), &mine, 700, None).await.status,
        StatusCode::OK
    );
    // Paying into an account the token does not list is what a transfer is for.
    let r = send(
        &t,
        reqwest::Method::POST,
        "/api/transfers",
        Some(&tok),
        Some(&json!({"fromAccountId": mine, "toAccountId": payee, "amountCents": 200})),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(observe(&t, &payee).await.0["balanceCents"], 200);
    // The account list shows such a token only the accounts it names.
    let ids = |r: Reply| -> Vec<String> {
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        r.body["accounts"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|a| a["id"].as_str().expect("an id").to_string())
            .collect()
    };
    t.shutdown().await;
    let flags = hs_flags(&secret_file(), "0");
    let mut config = test_config(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    config.seed_demo_accounts = Some(true);
    let t = spawn(config, None, None).await;
    let all = ids(get(&t, Some(&token(json!({}))), "/api/accounts").await);
    assert!(!all.is_empty(), "the demo accounts are seeded");
    assert!(ids(get(&t, Some(&tok), "/api/accounts").await).is_empty());
    let one = token(json!({"accounts": [all[0]]}));
    assert_eq!(
        ids(get(&t, Some(&one), "/api/accounts").await),
        [all[0].clone()]
    );
    t.shutdown().await;
}

#[tokio::test]
async fn two_callers_with_one_key_make_two_writes_each_replayed_only_to_its_caller() {
    let t = replica(&hs_flags(&secret_file(), "0"), None).await;
    let account = new_account();
    let alice = token(json!({"sub": "alice"}));
    let bob = token(json!({"sub": "bob"}));
    let key = "invoice-2026-11";
    let a1 = deposit(&t, Some(&alice), &account, 100, Some(key)).await;
    let b1 = deposit(&t, Some(&bob), &account, 100, Some(key)).await;
    assert_eq!((a1.status, b1.status), (StatusCode::OK, StatusCode::OK));
    assert!(
        !a1.replayed() && !b1.replayed(),
        "two callers, two first writes"
    );
    assert_ne!(a1.body, b1.body, "two writes: two versions");
    let a2 = deposit(&t, Some(&alice), &account, 100, Some(key)).await;
    let b2 = deposit(&t, Some(&bob), &account, 100, Some(key)).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(a2.body, a1.body, "alice's retry replays alice's answer");
    assert_eq!(b2.body, b1.body, "bob's retry replays bob's answer");
    // Bob reusing the key for another amount collides only with his own write.
    let b3 = deposit(&t, Some(&bob), &account, 999, Some(key)).await;
    assert_error(&b3, 422, "IDEMPOTENCY_KEY_REUSED");
    let (balance, events) = observe(&t, &account).await;
    assert_eq!(balance["balanceCents"], 200);
    assert_eq!(events.as_array().map(Vec::len), Some(2));
    // A UUID key is scoped too: it is no longer the event id as is.
    let uuid_key = uuid::Uuid::new_v4().to_string();
    let r = deposit(&t, Some(&alice), &account, 1, Some(&uuid_key)).await;
    assert_eq!(r.status, StatusCode::OK);
    let (_, events) = observe(&t, &account).await;
    let last = events.as_array().unwrap().last().unwrap();
    assert_ne!(last["eventId"], json!(uuid_key));
    t.shutdown().await;
}

#[tokio::test]
async fn a_caller_over_its_rate_is_told_when_to_retry_and_others_are_not_slowed() {
    // One request a second, no burst: the second request at once is over the rate.
    let t = replica(&hs_flags(&secret_file(), "1"), None).await;
    let account = new_account();
    let alice = token(json!({"sub": "alice"}));
    let path = format!("/api/accounts/{account}/balance");
    let mut limited = None;
    for _ in 0..2 {
        let r = get(&t, Some(&alice), &path).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            limited = Some(r);
            break;
        }
    }
    let r = limited.expect("the second request within a second is limited");
    assert_error(&r, 429, "RATE_LIMITED");
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=1).contains(&retry), "Retry-After {retry}");
    let bob = token(json!({"sub": "bob"}));
    let r = get(&t, Some(&bob), &path).await;
    assert_eq!(r.status, StatusCode::OK, "bob has his own allowance");
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(
            &metrics,
            "tally_rate_limit_decisions_total{outcome=\"limited\"}"
        ),
        1.0
    );
    assert_eq!(
        metric_sample(
            &metrics,
            "tally_rate_limit_decisions_total{outcome=\"allowed\"}"
        ),
        2.0
    );
    assert!(!metrics.contains("bob") && !metrics.contains("alice"));
    t.shutdown().await;
}

#[tokio::test]
async fn probes_metrics_and_the_contract_stay_open_with_auth_on() {
    let t = replica(&hs_flags(&secret_file(), "0"), None).await;
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        let r = t.get(path).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.text);
    }
    assert_error(&t.get("/api/accounts").await, 401, "UNAUTHORIZED");
    t.shutdown().await;
}

#[tokio::test]
async fn a_device_token_syncs_only_its_own_device() {
    let t = replica(&hs_flags(&secret_file(), "0"), None).await;
    let device = uuid::Uuid::new_v4();
    let account = new_account();
    let run = json!({"accountId": account, "events": [{"clientSeq": 1, "type": "deposit", "amountCents": 300}]});
    let path = format!("/api/devices/{device}/sync");
    let as_other = token(json!({"sub": uuid::Uuid::new_v4(), "scope": "devices:sync"}));
    let r = send(
        &t,
        reqwest::Method::POST,
        &path,
        Some(&as_other),
        Some(&run),
        None,
    )
    .await;
    assert_error(&r, 403, "FORBIDDEN");
    let no_scope = token(json!({"sub": device}));
    let r = send(
        &t,
        reqwest::Method::POST,
        &path,
        Some(&no_scope),
        Some(&run),
        None,
    )
    .await;
    assert_error(&r, 403, "INSUFFICIENT_SCOPE");
    assert_eq!(observe(&t, &account).await.0["aggregateVersion"], 0);
    let own = token(json!({"sub": device, "scope": "devices:sync"}));
    let r = send(
        &t,
        reqwest::Method::POST,
        &path,
        Some(&own),
        Some(&run),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(observe(&t, &account).await.0["balanceCents"], 300);
    t.shutdown().await;
}

/// An Ed25519 private key as PKCS#8 v1 DER: the fixed 16-byte prefix, then the seed.
fn ed25519(seed: u8, kid: &str) -> (EncodingKey, Jwk) {
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend([seed; 32]);
    let key = EncodingKey::from_ed_der(&der);
    let mut jwk = Jwk::from_encoding_key(&key, Algorithm::EdDSA).unwrap();
    jwk.common.key_id = Some(kid.into());
    (key, jwk)
}

fn ed_token(key: &EncodingKey, kid: &str) -> String {
    let mut h = Header::new(Algorithm::EdDSA);
    h.kid = Some(kid.into());
    jsonwebtoken::encode(&h, &valid_claims(), key).unwrap()
}

#[tokio::test]
async fn a_jwks_replica_accepts_its_keys_and_refuses_an_unknown_kid() {
    let (known, jwk) = ed25519(7, "2026-11");
    let (stranger, _) = ed25519(8, "elsewhere");
    let dir = std::env::temp_dir().join(format!("tally-auth-jwks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path: PathBuf = dir.join("jwks.json");
    std::fs::write(
        &path,
        serde_json::to_vec(&JwkSet { keys: vec![jwk] }).unwrap(),
    )
    .unwrap();
    let flags = ["--auth", "jwt", "--auth-jwks-file", path.to_str().unwrap()].map(String::from);
    let t = replica(&flags, None).await;
    let account = new_account();
    let r = deposit(
        &t,
        Some(&ed_token(&stranger, "elsewhere")),
        &account,
        5,
        None,
    )
    .await;
    assert_error(&r, 401, "INVALID_TOKEN");
    assert!(
        r.header("www-authenticate")
            .unwrap()
            .contains("unknown key id")
    );
    // Signed by a stranger under the known kid: the signature fails.
    let r = deposit(&t, Some(&ed_token(&stranger, "2026-11")), &account, 5, None).await;
    assert_error(&r, 401, "INVALID_TOKEN");
    // An HS256 token (over any secret) is refused by a JWKS replica.
    let r = deposit(&t, Some(&token(json!({}))), &account, 5, None).await;
    assert_error(&r, 401, "INVALID_TOKEN");
    let r = deposit(&t, Some(&ed_token(&known, "2026-11")), &account, 5, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let reader = ed_token(&known, "2026-11");
    let b = get(
        &t,
        Some(&reader),
        &format!("/api/accounts/{account}/balance"),
    )
    .await;
    assert_eq!(b.body["balanceCents"], 5, "only the signed deposit landed");
    t.shutdown().await;
}

/// Reads an event stream's chunks until its text holds `marker`, within a bound.
async fn read_until(resp: &mut reqwest::Response, seen: &mut String, marker: &str) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !seen.contains(marker) {
            let chunk = resp.chunk().await.expect("readable").expect("stream open");
            seen.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {marker:?} within the bound; got {seen:?}"));
}

/// Rule: a watch stream lasts as long as its token is accepted, and a JWKS reload that
/// removes the token's key, or replaces its material under the same kid, (revokes it) ends
/// the stream with `event: expired` at its next item, as it refuses every new request; a
/// stream signed by a key still there goes on.
#[tokio::test]
async fn a_revoked_key_ends_the_streams_its_tokens_opened() {
    let (removed, removed_jwk) = ed25519(7, "2026-11");
    let (replaced, replaced_jwk) = ed25519(8, "2026-10");
    let (_, replacement_jwk) = ed25519(10, "2026-10");
    let (kept, kept_jwk) = ed25519(9, "2026-12");
    let dir = std::env::temp_dir().join(format!("tally-auth-revoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path: PathBuf = dir.join("jwks.json");
    let write_keys = |keys: Vec<Jwk>| {
        std::fs::write(&path, serde_json::to_vec(&JwkSet { keys }).unwrap()).unwrap()
    };
    write_keys(vec![removed_jwk, replaced_jwk, kept_jwk.clone()]);
    let flags = [
        "--auth",
        "jwt",
        "--auth-jwks-file",
        path.to_str().unwrap(),
        "--watch-keepalive-secs",
        "1",
    ]
    .map(String::from);
    let t = replica(&flags, None).await;
    let account = new_account();
    let open = |token: String| {
        t.client
            .get(t.url(&format!("/api/accounts/{account}/events")))
            .bearer_auth(token)
            .send()
    };
    let mut gone = open(ed_token(&removed, "2026-11")).await.unwrap();
    let mut swapped = open(ed_token(&replaced, "2026-10")).await.unwrap();
    let mut lasting = open(ed_token(&kept, "2026-12")).await.unwrap();
    let mut seen = [String::new(), String::new(), String::new()];
    for (resp, text) in [&mut gone, &mut swapped, &mut lasting]
        .into_iter()
        .zip(seen.iter_mut())
    {
        assert_eq!(resp.status(), StatusCode::OK);
        read_until(resp, text, "event: snapshot").await;
    }
    write_keys(vec![replacement_jwk, kept_jwk]);
    assert_eq!(t.app.auth.keys().unwrap().reload(), Ok(true));
    let [g, s, l] = &mut seen;
    for (resp, text) in [(&mut gone, g), (&mut swapped, s)] {
        read_until(resp, text, "event: expired").await;
        assert!(text.contains("no longer accepted"), "{text}");
        assert!(
            resp.chunk().await.expect("readable").is_none(),
            "the stream ends after its final event"
        );
    }
    // The other stream goes on: two more keep-alives (the second sent after the reload
    // whatever was in flight), and no final event.
    l.clear();
    read_until(&mut lasting, l, "keep-alive").await;
    let first = l.len();
    let mut rest = l.split_off(first);
    read_until(&mut lasting, &mut rest, "keep-alive").await;
    l.push_str(&rest);
    assert!(!l.contains("event: expired"), "{l}");
    t.shutdown().await;
}

/// A fleet with authentication on: three replicas over one store, two callers sending the
/// same keys to different replicas at once. Each caller's retries, wherever they land,
/// replay that caller's write; the two callers never share one.
#[tokio::test]
async fn a_fleet_with_auth_on_keeps_each_callers_keys_apart() {
    let store: SharedLog = std::sync::Arc::new(MemoryLog::new());
    let flags = hs_flags(&secret_file(), "0");
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(replica(&flags, Some(store.clone())).await);
    }
    let account = new_account();
    let callers = ["alice", "bob"].map(|sub| token(json!({"sub": sub})));
    const KEYS: usize = 20;
    let mut tasks = Vec::new();
    for (c, tok) in callers.iter().enumerate() {
        for k in 0..KEYS {
            for attempt in 0..2 {
                let app = &fleet[(c + k + attempt) % fleet.len()];
                let (client, url, tok) = (
                    app.client.clone(),
                    app.url(&format!("/api/accounts/{account}/deposit")),
                    tok.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let r = client
                        .post(url)
                        .bearer_auth(tok)
                        .header("Idempotency-Key", format!("order-{k}"))
                        .json(&json!({"amountCents": 10}))
                        .send()
                        .await
                        .expect("sent");
                    (c, k, read(r).await)
                }));
            }
        }
    }
    let mut first = std::collections::HashMap::new();
    for task in tasks {
        let (c, k, r) = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("bounded")
            .unwrap();
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        // Both attempts of one (caller, key) answer with the same version.
        let v = r.body["aggregateVersion"].clone();
        if let Some(prev) = first.insert((c, k), v.clone()) {
            assert_eq!(prev, v, "caller {c} key {k}: two attempts, two writes");
        }
    }
    let (balance, events) = observe(&fleet[0], &account).await;
    assert_eq!(
        balance["balanceCents"],
        json!(2 * KEYS as i64 * 10),
        "one write per (caller, key)"
    );
    assert_eq!(events.as_array().map(Vec::len), Some(2 * KEYS));
    for t in fleet {
        t.shutdown().await;
    }
}

/// `tally token` mints a token the replica accepts, from the same secret file.
#[tokio::test]
async fn a_token_minted_by_tally_token_is_accepted() {
    let secret = secret_file();
    let account = new_account();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args([
            "token",
            "--secret-file",
            &secret,
            "--sub",
            "dev-alice",
            "--scope",
            "accounts:write",
            "--account",
            &account,
        ])
        .env_remove("TALLY_AUTH_ISSUER")
        .env_remove("TALLY_AUTH_AUDIENCE")
        .output()
        .expect("tally token runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let minted = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let t = replica(&hs_flags(&secret, "0"), None).await;
    let r = deposit(&t, Some(&minted), &account, 42, None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    // Write only, for this account only.
    let other = new_account();
    assert_error(
        &deposit(&t, Some(&minted), &other, 1, None).await,
        403,
        "FORBIDDEN",
    );
    let r = get(
        &t,
        Some(&minted),
        &format!("/api/accounts/{account}/balance"),
    )
    .await;
    assert_error(&r, 403, "INSUFFICIENT_SCOPE");
    // An unknown scope, or a `sub` no replica accepts, is refused at minting, with exit 2
    // and nothing on stdout.
    let long_sub = "s".repeat(256);
    for refused in [
        ["--scope", "accounts:everything"],
        ["--sub", ""],
        ["--sub", long_sub.as_str()],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(["token", "--secret-file", &secret])
            .args(refused)
            .output()
            .expect("tally token runs");
        assert_eq!(out.status.code(), Some(2), "{refused:?}");
        assert!(out.stdout.is_empty(), "{refused:?}: printed a token");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn with_an_admin_address_metrics_move_there() {
    let t = replica(
        &["--admin-listen".to_string(), "127.0.0.1:0".to_string()],
        None,
    )
    .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = listener.local_addr().unwrap();
    let server = tokio::spawn(tally::http::serve_admin(
        t.app.clone(),
        listener,
        std::future::pending(),
    ));
    assert_error(&t.get("/metrics").await, 404, "NOT_FOUND");
    let r = read(
        t.client
            .get(format!("http://{admin}/metrics"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.text.contains("tally_http_requests_total"));
    let r = read(
        t.client
            .get(format!("http://{admin}/readyz"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = read(
        t.client
            .get(format!("http://{admin}/api/accounts"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_error(&r, 404, "NOT_FOUND");
    server.abort();
    t.shutdown().await;
}

/// The real binary: `--auth jwt` without a key refuses to start (exit 2, naming the flag);
/// `--admin-listen` moves `/metrics`; each access line names its peer and, once its token is
/// accepted, its caller; and with debug logging on, neither a good nor a refused token
/// reaches the log.
#[tokio::test]
async fn the_access_line_names_caller_and_peer_never_a_token_and_jwt_needs_a_key() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let bin = env!("CARGO_BIN_EXE_tally");
    let clean = |cmd: &mut Command| {
        for (name, _) in std::env::vars() {
            if name.starts_with("TALLY_") || name == "RUST_LOG" {
                cmd.env_remove(name);
            }
        }
    };
    let mut no_key = Command::new(bin);
    clean(&mut no_key);
    let out = no_key.args(["--auth", "jwt"]).output().expect("tally runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--auth-secret-file"));

    let mut cmd = Command::new(bin);
    clean(&mut cmd);
    let mut child = cmd
        .args([
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--auth",
            "jwt",
        ])
        .args(["--auth-secret-file", &secret_file()])
        .args(["--admin-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tally starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut admin = None;
    let addr = loop {
        let line = lines.next().expect("a log line before listening").unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        let addr = v["fields"]["addr"].as_str().map(str::to_owned);
        match v["fields"]["message"].as_str() {
            Some("tally listening") => break addr.unwrap(),
            Some(m) if m.starts_with("admin listening") => admin = addr,
            _ => {}
        }
    };
    // --admin-listen: the scrape moves to the admin address.
    let admin = admin.expect("the admin address is logged before the API's");
    let get = |url: String| async move { reqwest::get(url).await.unwrap().status() };
    assert_eq!(get(format!("http://{admin}/metrics")).await, StatusCode::OK);
    assert_eq!(
        get(format!("http://{addr}/metrics")).await,
        StatusCode::NOT_FOUND
    );
    let good = token(json!({"sub": "log-check"}));
    let forged = signed_with(&valid_claims(), b"a forged secret, long enough to sign");
    let client = reqwest::Client::new();
    for tok in [&good, &forged] {
        let r = client
            .get(format!("http://{addr}/api/accounts"))
            .bearer_auth(tok)
            .send()
            .await
            .unwrap();
        assert!(r.status() == StatusCode::OK || r.status() == StatusCode::UNAUTHORIZED);
    }
    assert!(
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("reaped");
    assert!(status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let log = rest.join("\n") + &stderr;
    assert!(log.contains("served"), "the requests were logged: {log}");
    // Each access line says who asked: the peer always, the caller (`sub`) once its token
    // was accepted. A service that moves money must be able to tell callers apart.
    let served: Vec<Value> = rest
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "served" && v["fields"]["route"] == "/api/accounts")
        .collect();
    assert_eq!(served.len(), 2, "{log}");
    let peers: Vec<&str> = served
        .iter()
        .map(|v| v["fields"]["peer"].as_str().expect("a peer on every line"))
        .collect();
    assert!(
        peers.iter().all(|p| p.starts_with("127.0.0.1:")),
        "{peers:?}"
    );
    let callers: Vec<&Value> = served.iter().map(|v| &v["fields"]["caller"]).collect();
    assert_eq!(callers, [&json!("log-check"), &Value::Null], "{log}");
    for tok in [&good, &forged] {
        // Not the token, nor its signature (the part an attacker would need).
        let signature = tok.rsplit('.').next().unwrap();
        assert!(!log.contains(signature), "a token reached the log");
    }
}

/// Rule: a transfer's answer shows the destination's balance only to a caller who may read
/// that balance. A token limited to its source account gets the source leg alone, on both
/// transfer routes, and its replay under the same key answers the same shape.
#[tokio::test]
async fn a_transfer_shows_the_destination_leg_only_to_a_caller_who_may_read_it() {
    let t = replica(&hs_flags(&secret_file(), "0"), None).await;
    let (mine, payee) = (new_account(), new_account());
    let limited = token(json!({"accounts": [mine]}));
    assert_eq!(
        deposit(&t, Some(&limited), &mine, 1_000, None).await.status,
        StatusCode::OK
    );
    // The payee's balance is one the limited token must not learn.
    deposit(&t, Some(&token(json!({}))), &payee, 25_000, None).await;
    let routes = [
        (
            "/api/transfers".to_string(),
            json!({"fromAccountId": mine, "toAccountId": payee, "amountCents": 1}),
        ),
        (
            format!("/api/accounts/{mine}/transfers"),
            json!({"toAccountId": payee, "amountCents": 1}),
        ),
    ];
    for (i, (path, body)) in routes.iter().enumerate() {
        let key = format!("pay-{i}");
        let post = |tok: String, key: String| {
            let (t, path, body) = (&t, path.clone(), body.clone());
            async move {
                send(
                    t,
                    reqwest::Method::POST,
                    &path,
                    Some(&tok),
                    Some(&body),
                    Some(&key),
                )
                .await
            }
        };
        let first = post(limited.clone(), key.clone()).await;
        assert_eq!(first.status, StatusCode::OK, "{path}: {}", first.text);
        assert!(
            first.body["from"]["balanceCents"].is_i64(),
            "{}",
            first.text
        );
        assert_eq!(first.body.get("to"), None, "{path}: {}", first.text);
        let again = post(limited.clone(), key.clone()).await;
        assert!(again.replayed(), "{path}: {}", again.text);
        assert_eq!(
            again.body, first.body,
            "{path}: a replay answers the same shape"
        );
        // A caller who may read the payee sees both legs.
        let full = post(token(json!({})), format!("{key}-full")).await;
        assert_eq!(full.status, StatusCode::OK, "{path}: {}", full.text);
        assert!(full.body["to"]["balanceCents"].is_i64(), "{}", full.text);
    }
    t.shutdown().await;
}

/// Rule: one caller cannot take every watch slot of a replica. Past
/// `--watch-max-per-caller` its next stream is refused 429 `TOO_MANY_STREAMS` with
/// `Retry-After`, while another caller still opens one on its own account; a stream the
/// first caller closes gives its place back.
#[tokio::test]
async fn one_caller_cannot_take_every_watch_slot() {
    let mut flags = hs_flags(&secret_file(), "0");
    flags.extend(
        [
            "--watch-max-subscribers",
            "4",
            "--watch-max-per-account",
            "2",
            "--watch-max-per-caller",
            "2",
        ]
        .map(String::from),
    );
    let t = replica(&flags, None).await;
    let (a, b, own) = (new_account(), new_account(), new_account());
    // A caller limited to two accounts, as a hostile or buggy client would be.
    let greedy = token(json!({"sub": "greedy", "accounts": [a, b]}));
    let open = |token: &str, account: &str| {
        t.client
            .get(t.url(&format!("/api/accounts/{account}/events")))
            .bearer_auth(token)
            .send()
    };
    let mut held = Vec::new();
    for account in [&a, &b] {
        let mut resp = open(&greedy, account).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        read_until(&mut resp, &mut String::new(), "event: snapshot").await;
        held.push(resp);
    }
    // The status first: a stream opened by mistake would never end, and neither would
    // reading its body.
    let refused = open(&greedy, &a).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let refused = read(refused).await;
    assert_error(&refused, 429, "TOO_MANY_STREAMS");
    let retry: u64 = refused
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1, "Retry-After {retry}");
    // Another caller is not starved: its stream on its own account opens.
    let other = token(json!({"sub": "other", "accounts": [own]}));
    let mut resp = open(&other, &own).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    read_until(&mut resp, &mut String::new(), "event: snapshot").await;
    // A closed stream gives its place back (the hub counts it out when its task ends).
    drop(held.pop());
    let reopened = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let resp = open(&greedy, &b).await.unwrap();
            if resp.status() == StatusCode::OK {
                return resp;
            }
            assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the place comes back once the stream is closed");
    assert_eq!(reopened.status(), StatusCode::OK);
    let metrics = t.get("/metrics").await.text;
    assert!(
        metric_sample(&metrics, "tally_watch_refused_total{limit=\"caller\"}") >= 1.0,
        "counted by limit, never by caller"
    );
    assert!(!metrics.contains("greedy"));
    t.shutdown().await;
}

/// Rule: failed authentications are paced per peer address. Past
/// `--auth-failures-per-minute`, a missing or refused token is answered 429
/// `TOO_MANY_AUTH_FAILURES` with `Retry-After` instead of 401, while a valid token from the
/// same address is still served.
#[tokio::test]
async fn a_peer_sending_bad_tokens_is_paced_and_valid_tokens_still_pass() {
    let mut flags = hs_flags(&secret_file(), "0");
    flags.extend(["--auth-failures-per-minute", "3"].map(String::from));
    let t = replica(&flags, None).await;
    let forged = signed_with(&valid_claims(), b"a forged secret, long enough to sign");
    let path = "/api/accounts";
    assert_error(&get(&t, Some(&forged), path).await, 401, "INVALID_TOKEN");
    assert_error(&get(&t, None, path).await, 401, "UNAUTHORIZED");
    assert_error(&get(&t, Some(&forged), path).await, 401, "INVALID_TOKEN");
    for tok in [Some(forged.as_str()), None] {
        let r = get(&t, tok, path).await;
        assert_error(&r, 429, "TOO_MANY_AUTH_FAILURES");
        let retry: u64 = r
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .unwrap();
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
    }
    let good = token(json!({}));
    assert_eq!(get(&t, Some(&good), path).await.status, StatusCode::OK);
    let metrics = t.get("/metrics").await.text;
    assert_eq!(
        metric_sample(
            &metrics,
            "tally_auth_requests_total{outcome=\"peer_limited\"}"
        ),
        2.0
    );
    t.shutdown().await;
}

/// Rule: an operator can bound what a `devices:sync` token takes. Its account list is
/// honoured (a run of another account is 403 and writes nothing), and
/// `--device-max-run-withdrawal-cents` refuses a run withdrawing more, whole (422
/// `DEVICE_RUN_OVER_LIMIT`), while a run within it lands below zero as devices may.
#[tokio::test]
async fn an_operator_bounds_what_a_device_token_can_withdraw() {
    let mut flags = hs_flags(&secret_file(), "0");
    flags.extend(["--device-max-run-withdrawal-cents", "1000"].map(String::from));
    let t = replica(&flags, None).await;
    let (account, other) = (new_account(), new_account());
    let device = uuid::Uuid::new_v4();
    let path = format!("/api/devices/{device}/sync");
    let run = |account: &str, seq: u64, cents: i64| {
        json!({"accountId": account, "events": [
            {"clientSeq": seq, "type": "withdraw", "amountCents": cents / 2},
            {"clientSeq": seq + 1, "type": "withdraw", "amountCents": cents - cents / 2}]})
    };
    let sync = |token: String, body: Value| {
        let (t, path) = (&t, path.clone());
        async move {
            send(
                t,
                reqwest::Method::POST,
                &path,
                Some(&token),
                Some(&body),
                None,
            )
            .await
        }
    };
    let unlisted = token(json!({"sub": device, "scope": "devices:sync"}));
    let r = sync(unlisted.clone(), run(&account, 1, 1_000_000)).await;
    assert_error(&r, 422, "DEVICE_RUN_OVER_LIMIT");
    assert_eq!(observe(&t, &account).await.0["aggregateVersion"], 0);
    let r = sync(unlisted, run(&account, 1, 1000)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(observe(&t, &account).await.0["balanceCents"], -1000);
    let listed = token(json!({"sub": device, "scope": "devices:sync", "accounts": [account]}));
    let r = sync(listed, run(&other, 1, 10)).await;
    assert_error(&r, 403, "FORBIDDEN");
    assert_eq!(observe(&t, &other).await.0["aggregateVersion"], 0);
    t.shutdown().await;
}
