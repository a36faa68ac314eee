//! One connection's side of the gate: its state (a slot held, a pass, queued, serving,
//! streaming), what its socket wrapper ([`super::io`]) decides with it before reading, and
//! the handle a request's handler uses to keep or give back its slot.
//!
//! The rules, in the order a request meets them:
//! 1. With no request being served, a read waits until the socket is readable, then for a
//!    slot, and only then reads. A read that finds nothing gives the slot back: the
//!    connection is idle, or its client is slow to send the rest of a head, and neither
//!    may hold a slot that other connections' waiting requests could use.
//! 2. A connection waits for a slot at most `--max-queue-wait-ms` (and never more than half
//!    the head-read timeout, which would otherwise close it unanswered), give or take one
//!    50 ms tick of the gate, which checks the queue's oldest. Then its request
//!    is read without a slot and meets the in-flight limit behind the gate, which queues it
//!    briefly or sheds it with 503 and `Retry-After`: a client is told, never left hanging.
//!    hyper's head-read timer runs from when the connection went idle, not from when the
//!    request arrived, so a request that arrives too late in its connection's idle time to
//!    wait the full time is read at once without a slot, as if its wait had run out (else
//!    one arriving after 9.7 s of idleness would be cut off unanswered).
//! 3. A probe or scrape (`GET /healthz`, `/readyz`, `/metrics`) never waits: it is seen in
//!    the socket without being read, and let through. A replica at its limit still answers
//!    its load balancer and its monitoring. Nor does a connection its client closed.
//! 4. A request's handler runs holding its connection's slot, taking one first if the
//!    head reached it without one (a pipelined request, already in hyper's buffer).
//!    Waiting on the store counts as work: the slot stays.
//! 5. A handler that must wait for its client to send more of the body gives the slot back
//!    for that wait and takes one again after, so a slow body holds no slot either.
//! 6. An event stream holds no slot while it lasts: its slot goes back when the stream
//!    starts, and its connection's reads take none until the stream's body is gone. hyper
//!    reads nothing while a response is being sent (it serves clients that half-close), so
//!    the stream watches its socket for its client's hang-up itself ([`Streaming`]); and a
//!    stream waits on notifications, not on the CPU slots share out.
//! 7. A response whose write waits for its client to read (the socket's send buffer is
//!    full) gives the slot back once its handler is done: a client that pipelines requests
//!    and never reads the answers would otherwise hold it for as long as it likes, as a
//!    slow body would (rule 5).
//!
//! How an idle connection waits: it leaves a callback ([`OnReadable`](super::io)) with its socket
//! instead of its task's waker. When its client's next request arrives the callback takes a
//! free slot, or lets a probe through, or puts the connection in the gate's queue, and only
//! then wakes the task, once, to read. Under overload nearly every request waits at the
//! gate; waking its task just to queue it would touch the connection's state (task, hyper's
//! buffers) twice per request, and at a thousand connections that state is cold. No timer
//! per wait either: the gate's ticker lets the expired ones through. Measured
//! (docs/benchmarks-history.md, "Overload"): about 6% less server CPU per request at 1,500
//! connections than waking the task to wait on a semaphore with a timeout.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::ReadBuf;
use tokio::net::TcpStream;

use super::slots::{Gate, Slot, Waiting};
use crate::http::config::HEADER_READ_TIMEOUT;

/// Request lines that never wait at the gate (rule 3), as their first bytes on the wire.
const UNGATED: [&[u8]; 3] = [b"GET /healthz", b"GET /readyz", b"GET /metrics"];
/// Bytes peeked to recognise them: the longest prefix above.
const PEEK_BYTES: usize = 12;
/// What a request let through at the end of its gate wait needs before hyper's head-read
/// timer fires: a late tick of the gate, its task's wake-up, the head's parse (rule 2).
const HEAD_TIMER_MARGIN: Duration = Duration::from_secs(1);

/// A connection's side of the gate, shared by its socket wrapper, its readiness callback,
/// the handler of its current request and (weakly) the gate's queue.
pub struct ConnSlot {
    pub(super) gate: Arc<Gate>,
    /// The socket, for the readiness callback to peek at; gone once the connection is.
    stream: Weak<TcpStream>,
    pub(super) state: Mutex<State>,
}

#[derive(Default)]
pub(super) struct State {
    slot: Option<Slot>,
    /// The current request may be read without a slot (rules 2 and 3).
    pass: bool,
    /// In the gate's queue, to be handed a slot or let through.
    pub(super) queued: bool,
    /// A request's handler is running: reads are for its body or hyper's check that the
    /// client is still there, and take no slot of their own.
    serving: bool,
    /// An event stream's body is being sent (rule 6): reads take no slot.
    streaming: bool,
    /// The socket wrapper is gone: nothing is handed to this connection any more.
    closed: bool,
    /// When the connection began waiting for its next request, and hyper's head-read timer
    /// with it (rule 2); `None` while a request is being served.
    idle_since: Option<Instant>,
    /// The connection task's waker, woken when it may read.
    waker: Option<Waker>,
}

impl State {
    pub(super) fn may_read(&self) -> bool {
        self.serving || self.streaming || self.slot.is_some() || self.pass
    }

    /// Whether a request read now could wait `wait` (and a tick of the gate, which lets
    /// waits that ran out through) before hyper's head-read timer, running since the
    /// connection went idle, closes the connection (rule 2).
    fn may_wait(&self, wait: Duration) -> bool {
        self.idle_since
            .is_none_or(|idle| idle.elapsed() + wait + HEAD_TIMER_MARGIN < HEADER_READ_TIMEOUT)
    }

    pub(super) fn keep_waker(&mut self, waker: &Waker) {
        if !self.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            self.waker = Some(waker.clone());
        }
    }
}

/// What rule 1 decided for a readable socket.
pub(super) enum Decision {
    /// A slot or a pass: read.
    Read,
    /// Queued at the gate.
    Wait,
    /// Nothing to read after all (a stale readiness): wait for the socket again.
    Stale,
}

/// What the first bytes waiting in a socket are.
pub(super) enum Peeked {
    /// An API request's: it waits for a slot.
    Request,
    /// A probe's or a scrape's, or the end of the connection: let through (rule 3).
    Ungated,
    /// None yet.
    Nothing,
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
        self.conn.take().await;
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let mut s = self.conn.state.lock();
        s.serving = false;
        s.pass = false;
        // hyper starts its head-read timer once the answer is written: no earlier than now.
        s.idle_since = Some(Instant::now());
    }
}

/// An event stream being sent on a connection (rule 6); on drop (with the stream's body)
/// the connection's reads go back to the gate.
pub struct Streaming {
    conn: Arc<ConnSlot>,
}

impl Streaming {
    /// Whether the stream's client has gone (its end of input or an error on the socket),
    /// registering `cx` to be woken when that may have changed. hyper reads nothing while
    /// a response is being sent (it serves half-closed clients, RFC 9112 9.6), so a stream
    /// looks for its client's hang-up itself. Bytes the client sent meanwhile are left for
    /// hyper, and the stream then learns of a hang-up only when a write fails.
    pub fn poll_client_gone(&self, cx: &mut Context<'_>) -> bool {
        self.conn.poll_client_gone(cx).is_ready()
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        let mut s = self.conn.state.lock();
        s.streaming = false;
        s.idle_since = Some(Instant::now());
    }
}

impl ConnSlot {
    /// A connection's side of the gate with no socket: the queue's tests take slots through
    /// [`ConnSlot::take`] only.
    #[cfg(test)]
    pub(super) fn new(gate: Arc<Gate>) -> Arc<Self> {
        Self::with_stream(gate, Weak::new())
    }

    pub(super) fn with_stream(gate: Arc<Gate>, stream: Weak<TcpStream>) -> Arc<Self> {
        Arc::new(ConnSlot {
            gate,
            stream,
            state: Mutex::new(State {
                idle_since: Some(Instant::now()),
                ..State::default()
            }),
        })
    }

    #[cfg(test)]
    pub(super) fn holds(&self) -> bool {
        self.state.lock().slot.is_some()
    }

    /// Rule 1 for a readable socket, under the connection's lock: a free slot, else a pass
    /// for a probe or a closed connection, else the queue.
    pub(super) fn decide(
        self: &Arc<Self>,
        s: &mut State,
        peek: impl FnOnce() -> Peeked,
    ) -> Decision {
        debug_assert!(!s.may_read() && !s.queued && !s.closed);
        if let Some(slot) = self.gate.try_take() {
            s.slot = Some(slot);
            return Decision::Read;
        }
        match peek() {
            Peeked::Nothing => Decision::Stale,
            Peeked::Ungated => {
                s.pass = true;
                Decision::Read
            }
            Peeked::Request => self.wait(s),
        }
    }

    /// A slot if one is free, or else the back of the gate's queue (rule 2 bounds the wait).
    fn wait(self: &Arc<Self>, s: &mut State) -> Decision {
        if self.gate.max_wait.is_zero() || !s.may_wait(self.gate.max_wait) {
            self.wait_ran_out(s);
            return Decision::Read;
        }
        match self
            .gate
            .take_or_wait(Arc::downgrade(self) as Weak<dyn Waiting>)
        {
            Some(slot) => {
                s.slot = Some(slot);
                Decision::Read
            }
            None => {
                s.queued = true;
                Decision::Wait
            }
        }
    }

    /// Holds a slot, or goes on without one once its wait ran out (rules 2 and 4). The
    /// connection stays queued if this future is dropped: it takes the slot when handed one
    /// and gives it back at its next empty read.
    pub(super) async fn take(self: &Arc<Self>) {
        poll_fn(|cx| {
            let mut s = self.state.lock();
            if s.slot.is_some() || s.pass {
                return Poll::Ready(());
            }
            s.keep_waker(cx.waker());
            if s.queued {
                return Poll::Pending;
            }
            match self.wait(&mut s) {
                Decision::Read => Poll::Ready(()),
                Decision::Wait | Decision::Stale => Poll::Pending,
            }
        })
        .await
    }

    /// Ready once the client has closed its end with nothing unread before the close, or
    /// the socket failed, registering `cx` to be woken when that may have changed. Pending
    /// (and not woken by the socket again) while bytes wait: those are hyper's to read.
    fn poll_client_gone(&self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(stream) = self.stream.upgrade() else {
            return Poll::Ready(());
        };
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        match stream.poll_peek(cx, &mut buf) {
            Poll::Ready(Ok(0) | Err(_)) => Poll::Ready(()),
            Poll::Pending | Poll::Ready(Ok(_)) => Poll::Pending,
        }
    }

    /// Resolves when this connection's client has gone (see [`ConnSlot::poll_client_gone`]):
    /// for a request still waiting for admission, whose client cannot be answered any more.
    /// hyper does not notice mid-request (it serves half-closed clients), so a wait that
    /// nothing has been done for yet watches for it here. A client that half-closed after
    /// its request looks the same, and is not answered if its request has to wait.
    pub async fn client_gone(&self) {
        poll_fn(|cx| self.poll_client_gone(cx)).await
    }

    /// Rule 2's outcome, counted: the request is read without a slot.
    fn wait_ran_out(&self, s: &mut State) {
        self.gate.metrics.http_gate_waits_expired.inc();
        s.pass = true;
    }

    /// Wakes the connection's task, after the lock is released.
    fn wake(mut s: parking_lot::MutexGuard<'_, State>) {
        let waker = s.waker.take();
        drop(s);
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// The socket became readable while the connection was idle (see `OnReadable` in [`super::io`]).
    pub(super) fn on_readable(self: &Arc<Self>) {
        let mut s = self.state.lock();
        if s.closed || s.queued {
            return;
        }
        if !s.may_read() {
            let decision = self.decide(&mut s, || match self.stream.upgrade() {
                // The task re-registers readiness on its next poll if this finds nothing.
                Some(stream) => peek(&stream, &mut Context::from_waker(Waker::noop())),
                None => Peeked::Ungated,
            });
            if let Decision::Wait = decision {
                return;
            }
        }
        Self::wake(s);
    }

    /// Rule 1: a read found nothing; unless a request is being served (false), the
    /// connection is idle again and its slot or pass goes back.
    pub(super) fn go_idle(&self) -> bool {
        let mut s = self.state.lock();
        if s.serving || s.streaming {
            return false;
        }
        let slot = s.slot.take();
        s.pass = false;
        drop(s);
        drop(slot);
        true
    }

    /// The connection is gone: gives back its slot and leaves the queue.
    pub(super) fn close(self: &Arc<Self>) {
        let mut s = self.state.lock();
        s.closed = true;
        s.waker = None;
        let slot = s.slot.take();
        let queued = std::mem::take(&mut s.queued);
        drop(s);
        drop(slot);
        if queued {
            self.gate.forget(self);
        }
    }

    /// Rule 4, first half: marks a request served. Called when hyper hands the request over,
    /// before its future is first polled: hyper's check that the client is still there
    /// comes in between, and must not give the slot back.
    pub fn serve(self: &Arc<Self>) -> Serving {
        let mut s = self.state.lock();
        s.serving = true;
        s.idle_since = None;
        drop(s);
        Serving { conn: self.clone() }
    }

    /// Rule 7: a write found the socket full. Unless a handler is still running, the slot
    /// goes back: waiting for a client to read takes no CPU the gate shares out. The next
    /// request takes one again (rules 1 and 4).
    pub(super) fn write_blocked(&self) {
        let mut s = self.state.lock();
        if s.serving {
            return;
        }
        let slot = s.slot.take();
        drop(s);
        drop(slot);
    }

    /// Rule 6: an event stream starts on this connection. Its slot goes back now, and its
    /// reads take none until the returned guard (kept by the stream's body) is dropped.
    pub fn stream_started(self: &Arc<Self>) -> Streaming {
        let mut s = self.state.lock();
        s.streaming = true;
        let slot = s.slot.take();
        drop(s);
        drop(slot);
        Streaming { conn: self.clone() }
    }

    /// Rule 5: runs `body` (a read of the request's body), giving the slot back while it
    /// waits on the client and taking one again after.
    pub async fn while_client_sends<F: Future>(self: &Arc<Self>, body: F) -> F::Output {
        let mut body = pin!(body);
        if let Poll::Ready(done) = poll_fn(|cx| Poll::Ready(body.as_mut().poll(cx))).await {
            return done;
        }
        let slot = self.state.lock().slot.take();
        let had = slot.is_some();
        drop(slot);
        let done = body.await;
        if had {
            self.take().await;
        }
        done
    }
}

/// Rule 3: whether the bytes waiting in `stream` start a probe or a scrape (peeked, not
/// read). A connection its client closed (or broke) has nothing to wait for either:
/// reading tells hyper to close it now. `Nothing` when the readiness was stale.
pub(super) fn peek(stream: &TcpStream, cx: &mut Context<'_>) -> Peeked {
    let mut bytes = [0u8; PEEK_BYTES];
    let mut buf = ReadBuf::new(&mut bytes);
    match stream.poll_peek(cx, &mut buf) {
        Poll::Pending => Peeked::Nothing,
        Poll::Ready(Ok(0) | Err(_)) => Peeked::Ungated,
        Poll::Ready(Ok(_)) if UNGATED.iter().any(|l| buf.filled().starts_with(l)) => {
            Peeked::Ungated
        }
        Poll::Ready(Ok(_)) => Peeked::Request,
    }
}

impl Waiting for ConnSlot {
    /// The gate hands this queued connection a slot.
    fn hand(&self, slot: Slot) {
        let mut s = self.state.lock();
        if s.closed || !s.queued {
            drop(s);
            // Released again, to the next in line.
            drop(slot);
            return;
        }
        debug_assert!(s.slot.is_none(), "a queued connection holds no slot");
        s.queued = false;
        s.slot = Some(slot);
        Self::wake(s);
    }

    /// Rule 2: this queued connection waited its full time; it reads without a slot.
    fn let_through(&self) {
        let mut s = self.state.lock();
        if s.closed || !s.queued {
            return;
        }
        s.queued = false;
        self.wait_ran_out(&mut s);
        Self::wake(s);
    }
}
