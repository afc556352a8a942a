//! An event log of op calls and phases, for Chrome traces (`ferrotron train --trace`). Events
//! are memory outside the memory plan, so nothing is recorded unless the log is started: the
//! check is one relaxed atomic load per op call. Room for the expected events is reserved up
//! front; the log only grows if that estimate is short.

use super::observe::{Observed, OpObserver};
use super::{DeviceSpan, Kernels};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// The track of a rank's collectives in flight (a thread id no thread has).
pub const COMM_TRACK: u32 = u32::MAX;

/// The track of the device's own times of the ops (`Kernels::take_device_spans`).
pub const DEVICE_TRACK: u32 = u32::MAX - 1;

/// One complete ("X") event.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub name: &'static str,
    /// "kernel", "phase", "comm" or "gpu" (the device's own time of an op).
    pub cat: &'static str,
    /// Nanoseconds since the log was created.
    pub start_ns: u64,
    pub dur_ns: u64,
    pub tid: u32,
    /// Step (1-based) and micro-batch of a phase; 0 where they do not apply.
    pub step: u64,
    pub mb: u64,
}

static NEXT_TID: AtomicU32 = AtomicU32::new(1);

thread_local! {
    /// Small, stable thread ids (the OS ids are long and mean nothing in a trace).
    static TID: u32 = NEXT_TID.fetch_add(1, Relaxed);
}

fn tid() -> u32 {
    TID.with(|t| *t)
}

/// The recorder behind [`Tracing`].
#[derive(Debug)]
pub struct EventLog {
    on: AtomicBool,
    t0: Instant,
    events: Mutex<Vec<Event>>,
    /// The host's start of the first op since the device's spans were last taken (`u64::MAX`:
    /// none): where the device's track starts.
    first_op_ns: AtomicU64,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog {
            on: AtomicBool::new(false),
            t0: Instant::now(),
            events: Mutex::new(Vec::new()),
            first_op_ns: AtomicU64::new(u64::MAX),
        }
    }
}

impl EventLog {
    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.t0).as_nanos() as u64
    }

    fn event(
        &self,
        name: &'static str,
        cat: &'static str,
        start: Instant,
        end: Instant,
        step: u64,
        mb: u64,
    ) -> Event {
        Event {
            name,
            cat,
            start_ns: self.ns(start),
            dur_ns: end.saturating_duration_since(start).as_nanos() as u64,
            tid: tid(),
            step,
            mb,
        }
    }

    fn push(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }
}

impl OpObserver for EventLog {
    fn active(&self) -> bool {
        self.on.load(Relaxed)
    }
    fn device_timed(&self) -> bool {
        true
    }
    fn record(&self, op: &'static str, start: Instant, end: Instant) {
        let e = self.event(op, "kernel", start, end, 0, 0);
        self.first_op_ns.fetch_min(e.start_ns, Relaxed);
        self.push(e);
    }
}

/// A backend that can record a trace of its op calls and of the caller's phases.
pub type Tracing<K> = Observed<K, EventLog>;

impl<K> Observed<K, EventLog> {
    /// Off, with nothing reserved.
    pub fn new(inner: K) -> Self {
        Observed {
            inner,
            observer: EventLog::default(),
        }
    }

    /// Starts recording, with room for `capacity` events.
    pub fn start(&self, capacity: usize) {
        self.observer.events.lock().unwrap().reserve(capacity);
        self.observer.on.store(true, Relaxed);
    }

    pub fn stop(&self) {
        self.observer.on.store(false, Relaxed);
    }

    pub fn is_on(&self) -> bool {
        self.observer.active()
    }

    /// Takes the recorded events.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.observer.events.lock().unwrap())
    }

    /// Records a collective of this rank that was in flight from `start` to `end` (no-op when
    /// off), on its own track ([`COMM_TRACK`]) beside the compute of the thread that ran it.
    pub fn comm(&self, name: &'static str, start: Instant, end: Instant, step: u64) {
        if self.is_on() {
            let o = &self.observer;
            let e = o.event(name, "comm", start, end, step, 0);
            o.push(Event {
                tid: COMM_TRACK,
                ..e
            });
        }
    }

    /// Records the device's own times of the ops since the last call (no-op when off, or on
    /// a backend that does not time them), as events on the device's track ([`DEVICE_TRACK`]),
    /// the first starting where the first op did on the host: the device runs behind the
    /// host, so the track shows each op's length and the gaps between them, shifted.
    pub fn device_spans(&self, step: u64)
    where
        K: Kernels<f32>,
    {
        let first = self.observer.first_op_ns.swap(u64::MAX, Relaxed);
        // Taken whether or not the log is on, so no op of an untraced interval is left over.
        let mut spans: Vec<DeviceSpan> = vec![];
        self.inner.take_device_spans(&mut spans);
        let at = |ms: f64| (ms * 1e6).max(0.0) as u64;
        for s in spans.iter().filter(|_| first != u64::MAX && self.is_on()) {
            self.observer.push(Event {
                name: s.op,
                cat: "gpu",
                start_ns: first + at(s.start_ms),
                dur_ns: at(s.dur_ms),
                tid: DEVICE_TRACK,
                step,
                mb: 0,
            });
        }
    }

    /// Records a phase that began at `start` and ends now (no-op when off).
    pub fn phase(&self, name: &'static str, start: Instant, step: u64, mb: u64) {
        if self.is_on() {
            let o = &self.observer;
            o.push(o.event(name, "phase", start, Instant::now(), step, mb));
        }
    }
}
