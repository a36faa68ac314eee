//! `GET /openapi.json`: the API contract, `docs/openapi.json`, compiled in so
//! the binary serves the contract it was built with. `tests/api/openapi.rs` keeps it and the
//! code in step: every route, status and error code in one is in the other.

use hyper::StatusCode;

use super::response::{Resp, text_response};

/// The OpenAPI 3.1 document.
pub const DOCUMENT: &str = include_str!("../../docs/openapi.json");

pub fn document() -> Resp {
    text_response(StatusCode::OK, "application/json", DOCUMENT.to_owned())
}
