//! The non-tensor memory overhead model, and (re-exported from `cluster.rs`) the GPU kinds whose
//! capacity the fit verdict uses.

use crate::error::{PlanError, Result};
use serde::Serialize;

const GIB: u64 = 1 << 30;

/// The GPU table lives in `cluster.rs` (one table for capacity, FLOPS, bandwidth and links);
/// re-exported here for the memory verdict.
pub use crate::cluster::{gpu, gpu_names, gpus, Gpu};

/// Memory a process uses beyond its tensors: the runtime context (CUDA context, cuBLAS and
/// NCCL workspaces) and the caching allocator's fragmentation, as a fraction of the allocated
/// peak. Both are assumptions, stated in every report and configurable.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Overhead {
    pub context_bytes: u64,
    pub fragmentation: f64,
}

impl Overhead {
    /// Default for a GPU: 1 GiB of context and a 5% fragmentation margin.
    pub const GPU_DEFAULT: Overhead = Overhead {
        context_bytes: GIB,
        fragmentation: 0.05,
    };
    /// No overhead: the allocated bytes alone (used for published tables and the CPU trainer).
    pub const NONE: Overhead = Overhead {
        context_bytes: 0,
        fragmentation: 0.0,
    };

    pub fn bytes(&self, allocated: u64) -> u64 {
        self.context_bytes + (allocated as f64 * self.fragmentation).ceil() as u64
    }

    pub fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.fragmentation) || self.fragmentation.is_nan() {
            return Err(PlanError::setting(
                "fragmentation",
                self.fragmentation,
                "must be a fraction in [0, 1), e.g. 0.05",
            ));
        }
        Ok(())
    }
}
