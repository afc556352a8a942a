//! `--trace`: a Chrome trace (the JSON Trace Event Format that Perfetto and chrome://tracing
//! open) of every kernel call and every phase of the first steps. `Tracing<K>` wraps a kernel
//! backend by delegation, as the engine's `Profiled<K>` does, but keeps each call as an event
//! (name, start, duration, thread) instead of per-op totals.
//!
//! Events are memory outside the plan, so nothing is recorded unless tracing is on: the check is
//! one relaxed atomic load per kernel call. The buffer is reserved up front for the expected
//! number of events and only grows if that estimate is short.

use anyhow::{Context, Result};
use ferrotron_engine::kernels::{
    Accum, AdamWParams, AttnShape, CeShape, Kernels, MatmulShape, NormShape, RopeShape, RopeTable,
};
use half::bf16;
use serde::Serialize;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// One complete ("X") event.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub name: &'static str,
    /// "kernel" or "phase".
    pub cat: &'static str,
    /// Nanoseconds since the tracer was created.
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

/// A kernel backend that can record a trace of its calls.
#[derive(Debug)]
pub struct Tracing<K> {
    pub inner: K,
    on: AtomicBool,
    t0: Instant,
    events: Mutex<Vec<Event>>,
}

impl<K: Kernels> Tracing<K> {
    /// Off, with nothing reserved.
    pub fn new(inner: K) -> Self {
        Tracing {
            inner,
            on: AtomicBool::new(false),
            t0: Instant::now(),
            events: Mutex::new(Vec::new()),
        }
    }

    /// Starts recording, with room for `capacity` events.
    pub fn start(&self, capacity: usize) {
        self.events.lock().unwrap().reserve(capacity);
        self.on.store(true, Relaxed);
    }

    pub fn stop(&self) {
        self.on.store(false, Relaxed);
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Relaxed)
    }

    /// Takes the recorded events.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.t0).as_nanos() as u64
    }

    /// Records a phase that began at `start` and ends now (no-op when off).
    pub fn phase(&self, name: &'static str, start: Instant, step: u64, mb: u64) {
        if self.is_on() {
            let now = Instant::now();
            self.push(Event {
                name,
                cat: "phase",
                start_ns: self.ns(start),
                dur_ns: now.saturating_duration_since(start).as_nanos() as u64,
                tid: tid(),
                step,
                mb,
            });
        }
    }

    fn push(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }

    fn time<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        if !self.is_on() {
            return f();
        }
        let t0 = Instant::now();
        let r = f();
        let dur = t0.elapsed().as_nanos() as u64;
        self.push(Event {
            name: op,
            cat: "kernel",
            start_ns: self.ns(t0),
            dur_ns: dur,
            tid: tid(),
            step: 0,
            mb: 0,
        });
        r
    }
}

#[derive(Serialize)]
struct ChromeEvent<'a> {
    name: &'a str,
    cat: &'a str,
    ph: &'a str,
    /// Microseconds (the format's unit), fractional to keep sub-µs kernels visible.
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<serde_json::Value>,
}

/// Writes `{"traceEvents": [...], "displayTimeUnit": "ms"}`, with thread-name metadata so the
/// main thread is labelled.
pub fn write_chrome(path: &Path, events: &[Event]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("trace = {}: cannot create", dir.display()))?;
    }
    let pid = std::process::id();
    let mut out = Vec::with_capacity(events.len() + 4);
    let mut tids: Vec<u32> = events.iter().map(|e| e.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    for t in tids {
        out.push(ChromeEvent {
            name: "thread_name",
            cat: "__metadata",
            ph: "M",
            ts: 0.0,
            dur: 0.0,
            pid,
            tid: t,
            args: Some(serde_json::json!({ "name": format!("ferrotron thread {t}") })),
        });
    }
    for e in events {
        let args = (e.cat == "phase").then(|| serde_json::json!({"step": e.step, "mb": e.mb}));
        out.push(ChromeEvent {
            name: e.name,
            cat: e.cat,
            ph: "X",
            ts: e.start_ns as f64 / 1e3,
            dur: e.dur_ns as f64 / 1e3,
            pid,
            tid: e.tid,
            args,
        });
    }
    let f = std::fs::File::create(path)
        .with_context(|| format!("trace = {}: cannot create", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    serde_json::to_writer(
        &mut w,
        &serde_json::json!({ "traceEvents": out, "displayTimeUnit": "ms" }),
    )?;
    w.flush()?;
    Ok(())
}

impl<K: Kernels> Kernels for Tracing<K> {
    fn warm_up(&self) {
        self.inner.warm_up()
    }
    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        y: &mut [f32],
        a: Accum,
    ) {
        self.time("matmul_forward", || {
            self.inner.matmul_forward(s, x, w, bias, y, a)
        })
    }
    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: &[f32],
        x: &[f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
    ) {
        self.time("matmul_backward_weight", || {
            self.inner.matmul_backward_weight(s, dy, x, dw, db)
        })
    }
    fn matmul_backward_input(
        &self,
        s: MatmulShape,
        dy: &[f32],
        w: &[f32],
        dx: &mut [f32],
        a: Accum,
    ) {
        self.time("matmul_backward_input", || {
            self.inner.matmul_backward_input(s, dy, w, dx, a)
        })
    }
    fn rmsnorm_forward(
        &self,
        s: NormShape,
        x: &[f32],
        w: &[f32],
        out: &mut [f32],
        rstd: &mut [f32],
    ) {
        self.time("rmsnorm_forward", || {
            self.inner.rmsnorm_forward(s, x, w, out, rstd)
        })
    }
    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        a: Accum,
        dw: &mut [f32],
    ) {
        self.time("rmsnorm_backward", || {
            self.inner.rmsnorm_backward(s, dy, x, w, rstd, dx, a, dw)
        })
    }
    fn rope_forward(&self, s: RopeShape, t: &RopeTable, x: &mut [f32]) {
        self.time("rope_forward", || self.inner.rope_forward(s, t, x))
    }
    fn rope_backward(&self, s: RopeShape, t: &RopeTable, dx: &mut [f32]) {
        self.time("rope_backward", || self.inner.rope_backward(s, t, dx))
    }
    fn attention_forward(
        &self,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        self.time("attention_forward", || {
            self.inner.attention_forward(s, q, k, v, o, lse)
        })
    }
    fn attention_backward(
        &self,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        self.time("attention_backward", || {
            self.inner
                .attention_backward(s, q, k, v, o, lse, d_o, dq, dk, dv)
        })
    }
    fn swiglu_forward(&self, g: &[f32], u: &[f32], h: &mut [f32]) {
        self.time("swiglu_forward", || self.inner.swiglu_forward(g, u, h))
    }
    fn swiglu_backward(&self, dh: &[f32], g: &[f32], u: &[f32], dg: &mut [f32], du: &mut [f32]) {
        self.time("swiglu_backward", || {
            self.inner.swiglu_backward(dh, g, u, dg, du)
        })
    }
    fn embedding_forward(&self, t: &[u32], wte: &[f32], c: usize, out: &mut [f32]) {
        self.time("embedding_forward", || {
            self.inner.embedding_forward(t, wte, c, out)
        })
    }
    fn embedding_backward(&self, t: &[u32], dout: &[f32], c: usize, dwte: &mut [f32]) {
        self.time("embedding_backward", || {
            self.inner.embedding_backward(t, dout, c, dwte)
        })
    }
    fn add(&self, a: &[f32], b: &[f32], out: &mut [f32]) {
        self.time("add", || self.inner.add(a, b, out))
    }
    fn add_inplace(&self, acc: &mut [f32], x: &[f32]) {
        self.time("add_inplace", || self.inner.add_inplace(acc, x))
    }
    fn copy(&self, src: &[f32], dst: &mut [f32]) {
        self.time("copy", || self.inner.copy(src, dst))
    }
    fn scale(&self, x: &mut [f32], s: f32) {
        self.time("scale", || self.inner.scale(x, s))
    }
    fn sum_squares(&self, x: &[f32]) -> f64 {
        self.time("sum_squares", || self.inner.sum_squares(x))
    }
    fn cross_entropy(
        &self,
        s: CeShape,
        z: &mut [f32],
        t: &[u32],
        l: &mut [f32],
        sc: Option<f32>,
    ) -> f64 {
        self.time("cross_entropy", || self.inner.cross_entropy(s, z, t, l, sc))
    }
    fn adamw_step(&self, h: AdamWParams, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        self.time("adamw_step", || self.inner.adamw_step(h, p, g, m, v))
    }
    fn cast_f32_to_bf16(&self, src: &[f32], dst: &mut [bf16]) {
        self.time("cast_f32_to_bf16", || self.inner.cast_f32_to_bf16(src, dst))
    }
    fn cast_bf16_to_f32(&self, src: &[bf16], dst: &mut [f32]) {
        self.time("cast_bf16_to_f32", || self.inner.cast_bf16_to_f32(src, dst))
    }
}
