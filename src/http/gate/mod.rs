//! The gate: how many requests a replica works on at once, enforced *before a request is
//! read*, with a limit that adapts to how busy the CPU is ([`limit`]).
//!
//! A connection takes a slot when its next request's bytes arrive and before it reads
//! them; the request keeps the slot until it is answered. Past the limit, a connection
//! waits (first come, first served) with its request still in the kernel's socket buffer:
//! no task polled, no buffer filled, no head parsed. That is socket-level backpressure, the
//! way Netty's `autoRead` off or an HTTP/2 server's stream limit push back.
//!
//! Why before reading: under overload a server that parses every request it can and queues
//! the rest behind an in-flight limit keeps every waiting request's state alive, and each
//! is touched cold when its turn comes. Measured on the embedded store with the server on
//! one core and 1,500 connections re-sending at once (wrk): the in-flight limit after
//! parsing kept 0.57-0.63 of the server's peak goodput; gated before reading, 16 at a time,
//! 0.75-0.78. Whatever the limit after parsing (64 or 2,048), it stayed under 0.7.
//!
//! The edge's in-flight limit with its queue wait and 503 (`admission`) stays behind the
//! gate as the hard cap, for requests that reach a handler without passing the gate.

mod conn;
pub mod limit;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

pub use conn::{ConnSlot, GatedIo};
use limit::{CpuLimit, Tick};

use super::InFlightGauge;
use crate::metrics::Metrics;

/// Slots shared by every connection of one listener.
pub struct Gate {
    slots: Arc<Semaphore>,
    /// Slots to retire as they come back: the limit shrank while they were taken.
    owed: AtomicUsize,
    limit: Mutex<CpuLimit>,
    /// A connection waited for a slot since the last tick.
    saturated: AtomicBool,
    metrics: Arc<Metrics>,
}

/// One taken slot; given back (or retired, if the limit shrank) when dropped.
pub struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    gate: Arc<Gate>,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, gate: Arc<Gate>) -> Self {
        gate.metrics.http_gate_active.inc();
        gate.metrics.http_gate_taken.inc();
        Slot {
            permit: Some(permit),
            gate,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.metrics.http_gate_active.dec();
        let retire = self
            .gate
            .owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| o.checked_sub(1))
            .is_ok();
        if let Some(permit) = self.permit.take()
            && retire
        {
            permit.forget();
        }
    }
}

impl Gate {
    /// A gate adapting within `[min, max]`, starting at `min`.
    pub fn new(min: usize, max: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        metrics.http_gate_limit.set(min as i64);
        Arc::new(Gate {
            slots: Arc::new(Semaphore::new(min)),
            owed: AtomicUsize::new(0),
            limit: Mutex::new(CpuLimit::new(min, max)),
            saturated: AtomicBool::new(false),
            metrics,
        })
    }

    /// A slot if one is free now.
    fn try_take(self: &Arc<Self>) -> Option<Slot> {
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        Some(Slot::new(permit, self.clone()))
    }

    /// A slot, waiting in arrival order while all are taken.
    pub async fn take(self: Arc<Self>) -> Slot {
        if let Some(slot) = self.try_take() {
            return slot;
        }
        self.saturated.store(true, Ordering::Relaxed);
        let permit = {
            let _waiting = InFlightGauge::enter(&self.metrics.http_gate_waiting);
            self.slots.clone().acquire_owned().await
        }
        .expect("the gate's semaphore is never closed");
        Slot::new(permit, self)
    }

    /// Reconsiders the limit after one tick of `busy` (the workers' busy fraction).
    pub fn tick(&self, busy: f64) {
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
            self.resize(before, after);
        }
    }

    /// Ticks every [`limit::TICK`] with the busy fraction of the current runtime's workers,
    /// until the returned handle is dropped.
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

    /// Moves the number of slots from `before` to `after`: new ones first pay off slots
    /// still owed; a shrink retires free slots now and owes the rest.
    fn resize(&self, before: usize, after: usize) {
        if after > before {
            let mut grow = after - before;
            while grow > 0 {
                let owed = self.owed.load(Ordering::Acquire);
                if owed == 0 {
                    break;
                }
                let pay = owed.min(grow);
                if self
                    .owed
                    .compare_exchange(owed, owed - pay, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    grow -= pay;
                }
            }
            self.slots.add_permits(grow);
        } else {
            for _ in after..before {
                match self.slots.try_acquire() {
                    Ok(permit) => permit.forget(),
                    Err(_) => {
                        self.owed.fetch_add(1, Ordering::AcqRel);
                    }
                }
            }
        }
        self.metrics.http_gate_limit.set(after as i64);
    }

    /// Slots that can be taken now, net of those owed (for tests and assertions).
    #[cfg(test)]
    fn free(&self) -> isize {
        self.slots.available_permits() as isize - self.owed.load(Ordering::Acquire) as isize
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
    use super::*;

    fn gate(min: usize, max: usize) -> Arc<Gate> {
        Gate::new(min, max, Arc::new(Metrics::new()))
    }

    #[test]
    fn a_shrink_retires_slots_as_they_come_back() {
        let g = gate(2, 8);
        g.resize(2, 4);
        assert_eq!(g.free(), 4);
        let taken: Vec<_> = (0..4).map(|_| g.try_take().expect("a free slot")).collect();
        g.resize(4, 2);
        assert_eq!(g.free(), -2, "two slots are owed");
        drop(taken);
        assert_eq!(g.free(), 2, "two came back, two were retired");
        assert_eq!(g.metrics.http_gate_limit.get(), 2);
    }

    #[test]
    fn a_grow_pays_off_owed_slots_first() {
        let g = gate(1, 8);
        g.resize(1, 3);
        let taken: Vec<_> = (0..3).map(|_| g.try_take().expect("a free slot")).collect();
        g.resize(3, 1);
        g.resize(1, 2);
        drop(taken);
        assert_eq!(g.free(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_take_is_counted_and_marks_the_tick_saturated() {
        let g = gate(1, 8);
        let first = g.clone().take().await;
        let second = tokio::spawn(g.clone().take());
        while g.metrics.http_gate_waiting.get() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(g.saturated.load(Ordering::Relaxed));
        drop(first);
        let _second = second.await.expect("the waiter gets the slot");
        assert_eq!(g.metrics.http_gate_waiting.get(), 0);
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

    #[test]
    fn few_connections_open_the_gate_to_its_ceiling() {
        let g = gate(16, 256);
        g.metrics.http_connections.set(64);
        g.tick(1.0);
        assert_eq!(g.metrics.http_gate_limit.get(), 256);
        assert_eq!(g.free(), 256);
    }
}
