//! Llama-family decoder (HF `LlamaForCausalLM` / `Qwen2ForCausalLM` semantics), forward and
//! backward written out top to bottom, llm.c style.
//!
//! Per layer, with N = B·T tokens:
//! ```text
//! x ─ rmsnorm(ln1) ─ q,k,v proj (+bias) ─ RoPE(q,k) ─ causal GQA attention ─ o_proj ─(+x)─ resid_mid
//! resid_mid ─ rmsnorm(ln2) ─ gate,up proj ─ silu(gate)·up ─ down_proj ─(+resid_mid)─ next x
//! ```
//! Each residual add comes after its projection is complete (where tensor parallelism
//! all-reduces the row-parallel partial sums); the attention block's is fused with the norm
//! that reads it (`add_rmsnorm_forward`). Then `model.norm` and the LM head. Activations are the named buffers of the memory plan
//! (`act.layers.{i}.<name>`, `act.final_norm.*`, `act.logits_chunk`, `act.losses`, and the
//! backward scratch `grad.act.*`), requested from a [`BufferPool`] when first written and
//! returned as soon as the backward has consumed them. Under a recompute policy
//! ([`super::recompute`]) the tensors it drops live in the shared `recompute.*` workspace: during
//! the forward until the layer's output exists, and again during the layer's backward, rebuilt.
//!
//! The LM head is fused llm.c style: during the training forward each chunk of
//! `ce_chunk_tokens` rows goes matmul → softmax/cross-entropy (gradient written in place into
//! the logits chunk) → `dW_lm += dlogitsᵀ·h` → `dh = dlogits·W_lm`, and `dh` overwrites the
//! chunk of `act.final_norm.out` it came from (that chunk is dead once `dW_lm` has used it).
//! So full-batch logits never exist and the head matmul is not recomputed in the backward;
//! the price is that the training forward already accumulates into the LM-head gradient and
//! needs the global number of target tokens up front.

use super::activations::{Activations, BatchShape, GradScratch, LayerActs, LossSum};
use super::buffers::{Boundary, Buf, BufName, BufferPool};
use super::config::LlamaConfig;
use super::grad_buf::{GradBuf, Whole};
use super::kv_cache::KvCache;
use super::param_buf::{ParamBuf, ParamSource, Unit, WholeParams};
use super::params::{LayerIdx, ParamTable};
use super::recompute::{dropped, layer_tensors, Recompute};
use super::stages::{GradsDone, HeadActs};
use super::tensor_parallel::TensorParallel;
use crate::dtype::Elem;
use crate::kernels::{
    Accum, AsView, AsViewMut, AttnShape, CeShape, CeShardShape, Kernels, MatmulShape, NormShape,
    RopeShape, RopeTable, View, ViewMut,
};
use ferrotron_plan::activations::{table_dims, TableRank};
use ferrotron_plan::tensors::{self, Edge, LayerTensor as T};
use ferrotron_plan::ModelSpec;
use std::ops::Range;

/// Default rows per LM-head / cross-entropy chunk.
pub const DEFAULT_CE_CHUNK_TOKENS: usize = 1024;

/// A Llama-family model: configuration, tensor table and RoPE tables. Parameters, gradients
/// and activations live outside, so one `Llama` serves any number of replicas / micro-batches.
#[derive(Clone, Debug)]
pub struct Llama {
    pub config: LlamaConfig,
    pub params: ParamTable,
    pub rope: RopeTable,
    /// Rows per LM-head chunk (`act.logits_chunk` is `[min(N, ce_chunk_tokens), V]`).
    pub ce_chunk_tokens: usize,
    /// Which layer activations the training forward keeps (see [`super::recompute`]).
    pub recompute: Recompute,
    /// This rank's tensor-parallel group (`config` is then its slice of the model).
    pub tp: Option<TensorParallel>,
    /// This rank's pipeline stage (`params` then holds only its part: `super::pipeline`).
    pub stage: Option<super::pipeline::Stage>,
    /// How a pipeline stage's parameters map onto the whole model's (without tensor
    /// parallelism, whose group keeps the map).
    pub part: Option<super::pipeline::Part>,
    /// A MoE model's load-balancing statistics of the micro-batch in flight.
    pub(super) router_load: super::moe::RouterLoad,
    /// The hot path's own host containers, reused from micro-batch to micro-batch.
    pub(super) spares: super::spares::Spares,
    /// This rank's expert-parallel group (`params` then holds only its experts).
    pub ep: Option<super::expert_parallel::ExpertParallel>,
    /// A MoE model's capacity factor (`None`: exact routing; see `super::moe`).
    pub capacity_factor: Option<f64>,
    /// This rank's context-parallel group (attention runs as a ring, `rope` is turned to the
    /// rank's tokens: `super::context_parallel`).
    pub cp: Option<super::context_parallel::ContextParallel>,
    /// The whole model as the planner describes it, made once: the table's sizes of every
    /// buffer come from it through the planner's own function ([`Self::dims`]).
    spec: ModelSpec,
}

/// `matmul_backward_weight` with an optional bias grad living in the same flat buffer.
fn weight_grad<S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    s: MatmulShape,
    dy: View<'_, S>,
    x: View<'_, S>,
    grads: &mut dyn GradBuf<G>,
    w: &Range<usize>,
    b: &Option<Range<usize>>,
) {
    match b {
        Some(b) => {
            let (dw, db) = grads.pair_mut(w.clone(), b.clone());
            k.matmul_backward_weight(s, dy, x, dw, Some(db));
        }
        None => k.matmul_backward_weight(s, dy, x, grads.slice_mut(w.clone()), None),
    }
}

/// The input gradient of products that read one input (q, k and v; gate and up): the sum of
/// each product's `dy·W`, written by the first and added by the rest, in order.
pub(super) fn shared_input_grad<S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    parts: &[(MatmulShape, View<'_, S>, View<'_, S>)],
    mut dx: ViewMut<'_, S>,
) {
    for (i, &(s, dy, w)) in parts.iter().enumerate() {
        let acc = if i == 0 { Accum::Overwrite } else { Accum::Add };
        k.matmul_backward_input(s, dy, w, dx.rb(), acc);
    }
}

fn opt<'a, S>(params: &'a dyn ParamBuf<S>, r: &Option<Range<usize>>) -> Option<View<'a, S>> {
    r.as_ref().map(|r| params.slice(r.clone()))
}

impl Llama {
    /// The model with its RoPE table: ready to run.
    pub fn new(config: LlamaConfig) -> Self {
        Self::tables(config).with_rope()
    }

    /// `self` with its RoPE table built ([`Self::build_rope`]).
    pub fn with_rope(mut self) -> Self {
        self.build_rope();
        self
    }

    /// The model's tables (its parameter table, the planner's description) without its one
    /// buffer, the RoPE table, which [`Self::build_rope`] makes. A trainer builds the tables,
    /// takes its memory baseline, then builds the table the memory plan lists (`rope.cos`,
    /// `rope.sin`): what it measures is then the plan's buffers and not the process's tables.
    pub fn tables(config: LlamaConfig) -> Self {
        config.validate().expect("invalid LlamaConfig");
        let params = ParamTable::new(&config);
        // Not built yet: no positions, nothing allocated.
        let rope = RopeTable {
            head_dim: config.head_dim,
            max_pos: config.max_pos,
            cos: Vec::new(),
            sin: Vec::new(),
        };
        let spec = config.spec();
        Llama {
            spec,
            config,
            params,
            rope,
            ce_chunk_tokens: DEFAULT_CE_CHUNK_TOKENS,
            recompute: Recompute::None,
            tp: None,
            stage: None,
            part: None,
            router_load: Default::default(),
            spares: Default::default(),
            ep: None,
            cp: None,
            capacity_factor: None,
        }
    }

    /// Builds the RoPE table (turned to this rank's tokens under context parallelism), unless
    /// it is built: a GPU backend keys its device copy by the table's address, so a table once
    /// uploaded is never replaced.
    pub fn build_rope(&mut self) {
        if self.rope_built() {
            return;
        }
        let c = &self.config;
        let full = RopeTable::new(c.head_dim, c.max_pos, c.rope_theta);
        self.rope = match &self.cp {
            Some(cp) => cp.rope(&full, cp.tokens),
            None => full,
        };
    }

    /// Whether [`Self::build_rope`] has run (a model without positions has nothing to build).
    pub fn rope_built(&self) -> bool {
        !self.rope.cos.is_empty() || self.config.max_pos == 0
    }

    /// The RoPE table the attention reads; a model run before [`Self::build_rope`] is a bug of
    /// its builder, said here rather than as an index out of bounds in a kernel.
    fn rope_table(&self) -> &RopeTable {
        assert!(
            self.rope_built(),
            "internal: the model's RoPE table is not built (Llama::build_rope)"
        );
        &self.rope
    }

    /// One rank of an expert-parallel group: the whole model but only its experts
    /// (`super::expert_parallel`); its tables only, as [`Self::tables`].
    pub fn expert_parallel(
        config: LlamaConfig,
        ep: super::expert_parallel::ExpertParallel,
    ) -> Self {
        let mut m = Llama::tables(config);
        let local = ep.local();
        let held = &|e: u64| local.contains(&(e as usize));
        m.params = ParamTable::holding_experts(&m.config, &|_| true, held);
        if ep.size > 1 {
            // How its parameters map onto the whole model's (checkpoints, the first weights).
            let whole = ParamTable::new(&m.config);
            let pieces = super::tensor_parallel::shard_pieces(&whole, &m.params, 0);
            m.part = Some(super::pipeline::Part { whole, pieces });
        }
        m.ep = (ep.size > 1).then_some(ep);
        m
    }

    /// One rank's part of a tensor-parallel model (`super::tensor_parallel`): its slice of the
    /// config, parameters of the slice's shapes, and the group's collectives; its tables only,
    /// as [`Self::tables`].
    pub fn tensor_parallel(tp: TensorParallel) -> Result<Self, super::ModelError> {
        let local = super::tensor_parallel::shard_config(&tp.full, tp.size)?;
        let mut m = Llama::tables(local);
        m.spec = tp.full.spec();
        m.tp = (tp.size > 1).then_some(tp);
        Ok(m)
    }

    /// The whole model's config (this rank's `config` is a slice of it under tensor
    /// parallelism).
    pub fn full_config(&self) -> &LlamaConfig {
        self.tp.as_ref().map_or(&self.config, |t| &t.full)
    }

    /// Sums a row-parallel product's partial result over the tensor-parallel group (nothing
    /// on one rank).
    pub(super) fn tp_sum<S: Elem>(&self, buf: ViewMut<'_, S>) {
        if let Some(tp) = &self.tp {
            tp.sum(buf);
        }
    }

    /// The group, when sequence parallelism divides the residual stream.
    pub(super) fn sp(&self) -> Option<&TensorParallel> {
        self.tp.as_ref().filter(|t| t.sp)
    }

    /// Rows of the residual stream (and the norms) this rank holds of `n` tokens.
    pub(super) fn rows(&self, n: usize) -> usize {
        self.sp().map_or(n, |t| n / t.size)
    }

    /// Under sequence parallelism, the `[n, C]` scratch every gather and reduce-scatter of a
    /// micro-batch passes through (`act.sp.full`), one use at a time.
    pub(super) fn sp_full<S: Elem>(&self, pool: &mut dyn BufferPool, n: usize) -> Option<Buf<S>> {
        self.sp()
            .map(|_| self.buf(pool, BufName::Edge(Edge::SpFull), n))
    }

    pub(super) fn free_sp_full<S: Elem>(&self, pool: &mut dyn BufferPool, full: Option<Buf<S>>) {
        if let Some(f) = full {
            pool.free(BufName::Edge(Edge::SpFull), f);
        }
    }

    /// The input of a column-parallel product: this rank's rows gathered from the group
    /// into `full` under sequence parallelism, else `local` itself.
    pub(super) fn gathered_rows<'a, S: Elem>(
        &self,
        local: View<'a, S>,
        full: Option<&'a mut Buf<S>>,
    ) -> View<'a, S> {
        match (self.sp(), full) {
            (Some(tp), Some(f)) => {
                tp.gather_rows(local, f.view_mut());
                f.view()
            }
            _ => local,
        }
    }

    /// A row-parallel product into `out` (this rank's rows of the residual stream): under
    /// sequence parallelism computed into `full` and reduce-scattered, else computed in place
    /// and all-reduced (Megatron's `g`).
    fn row_parallel<S: Elem>(
        &self,
        full: Option<&mut Buf<S>>,
        mut out: ViewMut<'_, S>,
        product: impl FnOnce(ViewMut<'_, S>),
    ) {
        match (self.sp(), full) {
            (Some(tp), Some(f)) => {
                product(f.view_mut());
                tp.scatter_rows(f.view(), out);
            }
            _ => {
                product(out.rb());
                self.tp_sum(out);
            }
        }
    }

    /// `out = x·Wᵀ + resid`: a row-parallel projection (down_proj) into this rank's rows
    /// of the residual stream, then the residual added as its own step, once the projection's
    /// partial sums are complete (added before them, it would count tp times).
    #[allow(clippy::too_many_arguments)]
    fn projection_residual<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        full: Option<&mut Buf<S>>,
        s: MatmulShape,
        x: View<'_, S>,
        w: View<'_, S>,
        resid: View<'_, S>,
        mut out: ViewMut<'_, S>,
    ) {
        self.row_parallel(full, out.rb(), |y| {
            k.matmul_forward(s, x, w, None, y, Accum::Overwrite)
        });
        k.add_inplace(out, resid);
    }

    /// The gradient of a column-parallel block's input, `partial` over the group: summed in
    /// place, or under sequence parallelism reduce-scattered into the first rows of `full`.
    fn input_grad<'a, S: Elem>(
        &self,
        mut partial: ViewMut<'a, S>,
        full: Option<&'a mut Buf<S>>,
        rows: usize,
    ) -> View<'a, S> {
        match (self.sp(), full) {
            (Some(tp), Some(f)) => {
                let mut local = f.view_mut().slice_mut(..rows * self.config.hidden);
                tp.scatter_rows(partial.as_view(), local.rb());
                local.into_view()
            }
            _ => {
                self.tp_sum(partial.rb());
                partial.into_view()
            }
        }
    }

    pub fn with_recompute(mut self, recompute: Recompute) -> Self {
        self.recompute = recompute;
        self
    }

    /// Buffer of layer `i`'s tensor `t`: `act.layers.{i}.<t>` when the policy keeps it, else
    /// the shared workspace `recompute.<t>`.
    pub(super) fn slot(&self, i: usize, t: T) -> BufName {
        BufName::of_layer(i, t, self.recompute)
    }

    /// The table's sizes (`ferrotron_plan::tensors`) for `tokens` tokens on this one rank, made
    /// by the planner's [`table_dims`] from the whole model's spec, as the plan makes them.
    fn dims(&self, tokens: usize) -> tensors::Dims {
        let rank = TableRank {
            tokens: tokens as u64,
            tp: self.tp.as_ref().map_or(1, |t| t.size as u64),
            sp: self.sp().is_some(),
            ep: self.ep.as_ref().map_or(1, |e| e.size) as u64,
            capacity_factor: self.capacity_factor,
            ce_chunk_tokens: self.ce_chunk_tokens as u64,
        };
        table_dims(&self.spec, &rank, self.config.moe.is_some())
    }

    /// With a capacity factor (a MoE model): each expert takes at most ⌈cf · tokens · top_k /
    /// E⌉ of a micro-batch's copies, the rest are dropped.
    pub fn with_capacity_factor(mut self, cf: Option<f64>) -> Self {
        self.capacity_factor = cf;
        self
    }

    /// Elements of buffer `name` for `tokens` tokens, as the table gives them.
    pub fn len(&self, name: BufName, tokens: usize) -> usize {
        name.shape().numel(&self.dims(tokens)) as usize
    }

    /// Buffer `name` for `tokens` tokens, from the pool.
    pub(super) fn buf<X: super::buffers::Plain>(
        &self,
        pool: &mut dyn BufferPool,
        name: BufName,
        tokens: usize,
    ) -> Buf<X> {
        pool.alloc(name, self.len(name, tokens))
    }

    pub fn with_ce_chunk_tokens(mut self, rows: usize) -> Self {
        assert!(rows > 0, "ce_chunk_tokens must be positive");
        self.ce_chunk_tokens = rows;
        self
    }

    /// Number of parameters (length of the flat parameter and gradient buffers).
    pub fn num_params(&self) -> usize {
        self.params.total
    }

    fn check_params<S>(&self, params: &[S]) {
        assert_eq!(params.len(), self.params.total, "params buffer length");
    }

    fn check_batch(&self, batch: BatchShape, tokens: &(impl AsView<u32> + ?Sized)) {
        assert_eq!(tokens.view().len(), batch.n(), "tokens must hold B·T ids");
        if let Some(tp) = self.sp() {
            assert!(
                batch.n().is_multiple_of(tp.size),
                "sequence parallelism splits B·T = {} tokens over {} ranks",
                batch.n(),
                tp.size
            );
        }
        assert!(
            batch.t <= self.config.max_pos,
            "sequence length {} exceeds max_position_embeddings {}",
            batch.t,
            self.config.max_pos
        );
    }

    pub(super) fn norm(&self, n: usize) -> NormShape {
        NormShape {
            n,
            c: self.config.hidden,
            eps: self.config.rms_eps,
        }
    }

    /// Name of the buffer that receives layer `i`'s output.
    pub(super) fn output_name(&self, i: usize) -> BufName {
        if i + 1 < self.config.layers {
            BufName::Layer(i as u32 + 1, T::Input)
        } else {
            BufName::Edge(Edge::FinalNormInput)
        }
    }

    /// One decoder layer; returns its saved activations (the dropped ones already returned to
    /// the pool) and its output (the next residual).
    pub(super) fn layer_forward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        i: usize,
        batch: BatchShape,
        input: Buf<S>,
    ) -> (LayerActs<S>, Buf<S>) {
        self.layer_forward_over(k, pool, params, i, batch, input, None)
    }

    /// [`Llama::layer_forward`], attending over a KV cache when given one.
    #[allow(clippy::too_many_arguments)]
    fn layer_forward_over<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        i: usize,
        batch: BatchShape,
        input: Buf<S>,
        cache: Option<&mut KvCache<S>>,
    ) -> (LayerActs<S>, Buf<S>) {
        let (mut acts, out) = self.layer_body(k, pool, params, i, batch, input, true, cache);
        pool.boundary(Boundary::Forward { layer: i as u32 });
        // The workspace of the dropped tensors goes once the output exists.
        for field in dropped(self.recompute, self.config.moe.is_some()) {
            acts.release(field, pool, self.slot(i, field));
        }
        (acts, out.expect("layer output"))
    }

    /// The layer's forward computation. Every tensor goes to its [`Llama::slot`]. With
    /// `output = false` (the replay of full recomputation) the output projection into the
    /// residual stream is skipped: the backward needs every tensor but the output. With a KV
    /// cache (inference) the tokens sit at the positions after the cached ones and attend over
    /// those too; `attn_lse` is then left unwritten (nothing reads it without a backward).
    #[allow(clippy::too_many_arguments)]
    fn layer_body<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        i: usize,
        batch: BatchShape,
        input: Buf<S>,
        output: bool,
        cache: Option<&mut KvCache<S>>,
    ) -> (LayerActs<S>, Option<Buf<S>>) {
        let cfg = &self.config;
        let li: &LayerIdx = &self.params.layers[i];
        let (n, c, f) = (batch.n(), cfg.hidden, cfg.intermediate);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let name = |t| self.slot(i, t);
        let p = |r: &Range<usize>| params.slice(r.clone());
        let lin = |inf, outf| MatmulShape {
            n,
            in_features: inf,
            out_features: outf,
            ragged: false,
        };

        // ---- attention block ----
        // Under sequence parallelism the norms run on this rank's rows and their outputs are
        // gathered for the column-parallel products (Korthikanti et al. 2022 §4.2.2).
        let nl = self.rows(n);
        let mut full = self.sp_full::<S>(pool, n);
        let mut ln1_rstd = self.buf(pool, name(T::Ln1Rstd), n);
        let mut ln1_out = self.buf(pool, name(T::Ln1Out), n);
        k.rmsnorm_forward(
            self.norm(nl),
            input.view(),
            p(&li.ln1),
            ln1_out.view_mut(),
            ln1_rstd.view_mut(),
        );
        let x1 = self.gathered_rows(ln1_out.view(), full.as_mut());
        let mut q = self.buf(pool, name(T::Q), n);
        k.matmul_forward(
            lin(c, qd),
            x1,
            p(&li.wq),
            opt(params, &li.bq),
            q.view_mut(),
            Accum::Overwrite,
        );
        let mut kk = self.buf(pool, name(T::K), n);
        k.matmul_forward(
            lin(c, kvd),
            x1,
            p(&li.wk),
            opt(params, &li.bk),
            kk.view_mut(),
            Accum::Overwrite,
        );
        let mut v = self.buf(pool, name(T::V), n);
        k.matmul_forward(
            lin(c, kvd),
            x1,
            p(&li.wv),
            opt(params, &li.bv),
            v.view_mut(),
            Accum::Overwrite,
        );
        let rs = |heads| RopeShape {
            b: batch.b,
            t: batch.t,
            heads,
            head_dim: cfg.head_dim,
        };
        let rope = match cache.as_deref() {
            Some(c) => c.rope(),
            None => self.rope_table(),
        };
        k.rope_forward(rs(cfg.heads), rope, q.view_mut());
        k.rope_forward(rs(cfg.kv_heads), rope, kk.view_mut());
        let ashape = self.attn_shape(batch);
        let mut attn_lse = self.buf(pool, name(T::AttnLse), n);
        let mut attn_out = self.buf(pool, name(T::AttnOut), n);
        let qkv = (q.view(), kk.view(), v.view());
        match cache {
            None => self.attention(
                k,
                pool,
                ashape,
                qkv,
                attn_out.view_mut(),
                attn_lse.view_mut(),
            ),
            Some(c) => c.attend(k, i, ashape, qkv.0, qkv.1, qkv.2, attn_out.view_mut()),
        }
        // resid_mid = attn_out·Woᵀ, then + input: the residual add comes after the projection
        // is complete, because a row-parallel o_proj (tensor parallelism) must all-reduce its
        // partial sums between the two (added in the product, the residual would count tp
        // times). The add is fused instead with the MLP block's norm, which reads its sum.
        let mut resid_mid = self.buf(pool, name(T::ResidMid), n);
        let (o, wo) = (attn_out.view(), p(&li.wo));
        self.row_parallel(full.as_mut(), resid_mid.view_mut(), |y| {
            k.matmul_forward(lin(qd, c), o, wo, None, y, Accum::Overwrite)
        });

        // ---- MLP block ----
        let mut ln2_rstd = self.buf(pool, name(T::Ln2Rstd), n);
        let mut ln2_out = self.buf(pool, name(T::Ln2Out), n);
        k.add_rmsnorm_forward(
            self.norm(nl),
            resid_mid.view_mut(),
            input.view(),
            p(&li.ln2),
            ln2_out.view_mut(),
            ln2_rstd.view_mut(),
        );
        if self.config.moe.is_some() {
            let mut acts = LayerActs {
                input,
                ln1_rstd,
                ln1_out,
                q,
                k: kk,
                v,
                attn_lse,
                attn_out,
                resid_mid,
                ln2_rstd,
                ..LayerActs::default()
            };
            let out = self.moe_forward(k, pool, params, i, n, ln2_out.view(), &mut acts, output);
            acts.ln2_out = ln2_out;
            self.free_sp_full(pool, full);
            return (acts, out);
        }
        let x2 = self.gathered_rows(ln2_out.view(), full.as_mut());
        let mut gate = self.buf(pool, name(T::Gate), n);
        k.matmul_forward(
            lin(c, f),
            x2,
            p(&li.wg),
            None,
            gate.view_mut(),
            Accum::Overwrite,
        );
        let mut up = self.buf(pool, name(T::Up), n);
        k.matmul_forward(
            lin(c, f),
            x2,
            p(&li.wu),
            None,
            up.view_mut(),
            Accum::Overwrite,
        );
        let mut swiglu = self.buf(pool, name(T::Swiglu), n);
        k.swiglu_forward(gate.view(), up.view(), swiglu.view_mut());
        let out = output.then(|| {
            // out = swiglu·Wdᵀ, then + resid_mid (explicit, as for o_proj above).
            let mut out = self.buf(pool, self.output_name(i), n);
            let (h, wd, resid) = (swiglu.view(), p(&li.wd), resid_mid.view());
            self.projection_residual(k, full.as_mut(), lin(f, c), h, wd, resid, out.view_mut());
            out
        });
        self.free_sp_full(pool, full);

        let acts = LayerActs {
            input,
            ln1_rstd,
            ln1_out,
            q,
            k: kk,
            v,
            attn_lse,
            attn_out,
            resid_mid,
            ln2_rstd,
            ln2_out,
            gate,
            up,
            swiglu,
            ..LayerActs::default()
        };
        (acts, out)
    }

    fn attn_shape(&self, batch: BatchShape) -> AttnShape {
        AttnShape {
            b: batch.b,
            t: batch.t,
            heads: self.config.heads,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Returns every kept buffer of a layer to the pool (used by the no-grad forwards).
    fn free_layer<S: Elem>(&self, pool: &mut dyn BufferPool, i: usize, mut a: LayerActs<S>) {
        let moe = self.config.moe.is_some();
        for t in layer_tensors(moe).filter(|t| t.kept_by(self.recompute)) {
            a.release(t, pool, BufName::Layer(i as u32, t));
        }
    }

    /// Rebuilds the tensors the policy dropped from layer `i`'s activations, into the
    /// `recompute.*` workspace, at the start of the layer's backward (allocated in
    /// table order, as the plan does). Same kernels on the same inputs as the
    /// forward, so the same bits.
    pub(super) fn rebuild<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        i: usize,
        batch: BatchShape,
        a: LayerActs<S>,
    ) -> LayerActs<S> {
        match self.recompute {
            Recompute::None => a,
            Recompute::Full => {
                self.layer_body(k, pool, params, i, batch, a.input, false, None)
                    .0
            }
            Recompute::Selective => {
                let mut a = a;
                let li: &LayerIdx = &self.params.layers[i];
                let n = batch.n();
                let p = |r: &Range<usize>| params.slice(r.clone());
                // The norm kernel recomputes rstd along with the output; it rewrites the kept
                // rstd with the same value (same input, same reduction order).
                a.ln1_out = self.buf(pool, self.slot(i, T::Ln1Out), n);
                k.rmsnorm_forward(
                    self.norm(self.rows(n)),
                    a.input.view(),
                    p(&li.ln1),
                    a.ln1_out.view_mut(),
                    a.ln1_rstd.view_mut(),
                );
                a.ln2_out = self.buf(pool, self.slot(i, T::Ln2Out), n);
                k.rmsnorm_forward(
                    self.norm(self.rows(n)),
                    a.resid_mid.view(),
                    p(&li.ln2),
                    a.ln2_out.view_mut(),
                    a.ln2_rstd.view_mut(),
                );
                // The gated product of the rows in use (a MoE layer's routed buffers have
                // room for the most its experts can receive).
                let used = match self.config.moe {
                    Some(_) => {
                        self.rebuild_expert_in(k, pool, i, n, &mut a);
                        self.routed_used(a.router_index.view())
                    }
                    None => a.gate.len(),
                };
                a.swiglu = self.buf(pool, self.slot(i, T::Swiglu), n);
                k.swiglu_forward(
                    a.gate.view().slice(..used),
                    a.up.view().slice(..used),
                    a.swiglu.view_mut().slice_mut(..used),
                );
                a
            }
        }
    }

    /// Final norm + chunked LM head + cross-entropy. With `grad = Some((grads, scale))` the
    /// head's backward is fused in (see module docs) and `out` ends up holding its gradient.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        final_input: &Buf<S>,
        targets: &(impl AsView<u32> + ?Sized),
        mut grad: Option<(&mut dyn GradBuf<G>, f32)>,
    ) -> (Buf<f32>, Buf<S>, LossSum) {
        let (c, vocab) = (self.config.hidden, self.config.vocab);
        let n = targets.view().len();
        let (rstd_name, out_name) = (
            BufName::Edge(Edge::FinalNormRstd),
            BufName::Edge(Edge::FinalNormOut),
        );
        let mut rstd = self.buf(pool, rstd_name, n);
        let mut out = self.buf(pool, out_name, n);
        let w_norm = params.slice(self.params.norm.clone());
        let final_input = final_input.view();
        // Under sequence parallelism the final norm runs on this rank's rows, gathered for the
        // vocabulary-parallel head, which runs on every token.
        let nl = self.rows(n);
        let mut full = self.sp_full::<S>(pool, n);
        match (self.sp(), full.as_mut()) {
            (Some(tp), Some(f)) => {
                let mut local = f.view_mut().slice_mut(..nl * c);
                let norm = self.norm(nl);
                k.rmsnorm_forward(norm, final_input, w_norm, local.rb(), rstd.view_mut());
                tp.gather_rows(local.as_view(), out.view_mut());
            }
            _ => {
                let norm = self.norm(n);
                k.rmsnorm_forward(norm, final_input, w_norm, out.view_mut(), rstd.view_mut())
            }
        }
        let w_lm = params.slice(self.params.lm_head.clone());
        let chunk = n.min(self.ce_chunk_tokens);
        let (logits_name, losses_name) = (
            BufName::Edge(Edge::LogitsChunk),
            BufName::Edge(Edge::Losses),
        );
        let mut logits = self.buf(pool, logits_name, n);
        let mut losses = self.buf(pool, losses_name, n);
        let stats_name = BufName::Edge(Edge::CeStats);
        let mut stats = self
            .tp
            .as_ref()
            .map(|_| self.buf::<f32>(pool, stats_name, n));
        let mut total = 0.0f64;
        let mut r0 = 0;
        while r0 < n {
            let rows = chunk.min(n - r0);
            let s = MatmulShape {
                n: rows,
                in_features: c,
                out_features: vocab,
                ragged: false,
            };
            let mut h = out.view_mut().slice_mut(r0 * c..(r0 + rows) * c);
            let mut lg = logits.view_mut().slice_mut(..rows * vocab);
            k.head_forward(s, h.as_view(), w_lm, lg.rb());
            let scale = grad.as_ref().map(|g| g.1);
            let t = targets.view().slice(r0..r0 + rows);
            let l = losses.view_mut().slice_mut(r0..r0 + rows);
            total += match (&self.tp, stats.as_mut()) {
                (Some(tp), Some(st)) => {
                    // Vocabulary-parallel: this rank's three statistics per row, then every
                    // rank's (`act.ce_stats` holds both: [chunk, 3] then [tp, rows, 3]).
                    let ce = CeShardShape {
                        rows,
                        vocab,
                        first: tp.vocab_first(),
                        full_vocab: tp.full.vocab,
                    };
                    let (mine, all) = st.view_mut().split_at_mut(3 * chunk);
                    let (mut mine, mut all) = (
                        mine.slice_mut(..3 * rows),
                        all.slice_mut(..3 * rows * tp.size),
                    );
                    k.ce_shard_stats(ce, lg.rb(), t, mine.rb(), scale.is_some());
                    tp.gather_rows(mine.as_view(), all.rb());
                    k.ce_shard_finish(ce, lg.rb(), t, all.as_view(), tp.rank, l, scale)
                }
                _ => k.cross_entropy(CeShape { rows, vocab }, lg.rb(), t, l, scale),
            };
            if let Some((grads, _)) = grad.as_mut() {
                let dw = grads.slice_mut(self.params.lm_head.clone());
                k.head_backward_weight(s, lg.as_view(), h.as_view(), dw);
                k.head_backward_input(s, lg.as_view(), w_lm, h.rb());
                // The vocabulary-parallel head's input gradient is partial: summed chunk by
                // chunk, or under sequence parallelism reduce-scattered once below.
                if self.sp().is_none() {
                    self.tp_sum(h);
                }
            }
            r0 += rows;
        }
        if let (Some(tp), Some(f), true) = (self.sp(), full.as_mut(), grad.is_some()) {
            // This rank's rows of d(final norm output), at the front of `out`.
            let mut local = f.view_mut().slice_mut(..nl * c);
            tp.scatter_rows(out.view(), local.rb());
            k.copy(local.as_view(), out.view_mut().slice_mut(..nl * c));
        }
        self.free_sp_full(pool, full);
        pool.boundary(Boundary::Loss);
        pool.free(logits_name, logits);
        pool.free(losses_name, losses);
        if let Some(st) = stats {
            pool.free(stats_name, st);
        }
        let count = k.count_targets(targets.view(), self.full_config().vocab);
        (rstd, out, LossSum { sum: total, count })
    }

    /// Training forward for one micro-batch: runs every layer keeping its activations, then the
    /// fused LM head, which already accumulates `d lm_head.weight` into `grads`. The loss is
    /// normalised by `num_target_tokens`, the number of non-ignored targets in the whole global
    /// batch (all micro-batches of the step), so that summing micro-batch gradients gives the
    /// gradient of the global mean loss. Returns the activations for [`Llama::backward`] and
    /// this micro-batch's loss sum.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_train<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &[S],
        grads: &mut [G],
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
        targets: &(impl AsView<u32> + ?Sized),
        num_target_tokens: usize,
    ) -> (Activations<S>, LossSum) {
        assert_eq!(grads.len(), self.params.total, "grads buffer length");
        self.check_params(params);
        self.forward_train_scaled(
            k,
            pool,
            &mut WholeParams::host(params),
            &mut Whole::host(grads),
            batch,
            tokens,
            targets,
            num_target_tokens,
            1.0,
        )
    }

    /// [`Llama::forward_train`] with the loss multiplied by `loss_scale` before the backward
    /// (fp16 loss scaling, Micikevicius et al. 2018 §3.2): every gradient comes out scaled by
    /// it; the returned loss is not.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_train_scaled<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        grads: &mut dyn GradBuf<G>,
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
        targets: &(impl AsView<u32> + ?Sized),
        num_target_tokens: usize,
        loss_scale: f32,
    ) -> (Activations<S>, LossSum) {
        self.check_batch(batch, tokens);
        assert_eq!(targets.view().len(), batch.n(), "targets must hold B·T ids");
        // The stages (`super::stages`) in order.
        let x = self.embed_forward(k, pool, params, tokens);
        let (layers, x) = self.layers_forward(k, pool, params, batch, 0..self.config.layers, x);
        let (head, loss) = self.head_forward(
            k,
            pool,
            params,
            grads,
            x,
            targets,
            num_target_tokens,
            loss_scale,
        );
        let acts = Activations {
            batch,
            layers,
            final_input: head.final_input,
            final_rstd: head.final_rstd,
            final_out_grad: head.final_out_grad,
        };
        (acts, loss)
    }

    /// Backward for the micro-batch whose [`Activations`] `forward_train` returned:
    /// accumulates into `grads` and returns every activation to the pool as it is consumed.
    pub fn backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &[S],
        grads: &mut [G],
        acts: Activations<S>,
        tokens: &(impl AsView<u32> + ?Sized),
    ) {
        // Nobody listens for finished gradients.
        let done = &mut |_: GradsDone, _: &mut dyn GradBuf<G>| {};
        assert_eq!(grads.len(), self.params.total, "grads buffer length");
        self.check_params(params);
        let whole = &mut WholeParams::host(params);
        self.backward_notify(k, pool, whole, &mut Whole::host(grads), acts, tokens, done);
    }

    /// [`Llama::backward`], calling `done` with the gradients each time some of them are
    /// final for this micro-batch (see [`GradsDone`]): data parallelism starts reducing them
    /// while the backward goes on.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_notify<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        grads: &mut dyn GradBuf<G>,
        acts: Activations<S>,
        tokens: &(impl AsView<u32> + ?Sized),
        done: &mut dyn FnMut(GradsDone, &mut dyn GradBuf<G>),
    ) {
        assert_eq!(
            tokens.view().len(),
            acts.batch.n(),
            "tokens must hold B·T ids"
        );
        // The stages (`super::stages`) in order.
        let Activations {
            batch,
            layers,
            final_input,
            final_rstd,
            final_out_grad,
        } = acts;
        let head = HeadActs {
            final_input,
            final_rstd,
            final_out_grad,
        };
        let mut state = self.head_backward(k, pool, params, grads, head, batch, done);
        let all = 0..self.config.layers;
        self.layers_backward(k, pool, params, grads, batch, all, layers, &mut state, done);
        self.embed_backward(k, pool, grads, tokens, state, done);
    }

    /// Backward of one layer (every tensor present: [`Llama::rebuild`] ran). On entry
    /// `sc.resid` = d(layer output); on exit d(layer input). Each buffer goes back to the pool
    /// once consumed; `input` goes last, so every `recompute.*` buffer is gone when the
    /// layer's last saved buffer is (the plan's backward mark).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        grads: &mut dyn GradBuf<G>,
        i: usize,
        batch: BatchShape,
        a: LayerActs<S>,
        sc: &mut GradScratch<S>,
    ) {
        let cfg = &self.config;
        let li: &LayerIdx = &self.params.layers[i];
        let (n, c) = (batch.n(), cfg.hidden);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let name = |t| self.slot(i, t);
        let p = |r: &Range<usize>| params.slice(r.clone());
        let lin = |inf, outf| MatmulShape {
            n,
            in_features: inf,
            out_features: outf,
            ragged: false,
        };

        // Under sequence parallelism `sc.resid` holds this rank's rows: the row-parallel
        // products' output gradients are gathered, the column-parallel inputs gathered again
        // for the weight gradients, and the input gradients reduce-scattered (Korthikanti et
        // al. 2022 §4.2.2), all through `act.sp.full`.
        let nl = self.rows(n);
        let mut full = self.sp_full::<S>(pool, n);

        // ---- MLP block: out = resid_mid + down(silu(gate)·up) ----
        let mut a = a;
        if self.config.moe.is_some() {
            self.moe_backward(k, pool, params, grads, i, n, &mut a, sc);
            pool.free(name(T::Ln2Out), std::mem::take(&mut a.ln2_out));
        } else {
            self.dense_mlp_backward(k, pool, params, grads, i, n, &mut a, sc, full.as_mut());
        }
        // Column-parallel gate/up: each rank's input gradient is partial (Megatron's `f`).
        let dln2 = self.input_grad(sc.ln_out.view_mut(), full.as_mut(), nl);
        // resid_mid feeds both ln2 and the skip connection: d resid_mid = d out + ln2'(d ln2_out).
        k.rmsnorm_backward(
            self.norm(nl),
            dln2,
            a.resid_mid.view(),
            p(&li.ln2),
            a.ln2_rstd.view(),
            sc.resid.view_mut(),
            Accum::Add,
            grads.slice_mut(li.ln2.clone()),
        );
        pool.free(name(T::ResidMid), a.resid_mid);
        pool.free(name(T::Ln2Rstd), a.ln2_rstd);

        // ---- attention block: resid_mid = input + o_proj(attn(q, k, v)) ----
        let dmid = self.gathered_rows(sc.resid.view(), full.as_mut());
        let dwo = grads.slice_mut(li.wo.clone());
        let dx = Some((sc.attn_out.view_mut(), Accum::Overwrite));
        k.matmul_backward(
            lin(qd, c),
            dmid,
            a.attn_out.view(),
            p(&li.wo),
            dx,
            dwo,
            None,
        );
        self.attention_backward(
            k,
            pool,
            self.attn_shape(batch),
            (
                a.q.view(),
                a.k.view(),
                a.v.view(),
                a.attn_out.view(),
                a.attn_lse.view(),
                sc.attn_out.view(),
            ),
            (sc.q.view_mut(), sc.k.view_mut(), sc.v.view_mut()),
        );
        pool.free(name(T::AttnOut), a.attn_out);
        pool.free(name(T::AttnLse), a.attn_lse);
        pool.free(name(T::Q), a.q);
        pool.free(name(T::K), a.k);
        pool.free(name(T::V), a.v);
        let rs = |heads| RopeShape {
            b: batch.b,
            t: batch.t,
            heads,
            head_dim: cfg.head_dim,
        };
        k.rope_backward(rs(cfg.heads), self.rope_table(), sc.q.view_mut());
        k.rope_backward(rs(cfg.kv_heads), self.rope_table(), sc.k.view_mut());
        let x1 = self.gathered_rows(a.ln1_out.view(), full.as_mut());
        weight_grad(k, lin(c, qd), sc.q.view(), x1, grads, &li.wq, &li.bq);
        weight_grad(k, lin(c, kvd), sc.k.view(), x1, grads, &li.wk, &li.bk);
        weight_grad(k, lin(c, kvd), sc.v.view(), x1, grads, &li.wv, &li.bv);
        pool.free(name(T::Ln1Out), a.ln1_out);
        let qkv = [
            (lin(c, qd), sc.q.view(), p(&li.wq)),
            (lin(c, kvd), sc.k.view(), p(&li.wk)),
            (lin(c, kvd), sc.v.view(), p(&li.wv)),
        ];
        shared_input_grad(k, &qkv, sc.ln_out.view_mut());
        let dln1 = self.input_grad(sc.ln_out.view_mut(), full.as_mut(), nl);
        k.rmsnorm_backward(
            self.norm(nl),
            dln1,
            a.input.view(),
            p(&li.ln1),
            a.ln1_rstd.view(),
            sc.resid.view_mut(),
            Accum::Add,
            grads.slice_mut(li.ln1.clone()),
        );
        self.free_sp_full(pool, full);
        pool.free(name(T::Ln1Rstd), a.ln1_rstd);
        pool.free(name(T::Input), a.input);
        pool.boundary(Boundary::Backward { layer: i as u32 });
    }

    /// The dense MLP's backward (`sc.resid` = d out in, `sc.ln_out` = d ln2_out out).
    #[allow(clippy::too_many_arguments)]
    fn dense_mlp_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        grads: &mut dyn GradBuf<G>,
        i: usize,
        n: usize,
        a: &mut LayerActs<S>,
        sc: &mut GradScratch<S>,
        mut full: Option<&mut Buf<S>>,
    ) {
        let li: &LayerIdx = &self.params.layers[i];
        let (c, f) = (self.config.hidden, self.config.intermediate);
        let name = |t| self.slot(i, t);
        let p = |r: &Range<usize>| params.slice(r.clone());
        let lin = |inf, outf| MatmulShape {
            n,
            in_features: inf,
            out_features: outf,
            ragged: false,
        };
        let dout = self.gathered_rows(sc.resid.view(), full.as_deref_mut());
        let dwd = grads.slice_mut(li.wd.clone());
        let dx = Some((sc.swiglu.view_mut(), Accum::Overwrite));
        k.matmul_backward(lin(f, c), dout, a.swiglu.view(), p(&li.wd), dx, dwd, None);
        pool.free(name(T::Swiglu), std::mem::take(&mut a.swiglu));
        k.swiglu_backward(
            sc.swiglu.view(),
            a.gate.view(),
            a.up.view(),
            sc.gate.view_mut(),
            sc.up.view_mut(),
        );
        pool.free(name(T::Gate), std::mem::take(&mut a.gate));
        pool.free(name(T::Up), std::mem::take(&mut a.up));
        let x2 = self.gathered_rows(a.ln2_out.view(), full);
        k.matmul_backward_weight(
            lin(c, f),
            sc.gate.view(),
            x2,
            grads.slice_mut(li.wg.clone()),
            None,
        );
        k.matmul_backward_weight(
            lin(c, f),
            sc.up.view(),
            x2,
            grads.slice_mut(li.wu.clone()),
            None,
        );
        pool.free(name(T::Ln2Out), std::mem::take(&mut a.ln2_out));
        let gate_up = [
            (lin(c, f), sc.gate.view(), p(&li.wg)),
            (lin(c, f), sc.up.view(), p(&li.wu)),
        ];
        shared_input_grad(k, &gate_up, sc.ln_out.view_mut());
    }

    /// Evaluation forward (no gradients): loss sum over the batch; layer activations are
    /// returned to the pool as soon as the next layer's input exists.
    pub fn forward_eval<S: Elem>(
        &self,
        k: &dyn Kernels<S>,
        pool: &mut dyn BufferPool,
        params: &[S],
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
        targets: &(impl AsView<u32> + ?Sized),
    ) -> LossSum {
        self.check_params(params);
        let whole = &mut WholeParams::host(params);
        self.forward_eval_from(k, pool, whole, batch, tokens, targets)
    }

    /// [`Llama::forward_eval`] reading each unit's parameters from `params` as it reaches it
    /// (`ferrotron_plan::zero3::eval_sequence`).
    pub fn forward_eval_from<S: Elem>(
        &self,
        k: &dyn Kernels<S>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
        targets: &(impl AsView<u32> + ?Sized),
    ) -> LossSum {
        self.check_batch(batch, tokens);
        assert_eq!(targets.view().len(), batch.n(), "targets must hold B·T ids");
        let x = self.trunk_no_grad(k, pool, params, batch, tokens);
        self.head_eval(k, pool, params, x, targets)
    }

    /// Inference forward for sampling: writes the logits of the last position of each of the
    /// B sequences into `logits` `[B, V]`. No KV cache: the whole prefix is recomputed (see
    /// [`Llama::forward_cached`] for decoding with one).
    pub fn forward_logits_last<S: Elem>(
        &self,
        k: &dyn Kernels<S>,
        pool: &mut dyn BufferPool,
        params: &[S],
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
        logits: &mut [f32],
    ) {
        self.check_params(params);
        let params = &mut WholeParams::host(params);
        self.check_batch(batch, tokens);
        let x = self.trunk_no_grad(k, pool, params, batch, tokens);
        self.last_logits(k, pool, params.unit(Unit::Head), batch, x, logits);
    }

    /// The last layer's output `x` `[B·T, C]` → the logits `[B, V]` of each sequence's last
    /// token.
    pub(super) fn last_logits<S: Elem>(
        &self,
        k: &dyn Kernels<S>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        batch: BatchShape,
        x: Buf<S>,
        logits: &mut [f32],
    ) {
        let (c, vocab, b) = (self.config.hidden, self.full_config().vocab, batch.b);
        assert_eq!(logits.len(), b * vocab, "logits must be [B, V]");
        let xs = self.all_rows(&x);
        let last_name = BufName::Edge(Edge::LastHidden);
        let mut last = self.buf(pool, last_name, b);
        for s in 0..b {
            let row = (s * batch.t + batch.t - 1) * c;
            last[s * c..(s + 1) * c].copy_from_slice(&xs[row..row + c]);
        }
        drop(xs);
        pool.free(BufName::Edge(Edge::FinalNormInput), x);
        self.logits_of(k, pool, params, last.view(), logits);
        pool.free(last_name, last);
    }

    /// Inference forward returning the logits of every position, `[N, V]` (tests, eval tools;
    /// holds full-batch logits, so not for large batches).
    pub fn forward_logits<S: Elem>(
        &self,
        k: &dyn Kernels<S>,
        pool: &mut dyn BufferPool,
        params: &[S],
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
        logits: &mut [f32],
    ) {
        self.check_params(params);
        self.check_batch(batch, tokens);
        assert_eq!(
            logits.len(),
            batch.n() * self.full_config().vocab,
            "logits must be [B·T, V]"
        );
        let whole = &mut WholeParams::host(params);
        let x = self.trunk_no_grad(k, pool, whole, batch, tokens);
        self.logits_of(k, pool, whole, self.all_rows(&x).view(), logits);
        pool.free(BufName::Edge(Edge::FinalNormInput), x);
    }

    /// Every token's row of the residual stream: under sequence parallelism gathered from the
    /// group (sampling and tests only: outside any training plan), else `x` itself.
    fn all_rows<'a, S: Elem>(&self, x: &'a [S]) -> std::borrow::Cow<'a, [S]> {
        match self.sp() {
            Some(tp) => {
                let mut all = vec![S::from_f32(0.0); x.len() * tp.size];
                tp.gather_rows(x.view(), all.view_mut());
                std::borrow::Cow::Owned(all)
            }
            None => std::borrow::Cow::Borrowed(x),
        }
    }

    /// Final norm and LM head over `hidden` rows `[rows, C]` into `logits` `[rows, V]`.
    fn logits_of<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        hidden: View<'_, S>,
        logits: &mut [f32],
    ) {
        let c = self.config.hidden;
        let rows = hidden.len() / c;
        let (rstd_name, out_name) = (
            BufName::Edge(Edge::FinalNormRstd),
            BufName::Edge(Edge::FinalNormOut),
        );
        let mut rstd = self.buf::<f32>(pool, rstd_name, rows);
        let mut out = self.buf(pool, out_name, rows);
        // Under sequence parallelism `hidden` holds every token (gathered), the planned rstd
        // this rank's share of them: these rows' go to a buffer of their own.
        let mut all_rstd = self.sp().map(|_| vec![0.0f32; rows]);
        k.rmsnorm_forward(
            self.norm(rows),
            hidden,
            params.slice(self.params.norm.clone()),
            out.view_mut(),
            match all_rstd.as_mut() {
                Some(all) => all.view_mut(),
                None => rstd.view_mut(),
            },
        );
        let s = MatmulShape {
            n: rows,
            in_features: c,
            out_features: self.config.vocab,
            ragged: false,
        };
        let w = params.slice(self.params.lm_head.clone());
        match &self.tp {
            None => k.head_forward(s, out.view(), w, logits.view_mut()),
            Some(tp) => {
                // Sampling and tests only (no training plan has whole logits): this rank's
                // vocabulary slice, gathered and laid out row by row.
                let v = self.config.vocab;
                let mut mine = vec![0.0; rows * v];
                k.head_forward(s, out.view(), w, mine.view_mut());
                let mut all = vec![0.0; rows * v * tp.size];
                tp.gather_rows(mine.view(), all.view_mut());
                for (r, part) in all.chunks(rows * v).enumerate() {
                    for (i, row) in part.chunks(v).enumerate() {
                        let at = i * v * tp.size + r * v;
                        logits[at..at + v].copy_from_slice(row);
                    }
                }
            }
        }
        pool.free(BufName::Edge(Edge::FinalNormRstd), rstd);
        pool.free(BufName::Edge(Edge::FinalNormOut), out);
    }

    /// Embedding + all layers without keeping activations; returns `act.final_norm.input`.
    fn trunk_no_grad<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        batch: BatchShape,
        tokens: &(impl AsView<u32> + ?Sized),
    ) -> Buf<S> {
        let x = self.embed_forward(k, pool, params, tokens);
        self.layers_no_grad(k, pool, params, batch, 0..self.config.layers, x)
    }

    /// Forward of decoder layers `layers` from their input `x` without keeping activations
    /// (evaluation; a pipeline stage runs its chunks this way).
    pub fn layers_no_grad<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        batch: BatchShape,
        layers: Range<usize>,
        x: Buf<S>,
    ) -> Buf<S> {
        self.layers_no_grad_over(k, pool, params, batch, layers, x, None)
    }

    /// [`Llama::layers_no_grad`], attending over a KV cache when given one (inference
    /// decoding: `super::kv_cache`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layers_no_grad_over<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        batch: BatchShape,
        layers: Range<usize>,
        mut x: Buf<S>,
        mut cache: Option<&mut KvCache<S>>,
    ) -> Buf<S> {
        for i in layers {
            let p = params.unit(Unit::Layer(i));
            let kv = cache.as_deref_mut();
            let (acts, out) = self.layer_forward_over(k, pool, p, i, batch, x, kv);
            self.free_layer(pool, i, acts);
            x = out;
        }
        x
    }

    /// The loss of the last layer's output `x` against `targets`, without gradients.
    pub fn head_eval<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &mut dyn ParamSource<S>,
        x: Buf<S>,
        targets: &(impl AsView<u32> + ?Sized),
    ) -> LossSum {
        let p = params.unit(Unit::Head);
        let (rstd, out, loss) = self.head(k, pool, p, &x, targets, None);
        pool.free(BufName::Edge(Edge::FinalNormOut), out);
        pool.free(BufName::Edge(Edge::FinalNormRstd), rstd);
        pool.free(BufName::Edge(Edge::FinalNormInput), x);
        loss
    }
}
