//! Step time: compute (a roofline per kernel with one achievable-efficiency model per GPU kind),
//! exposed communication, the pipeline bubble and the optimizer step; tokens/s, MFU and HFU.
//!
//! The model (docs/FORMULAS.md, "Step time"):
//! - Every kernel of a layer is costed with a roofline (Williams, Waterman & Patterson 2009):
//!   time = max(FLOPs / (peak · e_mm · wave), bytes / (HBM bandwidth · e_mem)).
//!   Matmuls: FLOPs 2mkn, bytes = operands + result. `wave` is the wave-quantization efficiency of
//!   128 × 256 output tiles over the GPU's SMs (NVIDIA, "Matrix Multiplication Background User's
//!   Guide", §"Wave quantization"): tiles / (⌈tiles / SMs⌉ · SMs). Elementwise kernels (norms,
//!   activations, residuals, dropout, softmax, RoPE, cross-entropy) move bytes only.
//! - e_mm = MAMF(GPU) × KERNEL_MIX: the best measured matmul fraction of each GPU (Bekman's MAMF
//!   table, see `cluster.rs`) times one constant for the kernel mix of real training (shapes,
//!   epilogues, launch gaps). KERNEL_MIX = 0.87 was calibrated once, on A100, against Korthikanti
//!   et al. 2022 Table 5; the same value serves every GPU and every case. e_mem = 0.8 of HBM
//!   bandwidth (a STREAM-like achievable fraction; an assumption).
//! - Backward: each matmul's dgrad and wgrad GEMMs (2× the forward FLOPs); elementwise kernels
//!   read the saved input and the output gradient and write the input gradient.
//! - Recompute: full replays each layer's forward (with its TP/EP/CP communication);
//!   selective replays what the memory convention drops (Korthikanti et al. §5: the attention
//!   core for Megatron-style layers; the norms and the MLP activation in ferrotron's engine).
//! - Communication (`comm.rs`): TP collectives and EP all-to-alls are exposed (Megatron-LM 2022
//!   does not overlap them); CP ring exchanges overlap the attention kernels they feed; DP
//!   gradient reduction is bucketed and overlaps the last micro-batch's backward (Li et al. 2020,
//!   "PyTorch Distributed", §3.2.3); ZeRO-3 gathers are prefetched and overlap each
//!   micro-batch's compute; ZeRO-1/2 parameter all-gathers after the optimizer step are exposed;
//!   pipeline sends are on the critical path.
//! - Pipeline: the steady state is paced by the slowest stage (first or last: they hold the
//!   embedding and the LM head); bubble = (p − 1)/v × its per-micro-batch time, i.e. a bubble
//!   fraction (p − 1)/(v·m) (Narayanan et al. 2021 §2.2 for 1F1B and interleaved 1F1B; AFAB/GPipe,
//!   Huang et al. 2019, has the same bubble with v = 1 but holds every micro-batch).
//! - Optimizer: a memory-bound pass over this rank's shard (Adam reads and writes master weights
//!   and both moments, reads the gradient, writes the 16-bit weights), plus the gradient-norm
//!   read and the zeroing write.

use crate::cluster::{groups, replica_group, Cluster, Dim, Group, Link};
use crate::comm::{Collective, DimComm};
use crate::convention::Convention;
use crate::error::Result;
use crate::flops::FlopsConvention;
use crate::inventory::{inventory, Placement, Tensor, TpSplit};
use crate::layout::{Layout, Offload, PpSchedule};
use crate::model::{Family, ModelSpec};
use crate::planner::{rank_elems, ModelSource, PlanInput};
use crate::recipe::{Optimizer, Precision, Recompute};
use crate::states::RankElems;
use serde::Serialize;
use std::cell::RefCell;
use std::collections::HashMap;

/// Share of a GPU's measured best matmul throughput that a training step's kernel mix reaches.
/// Calibrated once on Korthikanti et al. 2022 Table 5 (A100); used unchanged for every GPU.
pub const KERNEL_MIX: f64 = 0.87;
/// Achievable fraction of HBM bandwidth for memory-bound kernels (assumption).
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// Output tile of the matmul kernels for wave quantization (rows × columns).
pub const TILE: (u64, u64) = (128, 256);
/// Host offload: achievable PCIe Gen4 x16 bandwidth and host memory bandwidth (assumptions).
const PCIE_BW: f64 = 25e9;
const HOST_BW: f64 = 100e9;

/// Seconds and FLOPs of some work, split by the kind of kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Cost {
    pub matmul_s: f64,
    pub attention_s: f64,
    pub memory_s: f64,
    /// FLOPs executed (hardware FLOPs).
    pub flops: f64,
}

impl Cost {
    pub fn s(&self) -> f64 {
        self.matmul_s + self.attention_s + self.memory_s
    }
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            matmul_s: self.matmul_s + o.matmul_s,
            attention_s: self.attention_s + o.attention_s,
            memory_s: self.memory_s + o.memory_s,
            flops: self.flops + o.flops,
        }
    }
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        *self = *self + o;
    }
}

impl std::ops::Mul<f64> for Cost {
    type Output = Cost;
    fn mul(self, k: f64) -> Cost {
        Cost {
            matmul_s: self.matmul_s * k,
            attention_s: self.attention_s * k,
            memory_s: self.memory_s * k,
            flops: self.flops * k,
        }
    }
}

/// The achievable-efficiency model of one GPU kind for one precision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Efficiency {
    /// Peak FLOP/s of the recipe's matmul dtype.
    pub peak_flops: f64,
    /// e_mm = MAMF × KERNEL_MIX.
    pub matmul: f64,
    /// e_mem.
    pub memory: f64,
    pub hbm_bw: f64,
    pub sms: u64,
}

impl Efficiency {
    pub fn of(c: &Cluster, p: Precision) -> Self {
        Efficiency {
            peak_flops: c.gpu.peak_flops(p),
            matmul: c.gpu.mamf(p) * KERNEL_MIX,
            memory: MEMORY_EFFICIENCY,
            hbm_bw: c.gpu.hbm_bw,
            sms: c.gpu.sms.max(1),
        }
    }

    /// Wave-quantization efficiency of a `rows × cols` result in `batch` independent problems.
    fn wave(&self, rows: u64, cols: u64, batch: u64) -> f64 {
        let tiles = rows.div_ceil(TILE.0) * cols.div_ceil(TILE.1) * batch.max(1);
        let waves = tiles.div_ceil(self.sms);
        tiles as f64 / (waves * self.sms) as f64
    }

    fn mem(&self, bytes: f64) -> Cost {
        Cost {
            memory_s: bytes / (self.hbm_bw * self.memory),
            ..Cost::default()
        }
    }

    /// Forward and backward (dgrad + wgrad) of `batch` matmuls [m, k] × [k, n].
    fn gemm(&self, m: u64, k: u64, n: u64, batch: u64, elem_bytes: f64) -> (Cost, Cost) {
        let flops = 2.0 * (m * k) as f64 * n as f64 * batch as f64;
        if flops == 0.0 {
            return (Cost::default(), Cost::default());
        }
        let bytes = elem_bytes * ((m * k + k * n + m * n) * batch) as f64;
        let one = |rows: u64, cols: u64| -> Cost {
            let compute = flops / (self.peak_flops * self.matmul * self.wave(rows, cols, batch));
            let memory = bytes / (self.hbm_bw * self.memory);
            Cost {
                matmul_s: compute.max(memory),
                flops,
                ..Cost::default()
            }
        };
        // Forward writes [m, n]; dgrad writes [m, k]; wgrad writes [k, n].
        (one(m, n), one(m, k) + one(k, n))
    }

    fn attention(&self, flops: f64) -> Cost {
        Cost {
            attention_s: flops / (self.peak_flops * self.matmul),
            flops,
            ..Cost::default()
        }
    }
}

/// Collective counts and sizes of one transformer layer for one micro-batch.
#[derive(Debug, Clone, Copy, Default)]
struct LayerComm {
    /// TP: bytes of one activation collective, and collectives per forward and backward.
    tp_bytes: f64,
    tp_fwd: f64,
    tp_bwd: f64,
    /// CP: bytes of one ring step (this rank's K and V chunk); steps per forward.
    cp_bytes: f64,
    cp_steps: f64,
    /// EP: bytes of one all-to-all (this rank's routed tokens); all-to-alls per forward.
    ep_bytes: f64,
    ep_fwd: f64,
}

/// Cost of one transformer layer for one micro-batch on one rank.
#[derive(Debug, Clone, Copy, Default)]
struct LayerCost {
    fwd: Cost,
    bwd: Cost,
    /// Extra forward work in the backward (recomputation).
    recompute: Cost,
    /// Whether the recomputation replays the layer's communication (full recompute).
    recompute_comm: bool,
    /// Seconds of the attention core forward and backward (what CP exchanges overlap with).
    attn_fwd_s: f64,
    attn_bwd_s: f64,
    comm: LayerComm,
}

/// Cost outside the layers for one micro-batch: embedding (first stage) and head (last stage).
#[derive(Debug, Clone, Copy, Default)]
struct EdgeCost {
    fwd: Cost,
    bwd: Cost,
    tp_collectives: f64,
}

/// (tp, ep, pp, v, stage): what a rank's element counts depend on.
type ElemsKey = (u64, u64, u64, u64, u64);

/// What the step-time model needs from a plan input, precomputed once per model.
pub struct TimeModel<'a> {
    pub spec: &'a ModelSpec,
    pub tensors: &'a [Tensor],
    /// Elements per (tp, ep, pp, v, stage), computed by the planner's own `rank_elems` once
    /// (the search asks for the same few combinations thousands of times).
    elems: RefCell<HashMap<ElemsKey, RankElems>>,
}

impl<'a> TimeModel<'a> {
    pub fn new(spec: &'a ModelSpec, tensors: &'a [Tensor]) -> Self {
        TimeModel {
            spec,
            tensors,
            elems: RefCell::new(HashMap::new()),
        }
    }

    fn rank_elems(&self, l: &Layout, stage: u64) -> RankElems {
        let key = (l.tp, l.ep, l.pp, l.pp_virtual, stage);
        *self
            .elems
            .borrow_mut()
            .entry(key)
            .or_insert_with(|| rank_elems(Some(self.spec), self.tensors, l, stage, 0))
    }
}

fn in_out(m: &ModelSpec, t: &Tensor, tp: u64) -> (u64, u64) {
    let (s0, s1) = (t.shape[0], t.shape[1]);
    // nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out].
    let gpt2 = m.family == Family::Gpt2;
    let (mut i, mut o) = if gpt2 { (s0, s1) } else { (s1, s0) };
    if let TpSplit::Dim(d) = t.tp {
        let in_dim = if gpt2 { 0 } else { 1 };
        if d == in_dim {
            i = i.div_ceil(tp);
        } else {
            o = o.div_ceil(tp);
        }
    }
    (i, o)
}

fn layer_cost(tm: &TimeModel, x: &PlanInput, e: &Efficiency) -> LayerCost {
    let (m, r, l) = (tm.spec, &x.recipe, &x.layout);
    let st = r.precision.storage().bytes() as f64;
    let t = l.tp;
    let sp = l.sp && t > 1;
    let shard = if sp { t as f64 } else { 1.0 };
    let s_q = r.seq / l.cp;
    let n = r.mbs * s_q;
    let nf = n as f64;
    let h = m.hidden as f64;
    let a_l = m.heads.div_ceil(t);
    let kv_l = m.kv_heads.div_ceil(t);
    let d = m.head_dim;
    let unfused = x.convention != Convention::Ferrotron;
    let dropout = unfused;
    let mut out = LayerCost::default();
    let mut selective = Cost::default();

    // Matmuls of layer 0 (all layers are alike), experts as a batch of the local ones.
    let (e_total, k_routed) = m.moe.map_or((1, 1), |moe| (moe.num_experts, moe.top_k));
    let local_experts = (e_total / l.ep).max(1);
    let per_expert_tokens = (n * k_routed * l.ep).div_ceil(e_total);
    for tensor in tm.tensors.iter().filter(|t| {
        t.placement == Placement::Layer(0) && t.matmul && matches!(t.expert, None | Some(0))
    }) {
        let (k, nn) = in_out(m, tensor, t);
        let (rows, batch) = if tensor.expert.is_some() {
            (per_expert_tokens, local_experts)
        } else {
            (n, 1)
        };
        let (f, b) = e.gemm(rows, k, nn, batch, st);
        out.fwd += f;
        out.bwd += b;
    }

    // Attention core.
    let mbs = r.mbs;
    if unfused {
        // Megatron-style: QKᵀ and AV as batched GEMMs over the full s × s square, a fused
        // scale-mask-softmax and attention dropout on the materialised scores.
        let (qk_f, qk_b) = e.gemm(s_q, d, r.seq, mbs * a_l, st);
        let (av_f, av_b) = e.gemm(s_q, r.seq, d, mbs * a_l, st);
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
        let fwd = 4.0 * nf * r.seq as f64 * (a_l * d) as f64 / 2.0;
        out.fwd += e.attention(fwd);
        out.bwd += e.attention(2.5 * fwd);
        out.attn_fwd_s = e.attention(fwd).s();
        out.attn_bwd_s = e.attention(2.5 * fwd).s();
    }

    // Elementwise kernels. Residual-stream tensors are sharded by sequence parallelism.
    let resid = nf * h / shard;
    let norm_f = e.mem(2.0 * st * resid);
    let norm_b = e.mem(3.0 * st * resid);
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
    let (act_f, act_b) = if m.family == Family::Gpt2 {
        // Fused bias-GeLU: read and write the [n, f] activation.
        (e.mem(2.0 * st * nf * f_l), e.mem(3.0 * st * nf * f_l))
    } else {
        // SwiGLU: read gate and up, write the product; backward reads gate, up and the output
        // gradient and writes both input gradients.
        (
            e.mem(3.0 * st * routed * f_l),
            e.mem(5.0 * st * routed * f_l),
        )
    };
    out.fwd += norm_f * 2.0 + res_f * 2.0 + act_f;
    out.bwd += norm_b * 2.0 + res_b * 2.0 + act_b;
    if m.family != Family::Gpt2 {
        // RoPE on q and k.
        let rope = e.mem(2.0 * st * nf * ((a_l + kv_l) * d) as f64);
        out.fwd += rope;
        out.bwd += rope;
    }
    if let Some(moe) = m.moe {
        // Router softmax/top-k in fp32 and the permutations to and from expert order.
        let router = e.mem(3.0 * 4.0 * nf * moe.num_experts as f64);
        let permute = e.mem(2.0 * 2.0 * st * routed * h);
        out.fwd += router + permute;
        out.bwd += router + permute;
        if !unfused {
            selective += permute * 0.5;
        }
    }
    if !unfused {
        // ferrotron's selective policy drops both norm outputs and the activation product.
        selective += norm_f * 2.0 + act_f;
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
    if t > 1 {
        out.comm.tp_bytes = nf * h * st;
        out.comm.tp_fwd = 2.0;
        out.comm.tp_bwd = 2.0;
    }
    if l.cp > 1 {
        // Ring attention (Liu et al. 2023): cp − 1 steps, each passing this rank's K and V chunk.
        out.comm.cp_bytes = 2.0 * nf * (kv_l * d) as f64 * st;
        out.comm.cp_steps = (l.cp - 1) as f64;
    }
    if l.ep > 1 && m.moe.is_some() {
        // Dispatch and combine all-to-alls of the n·k routed token copies (Lepikhin et al. 2021).
        out.comm.ep_bytes = routed * h * st;
        out.comm.ep_fwd = 2.0;
    }
    out
}

fn edge_costs(tm: &TimeModel, x: &PlanInput, e: &Efficiency) -> (EdgeCost, EdgeCost) {
    let (m, r, l) = (tm.spec, &x.recipe, &x.layout);
    let st = r.precision.storage().bytes() as f64;
    let t = l.tp;
    let shard = if l.sp && t > 1 { t as f64 } else { 1.0 };
    let n = r.mbs * r.seq / l.cp;
    let nf = n as f64;
    let h = m.hidden as f64;
    let unfused = x.convention != Convention::Ferrotron;
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
        tp_collectives: if t > 1 { 2.0 } else { 0.0 },
    };
    (emb, head)
}

/// The step-time breakdown; the five terms sum to `step_s`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimeBreakdown {
    /// Forward and backward compute of every micro-batch on the slowest stage.
    pub compute_s: f64,
    /// Recomputation in the backward.
    pub recompute_s: f64,
    /// Communication on the critical path (per dimension in `comm`).
    pub exposed_comm_s: f64,
    /// Pipeline bubble: idle time of the slowest stage.
    pub bubble_s: f64,
    /// Optimizer step (and host transfers with offloading).
    pub optimizer_s: f64,
}

/// Compute (with recomputation) by kind of kernel, per step, on the slowest stage.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ComputeDetail {
    pub matmul_s: f64,
    pub attention_s: f64,
    pub memory_bound_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimeReport {
    pub gpus: u64,
    pub cluster: String,
    pub gpu: String,
    pub efficiency: Efficiency,
    pub step_s: f64,
    pub tokens_per_step: u64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub hfu: f64,
    pub flops_convention: FlopsConvention,
    pub model_flops_per_step: f64,
    pub hardware_flops_per_step: f64,
    /// Model FLOPs per token under every convention (for comparison).
    pub flops_per_token: Vec<(FlopsConvention, f64)>,
    pub breakdown: TimeBreakdown,
    pub compute_detail: ComputeDetail,
    /// Per dimension (tp, cp, ep, dp, pp), per rank per step.
    pub comm: Vec<(Dim, DimComm)>,
    /// (p − 1)/(v·m): the bubble over the ideal pipeline time.
    pub bubble_fraction: f64,
    /// The stage that paces the pipeline.
    pub slowest_stage: String,
    pub notes: Vec<String>,
}

impl TimeReport {
    pub fn comm_of(&self, d: Dim) -> &DimComm {
        &self
            .comm
            .iter()
            .find(|(x, _)| *x == d)
            .expect("every dimension is reported")
            .1
    }
}

/// Per micro-batch cost of one pipeline stage.
#[derive(Debug, Clone, Copy, Default)]
struct StageMb {
    compute: Cost,
    recompute: Cost,
    backward_s: f64,
    tp: (f64, f64),
    cp: (f64, f64, f64),
    ep: (f64, f64),
    pp: (f64, f64),
}

impl StageMb {
    /// Seconds on the critical path per micro-batch.
    fn total(&self) -> f64 {
        self.compute.s() + self.recompute.s() + self.tp.1 + self.cp.2 + self.ep.1 + self.pp.1
    }
}

fn link_of(c: &Cluster, gs: &[Group], d: Dim) -> (Link, &'static str) {
    let g = gs.iter().find(|g| g.dim == d).expect("all dims");
    (
        c.link(g),
        if g.crosses_nodes {
            "inter-node"
        } else {
            "intra-node"
        },
    )
}

/// Estimates one step. `None` without an architecture (a bare `--params` count).
pub fn estimate(
    x: &PlanInput,
    cluster: &Cluster,
    fc: FlopsConvention,
) -> Result<Option<TimeReport>> {
    let ModelSource::Spec(spec) = &x.model else {
        return Ok(None);
    };
    x.recipe.validate()?;
    x.layout.validate(Some(spec), &x.recipe)?;
    let tensors = inventory(spec);
    let tm = TimeModel::new(spec, &tensors);
    let per_token = crate::flops::all_conventions_with(spec, &tensors, x.recipe.seq);
    Ok(Some(estimate_with(&tm, x, cluster, fc, &per_token)))
}

/// Estimates one step from precomputed model facts (the search calls this in its inner loop).
pub fn estimate_with(
    tm: &TimeModel,
    x: &PlanInput,
    cluster: &Cluster,
    fc: FlopsConvention,
    per_token: &[(FlopsConvention, f64)],
) -> TimeReport {
    let (m, r, l) = (tm.spec, &x.recipe, &x.layout);
    let e = Efficiency::of(cluster, r.precision);
    let st = r.precision.storage().bytes() as f64;
    let gs = groups(l, cluster.gpus_per_node);
    let lc = layer_cost(tm, x, &e);
    let (emb, head) = edge_costs(tm, x, &e);
    let (tp_link, tp_where) = link_of(cluster, &gs, Dim::Tp);
    let (cp_link, cp_where) = link_of(cluster, &gs, Dim::Cp);
    let (ep_link, ep_where) = link_of(cluster, &gs, Dim::Ep);
    let (pp_link, pp_where) = link_of(cluster, &gs, Dim::Pp);
    let tp_coll = if l.sp && l.tp > 1 {
        // All-gather + reduce-scatter pairs move what one all-reduce moves.
        Collective::AllGather
    } else {
        Collective::AllReduce
    };
    let tp_one = crate::comm::time(tp_coll, lc.comm.tp_bytes, l.tp, tp_link);
    let tp_one_bytes = crate::comm::bytes_per_rank(tp_coll, lc.comm.tp_bytes, l.tp);
    let layers_per_stage = (m.layers / l.pp) as f64;
    let v = l.pp_virtual as f64;

    let stage_mb = |stage: u64| -> StageMb {
        let mut s = StageMb::default();
        let k = layers_per_stage;
        s.compute = (lc.fwd + lc.bwd) * k;
        s.recompute = lc.recompute * k;
        s.backward_s = (lc.bwd + lc.recompute).s() * k;
        let mut tp_count = (lc.comm.tp_fwd + lc.comm.tp_bwd) * k;
        if lc.recompute_comm {
            tp_count += lc.comm.tp_fwd * k;
        }
        if stage == 0 {
            s.compute += emb.fwd + emb.bwd;
            s.backward_s += emb.bwd.s();
            tp_count += emb.tp_collectives;
        }
        if stage == l.pp - 1 {
            s.compute += head.fwd + head.bwd;
            s.backward_s += head.bwd.s();
            tp_count += head.tp_collectives;
        }
        if l.tp > 1 {
            // With SP, each "collective" above is one all-gather or one reduce-scatter pair
            // member; an all-reduce without SP moves as much as the pair.
            let per = if tp_coll == Collective::AllGather {
                2.0
            } else {
                1.0
            };
            s.tp = (tp_count * tp_one_bytes * per, tp_count * tp_one * per);
        }
        if l.cp > 1 {
            let step = crate::comm::time(Collective::SendRecv, lc.comm.cp_bytes, 2, cp_link);
            let fwd = lc.comm.cp_steps * step;
            let passes_f = if lc.recompute_comm { 2.0 } else { 1.0 };
            let bwd = 2.0 * fwd;
            let (attn_f, attn_b) = (lc.attn_fwd_s, lc.attn_bwd_s);
            let exposed = passes_f * (fwd - attn_f).max(0.0) + (bwd - attn_b).max(0.0);
            let bytes = (passes_f + 2.0) * lc.comm.cp_steps * lc.comm.cp_bytes;
            s.cp = (bytes * k, (passes_f * fwd + bwd) * k, exposed * k);
        }
        if lc.comm.ep_fwd > 0.0 {
            let one = crate::comm::time(Collective::AllToAll, lc.comm.ep_bytes, l.ep, ep_link);
            let b1 = crate::comm::bytes_per_rank(Collective::AllToAll, lc.comm.ep_bytes, l.ep);
            let count = lc.comm.ep_fwd * if lc.recompute_comm { 3.0 } else { 2.0 };
            s.ep = (count * b1 * k, count * one * k);
        }
        if l.pp > 1 {
            // One activation send forward and one gradient send backward per model chunk,
            // split over the tp ranks (Narayanan et al. 2021 §4.1, scatter/gather).
            let bytes = (r.mbs * r.seq / l.cp) as f64 * m.hidden as f64 * st / l.tp as f64;
            let one = crate::comm::time(Collective::SendRecv, bytes, 2, pp_link);
            s.pp = (2.0 * v * bytes, 2.0 * v * one);
        }
        s
    };

    let last = l.pp - 1;
    let stages: Vec<u64> = if l.pp == 1 { vec![0] } else { vec![0, last] };
    let costs: Vec<(u64, StageMb)> = stages.iter().map(|&s| (s, stage_mb(s))).collect();
    let (slow_stage, slow) = costs
        .iter()
        .copied()
        .max_by(|a, b| a.1.total().total_cmp(&b.1.total()))
        .expect("at least one stage");
    let mb = r.grad_acc as f64;
    let t_mb = slow.total();
    let bubble_s = (l.pp - 1) as f64 / v * t_mb;

    // Data parallelism and ZeRO, per stage: what remains after the pipeline drains.
    let rg = replica_group(l, cluster.gpus_per_node);
    let dp_link = cluster.link(&rg);
    let mut eg = rg;
    eg.size = l.cp * l.dp;
    eg.crosses_nodes = l.dp * l.cp > 1
        && (l.tp * l.cp * l.ep * l.dp > cluster.gpus_per_node
            || !cluster
                .gpus_per_node
                .is_multiple_of(l.tp * l.cp * l.ep * l.dp));
    let ep_dp_link = cluster.link(&eg);
    let grad_bytes = if x.convention == Convention::Megatron || r.precision.fp32_grad_acc() {
        4.0
    } else {
        st
    };
    let param_bytes = st;
    struct Tail {
        dp: DimComm,
        optimizer_s: f64,
        host: f64,
    }
    let tail_of = |stage: u64, s: &StageMb| -> Tail {
        let RankElems { dense, expert } = tm.rank_elems(l, stage);
        let (dn, en) = (dense as f64, expert as f64);
        let (rd, re) = (rg.size, eg.size);
        let mut dp = DimComm {
            group: rd,
            crosses_nodes: rg.crosses_nodes,
            ..DimComm::default()
        };
        let mut exposed = 0.0;
        let bucket = x.bucket_bytes as f64;
        let reduce = |dp: &mut DimComm, c: Collective, count: f64| -> f64 {
            let before = dp.s;
            dp.add_bucketed(c, dn * grad_bytes, rd, dp_link, count, bucket);
            dp.add_bucketed(c, en * grad_bytes, re, ep_dp_link, count, bucket);
            dp.s - before
        };
        let window = s.backward_s;
        let last_bucket = crate::comm::time(Collective::AllReduce, bucket, rd, dp_link);
        match l.zero {
            0 | 1 => {
                let c = if l.zero == 0 {
                    Collective::AllReduce
                } else {
                    Collective::ReduceScatter
                };
                let t = reduce(&mut dp, c, 1.0);
                if t > 0.0 {
                    exposed += (t - window).max(last_bucket.min(t));
                }
                dp.what = format!(
                    "gradient {} once per step, bucketed, overlapping the last backward",
                    if l.zero == 0 {
                        "all-reduce"
                    } else {
                        "reduce-scatter"
                    }
                );
            }
            2 => {
                let t = reduce(&mut dp, Collective::ReduceScatter, mb);
                if t > 0.0 {
                    let per = t / mb;
                    exposed += mb * (per - window).max(last_bucket.min(per));
                }
                dp.what = "gradient reduce-scatter in every micro-batch's backward (ZeRO-2), overlapping it".into();
            }
            _ => {
                // ZeRO-3: gather the parameters for the forward and again for the backward,
                // reduce-scatter the gradients, every micro-batch (ZeRO paper §7.2.2: 1.5× the
                // data-parallel volume); prefetched, overlapping the micro-batch's compute.
                let before = dp.s;
                dp.add(
                    Collective::AllGather,
                    dn * param_bytes,
                    rd,
                    dp_link,
                    2.0 * mb,
                );
                dp.add(
                    Collective::AllGather,
                    en * param_bytes,
                    re,
                    ep_dp_link,
                    2.0 * mb,
                );
                dp.add(Collective::ReduceScatter, dn * grad_bytes, rd, dp_link, mb);
                dp.add(
                    Collective::ReduceScatter,
                    en * grad_bytes,
                    re,
                    ep_dp_link,
                    mb,
                );
                let per = (dp.s - before) / mb;
                if per > 0.0 {
                    exposed += mb * (per - (s.compute + s.recompute).s()).max(0.0);
                }
                dp.what = "parameter all-gathers (forward and backward) and gradient reduce-scatter every micro-batch (ZeRO-3), prefetched to overlap compute".into();
            }
        }
        if l.zero == 1 || l.zero == 2 {
            // Updated parameter shards are all-gathered after the optimizer step: exposed.
            let before = dp.s;
            dp.add(Collective::AllGather, dn * param_bytes, rd, dp_link, 1.0);
            dp.add(Collective::AllGather, en * param_bytes, re, ep_dp_link, 1.0);
            exposed += dp.s - before;
            dp.what
                .push_str("; parameter all-gather after the optimizer step (exposed)");
        }
        if rd <= 1 && re <= 1 {
            dp.what = "no data parallelism".into();
        }
        dp.exposed_s = exposed;

        // Optimizer: a memory-bound pass over this rank's shard.
        let opt_elems = if l.zero >= 1 {
            dense.div_ceil(rd) + expert.div_ceil(re)
        } else {
            dense + expert
        } as f64;
        let grad_elems = if l.zero >= 2 {
            dense.div_ceil(rd) + expert.div_ceil(re)
        } else {
            dense + expert
        } as f64;
        let per_param = match (r.optimizer, r.precision.has_master()) {
            // Read grad; read+write master and both moments; write 16-bit weights.
            (Optimizer::Adamw, true) => grad_bytes + 8.0 + 16.0 + st,
            // Read grad; read+write weights and both moments.
            (Optimizer::Adamw, false) => grad_bytes + 8.0 + 16.0,
            (Optimizer::Sgd, true) => grad_bytes + 8.0 + st,
            (Optimizer::Sgd, false) => grad_bytes + 8.0,
        };
        let opt_bytes = opt_elems * per_param + grad_elems * grad_bytes * 2.0;
        let (optimizer_s, host) = if l.offload == Offload::None {
            (opt_bytes / (e.hbm_bw * e.memory), 0.0)
        } else {
            // The update runs on the host: gradients down and weights up over PCIe.
            let pcie = opt_elems * (grad_bytes + st) / PCIE_BW;
            let host_update = opt_elems * per_param / HOST_BW;
            let per_mb_params = if l.offload == Offload::Params {
                // Parameters stream in for every forward and backward.
                let p = (dense + expert) as f64 * st * 2.0 / PCIE_BW;
                mb * (p - (s.compute + s.recompute).s()).max(0.0)
            } else {
                0.0
            };
            (pcie + host_update + per_mb_params, pcie + per_mb_params)
        };
        Tail {
            dp,
            optimizer_s,
            host,
        }
    };
    let tails: Vec<(u64, Tail)> = costs
        .iter()
        .map(|(st_, s)| (*st_, tail_of(*st_, s)))
        .collect();
    let (_, tail) = tails
        .iter()
        .max_by(|a, b| {
            (a.1.dp.exposed_s + a.1.optimizer_s).total_cmp(&(b.1.dp.exposed_s + b.1.optimizer_s))
        })
        .expect("one stage");

    // Tied embeddings across the pipeline: the first and last stage all-reduce the embedding
    // gradient once per step (Megatron-LM), exposed.
    let mut pp = DimComm {
        group: l.pp,
        crosses_nodes: gs[4].crosses_nodes,
        bytes: mb * slow.pp.0,
        s: mb * slow.pp.1,
        exposed_s: mb * slow.pp.1,
        what: if l.pp > 1 {
            format!(
                "activation/gradient sends per micro-batch and model chunk ({pp_where}, on the critical path)"
            )
        } else {
            "no pipeline parallelism".into()
        },
    };
    if l.pp > 1 && m.tie_embeddings {
        let bytes = m.vocab.div_ceil(l.tp) as f64 * m.hidden as f64 * grad_bytes;
        pp.add(Collective::AllReduce, bytes, 2, pp_link, 1.0);
        pp.exposed_s += crate::comm::time(Collective::AllReduce, bytes, 2, pp_link);
        pp.what
            .push_str("; tied-embedding gradient all-reduce between first and last stage");
    }
    let tp =
        DimComm {
            group: l.tp,
            crosses_nodes: gs[0].crosses_nodes,
            bytes: mb * slow.tp.0,
            s: mb * slow.tp.1,
            exposed_s: mb * slow.tp.1,
            what: if l.tp > 1 {
                format!(
                "{} of the activations, 2 per layer forward and 2 backward ({tp_where}, exposed)",
                if l.sp { "all-gathers + reduce-scatters" } else { "all-reduces" }
            )
            } else {
                "no tensor parallelism".into()
            },
        };
    let cp = DimComm {
        group: l.cp,
        crosses_nodes: gs[1].crosses_nodes,
        bytes: mb * slow.cp.0,
        s: mb * slow.cp.1,
        exposed_s: mb * slow.cp.2,
        what: if l.cp > 1 {
            format!("ring exchange of K/V chunks ({cp_where}), overlapping attention")
        } else {
            "no context parallelism".into()
        },
    };
    let ep = DimComm {
        group: l.ep,
        crosses_nodes: gs[2].crosses_nodes,
        bytes: mb * slow.ep.0,
        s: mb * slow.ep.1,
        exposed_s: mb * slow.ep.1,
        what: if l.ep > 1 {
            format!("token dispatch/combine all-to-alls, 2 per MoE layer forward and 2 backward ({ep_where}, exposed)")
        } else {
            "no expert parallelism".into()
        },
    };
    let dp = tail.dp.clone();

    let compute_s = mb * slow.compute.s();
    let recompute_s = mb * slow.recompute.s();
    let exposed_comm_s = tp.exposed_s + cp.exposed_s + ep.exposed_s + pp.exposed_s + dp.exposed_s;
    let optimizer_s = tail.optimizer_s;
    let step_s = compute_s + recompute_s + exposed_comm_s + bubble_s + optimizer_s;

    let tokens_per_step = l.global_batch(r) * r.seq;
    let gpus = l.world();
    let peak = e.peak_flops;
    let all_per_token = per_token;
    let per_token = per_token
        .iter()
        .find(|(c, _)| *c == fc)
        .map_or(0.0, |(_, f)| *f);
    let model_flops = per_token * tokens_per_step as f64;
    // Hardware FLOPs: what every GPU executes, summed (recomputation included).
    let layer_flops = (lc.fwd + lc.bwd + lc.recompute).flops;
    let per_replica = mb
        * (layer_flops * m.layers as f64 + (emb.fwd + emb.bwd).flops + (head.fwd + head.bwd).flops);
    let hardware_flops = per_replica * (l.tp * l.cp * l.dp * l.ep) as f64;
    let detail_cost = (slow.compute + slow.recompute) * mb;
    let mut notes = vec![
        format!(
            "compute: roofline per kernel; matmuls at {:.1}% of {:.0} TFLOP/s (MAMF {:.1}% × kernel mix {:.2}) with wave quantization over {} SMs; memory-bound kernels at {:.0}% of {:.0} GB/s",
            e.matmul * 100.0,
            peak / 1e12,
            cluster.gpu.mamf(r.precision) * 100.0,
            KERNEL_MIX,
            e.sms,
            e.memory * 100.0,
            e.hbm_bw / 1e9
        ),
        format!(
            "attention: {}",
            if x.convention == Convention::Ferrotron {
                "flash (causal half of the square; backward recomputes the scores)"
            } else {
                "unfused, full s×s scores with softmax and dropout (the memory convention's layer)"
            }
        ),
        format!("ranks placed tp innermost, then cp, ep, dp, pp; {}", cluster.describe()),
    ];
    if l.pp_schedule == PpSchedule::Afab && l.pp > 1 {
        notes.push("AFAB (GPipe): same bubble as 1F1B, (p − 1)/m, but every micro-batch's activations are held".into());
    }
    if l.offload != Offload::None {
        notes.push(format!(
            "offload: PCIe {:.0} GB/s and host memory {:.0} GB/s assumed; {:.3} s of host transfers per step in the optimizer term",
            PCIE_BW / 1e9,
            HOST_BW / 1e9,
            tail.host
        ));
    }
    TimeReport {
        gpus,
        cluster: cluster.name.clone(),
        gpu: cluster.gpu.name.clone(),
        efficiency: e,
        step_s,
        tokens_per_step,
        tokens_per_s: tokens_per_step as f64 / step_s,
        mfu: model_flops / (step_s * gpus as f64 * peak),
        hfu: hardware_flops / (step_s * gpus as f64 * peak),
        flops_convention: fc,
        model_flops_per_step: model_flops,
        hardware_flops_per_step: hardware_flops,
        flops_per_token: all_per_token.to_vec(),
        breakdown: TimeBreakdown {
            compute_s,
            recompute_s,
            exposed_comm_s,
            bubble_s,
            optimizer_s,
        },
        compute_detail: ComputeDetail {
            matmul_s: detail_cost.matmul_s,
            attention_s: detail_cost.attention_s,
            memory_bound_s: detail_cost.memory_s,
        },
        comm: vec![
            (Dim::Tp, tp),
            (Dim::Cp, cp),
            (Dim::Ep, ep),
            (Dim::Dp, dp),
            (Dim::Pp, pp),
        ],
        bubble_fraction: (l.pp - 1) as f64 / (v * mb),
        slowest_stage: if l.pp == 1 {
            "every rank".into()
        } else {
            format!("pipeline stage {slow_stage}")
        },
        notes,
    }
}
