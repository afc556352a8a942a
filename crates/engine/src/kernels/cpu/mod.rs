//! CPU backend: f32 math, oneDNN or the `gemm` crate for matmuls (`gemm_select`), rayon for
//! everything parallel.
//! One file per op; this file only routes the trait to them.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod gemm_select;
pub mod matmul;
pub mod moe_routing;
pub mod onednn;
pub mod rmsnorm;
pub mod rope;
pub mod simd;
pub mod staged_gemm;
pub mod swiglu;
pub mod tile_gemm;
pub mod vocab_parallel_ce;

use super::{
    Accum, AdamWParams, AttnShape, CeShape, CeShardShape, Kernels, Limits, MatmulShape, NormShape,
    RingShape, RopeShape, RopeTable, Rounding, RouteShape,
};
use crate::dtype::Elem;
pub use gemm_select::Gemm;
pub use matmul::{Fp8Inputs, FP8_HYBRID};

/// The CPU implementation of [`Kernels`] for every storage type. No state but the fp8 recipe
/// and the GEMM choice; threads come from rayon's global pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuKernels {
    /// When set, every layer GEMM (not the LM head, not attention) quantises its inputs to
    /// fp8 with per-tensor current scaling, accumulating in f32.
    pub fp8: Option<Fp8Inputs>,
    /// Which GEMM kernel runs the products (oneDNN or the gemm crate).
    pub gemm: Gemm,
}

impl CpuKernels {
    /// f32 (or 16-bit) products throughout.
    pub const PLAIN: CpuKernels = CpuKernels {
        fp8: None,
        gemm: Gemm::Auto,
    };
    /// fp8 layer GEMMs: e4m3 weights and activations, e5m2 gradients.
    pub const FP8: CpuKernels = CpuKernels {
        fp8: Some(FP8_HYBRID),
        gemm: Gemm::Auto,
    };

    /// The same kernels with products on `gemm`.
    pub const fn with_gemm(self, gemm: Gemm) -> CpuKernels {
        CpuKernels { gemm, ..self }
    }

    /// The LM head's products: never fp8.
    fn head(&self) -> CpuKernels {
        CpuKernels { fp8: None, ..*self }
    }
}

/// The gemm crate keeps a per-thread L2 packing slab (the size of one core's L2 cache: 2 MiB on
/// a Xeon) created on a thread's first product that packs its left operand block by block,
/// which it does only for large enough products (smaller ones pack into a per-call buffer:
/// 256³ or 8,192 × 64 × 384 create no slab on a Xeon). Running one product of a layer's size
/// (2,048 × 384 × 384, a few ms) on every pool thread and the caller creates them all. The layers' products used to do this while the trainer measured its kernel
/// workspace; on oneDNN they no longer run on the gemm crate, and attention's first tile
/// products created the slabs inside the first step, outside the memory plan.
fn warm_up_gemm() {
    let run = || {
        let (m, n, k) = (2048, 384, 384);
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

impl<S: Elem, G: Elem> Kernels<S, G> for CpuKernels {
    fn warm_up(&self) {
        warm_up_gemm();
    }
    fn limits(&self) -> Limits {
        Limits {
            backend: "CPU",
            max_head_dim: attention::MAX_HEAD_DIM,
        }
    }

    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: &[S],
        w: &[S],
        bias: Option<&[S]>,
        y: &mut [S],
        y_accum: Accum,
    ) {
        matmul::forward(s, x, w, bias, y, y_accum, self)
    }
    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: &[S],
        x: &[S],
        dw: &mut [G],
        dbias: Option<&mut [G]>,
    ) {
        matmul::backward_weight(s, dy, x, dw, dbias, self)
    }
    fn matmul_backward_input(
        &self,
        s: MatmulShape,
        dy: &[S],
        w: &[S],
        dx: &mut [S],
        dx_accum: Accum,
    ) {
        matmul::backward_input(s, dy, w, dx, dx_accum, self)
    }
    fn head_forward(&self, s: MatmulShape, x: &[S], w: &[S], logits: &mut [f32]) {
        matmul::forward(s, x, w, None, logits, Accum::Overwrite, &self.head())
    }
    fn head_backward_weight(&self, s: MatmulShape, dlogits: &[f32], x: &[S], dw: &mut [G]) {
        matmul::backward_weight(s, dlogits, x, dw, None, &self.head())
    }
    fn head_backward_input(&self, s: MatmulShape, dlogits: &[f32], w: &[S], dx: &mut [S]) {
        matmul::backward_input(s, dlogits, w, dx, Accum::Overwrite, &self.head())
    }
    fn rmsnorm_forward(&self, s: NormShape, x: &[S], w: &[S], out: &mut [S], rstd: &mut [f32]) {
        rmsnorm::forward(s, x, w, out, rstd)
    }
    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: &[S],
        x: &[S],
        w: &[S],
        rstd: &[f32],
        dx: &mut [S],
        dx_accum: Accum,
        dw: &mut [G],
    ) {
        rmsnorm::backward(s, dy, x, w, rstd, dx, dx_accum, dw)
    }
    fn rope_forward(&self, s: RopeShape, table: &RopeTable, x: &mut [S]) {
        rope::forward(s, table, x)
    }
    fn rope_backward(&self, s: RopeShape, table: &RopeTable, dx: &mut [S]) {
        rope::backward(s, table, dx)
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
        attention::forward(s, q, k, v, o, lse)
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
        attention::backward(s, q, k, v, o, lse, d_o, dq, dk, dv)
    }
    fn attention_forward_ring(
        &self,
        s: RingShape,
        q: &[S],
        k: &[f32],
        v: &[f32],
        o: &mut [f32],
        lse: &mut [f32],
        first: bool,
    ) {
        attention::forward_ring(s, q, k, v, o, lse, first)
    }
    fn attention_backward_ring(
        &self,
        s: RingShape,
        q: &[S],
        k: &[f32],
        v: &[f32],
        o: &[S],
        lse: &[f32],
        d_o: &[S],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        attention::backward_ring(s, q, k, v, o, lse, d_o, dq, dk, dv)
    }
    fn swiglu_forward(&self, gate: &[S], up: &[S], h: &mut [S]) {
        swiglu::forward(gate, up, h)
    }
    fn swiglu_backward(&self, dh: &[S], gate: &[S], up: &[S], dgate: &mut [S], dup: &mut [S]) {
        swiglu::backward(dh, gate, up, dgate, dup)
    }
    fn router_forward(
        &self,
        s: RouteShape,
        logits: &[f32],
        weights: &mut [f32],
        index: &mut [u32],
        load: &mut [f32],
    ) {
        moe_routing::router_forward(s, logits, weights, index, load)
    }
    fn router_backward(
        &self,
        s: RouteShape,
        logits: &[f32],
        index: &[u32],
        dweights: &[f32],
        aux_dp: &[f32],
        dlogits: &mut [f32],
    ) {
        moe_routing::router_backward(s, logits, index, dweights, aux_dp, dlogits)
    }
    fn permute(&self, s: RouteShape, index: &[u32], x: &[S], rows: &mut [S]) {
        moe_routing::permute(s, index, x, rows)
    }
    fn unpermute(
        &self,
        s: RouteShape,
        index: &[u32],
        weights: Option<&[f32]>,
        rows: &[S],
        y: &mut [S],
        accum: Accum,
    ) {
        moe_routing::unpermute(s, index, weights, rows, y, accum)
    }
    fn scale_rows(&self, s: RouteShape, index: &[u32], weights: &[f32], rows: &mut [S]) {
        moe_routing::scale_rows(s, index, weights, rows)
    }
    fn row_dot(&self, s: RouteShape, index: &[u32], a: &[S], b: &[S], out: &mut [f32]) {
        moe_routing::row_dot(s, index, a, b, out)
    }
    fn embedding_forward(&self, tokens: &[u32], wte: &[S], c: usize, out: &mut [S]) {
        embedding::forward(tokens, wte, c, out)
    }
    fn embedding_backward(&self, tokens: &[u32], dout: &[S], c: usize, dwte: &mut [G]) {
        embedding::backward(tokens, dout, c, dwte)
    }
    fn embedding_forward_shard(
        &self,
        tokens: &[u32],
        wte: &[S],
        c: usize,
        first: usize,
        out: &mut [S],
    ) {
        embedding::forward_shard(tokens, wte, c, first, out)
    }
    fn embedding_backward_shard(
        &self,
        tokens: &[u32],
        dout: &[S],
        c: usize,
        first: usize,
        dwte: &mut [G],
    ) {
        embedding::backward_shard(tokens, dout, c, first, dwte)
    }
    fn add(&self, a: &[S], b: &[S], out: &mut [S]) {
        elementwise::add(a, b, out)
    }
    fn add_inplace(&self, acc: &mut [S], x: &[S]) {
        elementwise::add_inplace(acc, x)
    }
    fn copy(&self, src: &[S], dst: &mut [S]) {
        elementwise::copy(src, dst)
    }
    fn scale(&self, x: &mut [G], s: f32) {
        elementwise::scale(x, s)
    }
    fn sum_squares(&self, x: &[G]) -> f64 {
        elementwise::sum_squares(x)
    }
    fn round_params(&self, src: &[f32], dst: &mut [S]) {
        elementwise::round_into(src, dst)
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
    fn ce_shard_stats(
        &self,
        s: CeShardShape,
        logits: &mut [f32],
        targets: &[u32],
        stats: &mut [f32],
        keep_exp: bool,
    ) {
        vocab_parallel_ce::stats(s, logits, targets, stats, keep_exp)
    }
    fn ce_shard_finish(
        &self,
        s: CeShardShape,
        logits: &mut [f32],
        targets: &[u32],
        all: &[f32],
        rank: usize,
        losses: &mut [f32],
        dlogits_scale: Option<f32>,
    ) -> f64 {
        vocab_parallel_ce::finish(s, logits, targets, all, rank, losses, dlogits_scale)
    }
    fn adamw_step(
        &self,
        h: AdamWParams,
        master: &mut [f32],
        grads: &[G],
        m: &mut [f32],
        v: &mut [f32],
        params: Option<(&mut [S], Rounding)>,
    ) {
        adamw::step(h, master, grads, m, v, params)
    }
}
