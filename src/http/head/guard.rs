//! The socket wrapper that answers hyper's refusal of a head in the API's JSON shape.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::scan::{HeadScan, Over};
use crate::http::error::ApiError;

/// hyper's own answers to a head it refused, as they start on the wire: the only 414 and 431
/// a connection sends (no handler answers either).
const HYPER_URI_TOO_LONG: &[u8] = b"HTTP/1.1 414 URI Too Long\r\n";
const HYPER_HEAD_TOO_LARGE: &[u8] = b"HTTP/1.1 431 Request Header Fields Too Large\r\n";
/// hyper's own cap on a request target, whatever the head limit (its 414).
const HYPER_MAX_URI_BYTES: usize = u16::MAX as usize - 1;

/// A connection's socket with its head refusals answered in the API's shape (see the
/// module's notes): reads are followed by a [`HeadScan`]; hyper's own answer to a head it
/// refused is replaced by the JSON one, after which the connection only closes.
pub struct HeadGuard<T> {
    inner: T,
    scan: HeadScan,
    limit: usize,
    refusal: Option<Refusal>,
}

/// The answer in place of hyper's.
struct Refusal {
    answer: Bytes,
    sent: usize,
    /// The sending side is closed after it: the client reads the answer, then the end,
    /// whatever of its request is left unread when the connection closes.
    closed: bool,
}

impl<T> HeadGuard<T> {
    /// `inner` with heads of more than `limit` bytes answered in JSON.
    pub fn new(inner: T, limit: usize) -> Self {
        HeadGuard {
            inner,
            scan: HeadScan::new(limit),
            limit,
            refusal: None,
        }
    }

    /// The error hyper's refusal at the start of `written` stands for, if it is one.
    fn refused(&self, written: &[u8]) -> Option<ApiError> {
        if written.starts_with(HYPER_URI_TOO_LONG) {
            return Some(ApiError::UriTooLong(format!(
                "the request target is over {HYPER_MAX_URI_BYTES} bytes"
            )));
        }
        if !written.starts_with(HYPER_HEAD_TOO_LARGE) {
            return None;
        }
        let limit = self.limit;
        Some(match self.scan.over() {
            Some(Over::RequestLine) => ApiError::UriTooLong(format!(
                "the request line is over the limit of {limit} bytes for a request's head"
            )),
            Some(Over::HeaderFields) => ApiError::HeadersTooLarge(format!(
                "the request's header fields take its head over the limit of {limit} bytes"
            )),
            None => ApiError::HeadersTooLarge(format!(
                "the request's head is over its limits: {limit} bytes, or 100 header fields"
            )),
        })
    }
}

impl<T: AsyncWrite + Unpin> HeadGuard<T> {
    /// Replaces `written` if it is hyper's refusal, then sends the replacement. Ready(true)
    /// once a refusal is sent (what hyper writes is then dropped).
    fn poll_refusal(&mut self, cx: &mut Context<'_>, written: &[u8]) -> Poll<io::Result<bool>> {
        if self.refusal.is_none() {
            let Some(error) = self.refused(written) else {
                return Poll::Ready(Ok(false));
            };
            let status = error.status().as_u16();
            tracing::info!(status, code = error.code().as_str(), "request head refused");
            self.refusal = Some(Refusal {
                answer: raw_answer(error),
                sent: 0,
                closed: false,
            });
        }
        let Some(refusal) = &mut self.refusal else {
            return Poll::Ready(Ok(false));
        };
        while refusal.sent < refusal.answer.len() {
            let rest = &refusal.answer[refusal.sent..];
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, rest))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            refusal.sent += n;
        }
        if !refusal.closed {
            ready!(Pin::new(&mut self.inner).poll_shutdown(cx))?;
            refusal.closed = true;
        }
        Poll::Ready(Ok(true))
    }
}

/// An error as a whole HTTP/1.1 answer that closes its connection.
fn raw_answer(error: ApiError) -> Bytes {
    let (parts, mut body) = error.into_response().into_parts();
    // A whole body is one frame, ready at once.
    let body = match Pin::new(&mut body).poll_frame(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Some(Ok(frame))) => frame.into_data().unwrap_or_default(),
        _ => Bytes::new(),
    };
    let status = parts.status;
    let mut out = BytesMut::new();
    let reason = status.canonical_reason().unwrap_or_default();
    out.put_slice(format!("HTTP/1.1 {} {reason}\r\n", status.as_str()).as_bytes());
    for (name, value) in &parts.headers {
        out.put_slice(name.as_str().as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    out.put_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    out.put_slice(b"connection: close\r\n\r\n");
    out.put_slice(&body);
    out.freeze()
}

impl<T: AsyncRead + Unpin> AsyncRead for HeadGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        this.scan.feed(&buf.filled()[before..]);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HeadGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if ready!(this.poll_refusal(cx, buf))? {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        if ready!(this.poll_refusal(cx, first))? {
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: usize = 100;

    #[test]
    fn hyper_refusals_are_recognised_and_nothing_else() {
        let guard = HeadGuard::new((), LIMIT);
        let refused = |written: &[u8]| guard.refused(written).map(|e| e.code().as_str());
        let hyper_431 =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(refused(hyper_431), Some("HEADERS_TOO_LARGE"));
        assert_eq!(
            refused(b"HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\n\r\n"),
            Some("URI_TOO_LONG")
        );
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\n",
            b"{\"x\":1}HTTP/1.1 431 Request Header Fields Too Large\r\n",
            b"",
        ] {
            assert_eq!(refused(other), None, "{other:?}");
        }
    }

    #[test]
    fn the_answer_is_the_json_error_and_closes_its_connection() {
        let answer = raw_answer(ApiError::UriTooLong("too long".into()));
        let text = std::str::from_utf8(&answer).expect("ASCII");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        let mut lines = head.split("\r\n");
        assert_eq!(lines.next(), Some("HTTP/1.1 414 URI Too Long"));
        let fields: Vec<&str> = lines.collect();
        assert!(fields.contains(&"content-type: application/json"), "{head}");
        assert!(fields.contains(&"connection: close"), "{head}");
        let length = format!("content-length: {}", body.len());
        assert!(fields.contains(&length.as_str()), "{head}");
        let json: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert_eq!(json["error"], "URI_TOO_LONG");
        assert_eq!(json["message"], "too long");
    }
}
