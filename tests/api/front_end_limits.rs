//! Request limits at the HTTP front end, against a real in-process server over raw TCP (so
//! the test controls every byte sent and reads exactly what hyper answers).
//!
//! Self-contained on purpose: it starts its own server rather than sharing the black-box
//! helpers of the other suites.

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use tally::app::App;
use tally::config::Config;
use tally::config::http::DEFAULT_MAX_HEADER_BYTES;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A header this large was accepted before the cap: under hyper's own ~400 KB buffer limit.
const HUGE_HEADER_BYTES: usize = 200_000;

struct Server {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Server {
    /// One instance on its own embedded store, on a loopback port, with `flags`.
    async fn start(flags: &[&str]) -> Self {
        let mut args = vec![
            "tally",
            "--listen",
            "127.0.0.1:0",
            "--seed-demo-accounts",
            "false",
        ];
        args.extend_from_slice(flags);
        let config = Config::parse_from(args);
        config.validate().expect("valid config");
        let app: Arc<App> = App::builder(config).build().await.expect("app builds");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tally::http::serve(app, listener, async {
            let _ = stopped.await;
        }));
        Self { addr, stop, task }
    }

    async fn shutdown(self) {
        let _ = self.stop.send(());
        self.task.await.expect("server task");
    }

    /// Sends `request` and reads until the server closes the connection.
    async fn exchange(&self, request: &str) -> String {
        let mut stream = TcpStream::connect(self.addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("sent");
        let mut answer = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            stream.read_to_end(&mut answer),
        )
        .await
        .expect("the connection is closed after the answer")
        .expect("read");
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// Sends `GET /healthz` with one `X-Padding` header of `padding` bytes and returns the
    /// status line of the answer. The request is written by its own task while this one
    /// reads: a server that refuses the head stops reading, so the rest of a long request
    /// may never be written (or fail with a reset), and what counts is what comes back.
    async fn get_with_header(&self, padding: usize) -> String {
        let stream = TcpStream::connect(self.addr).await.expect("connect");
        let (mut rx, mut tx) = stream.into_split();
        let request = format!(
            "GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Padding: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(padding)
        );
        let writer = tokio::spawn(async move {
            // An error here is the server refusing the rest: expected for an over-long head.
            let _ = tx.write_all(request.as_bytes()).await;
            let _ = tx.flush().await;
            tx
        });
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        // Read up to the end of the status line, or until the server closes the connection.
        while !answer.windows(2).any(|w| w == b"\r\n") {
            match rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
        drop(writer.await.expect("writer task"));
        let text = String::from_utf8_lossy(&answer);
        text.lines().next().unwrap_or_default().to_string()
    }
}

/// A whole answer read off a raw connection: its status line, header lines (names in lower
/// case) and body, and whether the server closed the connection after it.
struct Answer {
    status: String,
    headers: Vec<(String, String)>,
    body: String,
    closed: bool,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The answer's JSON body.
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {:?}", self.status, self.body))
    }
}

/// Splits the first answer off `bytes`, framed by its `content-length`.
fn first_answer(bytes: &[u8]) -> Option<(Answer, usize)> {
    let text = String::from_utf8_lossy(bytes);
    let head_end = text.find("\r\n\r\n")?;
    let mut lines = text[..head_end].split("\r\n");
    let status = lines.next()?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map_or(0, |(_, v)| v.parse().expect("numeric content-length"));
    let end = head_end + 4 + length;
    let body = String::from_utf8_lossy(bytes.get(head_end + 4..end)?).into_owned();
    let answer = Answer {
        status,
        headers,
        body,
        closed: false,
    };
    Some((answer, end))
}

impl Server {
    /// Sends `requests` on one connection (written by their own task: a server that refuses
    /// a head stops reading it, and the rest may never be taken), at once or each after the
    /// answer to the one before, and reads every answer until the server closes the
    /// connection. A reset after the answers counts as the close: what counts is what came
    /// back first.
    async fn answers(&self, requests: Vec<Vec<u8>>, one_at_a_time: bool) -> Vec<Answer> {
        let stream = TcpStream::connect(self.addr).await.expect("connect");
        let (mut rx, mut tx) = stream.into_split();
        let (answered, mut next) = tokio::sync::mpsc::unbounded_channel::<()>();
        let writer = tokio::spawn(async move {
            for request in requests {
                if tx.write_all(&request).await.is_err() {
                    break;
                }
                if one_at_a_time && next.recv().await.is_none() {
                    break;
                }
            }
            tx
        });
        let (mut got, mut answers) = (Vec::new(), Vec::new());
        let mut buf = vec![0u8; 64 * 1024];
        let closed = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                match rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return true,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
                while let Some((answer, used)) = first_answer(&got) {
                    answers.push(answer);
                    got.drain(..used);
                    let _ = answered.send(());
                }
            }
        })
        .await
        .unwrap_or(false);
        drop(answered);
        drop(writer.await.expect("writer task"));
        assert!(got.is_empty(), "bytes after the answers: {got:?}");
        if let Some(last) = answers.last_mut() {
            last.closed = closed;
        }
        answers
    }

    /// The one answer to `request`.
    async fn answer(&self, request: Vec<u8>) -> Answer {
        let mut answers = self.answers(vec![request], false).await;
        assert_eq!(answers.len(), 1, "one answer");
        answers.remove(0)
    }

    async fn balance(&self, account: uuid::Uuid) -> i64 {
        let answer = self
            .answer(
                format!(
                    "GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: localhost\r\n\
                     Connection: close\r\n\r\n"
                )
                .into_bytes(),
            )
            .await;
        assert!(
            answer.status.starts_with("HTTP/1.1 200"),
            "{}",
            answer.status
        );
        answer.json()["balanceCents"].as_i64().expect("a balance")
    }
}

/// A deposit of 5 cents to `account`, with `extra` header lines and `target_padding` added
/// to its target (`&` separators, a query naming no parameter, which the route takes).
fn deposit(account: uuid::Uuid, target_padding: usize, extra: &str) -> Vec<u8> {
    let body = r#"{"amountCents":5}"#;
    format!(
        "POST /api/accounts/{account}/deposit?{} HTTP/1.1\r\nHost: localhost\r\n\
         Content-Type: application/json\r\nIdempotency-Key: {}\r\n{extra}\
         Content-Length: {}\r\n\r\n{body}",
        "&".repeat(target_padding),
        uuid::Uuid::new_v4(),
        body.len()
    )
    .into_bytes()
}

/// A balance read of `account`, padded like [`deposit`].
fn balance_read(account: uuid::Uuid, target_padding: usize, extra: &str) -> Vec<u8> {
    format!(
        "GET /api/accounts/{account}/balance?{} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n",
        "&".repeat(target_padding)
    )
    .into_bytes()
}

/// Asserts `answer` is the API's JSON refusal `status`/`code`, closing its connection.
fn assert_refused(answer: &Answer, status: &str, code: &str, what: &str) {
    assert_eq!(answer.status, format!("HTTP/1.1 {status}"), "{what}");
    assert_eq!(
        answer.header("content-type"),
        Some("application/json"),
        "{what}"
    );
    assert_eq!(answer.json()["error"], code, "{what}: {}", answer.body);
    assert!(answer.json()["message"].is_string(), "{what}");
    assert_eq!(answer.header("connection"), Some("close"), "{what}");
    assert!(
        answer.closed,
        "{what}: the connection is closed after the answer"
    );
}

/// Rule (RFC 9110, 15.5.15): a request line that alone passes the head limit is answered
/// 414 `URI_TOO_LONG` in the API's JSON error shape (not hyper's empty 431), on a route
/// that writes as on one that reads, and on a path no route serves; nothing is written and
/// the connection is closed after the answer.
#[tokio::test]
async fn a_request_line_over_the_head_limit_is_414_in_json_and_writes_nothing() {
    let server = Server::start(&[]).await;
    let account = uuid::Uuid::new_v4();
    let long_path = format!(
        "GET /{} HTTP/1.1\r\nHost: localhost\r\n\r\n",
        "a".repeat(20_000)
    );
    for (what, request) in [
        ("a deposit", deposit(account, 20_000, "")),
        ("a balance read", balance_read(account, 20_000, "")),
        ("a 20,000-character path", long_path.into_bytes()),
        // Just over: the request line alone is the limit's length.
        (
            "a deposit just over",
            deposit(account, DEFAULT_MAX_HEADER_BYTES, ""),
        ),
    ] {
        let answer = server.answer(request).await;
        assert_refused(&answer, "414 URI Too Long", "URI_TOO_LONG", what);
    }
    assert_eq!(server.balance(account).await, 0, "nothing was written");
    // Under the limit, the same deposit is served.
    let answer = server
        .answer(deposit(account, 1_000, "Connection: close\r\n"))
        .await;
    assert!(answer.status.starts_with("HTTP/1.1 200"), "{}", answer.body);
    server.shutdown().await;
}

/// Rule: header fields that take a head past the limit (or more than 100 of them) are
/// answered 431 `HEADERS_TOO_LARGE` in the API's JSON error shape, on a route that writes
/// as on one that reads; nothing is written and the connection is closed after the answer.
#[tokio::test]
async fn header_fields_over_the_head_limit_are_431_in_json_and_write_nothing() {
    let server = Server::start(&[]).await;
    let account = uuid::Uuid::new_v4();
    let padding = format!("X-Padding: {}\r\n", "a".repeat(20_000));
    let many: String = (0..101).map(|i| format!("X-Field-{i}: x\r\n")).collect();
    for (what, request) in [
        ("a deposit", deposit(account, 0, &padding)),
        ("a balance read", balance_read(account, 0, &padding)),
        ("a deposit with 101 fields", deposit(account, 0, &many)),
        (
            "a balance read with 101 fields",
            balance_read(account, 0, &many),
        ),
        // A request line of most of the limit, its fields taking it over.
        (
            "a long line, then fields",
            deposit(account, 16_000, &"X-A: b\r\n".repeat(100)),
        ),
    ] {
        let answer = server.answer(request).await;
        assert_refused(
            &answer,
            "431 Request Header Fields Too Large",
            "HEADERS_TOO_LARGE",
            what,
        );
    }
    assert_eq!(server.balance(account).await, 0, "nothing was written");
    server.shutdown().await;
}

/// Rule: `--max-header-bytes` sets where 414 and 431 begin, below hyper's smallest read
/// buffer too (a head that arrives whole and is over the limit).
#[tokio::test]
async fn the_414_and_431_follow_the_head_limit_flag() {
    let server = Server::start(&["--max-header-bytes", "2048"]).await;
    let account = uuid::Uuid::new_v4();
    let answer = server.answer(deposit(account, 3_000, "")).await;
    assert_refused(&answer, "414 URI Too Long", "URI_TOO_LONG", "line");
    let padding = format!("X-Padding: {}\r\n", "a".repeat(3_000));
    let answer = server.answer(balance_read(account, 0, &padding)).await;
    let what = "fields";
    assert_refused(
        &answer,
        "431 Request Header Fields Too Large",
        "HEADERS_TOO_LARGE",
        what,
    );
    assert_eq!(server.balance(account).await, 0, "nothing was written");
    server.shutdown().await;
}

/// Rule: the admin address (`--admin-listen`) answers an over-long head in the same JSON
/// shape.
#[tokio::test]
async fn the_admin_address_refuses_an_over_long_head_in_json() {
    let config = Config::parse_from(["tally", "--listen", "127.0.0.1:0"]);
    let app: Arc<App> = App::builder(config).build().await.expect("app builds");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(tally::http::serve_admin(app, listener, async {
        let _ = stopped.await;
    }));
    let admin = Server { addr, stop, task };
    let long_line = format!(
        "GET /metrics?{} HTTP/1.1\r\nHost: t\r\n\r\n",
        "&".repeat(20_000)
    );
    let answer = admin.answer(long_line.into_bytes()).await;
    assert_refused(&answer, "414 URI Too Long", "URI_TOO_LONG", "admin, line");
    let padding = format!("X-Padding: {}\r\n", "a".repeat(20_000));
    let fields = format!("GET /metrics HTTP/1.1\r\nHost: t\r\n{padding}\r\n");
    let answer = admin.answer(fields.into_bytes()).await;
    let what = "admin, fields";
    assert_refused(
        &answer,
        "431 Request Header Fields Too Large",
        "HEADERS_TOO_LARGE",
        what,
    );
    admin.shutdown().await;
}

/// Rule: on a connection that already carried requests, bodies framed by length and by
/// chunks among them, a head over the limit is still told apart by its request line: the
/// requests before it are answered first, in order, and it gets its own JSON refusal. A
/// body with long lines and blank lines in it is never taken for a head.
#[tokio::test]
async fn a_head_over_the_limit_after_requests_on_its_connection_is_refused_in_turn() {
    let server = Server::start(&[]).await;
    let account = uuid::Uuid::new_v4();
    // 20,000 bytes of JSON whitespace with blank lines in it, then a long line.
    let mut body = String::from(r#"{"amountCents":5}"#);
    body.push_str("\r\n\r\n\n\n");
    body.push_str(&" ".repeat(20_000));
    let by_length = || {
        format!(
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\n\
             Content-Type: application/json\r\nIdempotency-Key: {}\r\n\
             content-length: {}\r\n\r\n{body}",
            uuid::Uuid::new_v4(),
            body.len()
        )
    };
    let chunks: String = body
        .as_bytes()
        .chunks(7_000)
        .map(|c| format!("{:X};ext=1\r\n{}\r\n", c.len(), String::from_utf8_lossy(c)))
        .collect();
    let by_chunks = || {
        format!(
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\n\
             Content-Type: application/json\r\nIdempotency-Key: {}\r\n\
             Transfer-Encoding: chunked\r\n\r\n{chunks}0\r\nX-Trailer: t\r\n\r\n",
            uuid::Uuid::new_v4(),
        )
    };
    let padding = format!("X-Padding: {}\r\n", "a".repeat(20_000));
    for (last, status, code) in [
        (
            deposit(account, 20_000, ""),
            "414 URI Too Long",
            "URI_TOO_LONG",
        ),
        (
            balance_read(account, 0, &padding),
            "431 Request Header Fields Too Large",
            "HEADERS_TOO_LARGE",
        ),
    ] {
        // Sent at once (pipelined), and one at a time on a kept-alive connection.
        for one_at_a_time in [false, true] {
            let requests = vec![
                by_length().into_bytes(),
                by_chunks().into_bytes(),
                last.clone(),
            ];
            let answers = server.answers(requests, one_at_a_time).await;
            let what = format!("{code}, one at a time: {one_at_a_time}");
            assert_eq!(answers.len(), 3, "{what}: every request answered");
            for answer in &answers[..2] {
                assert!(
                    answer.status.starts_with("HTTP/1.1 200"),
                    "{what}: {}",
                    answer.body
                );
            }
            assert_refused(&answers[2], status, code, &what);
        }
    }
    assert_eq!(
        server.balance(account).await,
        4 * 2 * 5,
        "the deposits before, and only they"
    );
    server.shutdown().await;
}

/// Rule: a request head over the named limit is answered 431, however far under hyper's own
/// buffer limit it is; a normal request on the same server is still served.
#[tokio::test]
async fn a_request_head_over_the_header_limit_gets_431() {
    let server = Server::start(&[]).await;
    assert_eq!(
        server.get_with_header(HUGE_HEADER_BYTES).await,
        "HTTP/1.1 431 Request Header Fields Too Large"
    );
    // Just over the default limit, and just under it.
    assert_eq!(
        server.get_with_header(DEFAULT_MAX_HEADER_BYTES).await,
        "HTTP/1.1 431 Request Header Fields Too Large"
    );
    assert_eq!(
        server.get_with_header(DEFAULT_MAX_HEADER_BYTES - 200).await,
        "HTTP/1.1 200 OK"
    );
    assert_eq!(server.get_with_header(0).await, "HTTP/1.1 200 OK");
    server.shutdown().await;
}

/// Rule: `--max-header-bytes` sets the limit.
#[tokio::test]
async fn the_header_limit_follows_its_flag() {
    let server = Server::start(&["--max-header-bytes", "2048"]).await;
    assert_eq!(
        server.get_with_header(3000).await,
        "HTTP/1.1 431 Request Header Fields Too Large"
    );
    assert_eq!(server.get_with_header(1500).await, "HTTP/1.1 200 OK");
    server.shutdown().await;
}

/// Rule (RFC 9112 §6.1, request smuggling): a request carrying both `Transfer-Encoding:
/// chunked` and `Content-Length` is framed by its chunks alone, whichever header comes
/// first, and its connection is closed after the answer, so bytes a proxy might have framed
/// differently are never read as a second request.
#[tokio::test]
async fn a_request_with_both_framings_is_read_by_its_chunks_and_its_connection_closed() {
    let server = Server::start(&[]).await;
    let body = r#"{"amountCents":5}"#;
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    for (n, framing) in [
        "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
        "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
    ]
    .into_iter()
    .enumerate()
    {
        let account = uuid::Uuid::new_v4();
        // The deposit, then a request a Content-Length reader would find inside its body.
        let text = server
            .exchange(&format!(
                "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\n\
                 Content-Type: application/json\r\nIdempotency-Key: both-{n}\r\n{framing}\r\n\
                 {chunked}GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
            ))
            .await;
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{framing}: {text}");
        assert!(text.contains(r#""balanceCents":5"#), "{framing}: {text}");
        assert_eq!(
            text.matches("HTTP/1.1 ").count(),
            1,
            "{framing}: one answer, nothing read past the chunks: {text}"
        );
    }
    server.shutdown().await;
}

/// Rule: a transfer coding other than `chunked` (which hyper lets through ahead of it, and
/// does not decode) is refused like a content coding, 415, and `chunked` applied twice,
/// framing no sender may use (RFC 9112, 6.1, which hyper undoes once and would hand the
/// rest over as the body), is 400; either writes nothing, whether the codings are named in
/// one field or two.
#[tokio::test]
async fn a_transfer_coding_other_than_chunked_once_is_refused_and_writes_nothing() {
    let server = Server::start(&[]).await;
    let body = r#"{"amountCents":5}"#;
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let account = uuid::Uuid::new_v4();
    let deposit = |codings: &str| {
        format!(
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\n\
             Content-Type: application/json\r\nConnection: close\r\n{codings}\r\n{chunked}"
        )
    };
    for (codings, status, says) in [
        (
            "Transfer-Encoding: gzip, chunked\r\n",
            "415 Unsupported Media Type",
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
            "415 Unsupported Media Type",
            "UNSUPPORTED_MEDIA_TYPE",
        ),
        (
            "Transfer-Encoding: chunked, chunked\r\n",
            "400 Bad Request",
            "at most once",
        ),
        (
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
            "400 Bad Request",
            "at most once",
        ),
    ] {
        let text = server.exchange(&deposit(codings)).await;
        assert!(
            text.starts_with(&format!("HTTP/1.1 {status}")),
            "{codings}: {text}"
        );
        assert!(text.contains(says), "{text}");
    }
    let balance = server
        .exchange(&format!(
            "GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert!(balance.contains(r#""balanceCents":0"#), "{balance}");
    // `chunked` alone, in any case, is the body as sent.
    let plain = server
        .exchange(&deposit("Transfer-Encoding: Chunked\r\n"))
        .await;
    assert!(plain.contains(r#""balanceCents":5"#), "{plain}");
    // An empty list element is no coding (RFC 9110, 5.6.1; else it would be a 415).
    let listed = server
        .exchange(&deposit("Transfer-Encoding: , chunked\r\n"))
        .await;
    assert!(listed.contains(r#""balanceCents":10"#), "{listed}");
    server.shutdown().await;
}

/// Rule (RFC 9112, 9.6): a client that closes its sending side after its request still
/// gets the answer; else hyper takes the end of input for an abort, answers
/// nothing, and a deposit can land unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_then_half_closes_is_answered() {
    let server = Server::start(&[]).await;
    let account = uuid::Uuid::new_v4();
    let body = r#"{"amountCents":5}"#;
    for i in 0..20 {
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        let request = format!(
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: localhost\r\n\
             Content-Type: application/json\r\nIdempotency-Key: half-{i}\r\n\
             Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("sent");
        stream.shutdown().await.expect("half-closed");
        let mut answer = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            stream.read_to_end(&mut answer),
        )
        .await
        .expect("closed after the answer")
        .expect("read");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 200"), "deposit {i}: {text:?}");
        assert!(
            text.contains(&format!(r#""balanceCents":{}"#, 5 * (i + 1))),
            "{text}"
        );
    }
    server.shutdown().await;
}

/// Rule: an HTTP/1.1 request without a `Host` header, or any request with two, or with a
/// `Host` that is not host[:port], is 400 and writes nothing (RFC 9112, 3.2; else
/// all would be served). HTTP/1.0 may leave it out.
#[tokio::test]
async fn a_request_without_one_host_is_refused_and_writes_nothing() {
    let server = Server::start(&[]).await;
    let body = r#"{"amountCents":5}"#;
    let account = uuid::Uuid::new_v4();
    for (version, hosts) in [
        ("HTTP/1.1", ""),
        ("HTTP/1.1", "Host: a\r\nHost: b\r\n"),
        ("HTTP/1.1", "Host: a, b\r\n"),
        ("HTTP/1.0", "Host: a\r\nHost: b\r\n"),
        ("HTTP/1.1", "Host: a b/c@d\r\n"),
        ("HTTP/1.1", "Host:\r\n"),
        ("HTTP/1.1", "Host: a/b\r\n"),
        ("HTTP/1.0", "Host: user@a\r\n"),
    ] {
        let text = server
            .exchange(&format!(
                "POST /api/accounts/{account}/deposit {version}\r\n{hosts}\
                 Content-Type: application/json\r\nConnection: close\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            ))
            .await;
        assert!(
            text.contains(" 400 Bad Request"),
            "{version} {hosts:?}: {text}"
        );
        assert!(text.contains("Host header"), "{text}");
    }
    for host in ["localhost:8080", "[::1]:80", "10.0.0.1"] {
        let text = server
            .exchange(&format!(
                "GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            ))
            .await;
        assert!(text.starts_with("HTTP/1.1 200"), "Host: {host}: {text}");
    }
    let balance = server
        .exchange(&format!(
            "GET /api/accounts/{account}/balance HTTP/1.0\r\n\r\n"
        ))
        .await;
    assert!(
        balance.contains(r#""balanceCents":0"#),
        "HTTP/1.0 without Host is served: {balance}"
    );
    // Probes are answered whatever their Host: a health checker that sends none must not
    // take every replica out of its balancer.
    let probe = server
        .exchange("GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        .await;
    assert!(probe.starts_with("HTTP/1.1 200"), "{probe}");
    server.shutdown().await;
}

/// Rule: with `--auth none` a replica serves local host names only (and IP addresses),
/// unless `--allowed-hosts` lists more or `*`: a web page that rebinds its own name to this
/// replica gets 403 `HOST_NOT_ALLOWED` and moves no money (a deposit here: it would land).
/// Probes answer any name.
#[tokio::test]
async fn with_auth_off_only_local_or_listed_host_names_are_served() {
    let account = uuid::Uuid::new_v4();
    let deposit = |host: &str| {
        let body = r#"{"amountCents":5}"#;
        format!(
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: {host}\r\n\
             Origin: http://{host}\r\nContent-Type: application/json\r\n\
             Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let balance = |host: &str| {
        format!(
            "GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )
    };
    let server = Server::start(&[]).await;
    let text = server.exchange(&deposit("rebind.attacker.example")).await;
    assert!(text.starts_with("HTTP/1.1 403"), "{text}");
    assert!(text.contains("HOST_NOT_ALLOWED"), "{text}");
    let probe = server
        .exchange(
            "GET /healthz HTTP/1.1\r\nHost: rebind.attacker.example\r\nConnection: close\r\n\r\n",
        )
        .await;
    assert!(probe.starts_with("HTTP/1.1 200"), "{probe}");
    let local = server.exchange(&balance("localhost:8080")).await;
    assert!(
        local.contains(r#""balanceCents":0,"aggregateVersion":0"#),
        "nothing written: {local}"
    );
    server.shutdown().await;

    let server = Server::start(&["--allowed-hosts", "tally.internal"]).await;
    let listed = server.exchange(&balance("Tally.Internal:8080")).await;
    assert!(listed.starts_with("HTTP/1.1 200"), "{listed}");
    let other = server.exchange(&balance("rebind.attacker.example")).await;
    assert!(other.starts_with("HTTP/1.1 403"), "{other}");
    server.shutdown().await;

    let server = Server::start(&["--allowed-hosts", "*"]).await;
    let any = server.exchange(&balance("anything.example")).await;
    assert!(any.starts_with("HTTP/1.1 200"), "{any}");
    server.shutdown().await;
}
