//! One connection's side of the gate: the socket wrapper that takes a slot before reading,
//! and the handle a request's handler uses to keep it.
//!
//! The rules, in the order a request meets them:
//! 1. With no request being served, a read waits until the socket is readable, then for a
//!    slot, and only then reads. A read that finds nothing gives the slot back: the
//!    connection is idle, or its client is slow to send the rest of a head, and neither
//!    may hold a slot that other connections' waiting requests could use.
//! 2. A connection waits for a slot at most `--max-queue-wait-ms` (and never more than half
//!    the head-read timeout, which would otherwise close it unanswered). Then its request
//!    is read without a slot and meets the in-flight limit behind the gate, which queues it
//!    briefly or sheds it with 503 and `Retry-After`: a client is told, never left hanging.
//! 3. A probe or scrape (`GET /healthz`, `/readyz`, `/metrics`) never waits: it is seen in
//!    the socket without being read, and let through. A replica at its limit still answers
//!    its load balancer and its monitoring. Nor does a connection its client closed.
//! 4. A request's handler runs holding its connection's slot, taking one first if the
//!    head reached it without one (a pipelined request, already in hyper's buffer).
//!    Waiting on the store counts as work: the slot stays.
//! 5. A handler that must wait for its client to send more of the body gives the slot back
//!    for that wait and takes one again after, so a slow body holds no slot either.

use std::future::{Future, poll_fn};
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{Gate, Slot};

/// Request lines that never wait at the gate (rule 3), as their first bytes on the wire.
const UNGATED: [&[u8]; 3] = [b"GET /healthz", b"GET /readyz", b"GET /metrics"];
/// Bytes peeked to recognise them: the longest prefix above.
const PEEK_BYTES: usize = 12;

/// A connection's slot, shared by its socket wrapper and the handler of its current request
/// (both run in the connection's task; the lock is never contended).
pub struct ConnSlot {
    gate: Arc<Gate>,
    /// The longest a request waits for a slot (rule 2).
    max_wait: Duration,
    held: Mutex<Option<Slot>>,
    /// A request's handler is running: reads are for its body or hyper's check that the
    /// client is still there, and take no slot of their own.
    serving: AtomicBool,
    /// The current request was let through without a slot (rules 2 and 3).
    unslotted: AtomicBool,
}

/// A request being served; on drop the connection goes back to rule 1. The slot itself is
/// kept until the next read finds nothing, so a pipelined request behind this one is read
/// without waiting again.
pub struct Serving {
    conn: Arc<ConnSlot>,
}

impl Serving {
    /// Rule 4, second half: holds a slot, taking one if the head came without the gate
    /// (and was not let through on purpose).
    pub async fn hold_slot(&self) {
        let conn = &self.conn;
        if !conn.holds() && !conn.unslotted.load(Ordering::Acquire) {
            conn.clone().take_bounded().await;
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.conn.serving.store(false, Ordering::Release);
        self.conn.unslotted.store(false, Ordering::Release);
    }
}

impl ConnSlot {
    pub fn new(gate: Arc<Gate>, max_wait: Duration) -> Arc<Self> {
        Arc::new(ConnSlot {
            gate,
            max_wait,
            held: Mutex::new(None),
            serving: AtomicBool::new(false),
            unslotted: AtomicBool::new(false),
        })
    }

    fn holds(&self) -> bool {
        self.held.lock().is_some()
    }

    fn serving(&self) -> bool {
        self.serving.load(Ordering::Acquire)
    }

    /// Holds a slot, or after `max_wait` goes on without one (rule 2). Owns its handle, so
    /// the socket wrapper can keep the wait across polls.
    async fn take_bounded(self: Arc<Self>) {
        match tokio::time::timeout(self.max_wait, self.gate.clone().take()).await {
            Ok(slot) => *self.held.lock() = Some(slot),
            Err(_) => self.let_through(),
        }
    }

    fn let_through(&self) {
        self.gate.metrics.http_gate_waits_expired.inc();
        self.unslotted.store(true, Ordering::Release);
    }

    /// Rule 1: the connection waits on its client, with no slot and no pass.
    fn give_back(&self) {
        drop(self.held.lock().take());
        self.unslotted.store(false, Ordering::Release);
    }

    /// Rule 4, first half: marks a request served. Called when hyper hands the request over,
    /// before its future is first polled: hyper's check that the client is still there
    /// comes in between, and must not give the slot back.
    pub fn serve(self: &Arc<Self>) -> Serving {
        self.serving.store(true, Ordering::Release);
        Serving { conn: self.clone() }
    }

    /// Rule 5: runs `body` (a read of the request's body), giving the slot back while it
    /// waits on the client and taking one again after.
    pub async fn while_client_sends<F: Future>(self: &Arc<Self>, body: F) -> F::Output {
        let mut body = pin!(body);
        if let Poll::Ready(done) = poll_fn(|cx| Poll::Ready(body.as_mut().poll(cx))).await {
            return done;
        }
        let had = self.held.lock().take().is_some();
        let done = body.await;
        if had {
            self.clone().take_bounded().await;
        }
        done
    }
}

type Taking = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A client socket whose reads pass the gate (rules 1 to 3).
pub struct GatedIo {
    stream: TcpStream,
    conn: Arc<ConnSlot>,
    /// A bounded wait for a slot, under way.
    taking: Option<Taking>,
}

impl GatedIo {
    pub fn new(stream: TcpStream, conn: Arc<ConnSlot>) -> Self {
        GatedIo {
            stream,
            conn,
            taking: None,
        }
    }

    /// Ready once this connection holds a slot or may read without one.
    fn poll_slot(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let conn = &self.conn;
        if conn.serving() || conn.holds() || conn.unslotted.load(Ordering::Acquire) {
            return Poll::Ready(Ok(()));
        }
        // Nothing to read yet: wait for the client without a slot.
        ready!(self.stream.poll_read_ready(cx))?;
        // Once queued, only the queue hands out the slot (first come, first served).
        if self.taking.is_none() {
            if let Some(slot) = conn.gate.try_take() {
                *conn.held.lock() = Some(slot);
                return Poll::Ready(Ok(()));
            }
            if ready!(self.poll_ungated(cx)) {
                conn.unslotted.store(true, Ordering::Release);
                return Poll::Ready(Ok(()));
            }
        }
        let conn = self.conn.clone();
        let taking = self
            .taking
            .get_or_insert_with(|| Box::pin(conn.take_bounded()));
        ready!(taking.as_mut().poll(cx));
        self.taking = None;
        Poll::Ready(Ok(()))
    }

    /// Rule 3: whether the waiting bytes start a probe or a scrape (peeked, not read). A
    /// connection its client closed (or broke) has nothing to wait for either: reading
    /// tells hyper to close it now, instead of after a wait for a slot. Pending when the
    /// readiness was stale and nothing has arrived yet.
    fn poll_ungated(&self, cx: &mut Context<'_>) -> Poll<bool> {
        let mut bytes = [0u8; PEEK_BYTES];
        let mut buf = ReadBuf::new(&mut bytes);
        Poll::Ready(match ready!(self.stream.poll_peek(cx, &mut buf)) {
            Ok(0) | Err(_) => true,
            Ok(_) => UNGATED.iter().any(|line| buf.filled().starts_with(line)),
        })
    }
}

impl AsyncRead for GatedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_slot(cx))?;
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if read.is_pending() && !this.conn.serving() {
            this.conn.give_back();
        }
        read
    }
}

impl AsyncWrite for GatedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
