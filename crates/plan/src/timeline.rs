//! The memory timeline over the first two steps, in the phases the playbook's predict_memory
//! tool shows, read off the sweep of a rank's program.

use crate::hardware::Overhead;
use crate::memory::{Phase, Sweep};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelinePoint {
    pub phase: String,
    /// Allocated bytes plus the overhead model at that point.
    pub bytes: u64,
}

/// Coarse timeline: model init, gradient buffers, forward/backward peaks and optimizer step of
/// steps 1 and 2, and the steady state between steps.
pub fn coarse(sweep: &Sweep, overhead: &Overhead) -> Vec<TimelinePoint> {
    let with = |b: u64| b + overhead.bytes(b);
    let mut out = Vec::new();
    let point = |out: &mut Vec<TimelinePoint>, phase: String, b: u64| {
        out.push(TimelinePoint {
            phase,
            bytes: with(b),
        });
    };
    if let Some(m) = sweep.marks.iter().find(|m| m.phase == Phase::Init) {
        point(&mut out, "model init".into(), m.live);
    }
    for step in 1..=2u32 {
        fn in_step<'a>(
            sweep: &'a Sweep,
            step: u32,
            ph: &'a [Phase],
        ) -> impl Iterator<Item = &'a crate::memory::MarkSample> + 'a {
            sweep
                .marks
                .iter()
                .filter(move |m| m.step == step && ph.contains(&m.phase))
        }
        // Gradients appear before the first forward (ferrotron's fused LM head) or at the
        // first backward (PyTorch); the point goes where it happens.
        let grads = in_step(sweep, step, &[Phase::Forward, Phase::Backward])
            .find(|m| m.label == "gradients allocated")
            .map(|m| (m.phase, m.live));
        let grads_point = |out: &mut Vec<TimelinePoint>| {
            if let Some((_, live)) = grads {
                point(
                    out,
                    format!("step {step}: gradient buffers allocated"),
                    live,
                );
            }
        };
        if matches!(grads, Some((Phase::Forward, _))) {
            grads_point(&mut out);
        }
        let fwd = in_step(sweep, step, &[Phase::Forward, Phase::Loss])
            .map(|m| m.max_since_previous)
            .max();
        if let Some(b) = fwd {
            point(&mut out, format!("step {step}: forward peak"), b);
        }
        if matches!(grads, Some((Phase::Backward, _))) {
            grads_point(&mut out);
        }
        let bwd = in_step(sweep, step, &[Phase::Backward])
            .map(|m| m.max_since_previous)
            .max();
        if let Some(b) = bwd {
            point(&mut out, format!("step {step}: backward peak"), b);
        }
        if let Some(m) = in_step(sweep, step, &[Phase::Optimizer]).last() {
            point(&mut out, format!("step {step}: optimizer step"), m.live);
            if step == 2 {
                point(&mut out, "steady state".into(), m.live);
            }
        }
    }
    out
}

/// Why step 2 peaks higher than step 1 (or, where the first optimizer step is the peak, why
/// step 1 does), in numbers from this plan: the peak of each step is the highest of its points.
pub fn step2_explanation(
    points: &[TimelinePoint],
    optimizer_bytes: u64,
    grad_bytes: u64,
) -> String {
    let step_peak = |step: u64| {
        let prefix = format!("step {step}: ");
        points
            .iter()
            .filter(|p| p.phase.starts_with(&prefix))
            .max_by_key(|p| p.bytes)
    };
    let (Some(s1), Some(s2)) = (step_peak(1), step_peak(2)) else {
        return String::new();
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if s2.bytes <= s1.bytes {
        return format!(
            "Step 1 peaks at its {} ({:.2} GiB), above step 2 ({:.2} GiB, at its {}): the first \
             optimizer step creates the optimizer states ({:.2} GiB) while the step's gradients \
             ({:.2} GiB) and buffers are still live; later steps reuse them.",
            s1.phase.trim_start_matches("step 1: "),
            gib(s1.bytes),
            gib(s2.bytes),
            s2.phase.trim_start_matches("step 2: "),
            gib(optimizer_bytes),
            gib(grad_bytes)
        );
    }
    format!(
        "Step 2 peaks {:.2} GiB above step 1 ({:.2} vs {:.2} GiB): the optimizer states \
         ({:.2} GiB) are created lazily by the first optimizer step, so they are live during \
         step 2's forward and backward but not step 1's; the gradients ({:.2} GiB) appear \
         during step 1 and are kept (zeroed, not freed) between steps, so step 2's forward also \
         starts from a higher floor.",
        gib(s2.bytes - s1.bytes),
        gib(s2.bytes),
        gib(s1.bytes),
        gib(optimizer_bytes),
        gib(grad_bytes)
    )
}
