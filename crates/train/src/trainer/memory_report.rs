//! A rank's memory against its plan: every rank's planned and measured peaks, the kernels'
//! workspace measured once, the planned peak of a step, and the trace's capacity.

use super::*;

/// Every rank's planned and measured peak and kernel workspace, rank order.
pub(super) fn rank_mems(all: &[[u64; 3]]) -> Vec<RankMem> {
    all.iter()
        .enumerate()
        .map(|(rank, &[p, m, w])| RankMem {
            rank,
            mem_peak_planned: p,
            mem_peak_measured: m,
            kernel_workspace: w,
        })
        .collect()
}

/// The kernel workspace of a precision's types (see `workspace`).
pub(super) fn measure_workspace(
    k: &CpuKernels,
    p: Precision,
    c: &LlamaConfig,
    n: usize,
    chunk: usize,
) -> KernelWorkspace {
    use half::{bf16, f16};
    match p {
        Precision::Fp32 => workspace::measure::<f32, f32>(k, c, n, chunk),
        Precision::Bf16 | Precision::Fp8 => workspace::measure::<bf16, bf16>(k, c, n, chunk),
        Precision::Bf16Fp32grads => workspace::measure::<bf16, f32>(k, c, n, chunk),
        Precision::Fp16 => workspace::measure::<f16, f16>(k, c, n, chunk),
    }
}

/// The resident layouts as the memory a rank's peak is measured in holds them. A GPU's peak is
/// its allocator's count, and its communication buffers are the host staging of its
/// communicator (`memory/resident.rs`), so their block weighs nothing there; an emulated
/// device's memory is host memory, counted with them by the tracking allocator. (Found by the
/// CUDA emulator: dp 2 on `--device cuda` measured its two buckets below its plan.)
pub(super) fn on_device(
    mut layouts: [ArenaLayout; 4],
    device: Option<&Arc<dyn DeviceAlloc>>,
) -> [ArenaLayout; 4] {
    if device.is_some_and(|d| d.peak().is_some()) {
        layouts[0].bytes = 0;
    }
    layouts
}

/// Planned peak of steps 1 and 2. The kernel workspace is live only while a product runs: the
/// layers' in the forward and backward phases, the LM head's in the loss phase, none at the
/// optimizer step (where step 1 allocates the Adam states and no GEMM runs). The plan's
/// overhead term is the larger of the two, the bound for a phase nobody tells it about.
///
/// The marks are those of the plan as the allocator sees it, with the activation arena held
/// whole from a micro-batch's first buffer to its last (`ferrotron_plan::arena::with_region`)
/// and the resident regions (communication buffers, Adam's moments: `ferrotron_plan::resident`;
/// the weights with their master copy, the gradients: `ferrotron_plan::state_regions`) from
/// their first buffer on, each with its alignment padding.
pub(super) fn step_peaks(
    plan: &RankPlan,
    [resident, moments, weights, grads]: &[ArenaLayout; 4],
    arena: &ArenaLayout,
    ws: KernelWorkspace,
) -> [u64; 2] {
    use ferrotron_plan::resident::{with_moments, with_resident};
    use ferrotron_plan::state_regions::{with_grads, with_weights};
    let mut out = [plan.overhead; 2];
    let held = with_moments(&with_resident(&plan.plan, resident), moments);
    let held = with_grads(&with_weights(&held, weights), grads);
    let held = with_region(&held, arena).sweep();
    for m in &held.marks {
        let i = (m.step as usize).saturating_sub(1).min(1);
        let peak = match m.phase {
            Phase::Init => continue,
            // (A GPU's workspace stays through the update: found by the CUDA emulator, where a
            // first pipeline stage's peak is its update, the moments outweighing its arena.)
            Phase::Optimizer => m.live + ws.resident,
            Phase::Loss => m.max_since_previous + ws.head,
            Phase::Forward | Phase::Backward => m.max_since_previous + ws.layers,
        };
        out[i] = out[i].max(peak);
    }
    out
}

/// Expected events of `steps` traced steps, with any evaluation: about 50 kernel calls per layer
/// per micro-batch forward and backward, four per LM-head chunk, one AdamW call per tensor.
pub(super) fn trace_capacity(cfg: &TrainConfig, c: &LlamaConfig, steps: u64) -> usize {
    let n = (cfg.data.mbs * cfg.data.seq) as usize;
    let chunks = n.div_ceil(cfg.runtime.ce_chunk.max(1) as usize);
    let per_mb = 64 * c.layers + 8 * chunks + 32;
    let tensors = 16 * c.layers + 8;
    let eval = cfg.observability.eval_batches as usize * (32 * c.layers + 4 * chunks + 8);
    steps as usize * (cfg.data.grad_acc as usize * per_mb + tensors + 16 + eval)
}

impl Trainer {
    /// Kernel workspace included in the plan (see `workspace`).
    pub fn kernel_workspace(&self) -> u64 {
        self.plan.overhead
    }

    /// Planned peak bytes of step 1 (no optimizer states yet) or any later step.
    /// Adds to this rank's memory plan a buffer of `bytes` live from before the first step to
    /// the end (a checkpoint's staging buffer), which the caller allocates now.
    pub fn plan_persistent(&mut self, name: &str, bytes: u64) {
        use ferrotron_plan::memory::{Category, Op};
        let plan = &mut self.plan;
        let id = plan.plan.add(
            name,
            ferrotron_plan::DType::U8,
            bytes,
            Category::CommBuffers,
        );
        plan.plan.program.insert(0, Op::Alloc(id));
        plan.sweep = plan.plan.sweep();
        plan.at_peak = plan.sweep.at_peak;
        plan.peak += bytes;
        for p in &mut self.planned_peak {
            *p += bytes;
        }
    }

    pub fn planned_peak_step(&self, step: u64) -> u64 {
        self.planned_peak[(step > 1) as usize]
    }

    /// Planned peak bytes of a step with optimizer states present (the steady-state step).
    pub fn planned_peak(&self) -> u64 {
        self.planned_peak[1]
    }
}
