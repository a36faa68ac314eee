//! The HTTP side: target parsing (loopback unless allowed), a keep-alive hyper client and one
//! bounded request/response exchange.

use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, Response, Uri};
use hyper_util::client::legacy::Client as LegacyClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::LoadError;

/// Request header carrying the idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Response header marking a replayed answer.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Largest response body read; anything larger is a transport error.
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
/// Longest URL accepted for a target.
pub const MAX_TARGET_LEN: usize = 2048;

/// The keep-alive client shared by all workers.
pub type Client = LegacyClient<HttpConnector, Full<Bytes>>;

/// Builds a pooled HTTP/1 client keeping up to `connections` idle connections per host.
pub fn client(connections: usize, timeout: Duration) -> Client {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout));
    LegacyClient::builder(TokioExecutor::new())
        .pool_max_idle_per_host(connections)
        .build(connector)
}

/// One node's base URL, e.g. `http://127.0.0.1:8080`, without a trailing slash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    base: String,
    /// `host:port` to connect to (port 80 when the URL names none).
    address: String,
    /// The authority as given, for the Host header.
    authority: String,
    /// The path prefix, without a trailing slash (often empty).
    prefix: String,
}

impl Target {
    /// Parses `raw`, refusing non-HTTP schemes, queries, and non-loopback hosts unless
    /// `allow_remote`.
    pub fn parse(raw: &str, allow_remote: bool) -> Result<Self, LoadError> {
        let bad = |why: &str| LoadError::Config(format!("--target {raw:?}: {why}"));
        if raw.len() > MAX_TARGET_LEN {
            return Err(bad("URL too long"));
        }
        let uri: Uri = raw.parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(bad("https is not supported (no TLS built in)")),
            _ => return Err(bad("scheme must be http://")),
        }
        let authority = uri.authority().ok_or_else(|| bad("missing host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not accepted"));
        }
        if uri.query().is_some() {
            return Err(bad("a query string is not accepted"));
        }
        if !allow_remote && !is_loopback_host(authority.host()) {
            return Err(bad(
                "not a loopback host (127.0.0.0/8, ::1, localhost); pass --allow-remote to permit",
            ));
        }
        let path = uri.path().trim_end_matches('/');
        Ok(Target {
            base: format!("http://{}{}", authority.as_str(), path),
            address: format!(
                "{}:{}",
                authority.host(),
                authority.port_u16().unwrap_or(80)
            ),
            authority: authority.as_str().to_string(),
            prefix: path.to_string(),
        })
    }

    /// `host:port` to open a connection to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The value of the Host header for this target.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The request target (origin form) of `path_and_query` on this node.
    pub fn origin_form(&self, path_and_query: &str) -> String {
        format!("{}{}", self.prefix, path_and_query)
    }

    /// The full URI of `path_and_query` (which starts with `/`) on this target.
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, String> {
        format!("{}{}", self.base, path_and_query)
            .parse()
            .map_err(|e| format!("bad request URI: {e}"))
    }

    /// The base URL as given (normalised).
    pub fn as_str(&self) -> &str {
        &self.base
    }
}

/// True for `localhost` and loopback IP literals (IPv4-mapped included).
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

/// A response that arrived in full.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub retry_after: Option<Duration>,
    pub body: Bytes,
}

/// The error kind of a connection that could not be opened (refused, unreachable).
pub const CONNECT: &str = "connect";

/// Why no answer arrived.
#[derive(Debug, Clone)]
pub struct TransportError {
    /// Short class for counting: `timeout`, `connect`, `request` or `body`.
    pub kind: &'static str,
    pub detail: String,
}

/// The result of one exchange.
pub type Outcome = Result<Answer, TransportError>;

/// An error and its sources, joined with `: `.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Reads a response's status, the headers the generator uses, and its whole body (at most
/// [`MAX_RESPONSE_BYTES`]).
pub async fn read_answer(response: Response<Incoming>) -> Outcome {
    let status = response.status().as_u16();
    let headers = response.headers();
    let replayed = headers
        .get(IDEMPOTENT_REPLAYED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let retry_after = headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| TransportError {
            kind: "body",
            detail: chain(&*e),
        })?
        .to_bytes();
    Ok(Answer {
        status,
        replayed,
        retry_after,
        body,
    })
}

/// Sends one request and reads the whole answer, all within `timeout`.
pub async fn exchange(
    client: &Client,
    method: Method,
    uri: Uri,
    idempotency_key: Option<&str>,
    body: Option<Bytes>,
    timeout: Duration,
) -> Outcome {
    let mut builder = Request::builder().method(method).uri(uri);
    if let Some(key) = idempotency_key {
        builder = builder.header(IDEMPOTENCY_KEY, key);
    }
    if body.is_some() {
        builder = builder.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    let request = builder
        .body(Full::new(body.unwrap_or_default()))
        .map_err(|e| TransportError {
            kind: "request",
            detail: e.to_string(),
        })?;
    let work = async {
        let response = client.request(request).await.map_err(|e| TransportError {
            kind: if e.is_connect() { CONNECT } else { "request" },
            detail: chain(&e),
        })?;
        read_answer(response).await
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(outcome) => outcome,
        Err(_) => Err(TransportError {
            kind: "timeout",
            detail: format!("no complete answer within {} ms", timeout.as_millis()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_targets_pass() {
        for ok in [
            "http://127.0.0.1:8080",
            "http://127.9.9.9:1/",
            "http://localhost:80",
            "http://[::1]:8080",
            "http://[::ffff:127.0.0.1]:8080",
        ] {
            assert!(Target::parse(ok, false).is_ok(), "{ok}");
        }
        let t = Target::parse("http://127.0.0.1:8080/base/", false).unwrap();
        assert_eq!(t.as_str(), "http://127.0.0.1:8080/base");
        assert_eq!(t.address(), "127.0.0.1:8080");
        assert_eq!(t.origin_form("/api/x"), "/base/api/x");
        let t = Target::parse("http://[::1]", false).unwrap();
        assert_eq!((t.address(), t.authority()), ("[::1]:80", "[::1]"));
    }

    #[test]
    fn remote_and_odd_targets_are_refused() {
        for bad in [
            "http://10.0.0.1:8080",
            "http://example.invalid",
            "https://127.0.0.1",
            "ftp://127.0.0.1",
            "127.0.0.1:8080",
            "http://user:pw@127.0.0.1",
            "http://127.0.0.1/?q=1",
            "",
        ] {
            assert!(Target::parse(bad, false).is_err(), "{bad}");
        }
        assert!(Target::parse("http://example.invalid", true).is_ok());
    }
}
