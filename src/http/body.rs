//! JSON in: content-type and size checks, decoding that tells malformed JSON (400) from a
//! well-formed body with wrong fields or types (422).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use hyper::{HeaderMap, Request};
use serde::de::DeserializeOwned;

use super::admission::RequestSlots;
use super::error::{ApiError, ErrorCode};
use super::headers::at_most_one;
// `accounts.rs` still names these here; they live in `response`.
pub use super::response::{Resp, json_response};

/// The largest request body accepted. Tally's bodies are tiny; this is generous.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Whether a Content-Type names JSON the way it is read: `application/json`, with no
/// parameter but a UTF-8 charset (JSON is UTF-8, RFC 8259; a body its sender encoded in
/// another charset would be read as bytes it is not).
fn is_utf8_json(content_type: &str) -> bool {
    let mut parts = content_type.split(';');
    let mime = parts.next().unwrap_or("").trim();
    mime.eq_ignore_ascii_case("application/json")
        && parts.all(|param| {
            let param = param.trim();
            match param.split_once('=') {
                Some((name, value)) if name.trim().eq_ignore_ascii_case("charset") => {
                    // A quoted value: the quote written as an escape keeps this file's
                    // string literals paired for the error-code scan (tests/api/openapi.rs).
                    let value = value.trim().trim_matches('\u{22}');
                    value.eq_ignore_ascii_case("utf-8") || value.eq_ignore_ascii_case("utf8")
                }
                // Other parameters say nothing about how the body is read.
                Some(_) => true,
                None => param.is_empty(),
            }
        })
}

/// Reads and decodes a JSON body of at most [`MAX_BODY_BYTES`]. A client slow to send it
/// holds neither of the request's `slots` meanwhile: the gate's nor the in-flight one.
pub async fn read_json<T: DeserializeOwned>(
    req: Request<Incoming>,
    slots: &RequestSlots,
) -> Result<T, ApiError> {
    read_json_within(req, slots, MAX_BODY_BYTES).await
}

/// [`read_json`] with a limit of its own (a batch's, `--batch-max-bytes`).
pub async fn read_json_within<T: DeserializeOwned>(
    req: Request<Incoming>,
    slots: &RequestSlots,
    limit: usize,
) -> Result<T, ApiError> {
    check_json_framing(req.headers(), limit)?;
    let collect = read_capped(Limited::new(req.into_body(), limit));
    let gated = async {
        match &slots.conn {
            Some(slot) => slot.while_client_sends(collect).await,
            None => collect.await,
        }
    };
    let collected = match &slots.in_flight {
        Some(in_flight) => in_flight.while_client_sends(gated).await?,
        None => gated.await,
    };
    let bytes = collected.map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            ApiError::PayloadTooLarge { limit }
        } else {
            ApiError::bad_request(
                ErrorCode::BadRequest,
                format!("could not read the body: {e}"),
            )
        }
    })?;
    decode_json(&bytes)
}

/// What the headers say of the body, checked before a byte of it is read: one JSON content
/// type, no content or transfer coding but chunked once, a declared length within the limit.
fn check_json_framing(headers: &HeaderMap, limit: usize) -> Result<(), ApiError> {
    // Content-Type is a singleton field (RFC 9110): two of them name no one type, and
    // taking the first would read a body its sender may have meant as the other.
    let content_type = at_most_one(headers, CONTENT_TYPE).map_err(|_| {
        ApiError::bad_request(
            ErrorCode::BadRequest,
            "send one Content-Type header, not several",
        )
    })?;
    let is_json = content_type
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_utf8_json);
    if !is_json {
        return Err(ApiError::UnsupportedMediaType(
            "content type must be application/json (a charset, if named, UTF-8)",
        ));
    }
    // A compressed body would be read as JSON bytes it is not: refused, never guessed at.
    let encoded = headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return Err(ApiError::UnsupportedMediaType(
            "content codings are not accepted: send the JSON body as is",
        ));
    }
    check_transfer_codings(headers)?;
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    Ok(())
}

/// A transfer coding hyper lets through ahead of `chunked` (`gzip, chunked`) is refused: it
/// decodes only the chunks, and would hand over the compressed bytes.
fn check_transfer_codings(headers: &HeaderMap) -> Result<(), ApiError> {
    let codings = || {
        headers
            .get_all(TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(|coding| coding.trim_ascii())
            // Empty list elements are not codings (RFC 9110, 5.6.1).
            .filter(|coding| !coding.is_empty())
    };
    if codings().any(|coding| !coding.eq_ignore_ascii_case(b"chunked")) {
        return Err(ApiError::UnsupportedMediaType(
            "transfer codings other than chunked are not accepted: send the JSON body as is",
        ));
    }
    // Chunked twice is framing no sender may use (RFC 9112, 6.1); hyper undoes it once and
    // would hand over chunk framing as the body.
    if codings().count() > 1 {
        return Err(ApiError::bad_request(
            ErrorCode::BadRequest,
            "chunked is applied at most once: send one Transfer-Encoding: chunked",
        ));
    }
    Ok(())
}

/// A body's data in one buffer, each frame copied in and dropped as it arrives. Not
/// `collect()`: that keeps every frame, and hyper makes each chunk of a chunked body a frame
/// holding a slice of its read buffer, so a 64 KiB body sent as 1-byte chunks held about
/// 2.4 MiB (a 65,536-entry queue, and the wire bytes pinned). The usual body,
/// one frame, is returned as it is. `body` bounds the total (`Limited`), so this holds at
/// most [`MAX_BODY_BYTES`].
async fn read_capped<B>(body: B) -> Result<Bytes, B::Error>
where
    B: hyper::body::Body<Data = Bytes>,
{
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut rest = BytesMut::new();
    while let Some(frame) = body.frame().await {
        // Trailers carry no body data: they are dropped.
        let Ok(mut data) = frame?.into_data() else {
            continue;
        };
        match first.take() {
            None if rest.is_empty() => first = Some(data),
            None => rest.put(&mut data),
            Some(mut head) => {
                rest.reserve(head.remaining() + data.remaining());
                rest.put(&mut head);
                rest.put(&mut data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| rest.freeze()))
}

/// Malformed JSON is a 400; valid JSON of the wrong shape (unknown field, wrong type, missing
/// field, not an object) is a 422.
pub fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let malformed = |e: serde_json::Error| {
        ApiError::bad_request(ErrorCode::InvalidJson, format!("malformed JSON: {e}"))
    };
    let not_an_object = || ApiError::Validation("the body must be a JSON object".into());
    match serde_json::from_slice::<T>(bytes) {
        // serde fills a struct from a positional array too; the API takes objects only.
        Ok(_) if !is_object(bytes) => Err(not_an_object()),
        Ok(value) => Ok(value),
        // Whether the body is JSON at all decides 400 or 422, not the error's category: the
        // shape can fail before the parser reaches a syntax error further on, and a struct
        // read from an array too long for it reports "trailing characters" (else
        // `[5,6]` would be a 400) although the array is well-formed.
        // JSON text is UTF-8 (RFC 8259, 8.1); skipping a value does not check its strings
        // (else an invalid byte in a key would be a 422).
        Err(e) if std::str::from_utf8(bytes).is_err() => Err(malformed(e)),
        Err(e) => match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
            Ok(_) if !is_object(bytes) => Err(not_an_object()),
            Ok(_) => Err(ApiError::Validation(in_json_words(&e.to_string()))),
            Err(syntax) => Err(malformed(syntax)),
        },
    }
}

/// serde's message with the Rust type it expected said in JSON's words: a caller sends JSON
/// and has no `u64` (a field with an API rule of its own, such as `amountCents`, says that
/// rule instead; `account::deserialize_amount_cents`).
fn in_json_words(message: &str) -> String {
    const RUST_TYPES: [(&str, &str); 12] = [
        ("i8", "an integer"),
        ("i16", "an integer"),
        ("i32", "an integer"),
        ("i64", "an integer"),
        ("isize", "an integer"),
        ("u8", "an integer from 0"),
        ("u16", "an integer from 0"),
        ("u32", "an integer from 0"),
        ("u64", "an integer from 0"),
        ("usize", "an integer from 0"),
        ("f32", "a number"),
        ("f64", "a number"),
    ];
    let mut out = message.to_owned();
    for (rust, json) in RUST_TYPES {
        // serde writes "expected u64" at the end of its sentence, before the position.
        for end in [" at ", ""] {
            let from = format!("expected {rust}{end}");
            if out.contains(&from) && (!end.is_empty() || out.ends_with(&from)) {
                out = out.replace(&from, &format!("expected {json}{end}"));
            }
        }
    }
    out
}

/// Whether the first non-whitespace byte opens a JSON object.
fn is_object(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|&b| b == b'{')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    struct Amount {
        #[allow(dead_code)]
        amount_cents: i64,
    }

    #[test]
    fn malformed_json_is_400_and_wrong_shape_is_422() {
        let status = |b: &[u8]| decode_json::<Amount>(b).unwrap_err().status().as_u16();
        assert_eq!(status(b"{"), 400);
        assert_eq!(status(b"not json"), 400);
        assert_eq!(status(br#"{"amountCents":"7"}"#), 422);
        assert_eq!(status(br#"{"amountCents":7,"x":1}"#), 422);
        assert_eq!(status(br#"{"amountCents":1.5}"#), 422);
        assert_eq!(status(br#"{}"#), 422);
        assert_eq!(status(br#"[7]"#), 422);
        assert_eq!(status(br#" [7] "#), 422);
        // serde reports an array too long for the struct as "trailing
        // characters", a syntax category, though the array is well-formed JSON.
        assert_eq!(status(br#"[5,6]"#), 422);
        assert_eq!(status(br#"[]"#), 422);
        assert_eq!(status(br#"7"#), 422);
        assert_eq!(status(br#"[5,6"#), 400);
        assert_eq!(status(br#"[7"#), 400);
        assert_eq!(status(br#"{"amountCents":7}x"#), 400);
        assert_eq!(status(br#"{}x"#), 400);
        assert!(decode_json::<Amount>(br#"{"amountCents":7}"#).is_ok());
    }

    /// Rule: a wrong type is refused in JSON's words, never Rust's.
    #[test]
    fn a_wrong_type_is_refused_without_rust_type_names() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(rename_all = "camelCase")]
        struct Counts {
            #[allow(dead_code)]
            seq: u64,
            #[allow(dead_code)]
            delta: i64,
        }
        let message = |b: &[u8]| decode_json::<Counts>(b).unwrap_err().to_string();
        let seq = message(br#"{"seq":-1,"delta":1}"#);
        assert!(
            seq.contains("expected an integer from 0 at line 1"),
            "{seq}"
        );
        let delta = message(br#"{"seq":1,"delta":"x"}"#);
        assert!(delta.contains("expected an integer at line 1"), "{delta}");
        for m in [seq, delta] {
            assert!(!m.contains("u64") && !m.contains("i64"), "{m}");
        }
    }
}
