//! An event log of op calls and phases, for Chrome traces (`ferrotron train --trace`). Events
//! are memory outside the memory plan, so nothing is recorded unless the log is started: the
//! check is one relaxed atomic load per op call. Room for the expected events is reserved up
//! front; the log only grows if that estimate is short.

use super::observe::{Observed, OpObserver};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// The track of a rank's collectives in flight (a thread id no thread has).
pub const COMM_TRACK: u32 = u32::MAX;

/// One complete ("X") event.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub name: &'static str,
    /// "kernel", "phase" or "comm".
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
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog {
            on: AtomicBool::new(false),
            t0: Instant::now(),
            events: Mutex::new(Vec::new()),
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
    fn record(&self, op: &'static str, start: Instant, end: Instant) {
        self.push(self.event(op, "kernel", start, end, 0, 0));
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

    /// Records a phase that began at `start` and ends now (no-op when off).
    pub fn phase(&self, name: &'static str, start: Instant, step: u64, mb: u64) {
        if self.is_on() {
            let o = &self.observer;
            o.push(o.event(name, "phase", start, Instant::now(), step, mb));
        }
    }
}
