//! Does it fit? If not, the cheapest change that makes it fit.

use crate::error::Result;
use crate::hardware::Gpu;
use crate::layout::{Offload, PpSchedule};
use crate::planner::{plan, ModelSource, PlanInput};
use crate::recipe::Recompute;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub gpu: String,
    pub capacity: u64,
    pub peak: u64,
    pub fits: bool,
    /// capacity − peak (negative when it does not fit).
    pub free: i64,
    /// When it does not fit: the cheapest change (as CLI flags) that fits, and its peak.
    pub suggestion: Option<Suggestion>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Suggestion {
    pub flags: String,
    pub why: String,
    pub peak: u64,
}

type Change = (String, String, PlanInput);

/// Candidate single changes, cheapest first by what they cost in speed: sharding optimizer
/// states costs no extra communication volume (ZeRO paper §7), selective recompute a few
/// percent of compute (Korthikanti et al. 2022), a smaller micro-batch lowers GEMM efficiency,
/// full recompute adds about a third of compute, more tensor/pipeline parallelism adds
/// communication or bubbles, offloading adds host transfers.
fn candidates(x: &PlanInput) -> Vec<Change> {
    let (r, l) = (&x.recipe, &x.layout);
    let mut out: Vec<Change> = Vec::new();
    let mut push = |flags: String, why: &str, f: &dyn Fn(&mut PlanInput)| {
        let mut y = x.clone();
        f(&mut y);
        out.push((flags, why.to_string(), y));
    };
    let replicas = l.dense_replicas();
    if l.zero < 1 && replicas > 1 {
        push(
            "--zero 1".into(),
            "shards fp32 master weights and optimizer states over the data-parallel ranks",
            &|y| y.layout.zero = 1,
        );
    }
    if r.recompute == Recompute::None {
        push(
            "--recompute selective".into(),
            "drops the cheap, large activations and recomputes them",
            &|y| y.recipe.recompute = Recompute::Selective,
        );
    }
    if l.zero < 2 && replicas > 1 && l.pp == 1 {
        push("--zero 2".into(), "also shards gradients", &|y| {
            y.layout.zero = 2
        });
    }
    if r.mbs > 1 {
        let (mbs, ga) = (r.mbs / 2, r.grad_acc * 2);
        push(
            format!("--mbs {mbs} --grad-acc {ga}"),
            "halves activations, same global batch",
            &move |y| {
                y.recipe.mbs = mbs;
                y.recipe.grad_acc = ga;
            },
        );
    }
    if r.recompute != Recompute::Full {
        push(
            "--recompute full".into(),
            "keeps only each layer's input (about +33% compute)",
            &|y| y.recipe.recompute = Recompute::Full,
        );
    }
    if let ModelSource::Spec(m) = &x.model {
        let tp = l.tp * 2;
        if m.heads % tp == 0 && m.kv_heads % tp == 0 {
            let (flags, dp) = if l.dp % 2 == 0 {
                (format!("--tp {tp} --dp {} (same GPUs)", l.dp / 2), l.dp / 2)
            } else {
                (format!("--tp {tp} (2x the GPUs)"), l.dp)
            };
            push(
                flags,
                "splits weights and activations over more tensor-parallel ranks",
                &move |y| {
                    y.layout.tp = tp;
                    y.layout.dp = dp;
                    y.layout.sp = true;
                },
            );
        }
    }
    if l.zero < 3 && replicas > 1 && l.pp == 1 {
        push(
            "--zero 3".into(),
            "also shards the parameters (gathered layer by layer)",
            &|y| y.layout.zero = 3,
        );
    }
    if let ModelSource::Spec(m) = &x.model {
        let pp = l.pp * 2;
        if m.layers % (pp * l.pp_virtual) == 0 && l.zero < 2 {
            let (flags, dp) = if l.dp % 2 == 0 {
                (format!("--pp {pp} --dp {} (same GPUs)", l.dp / 2), l.dp / 2)
            } else {
                (format!("--pp {pp} (2x the GPUs)"), l.dp)
            };
            push(
                flags,
                "splits the layers over more pipeline stages",
                &move |y| {
                    y.layout.pp = pp;
                    y.layout.dp = dp;
                    if y.layout.pp_schedule == PpSchedule::Interleaved
                        && y.recipe.grad_acc % pp != 0
                    {
                        y.recipe.grad_acc = y.recipe.grad_acc.div_ceil(pp) * pp;
                    }
                },
            );
        }
    }
    if l.offload == Offload::None {
        push(
            "--offload optimizer".into(),
            "moves master weights and optimizer states to host memory",
            &|y| y.layout.offload = Offload::Optimizer,
        );
    }
    out
}

fn peak_of(x: &PlanInput) -> Option<u64> {
    plan(x).ok().map(|r| r.worst().peak)
}

/// The first candidate (in cost order) that fits; failing that, up to three changes applied
/// greedily, each time taking the one that lowers the peak the most.
fn cheapest_fix(x: &PlanInput, capacity: u64) -> Option<Suggestion> {
    for (flags, why, y) in candidates(x) {
        if let Some(p) = peak_of(&y) {
            if p <= capacity {
                return Some(Suggestion {
                    flags,
                    why,
                    peak: p,
                });
            }
        }
    }
    let mut cur = x.clone();
    let mut steps: Vec<String> = Vec::new();
    for _ in 0..3 {
        let best = candidates(&cur)
            .into_iter()
            .filter_map(|(f, _, y)| peak_of(&y).map(|p| (p, f, y)))
            .min_by_key(|(p, _, _)| *p)?;
        steps.push(best.1);
        cur = best.2;
        if best.0 <= capacity {
            return Some(Suggestion {
                flags: steps.join(" + "),
                why: "no single change fits; these combined do".into(),
                peak: best.0,
            });
        }
    }
    None
}

pub fn verdict(x: &PlanInput, peak: u64, gpu: &Gpu) -> Result<Verdict> {
    let fits = peak <= gpu.capacity;
    Ok(Verdict {
        gpu: gpu.name.to_string(),
        capacity: gpu.capacity,
        peak,
        fits,
        free: gpu.capacity as i64 - peak as i64,
        suggestion: if fits {
            None
        } else {
            cheapest_fix(x, gpu.capacity)
        },
    })
}
