//! A request head over `--max-header-bytes` answered with the API's JSON error: 414
//! `URI_TOO_LONG` when the request line alone passes the limit, 431 `HEADERS_TOO_LARGE`
//! when the header fields do (or number more than hyper's 100), and the connection closed.
//!
//! hyper refuses such a head itself, before there is a request to route, and answers it
//! with a status and an empty body. hyper stays the one judge of a head (its limits are
//! unchanged, and with them what a connection may buffer): [`HeadGuard`], around a
//! connection's socket, replaces that answer on its way out with the JSON one, in the same
//! place in the connection's answers, so answers to requests pipelined before it still go
//! first. Which of the two statuses it is comes from [`HeadScan`], which follows the
//! request stream's framing as hyper reads it (heads, `Content-Length` and chunked bodies)
//! to know where each head starts and whether its request line ended within the limit.
//!
//! Where the scan cannot follow the framing (an upgrade, conflicting lengths: requests hyper
//! refuses or closes the connection after), a later refusal is the 431.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::error::ApiError;

/// hyper's own answers to a head it refused, as they start on the wire: the only 414 and 431
/// a connection sends (no handler answers either).
const HYPER_URI_TOO_LONG: &[u8] = b"HTTP/1.1 414 URI Too Long\r\n";
const HYPER_HEAD_TOO_LARGE: &[u8] = b"HTTP/1.1 431 Request Header Fields Too Large\r\n";
/// hyper's own cap on a request target, whatever the head limit (its 414).
const HYPER_MAX_URI_BYTES: usize = u16::MAX as usize - 1;
/// Bytes of a header line kept to read its name and, for the framing headers, its value.
/// A framing header longer than this is none a well-formed request sends.
const LINE_KEPT: usize = 64;

/// What a head over the limit was over it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// The request line had not ended by the limit.
    RequestLine,
    /// The request line ended within it; the header fields took the head past it.
    HeaderFields,
}

/// Where a connection's request stream is, as far as telling a request line from header
/// fields needs: fed every byte hyper reads, in order.
pub struct HeadScan {
    limit: usize,
    at: At,
    /// The first head that passed the limit: the one hyper refuses.
    over: Option<Over>,
}

enum At {
    Head(Head),
    /// In a body framed by `Content-Length`: its bytes still to come.
    Body(u64),
    Chunked(Chunk),
    /// Past a head over the limit, or framing this scan does not follow.
    Lost,
}

#[derive(Default)]
struct Head {
    /// Bytes so far, leading empty lines included (hyper counts them too).
    len: usize,
    request_line_done: bool,
    line: Line,
    content_length: Option<u64>,
    /// Whether the last `Transfer-Encoding` names `chunked` last (hyper's rule).
    chunked: Option<bool>,
    /// This head's body is framed in a way the scan does not follow.
    lost: bool,
}

struct Line {
    len: usize,
    kept: [u8; LINE_KEPT],
}

impl Default for Line {
    fn default() -> Self {
        Line {
            len: 0,
            kept: [0; LINE_KEPT],
        }
    }
}

impl Line {
    fn push(&mut self, b: u8) {
        if let Some(slot) = self.kept.get_mut(self.len) {
            *slot = b;
        }
        self.len += 1;
    }

    /// The line without its CR, if it was kept whole.
    fn whole(&self) -> Option<&[u8]> {
        let line = self.kept.get(..self.len)?;
        Some(line.strip_suffix(b"\r").unwrap_or(line))
    }

    fn is_empty(&self) -> bool {
        self.whole().is_some_and(<[u8]>::is_empty)
    }
}

/// A chunked body's framing (RFC 9112, 7.1), as strictly as hyper decodes it.
#[derive(Clone, Copy)]
enum Chunk {
    Start,
    Size(u64),
    SizeSpace(u64),
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// After the last chunk: the end, or a trailer field.
    EndCr,
    Trailer,
    TrailerLf,
    EndLf,
}

/// What one byte of a chunked body did.
enum ChunkStep {
    Next(Chunk),
    End,
    Lost,
}

impl HeadScan {
    pub fn new(limit: usize) -> Self {
        HeadScan {
            limit,
            at: At::Head(Head::default()),
            over: None,
        }
    }

    /// What the first head over the limit was over it with, if one was.
    pub fn over(&self) -> Option<Over> {
        self.over
    }

    /// Follows `bytes`, the next that hyper reads.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match &mut self.at {
                At::Lost => return,
                At::Body(left) => {
                    let n = usize::try_from(*left).map_or(bytes.len(), |l| l.min(bytes.len()));
                    *left -= n as u64;
                    if *left == 0 {
                        self.at = At::Head(Head::default());
                    }
                    bytes = &bytes[n..];
                }
                At::Chunked(chunk) => {
                    let (used, step) = chunk_bytes(*chunk, bytes);
                    self.at = match step {
                        ChunkStep::Next(next) => At::Chunked(next),
                        ChunkStep::End => At::Head(Head::default()),
                        ChunkStep::Lost => At::Lost,
                    };
                    bytes = &bytes[used..];
                }
                At::Head(head) => {
                    let (used, step) = head_bytes(head, bytes, self.limit);
                    match step {
                        HeadStep::More => {}
                        HeadStep::Ended(next) => self.at = next,
                        HeadStep::Over(over) => {
                            self.over.get_or_insert(over);
                            self.at = At::Lost;
                        }
                    }
                    bytes = &bytes[used..];
                }
            }
        }
    }
}

/// What reading head bytes came to.
enum HeadStep {
    /// The head goes on.
    More,
    /// It ended; the stream is at its body or the next head.
    Ended(At),
    /// It passed the limit unfinished.
    Over(Over),
}

/// Reads head bytes: how many were used, and what they came to.
fn head_bytes(head: &mut Head, bytes: &[u8], limit: usize) -> (usize, HeadStep) {
    for (i, &b) in bytes.iter().enumerate() {
        head.len += 1;
        if b == b'\n' {
            if let Some(next) = end_line(head) {
                return (i + 1, HeadStep::Ended(next));
            }
        } else {
            head.line.push(b);
        }
        // hyper refuses a head once it holds `limit` bytes of it unfinished.
        if head.len >= limit {
            let over = if head.request_line_done || head.line.len == 0 {
                Over::HeaderFields
            } else {
                Over::RequestLine
            };
            return (i + 1, HeadStep::Over(over));
        }
    }
    (bytes.len(), HeadStep::More)
}

/// A head line ended: where the stream goes if it was the head's last.
fn end_line(head: &mut Head) -> Option<At> {
    let line = std::mem::take(&mut head.line);
    if line.is_empty() {
        // Empty lines before the request line are skipped (RFC 9112, 2.2).
        return head.request_line_done.then(|| body_framing(head));
    }
    if !head.request_line_done {
        head.request_line_done = true;
        // A tunnel's bytes after its head are no request's.
        head.lost |= line.kept.starts_with(b"CONNECT ");
        return None;
    }
    header_line(head, &line);
    None
}

/// Notes a header field that frames the body (RFC 9112, 6.1 and 6.3, as hyper reads them).
fn header_line(head: &mut Head, line: &Line) {
    let kept = &line.kept[..line.len.min(LINE_KEPT)];
    let Some(colon) = kept.iter().position(|&b| b == b':') else {
        return;
    };
    let name = &kept[..colon];
    let framing = ["content-length", "transfer-encoding", "upgrade"]
        .iter()
        .any(|n| name.eq_ignore_ascii_case(n.as_bytes()));
    if !framing {
        return;
    }
    let Some(value) = line.whole().map(|l| l[colon + 1..].trim_ascii()) else {
        head.lost = true;
        return;
    };
    if name.eq_ignore_ascii_case(b"transfer-encoding") {
        let last = value.rsplit(|&b| b == b',').next().unwrap_or_default();
        head.chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
    } else if name.eq_ignore_ascii_case(b"content-length") {
        let length = std::str::from_utf8(value)
            .ok()
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok());
        match (length, head.content_length) {
            (Some(n), None) => head.content_length = Some(n),
            (Some(n), Some(before)) if n == before => {}
            _ => head.lost = true,
        }
    } else {
        head.lost = true;
    }
}

/// Where the stream goes after a head: its body, or the next head.
fn body_framing(head: &Head) -> At {
    match (head.lost, head.chunked, head.content_length) {
        (true, _, _) | (false, Some(false), _) => At::Lost,
        (false, Some(true), _) => At::Chunked(Chunk::Start),
        (false, None, Some(n)) if n > 0 => At::Body(n),
        (false, None, _) => At::Head(Head::default()),
    }
}

/// Reads chunked-body bytes from `chunk`: how many were used, and the step they ended on.
fn chunk_bytes(mut chunk: Chunk, bytes: &[u8]) -> (usize, ChunkStep) {
    let mut i = 0;
    while i < bytes.len() {
        if let Chunk::Data(left) = chunk {
            let n = usize::try_from(left).map_or(bytes.len() - i, |l| l.min(bytes.len() - i));
            let left = left - n as u64;
            chunk = if left == 0 {
                Chunk::DataCr
            } else {
                Chunk::Data(left)
            };
            i += n;
            continue;
        }
        let step = chunk_byte(chunk, bytes[i]);
        i += 1;
        match step {
            ChunkStep::Next(next) => chunk = next,
            end => return (i, end),
        }
    }
    (i, ChunkStep::Next(chunk))
}

fn hex(b: u8) -> Option<u64> {
    (b as char).to_digit(16).map(u64::from)
}

fn chunk_byte(chunk: Chunk, b: u8) -> ChunkStep {
    use ChunkStep::{End, Lost, Next};
    let grow = |size: u64, d: u64| size.checked_mul(16).and_then(|s| s.checked_add(d));
    match (chunk, b) {
        (Chunk::Start, _) => hex(b).map_or(Lost, |d| Next(Chunk::Size(d))),
        (Chunk::Size(size), _) if hex(b).is_some() => {
            grow(size, hex(b).unwrap_or_default()).map_or(Lost, |s| Next(Chunk::Size(s)))
        }
        (Chunk::Size(size) | Chunk::SizeSpace(size), b' ' | b'\t') => Next(Chunk::SizeSpace(size)),
        (Chunk::Size(size) | Chunk::SizeSpace(size), b';') => Next(Chunk::Extension(size)),
        (Chunk::Size(size) | Chunk::SizeSpace(size) | Chunk::Extension(size), b'\r') => {
            Next(Chunk::SizeLf(size))
        }
        (Chunk::Extension(_), b'\n') => Lost,
        (Chunk::Extension(size), _) => Next(Chunk::Extension(size)),
        (Chunk::SizeLf(0), b'\n') => Next(Chunk::EndCr),
        (Chunk::SizeLf(size), b'\n') => Next(Chunk::Data(size)),
        (Chunk::DataCr, b'\r') => Next(Chunk::DataLf),
        (Chunk::DataLf, b'\n') => Next(Chunk::Start),
        (Chunk::EndCr, b'\r') => Next(Chunk::EndLf),
        (Chunk::Trailer, b'\r') => Next(Chunk::TrailerLf),
        (Chunk::EndCr | Chunk::Trailer, _) => Next(Chunk::Trailer),
        (Chunk::TrailerLf, b'\n') => Next(Chunk::EndCr),
        (Chunk::EndLf, b'\n') => End,
        _ => Lost,
    }
}

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
            tracing::info!(status, code = error.code(), "request head refused");
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

    /// What a scan of `stream`, fed in pieces of `step` bytes, says of its first head over
    /// the limit.
    fn over(stream: &[u8], step: usize) -> Option<Over> {
        let mut scan = HeadScan::new(LIMIT);
        for piece in stream.chunks(step) {
            scan.feed(piece);
        }
        scan.over()
    }

    /// Every way of cutting `stream` into reads gives `expected`.
    fn assert_over(stream: &[u8], expected: Option<Over>) {
        for step in [1, 2, 7, stream.len().max(1)] {
            assert_eq!(over(stream, step), expected, "reads of {step}: {stream:?}");
        }
    }

    fn long_line() -> Vec<u8> {
        let mut head = b"GET /".to_vec();
        head.resize(LIMIT + 10, b'a');
        head.extend_from_slice(b" HTTP/1.1\r\nHost: t\r\n\r\n");
        head
    }

    fn long_fields() -> Vec<u8> {
        let mut head = b"GET / HTTP/1.1\r\nX-Padding: ".to_vec();
        head.resize(LIMIT + 10, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        head
    }

    #[test]
    fn a_head_is_over_by_its_request_line_or_by_its_fields() {
        assert_over(&long_line(), Some(Over::RequestLine));
        assert_over(&long_fields(), Some(Over::HeaderFields));
        assert_over(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", None);
        // Exactly the limit, ended: hyper takes it.
        let mut exact = b"GET / HTTP/1.1\r\nX: ".to_vec();
        exact.resize(LIMIT - 4, b'a');
        exact.extend_from_slice(b"\r\n\r\n");
        assert_eq!(exact.len(), LIMIT);
        assert_over(&exact, None);
        // Empty lines before the request line count towards the head (as hyper counts them).
        let request = b"GET / HTTP/1.1\r\n\r\n";
        let mut leading = b"\r\n".repeat((LIMIT - request.len()) / 2);
        leading.extend_from_slice(request);
        assert_over(&leading, None);
        let mut more = b"\r\n\n".to_vec();
        more.extend_from_slice(&leading);
        assert!(over(&more, 1).is_some(), "over by its leading empty lines");
    }

    /// The stream of `first` (a request with a body), then the long-line head.
    fn after(first: &[u8]) -> Vec<u8> {
        let mut stream = first.to_vec();
        stream.extend_from_slice(&long_line());
        stream
    }

    #[test]
    fn bodies_are_skipped_by_their_framing_whatever_they_hold() {
        let body = "x".repeat(LIMIT * 2) + "\r\n\r\n";
        let by_length = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        assert_over(&after(by_length.as_bytes()), Some(Over::RequestLine));
        let twice = format!(
            "POST / HTTP/1.1\r\ncontent-length:{0}\r\nContent-Length: {0} \r\n\r\n{body}",
            body.len()
        );
        assert_over(&after(twice.as_bytes()), Some(Over::RequestLine));
        let chunked = format!(
            "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n\
             {:x} ; a=b\r\n{body}\r\n1\r\n\n\r\n000\r\nT: 1\r\nU: 2\r\n\r\n",
            body.len()
        );
        assert_over(&after(chunked.as_bytes()), Some(Over::RequestLine));
        // A later Content-Length does not reframe a chunked body (hyper's rule).
        let both = format!(
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n\
             {:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        );
        assert_over(&after(both.as_bytes()), Some(Over::RequestLine));
    }

    #[test]
    fn framing_it_does_not_follow_tells_nothing_after() {
        for first in [
            "POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
            "POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc",
            "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\nabc",
            "GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            "CONNECT t:443 HTTP/1.1\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n",
        ] {
            assert_over(&after(first.as_bytes()), None);
        }
        // Only the first head over the limit counts: hyper closes the connection at it.
        let mut two = long_fields();
        two.extend_from_slice(&long_line());
        assert_over(&two, Some(Over::HeaderFields));
    }

    #[test]
    fn hyper_refusals_are_recognised_and_nothing_else() {
        let guard = HeadGuard::new((), LIMIT);
        let refused = |written: &[u8]| guard.refused(written).map(|e| e.code());
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
