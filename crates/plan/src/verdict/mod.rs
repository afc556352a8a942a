//! Does it fit? If not, what to change: the options that keep the GPU count first (a user with
//! one GPU cannot take the others), then those that add GPUs. Every option is planned — its
//! peak and whether it fits come from the planner, and options the planner rejects are not
//! listed — and timed with the step-time model when a cluster is known.

mod change;
mod combine;
mod flags;
mod timing;

pub use timing::Timing;

use crate::error::Result;
use crate::hardware::Gpu;
use crate::planner::{ModelSource, PlanInput};
use combine::{combinations, singles, Gpus, Tried};
use serde::Serialize;
use serde_json::{Map, Value};
use std::cmp::Ordering;
use timing::{Clock, Speed};

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub gpu: String,
    pub capacity: u64,
    pub peak: u64,
    pub fits: bool,
    /// capacity − peak (negative when it does not fit).
    pub free: i64,
    /// GPUs the configuration uses.
    pub gpus: u64,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// When it does not fit: the recommended change, the first option that fits — on the same
    /// GPUs whenever one does.
    pub suggestion: Option<Suggestion>,
    /// When it does not fit: the changes that lower the peak (and that the planner accepts),
    /// those on the same GPUs first, then those that add GPUs; within
    /// each, those that fit first (cheapest first: fewest GPUs, then predicted time, or the
    /// usual cost order without a time estimate), then those that do not (lowest peak first).
    pub options: Vec<Suggestion>,
}

/// One option: a change, or a combination when no single change fits.
#[derive(Debug, Clone, Serialize)]
pub struct Suggestion {
    /// Command-line flags that apply it, e.g. `--offload optimizer`.
    pub flags: String,
    /// The settings it changes, keyed as in the JSON API and TOML files.
    pub set: Map<String, Value>,
    pub why: String,
    /// Planned peak of the most loaded rank.
    pub peak: u64,
    pub fits: bool,
    /// GPUs it uses, and whether that is more than the configuration as given.
    pub gpus: u64,
    pub adds_gpus: bool,
    /// Sequences per optimizer step (the same as the configuration's unless `why` says so).
    pub global_batch: u64,
    /// Predicted step time and throughput (with a cluster and an architecture).
    pub step_s: Option<f64>,
    pub tokens_per_s: Option<f64>,
    /// Time per token against the configuration as given (as if it fitted), minus one: 0.25 is
    /// 25% slower, negative is faster (e.g. with more GPUs).
    pub slowdown: Option<f64>,
    /// What it costs in speed, in words.
    pub cost: String,
}

/// An option with what ranks it.
struct Ranked {
    s: Suggestion,
    /// Position in the candidate order (summed over a combination).
    rank: usize,
    changes: usize,
    batch_changes: bool,
}

fn describe(x: &PlanInput, t: &Tried, capacity: u64, clock: Option<&Clock>) -> Ranked {
    let set = flags::changed(x, &t.input);
    let mut why = if t.whys.len() > 1 {
        format!("no single change fits; combined: {}", t.whys.join("; "))
    } else {
        t.whys.join("; ")
    };
    let (before, after) = (
        x.layout.global_batch(&x.recipe),
        t.input.layout.global_batch(&t.input.recipe),
    );
    if before != after {
        why.push_str(&format!(
            "; changes the global batch from {before} to {after} sequences"
        ));
    }
    let speed: Option<Speed> = clock.and_then(|c| c.speed(&t.input));
    let gpus = t.input.layout.world();
    Ranked {
        s: Suggestion {
            flags: flags::to_flags(&set),
            set: flags::to_map(&set),
            why,
            peak: t.peak.unwrap_or(u64::MAX),
            fits: t.fits(capacity),
            gpus,
            adds_gpus: gpus > x.layout.world(),
            global_batch: after,
            step_s: speed.map(|s| s.step_s),
            tokens_per_s: speed.map(|s| s.tokens_per_s),
            slowdown: speed.map(|s| s.slowdown),
            cost: t.costs.join("; "),
        },
        rank: t.rank,
        changes: t.knobs.len(),
        batch_changes: before != after,
    }
}

/// Fitting options first, cheapest first: fewest GPUs, then those that keep the global batch
/// (a different batch changes the training, not just its speed), then predicted time per token
/// (else the candidate order); then the others, closest to fitting first.
fn cheaper(a: &Ranked, b: &Ranked) -> Ordering {
    let (x, y) = (&a.s, &b.s);
    y.fits.cmp(&x.fits).then_with(|| {
        if x.fits {
            x.gpus
                .cmp(&y.gpus)
                .then(a.batch_changes.cmp(&b.batch_changes))
                .then_with(|| faster(a, b))
        } else {
            x.peak.cmp(&y.peak).then(a.rank.cmp(&b.rank))
        }
    })
}

/// By predicted time per token when both are timed, else by the candidate order.
fn faster(a: &Ranked, b: &Ranked) -> Ordering {
    match (a.s.slowdown, b.s.slowdown) {
        (Some(p), Some(q)) => p.total_cmp(&q),
        _ => Ordering::Equal,
    }
    .then(a.rank.cmp(&b.rank))
}

/// Whether `a` is `b` plus more changes: `b` then fits with no more GPUs and less changed.
fn contains(a: &Suggestion, b: &Suggestion) -> bool {
    b.gpus <= a.gpus && b.set.iter().all(|(k, v)| a.set.get(k) == Some(v))
}

/// The options of one group: each single change that is planned and lowers the peak, plus the
/// cheapest combination that fits when no single change does (unless it only adds changes to
/// an option that fits already, listed in `earlier`).
fn group_options(
    x: &PlanInput,
    peak: u64,
    tried: &[Tried],
    capacity: u64,
    clock: Option<&Clock>,
    group: Gpus,
    earlier: &[Suggestion],
) -> Vec<Suggestion> {
    let mut out: Vec<Ranked> = tried
        .iter()
        .filter(|t| t.peak.is_some_and(|p| p < peak) && Gpus::of(x, &t.input) == group)
        .map(|t| describe(x, t, capacity, clock))
        .collect();
    if !out.iter().any(|r| r.s.fits) {
        let best = combinations(x, tried, capacity, group)
            .iter()
            .map(|t| describe(x, t, capacity, clock))
            .filter(|c| !earlier.iter().any(|e| e.fits && contains(&c.s, e)))
            .min_by(|a, b| {
                a.batch_changes.cmp(&b.batch_changes).then_with(|| {
                    match (a.s.slowdown, b.s.slowdown) {
                        (Some(_), Some(_)) => faster(a, b),
                        // Untimed: fewer changes first.
                        _ => a.changes.cmp(&b.changes).then(a.rank.cmp(&b.rank)),
                    }
                })
            });
        out.extend(best);
    }
    out.sort_by(cheaper);
    out.into_iter().map(|r| r.s).collect()
}

/// The verdict for a configuration whose most loaded rank peaks at `peak` on `gpu`; with
/// `timing`, every option gets a predicted step time.
pub fn verdict(x: &PlanInput, peak: u64, gpu: &Gpu, timing: Option<Timing>) -> Result<Verdict> {
    // The candidates are built from the input's settings: refuse an input the planner would.
    x.recipe.validate()?;
    let spec = match &x.model {
        ModelSource::Spec(m) => Some(m),
        ModelSource::Params(_) | ModelSource::Counted { .. } => None,
    };
    x.layout.validate(spec, &x.recipe)?;
    let capacity = gpu.capacity;
    let fits = peak <= capacity;
    let mut options = Vec::new();
    if !fits {
        let clock = timing.and_then(|t| Clock::new(x, t));
        let tried = singles(x);
        for group in [Gpus::Same, Gpus::More] {
            let found = group_options(x, peak, &tried, capacity, clock.as_ref(), group, &options);
            options.extend(found);
        }
    }
    Ok(Verdict {
        gpu: gpu.name.to_string(),
        capacity,
        peak,
        fits,
        free: capacity as i64 - peak as i64,
        gpus: x.layout.world(),
        global_batch: x.layout.global_batch(&x.recipe),
        suggestion: options.iter().find(|o| o.fits).cloned(),
        options,
    })
}
