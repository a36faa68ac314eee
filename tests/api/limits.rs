//! Limits: the 64 KiB body (declared or chunked), the concurrency limit that sheds with a
//! retryable 503, and the in-flight count of a client that disconnects mid-write.

use reqwest::StatusCode;
use serde_json::json;

use crate::common::raw_http::{post_raw, raw_exchange};
use crate::common::{
    self, assert_error, deposit_path, faults, funded, leg, new_account, observe, spawn,
    spawn_default, test_config, withdraw_path,
};

/// The body limit the API states: 64 KiB.
const MAX_BODY: usize = 64 * 1024;

#[tokio::test]
async fn a_body_of_64_kib_is_accepted_and_one_byte_more_is_413() {
    let t = spawn_default().await;
    let account = funded(&t, 100).await;
    let before = observe(&t, &account).await;
    let json = br#"{"amountCents":7}"#;
    let padded = |len: usize| {
        let mut b = json.to_vec();
        b.resize(len, b' ');
        b
    };
    let r = post_raw(&t, &withdraw_path(&account), &padded(MAX_BODY + 1), None).await;
    assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(observe(&t, &account).await, before);
    // Refused on the declared length alone, before any body byte is read.
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        withdraw_path(&account),
        t.addr,
        MAX_BODY + 1
    );
    let r = raw_exchange(t.addr, head, Vec::new()).await;
    assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(observe(&t, &account).await, before);
    // Exactly the limit is fine.
    let r = post_raw(&t, &withdraw_path(&account), &padded(MAX_BODY), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (93, 2));
    t.shutdown().await;
}

#[tokio::test]
async fn a_chunked_body_over_64_kib_is_413() {
    let t = spawn_default().await;
    let account = funded(&t, 100).await;
    let before = observe(&t, &account).await;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        withdraw_path(&account),
        t.addr
    );
    let frame = |data: &[u8]| {
        let mut f = format!("{:x}\r\n", data.len()).into_bytes();
        f.extend_from_slice(data);
        f.extend_from_slice(b"\r\n");
        f
    };
    let mut chunks = vec![frame(br#"{"amountCents":7}"#)];
    // 9 × 8 KiB of padding: past the limit however the chunks are counted.
    chunks.extend((0..9).map(|_| frame(&[b' '; 8192])));
    chunks.push(b"0\r\n\r\n".to_vec());
    let r = raw_exchange(t.addr, head, chunks).await;
    assert_error(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(observe(&t, &account).await, before);
    t.shutdown().await;
}

#[tokio::test]
async fn a_small_chunked_body_is_accepted() {
    let t = spawn_default().await;
    let account = new_account();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        deposit_path(&account),
        t.addr
    );
    let r = raw_exchange(
        t.addr,
        head,
        vec![b"5\r\n{\"amo\r\nd\r\nuntCents\":42}\r\n0\r\n\r\n".to_vec()],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(leg(&r.body), (42, 1));
    t.shutdown().await;
}

#[tokio::test]
async fn requests_over_the_concurrency_limit_are_shed_with_a_retryable_503() {
    let t = spawn(
        test_config(&["--max-concurrent-requests", "1", "--faults", "seed=1"]),
        None,
        None,
    )
    .await;
    let account = funded(&t, 1_000).await;
    // Hold one write inside the store: its request keeps the only slot.
    let mut hold = faults(&t).hold_next_write();
    let held = {
        let (client, url) = (t.client.clone(), t.url(&deposit_path(&account)));
        tokio::spawn(async move {
            common::read(
                client
                    .post(url)
                    .json(&json!({ "amountCents": 1 }))
                    .send()
                    .await
                    .expect("sent"),
            )
            .await
        })
    };
    assert!(hold.held().await);
    let r = t.deposit(&account, 2, Some("shed-1")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = t.get(&format!("/api/accounts/{account}/balance")).await;
    assert_error(&r, 503, "SERVICE_UNAVAILABLE");
    assert_eq!(r.header("retry-after"), Some("1"));
    // Probes and scrapes are never shed.
    assert_eq!(t.get("/healthz").await.status, StatusCode::OK);
    assert_eq!(t.get("/readyz").await.status, StatusCode::OK);
    let m = t.get("/metrics").await;
    assert_eq!(
        common::metric_sum(&m.text, "tally_http_requests_shed_total"),
        2.0
    );
    hold.release();
    let first = held.await.expect("held request");
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(leg(&first.body), (1_001, 2));
    // The shed write did nothing: retrying its key is a first write.
    let r = t.deposit(&account, 2, Some("shed-1")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(!r.replayed());
    assert_eq!(leg(&r.body), (1_003, 3));
    t.shutdown().await;
}

#[tokio::test]
async fn a_client_that_disconnects_mid_write_is_not_counted_in_flight_forever_and_its_write_still_lands()
 {
    // Without group commit, whose sender would carry the store write on its own task: here
    // only the handler's detaching keeps the write going once its request is dropped.
    let t = spawn(
        test_config(&["--faults", "seed=1", "--combine-writes", "false"]),
        None,
        None,
    )
    .await;
    let app = t.app.clone();
    let account = new_account();
    let mut hold = faults(&t).hold_next_write();
    let request = {
        let (client, url) = (t.client.clone(), t.url(&deposit_path(&account)));
        tokio::spawn(async move {
            client
                .post(url)
                .header("idempotency-key", "disconnect-1")
                .json(&json!({ "amountCents": 100 }))
                .send()
                .await
        })
    };
    assert!(hold.held().await);
    assert_eq!(app.metrics.http_in_flight.get(), 1);
    // The client gives up while its write is held in the store, and closes the connection.
    request.abort();
    assert!(request.await.is_err_and(|e| e.is_cancelled()));
    // Graceful shutdown returns once every connection is gone: the server has dropped the
    // abandoned request by then, while its write is still held.
    t.shutdown().await;
    assert_eq!(
        app.metrics.http_in_flight.get(),
        0,
        "an abandoned request is still counted in flight"
    );
    // The write was detached from the connection: it lands, and a retry of its key (served
    // by the same app on a new listener) is answered from it.
    hold.release();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(tally::http::serve(
        app.clone(),
        listener,
        std::future::pending(),
    ));
    let r = common::read(
        reqwest::Client::new()
            .post(format!("http://{addr}{}", deposit_path(&account)))
            .header("idempotency-key", "disconnect-1")
            .json(&json!({ "amountCents": 100 }))
            .send()
            .await
            .expect("sent"),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        r.replayed(),
        "the abandoned write was cancelled, not detached"
    );
    assert_eq!(leg(&r.body), (100, 1));
    server.abort();
}
