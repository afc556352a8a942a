//! CPU backend: f32 math, oneDNN or the `gemm` crate for matmuls (`gemm_select`), rayon for
//! everything parallel.
//! One file per op; this file only routes the trait to them.

pub mod adamw;
pub mod attention;
pub mod attention_cached;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod gemm_select;
pub mod matmul;
pub mod moe_routing;
pub mod onednn;
pub mod rmsnorm;
pub mod rope;
pub mod scratch;
pub mod simd;
pub mod staged_gemm;
pub mod swiglu;
pub mod tile_gemm;
pub mod vocab_parallel_ce;

use super::{
    Accum, AdamWParams, AttnShape, CachedAttnShape, CeShape, CeShardShape, Kernels, Limits,
    MatmulShape, NormShape, RingShape, RopeShape, RopeTable, Rounding, RouteShape, View, ViewMut,
    Weighted,
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
            experts: true,
        }
    }

    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: View<'_, S>,
        w: View<'_, S>,
        bias: Option<View<'_, S>>,
        y: ViewMut<'_, S>,
        y_accum: Accum,
    ) {
        matmul::forward(
            s,
            x.host(),
            w.host(),
            bias.map(View::host),
            y.host_mut(),
            y_accum,
            self,
        )
    }
    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: View<'_, S>,
        x: View<'_, S>,
        dw: ViewMut<'_, G>,
        dbias: Option<ViewMut<'_, G>>,
    ) {
        matmul::backward_weight(
            s,
            dy.host(),
            x.host(),
            dw.host_mut(),
            dbias.map(ViewMut::host_mut),
            self,
        )
    }
    fn matmul_backward_input(
        &self,
        s: MatmulShape,
        dy: View<'_, S>,
        w: View<'_, S>,
        dx: ViewMut<'_, S>,
        dx_accum: Accum,
    ) {
        matmul::backward_input(s, dy.host(), w.host(), dx.host_mut(), dx_accum, self)
    }
    fn head_forward(
        &self,
        s: MatmulShape,
        x: View<'_, S>,
        w: View<'_, S>,
        logits: ViewMut<'_, f32>,
    ) {
        matmul::forward(
            s,
            x.host(),
            w.host(),
            None,
            logits.host_mut(),
            Accum::Overwrite,
            &self.head(),
        )
    }
    fn head_backward_weight(
        &self,
        s: MatmulShape,
        dlogits: View<'_, f32>,
        x: View<'_, S>,
        dw: ViewMut<'_, G>,
    ) {
        matmul::backward_weight(
            s,
            dlogits.host(),
            x.host(),
            dw.host_mut(),
            None,
            &self.head(),
        )
    }
    fn head_backward_input(
        &self,
        s: MatmulShape,
        dlogits: View<'_, f32>,
        w: View<'_, S>,
        dx: ViewMut<'_, S>,
    ) {
        matmul::backward_input(
            s,
            dlogits.host(),
            w.host(),
            dx.host_mut(),
            Accum::Overwrite,
            &self.head(),
        )
    }
    fn rmsnorm_forward(
        &self,
        s: NormShape,
        x: View<'_, S>,
        w: View<'_, S>,
        out: ViewMut<'_, S>,
        rstd: ViewMut<'_, f32>,
    ) {
        rmsnorm::forward(s, x.host(), w.host(), out.host_mut(), rstd.host_mut())
    }
    fn add_rmsnorm_forward(
        &self,
        s: NormShape,
        resid: ViewMut<'_, S>,
        x: View<'_, S>,
        w: View<'_, S>,
        out: ViewMut<'_, S>,
        rstd: ViewMut<'_, f32>,
    ) {
        // Two passes on the CPU, where the rows stay in cache between them.
        let resid = resid.host_mut();
        elementwise::add_inplace(resid, x.host());
        rmsnorm::forward(s, resid, w.host(), out.host_mut(), rstd.host_mut())
    }
    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: View<'_, S>,
        x: View<'_, S>,
        w: View<'_, S>,
        rstd: View<'_, f32>,
        dx: ViewMut<'_, S>,
        dx_accum: Accum,
        dw: ViewMut<'_, G>,
    ) {
        rmsnorm::backward(
            s,
            dy.host(),
            x.host(),
            w.host(),
            rstd.host(),
            dx.host_mut(),
            dx_accum,
            dw.host_mut(),
        )
    }
    fn rope_forward(&self, s: RopeShape, table: &RopeTable, x: ViewMut<'_, S>) {
        rope::forward(s, table, x.host_mut())
    }
    fn rope_backward(&self, s: RopeShape, table: &RopeTable, dx: ViewMut<'_, S>) {
        rope::backward(s, table, dx.host_mut())
    }
    fn attention_forward(
        &self,
        s: AttnShape,
        q: View<'_, S>,
        k: View<'_, S>,
        v: View<'_, S>,
        o: ViewMut<'_, S>,
        lse: ViewMut<'_, f32>,
    ) {
        attention::forward(
            s,
            q.host(),
            k.host(),
            v.host(),
            o.host_mut(),
            lse.host_mut(),
        )
    }
    fn attention_backward(
        &self,
        s: AttnShape,
        q: View<'_, S>,
        k: View<'_, S>,
        v: View<'_, S>,
        o: View<'_, S>,
        lse: View<'_, f32>,
        d_o: View<'_, S>,
        dq: ViewMut<'_, S>,
        dk: ViewMut<'_, S>,
        dv: ViewMut<'_, S>,
    ) {
        attention::backward(
            s,
            q.host(),
            k.host(),
            v.host(),
            o.host(),
            lse.host(),
            d_o.host(),
            dq.host_mut(),
            dk.host_mut(),
            dv.host_mut(),
        )
    }
    fn attention_forward_cached(
        &self,
        s: CachedAttnShape,
        q: View<'_, S>,
        k_cache: View<'_, S>,
        v_cache: View<'_, S>,
        o: ViewMut<'_, S>,
    ) {
        attention_cached::forward(s, q.host(), k_cache.host(), v_cache.host(), o.host_mut())
    }
    fn attention_forward_ring(
        &self,
        s: RingShape,
        q: View<'_, S>,
        k: View<'_, f32>,
        v: View<'_, f32>,
        o: ViewMut<'_, f32>,
        lse: ViewMut<'_, f32>,
        first: bool,
    ) {
        attention::forward_ring(
            s,
            q.host(),
            k.host(),
            v.host(),
            o.host_mut(),
            lse.host_mut(),
            first,
        )
    }
    fn attention_backward_ring(
        &self,
        s: RingShape,
        q: View<'_, S>,
        k: View<'_, f32>,
        v: View<'_, f32>,
        o: View<'_, S>,
        lse: View<'_, f32>,
        d_o: View<'_, S>,
        dq: ViewMut<'_, f32>,
        dk: ViewMut<'_, f32>,
        dv: ViewMut<'_, f32>,
    ) {
        attention::backward_ring(
            s,
            q.host(),
            k.host(),
            v.host(),
            o.host(),
            lse.host(),
            d_o.host(),
            dq.host_mut(),
            dk.host_mut(),
            dv.host_mut(),
        )
    }
    fn swiglu_forward(&self, gate: View<'_, S>, up: View<'_, S>, h: ViewMut<'_, S>) {
        swiglu::forward(gate.host(), up.host(), h.host_mut())
    }
    fn swiglu_backward(
        &self,
        dh: View<'_, S>,
        gate: View<'_, S>,
        up: View<'_, S>,
        dgate: ViewMut<'_, S>,
        dup: ViewMut<'_, S>,
    ) {
        swiglu::backward(
            dh.host(),
            gate.host(),
            up.host(),
            dgate.host_mut(),
            dup.host_mut(),
        )
    }
    fn router_forward(
        &self,
        s: RouteShape,
        logits: View<'_, f32>,
        weights: ViewMut<'_, f32>,
        index: ViewMut<'_, u32>,
        load: ViewMut<'_, f32>,
    ) {
        moe_routing::router_forward(
            s,
            logits.host(),
            weights.host_mut(),
            index.host_mut(),
            load.host_mut(),
        )
    }
    fn router_backward(
        &self,
        s: RouteShape,
        logits: View<'_, f32>,
        index: View<'_, u32>,
        dweights: View<'_, f32>,
        aux_dp: View<'_, f32>,
        dlogits: ViewMut<'_, f32>,
    ) {
        moe_routing::router_backward(
            s,
            logits.host(),
            index.host(),
            dweights.host(),
            aux_dp.host(),
            dlogits.host_mut(),
        )
    }
    fn permute(&self, s: RouteShape, index: View<'_, u32>, x: View<'_, S>, rows: ViewMut<'_, S>) {
        moe_routing::permute(s, index.host(), x.host(), rows.host_mut())
    }
    fn unpermute(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        weights: Option<View<'_, f32>>,
        rows: View<'_, S>,
        y: ViewMut<'_, S>,
        accum: Accum,
    ) {
        moe_routing::unpermute(
            s,
            index.host(),
            weights.map(View::host),
            rows.host(),
            y.host_mut(),
            accum,
        )
    }
    fn scale_rows(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        weights: View<'_, f32>,
        rows: ViewMut<'_, S>,
    ) {
        moe_routing::scale_rows(s, index.host(), weights.host(), rows.host_mut())
    }
    fn row_dot(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        a: View<'_, S>,
        b: View<'_, S>,
        out: ViewMut<'_, f32>,
    ) {
        moe_routing::row_dot(s, index.host(), a.host(), b.host(), out.host_mut())
    }
    fn gather_copies(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        values: View<'_, f32>,
        rows: ViewMut<'_, f32>,
    ) {
        moe_routing::gather_copies(s, index.host(), values.host(), rows.host_mut())
    }
    fn scatter_copies(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        rows: View<'_, f32>,
        values: ViewMut<'_, f32>,
    ) {
        moe_routing::scatter_copies(s, index.host(), rows.host(), values.host_mut())
    }
    fn scale_each_row(&self, width: usize, weights: View<'_, f32>, rows: ViewMut<'_, S>) {
        moe_routing::scale_each_row(width, weights.host(), rows.host_mut())
    }
    fn dot_each_row(&self, width: usize, a: View<'_, S>, b: View<'_, S>, out: ViewMut<'_, f32>) {
        moe_routing::dot_each_row(width, a.host(), b.host(), out.host_mut())
    }
    fn embedding_forward(
        &self,
        tokens: View<'_, u32>,
        wte: View<'_, S>,
        c: usize,
        out: ViewMut<'_, S>,
    ) {
        embedding::forward(tokens.host(), wte.host(), c, out.host_mut())
    }
    fn embedding_backward(
        &self,
        tokens: View<'_, u32>,
        dout: View<'_, S>,
        c: usize,
        dwte: ViewMut<'_, G>,
    ) {
        embedding::backward(tokens.host(), dout.host(), c, dwte.host_mut())
    }
    fn embedding_forward_shard(
        &self,
        tokens: View<'_, u32>,
        wte: View<'_, S>,
        c: usize,
        first: usize,
        out: ViewMut<'_, S>,
    ) {
        embedding::forward_shard(tokens.host(), wte.host(), c, first, out.host_mut())
    }
    fn embedding_backward_shard(
        &self,
        tokens: View<'_, u32>,
        dout: View<'_, S>,
        c: usize,
        first: usize,
        dwte: ViewMut<'_, G>,
    ) {
        embedding::backward_shard(tokens.host(), dout.host(), c, first, dwte.host_mut())
    }
    fn add(&self, a: View<'_, S>, b: View<'_, S>, out: ViewMut<'_, S>) {
        elementwise::add(a.host(), b.host(), out.host_mut())
    }
    fn add_inplace(&self, acc: ViewMut<'_, S>, x: View<'_, S>) {
        elementwise::add_inplace(acc.host_mut(), x.host())
    }
    fn copy(&self, src: View<'_, S>, dst: ViewMut<'_, S>) {
        elementwise::copy(src.host(), dst.host_mut())
    }
    fn scale(&self, x: ViewMut<'_, G>, s: f32) {
        elementwise::scale(x.host_mut(), s)
    }
    fn sum_squares(&self, x: View<'_, G>) -> f64 {
        elementwise::sum_squares(x.host())
    }
    fn sum_squares_weighted(&self, parts: Weighted<'_, '_, G>) -> f64 {
        parts
            .map(|(x, w)| w * elementwise::sum_squares(x.host()))
            .sum()
    }
    fn round_params(&self, src: View<'_, f32>, dst: ViewMut<'_, S>) {
        elementwise::round_into(src.host(), dst.host_mut())
    }
    fn widen(&self, src: View<'_, S>, dst: ViewMut<'_, f32>) {
        elementwise::widen_into(src.host(), dst.host_mut())
    }
    fn narrow(&self, src: View<'_, f32>, dst: ViewMut<'_, S>) {
        elementwise::round_into(src.host(), dst.host_mut())
    }
    fn count_targets(&self, targets: View<'_, u32>, vocab: usize) -> usize {
        targets
            .host()
            .iter()
            .filter(|&&t| (t as usize) < vocab)
            .count()
    }
    fn cross_entropy(
        &self,
        s: CeShape,
        logits: ViewMut<'_, f32>,
        targets: View<'_, u32>,
        losses: ViewMut<'_, f32>,
        dlogits_scale: Option<f32>,
    ) -> f64 {
        cross_entropy::cross_entropy(
            s,
            logits.host_mut(),
            targets.host(),
            losses.host_mut(),
            dlogits_scale,
        )
    }
    fn ce_shard_stats(
        &self,
        s: CeShardShape,
        logits: ViewMut<'_, f32>,
        targets: View<'_, u32>,
        stats: ViewMut<'_, f32>,
        keep_exp: bool,
    ) {
        vocab_parallel_ce::stats(
            s,
            logits.host_mut(),
            targets.host(),
            stats.host_mut(),
            keep_exp,
        )
    }
    fn ce_shard_finish(
        &self,
        s: CeShardShape,
        logits: ViewMut<'_, f32>,
        targets: View<'_, u32>,
        all: View<'_, f32>,
        rank: usize,
        losses: ViewMut<'_, f32>,
        dlogits_scale: Option<f32>,
    ) -> f64 {
        vocab_parallel_ce::finish(
            s,
            logits.host_mut(),
            targets.host(),
            all.host(),
            rank,
            losses.host_mut(),
            dlogits_scale,
        )
    }
    fn adamw_step(
        &self,
        h: AdamWParams,
        master: ViewMut<'_, f32>,
        grads: View<'_, G>,
        m: ViewMut<'_, f32>,
        v: ViewMut<'_, f32>,
        params: Option<(ViewMut<'_, S>, Rounding)>,
    ) {
        adamw::step(
            h,
            master.host_mut(),
            grads.host(),
            m.host_mut(),
            v.host_mut(),
            params.map(|(v, r)| (v.host_mut(), r)),
        )
    }
}
