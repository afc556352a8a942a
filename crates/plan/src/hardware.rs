//! Accelerator capacities for the fit verdict, and the non-tensor memory overhead model.

use crate::error::{PlanError, Result};
use serde::Serialize;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Gpu {
    pub name: &'static str,
    /// Memory the device reports as total (nvidia-smi "MiB" figures where known).
    pub capacity: u64,
    pub note: &'static str,
}

/// Device memory. NVIDIA figures are the totals nvidia-smi reports (e.g. H100 SXM 80 GB:
/// 81559 MiB), which is what a process can see; others are the vendor's capacity.
pub const GPUS: &[Gpu] = &[
    Gpu {
        name: "a100-40",
        capacity: 40_960 * MIB,
        note: "A100 40 GB (nvidia-smi 40960 MiB)",
    },
    Gpu {
        name: "a100-80",
        capacity: 81_920 * MIB,
        note: "A100 80 GB (nvidia-smi 81920 MiB)",
    },
    Gpu {
        name: "h100",
        capacity: 81_559 * MIB,
        note: "H100 SXM 80 GB (nvidia-smi 81559 MiB)",
    },
    Gpu {
        name: "h100-pcie",
        capacity: 81_559 * MIB,
        note: "H100 PCIe 80 GB (nvidia-smi 81559 MiB)",
    },
    Gpu {
        name: "h200",
        capacity: 143_771 * MIB,
        note: "H200 141 GB (nvidia-smi 143771 MiB)",
    },
    Gpu {
        name: "b200",
        capacity: 180 * GIB,
        note: "B200 (vendor capacity 180 GiB usable, 192 GB HBM3e)",
    },
    Gpu {
        name: "mi300x",
        capacity: 192 * GIB,
        note: "MI300X 192 GB HBM3 (vendor capacity)",
    },
    Gpu {
        name: "l40s",
        capacity: 46_068 * MIB,
        note: "L40S 48 GB (nvidia-smi 46068 MiB)",
    },
    Gpu {
        name: "rtx4090",
        capacity: 24_564 * MIB,
        note: "RTX 4090 24 GB (nvidia-smi 24564 MiB)",
    },
];

pub fn gpu(name: &str) -> Result<Gpu> {
    GPUS.iter()
        .copied()
        .find(|g| g.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = GPUS.iter().map(|g| g.name).collect();
            PlanError::setting(
                "gpu",
                name,
                format!("unknown GPU; expected one of {}", names.join(", ")),
            )
        })
}

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
