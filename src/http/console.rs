//! `GET /`: the console, one page embedded in the binary (no build step, no CDN, no request
//! to anywhere but this replica). It lists accounts with live balances from the watch
//! stream, shows each write's `Idempotency-Key` and whether its answer was a replay, and,
//! when the replica runs with `--faults`, the write loop's arms from `/metrics`.

use std::sync::LazyLock;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hyper::StatusCode;
use hyper::header::{CACHE_CONTROL, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

use super::response::{Resp, text_response};

/// The page, compiled in.
pub const PAGE: &str = include_str!("../../assets/console.html");

/// The page may load nothing from elsewhere: its one script and one style sheet are inline,
/// and requests go to this origin only (the browser test checks it makes no other). Inline
/// code runs only if its SHA-256 is listed, never `'unsafe-inline'`: the page holds a bearer
/// token in `sessionStorage`, so a script injected into it must not run. Computed from the
/// page once, so an edit to the page cannot leave a stale hash.
static CONTENT_SECURITY_POLICY: LazyLock<HeaderValue> = LazyLock::new(|| {
    let policy = format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        inline_hash(PAGE, "script"),
        inline_hash(PAGE, "style"),
    );
    HeaderValue::from_str(&policy).expect("a policy of ASCII")
});

/// The CSP source of the page's one inline `<tag>` element: `'sha256-<base64>'` of its
/// text, as a browser hashes it. A page without one lists `'none'`.
fn inline_hash(page: &str, tag: &str) -> String {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let text = page
        .split_once(open.as_str())
        .and_then(|(_, rest)| rest.split_once(close.as_str()))
        .map(|(text, _)| text);
    match text {
        Some(text) => format!("'sha256-{}'", STANDARD.encode(Sha256::digest(text))),
        None => "'none'".into(),
    }
}

pub fn page() -> Resp {
    let mut resp = text_response(StatusCode::OK, "text/html; charset=utf-8", PAGE.to_string());
    let h = resp.headers_mut();
    h.insert(
        HeaderName::from_static("content-security-policy"),
        CONTENT_SECURITY_POLICY.clone(),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: the console's policy lets only its own inline script and style run, by hash:
    /// never `'unsafe-inline'`, and the page holds exactly one of each (a second, unhashed
    /// one would not run).
    #[test]
    fn the_console_policy_names_its_inline_code_by_hash_never_unsafe_inline() {
        let policy = CONTENT_SECURITY_POLICY.to_str().unwrap();
        assert!(!policy.contains("unsafe-inline"), "{policy}");
        for tag in ["script", "style"] {
            assert_eq!(PAGE.matches(&format!("<{tag}")).count(), 1, "one <{tag}>");
            let hash = inline_hash(PAGE, tag);
            assert!(hash.starts_with("'sha256-") && hash.len() > 50, "{hash}");
            assert!(policy.contains(&format!("{tag}-src {hash};")), "{policy}");
        }
        // The hash is of the element's text exactly, as a browser computes it: this known
        // vector is SHA-256 of "x", base64.
        assert_eq!(
            inline_hash("<script>x</script>", "script"),
            "'sha256-LXEWQrcmsEQBYnyp+6wy9chTD7GQPMTbAiWHF5IaSIE='"
        );
    }
}
