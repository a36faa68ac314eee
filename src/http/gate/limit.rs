//! How many requests the gate lets a replica work on at once: more only while its CPU has
//! time to spare, fewer once the CPU is the bottleneck.
//!
//! Why the CPU and not latency: a request admitted past what the CPU can work on only
//! waits, and waiting costs here (every admitted request keeps its connection's task and
//! buffers live, and each is touched cold when its turn comes). On the embedded store,
//! one core and 1,500 connections, admitting them all kept 0.63 of peak goodput where 16
//! at a time kept 0.75-0.78. But a request waiting on a networked store costs no CPU, and
//! there concurrency is throughput: Celeriant batches one account's queued writes into one
//! store write, so more admitted requests raise both latency and goodput (a gate fixed at
//! 16 cut goodput to a third, hot accounts to a quarter). A latency-based limit (TCP
//! Vegas, as Netflix's concurrency-limits uses) read that latency as queueing and held the
//! limit at its floor; the CPU's idle time tells the two cases apart.
//!
//! Each tick the runtime's workers report how busy they were: busy past [`BUSY_HIGH`], the
//! limit falls by a quarter; below [`BUSY_LOW`] with connections waiting for a slot, it
//! grows by an eighth. In between, or with nobody waiting, it holds.
//!
//! With no more connections open than the ceiling, the gate stands wide open: each
//! connection carries one request at a time, so they are already a bound, and their state
//! stays warm. Gating them only adds a wait (about a tenth of peak goodput at 128
//! connections, server on one core); the cold-state cost the gate saves grows with the
//! connections, past a few hundred.

/// How often the limit is reconsidered.
pub const TICK: std::time::Duration = std::time::Duration::from_millis(50);
/// Busy fraction of the workers at or above which the CPU is the bottleneck.
pub const BUSY_HIGH: f64 = 0.9;
/// Busy fraction below which the CPU has time for more requests.
pub const BUSY_LOW: f64 = 0.8;

/// One tick's measurements.
#[derive(Debug, Clone, Copy)]
pub struct Tick {
    /// The workers' busy time over the tick, as a fraction of their wall time (0 to 1).
    pub busy: f64,
    /// Whether a connection had to wait for a slot during the tick: only a binding limit
    /// is evidence that more slots would be used.
    pub saturated: bool,
    /// Client connections open at the tick.
    pub connections: usize,
}

/// The adaptive limit: always within `[min, max]`.
#[derive(Debug, Clone)]
pub struct CpuLimit {
    limit: usize,
    min: usize,
    max: usize,
}

impl CpuLimit {
    /// Starts at the floor: a replica earns concurrency, it is not handed it.
    pub fn new(min: usize, max: usize) -> Self {
        assert!(
            (1..=max).contains(&min),
            "the gate needs 1 <= min ({min}) <= max ({max})"
        );
        CpuLimit {
            limit: min,
            min,
            max,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Folds one tick in and returns the new limit.
    pub fn on_tick(&mut self, t: Tick) -> usize {
        assert!(
            t.busy.is_finite() && t.busy >= 0.0,
            "a busy fraction is a finite, non-negative number, got {}",
            t.busy
        );
        let next = if t.connections <= self.max {
            self.max
        } else if t.busy >= BUSY_HIGH {
            self.limit - (self.limit / 4).max(1).min(self.limit)
        } else if t.busy < BUSY_LOW && t.saturated {
            self.limit + (self.limit / 8).max(1)
        } else {
            self.limit
        };
        self.limit = next.clamp(self.min, self.max);
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tick with more connections open than any ceiling in these tests.
    fn tick(busy: f64, saturated: bool) -> Tick {
        Tick {
            busy,
            saturated,
            connections: 1_500,
        }
    }

    #[test]
    fn with_no_more_connections_than_the_ceiling_the_gate_is_wide_open() {
        let mut l = CpuLimit::new(16, 256);
        let few = Tick {
            busy: 1.0,
            saturated: true,
            connections: 256,
        };
        assert_eq!(l.on_tick(few), 256);
        let many = Tick {
            connections: 257,
            ..few
        };
        assert_eq!(
            l.on_tick(many),
            192,
            "busy with many connections: a quarter less"
        );
    }

    #[test]
    fn a_saturated_gate_grows_while_the_cpu_has_time_to_spare() {
        let mut l = CpuLimit::new(16, 256);
        let mut seen = vec![l.limit()];
        for _ in 0..30 {
            seen.push(l.on_tick(tick(0.4, true)));
        }
        assert!(seen.windows(2).all(|w| w[1] >= w[0]), "{seen:?}");
        assert_eq!(l.limit(), 256, "{seen:?}");
    }

    #[test]
    fn a_gate_nobody_waits_for_holds_its_limit() {
        let mut l = CpuLimit::new(16, 256);
        for _ in 0..30 {
            l.on_tick(tick(0.1, false));
        }
        assert_eq!(l.limit(), 16);
    }

    #[test]
    fn a_busy_cpu_takes_the_limit_back_to_the_floor() {
        let mut l = CpuLimit::new(16, 256);
        for _ in 0..30 {
            l.on_tick(tick(0.4, true));
        }
        let mut seen = vec![l.limit()];
        for _ in 0..15 {
            seen.push(l.on_tick(tick(0.99, true)));
        }
        assert!(seen.windows(2).all(|w| w[1] <= w[0]), "{seen:?}");
        assert_eq!(l.limit(), 16, "{seen:?}");
    }

    #[test]
    fn between_the_thresholds_the_limit_holds() {
        let mut l = CpuLimit::new(16, 256);
        for _ in 0..10 {
            l.on_tick(tick(0.4, true));
        }
        let at = l.limit();
        for _ in 0..10 {
            l.on_tick(tick(0.85, true));
        }
        assert_eq!(l.limit(), at);
    }

    #[test]
    fn the_limit_never_leaves_its_bounds() {
        let mut l = CpuLimit::new(1, 8);
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..10_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let n = l.on_tick(tick((rng % 1000) as f64 / 1000.0, !rng.is_multiple_of(3)));
            assert!((1..=8).contains(&n), "limit {n} outside [1, 8] (rng {rng})");
        }
    }

    #[test]
    #[should_panic(expected = "1 <= min")]
    fn a_floor_above_the_ceiling_is_refused() {
        CpuLimit::new(9, 8);
    }
}
