//! `Observed<K, O>`: a [`Kernels`] backend wrapped so that an observer sees every op call (its
//! name, start and end). The delegation to every op is written once, here; what is done with
//! the calls is the observer's business: per-op totals ([`super::profile::Profiled`]) or an
//! event log for traces ([`super::event_log::Tracing`]).

use super::{
    Accum, AdamWParams, AttnShape, CeShape, Kernels, MatmulShape, NormShape, RopeShape, RopeTable,
};
use half::bf16;
use std::time::Instant;

/// Receives every op call of an [`Observed`] backend.
pub trait OpObserver: Send + Sync {
    /// Whether calls are observed now; when false the op runs without reading the clock.
    fn active(&self) -> bool {
        true
    }
    fn record(&self, op: &'static str, start: Instant, end: Instant);
}

/// A backend and its observer.
#[derive(Debug, Default)]
pub struct Observed<K, O> {
    pub inner: K,
    pub observer: O,
}

impl<K: Kernels, O: OpObserver> Observed<K, O> {
    fn time<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        if !self.observer.active() {
            return f();
        }
        let start = Instant::now();
        let r = f();
        self.observer.record(op, start, Instant::now());
        r
    }
}

impl<K: Kernels, O: OpObserver> Kernels for Observed<K, O> {
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
