//! Work captured into a CUDA graph and replayed (#32 item 5): the backend's ops issued between
//! [`CudaKernels::begin_capture`] and [`CudaKernels::end_capture`] run nothing; they are kept,
//! arguments and all, as one graph that [`CudaKernels::replay`] launches with one call. A
//! trainer's micro-batch is a few hundred launches whose host cost (argument packing, the
//! cuBLASLt calls, the model's own bookkeeping) a small model's step cannot hide behind its
//! kernels; replayed, it is one launch (Nguyen et al., "Accelerating PyTorch with CUDA
//! Graphs", 2021: the same reason PyTorch's `torch.cuda.graphs` exists).
//!
//! A graph replays addresses and launch geometry, so what it needs of its caller is that
//! every buffer it touches is where it was at the capture (the plan's fixed offsets make that
//! so; the caller checks) and that what the host would have written during the work is written
//! before the launch: the embedding backward's grouping, which the eager backward computes
//! from the host's copy of the ids and uploads itself, is recorded during the capture
//! ([`Capturing::grouping`]) and rebuilt from that copy and uploaded before each launch. The
//! host-side effects of the captured ops are replayed too: the device's loss slots were added
//! to (`take_loss` must read them), and the ops are counted ([`DeviceOps::graphs`] for the
//! launch; the kernels inside are not launched by the host again).

use super::{host_ids, lock, CudaKernels, OPS};
use crate::kernels::{Memory, View};
use cudarc::driver::{sys, CudaGraph};
use std::ptr::NonNull;

/// An embedding backward inside the capture: the grouping of the `n` ids at device address
/// `tokens`, which its kernel reads from `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Grouping {
    tokens: u64,
    n: usize,
    at: u64,
}

/// What the backend notes while a capture is open.
#[derive(Debug, Default)]
pub(super) struct Capturing {
    groupings: Vec<Grouping>,
    adds_loss: bool,
}

impl Capturing {
    /// An embedding backward reads the grouping of `n` ids at `tokens` from `at`: uploaded
    /// before each launch of the graph, not inside it (a capture cannot copy from pageable
    /// memory, and the ids change from launch to launch).
    pub(super) fn grouping(&mut self, tokens: u64, n: usize, at: u64) -> Result<(), String> {
        if let Some(g) = self.groupings.iter().find(|g| g.at == at) {
            return Err(format!(
                "two embedding backwards in one captured graph share the grouping scratch (ids at {:#x} and {tokens:#x}): the second would overwrite the first's before it runs",
                g.tokens
            ));
        }
        self.groupings.push(Grouping { tokens, n, at });
        Ok(())
    }

    /// The work added to the device's loss slots.
    pub(super) fn adds_loss(&mut self) {
        self.adds_loss = true;
    }
}

/// A captured graph, with what its launch needs from the host.
pub struct CapturedWork {
    graph: CudaGraph,
    groupings: Vec<Grouping>,
    adds_loss: bool,
}

impl std::fmt::Debug for CapturedWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedWork")
            .field("groupings", &self.groupings)
            .field("adds_loss", &self.adds_loss)
            .finish_non_exhaustive()
    }
}

impl CudaKernels {
    /// Starts capturing this thread's compute stream: the backend's ops from here to
    /// [`end_capture`](Self::end_capture) are recorded, not run. Thread-local mode: CUDA
    /// refuses what would break the capture on this thread (a synchronisation, a copy from
    /// pageable memory, an allocation) and leaves other threads' work alone.
    pub fn begin_capture(&self) -> Result<(), String> {
        self.bind();
        let mut c = lock(&self.capturing);
        if c.is_some() {
            return Err("a capture is already open".into());
        }
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        (self.gpu.stream.begin_capture(mode))
            .map_err(|e| format!("CUDA could not start capturing the compute stream: {e:?}"))?;
        *c = Some(Capturing::default());
        Ok(())
    }

    /// Ends the capture: the work recorded since [`begin_capture`](Self::begin_capture), as a
    /// graph ready to launch. Nothing of it has run.
    pub fn end_capture(&self) -> Result<CapturedWork, String> {
        let noted = lock(&self.capturing).take().ok_or("no capture is open")?;
        let graph = (self.gpu.stream.end_capture(sys::CUgraphInstantiate_flags(0)))
            .map_err(|e| format!("CUDA could not capture the work (an op a graph cannot hold invalidated the capture): {e:?}"))?
            .ok_or("the capture recorded no work")?;
        Ok(CapturedWork {
            graph,
            groupings: noted.groupings,
            adds_loss: noted.adds_loss,
        })
    }

    /// Launches `work` on the compute stream behind the work queued before: first the
    /// groupings of the ids now on the device (from the host's copies, `Kernels::host_ids`),
    /// then the graph.
    pub fn replay(&self, work: &CapturedWork) -> Result<(), String> {
        self.bind();
        let ordinal = self.gpu.ctx.ordinal() as u32;
        for g in &work.groupings {
            // SAFETY: the address and length were a view of device ids when the graph was
            // captured, and the caller keeps every buffer of the graph where it was; the ids
            // are taken from the host's mirror of them (read back where there is none, as the
            // eager backward does).
            let ids: View<'_, u32> = unsafe {
                View::from_raw_parts(
                    NonNull::new(g.tokens as *mut u32).ok_or("a null ids address")?,
                    g.n,
                    Memory::Device(ordinal),
                )
            };
            // The scratch the captured kernel reads, the grouping's one length for `n` ids.
            self.upload_grouping(g.at, host_ids::ids().grouping(ids));
        }
        OPS.graph();
        (work.graph.launch())
            .map_err(|e| format!("CUDA could not launch the captured graph: {e:?}"))?;
        if work.adds_loss {
            self.loss_added();
        }
        Ok(())
    }
}
