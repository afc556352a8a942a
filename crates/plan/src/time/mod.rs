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
//! - e_mm = MAMF(GPU) × sustained(GPU) × KERNEL_MIX: the best measured matmul fraction of each
//!   GPU (Bekman's MAMF table, see `cluster.rs`), the sustained-over-burst clock ratio where the
//!   MSMF (power-saturated) benchmark measured it (H100/H200, B200), and one constant for the
//!   kernel mix of real training (shapes, epilogues, launch gaps). KERNEL_MIX = 0.87 was
//!   calibrated once, on A100, against Korthikanti et al. 2022 Table 5; the same value serves
//!   every GPU and every case. e_mem = 0.8 of HBM bandwidth (a STREAM-like achievable fraction;
//!   an assumption).
//! - Fused attention runs at its own measured rate: FlashAttention-2's fraction of the bf16 peak
//!   from attention kernel benchmarks (`attention_kernel.rs`), times the sustained ratio, scaled
//!   for the cluster's kernel (the Triton kernel: 1.4× slower forward, 2× backward).
//! - Backward: each matmul's dgrad and wgrad GEMMs (2× the forward FLOPs); elementwise kernels
//!   read the saved input and the output gradient and write the input gradient.
//! - Recompute: full replays each layer's forward (with its TP/EP/CP communication);
//!   selective replays what the memory convention drops (Korthikanti et al. §5: the attention
//!   core for Megatron-style layers; the norms and the MLP activation in ferrotron's engine).
//! - Communication (`comm.rs`): TP collectives and EP all-to-alls are exposed (Megatron-LM 2022
//!   does not overlap them) unless `tp_overlap` (Megatron-LM's `--tp-comm-overlap`) or
//!   `ep_overlap` (DeepSeek-V3's DualPipe) hides them under compute; CP ring exchanges overlap the attention kernels they feed; DP
//!   gradient reduction is bucketed and overlaps the last micro-batch's backward (Li et al. 2020,
//!   "PyTorch Distributed", §3.2.3); ZeRO-3 gathers are prefetched and overlap each
//!   micro-batch's compute; ZeRO-1/2 parameter all-gathers after the optimizer step are exposed;
//!   overlapped collectives slow the kernels they overlap by OVERLAP_SLOWDOWN (`overlap.rs`:
//!   NCCL runs on the SMs; Lee et al. 2025 measured 18.9% on average);
//!   pipeline sends are on the critical path. Data-parallel rings across nodes drive one network
//!   card per group member in a node (`Cluster::ring_link`).
//! - Pipeline: the steady state is paced by the slowest stage (first or last: they hold the
//!   embedding and the LM head); bubble = (p − 1)/v × its per-micro-batch time, i.e. a bubble
//!   fraction (p − 1)/(v·m) (Narayanan et al. 2021 §2.2 for 1F1B and interleaved 1F1B; AFAB/GPipe,
//!   Huang et al. 2019, has the same bubble with v = 1 but holds every micro-batch).
//! - Optimizer: a memory-bound pass over this rank's shard (Adam reads and writes master weights
//!   and both moments, reads the gradient, writes the 16-bit weights), plus the gradient-norm
//!   read and the zeroing write.

mod cost;
mod elementwise;
mod fp8;
mod layer;
mod overlap;
mod param_stream;
mod report;
mod ring;
mod stage;
mod tail;

pub use cost::{Cost, Efficiency, KERNEL_MIX, MEMORY_EFFICIENCY, TILE};
pub use layer::TimeModel;
pub use overlap::OVERLAP_SLOWDOWN;
pub use report::{ComputeDetail, TimeBreakdown, TimeReport};

use crate::cluster::{groups, replica_group, Cluster, Dim, Group, Link};
use crate::comm::{Collective, DimComm};
use crate::convention::Convention;
use crate::error::Result;
use crate::flops::FlopsConvention;
use crate::inventory::inventory;
use crate::layout::{Layout, Offload, PpSchedule};
use crate::planner::ModelSource;
use crate::planner::PlanInput;
use layer::{edge_costs, layer_cost};
use stage::{StageInputs, StageMb, TpCosts};
use tail::{Tail, TailInputs, HOST_BW, PCIE_BW};

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

/// The share of the modelled all-to-all bytes (every routed copy, `precision`'s storage type,
/// (ep − 1)/ep of them leaving the rank) that a DeepSeek-V3-style exchange sends over its
/// slowest link (DeepSeek-AI 2024, arXiv 2412.19437):
/// - node-limited routing (§3.2.2): with one expert group per node of the EP group
///   (`n_group` = its nodes), a token reaches at most `topk_group` = M nodes, and crosses the
///   network once per node (then NVLink forwards it to the node's GPUs): M·(G − 1)/G copies
///   per token over the network against k·(ep − 1)/ep;
/// - fp8 dispatch (§3.3.2, "we quantize the activation before MoE up-projections into FP8 and
///   then apply dispatch components"): with fp8 training the dispatch moves 1 byte per element
///   plus one fp32 scale per 128 (1.03 bytes), the combine stays bf16: half of the pair's
///   all-to-alls at 1.03/2 of the bytes.
fn ep_volume(m: &crate::model::ModelSpec, x: &PlanInput, g: &Group, gpus_per_node: u64) -> f64 {
    let Some(moe) = m.moe else { return 1.0 };
    let ep = x.layout.ep;
    let mut share = 1.0;
    let nodes = if g.crosses_nodes {
        (ep * g.stride).div_ceil(gpus_per_node)
    } else {
        1
    };
    if let Some((groups, limit)) = moe.routing_groups {
        if ep > 1 && nodes > 1 && groups == nodes {
            let limited = limit as f64 * (nodes - 1) as f64 / nodes as f64;
            let all = moe.top_k as f64 * (ep - 1) as f64 / ep as f64;
            share *= (limited / all).min(1.0);
        }
    }
    if x.recipe.precision == crate::recipe::Precision::Fp8 {
        let st = x.recipe.precision.storage().bytes() as f64;
        share *= (1.0 + (1.0 + 4.0 / 128.0) / st) / 2.0;
    }
    share
}

/// What every stage's per-micro-batch cost is computed from: the mean layer's, the
/// embedding's and the head's costs, the TP collective and the links (one derivation for the
/// step estimate and the split proposal, `balance.rs`).
struct StageSetup {
    lc: layer::LayerCost,
    emb: layer::EdgeCost,
    head: layer::EdgeCost,
    tp: TpCosts,
    links: (Link, Link, Link),
    wheres: [&'static str; 4],
}

impl StageSetup {
    fn new(tm: &TimeModel, x: &PlanInput, cluster: &Cluster, e: &Efficiency, gs: &[Group]) -> Self {
        let l = &x.layout;
        let mut lc = layer_cost(tm, x, e);
        let ep_group = gs.iter().find(|g| g.dim == Dim::Ep).expect("all dims");
        lc.comm.ep_bytes *= ep_volume(tm.spec, x, ep_group, cluster.gpus_per_node);
        let (emb, head) = edge_costs(tm, x, e);
        let (tp_link, tp_where) = link_of(cluster, gs, Dim::Tp);
        let (cp_link, cp_where) = link_of(cluster, gs, Dim::Cp);
        let (ep_link, ep_where) = link_of(cluster, gs, Dim::Ep);
        let (pp_link, pp_where) = link_of(cluster, gs, Dim::Pp);
        let tp_coll = if l.sp && l.tp > 1 {
            // All-gather + reduce-scatter pairs move what one all-reduce moves.
            Collective::AllGather
        } else {
            Collective::AllReduce
        };
        let tp_one = crate::comm::time(tp_coll, lc.comm.tp_bytes, l.tp, tp_link);
        let tp_one_bytes = crate::comm::bytes_per_rank(tp_coll, lc.comm.tp_bytes, l.tp);
        // A layer's all-gather + reduce-scatter pair, as two halves, with the all-gather at
        // its own width (`tp_gather_share`).
        let gather = lc.comm.tp_bytes * lc.comm.tp_gather_share;
        let (layer_one, layer_one_bytes) = match tp_coll {
            Collective::AllGather => (
                (crate::comm::time(tp_coll, gather, l.tp, tp_link) + tp_one) / 2.0,
                (crate::comm::bytes_per_rank(tp_coll, gather, l.tp) + tp_one_bytes) / 2.0,
            ),
            _ => (tp_one, tp_one_bytes),
        };
        StageSetup {
            lc,
            emb,
            head,
            tp: TpCosts {
                coll: tp_coll,
                one: tp_one,
                one_bytes: tp_one_bytes,
                layer_one,
                layer_one_bytes,
            },
            links: (cp_link, ep_link, pp_link),
            wheres: [tp_where, cp_where, ep_where, pp_where],
        }
    }

    fn inputs<'a>(
        &'a self,
        layout: &'a Layout,
        recipe: &'a crate::recipe::Recipe,
        m: &'a crate::model::ModelSpec,
        st: f64,
    ) -> StageInputs<'a> {
        StageInputs {
            lc: &self.lc,
            emb: &self.emb,
            head: &self.head,
            layout,
            recipe,
            model: m,
            st,
            tp: self.tp,
            links: self.links,
        }
    }
}

/// Seconds per micro-batch of each pipeline stage as a line in its layer count: (what the
/// stage costs without layers — the embedding on the first, the final norm, LM head and
/// cross-entropy on the last, the pipeline sends — and what each layer adds). The split
/// proposal (`balance.rs`) balances these; the step estimate prices the split it gets.
pub fn stage_lines(tm: &TimeModel, x: &PlanInput, cluster: &Cluster) -> Vec<(f64, f64)> {
    let e = Efficiency::of(cluster, x.recipe.precision);
    let gs = groups(&x.layout, cluster.gpus_per_node);
    lines_of(&StageSetup::new(tm, x, cluster, &e, &gs), tm, x)
}

fn lines_of(setup: &StageSetup, tm: &TimeModel, x: &PlanInput) -> Vec<(f64, f64)> {
    let st = x.recipe.precision.storage().bytes() as f64;
    let p = x.layout.pp;
    // The same layout with 0 and with 1 layer on every stage (`stage_mb` is linear in them).
    let with = |k: u64| Layout {
        pp_layers: vec![k; p as usize],
        pp_virtual: 1,
        pp_first_layers: None,
        pp_last_layers: None,
        ..x.layout.clone()
    };
    let (none, one) = (with(0), with(1));
    let (a, b) = (
        setup.inputs(&none, &x.recipe, tm.spec, st),
        setup.inputs(&one, &x.recipe, tm.spec, st),
    );
    let v = x.layout.pp_virtual as f64;
    (0..p)
        .map(|s| {
            let (a, b) = (a.stage_mb(s), b.stage_mb(s));
            // The sends are per model chunk: v of them whatever the layers.
            let fixed = a.total() + (v - 1.0) * a.pp.2;
            (fixed, b.total() - a.total())
        })
        .collect()
}

/// As [`estimate_with`], for the split `--pp-layers auto` proposes (`balance.rs`), which it
/// writes into `x.layout.pp_layers` (left empty where it is the even split): the layout
/// search's inner loop, sharing the stage costs between the proposal and the estimate.
pub fn estimate_balanced(
    tm: &TimeModel,
    x: &mut PlanInput,
    cluster: &Cluster,
    fc: FlopsConvention,
    per_token: &[(FlopsConvention, f64)],
) -> TimeReport {
    let e = Efficiency::of(cluster, x.recipe.precision);
    let gs = groups(&x.layout, cluster.gpus_per_node);
    let setup = StageSetup::new(tm, x, cluster, &e, &gs);
    let (l, layers) = (&x.layout, tm.spec.layers);
    if l.pp > 1 {
        let lines = lines_of(&setup, tm, x);
        let split = crate::balance::chunks_of(
            &crate::balance::balance_with_floor(&lines, layers, l.pp_virtual),
            l.pp_virtual,
        );
        let even = split.iter().all(|&n| n * l.pp * l.pp_virtual == layers);
        x.layout.pp_layers = if even { vec![] } else { split };
    }
    estimate_from(tm, x, cluster, fc, per_token, e, gs, setup)
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
    x.runtime.validate(x.convention)?;
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
    let e = Efficiency::of(cluster, x.recipe.precision);
    let gs = groups(&x.layout, cluster.gpus_per_node);
    let setup = StageSetup::new(tm, x, cluster, &e, &gs);
    estimate_from(tm, x, cluster, fc, per_token, e, gs, setup)
}

#[allow(clippy::too_many_arguments)]
fn estimate_from(
    tm: &TimeModel,
    x: &PlanInput,
    cluster: &Cluster,
    fc: FlopsConvention,
    per_token: &[(FlopsConvention, f64)],
    e: Efficiency,
    gs: Vec<Group>,
    setup: StageSetup,
) -> TimeReport {
    let (m, r, l) = (tm.spec, &x.recipe, &x.layout);
    let st = r.precision.storage().bytes() as f64;
    let (lc, emb, head) = (&setup.lc, &setup.emb, &setup.head);
    let [tp_where, cp_where, ep_where, pp_where] = setup.wheres;
    let pp_link = setup.links.2;
    let v = l.pp_virtual as f64;
    let stages_in = setup.inputs(l, r, m, st);
    // Every stage: the slowest paces the pipeline (of an even split the first or the last,
    // which add the embedding and the head; of an uneven one any), and a rank compares what
    // it sends with its own stage's (`stage_bytes`).
    let costs: Vec<(u64, StageMb)> = (0..l.pp).map(|s| (s, stages_in.stage_mb(s))).collect();
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
    let dp_link = cluster.ring_link(&rg);
    let mut eg = rg;
    eg.size = l.cp * l.dp;
    // Expert replicas: cp members are tp apart, dp members tp·cp·ep apart.
    eg.stride = if l.cp > 1 { l.tp } else { l.tp * l.ep };
    eg.crosses_nodes = l.dp * l.cp > 1
        && (l.tp * l.cp * l.ep * l.dp > cluster.gpus_per_node
            || !cluster
                .gpus_per_node
                .is_multiple_of(l.tp * l.cp * l.ep * l.dp));
    let ep_dp_link = cluster.ring_link(&eg);
    // Megatron's fp32 main grads; torchtitan reduces in fp32 (FSDP2 `reduce_dtype`).
    let fp32_reduce = x.convention == Convention::Torchtitan && r.precision.has_master();
    let grad_bytes = if x.convention.fp32_main_grads() || fp32_reduce || r.precision.fp32_grad_acc()
    {
        4.0
    } else {
        st
    };
    let param_bytes = st;
    let tails_in = TailInputs {
        tm,
        layout: l,
        recipe: r,
        e: &e,
        groups: (rg, eg),
        links: (dp_link, ep_dp_link),
        bucket: x.bucket_bytes as f64,
        mb,
        grad_bytes,
        param_bytes,
        st,
        runtime: x.runtime,
        disk: cluster.disk,
    };
    let tails: Vec<(u64, Tail)> = costs
        .iter()
        .map(|(st_, s)| (*st_, tails_in.tail(*st_, s)))
        .collect();
    // What a rank of each stage sends, stage order.
    let stage_bytes: Vec<[f64; 4]> = costs
        .iter()
        .zip(&tails)
        .map(|((_, s), (_, t))| [mb * s.tp.0, mb * s.cp.0, mb * s.ep.0, t.dp.bytes])
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
        exposed_s: mb * slow.pp.2,
        what: if l.pp > 1 {
            format!(
                "activation/gradient sends per micro-batch and model chunk ({pp_where}, {})",
                if l.pp_overlap {
                    "overlapping the next chunk's compute"
                } else {
                    "on the critical path"
                }
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
    let tp = DimComm {
        group: l.tp,
        crosses_nodes: gs[0].crosses_nodes,
        bytes: mb * slow.tp.0,
        s: mb * slow.tp.1,
        exposed_s: mb * slow.tp.2,
        what: if l.tp > 1 {
            format!(
                "{} of the activations, 2 per layer forward and 2 backward ({tp_where}, {})",
                if l.sp {
                    "all-gathers + reduce-scatters"
                } else {
                    "all-reduces"
                },
                if l.tp_overlap {
                    "overlapping the layers' GEMMs"
                } else {
                    "exposed"
                }
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
        exposed_s: mb * slow.ep.2,
        what: if l.ep > 1 {
            format!(
                "token dispatch/combine all-to-alls, 2 per MoE layer forward and 2 backward ({ep_where}, {})",
                if l.ep_overlap { "overlapping another micro-batch's compute" } else { "exposed" }
            )
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
            "compute: roofline per kernel; matmuls at {:.1}% of {:.0} TFLOP/s (MAMF {:.1}% × sustained clock {:.3} × kernel mix {:.2}) with wave quantization over {} SMs; memory-bound kernels at {:.0}% of {:.0} GB/s",
            e.matmul * 100.0,
            peak / 1e12,
            cluster.gpu.mamf(r.precision) * 100.0,
            cluster.gpu.sustained(r.precision),
            KERNEL_MIX,
            e.sms,
            e.memory * 100.0,
            e.hbm_bw / 1e9
        ),
        format!(
            "attention: {}",
            if x.convention.fused_attention() {
                format!(
                    "{} (causal half of the square; backward recomputes the scores) at {:.0} / {:.0} TFLOP/s forward / backward",
                    cluster.attention_kernel,
                    e.attention_flops.0 / 1e12,
                    e.attention_flops.1 / 1e12
                )
            } else {
                "unfused, full s×s scores with softmax and dropout (the memory convention's layer)"
                    .to_string()
            }
        ),
        format!("ranks placed tp innermost, then cp, ep, dp, pp; {}", cluster.describe()),
        format!(
            "overlapped collectives (data-parallel reduction, ZeRO gathers, CP ring, and the --tp/--pp/--param-gather/--ep overlaps asked for) slow the compute they overlap by {:.1}% (NCCL runs on the SMs)",
            OVERLAP_SLOWDOWN * 100.0
        ),
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
    if let (Some(d), Some(t)) = (tail.disk, cluster.disk) {
        notes.push(format!(
            "disk tier: {:.2} GiB of optimizer states on a drive of {:.0} GiB at {:.2} GB/s read, {:.2} GB/s write (assumed); {:.3} s of disk I/O per step overlapping the host's update, {:.3} s of it in the optimizer term",
            d.disk_bytes as f64 / crate::GIB,
            t.disk.capacity as f64 / crate::GIB,
            t.disk.read_bw / 1e9,
            t.disk.write_bw / 1e9,
            d.io_s,
            d.optimizer_s
        ));
    }
    TimeReport {
        stage_bytes,
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
        disk: tail.disk,
        notes,
    }
}
