//! Costs and the roofline: seconds and FLOPs by kind of kernel, and the achievable-efficiency
//! model of a GPU (see the module docs of `time`).

use crate::cluster::Cluster;
use crate::recipe::Precision;
use serde::Serialize;

/// Share of a GPU's measured best matmul throughput that a training step's kernel mix reaches.
/// Calibrated once on Korthikanti et al. 2022 Table 5 (A100); used unchanged for every GPU.
pub const KERNEL_MIX: f64 = 0.87;
/// Achievable fraction of HBM bandwidth for memory-bound kernels (assumption).
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// Output tile of the matmul kernels for wave quantization (rows × columns).
pub const TILE: (u64, u64) = (128, 256);

/// Seconds and FLOPs of some work, split by the kind of kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Cost {
    pub matmul_s: f64,
    pub attention_s: f64,
    pub memory_s: f64,
    /// FLOPs executed (hardware FLOPs).
    pub flops: f64,
}

impl Cost {
    pub fn s(&self) -> f64 {
        self.matmul_s + self.attention_s + self.memory_s
    }
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            matmul_s: self.matmul_s + o.matmul_s,
            attention_s: self.attention_s + o.attention_s,
            memory_s: self.memory_s + o.memory_s,
            flops: self.flops + o.flops,
        }
    }
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        *self = *self + o;
    }
}

impl std::ops::Mul<f64> for Cost {
    type Output = Cost;
    fn mul(self, k: f64) -> Cost {
        Cost {
            matmul_s: self.matmul_s * k,
            attention_s: self.attention_s * k,
            memory_s: self.memory_s * k,
            flops: self.flops * k,
        }
    }
}

/// The achievable-efficiency model of one GPU kind for one precision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Efficiency {
    /// Peak FLOP/s of the recipe's matmul dtype.
    pub peak_flops: f64,
    /// e_mm = MAMF × sustained clock ratio (MSMF / MAMF) × KERNEL_MIX.
    pub matmul: f64,
    /// Fused attention's FLOP/s on this GPU, forward and backward: the bf16 peak times
    /// FlashAttention-2's measured fraction (`attention_kernel.rs`) times the sustained clock
    /// ratio, scaled for the cluster's kernel; the matmul rate where no benchmark exists.
    /// Attention runs in bf16 under fp8 recipes (fp8 covers the linear layers in Transformer
    /// Engine and torchao's float8 training).
    pub attention_flops: (f64, f64),
    /// e_mem.
    pub memory: f64,
    pub hbm_bw: f64,
    pub sms: u64,
}

impl Efficiency {
    pub fn of(c: &Cluster, p: Precision) -> Self {
        Efficiency {
            peak_flops: c.gpu.peak_flops(p),
            matmul: c.gpu.mamf(p) * c.gpu.sustained(p) * KERNEL_MIX,
            attention_flops: {
                // Attention kernel benchmarks are bursts too: the sustained clock slows them
                // alike.
                let flash2 = match c.gpu.attention {
                    Some(a) if p != Precision::Fp32 => {
                        c.gpu.bf16_flops * a * c.gpu.sustained(Precision::Bf16)
                    }
                    _ => c.gpu.peak_flops(p) * c.gpu.mamf(p) * c.gpu.sustained(p) * KERNEL_MIX,
                };
                let (f, b) = c.attention_kernel.relative_to_flash2();
                (flash2 * f, flash2 * b)
            },
            memory: MEMORY_EFFICIENCY,
            hbm_bw: c.gpu.hbm_bw,
            sms: c.gpu.sms.max(1),
        }
    }

    /// Wave-quantization efficiency of a `rows × cols` result in `batch` independent problems.
    pub(super) fn wave(&self, rows: u64, cols: u64, batch: u64) -> f64 {
        let tiles = rows.div_ceil(TILE.0) * cols.div_ceil(TILE.1) * batch.max(1);
        let waves = tiles.div_ceil(self.sms);
        tiles as f64 / (waves * self.sms) as f64
    }

    pub(super) fn mem(&self, bytes: f64) -> Cost {
        Cost {
            memory_s: bytes / (self.hbm_bw * self.memory),
            ..Cost::default()
        }
    }

    /// Forward and backward (dgrad + wgrad) of `batch` matmuls [m, k] × [k, n].
    pub(super) fn gemm(&self, m: u64, k: u64, n: u64, batch: u64, elem_bytes: f64) -> (Cost, Cost) {
        let flops = 2.0 * (m * k) as f64 * n as f64 * batch as f64;
        if flops == 0.0 {
            return (Cost::default(), Cost::default());
        }
        let bytes = elem_bytes * ((m * k + k * n + m * n) * batch) as f64;
        let one = |rows: u64, cols: u64| -> Cost {
            let compute = flops / (self.peak_flops * self.matmul * self.wave(rows, cols, batch));
            let memory = bytes / (self.hbm_bw * self.memory);
            Cost {
                matmul_s: compute.max(memory),
                flops,
                ..Cost::default()
            }
        };
        // Forward writes [m, n]; dgrad writes [m, k]; wgrad writes [k, n].
        (one(m, n), one(m, k) + one(k, n))
    }

    /// A fused attention kernel's forward of `fwd` FLOPs and its backward (2.5× the forward:
    /// 5 matmuls against 2, the scores recomputed; Dao 2023 §3.1–3.2 and §4.1).
    pub(super) fn attention(&self, fwd: f64) -> (Cost, Cost) {
        let cost = |flops: f64, rate: f64| Cost {
            attention_s: flops / rate,
            flops,
            ..Cost::default()
        };
        (
            cost(fwd, self.attention_flops.0),
            cost(2.5 * fwd, self.attention_flops.1),
        )
    }
}
