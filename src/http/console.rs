//! `GET /`: the console, one page embedded in the binary (no build step, no CDN, no request
//! to anywhere but this replica). It lists accounts with live balances from the watch
//! stream, shows each write's `Idempotency-Key` and whether its answer was a replay, and,
//! when the replica runs with `--faults`, the write loop's arms from `/metrics`.

use hyper::StatusCode;
use hyper::header::{CACHE_CONTROL, HeaderName, HeaderValue};

use super::response::{Resp, text_response};

/// The page, compiled in.
pub const PAGE: &str = include_str!("../../assets/console.html");

/// The page may load nothing from elsewhere: scripts and styles are inline, requests go
/// to this origin only. The browser test checks the page makes no other request.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

pub fn page() -> Resp {
    let mut resp = text_response(StatusCode::OK, "text/html; charset=utf-8", PAGE.to_string());
    let h = resp.headers_mut();
    h.insert(
        HeaderName::from_static("content-security-policy"),
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
