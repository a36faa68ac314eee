//! RFC 9112, 3.2: an HTTP/1.1 request names its host, and no request names two; a server
//! must answer either with 400, else both would be served. Checked first, before the route:
//! a request that breaks it is refused whatever it asks for. Probes are answered whatever
//! their `Host`: a health checker written without one (an old HAProxy `httpchk` line) would
//! otherwise mark every replica down at once.

use hyper::Request;
use hyper::body::Incoming;

use crate::http::error::ApiError;
use crate::http::headers::at_most_one;
use crate::http::router::{Route, Routed};

use super::check::Check;

/// RFC 9112's `Host` rules, probes exempt.
#[derive(Clone, Copy)]
pub struct HostRules;

impl Check for HostRules {
    fn check(&self, routed: &mut Routed) -> Result<(), ApiError> {
        if matches!(routed.route(), Some(Route::Healthz | Route::Readyz)) {
            return Ok(());
        }
        check_host(&routed.req)
    }
}

/// RFC 9112, 3.2: an HTTP/1.1 request names its host, and no request names two; a server
/// must answer either with 400 (else both would be served).
fn check_host(req: &Request<Incoming>) -> Result<(), ApiError> {
    let several = || ApiError::bad_request("BAD_REQUEST", "send one Host header, not several");
    let host = at_most_one(req.headers(), hyper::header::HOST).map_err(|_| several())?;
    // A proxy that joined two Host fields into one list sent two hosts.
    if host.is_some_and(|h| h.as_bytes().contains(&b',')) {
        return Err(several());
    }
    // The field is `uri-host [":" port]` (RFC 9110, 7.2; an http URI's host is never empty):
    // no user, no path, no spaces (else `Host: a b/c@d` would be served).
    if host.is_some_and(|h| !is_host_and_port(h.as_bytes())) {
        return Err(ApiError::bad_request(
            "BAD_REQUEST",
            "the Host header is not a host with an optional port",
        ));
    }
    if host.is_none() && req.version() == hyper::Version::HTTP_11 {
        return Err(ApiError::bad_request(
            "BAD_REQUEST",
            "an HTTP/1.1 request must carry a Host header",
        ));
    }
    Ok(())
}

/// Whether `value` is `uri-host [":" port]` (RFC 9110, 7.2): an authority without a user, a
/// host that is not empty, and a port, if any, of 1 to 5 digits within 0..=65535 (else
/// `:80`, `host:abc` and `[::1]x` would be served).
fn is_host_and_port(value: &[u8]) -> bool {
    if value.contains(&b'@') || hyper::http::uri::Authority::try_from(value).is_err() {
        return false;
    }
    let split = match value.first() {
        // An IP literal: the port, if any, follows its closing bracket.
        Some(b'[') => value.iter().position(|&b| b == b']').map(|end| end + 1),
        _ => Some(value.iter().position(|&b| b == b':').unwrap_or(value.len())),
    };
    let Some(split) = split else {
        return false;
    };
    let (host, rest) = value.split_at(split);
    let port_ok = match rest {
        [] => true,
        [b':', digits @ ..] => {
            (1..=5).contains(&digits.len())
                && std::str::from_utf8(digits).is_ok_and(|d| d.parse::<u16>().is_ok())
        }
        _ => false,
    };
    !host.is_empty() && port_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_a_host_and_an_optional_port() {
        for good in [
            "tally",
            "tally:8080",
            "10.0.0.1",
            "10.0.0.1:80",
            "[::1]",
            "[::1]:80",
            "[fe80::1%25eth0]:80",
            "Example.COM.",
            "xn--bcher-kva.example:65535",
        ] {
            assert!(is_host_and_port(good.as_bytes()), "{good}");
        }
        for bad in [
            "",
            ":80",
            "host:",
            "host:abc",
            "host:65536",
            "host:123456",
            "[::1]x",
            "[::1",
            "::1",
            "host:80:80",
            "u@host",
            "a b",
            "a/b",
            "host?",
        ] {
            assert!(!is_host_and_port(bad.as_bytes()), "{bad}");
        }
    }
}
