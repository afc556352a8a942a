//! The measured memory timeline (`--memory-timeline`): live bytes sampled at every phase
//! boundary of the first steps (see `pool::Timeline`) next to the plan's prediction for the
//! same point, matched by the plan's `Mark` label.

use crate::memory::pool::{Point, Sample};
use anyhow::{Context, Result};
use ferrotron_plan::memory::Phase;
use ferrotron_plan::RankPlan;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// One boundary: measured and planned bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineEntry {
    /// The plan's label for this point, with the real step number.
    pub label: String,
    pub step: u64,
    pub phase: String,
    /// Live heap bytes over the trainer's baseline (the definition of `mem_peak_measured`).
    pub measured: u64,
    /// The plan's live bytes at its mark of the same name.
    pub planned: u64,
    /// measured / planned - 1.
    pub deviation: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineFile {
    pub model: String,
    pub baseline: u64,
    /// The plan's overhead term (the kernel workspace), not part of `planned`: see `note`.
    pub kernel_workspace: u64,
    /// Micro-batches per step the plan simulates: every micro-batch is sampled, and one from
    /// this index on is compared with the plan's last simulated micro-batch (see `note`).
    pub plan_micro_batches: u64,
    pub note: String,
    /// Largest |deviation| over all points.
    pub max_abs_deviation: f64,
    pub points: Vec<TimelineEntry>,
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Init => "init",
        Phase::Forward => "forward",
        Phase::Loss => "loss",
        Phase::Backward => "backward",
        Phase::Optimizer => "optimizer",
    }
}

/// The plan's label of a sample at plan step `s` and micro-batch `mb` (the plan models steps 1
/// and 2, every later step being a copy of step 2 with the optimizer states present, and its
/// first `simulated_micro_batches` micro-batches, every later one a copy of the last).
fn label(x: &Sample, s: u64, mb: u64) -> String {
    match x.point {
        Point::Init => "model init".into(),
        Point::Grads => "gradients allocated".into(),
        Point::Forward { layer } => format!("step {s} mb {mb} forward layer {layer}"),
        Point::Loss => format!("step {s} mb {mb} loss"),
        Point::Backward { layer } => format!("step {s} mb {mb} backward layer {layer}"),
        Point::Optimizer => format!("step {s} optimizer"),
    }
}

/// Pairs every sample with the plan's mark of the same label. Samples the plan has no mark for
/// are an internal error.
pub fn build(
    model: &str,
    plan: &RankPlan,
    baseline: u64,
    samples: &[Sample],
) -> Result<TimelineFile> {
    let marks: HashMap<&str, (Phase, u64)> = plan
        .sweep
        .marks
        .iter()
        .map(|m| (m.label.as_str(), (m.phase, m.live)))
        .collect();
    let mut points = Vec::with_capacity(samples.len());
    let mut worst = 0f64;
    let last_mb = plan.simulated_micro_batches.saturating_sub(1);
    for x in samples {
        let key = label(x, x.step.min(2), x.mb.min(last_mb));
        let &(phase, live) = marks
            .get(key.as_str())
            .with_context(|| format!("internal: the memory plan has no mark `{key}`"))?;
        let planned = live;
        let deviation = x.measured as f64 / planned.max(1) as f64 - 1.0;
        worst = worst.max(deviation.abs());
        points.push(TimelineEntry {
            label: label(x, x.step, x.mb),
            step: x.step,
            phase: phase_name(phase).into(),
            measured: x.measured,
            planned,
            deviation,
        });
    }
    Ok(TimelineFile {
        model: model.into(),
        baseline,
        kernel_workspace: plan.overhead,
        plan_micro_batches: plan.simulated_micro_batches,
        note: NOTE.into(),
        max_abs_deviation: worst,
        points,
    })
}

pub fn write(path: &Path, t: &TimelineFile) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("memory_timeline = {}: cannot create", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(t)?)
        .with_context(|| format!("memory_timeline = {}: cannot write", path.display()))
}

/// What the numbers are, in the file itself. The kernel workspace (gemm's packing buffers) lives
/// only inside a matmul call, and every boundary falls between kernel calls, so it is in the
/// plan's peaks (`mem_peak_planned`) but neither measured nor planned at a boundary: adding it
/// here would put every point about 2 MiB (4% at init for ferrotron-12m) off.
const NOTE: &str = "measured = live heap bytes over the baseline taken once the rank's tables (its plan, the model's parameter tables) are built and before any buffer the plan lists is; planned = the memory plan's live bytes at the mark of the same label (steps after 2 use step 2's marks; micro-batches from plan_micro_batches on use the last simulated micro-batch's marks, which hold the same buffers). Every micro-batch of the recorded steps is sampled. kernel_workspace is transient inside matmul calls, between the marks, so neither includes it; the step peaks do.";
