//! The single changes the verdict tries when a configuration does not fit. Each turns one knob of
//! the recipe or layout; those that reshape the data-parallel group keep the global batch by
//! moving the difference into gradient accumulation where they can (and the verdict reports the
//! global batch of every option, so a change that cannot keep it says so).

use crate::layout::{Offload, PpSchedule};
use crate::planner::{ModelSource, PlanInput};
use crate::recipe::Recompute;

/// What a change turns. A combination turns each knob at most once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Knob {
    Zero,
    Recompute,
    MicroBatch,
    Tp,
    Pp,
    Dp,
    Offload,
}

/// One change applied to an input.
pub(super) struct Change {
    pub knob: Knob,
    /// What it does to memory.
    pub why: String,
    /// What it costs in speed, in words (the step-time model gives numbers where it can run).
    pub cost: &'static str,
    pub input: PlanInput,
}

/// Candidate single changes of `x`, cheapest first by what they usually cost in speed:
/// sharding optimizer states costs no extra communication volume (ZeRO paper §7), selective
/// recompute a few percent of compute (Korthikanti et al. 2022), a smaller micro-batch lowers
/// GEMM efficiency, full recompute adds about a third of compute, more tensor/pipeline
/// parallelism adds communication or bubbles, offloading adds host transfers (ZeRO-Offload,
/// Ren et al. 2021), parameter offload streams the weights over PCIe every micro-batch
/// (ZeRO-Infinity, Rajbhandari et al. 2021). The order is the fallback ranking when no
/// step-time estimate is available. Changes the planner rejects are dropped by the caller,
/// which plans every candidate.
pub(super) fn candidates(x: &PlanInput) -> Vec<Change> {
    let (r, l) = (&x.recipe, &x.layout);
    let mut out: Vec<Change> = Vec::new();
    let mut push = |knob, why: String, cost, f: &dyn Fn(&mut PlanInput)| {
        let mut y = x.clone();
        f(&mut y);
        out.push(Change {
            knob,
            why,
            cost,
            input: y,
        });
    };
    let replicas = l.dense_replicas();
    if l.zero < 1 && replicas > 1 {
        push(
            Knob::Zero,
            "shards fp32 master weights and optimizer states over the data-parallel ranks".into(),
            "no extra communication volume; parameters all-gathered after the optimizer step",
            &|y| y.layout.zero = 1,
        );
    }
    if r.recompute == Recompute::None {
        push(
            Knob::Recompute,
            "drops the cheap, large activations and recomputes them".into(),
            "recomputes norms and activation functions in the backward (a few % of compute)",
            &|y| y.recipe.recompute = Recompute::Selective,
        );
    }
    if l.zero < 2 && replicas > 1 && l.pp == 1 {
        push(
            Knob::Zero,
            "also shards gradients".into(),
            "gradients reduce-scattered in every micro-batch's backward",
            &|y| y.layout.zero = 2,
        );
    }
    // Halving the micro-batch, or going straight to 1 when it is larger than 2; gradient
    // accumulation grows by the same factor so the global batch stays.
    let mut smaller: Vec<u64> = vec![];
    if r.mbs > 1 {
        smaller.push(r.mbs / 2);
    }
    if r.mbs > 2 {
        smaller.push(1);
    }
    smaller.dedup();
    for mbs in smaller {
        if !r.mbs.is_multiple_of(mbs) {
            continue;
        }
        let ga = r.grad_acc.saturating_mul(r.mbs / mbs);
        push(
            Knob::MicroBatch,
            format!("fewer activations per micro-batch ({mbs} sequences), same global batch"),
            "smaller GEMMs run less efficiently; more micro-batches per step",
            &move |y| {
                y.recipe.mbs = mbs;
                y.recipe.grad_acc = ga;
            },
        );
    }
    if r.recompute != Recompute::Full {
        push(
            Knob::Recompute,
            "keeps only each layer's input".into(),
            "replays every layer's forward in the backward (about +33% compute)",
            &|y| y.recipe.recompute = Recompute::Full,
        );
    }
    if let ModelSource::Spec(m) = &x.model {
        let tp = l.tp.saturating_mul(2);
        if m.heads % tp == 0 && m.kv_heads % tp == 0 {
            push(
                Knob::Tp,
                "splits weights and activations over more tensor-parallel ranks".into(),
                "tensor-parallel collectives in every layer, on the critical path",
                &move |y| {
                    y.layout.tp = tp;
                    y.layout.sp = true;
                    trade_dp_for(y);
                },
            );
        }
    }
    if l.zero < 3 && replicas > 1 && l.pp == 1 {
        push(
            Knob::Zero,
            "also shards the parameters (gathered layer by layer)".into(),
            "1.5× the data-parallel traffic (parameters gathered for forward and backward)",
            &|y| y.layout.zero = 3,
        );
    }
    if let ModelSource::Spec(m) = &x.model {
        let pp = l.pp.saturating_mul(2);
        if m.layers.is_multiple_of(pp.saturating_mul(l.pp_virtual)) && l.zero < 2 {
            push(
                Knob::Pp,
                "splits the layers over more pipeline stages".into(),
                "pipeline bubble of (p − 1)/(v·m) of the step, sends between stages",
                &move |y| {
                    y.layout.pp = pp;
                    trade_dp_for(y);
                    // The interleaved schedule needs whole rounds of pp micro-batches.
                    if y.layout.pp_schedule == PpSchedule::Interleaved
                        && y.recipe.grad_acc % pp != 0
                    {
                        y.recipe.grad_acc = y.recipe.grad_acc.div_ceil(pp) * pp;
                    }
                },
            );
        }
    }
    // At least ZeRO-1, or the new replicas would each hold every state again.
    let zero = l.zero.max(1);
    push(
        Knob::Dp,
        "adds data-parallel ranks and shards the optimizer states over them (ZeRO)".into(),
        "gradient reduction over the data-parallel group every step",
        &move |y| {
            y.layout.dp = y.layout.dp.saturating_mul(2);
            y.layout.zero = zero;
            // Keep the global batch: fewer micro-batches, else smaller ones; when both are
            // odd it doubles, and the option reports it.
            if y.recipe.grad_acc.is_multiple_of(2) {
                y.recipe.grad_acc /= 2;
            } else if y.recipe.mbs.is_multiple_of(2) {
                y.recipe.mbs /= 2;
            }
        },
    );
    if l.offload == Offload::None {
        push(
            Knob::Offload,
            "moves master weights and optimizer states to host memory".into(),
            "optimizer step on the host; gradients and weights cross PCIe every step",
            &|y| y.layout.offload = Offload::Optimizer,
        );
    }
    if l.offload != Offload::Params {
        push(
            Knob::Offload,
            "also moves parameters and gradients to host memory, streamed layer by layer".into(),
            "weights streamed over PCIe in every forward and backward, optimizer step on the host",
            &|y| y.layout.offload = Offload::Params,
        );
    }
    out
}

/// After doubling tp or pp: halve dp (same GPU count) and double gradient accumulation (same
/// global batch) when dp is even; otherwise the change adds GPUs and dp stays.
fn trade_dp_for(y: &mut PlanInput) {
    if y.layout.dp.is_multiple_of(2) {
        y.layout.dp /= 2;
        y.recipe.grad_acc = y.recipe.grad_acc.saturating_mul(2);
    }
}
