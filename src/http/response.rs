//! A whole answer's body and the two ways one is built (JSON, or text of a given type): the
//! leaf every handler, the error mapping and the edge share. Every answer says its type is
//! final ([`no_sniff`]).

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderValue, X_CONTENT_TYPE_OPTIONS};
use hyper::{Response, StatusCode};
use serde::Serialize;

pub type Resp = Response<Full<Bytes>>;

pub fn json_response(status: StatusCode, body: &impl Serialize) -> Resp {
    // Serialising our own response types into a Vec cannot fail; if it ever did, the answer
    // is a 500 with an errorId, never the status meant for a body that is not there.
    let (status, bytes) = match serde_json::to_vec(body) {
        Ok(bytes) => (status, bytes),
        Err(e) => {
            debug_assert!(false, "a response body failed to serialise: {e}");
            let error_id = uuid::Uuid::new_v4();
            tracing::error!(%error_id, error = %e, "a response body failed to serialise");
            let body = format!(
                r#"{{"error":"INTERNAL","message":"the response could not be written","errorId":"{error_id}"}}"#
            );
            (StatusCode::INTERNAL_SERVER_ERROR, body.into_bytes())
        }
    };
    let mut resp = Response::new(Full::new(Bytes::from(bytes)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    no_sniff(resp.headers_mut());
    resp
}

/// `X-Content-Type-Options: nosniff`: a browser takes the answer as the type it names and
/// never guesses another (a JSON error echoing input must not be run as a script or page).
/// Every answer sets it: whole ones here, event streams where they are built.
pub fn no_sniff(headers: &mut HeaderMap) {
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
}

pub fn text_response(status: StatusCode, content_type: &'static str, body: String) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    no_sniff(resp.headers_mut());
    resp
}
