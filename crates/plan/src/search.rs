//! `ferrotron plan search`: enumerate layouts for a GPU count and a global batch, keep those that
//! fit in memory, rank them by predicted tokens/s.
//!
//! Space: tp over the divisors of the heads and KV heads that fit in a node (tensor parallelism
//! across nodes is never competitive, Narayanan et al. 2021 §3.2), with sequence parallelism
//! whenever tp > 1 (same traffic, less memory: Korthikanti et al. 2022 §4.2.2); cp over powers of
//! two leaving at least 512 tokens per rank; ep over the divisors of the experts; pp over the
//! divisors of the layers, 1F1B, and interleaved with v = 2..8 model chunks; dp for the rest;
//! ZeRO 0–3 (2 and 3 without pp); recompute none, selective, full; mbs over powers of two; the
//! gradient accumulation that makes the global batch. AFAB is never faster than 1F1B (same
//! bubble) and holds more memory, so it is not enumerated; offloading is not either.
//!
//! Method: the time model is cheap, the memory plan is not. Every candidate's step time is
//! estimated; then candidates are visited fastest first and their memory planned (first and last
//! stage, which bound every stage: `plan_extremes`) until k fit. A candidate whose model states
//! alone exceed the budget is rejected without planning. The result is the same as planning all.

use crate::cluster::Cluster;
use crate::convention::Convention;
use crate::error::{PlanError, Result};
use crate::flops::{all_conventions_with, FlopsConvention};
use crate::hardware::Overhead;
use crate::inventory::{inventory, Tensor};
use crate::layout::{Layout, Offload, PpSchedule};
use crate::memory::MemoryPlan;
use crate::model::ModelSpec;
use crate::planner::{plan_extremes, rank_elems, ModelSource, PlanInput};
use crate::recipe::{Optimizer, Precision, Recipe, Recompute};
use crate::states::add_states;
use crate::time::{estimate_balanced, TimeModel, TimeReport};
use serde::Serialize;

/// Fraction of device memory a layout may plan to use: published large runs keep about 20%
/// headroom for allocator fragmentation spikes and NCCL buffers.
pub const DEFAULT_MARGIN: f64 = 0.8;

#[derive(Debug, Clone)]
pub struct SearchSpec {
    pub model: ModelSpec,
    pub gpus: u64,
    pub cluster: Cluster,
    pub seq: u64,
    /// Global batch in tokens per optimizer step.
    pub gbs_tokens: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub convention: Convention,
    pub flops: FlopsConvention,
    pub overhead: Overhead,
    pub bucket_bytes: u64,
    pub ce_chunk_tokens: u64,
    /// Memory budget as a fraction of capacity.
    pub margin: f64,
    pub top_k: usize,
    pub max_mbs: u64,
}

impl SearchSpec {
    pub fn new(model: ModelSpec, gpus: u64, cluster: Cluster, seq: u64, gbs_tokens: u64) -> Self {
        SearchSpec {
            model,
            gpus,
            cluster,
            seq,
            gbs_tokens,
            precision: Precision::Bf16,
            optimizer: Optimizer::Adamw,
            convention: Convention::Ferrotron,
            flops: FlopsConvention::Ferrotron,
            overhead: Overhead::GPU_DEFAULT,
            bucket_bytes: 25 << 20,
            ce_chunk_tokens: 1024,
            margin: DEFAULT_MARGIN,
            top_k: 5,
            max_mbs: 64,
        }
    }
}

/// One ranked layout.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub layout: Layout,
    pub recipe: Recipe,
    /// The `ferrotron plan` flags that reproduce it.
    pub flags: String,
    /// Peak of the most loaded rank (with the overhead model), and which rank.
    pub peak: u64,
    pub peak_rank: String,
    pub time: TimeReport,
}

#[derive(Debug, Clone, Serialize)]
pub struct SearchResult {
    pub gpus: u64,
    pub capacity: u64,
    /// margin × capacity.
    pub budget: u64,
    /// Layouts whose time was estimated.
    pub evaluated: usize,
    /// Layouts whose memory was planned (the rest were ranked below the winners, or rejected
    /// by their model states alone).
    pub memory_planned: usize,
    /// Faster layouts than the winner that do not fit.
    pub faster_rejected: usize,
    /// The fastest of them, with its planned peak (or model-states lower bound).
    pub fastest_rejected: Option<Candidate>,
    /// The faster layout that differs least from the winner: what the winner gives up to fit.
    pub nearest_rejected: Option<Candidate>,
    pub top: Vec<Candidate>,
    pub reason: String,
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The flags of `ferrotron plan` for a layout and recipe (defaults omitted).
pub fn flags(l: &Layout, r: &Recipe) -> String {
    let mut f = vec![format!("--dp {}", l.dp)];
    for (name, v) in [("tp", l.tp), ("pp", l.pp), ("cp", l.cp), ("ep", l.ep)] {
        if v > 1 {
            f.push(format!("--{name} {v}"));
        }
    }
    if l.sp {
        f.push("--sp".into());
    }
    if l.pp > 1 && l.pp_schedule != PpSchedule::OneFOneB {
        f.push(format!("--pp-schedule {}", l.pp_schedule));
    }
    if l.pp_virtual > 1 {
        f.push(format!("--pp-virtual {}", l.pp_virtual));
    }
    if !l.pp_layers.is_empty() {
        f.push(format!(
            "--pp-layers {}",
            crate::layout::format_pp_layers(&l.pp_layers)
        ));
    }
    if l.zero > 0 {
        f.push(format!("--zero {}", l.zero));
    }
    for (on, flag) in [
        (l.tp_overlap, "--tp-overlap"),
        (l.param_gather_overlap, "--param-gather-overlap"),
        (l.pp_overlap, "--pp-overlap"),
    ] {
        if on {
            f.push(flag.into());
        }
    }
    f.push(format!("--recompute {}", r.recompute));
    f.push(format!("--mbs {} --grad-acc {}", r.mbs, r.grad_acc));
    f.join(" ")
}

/// Bytes of this stage's model states (params, grads, master, optimizer): live at the step-2
/// peak, so a lower bound of it.
fn states_bytes(x: &PlanInput, spec: &ModelSpec, tensors: &[Tensor], stage: u64) -> u64 {
    let elems = rank_elems(Some(spec), tensors, &x.layout, stage, 0);
    let mut p = MemoryPlan::default();
    // (ferrotron's ZeRO-3 pads its shard and adds windows: without them, still a lower bound.)
    add_states(&mut p, elems, &x.recipe, &x.layout, x.convention, None);
    p.buffers.iter().map(|b| b.bytes()).sum()
}

/// Runs the search.
pub fn search(spec: &SearchSpec) -> Result<SearchResult> {
    let m = &spec.model;
    let g = spec.cluster.gpus_per_node;
    if spec.gpus == 0 {
        return Err(PlanError::setting("gpus", 0, "must be a positive integer"));
    }
    if spec.seq == 0 || spec.seq > m.max_positions {
        return Err(PlanError::setting(
            "seq",
            spec.seq,
            format!(
                "must be between 1 and the model's max_position_embeddings {}",
                m.max_positions
            ),
        ));
    }
    if spec.gbs_tokens == 0 || !spec.gbs_tokens.is_multiple_of(spec.seq) {
        return Err(PlanError::setting(
            "gbs_tokens",
            spec.gbs_tokens,
            format!("must be a positive multiple of seq = {}", spec.seq),
        ));
    }
    if !(spec.margin > 0.0 && spec.margin <= 1.0) {
        return Err(PlanError::setting(
            "margin",
            spec.margin,
            "must be a fraction in (0, 1], e.g. 0.8",
        ));
    }
    if spec.top_k == 0 {
        return Err(PlanError::setting("top", 0, "must be at least 1"));
    }
    spec.overhead.validate()?;
    let seqs = spec.gbs_tokens / spec.seq;
    let tensors = inventory(m);
    let tm = TimeModel::new(m, &tensors);
    let per_token = all_conventions_with(m, &tensors, spec.seq);
    let capacity = spec.cluster.gpu.capacity;
    let budget = (capacity as f64 * spec.margin) as u64;

    let tps: Vec<u64> = divisors(m.heads)
        .into_iter()
        .filter(|t| m.kv_heads.is_multiple_of(*t) && *t <= g && g.is_multiple_of(*t))
        .collect();
    let mut cps = vec![1];
    while spec.seq.is_multiple_of(cps.last().unwrap() * 2)
        && spec.seq / (cps.last().unwrap() * 2) >= 512
    {
        cps.push(cps.last().unwrap() * 2);
    }
    let eps = m.moe.map_or(vec![1], |moe| divisors(moe.num_experts));
    let pps = divisors(m.layers);
    let mut mbss = vec![1];
    while mbss.last().unwrap() * 2 <= spec.max_mbs {
        mbss.push(mbss.last().unwrap() * 2);
    }

    // One input, its layout and recipe rewritten per candidate (the model is not cloned).
    let mut x = PlanInput {
        model: ModelSource::Spec(m.clone()),
        recipe: Recipe {
            seq: spec.seq,
            mbs: 1,
            grad_acc: 1,
            precision: spec.precision,
            optimizer: spec.optimizer,
            recompute: Recompute::None,
            ce_chunk_tokens: spec.ce_chunk_tokens,
            capacity_factor: None,
        },
        layout: Layout::default(),
        convention: spec.convention,
        runtime: crate::runtime::Runtime::of(spec.convention),
        overhead: spec.overhead,
        bucket_bytes: spec.bucket_bytes,
    };
    // The overlaps the convention's framework offers, on wherever a layout allows them.
    let (tp_ov, pg_ov, pp_ov) = spec.convention.offered_overlaps();
    let mut all: Vec<(Layout, Recipe, TimeReport)> = Vec::new();
    for &tp in &tps {
        for &cp in &cps {
            for &ep in &eps {
                for &pp in &pps {
                    let inner = tp * cp * ep * pp;
                    if !spec.gpus.is_multiple_of(inner) {
                        continue;
                    }
                    let dp = spec.gpus / inner;
                    let mut schedules = vec![(PpSchedule::OneFOneB, 1)];
                    if pp > 1 {
                        for v in 2..=8 {
                            if (m.layers / pp).is_multiple_of(v) {
                                schedules.push((PpSchedule::Interleaved, v));
                            }
                        }
                    }
                    let replicas = dp * cp * ep;
                    for &(sched, v) in &schedules {
                        for zero in 0..=3u8 {
                            // ZeRO-2/3 under pipelining hold unsharded gradients (and ZeRO-3
                            // unsharded parameters) for the whole step (states.rs): never a
                            // lower peak than ZeRO-1, so the search skips them.
                            if (zero >= 2 && pp > 1) || (zero >= 1 && replicas == 1) {
                                continue;
                            }
                            for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
                                for &mbs in &mbss {
                                    let per_step = mbs * dp * ep;
                                    if !seqs.is_multiple_of(per_step) {
                                        continue;
                                    }
                                    let grad_acc = seqs / per_step;
                                    if sched == PpSchedule::Interleaved
                                        && !grad_acc.is_multiple_of(pp)
                                    {
                                        continue;
                                    }
                                    x.recipe.mbs = mbs;
                                    x.recipe.grad_acc = grad_acc;
                                    x.recipe.recompute = rc;
                                    x.layout = Layout {
                                        dp,
                                        tp,
                                        pp,
                                        cp,
                                        ep,
                                        zero,
                                        sp: tp > 1,
                                        pp_schedule: sched,
                                        pp_virtual: v,
                                        offload: Offload::None,
                                        tp_overlap: tp_ov && tp > 1,
                                        param_gather_overlap: pg_ov && (zero == 1 || zero == 2),
                                        pp_overlap: pp_ov && sched == PpSchedule::Interleaved,
                                        ..Layout::default()
                                    };
                                    if x.layout.validate(Some(m), &x.recipe).is_err() {
                                        continue;
                                    }
                                    // Priced with the split `--pp-layers auto` proposes for
                                    // time (`balance.rs`).
                                    let t = estimate_balanced(
                                        &tm,
                                        &mut x,
                                        &spec.cluster,
                                        spec.flops,
                                        &per_token,
                                    );
                                    all.push((x.layout.clone(), x.recipe.clone(), t));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let evaluated = all.len();
    // Fastest first. Layouts within 0.01% of each other (CP and DP often trade exactly) are
    // ties, broken towards the simpler layout: fewer context, pipeline and tensor ranks, a
    // lower ZeRO stage, less recomputation, a larger micro-batch.
    let tie = |s: f64| (s.ln() * 1e4).round() as i64;
    all.sort_by(|a, b| {
        tie(a.2.step_s)
            .cmp(&tie(b.2.step_s))
            .then(a.0.cp.cmp(&b.0.cp))
            .then(a.0.pp.cmp(&b.0.pp))
            .then(a.0.tp.cmp(&b.0.tp))
            .then(a.0.ep.cmp(&b.0.ep))
            .then(a.0.pp_virtual.cmp(&b.0.pp_virtual))
            .then(a.0.zero.cmp(&b.0.zero))
            .then((a.1.recompute as u8).cmp(&(b.1.recompute as u8)))
            .then(b.1.mbs.cmp(&a.1.mbs))
            .then(a.2.step_s.total_cmp(&b.2.step_s))
    });
    let mut top: Vec<Candidate> = Vec::new();
    let mut memory_planned = 0;
    let mut faster_rejected = 0;
    let mut rejected: Vec<Candidate> = Vec::new();
    for (layout, recipe, t) in all {
        if top.len() >= spec.top_k {
            break;
        }
        x.layout = layout;
        x.recipe = recipe;
        let last = x.layout.pp - 1;
        let lower = [0, last]
            .iter()
            .map(|&s| states_bytes(&x, m, &tensors, s))
            .max()
            .unwrap_or(0);
        let (peak, rank) = if lower + spec.overhead.bytes(lower) > budget {
            (
                lower + spec.overhead.bytes(lower),
                "model states alone".to_string(),
            )
        } else {
            memory_planned += 1;
            let p = plan_extremes(&x)?;
            (p.worst().peak, p.worst().name.clone())
        };
        let cand = Candidate {
            flags: flags(&x.layout, &x.recipe),
            layout: x.layout.clone(),
            recipe: x.recipe.clone(),
            peak,
            peak_rank: rank,
            time: t,
        };
        if peak <= budget {
            top.push(cand);
        } else if top.is_empty() {
            faster_rejected += 1;
            rejected.push(cand);
        }
    }
    if top.is_empty() {
        return Err(PlanError::setting(
            "gpus",
            spec.gpus,
            format!(
                "no layout of {} on {} × {} fits in {:.1} GiB ({:.0}% of {:.1} GiB); add GPUs, shorten seq, or raise --margin",
                m.name,
                spec.gpus,
                spec.cluster.gpu.name,
                budget as f64 / crate::GIB,
                spec.margin * 100.0,
                capacity as f64 / crate::GIB
            ),
        ));
    }
    let nearest_rejected = rejected
        .iter()
        .min_by_key(|c| changes(c, &top[0]).len())
        .cloned();
    let fastest_rejected = rejected.into_iter().next();
    let reason = reason(&top, nearest_rejected.as_ref(), faster_rejected, budget);
    Ok(SearchResult {
        gpus: spec.gpus,
        capacity,
        budget,
        evaluated,
        memory_planned,
        faster_rejected,
        fastest_rejected,
        nearest_rejected,
        top,
        reason,
    })
}

fn gib(b: u64) -> f64 {
    b as f64 / crate::GIB
}

/// What differs between two layouts, as "tp 1→2, mbs 4→2".
fn changes(from: &Candidate, to: &Candidate) -> Vec<String> {
    let (a, b) = (&from.layout, &to.layout);
    let (ra, rb) = (&from.recipe, &to.recipe);
    let mut out = Vec::new();
    for (name, x, y) in [
        ("tp", a.tp, b.tp),
        ("pp", a.pp, b.pp),
        ("cp", a.cp, b.cp),
        ("ep", a.ep, b.ep),
        ("dp", a.dp, b.dp),
        ("v", a.pp_virtual, b.pp_virtual),
        ("zero", a.zero as u64, b.zero as u64),
        ("mbs", ra.mbs, rb.mbs),
    ] {
        if x != y {
            out.push(format!("{name} {x}→{y}"));
        }
    }
    if ra.recompute != rb.recompute {
        out.push(format!("recompute {}→{}", ra.recompute, rb.recompute));
    }
    out
}

fn breakdown_parts(t: &TimeReport) -> [(&'static str, f64); 5] {
    let b = &t.breakdown;
    [
        ("compute", b.compute_s),
        ("recomputation", b.recompute_s),
        ("exposed communication", b.exposed_comm_s),
        ("pipeline bubble", b.bubble_s),
        ("the optimizer step", b.optimizer_s),
    ]
}

fn reason(
    top: &[Candidate],
    rejected: Option<&Candidate>,
    n_rejected: usize,
    budget: u64,
) -> String {
    let w = &top[0];
    let t = &w.time;
    let mut s = format!(
        "{} wins: {:.0} tokens/s, MFU {:.1}%, peak {:.1} GiB of a {:.1} GiB budget",
        w.flags,
        t.tokens_per_s,
        t.mfu * 100.0,
        gib(w.peak),
        gib(budget)
    );
    if w.layout.pp > 1 {
        s.push_str(&format!(
            "; pp {} adds a {:.1}% bubble",
            w.layout.pp,
            t.breakdown.bubble_s / t.step_s * 100.0
        ));
    }
    let comm = t.breakdown.exposed_comm_s / t.step_s * 100.0;
    if comm >= 1.0 {
        s.push_str(&format!(
            "; {:.1}% of the step is exposed communication",
            comm
        ));
    }
    s.push('.');
    if let Some(r) = rejected {
        let ch = changes(r, w);
        s.push_str(&format!(
            " {} faster layout{} do{} not fit; the closest, {}, would be {:.1}% faster but peaks at {:.1} GiB{}",
            n_rejected,
            if n_rejected == 1 { "" } else { "s" },
            if n_rejected == 1 { "es" } else { "" },
            r.flags,
            (r.time.tokens_per_s / t.tokens_per_s - 1.0) * 100.0,
            gib(r.peak),
            if r.peak_rank == "model states alone" { " in model states alone" } else { "" }
        ));
        if !ch.is_empty() {
            s.push_str(&format!(
                "; the winner's {} keeps it in memory",
                ch.join(", ")
            ));
        }
        s.push('.');
    }
    if let Some(r) = top.get(1) {
        let (wp, rp) = (breakdown_parts(t), breakdown_parts(&r.time));
        let (label, extra) = wp
            .iter()
            .zip(rp.iter())
            .map(|(a, b)| (a.0, b.1 - a.1))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or(("compute", 0.0));
        let gain = (t.tokens_per_s / r.time.tokens_per_s - 1.0) * 100.0;
        if gain < 0.05 {
            s.push_str(&format!(
                " #2 ({}) is as fast; #1 is the simpler layout.",
                changes(w, r).join(", ")
            ));
            return s;
        }
        s.push_str(&format!(
            " It beats #2 ({}) by {:.1}%",
            changes(w, r).join(", "),
            gain
        ));
        if extra > 0.0 {
            s.push_str(&format!(
                ", which spends {} more per step on {}",
                crate::report::table::secs(extra),
                label
            ));
        }
        s.push('.');
    }
    s
}
