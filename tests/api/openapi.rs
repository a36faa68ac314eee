//! `docs/openapi.json` and the code describe the same API. Fails when a route,
//! a status or an error code exists in one and not the other:
//! - routes: [`Route::ALL`] (every route, kept complete by an exhaustive match in the
//!   router) against the spec's paths and methods, both ways;
//! - statuses: every status an [`ApiError`] answers (one of each variant, kept complete by
//!   an exhaustive match below) plus 200, against every status the spec documents;
//! - error codes: every code literal in `src/http` and the device layer's codes, against
//!   the spec's `Error.error` enum.
//!
//! A new route is one line in `Route::ALL` (and its `listed_at` arm), then its path here in
//! the spec; the test names what is missing.

use crate::common;

use std::collections::BTreeSet;

use serde_json::Value;
use tally::auth::{AuthError, Scope};
use tally::device::error::SyncCode;
use tally::http::error::{ApiError, ErrorCode};
use tally::http::openapi::DOCUMENT;
use tally::http::router::Route;

fn spec() -> Value {
    serde_json::from_str(DOCUMENT).expect("docs/openapi.json is JSON")
}

/// A concrete path for a template: the nil UUID for `{id}` and `{holdId}`.
fn concrete(template: &str) -> String {
    let nil = "00000000-0000-0000-0000-000000000000";
    template.replace("{id}", nil).replace("{holdId}", nil)
}

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

#[test]
fn every_route_is_in_the_spec_and_every_spec_operation_is_a_route() {
    let s = spec();
    assert_eq!(s["openapi"], "3.2.0");
    let paths = s["paths"].as_object().expect("paths");
    for route in Route::ALL {
        let method = route.method_str().to_lowercase();
        assert!(
            paths
                .get(route.template())
                .and_then(|p| p.get(&method))
                .is_some(),
            "{method} {} is served but not in docs/openapi.json",
            route.template()
        );
    }
    for (path, item) in paths {
        for method in METHODS.iter().filter(|m| item.get(**m).is_some()) {
            let m: hyper::Method = method.to_uppercase().parse().unwrap();
            let resolved = Route::resolve(&m, &concrete(path));
            assert!(
                matches!(&resolved, Ok(r) if r.template() == path),
                "{method} {path} is in docs/openapi.json but not served ({resolved:?})"
            );
        }
    }
}

/// One of each `ApiError` variant. The match in [`variant`] is exhaustive: a new variant
/// does not compile until it is listed there, and the test then asks for a sample here.
fn one_of_each() -> Vec<ApiError> {
    vec![
        ApiError::bad_request(ErrorCode::InvalidId, "x"),
        ApiError::PayloadTooLarge { limit: 1 },
        ApiError::UriTooLong("x".into()),
        ApiError::HeadersTooLarge("x".into()),
        ApiError::NotFound { path: "/x".into() },
        ApiError::AccountNotFound("x".into()),
        ApiError::KeyNotFound("x".into()),
        ApiError::MethodNotAllowed {
            allow: "GET",
            route: "/healthz",
        },
        ApiError::UnsupportedMediaType(""),
        ApiError::Validation("x".into()),
        ApiError::InsufficientFunds { balance: 0 },
        ApiError::InsufficientAvailable {
            available: 0,
            held: 1,
            message: "x".into(),
        },
        ApiError::HoldResolved {
            resolution: "posted",
            message: "x".into(),
        },
        ApiError::KeyReused,
        ApiError::Unprocessable {
            code: ErrorCode::Sync(SyncCode::EmptyRun),
            message: "x".into(),
        },
        ApiError::StoreConflict {
            code: ErrorCode::Sync(SyncCode::RunStraddlesMark),
            message: "x".into(),
        },
        ApiError::Conflict("x".into()),
        ApiError::Unavailable("x".into()),
        ApiError::StoreUnavailable,
        ApiError::RetryLater {
            code: ErrorCode::Sync(SyncCode::SyncUnverified),
            message: "x".into(),
        },
        ApiError::Shed {
            close_connection: false,
        },
        ApiError::Internal {
            code: ErrorCode::Internal,
            message: "x".into(),
        },
        AuthError::Missing.into(),
        AuthError::Scope(Scope::AccountsWrite).into(),
        ApiError::RateLimited {
            retry_after_secs: 1,
        },
        ApiError::Limited {
            code: ErrorCode::TooManyStreams,
            message: "x".into(),
            retry_after_secs: 1,
        },
    ]
}

fn variant(e: &ApiError) -> usize {
    match e {
        ApiError::BadRequest { .. } => 0,
        ApiError::PayloadTooLarge { .. } => 1,
        ApiError::NotFound { .. } => 2,
        ApiError::MethodNotAllowed { .. } => 3,
        ApiError::UnsupportedMediaType(_) => 4,
        ApiError::Validation(_) => 5,
        ApiError::InsufficientFunds { .. } => 6,
        ApiError::KeyReused => 7,
        ApiError::Unprocessable { .. } => 8,
        ApiError::StoreConflict { .. } => 9,
        ApiError::Conflict(_) => 10,
        ApiError::Unavailable(_) => 11,
        ApiError::Shed { .. } => 12,
        ApiError::Internal { .. } => 13,
        ApiError::Unauthorized { .. } => 14,
        ApiError::Forbidden { .. } => 15,
        ApiError::RateLimited { .. } => 16,
        ApiError::RetryLater { .. } => 17,
        ApiError::UriTooLong(_) => 18,
        ApiError::HeadersTooLarge(_) => 19,
        ApiError::AccountNotFound(_) => 20,
        ApiError::StoreUnavailable => 21,
        ApiError::Limited { .. } => 22,
        ApiError::KeyNotFound(_) => 23,
        ApiError::InsufficientAvailable { .. } => 24,
        ApiError::HoldResolved { .. } => 25,
    }
}

/// Every status documented anywhere: operations and shared responses.
fn spec_statuses(s: &Value) -> BTreeSet<u16> {
    let mut out = BTreeSet::new();
    for item in s["paths"].as_object().unwrap().values() {
        for method in METHODS {
            if let Some(resp) = item.get(method).and_then(|op| op["responses"].as_object()) {
                out.extend(
                    resp.keys()
                        .map(|k| k.parse::<u16>().expect("numeric status")),
                );
            }
        }
    }
    for r in s["components"]["responses"].as_object().unwrap().values() {
        let codes =
            &r["content"]["application/json"]["schema"]["allOf"][1]["properties"]["error"]["enum"];
        let status = codes
            .as_array()
            .and_then(|c| c.first())
            .and_then(|c| c.as_str())
            .map(code_status);
        out.extend(status);
    }
    out
}

/// The status the spec's shared responses give an error code.
fn code_status(code: &str) -> u16 {
    let s = spec();
    for (_, r) in s["components"]["responses"].as_object().unwrap() {
        let codes =
            &r["content"]["application/json"]["schema"]["allOf"][1]["properties"]["error"]["enum"];
        if codes.as_array().unwrap().iter().any(|c| c == code) {
            return status_of_response(r);
        }
    }
    panic!("{code} is in no shared response of docs/openapi.json")
}

fn status_of_response(r: &Value) -> u16 {
    // Shared responses are referenced by status from the operations: find one.
    let s = spec();
    let name = s["components"]["responses"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, v)| *v == r)
        .map(|(k, _)| k.clone())
        .unwrap();
    let reference = format!("#/components/responses/{name}");
    for item in s["paths"].as_object().unwrap().values() {
        for method in METHODS {
            if let Some(resp) = item.get(method).and_then(|op| op["responses"].as_object()) {
                for (status, v) in resp {
                    if v["$ref"] == reference.as_str() {
                        return status.parse().unwrap();
                    }
                }
            }
        }
    }
    // Not referenced by any operation (404, 405, and the head refusals 414 and 431, which
    // come before there is a route): its status is in its name's table.
    match name.as_str() {
        "NotFound" => 404,
        "MethodNotAllowed" => 405,
        "UriTooLong" => 414,
        "HeadersTooLarge" => 431,
        other => panic!("shared response {other} is used by no operation"),
    }
}

#[test]
fn every_status_the_code_answers_is_documented_and_no_other() {
    let errors = one_of_each();
    let listed: BTreeSet<usize> = errors.iter().map(variant).collect();
    assert_eq!(listed.len(), 26, "one sample of each ApiError variant");
    let mut code: BTreeSet<u16> = errors.iter().map(|e| e.status().as_u16()).collect();
    code.insert(200);
    // An open's answer (`POST /api/accounts`), and a hold placed's.
    code.insert(201);
    assert_eq!(
        spec_statuses(&spec()),
        code,
        "statuses: docs/openapi.json vs the code"
    );
}

/// Every `.rs` file under `dir`, its subdirectories included.
fn rust_files(dir: &std::path::Path) -> Vec<String> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path.to_string_lossy().into_owned());
        }
    }
    files
}

/// The error codes the code can answer: string literals in `src/http` and its modules
/// (outside tests and the flags' own `config.rs`, whose literals are environment variables)
/// that look like codes, and the device layer's codes.
fn codes_in_source() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/http");
    let mut files = rust_files(std::path::Path::new(dir));
    files.retain(|f| !f.ends_with("config.rs"));
    files.push(concat!(env!("CARGO_MANIFEST_DIR"), "/src/device/protocol.rs").into());
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let text = text.split("#[cfg(test)]").next().unwrap();
        // Code only: comments show example bodies.
        let text: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let text = text.as_str();
        // Only the codes module of the device protocol.
        let text = if file.ends_with("protocol.rs") {
            text.split("pub mod codes")
                .nth(1)
                .unwrap()
                .split("\n}")
                .next()
                .unwrap()
        } else {
            text
        };
        for literal in text.split('"').skip(1).step_by(2) {
            let looks_like_code = literal.len() > 3
                && literal.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
                && !["POST", "HEAD", "OTHER", "DELETE"].contains(&literal);
            if looks_like_code {
                out.insert(literal.to_owned());
            }
        }
    }
    out
}

#[test]
fn every_error_code_is_documented_and_no_other() {
    let s = spec();
    let documented: BTreeSet<String> =
        s["components"]["schemas"]["Error"]["properties"]["error"]["enum"]
            .as_array()
            .expect("the Error schema lists its codes")
            .iter()
            .map(|c| c.as_str().unwrap().to_owned())
            .collect();
    assert_eq!(
        documented,
        codes_in_source(),
        "error codes: docs/openapi.json vs the code"
    );
    // Each code sits under the status the code answers it with, where that is fixed.
    for e in one_of_each() {
        if matches!(
            e,
            ApiError::Unprocessable { .. } | ApiError::StoreConflict { .. }
        ) {
            continue;
        }
        let code = e.code().as_str();
        assert_eq!(code_status(code), e.status().as_u16(), "{code}");
    }
    // Every code of the enum is documented, under the status its table gives it.
    for code in ErrorCode::ALL {
        assert!(documented.contains(code.as_str()), "{code:?}");
        // The device layer's malformed id: the route parses a device id before the device
        // layer sees it, so only the route's 400 answers `INVALID_DEVICE_ID`.
        if code == ErrorCode::Sync(SyncCode::InvalidDeviceId) {
            continue;
        }
        assert_eq!(
            code_status(code.as_str()),
            code.status().as_u16(),
            "{code:?}"
        );
    }
}

/// The codes a shared response lists.
fn response_codes(r: &Value) -> BTreeSet<String> {
    r["content"]["application/json"]["schema"]["allOf"][1]["properties"]["error"]["enum"]
        .as_array()
        .map(|codes| {
            codes
                .iter()
                .map(|c| c.as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Rule: every code the Error schema names is listed by a shared response, so some
/// operation's own answer allows it (a code only in the global enum fails a client that
/// checks an answer against its operation's response).
#[test]
fn every_error_code_is_in_a_shared_response() {
    let s = spec();
    let listed: BTreeSet<String> = s["components"]["responses"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(response_codes)
        .collect();
    for code in s["components"]["schemas"]["Error"]["properties"]["error"]["enum"]
        .as_array()
        .unwrap()
    {
        let code = code.as_str().unwrap();
        // An event stream's `event: error` code, never an HTTP answer (the route says so).
        if code == "STORE_UNAVAILABLE" {
            continue;
        }
        assert!(listed.contains(code), "{code} is in no shared response");
    }
}

/// Rule: the account event stream's 400 allows the resume codes it answers
/// (`src/http/watch.rs`), besides those of any route with an id and a query.
#[test]
fn the_event_streams_bad_request_lists_its_resume_codes() {
    let s = spec();
    let op = &s["paths"]["/api/accounts/{id}/events"]["get"];
    let codes = response_codes(deref(&s, &op["responses"]["400"]));
    for code in [
        "BAD_LAST_EVENT_ID",
        "RESUME_BEYOND_TIP",
        "RESUME_TOO_FAR_BACK",
        "BAD_QUERY",
        "INVALID_ID",
    ] {
        assert!(codes.contains(code), "{code} not in the events route's 400");
    }
}

#[test]
fn every_api_operation_documents_auth_and_rate_limit_answers() {
    let s = spec();
    for route in Route::ALL {
        let op = &s["paths"][route.template()][route.method_str().to_lowercase()];
        let security = op["security"]
            .as_array()
            .expect("each operation states its security");
        match tally::http::router::required_scope(&route) {
            None => assert!(security.is_empty(), "{} is open", route.template()),
            Some(scope) => {
                assert_eq!(
                    security[0]["bearer"][0],
                    scope.as_str(),
                    "{}: the spec names the scope the code requires",
                    route.template()
                );
                for status in ["401", "403", "429", "503"] {
                    assert!(
                        op["responses"].get(status).is_some(),
                        "{} lacks {status}",
                        route.template()
                    );
                }
            }
        }
    }
}

#[tokio::test]
async fn the_replica_serves_the_committed_document() {
    let t = common::spawn_default().await;
    let r = t.get("/openapi.json").await;
    assert_eq!(r.status, reqwest::StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, spec());
    let on_disk =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json")).unwrap();
    assert_eq!(r.text, on_disk);
    t.shutdown().await;
}

/// Resolves a `$ref` to a shared response, parameter or header.
fn deref<'a>(s: &'a Value, v: &'a Value) -> &'a Value {
    match v["$ref"].as_str() {
        Some(r) => {
            let path: Vec<&str> = r.trim_start_matches("#/").split('/').collect();
            path.iter().fold(s, |node, part| &node[*part])
        }
        None => v,
    }
}

/// Each route documents what its shape can answer: a malformed id (400) where the path has
/// one; on a POST, the body's refusals (400, 413, 415, 422) and the write's retryable 409;
/// on a write, the idempotency headers; and the headers that go with 401, 429 and 503.
#[test]
fn every_route_documents_the_answers_its_shape_can_give() {
    let s = spec();
    for route in Route::ALL {
        let template = route.template();
        let method = route.method_str().to_lowercase();
        let op = &s["paths"][template][&method];
        let responses = &op["responses"];
        let has = |status: &str| responses.get(status).is_some();
        if template.contains("{id}") {
            assert!(has("400"), "{template}: a malformed id is 400");
        }
        if method == "post" {
            for status in ["400", "413", "415", "422"] {
                assert!(has(status), "{method} {template} lacks {status}");
            }
            // A batch answers 200 once every item settled: the retryable 409 is an item's.
            if route != Route::Batch {
                assert!(has("409"), "{method} {template} lacks 409");
            }
        }
        let is_write = matches!(
            route,
            Route::Deposit(_) | Route::Withdraw(_) | Route::AccountTransfer(_) | Route::Transfers
        );
        if is_write {
            let params: Vec<&str> = op["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|p| deref(&s, p)["name"].as_str())
                .collect();
            assert!(params.contains(&"Idempotency-Key"), "{template}");
            let ok = deref(&s, &responses["200"]);
            for header in [
                "Idempotency-Key",
                "Idempotency-Window",
                "Idempotent-Replayed",
            ] {
                assert!(
                    ok["headers"].get(header).is_some(),
                    "{template}: 200 lacks {header}"
                );
            }
        }
        for (status, header) in [
            ("401", "WWW-Authenticate"),
            ("429", "Retry-After"),
            ("503", "Retry-After"),
        ] {
            if has(status) {
                let r = deref(&s, &responses[status]);
                assert!(
                    r["headers"].get(header).is_some(),
                    "{template}: {status} lacks {header}"
                );
            }
        }
    }
    let not_allowed = &s["components"]["responses"]["MethodNotAllowed"];
    assert!(not_allowed["headers"].get("Allow").is_some());
}
