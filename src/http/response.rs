//! A whole answer's body and the two ways one is built (JSON, or text of a given type): the
//! leaf every handler, the error mapping and the edge share.

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HeaderValue};
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
    resp
}

pub fn text_response(status: StatusCode, content_type: &'static str, body: String) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}
