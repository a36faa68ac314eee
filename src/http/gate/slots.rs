//! The gate's slots: how many are taken, the queue of connections waiting for one, and the
//! ticker that resizes them to the CPU ([`super::limit`]) and lets waits that ran out through.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::limit::{self, CpuLimit, Tick};

use crate::metrics::Metrics;

/// What waits in the gate's queue: a connection ([`super::ConnSlot`]), handed a slot when one
/// comes free or let through without one when its wait ran out. The gate knows it by this
/// alone, so the queue does not depend on how a connection reads.
pub trait Waiting: Send + Sync {
    /// The gate hands this queued waiter a slot.
    fn hand(&self, slot: Slot);
    /// Rule 2 of [`super::conn`]: the waiter waited its full time; it goes on without a slot.
    fn let_through(&self);
}

/// Slots shared by every connection of one listener.
pub struct Gate {
    slots: Mutex<Slots>,
    limit: Mutex<CpuLimit>,
    /// A connection waited for a slot since the last tick.
    saturated: AtomicBool,
    /// The longest a connection waits for a slot (rule 2 of [`super::conn`]); checked each tick.
    pub(super) max_wait: Duration,
    pub(super) metrics: Arc<Metrics>,
}

/// The slots' books, under one lock.
struct Slots {
    limit: usize,
    /// Slots held now; above `limit` for a while after the limit shrinks.
    taken: usize,
    /// Connections waiting for a slot, oldest first. A connection is here at most once
    /// (queued is one of its states), so the queue is bounded by the open connections.
    waiting: VecDeque<Waiter>,
}

struct Waiter {
    conn: Weak<dyn Waiting>,
    since: Instant,
}

/// One taken slot. Dropped, it goes straight to the oldest waiting connection, or back to
/// the gate (retired instead, if the limit shrank while it was taken).
pub struct Slot {
    gate: Arc<Gate>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.release();
    }
}

impl Gate {
    /// A gate adapting within `[min, max]`, starting at `min`; a connection waits for a
    /// slot at most `max_wait`.
    pub fn new(min: usize, max: usize, max_wait: Duration, metrics: Arc<Metrics>) -> Arc<Self> {
        metrics.http_gate_limit.set(min as i64);
        Arc::new(Gate {
            slots: Mutex::new(Slots {
                limit: min,
                taken: 0,
                waiting: VecDeque::new(),
            }),
            limit: Mutex::new(CpuLimit::new(min, max)),
            saturated: AtomicBool::new(false),
            max_wait,
            metrics,
        })
    }

    /// A slot the caller counted in `taken` already.
    fn counted_slot(self: &Arc<Self>) -> Slot {
        self.metrics.http_gate_taken.inc();
        Slot { gate: self.clone() }
    }

    /// A slot if one is free now.
    pub(super) fn try_take(self: &Arc<Self>) -> Option<Slot> {
        let mut s = self.slots.lock();
        if s.taken >= s.limit {
            return None;
        }
        s.taken += 1;
        self.metrics.http_gate_active.set(s.taken as i64);
        drop(s);
        Some(self.counted_slot())
    }

    /// A slot if one is free now, or else `conn` joins the back of the queue, to be handed
    /// one by [`Gate::release`]. The caller holds `conn`'s lock and marks it queued.
    pub(super) fn take_or_wait(self: &Arc<Self>, conn: Weak<dyn Waiting>) -> Option<Slot> {
        let mut s = self.slots.lock();
        if s.taken < s.limit {
            s.taken += 1;
            self.metrics.http_gate_active.set(s.taken as i64);
            drop(s);
            return Some(self.counted_slot());
        }
        s.waiting.push_back(Waiter {
            conn,
            since: Instant::now(),
        });
        self.metrics.http_gate_waiting.set(s.waiting.len() as i64);
        self.saturated.store(true, Ordering::Relaxed);
        None
    }

    /// A released slot: handed to the oldest waiting connection (it stays taken), or
    /// returned.
    fn release(self: &Arc<Self>) {
        let mut s = self.slots.lock();
        while s.taken <= s.limit {
            let Some(next) = s.waiting.pop_front() else {
                break;
            };
            self.metrics.http_gate_waiting.set(s.waiting.len() as i64);
            // A connection that closed while queued left the queue (`ConnSlot::close`); one
            // that closes after this pop is handed the slot and drops it, releasing it again.
            if let Some(conn) = next.conn.upgrade() {
                drop(s);
                conn.hand(self.counted_slot());
                return;
            }
        }
        assert!(s.taken > 0, "a slot was released that was never taken");
        s.taken -= 1;
        self.metrics.http_gate_active.set(s.taken as i64);
    }

    /// Takes `conn` out of the queue (it closed while waiting).
    pub(super) fn forget<W: Waiting>(&self, conn: &Arc<W>) {
        let mut s = self.slots.lock();
        s.waiting
            .retain(|w| !std::ptr::addr_eq(w.conn.as_ptr(), Arc::as_ptr(conn)));
        self.metrics.http_gate_waiting.set(s.waiting.len() as i64);
    }

    /// Rule 2: lets through every connection that has waited `max_wait` by `now`.
    fn expire(&self, now: Instant) {
        let mut expired = Vec::new();
        let mut s = self.slots.lock();
        while s
            .waiting
            .front()
            .is_some_and(|w| now.duration_since(w.since) >= self.max_wait)
        {
            expired.extend(s.waiting.pop_front().and_then(|w| w.conn.upgrade()));
        }
        self.metrics.http_gate_waiting.set(s.waiting.len() as i64);
        drop(s);
        for conn in expired {
            conn.let_through();
        }
    }

    /// Reconsiders the limit after one tick of `busy` (the workers' busy fraction).
    pub fn tick(self: &Arc<Self>, busy: f64) {
        let connections = usize::try_from(self.metrics.http_connections.get()).unwrap_or(0);
        let mut limit = self.limit.lock();
        let before = limit.limit();
        let after = limit.on_tick(Tick {
            busy,
            saturated: self.saturated.swap(false, Ordering::Relaxed),
            connections,
        });
        drop(limit);
        if after != before {
            self.resize(after);
        }
    }

    /// Ticks every [`limit::TICK`] with the busy fraction of the current runtime's workers,
    /// and lets through the connections whose wait ran out, until the returned handle is
    /// dropped.
    pub fn start_ticking(self: &Arc<Self>) -> Ticking {
        let gate = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            let metrics = tokio::runtime::Handle::current().metrics();
            let workers = metrics.num_workers().max(1);
            let busy_total = || {
                (0..workers)
                    .map(|w| metrics.worker_total_busy_duration(w))
                    .sum::<Duration>()
            };
            let mut ticks = tokio::time::interval(limit::TICK);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let (mut at, mut busy) = (Instant::now(), busy_total());
            loop {
                ticks.tick().await;
                let Some(gate) = gate.upgrade() else { return };
                let (now, busy_now) = (Instant::now(), busy_total());
                gate.expire(now);
                let wall = now.duration_since(at).as_secs_f64() * workers as f64;
                if wall > 0.0 {
                    let fraction = busy_now.saturating_sub(busy).as_secs_f64() / wall;
                    gate.tick(fraction.min(1.0));
                }
                (at, busy) = (now, busy_now);
            }
        });
        Ticking(task)
    }

    /// Sets the number of slots: a grow hands the new slots to waiting connections at
    /// once; a shrink retires slots as they come back.
    fn resize(self: &Arc<Self>, after: usize) {
        let mut handed = Vec::new();
        let mut s = self.slots.lock();
        s.limit = after;
        while s.taken < s.limit {
            let Some(next) = s.waiting.pop_front() else {
                break;
            };
            if let Some(conn) = next.conn.upgrade() {
                s.taken += 1;
                handed.push(conn);
            }
        }
        self.metrics.http_gate_active.set(s.taken as i64);
        self.metrics.http_gate_waiting.set(s.waiting.len() as i64);
        drop(s);
        self.metrics.http_gate_limit.set(after as i64);
        for conn in handed {
            conn.hand(self.counted_slot());
        }
    }

    /// Slots that can be taken now: negative while more are taken than the limit allows
    /// (for tests and assertions).
    #[cfg(test)]
    fn free(&self) -> isize {
        let s = self.slots.lock();
        s.limit as isize - s.taken as isize
    }
}

/// The gate's ticker; stops when dropped.
pub struct Ticking(tokio::task::JoinHandle<()>);

impl Drop for Ticking {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Waker};

    use super::super::ConnSlot;
    use super::*;

    const WAIT: Duration = Duration::from_secs(1);

    fn gate(min: usize, max: usize) -> Arc<Gate> {
        Gate::new(min, max, WAIT, Arc::new(Metrics::new()))
    }

    /// Polls `conn`'s take once: true if it holds a slot or a pass after it.
    fn poll_take(conn: &Arc<ConnSlot>) -> bool {
        let mut take = Box::pin(conn.take());
        let mut cx = Context::from_waker(Waker::noop());
        take.as_mut().poll(&mut cx).is_ready()
    }

    /// A one-slot gate whose slot is taken, and two connections queued behind it, oldest
    /// first.
    fn one_taken_two_waiting() -> (Arc<Gate>, Slot, Arc<ConnSlot>, Arc<ConnSlot>) {
        let g = gate(1, 8);
        let first = g.try_take().expect("a free slot");
        let (a, b) = (ConnSlot::new(g.clone()), ConnSlot::new(g.clone()));
        assert!(!poll_take(&a) && !poll_take(&b), "both wait");
        (g, first, a, b)
    }

    #[test]
    fn a_shrink_retires_slots_as_they_come_back() {
        let g = gate(2, 8);
        g.resize(4);
        assert_eq!(g.free(), 4);
        let taken: Vec<_> = (0..4).map(|_| g.try_take().expect("a free slot")).collect();
        g.resize(2);
        assert_eq!(g.free(), -2, "two slots too many are taken");
        drop(taken);
        assert_eq!(g.free(), 2, "two came back, two were retired");
        assert_eq!(g.metrics.http_gate_limit.get(), 2);
        assert_eq!(g.metrics.http_gate_active.get(), 0);
    }

    #[test]
    fn a_released_slot_goes_to_the_oldest_waiting_connection() {
        let (g, first, a, b) = one_taken_two_waiting();
        assert_eq!(g.metrics.http_gate_waiting.get(), 2);
        assert!(g.saturated.load(Ordering::Relaxed));
        drop(first);
        assert!(a.holds() && !b.holds(), "first come, first served");
        assert_eq!(g.metrics.http_gate_waiting.get(), 1);
        assert_eq!(g.free(), 0, "the slot changed hands without coming free");
        assert!(poll_take(&a), "a's take is done");
    }

    #[test]
    fn a_shrink_retires_a_released_slot_before_handing_it_on() {
        let g = gate(2, 8);
        let taken: Vec<_> = (0..2).map(|_| g.try_take().expect("a free slot")).collect();
        let waiter = ConnSlot::new(g.clone());
        assert!(!poll_take(&waiter));
        g.resize(1);
        drop(taken);
        assert!(waiter.holds(), "the second slot back is within the limit");
        assert_eq!(g.free(), 0);
    }

    #[test]
    fn a_grow_hands_the_new_slots_to_waiting_connections() {
        let g = gate(1, 8);
        let _first = g.try_take().expect("a free slot");
        let waiters: Vec<_> = (0..3).map(|_| ConnSlot::new(g.clone())).collect();
        assert!(waiters.iter().all(|w| !poll_take(w)));
        g.resize(3);
        let holding = waiters.iter().filter(|w| w.holds()).count();
        assert_eq!(holding, 2);
        assert!(!waiters[2].holds(), "the newest still waits");
        assert_eq!(g.metrics.http_gate_waiting.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_waited_its_full_time_is_let_through() {
        let g = gate(1, 8);
        let _first = g.try_take().expect("a free slot");
        let (old, new) = (ConnSlot::new(g.clone()), ConnSlot::new(g.clone()));
        assert!(!poll_take(&old));
        tokio::time::advance(WAIT / 2).await;
        assert!(!poll_take(&new));
        g.expire(Instant::now() + WAIT / 2);
        assert!(poll_take(&old), "waited its full time: let through");
        assert!(!old.holds(), "without a slot");
        assert!(!poll_take(&new), "the newer one waits on");
        assert_eq!(g.metrics.http_gate_waits_expired.get(), 1);
        assert_eq!(g.metrics.http_gate_waiting.get(), 1);
    }

    #[test]
    fn a_closed_connection_leaves_the_queue() {
        let (g, first, gone, next) = one_taken_two_waiting();
        gone.close();
        assert_eq!(g.metrics.http_gate_waiting.get(), 1);
        drop(first);
        assert!(next.holds(), "the slot skips the closed connection");
    }

    #[test]
    fn a_slot_handed_to_a_connection_closing_meanwhile_goes_on_to_the_next() {
        let (g, first, gone, next) = one_taken_two_waiting();
        // The gate pops `gone` to hand it the released slot, and it closes just then.
        let popped = g.slots.lock().waiting.pop_front().expect("queued");
        std::mem::forget(first);
        gone.close();
        popped.conn.upgrade().expect("alive").hand(g.counted_slot());
        assert!(next.holds(), "the slot went on to the next in line");
        assert_eq!(g.free(), 0, "still one slot taken, by next");
    }

    #[test]
    fn a_tick_resizes_the_slots_and_the_gauge() {
        let g = gate(16, 256);
        g.metrics.http_connections.set(1_500);
        g.saturated.store(true, Ordering::Relaxed);
        g.tick(0.2);
        assert_eq!(g.metrics.http_gate_limit.get(), 18, "idle CPU, saturated");
        assert_eq!(g.free(), 18);
        assert!(
            !g.saturated.load(Ordering::Relaxed),
            "each tick starts afresh"
        );
        g.tick(1.0);
        assert_eq!(
            g.metrics.http_gate_limit.get(),
            16,
            "busy CPU: back to the floor"
        );
        assert_eq!(g.free(), 16);
    }

    #[tokio::test(start_paused = true)]
    async fn the_ticker_reads_the_runtime_and_stops_when_dropped() {
        let g = gate(1, 4);
        g.metrics.http_connections.set(1_500);
        let ticking = g.start_ticking();
        // An idle runtime and a waiter each tick: the limit climbs to its ceiling (the clock
        // is paused, so each sleep is one tick of virtual time).
        while g.metrics.http_gate_limit.get() < 4 {
            g.saturated.store(true, Ordering::Relaxed);
            tokio::time::sleep(limit::TICK).await;
        }
        drop(ticking);
        assert_eq!(g.free(), 4);
        // Stopped: a tick's worth of virtual time later nothing has moved it back.
        g.metrics.http_connections.set(0);
        tokio::time::sleep(limit::TICK * 2).await;
        assert_eq!(g.metrics.http_gate_limit.get(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn the_ticker_lets_through_a_wait_that_ran_out() {
        let g = gate(1, 1);
        let _first = g.try_take().expect("a free slot");
        let _ticking = g.start_ticking();
        let waiter = ConnSlot::new(g.clone());
        tokio::time::timeout(WAIT + limit::TICK * 2, waiter.take())
            .await
            .expect("let through within a tick of its wait");
        assert!(!waiter.holds());
        assert_eq!(g.metrics.http_gate_waits_expired.get(), 1);
    }

    #[test]
    fn few_connections_open_the_gate_to_its_ceiling() {
        let g = gate(16, 256);
        g.metrics.http_connections.set(64);
        g.tick(1.0);
        assert_eq!(g.metrics.http_gate_limit.get(), 256);
        assert_eq!(g.free(), 256);
    }

    #[test]
    fn a_zero_wait_lets_a_request_through_at_once() {
        let g = Gate::new(1, 1, Duration::ZERO, Arc::new(Metrics::new()));
        let _first = g.try_take().expect("a free slot");
        let conn = ConnSlot::new(g.clone());
        assert!(poll_take(&conn));
        assert!(!conn.holds());
        assert_eq!(g.metrics.http_gate_waits_expired.get(), 1);
    }
}
