//! Per-layer and per-edge (embedding, LM head) costs of one micro-batch on one rank, and the
//! model facts the step-time estimate precomputes.

use super::cost::{Cost, Efficiency};
use super::elementwise::Traffic;
use super::fp8;
use super::ring::{self, Rotation};
use crate::convention::Convention;
use crate::inventory::{Placement, Tensor};
use crate::layout::Layout;
use crate::model::{Family, MlpAct, ModelSpec};
use crate::planner::{rank_elems, PlanInput};
use crate::recipe::{Precision, Recompute};
use crate::sac;
use crate::states::RankElems;
use std::cell::RefCell;
use std::collections::HashMap;

/// Collective counts and sizes of one transformer layer for one micro-batch.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LayerComm {
    /// TP: bytes of one activation collective, and collectives per forward and backward.
    pub(super) tp_bytes: f64,
    pub(super) tp_fwd: f64,
    pub(super) tp_bwd: f64,
    /// Collectives a full recomputation replays: the forward's, or for ferrotron's engine
    /// only the attention block's (its replay stops before the MLP's output projection).
    pub(super) tp_replay: f64,
    /// f32 elements of the layer's norm gradients all-reduced once they are final (ferrotron
    /// under sequence parallelism: each rank's hold only its tokens' share).
    pub(super) tp_norm_elems: f64,
    /// Bytes of the layers' sequence-parallel all-gathers per byte of `tp_bytes`: 1, or the
    /// float8 share under torchao's Float8 tensor parallelism.
    pub(super) tp_gather_share: f64,
    /// CP: bytes of one ring step (this rank's K and V chunk); steps per forward; passes of
    /// half a step's bytes after the backward's last step (ferrotron's ring sends each
    /// block's dK, dV home: 1).
    pub(super) cp_bytes: f64,
    pub(super) cp_steps: f64,
    pub(super) cp_home: f64,
    /// How the K/V blocks travel around the ring (`ring.rs`).
    pub(super) cp_rotation: Rotation,
    /// EP: bytes of one all-to-all (this rank's routed tokens); all-to-alls per forward.
    pub(super) ep_bytes: f64,
    pub(super) ep_fwd: f64,
}

/// Cost of one transformer layer for one micro-batch on one rank.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LayerCost {
    pub(super) fwd: Cost,
    pub(super) bwd: Cost,
    /// Extra forward work in the backward (recomputation).
    pub(super) recompute: Cost,
    /// Whether the recomputation replays the layer's communication (full recompute).
    pub(super) recompute_comm: bool,
    /// Seconds of the attention core forward and backward (what CP exchanges overlap with).
    pub(super) attn_fwd_s: f64,
    pub(super) attn_bwd_s: f64,
    pub(super) comm: LayerComm,
}

/// Cost outside the layers for one micro-batch: embedding (first stage) and head (last stage).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct EdgeCost {
    pub(super) fwd: Cost,
    pub(super) bwd: Cost,
    pub(super) tp_collectives: f64,
    /// Tensor-parallel bytes per rank besides the activation collectives (a vocabulary-
    /// parallel cross-entropy's row statistics).
    pub(super) tp_extra_bytes: f64,
}

/// (tp, ep, pp, v, stage, the stage's chunks' layer ranges under an uneven split): what a
/// rank's element counts depend on.
pub(super) type ElemsKey = (u64, u64, u64, u64, u64, Vec<(u64, u64)>);

/// What the step-time model needs from a plan input, precomputed once per model.
pub struct TimeModel<'a> {
    pub spec: &'a ModelSpec,
    pub tensors: &'a [Tensor],
    /// Elements per (tp, ep, pp, v, stage), computed by the planner's own `rank_elems` once
    /// (the search asks for the same few combinations thousands of times).
    pub(super) elems: RefCell<HashMap<ElemsKey, RankElems>>,
}

impl<'a> TimeModel<'a> {
    pub fn new(spec: &'a ModelSpec, tensors: &'a [Tensor]) -> Self {
        TimeModel {
            spec,
            tensors,
            elems: RefCell::new(HashMap::new()),
        }
    }

    pub(super) fn rank_elems(&self, l: &Layout, stage: u64) -> RankElems {
        let ranges = match l.uneven() {
            true => (0..l.pp_virtual)
                .map(|c| l.chunk_layers(self.spec.layers, c * l.pp + stage))
                .map(|r| (r.start, r.end))
                .collect(),
            false => vec![],
        };
        let key = (l.tp, l.ep, l.pp, l.pp_virtual, stage, ranges);
        *self
            .elems
            .borrow_mut()
            .entry(key)
            .or_insert_with(|| rank_elems(Some(self.spec), self.tensors, l, stage, 0))
    }
}

/// Whether linear weight `w` has a bias among the layer's tensors `here` (`X.weight` and
/// `X.bias`, as the inventory names them).
fn has_bias(here: &[&Tensor], w: &Tensor) -> bool {
    w.name.strip_suffix(".weight").is_some_and(|stem| {
        here.iter()
            .any(|b| b.name.strip_suffix(".bias") == Some(stem))
    })
}

pub(super) fn in_out(m: &ModelSpec, t: &Tensor, tp: u64) -> (u64, u64) {
    // nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out].
    let (in_dim, out_dim) = if m.conv1d() { (0, 1) } else { (1, 0) };
    (t.dim_tp(in_dim, tp), t.dim_tp(out_dim, tp))
}

impl LayerCost {
    /// `self · a + o · b`, for a weighted mean of layer kinds.
    fn mix(self, a: f64, o: LayerCost, b: f64) -> LayerCost {
        let c = |x: f64, y: f64| x * a + y * b;
        LayerCost {
            fwd: self.fwd * a + o.fwd * b,
            bwd: self.bwd * a + o.bwd * b,
            recompute: self.recompute * a + o.recompute * b,
            recompute_comm: self.recompute_comm,
            attn_fwd_s: c(self.attn_fwd_s, o.attn_fwd_s),
            attn_bwd_s: c(self.attn_bwd_s, o.attn_bwd_s),
            comm: LayerComm {
                tp_bytes: self.comm.tp_bytes,
                tp_fwd: self.comm.tp_fwd,
                tp_bwd: self.comm.tp_bwd,
                tp_replay: self.comm.tp_replay,
                tp_norm_elems: self.comm.tp_norm_elems,
                tp_gather_share: self.comm.tp_gather_share,
                cp_bytes: self.comm.cp_bytes,
                cp_steps: self.comm.cp_steps,
                cp_home: self.comm.cp_home,
                cp_rotation: self.comm.cp_rotation,
                // Dense layers have no all-to-all: the mean layer has the MoE layers' share.
                ep_bytes: self.comm.ep_bytes.max(o.comm.ep_bytes),
                ep_fwd: c(self.comm.ep_fwd, o.comm.ep_fwd),
            },
        }
    }
}

/// Cost of the mean layer of the model: the step-time model multiplies it by the layers of a
/// stage. All layers are alike except in MoE models with dense layers (DeepSeek's first
/// `first_k_dense_replace`, Qwen's `mlp_only_layers`), where it is the layer-count-weighted
/// mean of a dense and a MoE layer (a stage holding more of one kind than the model's share is
/// costed at the mean: the memory plan, not this estimate, places each layer exactly).
pub(super) fn layer_cost(tm: &TimeModel, x: &PlanInput, e: &Efficiency) -> LayerCost {
    let m = tm.spec;
    let first = |moe: bool| (0..m.layers).find(|&i| m.is_moe_layer(i) == moe);
    match (first(false), first(true)) {
        (Some(d), Some(s)) => {
            let dense = m.dense_layers.len() as f64 / m.layers as f64;
            one_layer_cost(tm, x, e, d).mix(dense, one_layer_cost(tm, x, e, s), 1.0 - dense)
        }
        (Some(i), None) | (None, Some(i)) => one_layer_cost(tm, x, e, i),
        (None, None) => LayerCost::default(),
    }
}

fn one_layer_cost(tm: &TimeModel, x: &PlanInput, e: &Efficiency, layer: u64) -> LayerCost {
    let (m, r, l) = (tm.spec, &x.recipe, &x.layout);
    let moe_layer = m.is_moe_layer(layer);
    let st = r.precision.storage().bytes() as f64;
    let t = l.tp;
    let sp = l.sp && t > 1;
    let shard = if sp { t as f64 } else { 1.0 };
    let s_q = r.seq / l.cp;
    let n = r.mbs * s_q;
    let nf = n as f64;
    let h = m.hidden as f64;
    let a_l = m.heads.div_ceil(t);
    let kv_l = m.kv_heads_tp(t);
    let (d, dv) = (m.head_dim, m.v_head_dim);
    let unfused = !x.convention.fused_attention();
    let dropout = unfused;
    let mut out = LayerCost::default();
    let mut selective = Cost::default();

    // Matmuls of this layer, experts as a batch of the local ones.
    let (e_total, k_routed) = match m.moe.filter(|_| moe_layer) {
        Some(moe) => (moe.num_experts, moe.top_k),
        None => (1, 1),
    };
    let local_experts = (e_total / l.ep).max(1);
    let per_expert_tokens = (n * k_routed * l.ep).div_ceil(e_total);
    // torchtitan's op-level selective checkpointing recomputes every second matmul (`sac.rs`).
    let op_sac = x.convention == Convention::Torchtitan && r.recompute == Recompute::Selective;
    let here: Vec<&Tensor> = tm
        .tensors
        .iter()
        .filter(|t| t.placement == Placement::Layer(layer))
        .collect();
    for (i, tensor) in here
        .iter()
        .filter(|t| t.matmul && matches!(t.expert, None | Some(0)))
        .enumerate()
    {
        let (k, nn) = in_out(m, tensor, t);
        let (rows, batch) = if tensor.expert.is_some() {
            (per_expert_tokens, local_experts)
        } else {
            (n, 1)
        };
        let (f, b) = e.gemm(rows, k, nn, batch, st);
        out.fwd += f;
        out.bwd += b;
        if r.precision == Precision::Fp8 {
            let (cf, cb) = fp8::cast_bytes(rows, k, nn, batch, st);
            out.fwd += e.mem(cf);
            out.bwd += e.mem(cb);
        } else if has_bias(&here, tensor) {
            // The bias is added in the GEMM's epilogue, but its gradient is the output
            // gradient summed over the tokens, a reduction kernel of its own that reads dY
            // once (PyTorch's `AddmmBackward0` sums `grad` to the bias shape; Megatron-LM's
            // `LinearWithGradAccumulationAndAsyncCommunication.backward`:
            // `grad_bias = grad_output.sum(dim=0)`).
            out.bwd += e.mem(st * (rows * nn * batch) as f64);
        }
        if op_sac && sac::recomputes_matmul(i) {
            selective += f;
        }
    }

    // Attention core.
    let mbs = r.mbs;
    if unfused {
        // Megatron-style: QKᵀ and AV as batched GEMMs over the full s × s square, a fused
        // scale-mask-softmax and attention dropout on the materialised scores.
        let (qk_f, qk_b) = e.gemm(s_q, d, r.seq, mbs * a_l, st);
        let (av_f, av_b) = e.gemm(s_q, r.seq, dv, mbs * a_l, st);
        let scores = (mbs * a_l * s_q * r.seq) as f64;
        let mut core_f = qk_f + av_f + e.mem(2.0 * st * scores);
        let mut core_b = qk_b + av_b + e.mem(3.0 * st * scores);
        if dropout {
            core_f += e.mem((2.0 * st + 1.0) * scores);
            core_b += e.mem((2.0 * st + 1.0) * scores);
        }
        out.fwd += core_f;
        out.bwd += core_b;
        out.attn_fwd_s = core_f.s();
        out.attn_bwd_s = core_b.s();
        selective += core_f;
    } else {
        // Flash attention: causal, so half the s_q × s square; the backward recomputes the
        // scores (5 matmuls against the forward's 2: Dao 2023, FlashAttention-2, §3.1–3.2).
        // QKᵀ over d and AV over dv (MLA: 192 and 128).
        let fwd = 2.0 * nf * r.seq as f64 * (a_l * (d + dv)) as f64 / 2.0;
        let (af, ab) = e.attention(fwd);
        out.fwd += af;
        out.bwd += ab;
        out.attn_fwd_s = af.s();
        out.attn_bwd_s = ab.s();
    }

    // Elementwise kernels. Residual-stream tensors are sharded by sequence parallelism.
    let resid = nf * h / shard;
    let tr = Traffic::of(x.convention, st);
    let norm_f = e.mem(tr.norm.0 * resid);
    let norm_b = e.mem(tr.norm.1 * resid);
    let (res_f, res_b) = if dropout {
        // Megatron's fused bias-dropout-add, with a one-byte mask.
        (
            e.mem((3.0 * st + 1.0) * resid),
            e.mem((2.0 * st + 1.0) * resid),
        )
    } else {
        (e.mem(3.0 * st * resid), e.mem(3.0 * st * resid))
    };
    let f_l = m.intermediate.div_ceil(t) as f64;
    let routed = nf * k_routed as f64;
    // Elements of the gated MLP's [tokens, width] tensors on this rank: the routed token
    // copies on the expert width plus every token on the shared expert, or the dense MLP.
    let gated = match m.moe.filter(|_| moe_layer) {
        Some(moe) => {
            routed * moe.expert_intermediate.div_ceil(t) as f64
                + nf * moe.shared_intermediate.div_ceil(t) as f64
        }
        None => nf * f_l,
    };
    let (act_f, act_b) = if m.mlp_act == MlpAct::Gelu {
        // Fused bias-GeLU (GPT-2, GPT-NeoX, GPT-J): read and write the [n, f] activation.
        (e.mem(2.0 * st * nf * f_l), e.mem(3.0 * st * nf * f_l))
    } else {
        // SwiGLU / GeGLU (`elementwise.rs`).
        (e.mem(tr.gated.0 * gated), e.mem(tr.gated.1 * gated))
    };
    // A serial block adds to the residual twice; a parallel block once, x + attn + mlp, one
    // kernel reading three tensors (and, with dropout, the two branches' masks). Its backward
    // still sums two gradients into the stream: the branch gradients of the norm input(s) and
    // the residual's.
    let res_fwd = match (m.parallel_block, dropout) {
        (false, _) => res_f * 2.0,
        (true, false) => e.mem(4.0 * st * resid),
        (true, true) => e.mem((4.0 * st + 2.0) * resid),
    };
    // One norm per block when attention and MLP share it (GPT-J), else two (`pre_norms`).
    let norms = m.pre_norms() as f64;
    let attn_elems = nf * (a_l * dv) as f64;
    out.fwd += norm_f * norms + res_fwd + act_f + e.mem(tr.attn_copy.0 * attn_elems);
    out.bwd += norm_b * norms + res_b * 2.0 + act_b + e.mem(tr.attn_copy.1 * attn_elems);
    let mut rope = Cost::default();
    if m.rope() {
        // RoPE on q and k.
        let qk = nf * ((a_l + kv_l) * m.rotary_dim) as f64;
        rope = e.mem(tr.rope.0 * qk);
        out.fwd += rope;
        out.bwd += e.mem(tr.rope.1 * qk);
    }
    if let Some(moe) = m.moe.filter(|_| moe_layer) {
        // Router softmax/top-k in fp32 and the permutations to and from expert order.
        let router = e.mem(3.0 * 4.0 * nf * moe.num_experts as f64);
        let permute = e.mem(2.0 * 2.0 * st * routed * h);
        out.fwd += router + permute;
        out.bwd += router + permute;
        if !unfused {
            selective += permute * 0.5;
        }
    }
    if op_sac {
        // ... and every elementwise op of the block: the norms, RoPE, the activation product
        // and the residual adds.
        selective += norm_f * norms + act_f + rope + res_fwd;
    } else if !unfused {
        // ferrotron's selective policy drops the norm outputs and the activation product.
        selective += norm_f * norms + act_f;
    }

    if l.cp > 1 && x.convention == Convention::Torchtitan {
        // PyTorch's ring attention merges each block's output in fp32 and accumulates each
        // block's gradients (`ring.rs`); K and V are passed at the query heads (`repeat_kv`).
        let kv = nf * (a_l * (d + dv)) as f64;
        let (f, b) = ring::torch_merge_bytes(attn_elems, kv, st, l.cp as f64);
        out.fwd += e.mem(f);
        out.bwd += e.mem(b);
        if op_sac {
            selective += e.mem(f);
        }
    }

    out.recompute = match r.recompute {
        Recompute::None => Cost::default(),
        Recompute::Selective => selective,
        Recompute::Full => out.fwd,
    };
    out.recompute_comm = r.recompute == Recompute::Full;

    // Communication of one layer. TP: two collectives of the [n, h] activation per forward
    // (after attention and after the MLP: all-reduces, or reduce-scatter + all-gather pairs with
    // SP), two per backward (Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2).
    // A parallel block sums the two row-parallel partial outputs before one all-reduce
    // (EleutherAI/gpt-neox `ParallelTransformerLayer` with `gpt_j_residual`: "we can do a
    // single allreduce after we add mlp / attn outputs"); its backward still all-reduces the
    // input gradient of each column-parallel branch.
    // Where the collectives fall is the engine's program, not the runtime's: ferrotron's model
    // issues its own tensor-parallel collectives (`crates/engine/src/model/tensor_parallel.rs`;
    // the trainer only carries them), consistent with what its activation table saves, so the
    // counts below follow the convention.
    if t > 1 {
        out.comm.tp_bytes = nf * h * st;
        out.comm.tp_fwd = if m.parallel_block { 1.0 } else { 2.0 };
        out.comm.tp_bwd = 2.0;
        out.comm.tp_replay = match x.convention {
            Convention::Ferrotron => 1.0,
            _ => out.comm.tp_fwd,
        };
        out.comm.tp_gather_share = 1.0;
        if x.convention == Convention::Torchtitan && sp && r.precision == Precision::Fp8 {
            // torchtitan's Float8 TP plan (torchao `float8_tensor_parallel.py` at eab345c, the
            // runs' version): `PrepareFloat8ModuleInput` casts the attention's and the MLP's
            // input to float8 before its all-gather, and `Float8RowwiseParallel` casts the
            // output gradient to float8 before the backward's all-gather
            // (`NoopFwToFloat8BwDynamic`); the reduce-scatters stay in the stored dtype.
            out.comm.tp_gather_share = 1.0 / st;
        }
        if x.convention == Convention::Ferrotron && l.sp {
            // ferrotron's backward under sequence parallelism (units of one all-gather +
            // reduce-scatter pair): per block it gathers the output gradient and the saved
            // norm output again (for the weight gradients) and reduce-scatters the input
            // gradient, 3 pairs per layer; its replay gathers two inputs and scatters the
            // attention output, 1.5 pairs; the norms' gradients are all-reduced.
            out.comm.tp_bwd = 3.0;
            out.comm.tp_replay = 1.5;
            out.comm.tp_norm_elems = 2.0 * h;
        }
    }
    if l.cp > 1 {
        // Ring attention (Liu et al. 2023): cp − 1 steps, each passing this rank's K and V chunk.
        // torchtitan's Llama repeats K and V to the query heads before SDPA (`repeat_kv` in
        // `models/llama/model.py`), so PyTorch's ring passes them at a_l heads.
        let passed_heads = match x.convention {
            Convention::Torchtitan => a_l,
            _ => kv_l,
        };
        let kv_elems = nf * (passed_heads * (d + dv)) as f64;
        out.comm.cp_bytes = kv_elems * st;
        out.comm.cp_steps = (l.cp - 1) as f64;
        // ferrotron's engine (crates/engine/src/model/context_parallel.rs) passes each block
        // with its dK, dV in the backward, then once more to bring them home.
        out.comm.cp_home = match x.convention {
            Convention::Ferrotron => 1.0,
            _ => 0.0,
        };
        if x.convention == Convention::Torchtitan {
            out.comm.cp_rotation = Rotation::AllGather;
        }
    }
    if l.ep > 1 && moe_layer {
        // Dispatch and combine all-to-alls of the n·k routed token copies (Lepikhin et al. 2021).
        out.comm.ep_bytes = routed * h * st;
        out.comm.ep_fwd = 2.0;
    }
    out
}

pub(super) fn edge_costs(tm: &TimeModel, x: &PlanInput, e: &Efficiency) -> (EdgeCost, EdgeCost) {
    let (m, r, l) = (tm.spec, &x.recipe, &x.layout);
    let st = r.precision.storage().bytes() as f64;
    let t = l.tp;
    let shard = if l.sp && t > 1 { t as f64 } else { 1.0 };
    let n = r.mbs * r.seq / l.cp;
    let nf = n as f64;
    let h = m.hidden as f64;
    let unfused = !x.convention.fused_attention();
    // Embedding: gather rows (read + write), GPT-2 adds positions, Megatron adds dropout.
    let mut emb_bytes = 2.0 * st * nf * h;
    if m.family == Family::Gpt2 {
        emb_bytes += 3.0 * st * nf * h;
    }
    if unfused {
        emb_bytes += (2.0 * st + 1.0) * nf * h / shard;
    }
    let emb = EdgeCost {
        fwd: e.mem(emb_bytes),
        bwd: e.mem(2.0 * st * nf * h),
        tp_collectives: if t > 1 { 1.0 } else { 0.0 },
        tp_extra_bytes: 0.0,
    };
    // Head: final norm, LM head GEMM over the vocabulary shard, cross-entropy on fp32 logits
    // (forward: read the 16-bit logits, write fp32, two fp32 passes for max and sum-exp;
    // backward: read fp32, write the 16-bit gradient).
    let v_l = m.vocab.div_ceil(t);
    let (hf, hb) = e.gemm(n, m.hidden, v_l, 1, st);
    let logits = nf * v_l as f64;
    let head = EdgeCost {
        fwd: e.mem(2.0 * st * nf * h / shard) + hf + e.mem((st + 12.0) * logits),
        bwd: e.mem(3.0 * st * nf * h / shard) + hb + e.mem((4.0 + st) * logits),
        // The vocabulary-parallel head's backward all-reduces its input gradient (Megatron's
        // `copy_to_tensor_model_parallel_region`); its cross-entropy exchanges per-row
        // statistics: ferrotron's engine all-gathers three f32 per row and rank
        // (`kernels::cpu::vocab_parallel_ce`; `act.ce_stats` in its activation table).
        tp_collectives: if t > 1 { 1.0 } else { 0.0 },
        tp_extra_bytes: match (t > 1, x.convention) {
            (true, Convention::Ferrotron) => crate::comm::bytes_per_rank(
                crate::comm::Collective::AllGather,
                12.0 * nf * t as f64,
                t,
            ),
            _ => 0.0,
        },
    };
    (emb, head)
}
