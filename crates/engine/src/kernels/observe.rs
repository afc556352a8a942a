//! `Observed<K, O>`: a [`Kernels`] backend wrapped so that an observer sees every op call (its
//! name, start and end). The delegation to every op is written once, here; what is done with
//! the calls is the observer's business: per-op totals ([`super::profile::Profiled`]) or an
//! event log for traces ([`super::event_log::Tracing`]).

use super::{
    Accum, AdamWParams, AttnShape, CeShape, Kernels, MatmulShape, NormShape, RopeShape, RopeTable,
    Rounding,
};
use crate::dtype::Elem;
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

impl<K, O: OpObserver> Observed<K, O> {
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

impl<S: Elem, G: Elem, K: Kernels<S, G>, O: OpObserver> Kernels<S, G> for Observed<K, O> {
    fn warm_up(&self) {
        self.inner.warm_up()
    }
    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: &[S],
        w: &[S],
        bias: Option<&[S]>,
        y: &mut [S],
        a: Accum,
    ) {
        self.time("matmul_forward", || {
            self.inner.matmul_forward(s, x, w, bias, y, a)
        })
    }
    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: &[S],
        x: &[S],
        dw: &mut [G],
        db: Option<&mut [G]>,
    ) {
        self.time("matmul_backward_weight", || {
            self.inner.matmul_backward_weight(s, dy, x, dw, db)
        })
    }
    fn matmul_backward_input(&self, s: MatmulShape, dy: &[S], w: &[S], dx: &mut [S], a: Accum) {
        self.time("matmul_backward_input", || {
            self.inner.matmul_backward_input(s, dy, w, dx, a)
        })
    }
    fn rmsnorm_forward(&self, s: NormShape, x: &[S], w: &[S], out: &mut [S], rstd: &mut [f32]) {
        self.time("rmsnorm_forward", || {
            self.inner.rmsnorm_forward(s, x, w, out, rstd)
        })
    }
    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: &[S],
        x: &[S],
        w: &[S],
        rstd: &[f32],
        dx: &mut [S],
        a: Accum,
        dw: &mut [G],
    ) {
        self.time("rmsnorm_backward", || {
            self.inner.rmsnorm_backward(s, dy, x, w, rstd, dx, a, dw)
        })
    }
    fn rope_forward(&self, s: RopeShape, t: &RopeTable, x: &mut [S]) {
        self.time("rope_forward", || self.inner.rope_forward(s, t, x))
    }
    fn rope_backward(&self, s: RopeShape, t: &RopeTable, dx: &mut [S]) {
        self.time("rope_backward", || self.inner.rope_backward(s, t, dx))
    }
    fn attention_forward(
        &self,
        s: AttnShape,
        q: &[S],
        k: &[S],
        v: &[S],
        o: &mut [S],
        lse: &mut [f32],
    ) {
        self.time("attention_forward", || {
            self.inner.attention_forward(s, q, k, v, o, lse)
        })
    }
    fn attention_backward(
        &self,
        s: AttnShape,
        q: &[S],
        k: &[S],
        v: &[S],
        o: &[S],
        lse: &[f32],
        d_o: &[S],
        dq: &mut [S],
        dk: &mut [S],
        dv: &mut [S],
    ) {
        self.time("attention_backward", || {
            self.inner
                .attention_backward(s, q, k, v, o, lse, d_o, dq, dk, dv)
        })
    }
    fn swiglu_forward(&self, g: &[S], u: &[S], h: &mut [S]) {
        self.time("swiglu_forward", || self.inner.swiglu_forward(g, u, h))
    }
    fn swiglu_backward(&self, dh: &[S], g: &[S], u: &[S], dg: &mut [S], du: &mut [S]) {
        self.time("swiglu_backward", || {
            self.inner.swiglu_backward(dh, g, u, dg, du)
        })
    }
    fn embedding_forward(&self, t: &[u32], wte: &[S], c: usize, out: &mut [S]) {
        self.time("embedding_forward", || {
            self.inner.embedding_forward(t, wte, c, out)
        })
    }
    fn embedding_backward(&self, t: &[u32], dout: &[S], c: usize, dwte: &mut [G]) {
        self.time("embedding_backward", || {
            self.inner.embedding_backward(t, dout, c, dwte)
        })
    }
    fn add(&self, a: &[S], b: &[S], out: &mut [S]) {
        self.time("add", || self.inner.add(a, b, out))
    }
    fn add_inplace(&self, acc: &mut [S], x: &[S]) {
        self.time("add_inplace", || self.inner.add_inplace(acc, x))
    }
    fn copy(&self, src: &[S], dst: &mut [S]) {
        self.time("copy", || self.inner.copy(src, dst))
    }
    fn scale(&self, x: &mut [G], s: f32) {
        self.time("scale", || self.inner.scale(x, s))
    }
    fn sum_squares(&self, x: &[G]) -> f64 {
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
    fn adamw_step(
        &self,
        h: AdamWParams,
        p: &mut [f32],
        g: &[G],
        m: &mut [f32],
        v: &mut [f32],
        out: Option<(&mut [S], Rounding)>,
    ) {
        self.time("adamw_step", || self.inner.adamw_step(h, p, g, m, v, out))
    }
    fn round_params(&self, src: &[f32], dst: &mut [S]) {
        self.time("round_params", || self.inner.round_params(src, dst))
    }
    fn head_forward(&self, s: MatmulShape, x: &[S], w: &[S], logits: &mut [f32]) {
        self.time("head_forward", || self.inner.head_forward(s, x, w, logits))
    }
    fn head_backward_weight(&self, s: MatmulShape, dl: &[f32], x: &[S], dw: &mut [G]) {
        self.time("head_backward_weight", || {
            self.inner.head_backward_weight(s, dl, x, dw)
        })
    }
    fn head_backward_input(&self, s: MatmulShape, dl: &[f32], w: &[S], dx: &mut [S]) {
        self.time("head_backward_input", || {
            self.inner.head_backward_input(s, dl, w, dx)
        })
    }
}
