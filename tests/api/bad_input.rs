//! Bad input gets a clear JSON error with the right status and changes nothing: malformed
//! JSON, ids and queries (400), unknown routes (404), wrong methods (405), content types (415),
//! invalid amounts and shapes, the same-account transfer and overdrawing (422).

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::common::raw_http::{post_raw, send};
use crate::common::{
    account_transfer_path, assert_error, deposit_path, funded, new_account, observe, spawn_default,
    withdraw_path,
};

#[tokio::test]
async fn malformed_json_is_400_and_changes_nothing() {
    let t = spawn_default().await;
    let account = funded(&t, 500).await;
    let before = observe(&t, &account).await;
    for body in [
        &b"{"[..],
        b"not json",
        b"",
        br#"{"amountCents":1}x"#,
        br#"{"amountCents":1,}"#,
        // Not UTF-8, so not JSON text (RFC 8259, 8.1), wherever the bad byte sits.
        b"{\"amount\xffCents\":1}",
        b"{\"amountCents\":1,\"note\":\"\xc3\"}",
    ] {
        for path in [
            deposit_path(&account),
            withdraw_path(&account),
            "/api/transfers".to_string(),
            account_transfer_path(&account),
        ] {
            let r = post_raw(&t, &path, body, None).await;
            assert_error(&r, 400, "INVALID_JSON");
            assert_eq!(observe(&t, &account).await, before, "{path} {body:?}");
        }
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_malformed_account_id_in_the_path_is_400() {
    let t = spawn_default().await;
    for action in ["balance", "history"] {
        for bad in ["not-a-uuid", "1234", "00000000-0000-0000-0000-00000000000g"] {
            let r = t.get(&format!("/api/accounts/{bad}/{action}")).await;
            assert_error(&r, 400, "INVALID_ID");
        }
    }
    let body = json!({ "amountCents": 1, "toAccountId": new_account() });
    for action in ["deposit", "withdraw", "transfers"] {
        let r = t
            .post(&format!("/api/accounts/not-a-uuid/{action}"), &body, None)
            .await;
        assert_error(&r, 400, "INVALID_ID");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn bad_query_parameters_are_400() {
    let t = spawn_default().await;
    let account = funded(&t, 1).await;
    for query in [
        "minVersion=abc",
        "minVersion=-1",
        "minVersion=",
        "minVersion=1.5",
        "minversion=1",
        "fromVersion=1",
        "bogus=1",
    ] {
        let r = t
            .get(&format!("/api/accounts/{account}/balance?{query}"))
            .await;
        assert_error(&r, 400, "BAD_QUERY");
    }
    for query in [
        "fromVersion=x",
        "fromVersion=-1",
        "limit=abc",
        "limit=0",
        "limit=1001",
        "limit=-5",
        "minVersion=1",
        "cursor=1",
        "limit=1&limit=2",
        "limit=+2",
        "limit=1%2E5",
    ] {
        let r = t
            .get(&format!("/api/accounts/{account}/history?{query}"))
            .await;
        assert_error(&r, 400, "BAD_QUERY");
    }
    // Values and names are percent-decoded like any query string.
    assert_eq!(t.deposit(&account, 1, None).await.status, StatusCode::OK);
    let r = t
        .get(&format!("/api/accounts/{account}/history?%6Cimit=%31"))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["events"].as_array().map(Vec::len), Some(1));
    assert_eq!(r.body["nextFromVersion"], 2);
    t.shutdown().await;
}

/// Rule: a write (or the account list) takes no query parameters, and one sent is refused
/// rather than ignored: `?dryRun=true` must not move money.
#[tokio::test]
async fn a_query_on_a_write_is_400_and_changes_nothing() {
    let t = spawn_default().await;
    let (account, payee) = (funded(&t, 100).await, new_account());
    let before = (observe(&t, &account).await, observe(&t, &payee).await);
    let one = json!({ "amountCents": 1 });
    let to_payee = json!({ "toAccountId": payee, "amountCents": 1 });
    let both = json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 1 });
    let writes = [
        (deposit_path(&account), &one),
        (withdraw_path(&account), &one),
        (account_transfer_path(&account), &to_payee),
        ("/api/transfers".to_string(), &both),
    ];
    for (path, body) in writes {
        for query in ["dryRun=true", "amountCents=999", "x", "&x&", "="] {
            let r = t.post(&format!("{path}?{query}"), body, None).await;
            assert_error(&r, 400, "BAD_QUERY");
        }
    }
    assert_eq!(
        (observe(&t, &account).await, observe(&t, &payee).await),
        before,
        "a write with a query changed something"
    );
    assert_error(&t.get("/api/accounts?limit=abc").await, 400, "BAD_QUERY");
    // An empty query is no query, and so is one of separators alone, as on a read.
    for query in ["", "&", "&&"] {
        let r = t
            .post(&format!("{}?{query}", deposit_path(&account)), &one, None)
            .await;
        assert_eq!(r.status, StatusCode::OK, "?{query}: {}", r.text);
    }
    assert_eq!(t.get("/api/accounts?").await.status, StatusCode::OK);
    t.shutdown().await;
}

#[tokio::test]
async fn unknown_routes_are_404_json() {
    let t = spawn_default().await;
    let account = new_account();
    // `/` is the console.
    for path in [
        "/nope".to_string(),
        "/api".to_string(),
        "/api/accounts/".to_string(),
        "/healthz/".to_string(),
        format!("/api/accounts/{account}"),
        format!("/api/accounts/{account}/statement"),
        format!("/api/accounts/{account}/balance/extra"),
    ] {
        let r = t.get(&path).await;
        assert_error(&r, 404, "NOT_FOUND");
        let r = t.post(&path, &json!({ "amountCents": 1 }), None).await;
        assert_error(&r, 404, "NOT_FOUND");
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_wrong_method_is_405_with_allow() {
    let t = spawn_default().await;
    let account = new_account();
    let cases = [
        (Method::GET, deposit_path(&account), "POST"),
        (Method::GET, withdraw_path(&account), "POST"),
        (Method::GET, account_transfer_path(&account), "POST"),
        (Method::GET, "/api/transfers".to_string(), "POST"),
        (Method::PUT, deposit_path(&account), "POST"),
        (Method::DELETE, "/api/transfers".to_string(), "POST"),
        (
            Method::POST,
            format!("/api/accounts/{account}/balance"),
            "GET, HEAD",
        ),
        (
            Method::POST,
            format!("/api/accounts/{account}/history"),
            "GET, HEAD",
        ),
        // One path, two routes: the list (GET, HEAD) and the open (POST).
        (Method::PUT, "/api/accounts".to_string(), "GET, HEAD, POST"),
        (Method::POST, "/healthz".to_string(), "GET, HEAD"),
        (Method::POST, "/readyz".to_string(), "GET, HEAD"),
        (Method::POST, "/metrics".to_string(), "GET, HEAD"),
        (
            Method::DELETE,
            format!("/api/accounts/{account}/balance"),
            "GET, HEAD",
        ),
        // The method is checked before the id, so a bad id with a wrong method is still 405.
        (
            Method::GET,
            "/api/accounts/not-a-uuid/deposit".to_string(),
            "POST",
        ),
    ];
    for (method, path, allow) in cases {
        let r = send(&t, method.clone(), &path, &[], None).await;
        assert_error(&r, 405, "METHOD_NOT_ALLOWED");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
    assert_eq!(t.balance(&account).await, (0, 0));
    // A HEAD answer has no body, so the 405 is its status and `Allow` only.
    let r = send(&t, Method::HEAD, &deposit_path(&account), &[], None).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.header("allow"), Some("POST"));
    // GET routes answer HEAD: the GET's status and headers, no body.
    for path in [
        "/healthz".to_string(),
        format!("/api/accounts/{account}/balance"),
    ] {
        let get = send(&t, Method::GET, &path, &[], None).await;
        let r = send(&t, Method::HEAD, &path, &[], None).await;
        assert_eq!(r.status, StatusCode::OK, "HEAD {path}");
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.header("content-length"),
            Some(get.text.len().to_string().as_str()),
            "HEAD {path}: the GET's length"
        );
    }
    t.shutdown().await;
}

#[tokio::test]
async fn a_missing_or_wrong_content_type_is_415_and_changes_nothing() {
    let t = spawn_default().await;
    let (account, payee) = (funded(&t, 100).await, new_account());
    let before = (observe(&t, &account).await, observe(&t, &payee).await);
    let withdraw = br#"{"amountCents":5}"#.to_vec();
    let transfer = json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 5 })
        .to_string()
        .into_bytes();
    let requests = [
        (withdraw_path(&account), withdraw.clone()),
        ("/api/transfers".to_string(), transfer),
    ];
    let content_types: [Option<&str>; 8] = [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("application/jsonx"),
        Some("application/problem+json"),
        Some(""),
        // JSON is UTF-8: a body sent in another charset would be read as what it is not.
        Some("application/json; charset=latin1"),
        Some("application/json; charset=utf-16"),
    ];
    for (path, body) in &requests {
        for ct in content_types {
            let headers: Vec<(&str, &[u8])> = ct
                .map(|ct| ("content-type", ct.as_bytes()))
                .into_iter()
                .collect();
            let r = send(&t, Method::POST, path, &headers, Some(body.clone())).await;
            assert_error(&r, 415, "UNSUPPORTED_MEDIA_TYPE");
            assert_eq!(
                (observe(&t, &account).await, observe(&t, &payee).await),
                before,
                "{path} with {ct:?} changed something"
            );
        }
    }
    // A content coding is refused, never guessed at (hyper does not decode bodies).
    for coding in ["gzip", "deflate, identity", "br"] {
        let r = send(
            &t,
            Method::POST,
            &withdraw_path(&account),
            &[
                ("content-type", b"application/json".as_slice()),
                ("content-encoding", coding.as_bytes()),
            ],
            Some(withdraw.clone()),
        )
        .await;
        assert_error(&r, 415, "UNSUPPORTED_MEDIA_TYPE");
    }
    assert_eq!(
        (observe(&t, &account).await, observe(&t, &payee).await),
        before,
        "a coded body changed something"
    );
    let r = send(
        &t,
        Method::POST,
        &withdraw_path(&account),
        &[
            ("content-type", b"application/json".as_slice()),
            ("content-encoding", b"Identity".as_slice()),
        ],
        Some(withdraw.clone()),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "identity: {}", r.text);
    // Content-Type is a singleton: two of them are malformed, whichever they name.
    for second in ["text/plain", "application/json"] {
        let r = send(
            &t,
            Method::POST,
            &withdraw_path(&account),
            &[
                ("content-type", b"application/json".as_slice()),
                ("content-type", second.as_bytes()),
            ],
            Some(withdraw.clone()),
        )
        .await;
        assert_error(&r, 400, "BAD_REQUEST");
    }
    assert_eq!(
        t.balance(&account).await,
        (95, 2),
        "two content types wrote"
    );
    // Parameters and case do not matter.
    for ct in [
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/json; charset=\"UTF-8\"",
    ] {
        let r = send(
            &t,
            Method::POST,
            &withdraw_path(&account),
            &[("content-type", ct.as_bytes())],
            Some(withdraw.clone()),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{ct}: {}", r.text);
    }
    assert_eq!(t.balance(&account).await, (80, 5));
    t.shutdown().await;
}

#[tokio::test]
async fn invalid_amounts_and_body_shapes_are_422_validation_errors_and_change_nothing() {
    let t = spawn_default().await;
    let (account, other) = (funded(&t, 1_000).await, funded(&t, 1_000).await);
    let before = (observe(&t, &account).await, observe(&t, &other).await);
    // Every case is (path, raw body).
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    let mut case = |path: String, body: Value| cases.push((path, body.to_string().into_bytes()));
    for amount in [
        json!(0),
        json!(-1),
        json!(-2_147_483_647),
        json!(2_147_483_648_i64),
        json!(i64::MAX),
        json!(1.5),
        json!(100.0),
        json!("100"),
        json!(null),
        json!(true),
        json!([1]),
        json!({ "cents": 1 }),
    ] {
        case(deposit_path(&account), json!({ "amountCents": amount }));
        case(withdraw_path(&account), json!({ "amountCents": amount }));
        case(
            "/api/transfers".into(),
            json!({ "fromAccountId": account, "toAccountId": other, "amountCents": amount }),
        );
        case(
            account_transfer_path(&account),
            json!({ "toAccountId": other, "amountCents": amount }),
        );
    }
    // Unknown fields.
    case(
        deposit_path(&account),
        json!({ "amountCents": 1, "memo": "x" }),
    );
    case(withdraw_path(&account), json!({ "amount": 1 }));
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "toAccountId": other, "amountCents": 1, "x": 0 }),
    );
    // Missing fields.
    case(deposit_path(&account), json!({}));
    case(
        "/api/transfers".into(),
        json!({ "toAccountId": other, "amountCents": 1 }),
    );
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "amountCents": 1 }),
    );
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "toAccountId": other }),
    );
    case(account_transfer_path(&account), json!({ "amountCents": 1 }));
    // Not an account id.
    case(
        "/api/transfers".into(),
        json!({ "fromAccountId": account, "toAccountId": "nope", "amountCents": 1 }),
    );
    case(
        account_transfer_path(&account),
        json!({ "toAccountId": 7, "amountCents": 1 }),
    );
    // Not an object: a scalar, or a positional array even when its items line up with the
    // fields.
    case(deposit_path(&account), json!(5));
    case(deposit_path(&account), json!("amountCents"));
    case(deposit_path(&account), json!([5]));
    case(withdraw_path(&account), json!([5]));
    case("/api/transfers".into(), json!([account, other, 5]));
    case(account_transfer_path(&account), json!([other, 5]));
    case(withdraw_path(&account), json!([{ "amountCents": 1 }]));
    // Spellings `json!` cannot produce.
    let raw: [(String, &[u8]); 3] = [
        // Too large even for 64 bits.
        (
            deposit_path(&account),
            br#"{"amountCents":99999999999999999999}"#,
        ),
        (deposit_path(&account), br#"{"amountCents":1e2}"#),
        (
            deposit_path(&account),
            br#"{"amountCents":1,"amountCents":2}"#,
        ),
    ];
    cases.extend(raw.into_iter().map(|(p, b)| (p, b.to_vec())));
    for (path, body) in cases {
        let r = post_raw(&t, &path, &body, None).await;
        let shown = String::from_utf8_lossy(&body);
        assert_eq!(r.status.as_u16(), 422, "{path} {shown}: {}", r.text);
        assert_error(&r, 422, "VALIDATION_ERROR");
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &other).await),
            before,
            "{path} {shown} changed something"
        );
    }
    t.shutdown().await;
}

/// An amount that is not an integer in range is refused in the API's words: the field, the
/// bound a caller may send, and what was sent; never a Rust type (`expected i64`).
#[tokio::test]
async fn a_bad_amount_is_refused_in_the_apis_words_on_every_write_route() {
    let t = spawn_default().await;
    let (account, other) = (funded(&t, 1_000).await, funded(&t, 1_000).await);
    let rule = "amountCents must be an integer from 1 to 2147483647, got ";
    let raw_amounts: [&str; 9] = [
        r#""100""#,
        "1.5",
        "100.0",
        "1e2",
        "null",
        "[1]",
        "0",
        "2147483648",
        "99999999999999999999",
    ];
    for amount in raw_amounts {
        for (path, body) in [
            (
                deposit_path(&account),
                format!(r#"{{"amountCents":{amount}}}"#),
            ),
            (
                withdraw_path(&account),
                format!(r#"{{"amountCents":{amount}}}"#),
            ),
            (
                "/api/transfers".to_string(),
                format!(
                    r#"{{"fromAccountId":"{account}","toAccountId":"{other}","amountCents":{amount}}}"#
                ),
            ),
            (
                account_transfer_path(&account),
                format!(r#"{{"toAccountId":"{other}","amountCents":{amount}}}"#),
            ),
        ] {
            let r = post_raw(&t, &path, body.as_bytes(), None).await;
            assert_error(&r, 422, "VALIDATION_ERROR");
            let message = r.body["message"].as_str().unwrap_or_default();
            assert!(message.starts_with(rule), "{path} {body}: {message}");
            for rust in ["i64", "u64", "i32", "f64"] {
                assert!(!message.contains(rust), "{path} {body}: {message}");
            }
        }
    }
    let r = post_raw(
        &t,
        &deposit_path(&account),
        br#"{"amountCents":"100"}"#,
        None,
    )
    .await;
    assert!(
        r.body["message"]
            .as_str()
            .is_some_and(|m| m.contains(r#"got the string "100""#)),
        "{}",
        r.text
    );
    // JSON keeps no spelling: `1e2` arrives as the float 100.0, and a bare "got 100.0" would
    // leave the caller guessing what was wrong with it.
    for spelling in ["1e2", "100.0", "1.00e2"] {
        let body = format!(r#"{{"amountCents":{spelling}}}"#);
        let r = post_raw(&t, &deposit_path(&account), body.as_bytes(), None).await;
        let message = r.body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("a fraction or an exponent")
                && message.contains("send plain digits: 100"),
            "{spelling}: {message}"
        );
    }
    assert_eq!(t.balance(&account).await.0, 1_000, "nothing was written");
    t.shutdown().await;
}

/// An account id in a body that is not one is refused naming its field and what was sent,
/// never in the uuid crate's words (`UUID parsing failed: invalid character ...`).
#[tokio::test]
async fn a_bad_account_id_in_a_body_names_its_field() {
    let t = spawn_default().await;
    let (account, other) = (funded(&t, 1_000).await, funded(&t, 1_000).await);
    let cases = [
        (
            "/api/transfers".to_string(),
            format!(r#"{{"fromAccountId":"{account}","toAccountId":"zz","amountCents":1}}"#),
            r#"toAccountId must be an account id (a UUID), got the string "zz""#,
        ),
        (
            "/api/transfers".to_string(),
            format!(r#"{{"fromAccountId":7,"toAccountId":"{other}","amountCents":1}}"#),
            "fromAccountId must be an account id (a UUID), got 7",
        ),
        (
            account_transfer_path(&account),
            r#"{"toAccountId":null,"amountCents":1}"#.to_string(),
            "toAccountId must be an account id (a UUID), got null",
        ),
        (
            "/api/accounts".to_string(),
            r#"{"accountId":"not-a-uuid"}"#.to_string(),
            r#"accountId must be an account id (a UUID), got the string "not-a-uuid""#,
        ),
    ];
    let before = (observe(&t, &account).await, observe(&t, &other).await);
    for (path, body, said) in cases {
        let r = post_raw(&t, &path, body.as_bytes(), None).await;
        assert_error(&r, 422, "VALIDATION_ERROR");
        let message = r.body["message"].as_str().unwrap_or_default();
        assert!(message.starts_with(said), "{path} {body}: {message}");
        assert!(!message.contains("UUID parsing failed"), "{message}");
    }
    assert_eq!(
        (observe(&t, &account).await, observe(&t, &other).await),
        before
    );
    t.shutdown().await;
}

#[tokio::test]
async fn a_transfer_to_the_same_account_is_422_and_changes_nothing() {
    let t = spawn_default().await;
    let account = funded(&t, 1_000).await;
    let before = observe(&t, &account).await;
    // Also with an amount the account cannot cover (the shape is checked before the funds),
    // and with the same id in another spelling.
    let upper = account.to_uppercase();
    for (to, cents) in [(&account, 10), (&account, 5_000), (&upper, 10)] {
        let r = t.transfer(&account, to, cents, None).await;
        assert_error(&r, 422, "VALIDATION_ERROR");
        assert_eq!(observe(&t, &account).await, before);
    }
    t.shutdown().await;
}

#[tokio::test]
async fn overdrawing_is_422_insufficient_funds_with_the_balance_and_changes_nothing() {
    let t = spawn_default().await;
    // `empty` has no events, so it has nothing to give.
    let (account, payee, empty) = (funded(&t, 1_000).await, new_account(), new_account());
    let before = (observe(&t, &account).await, (0, 0, vec![]));
    let cases = [
        (
            withdraw_path(&account),
            json!({ "amountCents": 1_001 }),
            1_000,
        ),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": account, "toAccountId": payee, "amountCents": 1_001 }),
            1_000,
        ),
        (
            account_transfer_path(&account),
            json!({ "toAccountId": payee, "amountCents": 2_147_483_647 }),
            1_000,
        ),
        (withdraw_path(&empty), json!({ "amountCents": 1 }), 0),
        (
            "/api/transfers".to_string(),
            json!({ "fromAccountId": empty, "toAccountId": account, "amountCents": 1 }),
            0,
        ),
    ];
    for (path, body, balance) in cases {
        let r = t.post(&path, &body, None).await;
        assert_error(&r, 422, "INSUFFICIENT_FUNDS");
        assert_eq!(r.body["balanceCents"], balance, "{path} {body}");
        assert_eq!(r.header("idempotency-window"), Some("90"));
        assert_eq!(
            (observe(&t, &account).await, observe(&t, &payee).await),
            before,
            "{path} {body} changed something"
        );
        assert_eq!(observe(&t, &empty).await, (0, 0, vec![]));
    }
    t.shutdown().await;
}
