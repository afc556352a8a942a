//! Per-op wall-time totals of a backend (benchmarks: `examples/train_step.rs`). The timing
//! overhead is one `Instant::now()` pair per call.

use super::observe::{Observed, OpObserver};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Accumulated calls and time of one op.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTime {
    pub calls: u64,
    pub time: Duration,
}

/// Per-op totals in first-call order.
#[derive(Debug, Default)]
pub struct OpTotals(Mutex<Vec<(&'static str, OpTime)>>);

impl OpObserver for OpTotals {
    fn record(&self, op: &'static str, start: Instant, end: Instant) {
        let dt = end.saturating_duration_since(start);
        let mut t = self.0.lock().unwrap();
        match t.iter_mut().find(|(n, _)| *n == op) {
            Some((_, o)) => {
                o.calls += 1;
                o.time += dt;
            }
            None => t.push((op, OpTime { calls: 1, time: dt })),
        }
    }
}

/// A backend that records per-op wall time.
pub type Profiled<K> = Observed<K, OpTotals>;

impl<K> Observed<K, OpTotals> {
    pub fn new(inner: K) -> Self {
        Observed {
            inner,
            observer: OpTotals::default(),
        }
    }

    /// Per-op totals in first-call order.
    pub fn report(&self) -> Vec<(&'static str, OpTime)> {
        self.observer.0.lock().unwrap().clone()
    }

    pub fn reset(&self) {
        self.observer.0.lock().unwrap().clear();
    }
}
