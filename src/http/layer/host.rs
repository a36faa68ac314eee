//! RFC 9112, 3.2: an HTTP/1.1 request names its host, and no request names two; a server
//! must answer either with 400, else both would be served. Checked first, before the route:
//! a request that breaks it is refused whatever it asks for. Probes are answered whatever
//! their `Host`: a health checker written without one (an old HAProxy `httpchk` line) would
//! otherwise mark every replica down at once.
//!
//! Then the names the API is served under ([`Served`]). A replica on `--auth none` serves its
//! API under local names only, unless `--allowed-hosts` says otherwise. The reason is DNS
//! rebinding: a web page can point its own name at 127.0.0.1, and a browser would then send
//! this replica that page's requests, under that name. With no token to ask for, only the
//! name tells them apart.

use std::sync::Arc;

use hyper::Request;
use hyper::body::Incoming;

use crate::app::App;
use crate::auth::AuthMode;
use crate::http::error::{ApiError, ErrorCode};
use crate::http::headers::at_most_one;
use crate::http::router::{Route, Routed};

use super::check::Check;

/// RFC 9112's `Host` rules and the names served, probes exempt.
#[derive(Clone)]
pub struct HostRules {
    served: Arc<Served>,
}

/// Which host names a replica serves.
#[derive(Debug, PartialEq, Eq)]
enum Served {
    /// Any name (`--auth jwt` without `--allowed-hosts`, or `--allowed-hosts '*'`).
    Any,
    /// Local names (`localhost`, `*.localhost`, IP addresses) and these.
    LocalAnd(Vec<String>),
}

impl HostRules {
    pub fn new(app: &App) -> Self {
        let listed = &app.config.http.allowed_hosts;
        let served = if listed.iter().any(|h| h == "*")
            || (listed.is_empty() && app.auth.mode() == AuthMode::Jwt)
        {
            Served::Any
        } else {
            Served::LocalAnd(listed.clone())
        };
        HostRules {
            served: Arc::new(served),
        }
    }
}

impl Check for HostRules {
    fn check(&self, routed: &mut Routed) -> Result<(), ApiError> {
        if matches!(routed.route(), Some(Route::Healthz | Route::Readyz)) {
            return Ok(());
        }
        let host = check_host(&routed.req)?;
        // The API only: the open routes (the console page, the contract, the scrape) read
        // and move nothing. A request without a Host (HTTP/1.0) came from no browser, which
        // always sends one.
        let api = routed.route().is_some_and(|r| r.is_api());
        match (&*self.served, host.filter(|_| api)) {
            (Served::LocalAnd(listed), Some(host)) if !serves(listed, host) => {
                Err(ApiError::Forbidden {
                    code: ErrorCode::HostNotAllowed,
                    message:
                        "this replica does not serve that host name; list it in --allowed-hosts"
                            .into(),
                    scope: None,
                })
            }
            _ => Ok(()),
        }
    }
}

/// Whether a `Host` value (`host[:port]`, already checked) names a local host or one listed.
fn serves(listed: &[String], host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // An IP literal: a page cannot rebind an address, only a name.
        Some(_) => return true,
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost")
        || listed.contains(&name)
}

/// RFC 9112, 3.2: an HTTP/1.1 request names its host, and no request names two; a server
/// must answer either with 400 (else both would be served). The `Host` value, if any.
fn check_host(req: &Request<Incoming>) -> Result<Option<&str>, ApiError> {
    let several =
        || ApiError::bad_request(ErrorCode::BadRequest, "send one Host header, not several");
    let host = at_most_one(req.headers(), hyper::header::HOST).map_err(|_| several())?;
    // A proxy that joined two Host fields into one list sent two hosts.
    if host.is_some_and(|h| h.as_bytes().contains(&b',')) {
        return Err(several());
    }
    // The field is `uri-host [":" port]` (RFC 9110, 7.2; an http URI's host is never empty):
    // no user, no path, no spaces (else `Host: a b/c@d` would be served).
    if host.is_some_and(|h| !is_host_and_port(h.as_bytes())) {
        return Err(ApiError::bad_request(
            ErrorCode::BadRequest,
            "the Host header is not a host with an optional port",
        ));
    }
    if host.is_none() && req.version() == hyper::Version::HTTP_11 {
        return Err(ApiError::bad_request(
            ErrorCode::BadRequest,
            "an HTTP/1.1 request must carry a Host header",
        ));
    }
    // Checked as host[:port] above, which is ASCII.
    Ok(host.and_then(|h| h.to_str().ok()))
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
    fn local_names_and_listed_ones_are_served() {
        let listed = ["tally.internal".to_string()];
        for good in [
            "localhost",
            "LOCALHOST:8080",
            "app.localhost",
            "localhost.",
            "127.0.0.1:8080",
            "10.0.0.7",
            "[::1]:80",
            "tally.internal:443",
        ] {
            assert!(serves(&listed, good), "{good}");
        }
        for bad in [
            "rebind.attacker.example",
            "localhost.attacker.example",
            "tally.internal.attacker.example:80",
            "127.0.0.1.nip.io",
        ] {
            assert!(!serves(&listed, bad), "{bad}");
        }
    }

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
