//! `--cuda-graph`: a micro-batch's forward and backward captured once into a CUDA graph and
//! replayed for every later micro-batch (#32 item 5). A GPU step of a small model is bound by
//! the host: a few hundred launches per micro-batch, each packed and issued by the model's
//! host code, against kernels of microseconds. Replayed, a micro-batch is one launch, and the
//! model's host code does not run at all (Nguyen et al., "Accelerating PyTorch with CUDA
//! Graphs", PyTorch blog, 2021).
//!
//! What makes it possible is the plan: every activation has a fixed offset in the arena, the
//! weights, gradients and the batch's ids fixed buffers, so a graph's addresses stay right
//! from step to step. [`Placement`] is what the graph saw; a micro-batch whose buffers are
//! elsewhere (the arena placed anew after an evaluation, say) is captured again. Capture
//! starts at the process's step [`FIRST_CAPTURED_STEP`] (a resumed run's too): before it, the
//! arena's region is placed anew and the backend's scratch grows (allocations, which a capture
//! cannot hold); a traced step runs eagerly (its ops timed one by one).
//!
//! Each replay first writes what the host would have written inside the work (the batch's
//! ids, as eagerly; the embedding backward's grouping, `CudaKernels::replay`), and the host's
//! side of the step is kept: the arena's region is held as the forward would hold it, the
//! loss is the device's sum read at the step's end as eagerly, and the target count is the
//! host's. The update stays eager (the learning rate, clip factor and step count are kernel
//! arguments that change every step). Only a single-rank dense step is captured: the
//! conditions are checked with the configuration ([`check_run`], [`check_model`]).

use super::*;

/// The first of this process's steps captured (1-based; a resumed run counts from its first
/// step too: its arena and the backend's scratch are placed anew).
pub(super) const FIRST_CAPTURED_STEP: u64 = 3;

/// The device addresses a captured graph reads and writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Placement {
    /// The activation arena's region.
    pub arena: usize,
    /// The micro-batch's ids and targets.
    pub tokens: usize,
    pub targets: usize,
    /// The weights and gradients (`state`).
    pub state: [usize; 2],
    /// The bits of fp16's loss scale (1 at other precisions), which the cross-entropy's
    /// gradient kernel takes as an argument: a graph replays the scale it was captured with,
    /// so a scale the loss scaler has changed is captured again. (fp8's per-tensor scales
    /// need nothing: they are computed on the device from each operand's amax, and read by
    /// cuBLASLt through pointers.)
    pub loss_scale: u32,
}

/// The captured micro-batch.
#[derive(Debug, Default)]
pub(super) struct MicroBatchGraph {
    /// The weights' and gradients' addresses this step.
    pub state: [usize; 2],
    /// Steps this process has begun ([`begin_step`](Self::begin_step)).
    steps: u64,
    /// This step's micro-batches are graphs'.
    pub on: bool,
    #[cfg(feature = "cuda")]
    captured: Option<(Placement, ferrotron_engine::kernels::cuda::CapturedWork)>,
}

/// What the micro-batch loop does with one micro-batch.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only a GPU captures
pub(super) enum Graphed {
    /// Run it as is (no graph this step, or no GPU).
    Eager,
    /// Run it as is while the backend captures it, then [`MicroBatchGraph::captured`].
    Capture,
    /// Replayed: nothing more to run.
    Replayed,
}

/// Why `--cuda-graph` cannot apply to a run on `device` in `layout`, checked with the
/// configuration (the model's part, [`check_model`], once it is read).
pub(crate) fn check_run(
    device: crate::device::Device,
    layout: &ferrotron_plan::Layout,
) -> Result<(), &'static str> {
    let l = layout;
    if device != crate::device::Device::Cuda {
        Err("CUDA graphs replay a GPU's work: add --device cuda, or drop --cuda-graph")
    } else if l.dp * l.tp * l.pp * l.cp * l.ep > 1 {
        Err("only a single-rank step is captured (each rank's collectives and exchanges would run outside the graph): drop the parallel layout or --cuda-graph")
    } else if l.offload != ferrotron_plan::Offload::None {
        Err("the offload tiers copy the step's buffers on their own streams, outside the graph: drop --offload or --cuda-graph")
    } else {
        Ok(())
    }
}

/// Why `--cuda-graph` cannot apply to `llama`.
pub(super) fn check_model(llama: &LlamaConfig) -> Result<()> {
    if llama.moe.is_some() {
        bail!("cuda_graph: a mixture of experts builds its routing tables on the host from its router's choices, between its kernels: a graph cannot hold it; drop --cuda-graph");
    }
    Ok(())
}

impl MicroBatchGraph {
    /// A step begins with the weights and gradients at `state`: whether its micro-batches
    /// are graphs' (untraced: a trace times each op eagerly).
    pub(super) fn begin_step(&mut self, state: [usize; 2], traced: bool) {
        self.steps += 1;
        self.state = state;
        self.on = self.steps >= FIRST_CAPTURED_STEP && !traced;
    }

    /// Before micro-batch work placed at `at`: replays the graph if it was captured there,
    /// else opens a capture on `k` (a GPU backend) and says the work must run.
    pub(super) fn before(&mut self, k: &Backend, at: Placement) -> Result<Graphed> {
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(k) = k {
            if let Some((placed, work)) = &self.captured {
                if *placed == at {
                    k.replay(work)
                        .map_err(|e| anyhow::anyhow!("cuda_graph: {e}"))?;
                    return Ok(Graphed::Replayed);
                }
                // Elsewhere now: captured again (the old graph's addresses are stale).
                self.captured = None;
            }
            k.begin_capture()
                .map_err(|e| anyhow::anyhow!("cuda_graph: {e}"))?;
            return Ok(Graphed::Capture);
        }
        let _ = (k, at);
        Ok(Graphed::Eager)
    }

    /// The micro-batch's work was captured at `at`: the graph is kept, and launched for it.
    pub(super) fn captured(&mut self, k: &Backend, at: Placement) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(k) = k {
            let work = k
                .end_capture()
                .map_err(|e| anyhow::anyhow!("cuda_graph: {e}"))?;
            k.replay(&work)
                .map_err(|e| anyhow::anyhow!("cuda_graph: {e}"))?;
            self.captured = Some((at, work));
            return Ok(());
        }
        let _ = (k, at);
        bail!("internal: a capture without a GPU")
    }
}
