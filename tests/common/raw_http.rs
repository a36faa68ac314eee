//! Requests a well-behaved client cannot send: any method with raw header bytes, a raw body,
//! and whole exchanges written byte by byte over one TCP connection (chunked bodies past the
//! limit, a declared length with no body).

use std::net::SocketAddr;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Reply, TestApp};

/// How long a raw exchange waits for the server before the test fails (instead of hanging).
pub const RAW_READ_BOUND: Duration = Duration::from_secs(30);

/// Sends any request: method, path, extra headers (raw bytes allowed) and an optional body.
pub async fn send(
    t: &TestApp,
    method: Method,
    path: &str,
    headers: &[(&str, &[u8])],
    body: Option<Vec<u8>>,
) -> Reply {
    let mut req = t.client.request(method, t.url(path));
    for (name, value) in headers {
        req = req.header(
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_bytes(value).expect("header value"),
        );
    }
    if let Some(b) = body {
        req = req.body(b);
    }
    super::read(req.send().await.expect("request sent")).await
}

/// POSTs a raw JSON body (any bytes) with `Content-Type: application/json`.
pub async fn post_raw(t: &TestApp, path: &str, body: &[u8], key: Option<&str>) -> Reply {
    let mut headers: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
    if let Some(k) = key {
        headers.push(("idempotency-key", k.as_bytes()));
    }
    send(t, Method::POST, path, &headers, Some(body.to_vec())).await
}

/// Sends raw bytes over one TCP connection (`head` and then each body chunk) and reads one
/// response. For what a well-behaved client cannot send: chunked bodies past the limit, a
/// declared length with no body.
pub async fn raw_exchange(addr: SocketAddr, head: String, chunks: Vec<Vec<u8>>) -> Reply {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    // The writer keeps its half open until it is aborted: dropping it would half-close the
    // connection. Errors are expected once the server stops reading.
    let writer = tokio::spawn(async move {
        if wr.write_all(head.as_bytes()).await.is_err() {
            return wr;
        }
        for c in chunks {
            if wr.write_all(&c).await.is_err() {
                break;
            }
        }
        let _ = wr.flush().await;
        std::future::pending::<()>().await;
        wr
    });
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let parsed = loop {
        if let Some(parsed) = parse_response(&buf) {
            break parsed;
        }
        let read = tokio::time::timeout(RAW_READ_BOUND, rd.read(&mut chunk))
            .await
            .expect("the server answers");
        match read {
            Ok(0) | Err(_) => break parse_response(&buf).expect("a whole response"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    writer.abort();
    parsed
}

/// Parses a whole HTTP/1.1 response with a Content-Length, or `None` if more bytes are needed.
pub fn parse_response(buf: &[u8]) -> Option<Reply> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).expect("ASCII head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let code: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':')?;
        headers.append(
            HeaderName::from_bytes(name.trim().as_bytes()).ok()?,
            HeaderValue::from_str(value.trim()).ok()?,
        );
    }
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("the server always sends Content-Length");
    let body = buf.get(end + 4..end + 4 + len)?;
    let text = String::from_utf8(body.to_vec()).expect("UTF-8 body");
    Some(Reply {
        status: StatusCode::from_u16(code).ok()?,
        headers,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        text,
    })
}
