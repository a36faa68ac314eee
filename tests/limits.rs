//! Request limits at the HTTP front end, against a real in-process server over raw TCP (so
//! the test controls every byte sent and reads exactly what hyper answers).
//!
//! Self-contained on purpose: it starts its own server rather than sharing the black-box
//! helpers of the other suites.

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use tally::app::App;
use tally::config::{Config, DEFAULT_MAX_HEADER_BYTES};
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
            "GET /healthz HTTP/1.1\r\nHost: tally\r\nX-Padding: {}\r\nConnection: close\r\n\r\n",
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
                "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: tally\r\n\
                 Content-Type: application/json\r\nIdempotency-Key: both-{n}\r\n{framing}\r\n\
                 {chunked}GET /healthz HTTP/1.1\r\nHost: tally\r\n\r\n"
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
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: tally\r\n\
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
            "GET /api/accounts/{account}/balance HTTP/1.1\r\nHost: tally\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert!(balance.contains(r#""balanceCents":0"#), "{balance}");
    // `chunked` alone, in any case, is the body as sent.
    let plain = server
        .exchange(&deposit("Transfer-Encoding: Chunked\r\n"))
        .await;
    assert!(plain.contains(r#""balanceCents":5"#), "{plain}");
    // An empty list element is no coding (RFC 9110, 5.6.1; found black-box: it was a 415).
    let listed = server
        .exchange(&deposit("Transfer-Encoding: , chunked\r\n"))
        .await;
    assert!(listed.contains(r#""balanceCents":10"#), "{listed}");
    server.shutdown().await;
}

/// Rule (RFC 9112, 9.6): a client that closes its sending side after its request still
/// gets the answer; found black-box: hyper took the end of input for an abort, answered
/// nothing, and a deposit sometimes landed unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_then_half_closes_is_answered() {
    let server = Server::start(&[]).await;
    let account = uuid::Uuid::new_v4();
    let body = r#"{"amountCents":5}"#;
    for i in 0..20 {
        let mut stream = TcpStream::connect(server.addr).await.expect("connect");
        let request = format!(
            "POST /api/accounts/{account}/deposit HTTP/1.1\r\nHost: tally\r\n\
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
/// `Host` that is not host[:port], is 400 and writes nothing (RFC 9112, 3.2; found
/// black-box: all were served). HTTP/1.0 may leave it out.
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
    for host in ["tally:8080", "[::1]:80", "10.0.0.1"] {
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
