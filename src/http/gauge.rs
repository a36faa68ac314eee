//! A gauge held up while something lasts.

use prometheus::IntGauge;

/// Counts a request on a gauge (in flight, queued for a slot, or waiting at the gate) until it
/// is dropped, however it ends: an error, a panic, the backstop, or its client gone while it
/// waited for admission. (Not the write loop's in-flight write, which followers of one key wait on.)
pub struct InFlightGauge(IntGauge);

impl InFlightGauge {
    pub fn enter(gauge: &IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for InFlightGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}
