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

/// A connection's state: its phase, and the waker of its task.
pub(super) struct State {
    phase: Phase,
    /// The connection task's waker, woken when it may read.
    waker: Option<Waker>,
}

/// What a connection is doing, with what each phase holds.
enum Phase {
    /// Waiting for its next request since `since`, and hyper's head-read timer with it
    /// (rule 2). Its next read goes on with `access`.
    Idle { since: Instant, access: Access },
    /// A request's handler is running: reads are for its body or hyper's check that the
    /// client is still there, and take no slot of their own. `access` is what the handler
    /// holds (rule 4).
    Serving { access: Access },
    /// A handler is running that started an event stream: its slot went back (rule 6), and
    /// the stream's body outlives the handler.
    ServingStream,
    /// An event stream's body is being sent (rule 6): reads take no slot.
    Streaming,
    /// The socket wrapper is gone: nothing is handed to this connection any more.
    Closed,
}

/// What a connection's reads go on with, from the gate.
pub(super) enum Access {
    /// Nothing yet: an idle connection's next read waits at the gate (rule 1).
    Nothing,
    /// A slot of the gate, held until this is dropped or replaced.
    Slot(#[expect(dead_code, reason = "held for its drop, which gives the slot back")] Slot),
    /// The current request may be read without a slot (rules 2 and 3).
    Pass,
    /// In the gate's queue, to be handed a slot or let through.
    Queued,
}

impl State {
    /// What the connection's reads go on with, in the phases that hold it.
    fn access(&self) -> Option<&Access> {
        match &self.phase {
            Phase::Idle { access, .. } | Phase::Serving { access } => Some(access),
            Phase::ServingStream | Phase::Streaming | Phase::Closed => None,
        }
    }

    fn access_mut(&mut self) -> Option<&mut Access> {
        match &mut self.phase {
            Phase::Idle { access, .. } | Phase::Serving { access } => Some(access),
            Phase::ServingStream | Phase::Streaming | Phase::Closed => None,
        }
    }

    pub(super) fn may_read(&self) -> bool {
        match &self.phase {
            Phase::Idle { access, .. } => matches!(access, Access::Slot(_) | Access::Pass),
            Phase::Serving { .. } | Phase::ServingStream | Phase::Streaming => true,
            Phase::Closed => false,
        }
    }

    pub(super) fn is_queued(&self) -> bool {
        matches!(self.access(), Some(Access::Queued))
    }

    /// An idle connection with nothing to read with: what rule 1 decides for. `None` when
    /// it may read, is queued, or is closed.
    pub(super) fn undecided(&mut self) -> Option<(Instant, &mut Access)> {
        match &mut self.phase {
            Phase::Idle {
                since,
                access: access @ Access::Nothing,
            } => Some((*since, access)),
            _ => None,
        }
    }

    pub(super) fn keep_waker(&mut self, waker: &Waker) {
        keep_waker(&mut self.waker, waker);
    }
}

fn keep_waker(kept: &mut Option<Waker>, waker: &Waker) {
    if !kept.as_ref().is_some_and(|w| w.will_wake(waker)) {
        *kept = Some(waker.clone());
    }
}

/// Whether a request read now could wait `wait` (and a tick of the gate, which lets waits
/// that ran out through) before hyper's head-read timer, running since the connection went
/// idle (`idle_since`; `None` while a request is being served), closes the connection
/// (rule 2).
fn may_wait(idle_since: Option<Instant>, wait: Duration) -> bool {
    idle_since.is_none_or(|idle| idle.elapsed() + wait + HEAD_TIMER_MARGIN < HEADER_READ_TIMEOUT)
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
        s.phase = match std::mem::replace(&mut s.phase, Phase::Closed) {
            // hyper starts its head-read timer once the answer is written: no earlier than
            // now. A slot is kept (see above); a pass was for this request only.
            Phase::Serving { access } => Phase::Idle {
                since: Instant::now(),
                access: match access {
                    Access::Pass => Access::Nothing,
                    other => other,
                },
            },
            Phase::ServingStream => Phase::Streaming,
            other => other,
        };
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
        s.phase = match std::mem::replace(&mut s.phase, Phase::Closed) {
            Phase::Streaming => Phase::Idle {
                since: Instant::now(),
                access: Access::Nothing,
            },
            Phase::ServingStream => Phase::Serving {
                access: Access::Nothing,
            },
            other => other,
        };
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
                phase: Phase::Idle {
                    since: Instant::now(),
                    access: Access::Nothing,
                },
                waker: None,
            }),
        })
    }

    #[cfg(test)]
    pub(super) fn holds(&self) -> bool {
        matches!(self.state.lock().access(), Some(Access::Slot(_)))
    }

    /// Rule 1 for a readable socket, under the connection's lock, for an idle connection
    /// with nothing to read with ([`State::undecided`]): a free slot, else a pass for a
    /// probe or a closed connection, else the queue.
    pub(super) fn decide(
        self: &Arc<Self>,
        idle_since: Instant,
        access: &mut Access,
        peek: impl FnOnce() -> Peeked,
    ) -> Decision {
        if let Some(slot) = self.gate.try_take() {
            *access = Access::Slot(slot);
            return Decision::Read;
        }
        match peek() {
            Peeked::Nothing => Decision::Stale,
            Peeked::Ungated => {
                *access = Access::Pass;
                Decision::Read
            }
            Peeked::Request => self.wait(Some(idle_since), access),
        }
    }

    /// A slot if one is free, or else the back of the gate's queue (rule 2 bounds the wait).
    fn wait(self: &Arc<Self>, idle_since: Option<Instant>, access: &mut Access) -> Decision {
        if self.gate.max_wait.is_zero() || !may_wait(idle_since, self.gate.max_wait) {
            self.wait_ran_out(access);
            return Decision::Read;
        }
        match self
            .gate
            .take_or_wait(Arc::downgrade(self) as Weak<dyn Waiting>)
        {
            Some(slot) => {
                *access = Access::Slot(slot);
                Decision::Read
            }
            None => {
                *access = Access::Queued;
                Decision::Wait
            }
        }
    }

    /// Holds a slot, or goes on without one once its wait ran out (rules 2 and 4). The
    /// connection stays queued if this future is dropped: it takes the slot when handed one
    /// and gives it back at its next empty read. A stream's reads need none (rule 6), and a
    /// closed connection is handed none.
    pub(super) async fn take(self: &Arc<Self>) {
        poll_fn(|cx| {
            let mut s = self.state.lock();
            let State { phase, waker } = &mut *s;
            let (idle_since, access) = match phase {
                Phase::Idle { since, access } => (Some(*since), access),
                Phase::Serving { access } => (None, access),
                Phase::ServingStream | Phase::Streaming | Phase::Closed => {
                    return Poll::Ready(());
                }
            };
            if matches!(access, Access::Slot(_) | Access::Pass) {
                return Poll::Ready(());
            }
            keep_waker(waker, cx.waker());
            if matches!(access, Access::Queued) {
                return Poll::Pending;
            }
            match self.wait(idle_since, access) {
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
    fn wait_ran_out(&self, access: &mut Access) {
        self.gate.metrics.http_gate_waits_expired.inc();
        *access = Access::Pass;
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
        if matches!(s.phase, Phase::Closed) || s.is_queued() {
            return;
        }
        if let Some((idle_since, access)) = s.undecided() {
            let decision = self.decide(idle_since, access, || match self.stream.upgrade() {
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
        let released = match &mut s.phase {
            Phase::Idle { access, .. } => match access {
                Access::Slot(_) | Access::Pass => std::mem::replace(access, Access::Nothing),
                Access::Nothing | Access::Queued => Access::Nothing,
            },
            Phase::Closed => Access::Nothing,
            Phase::Serving { .. } | Phase::ServingStream | Phase::Streaming => return false,
        };
        drop(s);
        drop(released);
        true
    }

    /// The connection is gone: gives back its slot and leaves the queue.
    pub(super) fn close(self: &Arc<Self>) {
        let mut s = self.state.lock();
        let was = std::mem::replace(&mut s.phase, Phase::Closed);
        s.waker = None;
        drop(s);
        let queued = matches!(
            was,
            Phase::Idle {
                access: Access::Queued,
                ..
            } | Phase::Serving {
                access: Access::Queued
            }
        );
        // Gives back a slot it held.
        drop(was);
        if queued {
            self.gate.forget(self);
        }
    }

    /// Rule 4, first half: marks a request served. Called when hyper hands the request over,
    /// before its future is first polled: hyper's check that the client is still there
    /// comes in between, and must not give the slot back.
    pub fn serve(self: &Arc<Self>) -> Serving {
        let mut s = self.state.lock();
        s.phase = match std::mem::replace(&mut s.phase, Phase::Closed) {
            Phase::Idle { access, .. } => Phase::Serving { access },
            Phase::Streaming => Phase::ServingStream,
            other => other,
        };
        drop(s);
        Serving { conn: self.clone() }
    }

    /// Rule 7: a write found the socket full. Unless a handler is still running, the slot
    /// goes back: waiting for a client to read takes no CPU the gate shares out. The next
    /// request takes one again (rules 1 and 4).
    pub(super) fn write_blocked(&self) {
        let mut s = self.state.lock();
        let released = match &mut s.phase {
            Phase::Idle {
                access: access @ Access::Slot(_),
                ..
            } => std::mem::replace(access, Access::Nothing),
            _ => return,
        };
        drop(s);
        drop(released);
    }

    /// Rule 6: an event stream starts on this connection. Its slot goes back now, and its
    /// reads take none until the returned guard (kept by the stream's body) is dropped.
    pub fn stream_started(self: &Arc<Self>) -> Streaming {
        let mut s = self.state.lock();
        let (phase, released) = match std::mem::replace(&mut s.phase, Phase::Closed) {
            Phase::Serving { access } => (Phase::ServingStream, Some(access)),
            Phase::Idle { access, .. } => (Phase::Streaming, Some(access)),
            other => (other, None),
        };
        s.phase = phase;
        drop(s);
        drop(released);
        Streaming { conn: self.clone() }
    }

    /// Rule 5: runs `body` (a read of the request's body), giving the slot back while it
    /// waits on the client and taking one again after.
    pub async fn while_client_sends<F: Future>(self: &Arc<Self>, body: F) -> F::Output {
        let mut body = pin!(body);
        if let Poll::Ready(done) = poll_fn(|cx| Poll::Ready(body.as_mut().poll(cx))).await {
            return done;
        }
        let released = match self.state.lock().access_mut() {
            Some(access @ Access::Slot(_)) => Some(std::mem::replace(access, Access::Nothing)),
            _ => None,
        };
        let had = released.is_some();
        drop(released);
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
        if let Some(access @ Access::Queued) = s.access_mut() {
            *access = Access::Slot(slot);
            Self::wake(s);
            return;
        }
        drop(s);
        // Closed, or no longer queued: released again, to the next in line.
        drop(slot);
    }

    /// Rule 2: this queued connection waited its full time; it reads without a slot.
    fn let_through(&self) {
        let mut s = self.state.lock();
        let Some(access @ Access::Queued) = s.access_mut() else {
            return;
        };
        self.wait_ran_out(access);
        Self::wake(s);
    }
}
