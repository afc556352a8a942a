//! Activation memory of one micro-batch on one rank, per transformer layer and outside the
//! layers, under each convention. `Act` entries are turned into named buffers by the schedule.

use crate::convention::Convention;
use crate::layout::Layout;
use crate::megatron_lm;
use crate::memory::Category;
use crate::model::{MlpAct, ModelSpec};
use crate::recipe::{DType, Recipe, Recompute};
use crate::sac;
use crate::tensors::{self, Edge, LayerTensor};

/// One activation tensor (or, for formula conventions, one aggregate in bytes as `U8`).
#[derive(Debug, Clone, PartialEq)]
pub struct Act {
    pub name: &'static str,
    pub dtype: DType,
    pub numel: u64,
    pub category: Category,
}

fn act(name: &'static str, dtype: DType, numel: u64) -> Act {
    Act {
        name,
        dtype,
        numel,
        category: Category::LayerActivations,
    }
}

fn bytes(name: &'static str, numel: u64, category: Category) -> Act {
    Act {
        name,
        dtype: DType::U8,
        numel,
        category,
    }
}

/// What one layer holds for backward, and what its backward needs on top, transiently.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerActs {
    pub saved: Vec<Act>,
    /// Rebuilt during this layer's backward (recomputation), freed after it.
    pub recompute: Vec<Act>,
}

/// Activations outside the transformer layers, per micro-batch, in the order the engine
/// allocates them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EdgeActs {
    /// Allocated once at init and kept (batch token buffers, RoPE tables).
    pub persistent: Vec<Act>,
    /// Held from the forward of the first stage's embedding to its backward.
    pub embedding: Vec<Act>,
    /// Held from the final norm's forward into the backward (last stage).
    pub head: Vec<Act>,
    /// Materialised only while the loss is computed at the end of the forward (chunked logits).
    pub loss_transient: Vec<Act>,
    /// Activation gradients allocated first in a micro-batch's backward, before `head` is freed.
    pub scratch_first: Vec<Act>,
    /// The loss's and the LM head's backward: allocated after `scratch_first` and freed with
    /// `head` (the gradients of full logits).
    pub head_backward: Vec<Act>,
    /// The remaining activation gradients, allocated once `head` is freed, reused by every layer.
    pub scratch_rest: Vec<Act>,
    /// A MoE layer's routed rows (`act.moe.rows`): in each MoE layer's forward until its output
    /// exists, and in the backward with `scratch_rest`.
    pub moe_rows: Vec<Act>,
    /// Expert parallelism's exchange buffers (`comm.ep.send`, `comm.ep.recv`): within each MoE
    /// layer's forward and backward, gone at its marks.
    pub ep_staging: Vec<Act>,
    /// Context parallelism's ring-attention buffers (`comm.cp.block`, `comm.cp.next`,
    /// `act.cp.acc`): within each layer's attention, forward and backward.
    pub cp_ring: Vec<Act>,
    /// Sequence parallelism's gather/scatter scratch (`act.sp.full`): the engine takes it for
    /// each use (the embedding's reduce-scatter, each layer's gathers, the head, each
    /// backward) and gives it back before the next mark.
    pub sp_scratch: Vec<Act>,
}

/// The most routed copies of `tokens` tokens one expert takes under capacity factor `cf`:
/// ⌈cf · tokens · top_k / E⌉ (Fedus et al. 2021, Switch Transformer eq. 3, with top-k copies
/// per token as GShard counts them); the copies past it are dropped.
pub fn expert_capacity(cf: f64, tokens: u64, top_k: u64, experts: u64) -> u64 {
    (cf * (tokens * top_k) as f64 / experts as f64).ceil() as u64
}

/// Rows of a MoE layer's routed tensors on a rank with `tokens` tokens, when they are not
/// tokens × top_k (the planner's table and the engine's buffers both use it). Under expert
/// parallelism a rank's experts may receive from none to every rank's copies: the routed
/// buffers hold the most, tokens × ep × min(top_k, E/ep) (exact routing, nothing dropped;
/// crates/engine/src/model/expert_parallel.rs). A capacity factor bounds them by every
/// expert's capacity, E · C (each rank sends an expert at most C copies).
pub fn routed_rows(tokens: u64, top_k: u64, experts: u64, ep: u64, cf: Option<f64>) -> Option<u64> {
    let exact = match ep > 1 {
        true => tokens * ep * top_k.min(experts / ep),
        false => tokens * top_k,
    };
    let rows = cf.map_or(exact, |cf| {
        exact.min(experts * expert_capacity(cf, tokens, top_k, experts))
    });
    (ep > 1 || rows != tokens * top_k).then_some(rows)
}

/// Shape facts shared by every formula: tokens of one micro-batch on one rank.
pub struct Dims {
    pub b: u64,
    /// Sequence length processed by this rank (seq / cp).
    pub s: u64,
    /// Full sequence length (keys attended to).
    pub s_full: u64,
    pub t: u64,
    pub sp: bool,
    /// Expert-parallel degree.
    pub ep: u64,
    /// Context-parallel degree.
    pub cp: u64,
}

impl Dims {
    pub fn new(r: &Recipe, l: &Layout) -> Self {
        Dims {
            b: r.mbs,
            s: r.seq / l.cp,
            s_full: r.seq,
            t: l.tp,
            sp: l.sp && l.tp > 1,
            ep: l.ep,
            cp: l.cp,
        }
    }
    /// Tokens on this rank.
    pub fn n(&self) -> u64 {
        self.b * self.s
    }
    /// The table's sizes (`tensors::Dims`) of this micro-batch for model `m`, in a MoE layer
    /// (`moe_layer`) or a dense one.
    pub fn table(&self, m: &ModelSpec, r: &Recipe, moe_layer: bool) -> tensors::Dims {
        let rank = TableRank {
            tokens: self.n(),
            tp: self.t,
            sp: self.sp,
            ep: self.ep,
            capacity_factor: r.capacity_factor,
            ce_chunk_tokens: r.ce_chunk_tokens,
        };
        table_dims(m, &rank, moe_layer)
    }
    /// Divisor of tensors of the residual stream: t under sequence parallelism, else 1.
    pub fn seq_shard(&self) -> u64 {
        if self.sp {
            self.t
        } else {
            1
        }
    }
}

/// What one rank's micro-batch and layout put into the table's sizes, beside the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TableRank {
    /// Tokens of the micro-batch on this rank.
    pub tokens: u64,
    /// Tensor-parallel degree, and whether sequence parallelism divides the residual stream.
    pub tp: u64,
    pub sp: bool,
    /// Expert-parallel degree and the capacity factor (a MoE layer's routed rows).
    pub ep: u64,
    pub capacity_factor: Option<f64>,
    pub ce_chunk_tokens: u64,
}

/// The table's sizes (`tensors::Dims`) of one rank's micro-batch of model `m` (the whole
/// model's spec; `moe_layer`: a mixture-of-experts layer's MLP): the one place they are made,
/// for the planner's activations and the engine's buffers alike (`Llama::len`), so the two
/// cannot size a buffer differently.
pub fn table_dims(m: &ModelSpec, rank: &TableRank, moe_layer: bool) -> tensors::Dims {
    let moe = m.moe.filter(|_| moe_layer);
    let kv_heads = m.kv_heads_tp(rank.tp);
    tensors::Dims {
        tokens: rank.tokens,
        hidden: m.hidden,
        heads: m.heads,
        q_dim: m.q_dim(),
        k_rank: kv_heads * m.head_dim,
        v_rank: kv_heads * m.v_head_dim,
        o_dim: m.o_dim(),
        rotary_dim: m.rotary_dim,
        ffn: moe.map_or(m.intermediate, |moe| moe.expert_intermediate),
        vocab: m.vocab,
        positions: m.max_positions,
        experts: moe.map_or(0, |moe| moe.num_experts),
        top_k: moe.map_or(1, |moe| moe.top_k),
        routed_rows: moe.and_then(|moe| {
            routed_rows(
                rank.tokens,
                moe.top_k,
                moe.num_experts,
                rank.ep,
                rank.capacity_factor,
            )
        }),
        ce_chunk_tokens: rank.ce_chunk_tokens,
        tp: rank.tp,
        sp: rank.sp,
    }
}

/// Korthikanti et al. 2022, Table 2: activation bytes of one GPT layer with 16-bit
/// activations. sbh terms use the local sequence s; the attention-score term 5as²b uses
/// s_local × s_full so that context parallelism divides it once.
pub fn korthikanti_layer(h: u64, a: u64, d: &Dims, rc: Recompute) -> u64 {
    let sbh = d.s * d.b * h;
    let score = 5 * a * d.s * d.s_full * d.b;
    let t = d.t;
    match (rc, d.sp) {
        // sbh(10 + 24/t + 5as/(ht)); with t = 1 this is the no-parallelism sbh(34 + 5as/h).
        (Recompute::None, false) => 10 * sbh + (24 * sbh + score) / t,
        // (sbh/t)(34 + 5as/h)
        (Recompute::None, true) => (34 * sbh + score) / t,
        // sbh(10 + 24/t)
        (Recompute::Selective, false) => 10 * sbh + 24 * sbh / t,
        // 34sbh/t
        (Recompute::Selective, true) => 34 * sbh / t,
        // 2sbh: only the layer input is kept (divided by t under sequence parallelism).
        (Recompute::Full, false) => 2 * sbh,
        (Recompute::Full, true) => 2 * sbh / t,
    }
}

/// Per-layer activations under a convention, for a layer with a mixture-of-experts MLP
/// (`moe_layer`) or a dense one. The formula conventions are the GPT layer of Korthikanti et
/// al. whatever the family (their published tables are for GPT): for MoE, MLA, GeGLU or
/// sandwich-norm models they are that paper's approximation, not the model's own tensors.
pub fn layer_acts(
    m: &ModelSpec,
    r: &Recipe,
    l: &Layout,
    conv: Convention,
    moe_layer: bool,
) -> LayerActs {
    let d = Dims::new(r, l);
    match conv {
        Convention::Ferrotron | Convention::Torchtitan => {
            if m.gpt_block() {
                gpt_layer(m, r, &d)
            } else {
                decoder_layer(m, r, &d, moe_layer, conv)
            }
        }
        Convention::MegatronLm => {
            let sp = megatron_lm::with_sp(d.sp, r.recompute);
            let f = m.moe.filter(|_| moe_layer).map_or(m.intermediate, |moe| {
                moe.expert_intermediate * moe.top_k + moe.shared_intermediate
            });
            let b = megatron_lm::layer_bytes(d.s * d.b * m.hidden, f, m.hidden, d.t, sp);
            LayerActs {
                saved: vec![bytes("layer", b, Category::LayerActivations)],
                recompute: vec![],
            }
        }
        _ => {
            let held = korthikanti_layer(m.hidden, m.heads, &d, r.recompute);
            let none = korthikanti_layer(m.hidden, m.heads, &d, Recompute::None);
            let recompute = match r.recompute {
                Recompute::None => vec![],
                // Full: the whole layer is rebuilt from its input during its backward.
                // Selective: the attention core (the 5as²b/t term) is rebuilt.
                _ => vec![bytes("recompute", none - held, Category::Workspace)],
            };
            LayerActs {
                saved: vec![bytes("layer", held, Category::LayerActivations)],
                recompute,
            }
        }
    }
}

/// The gated MLP's product of model `m`: SwiGLU, or GeGLU (Gemma).
fn gated_product(m: &ModelSpec) -> LayerTensor {
    match m.mlp_act {
        MlpAct::GeGlu => LayerTensor::Geglu,
        _ => LayerTensor::Swiglu,
    }
}

/// One tensor of a decoder layer as the plan holds it: the activation, and the name of its
/// gradient's backward scratch when it has one. (A tensor a family adds to the table's layer
/// is kept under no and selective recomputation, rebuilt under full.)
struct HeldTensor {
    act: Act,
    grad: Option<&'static str>,
}

fn held(name: &'static str, dtype: DType, numel: u64, grad: Option<&'static str>) -> HeldTensor {
    HeldTensor {
        act: act(name, dtype, numel),
        grad,
    }
}

/// What a family adds to the table's layer, by the table tensor it follows.
fn extras_after(
    m: &ModelSpec,
    r: &Recipe,
    d: &Dims,
    moe_layer: bool,
    t: LayerTensor,
) -> Vec<HeldTensor> {
    let st = r.precision.storage();
    let (n, tp, ss, c) = (d.n(), d.t, d.seq_shard(), m.hidden);
    let kv_t = m.kv_heads_tp(tp);
    let mut out = vec![];
    match t {
        LayerTensor::Ln1Out => {
            if let Some(mla) = m.mla {
                // MLA as trained (DeepSeek-V2 §2.1.2, without the inference-time absorption):
                // the down projections run replicated on the whole (all-gathered) sequence, so
                // their outputs are [N, rank] on every tp rank; each latent is RMS-normed before
                // its up projection (kept: the norm's input and rstd; its output is the
                // up-GEMM's input).
                if mla.q_lora_rank > 0 {
                    out.push(held("q_a", st, n * mla.q_lora_rank, Some("grad.act.q_a")));
                    out.push(held("q_a_rstd", DType::F32, n, None));
                    out.push(held("q_a_norm_out", st, n * mla.q_lora_rank, None));
                }
                let kv_a = n * (mla.kv_lora_rank + mla.qk_rope_head_dim);
                out.push(held("kv_a", st, kv_a, Some("grad.act.kv_a")));
                out.push(held("kv_a_rstd", DType::F32, n, None));
                out.push(held("kv_a_norm_out", st, n * mla.kv_lora_rank, None));
            } else if m.qk_norm {
                // Qwen3: the q/k projections' outputs feed a per-head RMSNorm (kept with its
                // rstd) whose output is rotated into q and k.
                out.push(held("q_pre", st, n * m.q_dim() / tp, None));
                out.push(held("q_rstd", DType::F32, n * m.heads / tp, None));
                out.push(held("k_pre", st, n * kv_t * m.head_dim, None));
                out.push(held("k_rstd", DType::F32, n * kv_t, None));
            }
        }
        // Gemma-2: the attention output (after o_proj) is normed before the residual add.
        LayerTensor::AttnOut if m.sandwich_norm => {
            out.push(held("attn_proj", st, n * c / ss, None));
            out.push(held("post_attn_rstd", DType::F32, n / ss, None));
        }
        LayerTensor::Swiglu | LayerTensor::Geglu => {
            if let Some(moe) = m.moe.filter(|_| moe_layer) {
                // A shared expert sees every token.
                if moe.shared_intermediate > 0 {
                    let f = moe.shared_intermediate.div_ceil(tp);
                    out.push(held("shared.gate", st, n * f, Some("grad.act.shared.gate")));
                    out.push(held("shared.up", st, n * f, Some("grad.act.shared.up")));
                    let product = Some("grad.act.shared.swiglu");
                    out.push(held("shared.swiglu", st, n * f, product));
                }
                if moe.shared_gate {
                    // Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert.
                    out.push(held("shared.score", DType::F32, n / ss, None));
                }
            }
            if m.sandwich_norm {
                out.push(held("mlp_proj", st, n * c / ss, None));
                out.push(held("post_mlp_rstd", DType::F32, n / ss, None));
            }
        }
        _ => {}
    }
    out
}

/// A decoder layer's tensors in forward order: the table's (`tensors::LayerTensor`, the
/// Llama layer the engine runs) with what the family adds, and whether the recompute policy
/// keeps each. The table's policies: none keeps all; selective drops the cheap, large ones
/// (the RMSNorm outputs, the gated product, the routed copies) and keeps the matmul and
/// attention outputs; full keeps only the layer's input and replays its forward in its
/// backward.
///
/// Under the `torchtitan` convention selective recomputation is its op-level policy instead
/// (`sac.rs`): the table tensors it keeps, plus w2's output.
fn layer_tensors(
    m: &ModelSpec,
    r: &Recipe,
    d: &Dims,
    moe_layer: bool,
    conv: Convention,
) -> Vec<(bool, HeldTensor)> {
    let (st, td) = (r.precision.storage(), d.table(m, r, moe_layer));
    let rc = r.recompute;
    let op_sac = conv == Convention::Torchtitan && rc == Recompute::Selective;
    let product = gated_product(m);
    let mut out = vec![];
    for t in LayerTensor::of_layer(moe_layer) {
        let t = if t == LayerTensor::Swiglu { product } else { t };
        let s = t.shape();
        let grad = Edge::grad_of(t).map(Edge::name);
        let e = held(t.name(), s.elems.dtype(st), s.numel(&td), grad);
        out.push((if op_sac { sac::keeps(t) } else { t.kept_by(rc) }, e));
        let kept = rc != Recompute::Full;
        out.extend(
            extras_after(m, r, d, moe_layer, t)
                .into_iter()
                .map(|e| (kept, e)),
        );
    }
    if op_sac {
        out.push((
            true,
            held(sac::MLP_OUT, st, d.n() * m.hidden / d.seq_shard(), None),
        ));
    }
    out
}

/// The ferrotron engine's decoder layer (crates/engine model/llama.rs runs the Llama layer
/// of the table; the other families extend it with their own tensors).
///
/// fp8: the CPU engine quantises GEMM inputs on the fly from their bf16 storage (inside its
/// GEMM workspace), so activations stay bf16: fp8 changes the numerics, not the memory. A GPU
/// engine that saves the fp8 casts for the weight-gradient GEMMs would use F8 for ln1_out,
/// attn_out, ln2_out and the gated product.
fn decoder_layer(
    m: &ModelSpec,
    r: &Recipe,
    d: &Dims,
    moe_layer: bool,
    conv: Convention,
) -> LayerActs {
    let mut acts = LayerActs::default();
    for (kept, e) in layer_tensors(m, r, d, moe_layer, conv) {
        if kept {
            acts.saved.push(e.act);
        } else {
            acts.recompute.push(Act {
                category: Category::Workspace,
                ..e.act
            });
        }
    }
    acts
}

/// A GPT-style block (GPT-2, GPT-NeoX, GPT-J) as the ferrotron engine would hold it
/// (LayerNorm saves mean and rstd; flash attention saves q, k, v — rotated, with RoPE, whose
/// backward needs only the tables — the output and its log-sum-exp).
///
/// Serial (GPT-2): the MLP's norm reads the mid-block residual `resid_mid`, kept for its
/// backward. Parallel (`parallel_block`): both branches read the layer input, so there is no
/// `resid_mid`; with one shared norm (GPT-J's `ln_1`, PaLM) the MLP's first linear reads
/// `ln1_out`, already held for the attention's, so the block keeps one norm's output and
/// statistics; GPT-NeoX normalises the input twice (`post_attention_layernorm` of `x`), so it
/// keeps two.
fn gpt_layer(m: &ModelSpec, r: &Recipe, d: &Dims) -> LayerActs {
    let st = r.precision.storage();
    let (n, t, ss, c) = (d.n(), d.t, d.seq_shard(), m.hidden);
    let f = m.intermediate.div_ceil(t);
    let mut all = vec![
        act("input", st, n * c / ss),
        act("ln1_stats", DType::F32, 2 * n / ss),
        act("ln1_out", st, n * c / ss),
        act("qkv", st, 3 * n * c / t),
        act("attn_lse", DType::F32, n * m.heads / t),
        act("attn_out", st, n * c / t),
    ];
    if !m.parallel_block {
        all.push(act("resid_mid", st, n * c / ss));
    }
    if m.pre_norms() == 2 {
        all.push(act("ln2_stats", DType::F32, 2 * n / ss));
        all.push(act("ln2_out", st, n * c / ss));
    }
    all.push(act("fc", st, n * f));
    all.push(act("gelu", st, n * f));
    // Selective recomputation drops the norm outputs and the GELU output (cheap to rebuild).
    let keeps = |a: &Act| match r.recompute {
        Recompute::None => true,
        Recompute::Selective => !matches!(a.name, "ln1_out" | "ln2_out" | "gelu"),
        Recompute::Full => a.name == "input",
    };
    let (saved, mut recompute): (Vec<Act>, Vec<Act>) = all.into_iter().partition(keeps);
    for a in &mut recompute {
        a.category = Category::Workspace;
    }
    LayerActs { saved, recompute }
}

/// The activation gradients one layer's backward needs at once, reused by every layer
/// (ferrotron convention): the gradient of each matmul output the layer keeps.
fn grad_scratch(m: &ModelSpec, r: &Recipe, d: &Dims, moe_layer: bool) -> Vec<Act> {
    let st = r.precision.storage();
    let (n, c) = (d.n(), m.hidden);
    let ws = |name, numel| Act {
        name,
        dtype: st,
        numel,
        category: Category::Workspace,
    };
    if m.gpt_block() {
        let (t, f) = (d.t, m.intermediate.div_ceil(d.t));
        return vec![
            ws(Edge::GradLnOut.name(), n * c),
            ws(Edge::GradQ.name(), n * m.q_dim() / t),
            ws(Edge::GradK.name(), n * m.kv_dim() / t),
            ws(Edge::GradV.name(), n * m.kv_dim() / t),
            ws(Edge::GradAttnOut.name(), n * m.q_dim() / t),
            ws("grad.act.fc", n * f),
            ws("grad.act.gelu", n * f),
        ];
    }
    let td = d.table(m, r, moe_layer);
    let mut out = vec![ws(
        Edge::GradLnOut.name(),
        Edge::GradLnOut.shape().numel(&td),
    )];
    // The gradients of the table's matmul outputs, whatever the policy kept.
    for (_, e) in layer_tensors(m, r, d, moe_layer, Convention::Ferrotron) {
        if let Some(name) = e.grad {
            out.push(ws(name, e.act.numel));
        }
    }
    if moe_layer {
        out.extend(Edge::MOE_SCRATCH.map(|e| Act {
            dtype: e.shape().elems.dtype(st),
            numel: e.shape().numel(&td),
            ..ws(e.name(), 0)
        }));
    }
    out
}

/// Activations outside the layers and the backward scratch, per micro-batch.
pub fn edge_acts(m: &ModelSpec, r: &Recipe, l: &Layout, conv: Convention) -> EdgeActs {
    let d = Dims::new(r, l);
    let (t, ss, c) = (d.t, d.seq_shard(), m.hidden);
    let other = Category::OtherActivations;
    match conv {
        Convention::Torchtitan => torchtitan_edges(m, r, &d),
        Convention::Ferrotron => {
            let (st, td) = (r.precision.storage(), d.table(m, r, false));
            let buf = |e: Edge, category| Act {
                name: e.name(),
                dtype: e.shape().elems.dtype(st),
                numel: e.shape().numel(&td),
                category,
            };
            let ws = Category::Workspace;
            // A MoE layer's buffers outside the table's layer (none without MoE layers).
            let moe_edges = |edges: &[Edge]| -> Vec<Act> {
                if !(0..m.layers).any(|i| m.is_moe_layer(i)) {
                    return vec![];
                }
                let td = d.table(m, r, true);
                edges
                    .iter()
                    .map(|&e| Act {
                        numel: e.shape().numel(&td),
                        ..buf(e, ws)
                    })
                    .collect()
            };
            // The activation gradients of the layer kind that needs the most bytes.
            let rest = [false, true]
                .into_iter()
                .filter(|&moe| (0..m.layers).any(|i| m.is_moe_layer(i) == moe))
                .map(|moe| grad_scratch(m, r, &d, moe))
                .max_by_key(|acts| acts.iter().map(|a| a.numel * a.dtype.bytes()).sum::<u64>())
                .unwrap_or_default();
            EdgeActs {
                // The trainer's batch buffers and the engine's RoPE cos/sin tables.
                persistent: vec![
                    buf(Edge::DataTokens, other),
                    buf(Edge::DataTargets, other),
                    buf(Edge::RopeCos, ws),
                    buf(Edge::RopeSin, ws),
                ],
                embedding: vec![],
                sp_scratch: match d.sp && t > 1 {
                    true => vec![buf(Edge::SpFull, ws)],
                    false => vec![],
                },
                head: vec![
                    buf(Edge::FinalNormInput, other),
                    buf(Edge::FinalNormRstd, other),
                    buf(Edge::FinalNormOut, other),
                ],
                // The LM head runs chunk by chunk at the end of the forward: logits, loss and
                // their gradient in place, then dW_head and d(final norm out) (as llm.c).
                loss_transient: match d.t > 1 {
                    // Tensor parallelism: each rank holds a vocabulary slice of the logits and
                    // exchanges three statistics per row instead of gathering them.
                    true => vec![
                        buf(Edge::LogitsChunk, other),
                        buf(Edge::Losses, other),
                        buf(Edge::CeStats, other),
                    ],
                    false => vec![buf(Edge::LogitsChunk, other), buf(Edge::Losses, other)],
                },
                scratch_first: vec![buf(Edge::GradResid, ws)],
                head_backward: vec![],
                scratch_rest: rest,
                moe_rows: moe_edges(&[Edge::ExpertRows]),
                ep_staging: match d.ep > 1 {
                    true => moe_edges(&[Edge::EpSend, Edge::EpRecv]),
                    false => vec![],
                },
                cp_ring: match d.cp > 1 {
                    true => [Edge::CpBlock, Edge::CpNext, Edge::CpAcc]
                        .map(|e| buf(e, ws))
                        .to_vec(),
                    false => vec![],
                },
            }
        }
        Convention::MegatronLm => {
            let (sb, sp) = (d.s * d.b, megatron_lm::with_sp(d.sp, r.recompute));
            let v = megatron_lm::padded_vocab(m.vocab, t);
            EdgeActs {
                embedding: vec![bytes(
                    "act.embedding_input_and_dropout",
                    megatron_lm::embedding_bytes(sb, c, t, sp),
                    other,
                )],
                head: vec![bytes(
                    "act.output_layer_and_loss",
                    megatron_lm::head_bytes(sb, c, v, t, sp),
                    other,
                )],
                ..EdgeActs::default()
            }
        }
        Convention::Megatron => {
            let sbh = d.s * d.b * c;
            EdgeActs {
                // §4.3: the embedding dropout mask, one byte per element (÷t with SP).
                embedding: vec![bytes("act.embedding_dropout_mask", sbh / ss, other)],
                // §4.3: final layer norm + output projection input 4sbh/t, fp32 logits for
                // the cross-entropy 4sbv/t: together 4sbh/t·(1 + v/h).
                head: vec![
                    bytes("act.output_norm_and_proj", 4 * sbh / t, other),
                    bytes("act.logits_fp32", 4 * d.s * d.b * m.vocab / t, other),
                ],
                ..EdgeActs::default()
            }
        }
        // The playbook's charts add the embedding dropout mask, s·b·h bytes, to the layers
        // (9.25390625 GiB = 9.25 GiB of layers + 4 MiB for h 4096, s 1024, b 1).
        Convention::Playbook | Convention::ZeroPaper | Convention::DeepSpeed => EdgeActs {
            embedding: vec![bytes(
                "act.embedding_dropout_mask",
                d.s * d.b * c / ss,
                other,
            )],
            ..EdgeActs::default()
        },
    }
}

/// torchtitan's activations outside the blocks (pytorch/torchtitan, Llama `model.py` and
/// `train.py`; the final norm and the output projection are not checkpointed). The model
/// returns `self.output(h).float()`: full fp32 logits, [tokens, vocab/t], which the
/// cross-entropy's log-softmax (fp32) saves for its backward; the train step deletes the logits
/// (`del pred`) before `loss.backward()`. The backward then holds, with the saved log-softmax,
/// the gradient of its output (nll_loss's, a full [tokens, vocab] tensor) and of its input:
/// 12 bytes per logit at once. No chunking: torchtitan computes the loss on whole logits.
fn torchtitan_edges(m: &ModelSpec, r: &Recipe, d: &Dims) -> EdgeActs {
    let (st, td) = (r.precision.storage(), d.table(m, r, false));
    let other = Category::OtherActivations;
    let logits = d.n() * m.vocab.div_ceil(d.t);
    let buf = |e: Edge, category| Act {
        name: e.name(),
        dtype: e.shape().elems.dtype(st),
        numel: e.shape().numel(&td),
        category,
    };
    let f32 = |name, category| Act {
        name,
        dtype: DType::F32,
        numel: logits,
        category,
    };
    EdgeActs {
        // Input ids and labels (int64) and the RoPE table (complex64 `freqs_cis`: as much as
        // the engine's cos and sin).
        persistent: vec![
            bytes("data.input_ids_labels_int64", 16 * d.n(), other),
            buf(Edge::RopeCos, Category::Workspace),
            buf(Edge::RopeSin, Category::Workspace),
        ],
        embedding: vec![],
        head: vec![
            buf(Edge::FinalNormInput, other),
            buf(Edge::FinalNormRstd, other),
            buf(Edge::FinalNormOut, other),
            f32("act.log_softmax_fp32", other),
        ],
        loss_transient: vec![f32("act.logits_fp32", other)],
        scratch_first: vec![buf(Edge::GradResid, Category::Workspace)],
        head_backward: vec![
            f32("grad.act.log_softmax_fp32", Category::Workspace),
            f32("grad.act.logits_fp32", Category::Workspace),
        ],
        scratch_rest: grad_scratch(m, r, d, false),
        moe_rows: vec![],
        ep_staging: vec![],
        cp_ring: torch_ring_buffers(m, r, d),
        sp_scratch: vec![],
    }
}

/// PyTorch's ring attention under torchtitan (`torch.distributed.tensor.experimental.
/// _attention` with torchtitan's default `allgather` rotation, commit 9dec370): within a layer's
/// attention backward (its forward holds less) a rank holds the K and V of all cp ranks,
/// all-gathered in the stored dtype (`_AllGatherRotater`; passed at the query heads, after
/// `repeat_kv`), the fp32 accumulators of dQ, dK and dV (`accum_dtype = float32`), and the
/// fp32 dK, dV it sends on and the ones it receives (`torch.cat` of the accumulators into
/// `dkv_rotater`'s buffer; `_AllToAllRotater`).
fn torch_ring_buffers(m: &ModelSpec, r: &Recipe, d: &Dims) -> Vec<Act> {
    if d.cp <= 1 {
        return vec![];
    }
    let heads = m.heads.div_ceil(d.t);
    let (q, kv) = (
        d.n() * heads * m.head_dim,
        d.n() * heads * (m.head_dim + m.v_head_dim),
    );
    let ws = Category::Workspace;
    vec![
        bytes(
            "comm.cp.kv_gathered",
            d.cp * kv * r.precision.storage().bytes(),
            ws,
        ),
        bytes("act.cp.grad_q_fp32", 4 * q, ws),
        bytes("act.cp.grad_kv_fp32", 4 * kv, ws),
        bytes("comm.cp.grad_kv_send_recv_fp32", 2 * 4 * kv, ws),
    ]
}
