//! Following a connection's request stream as hyper reads it: where each head starts, and
//! whether the first head over the limit was over it with its request line or its header
//! fields. Bodies are skipped by their framing (`Content-Length`, or chunked: [`super::chunked`]).

use super::chunked::{Chunk, ChunkStep, chunk_bytes};

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
#[cfg_attr(test, derive(Debug, PartialEq))]
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

#[cfg_attr(test, derive(Debug, PartialEq))]
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
    /// Appends bytes of the line: the first `LINE_KEPT` are kept, all are counted.
    fn extend(&mut self, bytes: &[u8]) {
        let from = self.len.min(LINE_KEPT);
        let n = bytes.len().min(LINE_KEPT - from);
        self.kept[from..from + n].copy_from_slice(&bytes[..n]);
        self.len += bytes.len();
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

/// Reads head bytes: how many were used, and what they came to. A line at a time, not a
/// byte: this runs on every byte of every request head.
fn head_bytes(head: &mut Head, bytes: &[u8], limit: usize) -> (usize, HeadStep) {
    let mut used = 0;
    while used < bytes.len() {
        // hyper refuses a head once it holds `limit` bytes of it unfinished: look no further
        // than that (at least one byte, as a byte at a time would).
        let room = limit.saturating_sub(head.len).max(1);
        let rest = &bytes[used..];
        let window = &rest[..rest.len().min(room)];
        let newline = memchr::memchr(b'\n', window);
        let taken = newline.map_or(window.len(), |i| i + 1);
        head.line.extend(&window[..newline.unwrap_or(window.len())]);
        head.len += taken;
        used += taken;
        if newline.is_some()
            && let Some(next) = end_line(head)
        {
            return (used, HeadStep::Ended(next));
        }
        if head.len >= limit {
            let over = if head.request_line_done || head.line.len == 0 {
                Over::HeaderFields
            } else {
                Over::RequestLine
            };
            return (used, HeadStep::Over(over));
        }
    }
    (used, HeadStep::More)
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

    /// The scan as it was first written, a byte at a time: the model the line-at-a-time
    /// `head_bytes` must agree with.
    fn head_bytes_bytewise(head: &mut Head, bytes: &[u8], limit: usize) -> (usize, HeadStep) {
        for (i, &b) in bytes.iter().enumerate() {
            head.len += 1;
            if b == b'\n' {
                if let Some(next) = end_line(head) {
                    return (i + 1, HeadStep::Ended(next));
                }
            } else {
                head.line.extend(&[b]);
            }
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

    /// What a step came to, comparably (the next state's body is compared through the head
    /// it was read from).
    fn summary(step: &HeadStep) -> (u8, Option<Over>) {
        match step {
            HeadStep::More => (0, None),
            HeadStep::Ended(_) => (1, None),
            HeadStep::Over(over) => (2, Some(*over)),
        }
    }

    fn piece() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        prop_oneof![
            Just(b"POST /api/accounts/x/deposit HTTP/1.1\r\n".to_vec()),
            Just(b"Content-Length: 12\r\n".to_vec()),
            Just(b"transfer-encoding: chunked\r\n".to_vec()),
            Just(b"CONNECT x:1 HTTP/1.1\r\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\n".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..90),
            proptest::collection::vec(Just(b'a'), 60..140),
        ]
    }

    proptest::proptest! {
        /// Rule: reading a head a line at a time says what reading it a byte at a time says,
        /// on any bytes, any limit and any cut into reads.
        #[test]
        fn a_line_at_a_time_reads_a_head_as_a_byte_at_a_time_does(
            pieces in proptest::collection::vec(piece(), 1..12),
            limit in 1usize..160,
            step in 1usize..50,
        ) {
            let stream: Vec<u8> = pieces.concat();
            let (mut fast, mut model) = (Head::default(), Head::default());
            for read in stream.chunks(step) {
                let (a, b) = (head_bytes(&mut fast, read, limit), head_bytes_bytewise(&mut model, read, limit));
                proptest::prop_assert_eq!(a.0, b.0);
                proptest::prop_assert_eq!(summary(&a.1), summary(&b.1));
                proptest::prop_assert_eq!(&fast, &model);
                if !matches!(a.1, HeadStep::More) {
                    break;
                }
            }
        }
    }
}
