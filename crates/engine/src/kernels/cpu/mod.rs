//! CPU backend: f32 math, `gemm` for matmuls, rayon for everything parallel.
//! One file per op; this file only routes the trait to them.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod matmul;
pub mod rmsnorm;
pub mod rope;
pub mod simd;
pub mod swiglu;

use super::{
    Accum, AdamWParams, AttnShape, CeShape, Kernels, MatmulShape, NormShape, RopeShape, RopeTable,
};
use half::bf16;

/// The CPU implementation of [`Kernels`]. Stateless; threads come from rayon's global pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuKernels;

/// The gemm crate keeps a per-thread L2 packing slab (about 1 MiB) created on a thread's first
/// product; running one small product on every pool thread and the caller creates them all.
fn warm_up_gemm() {
    let run = || {
        let (m, n, k) = (256, 256, 256);
        let (x, w) = (vec![0.5f32; m * k], vec![0.25f32; n * k]);
        let mut y = vec![0.0f32; m * n];
        matmul::sgemm(
            m,
            n,
            k,
            &mut y,
            (n, 1),
            &x,
            (k, 1),
            &w,
            (1, k),
            false,
            false,
        );
        std::hint::black_box(&y);
    };
    rayon::broadcast(|_| run());
    run();
}

impl Kernels for CpuKernels {
    fn warm_up(&self) {
        warm_up_gemm();
    }

    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        y: &mut [f32],
        y_accum: Accum,
    ) {
        matmul::forward(s, x, w, bias, y, y_accum)
    }
    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: &[f32],
        x: &[f32],
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
    ) {
        matmul::backward_weight(s, dy, x, dw, dbias)
    }
    fn matmul_backward_input(
        &self,
        s: MatmulShape,
        dy: &[f32],
        w: &[f32],
        dx: &mut [f32],
        dx_accum: Accum,
    ) {
        matmul::backward_input(s, dy, w, dx, dx_accum)
    }
    fn rmsnorm_forward(
        &self,
        s: NormShape,
        x: &[f32],
        w: &[f32],
        out: &mut [f32],
        rstd: &mut [f32],
    ) {
        rmsnorm::forward(s, x, w, out, rstd)
    }
    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        dx_accum: Accum,
        dw: &mut [f32],
    ) {
        rmsnorm::backward(s, dy, x, w, rstd, dx, dx_accum, dw)
    }
    fn rope_forward(&self, s: RopeShape, table: &RopeTable, x: &mut [f32]) {
        rope::forward(s, table, x)
    }
    fn rope_backward(&self, s: RopeShape, table: &RopeTable, dx: &mut [f32]) {
        rope::backward(s, table, dx)
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
        attention::forward(s, q, k, v, o, lse)
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
        attention::backward(s, q, k, v, o, lse, d_o, dq, dk, dv)
    }
    fn swiglu_forward(&self, gate: &[f32], up: &[f32], h: &mut [f32]) {
        swiglu::forward(gate, up, h)
    }
    fn swiglu_backward(
        &self,
        dh: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        swiglu::backward(dh, gate, up, dgate, dup)
    }
    fn embedding_forward(&self, tokens: &[u32], wte: &[f32], c: usize, out: &mut [f32]) {
        embedding::forward(tokens, wte, c, out)
    }
    fn embedding_backward(&self, tokens: &[u32], dout: &[f32], c: usize, dwte: &mut [f32]) {
        embedding::backward(tokens, dout, c, dwte)
    }
    fn add(&self, a: &[f32], b: &[f32], out: &mut [f32]) {
        elementwise::add(a, b, out)
    }
    fn add_inplace(&self, acc: &mut [f32], x: &[f32]) {
        elementwise::add_inplace(acc, x)
    }
    fn copy(&self, src: &[f32], dst: &mut [f32]) {
        elementwise::copy(src, dst)
    }
    fn scale(&self, x: &mut [f32], s: f32) {
        elementwise::scale(x, s)
    }
    fn sum_squares(&self, x: &[f32]) -> f64 {
        elementwise::sum_squares(x)
    }
    fn cross_entropy(
        &self,
        s: CeShape,
        logits: &mut [f32],
        targets: &[u32],
        losses: &mut [f32],
        dlogits_scale: Option<f32>,
    ) -> f64 {
        cross_entropy::cross_entropy(s, logits, targets, losses, dlogits_scale)
    }
    fn adamw_step(
        &self,
        h: AdamWParams,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        adamw::step(h, params, grads, m, v)
    }
    fn cast_f32_to_bf16(&self, src: &[f32], dst: &mut [bf16]) {
        elementwise::f32_to_bf16(src, dst)
    }
    fn cast_bf16_to_f32(&self, src: &[bf16], dst: &mut [f32]) {
        elementwise::bf16_to_f32(src, dst)
    }
}
