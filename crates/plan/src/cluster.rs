//! Accelerators and clusters: one table of GPU kinds (memory capacity for the fit verdict, peak
//! FLOPS, HBM bandwidth, intra-node links, achievable efficiency for the time model), inter-node
//! networks, user cluster files, and where each parallel group's ranks land.
//!
//! Sources (vendor datasheets; all FLOPS are dense, without 2:4 sparsity):
//! - [A100]: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TF, FP32 19.5 TF, HBM2
//!   1,555 GB/s (40 GB) / HBM2e 2,039 GB/s (80 GB), 108 SMs, NVLink 3 600 GB/s (bidirectional).
//! - [H100]: NVIDIA H100 Tensor Core GPU datasheet (2023): SXM BF16 989 TF, FP8 1,979 TF, FP32
//!   67 TF, HBM3 3.35 TB/s, NVLink 4 900 GB/s; PCIe BF16 756 TF, FP8 1,513 TF, FP32 51 TF,
//!   HBM2e 2.0 TB/s, PCIe Gen5 128 GB/s; 132 SMs (SXM), 114 SMs (PCIe).
//! - [H200]: NVIDIA H200 datasheet (2024): H100 SXM compute, 141 GB HBM3e at 4.8 TB/s.
//! - [H100-96]: pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md`: the Grand
//!   Teton H100 "equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth", 8 per host
//!   on NVLink, "400 Gb/s per GPU", "the default 500W power limit"; its peak is taken as the
//!   SXM's ("we use the peak number of SXM directly"). Its sustained clock under the 500 W
//!   limit is the 700 W part's MSMF clock scaled by the cube law of DVFS (`power_capped_clock`).
//! - [B200]: NVIDIA DGX B200 datasheet (2024): 8 GPUs, 72 PF FP8 training (sparse), 1,440 GB
//!   HBM3e at 64 TB/s, NVLink 5 1.8 TB/s per GPU; per GPU dense BF16 2.25 PF, FP8 4.5 PF,
//!   FP32 75 TF; 148 SMs.
//! - [MI300X]: AMD Instinct MI300X data sheet (2023): BF16 1,307.4 TF, FP8 2,614.9 TF, FP32
//!   (matrix) 163.4 TF, 192 GB HBM3 at 5.3 TB/s, 304 CUs, 7 Infinity Fabric links of 128 GB/s
//!   (bidirectional) each.
//! - [L40S], [RTX 4090]: NVIDIA L40S datasheet; NVIDIA Ada Lovelace architecture whitepaper
//!   (dense FP16/BF16 with FP32 accumulate 362 / 165 TF, FP8 733 / 330 TF, FP32 91.6 / 82.6
//!   TF, 864 / 1,008 GB/s, PCIe Gen4 64 GB/s bidirectional).
//! - [MAMF]: S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum
//!   Achievable Matmul FLOPS comparison table": best measured BF16 matmul as a fraction of the
//!   spec: A100 SXM 86.9%, H100 SXM 80.3% ("H200 is the same"), B200 77.6%, MI300X 51.4%; FP8:
//!   H100 70.9%, H200 73.4%, B200 76.3%.
//! - [NCCL]: NCCL `src/graph/tuning.cc` latency model: ring/simple per-hop latency 3.4 µs over
//!   NVLink, 5.7 µs over PCIe, 9.6 µs over the network.

use crate::attention_kernel::AttentionKernel;
use crate::error::{PlanError, Result};
use crate::layout::Layout;
use crate::recipe::Precision;
use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const T: f64 = 1e12;
const GB: f64 = 1e9;

/// One accelerator kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    pub name: String,
    /// Memory the device reports as total (nvidia-smi "MiB" figures where known).
    pub capacity: u64,
    pub note: String,
    /// Peak dense tensor-core FLOP/s for 16-bit (bf16/fp16) matmuls.
    pub bf16_flops: f64,
    /// Peak dense fp8 FLOP/s (0 where the hardware has no fp8 tensor cores).
    pub fp8_flops: f64,
    /// Peak fp32 FLOP/s (non-tensor-core, what an fp32 matmul gets without TF32).
    pub fp32_flops: f64,
    /// HBM bandwidth in bytes/s.
    pub hbm_bw: f64,
    /// Streaming multiprocessors (NVIDIA) or compute units (AMD), for wave quantization.
    pub sms: u64,
    /// Intra-node link bandwidth per GPU per direction, bytes/s.
    pub link_bw: f64,
    /// Per-hop latency of the intra-node link, seconds.
    pub link_latency: f64,
    /// Best measured matmul throughput as a fraction of peak [MAMF], bf16 and fp8.
    pub mamf_bf16: f64,
    pub mamf_fp8: f64,
    /// FlashAttention-2's forward + backward throughput as a fraction of the bf16 peak, from
    /// attention kernel benchmarks (`attention_kernel.rs`); `None` where none is published
    /// (the matmul efficiency is used instead).
    pub attention: Option<f64>,
    /// Sustained over burst tensor-core throughput ([MSMF] / [MAMF] measured on the same GPU
    /// and software), bf16 and fp8: the clock a saturated chip settles at under its power
    /// limit, as a training step keeps it. `None` where not measured (1.0 is used).
    pub sustained: Option<(f64, f64)>,
    /// The inter-node network this kind usually ships with (a `NETWORKS` name).
    pub default_network: String,
}

impl Gpu {
    /// Peak FLOP/s for the matmuls of a precision recipe.
    pub fn peak_flops(&self, p: Precision) -> f64 {
        match p {
            Precision::Fp32 => self.fp32_flops,
            Precision::Fp8 if self.fp8_flops > 0.0 => self.fp8_flops,
            _ => self.bf16_flops,
        }
    }

    /// Measured best-case matmul fraction for a precision [MAMF].
    pub fn mamf(&self, p: Precision) -> f64 {
        match p {
            Precision::Fp8 if self.fp8_flops > 0.0 => self.mamf_fp8,
            _ => self.mamf_bf16,
        }
    }

    /// Sustained over burst throughput of the tensor cores for a precision [MSMF] (1 where
    /// not measured).
    pub fn sustained(&self, p: Precision) -> f64 {
        match (self.sustained, p) {
            (Some((_, fp8)), Precision::Fp8) if self.fp8_flops > 0.0 => fp8,
            (Some((bf16, _)), _) => bf16,
            (None, _) => 1.0,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gpu_row(
    name: &str,
    capacity: u64,
    note: &str,
    tflops: (f64, f64, f64),
    hbm_gb_s: f64,
    sms: u64,
    link_gb_s: f64,
    link_latency_us: f64,
    mamf: (f64, f64),
    network: &str,
) -> Gpu {
    Gpu {
        name: name.into(),
        capacity,
        note: note.into(),
        bf16_flops: tflops.0 * T,
        fp8_flops: tflops.1 * T,
        fp32_flops: tflops.2 * T,
        hbm_bw: hbm_gb_s * GB,
        sms,
        link_bw: link_gb_s * GB,
        link_latency: link_latency_us * 1e-6,
        mamf_bf16: mamf.0,
        mamf_fp8: mamf.1,
        attention: AttentionKernel::flash2_fraction(name),
        sustained: sustained_ratio(name),
        default_network: network.into(),
    }
}

/// [MSMF] / [MAMF] from the same `mamf-finder.py --search auto` run (stas00/ml-engineering,
/// compute/accelerator/README.md at commit 082816f9be8aeb6b65b074c33cb354a7ca1e7087, "MAMF vs
/// MSMF": "for training-throughput reasoning use MSMF (the sustained, power-saturated number)"):
/// H200 SXM bf16 708.5 / 841.9 (1465 MHz saturated vs 1980 MHz boost), fp8 1288.7 / 1491.9;
/// B200 SXM bf16 1456.3 / 1770.9, fp8 2795.7 / 3435.2. H100 SXM: the H200's chip at the same
/// 700 W ("H200 is the same" in the MAMF table), so its ratios; the 96 GB Grand Teton part
/// runs the same chip at a 500 W limit [H100-96], so its saturated clock is lower again
/// (`power_capped_clock`). Not measured for A100 (whose sustained clock the kernel-mix
/// constant absorbs, see `time/cost.rs`) and the others.
fn sustained_ratio(name: &str) -> Option<(f64, f64)> {
    const H100_700W: (f64, f64) = (708.5 / 841.9, 1288.7 / 1491.9);
    match name {
        "h100" | "h200" => Some(H100_700W),
        "h100-96" => {
            let k = power_capped_clock(500.0, 700.0);
            Some((H100_700W.0 * k, H100_700W.1 * k))
        }
        "b200" => Some((1456.3 / 1770.9, 2795.7 / 3435.2)),
        _ => None,
    }
}

/// The saturated tensor-core clock of a chip held to `cap_w` watts, relative to the one it
/// settles at under `measured_w` (where MSMF was measured). A power-saturated chip runs at the
/// clock where its power meets the limit; CMOS dynamic power is α·C·V²·f, and along a GPU's
/// voltage–frequency curve V rises roughly in proportion to f, so P ∝ f³ and f ∝ P^(1/3)
/// (the cube law of dynamic voltage and frequency scaling; e.g. Hennessy & Patterson,
/// *Computer Architecture*, 6th ed., §1.5 "Trends in Power and Energy"). Static power is
/// neglected: a share of it that does not shrink with the clock would lower the capped clock
/// further, so this is the optimistic end (500 W of 700 W: 0.894).
fn power_capped_clock(cap_w: f64, measured_w: f64) -> f64 {
    (cap_w / measured_w).cbrt()
}

/// The built-in GPU kinds. Capacities are what nvidia-smi reports as total (e.g. H100 SXM
/// 80 GB: 81,559 MiB), the memory a process can see; others are the vendor's capacity.
/// Link bandwidths are per direction: NVLink 3 300 GB/s, NVLink 4 450 GB/s, NVLink 5 900 GB/s,
/// MI300X 7 × 64 GB/s, PCIe Gen5 64 GB/s, Gen4 32 GB/s. MAMF fractions not measured in [MAMF]
/// (A100 40 GB: same silicon as the 80 GB; H100 PCIe, L40S, RTX 4090) are assumed 0.80.
pub fn gpus() -> Vec<Gpu> {
    vec![
        gpu_row(
            "a100-40",
            40_960 * MIB,
            "A100 SXM 40 GB (nvidia-smi 40960 MiB) [A100]",
            (312.0, 0.0, 19.5),
            1555.0,
            108,
            300.0,
            3.4,
            (0.869, 0.869),
            "ib-hdr",
        ),
        gpu_row(
            "a100-80",
            81_920 * MIB,
            "A100 SXM 80 GB (nvidia-smi 81920 MiB) [A100]",
            (312.0, 0.0, 19.5),
            2039.0,
            108,
            300.0,
            3.4,
            (0.869, 0.869),
            "ib-hdr",
        ),
        gpu_row(
            "h100",
            81_559 * MIB,
            "H100 SXM 80 GB (nvidia-smi 81559 MiB) [H100]",
            (989.4, 1978.9, 66.9),
            3350.0,
            132,
            450.0,
            3.4,
            (0.803, 0.709),
            "ib-ndr",
        ),
        gpu_row(
            "h100-96",
            96 * GIB,
            "H100 SXM 96 GB HBM2e, 500 W power limit (Meta Grand Teton; vendor capacity) [H100-96]",
            (989.4, 1978.9, 66.9),
            2400.0,
            132,
            450.0,
            3.4,
            (0.803, 0.709),
            "ib-ndr",
        ),
        gpu_row(
            "h100-pcie",
            81_559 * MIB,
            "H100 PCIe 80 GB (nvidia-smi 81559 MiB) [H100]",
            (756.5, 1513.0, 51.2),
            2000.0,
            114,
            64.0,
            5.7,
            (0.80, 0.80),
            "ib-ndr",
        ),
        gpu_row(
            "h200",
            143_771 * MIB,
            "H200 SXM 141 GB (nvidia-smi 143771 MiB) [H200]",
            (989.4, 1978.9, 66.9),
            4800.0,
            132,
            450.0,
            3.4,
            (0.803, 0.734),
            "ib-ndr",
        ),
        gpu_row(
            "b200",
            180 * GIB,
            "B200 (vendor capacity 180 GiB usable, 192 GB HBM3e) [B200]",
            (2250.0, 4500.0, 75.0),
            8000.0,
            148,
            900.0,
            3.4,
            (0.776, 0.763),
            "ib-ndr",
        ),
        gpu_row(
            "mi300x",
            192 * GIB,
            "MI300X 192 GB HBM3 (vendor capacity) [MI300X]",
            (1307.4, 2614.9, 163.4),
            5300.0,
            304,
            448.0,
            3.4,
            (0.514, 0.514),
            "roce-400",
        ),
        gpu_row(
            "l40s",
            46_068 * MIB,
            "L40S 48 GB (nvidia-smi 46068 MiB) [L40S]",
            (362.0, 733.0, 91.6),
            864.0,
            142,
            32.0,
            5.7,
            (0.80, 0.80),
            "roce-400",
        ),
        gpu_row(
            "rtx4090",
            24_564 * MIB,
            "RTX 4090 24 GB (nvidia-smi 24564 MiB) [RTX 4090]",
            (165.2, 330.3, 82.6),
            1008.0,
            128,
            32.0,
            5.7,
            (0.80, 0.80),
            "eth-100",
        ),
    ]
}

/// Names of the built-in GPU kinds.
pub fn gpu_names() -> Vec<String> {
    gpus().into_iter().map(|g| g.name).collect()
}

/// A built-in GPU kind by name.
pub fn gpu(name: &str) -> Result<Gpu> {
    gpus().into_iter().find(|g| g.name == name).ok_or_else(|| {
        PlanError::setting(
            "gpu",
            name,
            format!("unknown GPU; expected one of {}", gpu_names().join(", ")),
        )
    })
}

/// An inter-node network: bandwidth per GPU per direction (one NIC per GPU, as DGX/HGX nodes
/// have) and per-hop latency [NCCL].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Network {
    pub name: String,
    pub bw: f64,
    pub latency: f64,
    pub note: String,
}

/// Built-in networks. InfiniBand HDR is 200 Gb/s per port (DGX A100: 8 ConnectX-6 for
/// compute traffic), NDR 400 Gb/s (DGX H100/H200/B200: 8 ConnectX-7), XDR 800 Gb/s
/// (ConnectX-8); RoCE 400 GbE as on typical MI300X platforms; 100 GbE for workstation nodes.
pub fn networks() -> Vec<Network> {
    let net = |name: &str, gbit: f64, note: &str| Network {
        name: name.into(),
        bw: gbit / 8.0 * GB,
        latency: 9.6e-6,
        note: note.into(),
    };
    vec![
        net(
            "ib-hdr",
            200.0,
            "InfiniBand HDR 200 Gb/s per GPU (DGX A100)",
        ),
        net(
            "ib-ndr",
            400.0,
            "InfiniBand NDR 400 Gb/s per GPU (DGX H100/H200/B200)",
        ),
        net(
            "ib-xdr",
            800.0,
            "InfiniBand XDR 800 Gb/s per GPU (ConnectX-8)",
        ),
        net("roce-400", 400.0, "RoCE 400 GbE per GPU"),
        net("eth-100", 100.0, "Ethernet 100 Gb/s per GPU"),
    ]
}

pub fn network(name: &str) -> Result<Network> {
    networks()
        .into_iter()
        .find(|n| n.name == name)
        .ok_or_else(|| {
            let names: Vec<String> = networks().into_iter().map(|n| n.name).collect();
            PlanError::setting(
                "network",
                name,
                format!("unknown network; expected one of {}", names.join(", ")),
            )
        })
}

/// Fraction of a link's bandwidth collectives achieve (NCCL bus bandwidth vs. the raw link:
/// about 230–240 GB/s of NVLink 3's 300 GB/s per direction on DGX A100). An assumption, stated.
pub const LINK_EFFICIENCY: f64 = 0.8;

/// A homogeneous cluster: nodes of `gpus_per_node` GPUs, an intra-node link and a network.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cluster {
    pub name: String,
    pub gpu: Gpu,
    pub gpus_per_node: u64,
    /// Intra-node bandwidth per GPU per direction (bytes/s) and per-hop latency (s).
    pub intra_bw: f64,
    pub intra_latency: f64,
    pub network: Network,
    /// Fraction of raw link bandwidth collectives achieve.
    pub link_efficiency: f64,
    /// The fused attention kernel the framework runs on these GPUs.
    pub attention_kernel: AttentionKernel,
    /// The drive offloaded optimizer states are kept on (`--disk-gib`), when they are.
    pub disk: Option<crate::disk_tier::DiskTier>,
}

impl Cluster {
    /// The usual node of a GPU kind: its intra-node link and default network.
    pub fn of(gpu: Gpu, gpus_per_node: u64) -> Result<Cluster> {
        if gpus_per_node == 0 {
            return Err(PlanError::setting(
                "gpus_per_node",
                0,
                "must be a positive integer (8 for DGX/HGX nodes)",
            ));
        }
        let network = network(&gpu.default_network)?;
        Ok(Cluster {
            name: format!("nodes of {} × {}", gpus_per_node, gpu.name),
            intra_bw: gpu.link_bw,
            intra_latency: gpu.link_latency,
            gpu,
            gpus_per_node,
            network,
            link_efficiency: LINK_EFFICIENCY,
            attention_kernel: AttentionKernel::default(),
            disk: None,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "{} GPUs per node of {}; intra-node {:.0} GB/s/dir, inter-node {} ({:.0} GB/s/dir per GPU); collectives at {:.0}% of link bandwidth",
            self.gpus_per_node,
            self.gpu.name,
            self.intra_bw / GB,
            self.network.name,
            self.network.bw / GB,
            self.link_efficiency * 100.0
        )
    }
}

/// A custom GPU in a cluster file.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CustomGpu {
    pub name: String,
    pub memory_gib: f64,
    pub bf16_tflops: f64,
    #[serde(default)]
    pub fp8_tflops: f64,
    pub fp32_tflops: f64,
    pub hbm_tb_s: f64,
    pub sms: u64,
    /// Intra-node link per direction, GB/s.
    pub link_gb_s: f64,
    /// Best achievable matmul fraction of peak (measure it with a MAMF finder) [default 0.8].
    pub matmul_efficiency: Option<f64>,
    /// Flash-attention forward + backward fraction of the bf16 peak [default: the matmul
    /// efficiency model's].
    pub attention_efficiency: Option<f64>,
}

/// A user cluster file (TOML or JSON): a built-in GPU kind or a custom one, GPUs per node,
/// and optional link overrides. Keys mirror the flags (`gpu`, `gpus_per_node`).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    pub name: Option<String>,
    pub gpu: Option<String>,
    pub custom_gpu: Option<CustomGpu>,
    pub gpus_per_node: Option<u64>,
    /// Intra-node bandwidth per GPU per direction, GB/s.
    pub intra_node_gb_s: Option<f64>,
    pub intra_node_latency_us: Option<f64>,
    /// A built-in network name (ib-hdr, ib-ndr, ib-xdr, roce-400, eth-100).
    pub network: Option<String>,
    /// Inter-node bandwidth per GPU per direction, GB/s.
    pub inter_node_gb_s: Option<f64>,
    pub inter_node_latency_us: Option<f64>,
    /// Fraction of link bandwidth collectives achieve [default 0.8].
    pub link_efficiency: Option<f64>,
    /// The fused attention kernel: flash2 or triton [default flash2].
    pub attention_kernel: Option<String>,
}

fn positive(field: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(PlanError::setting(field, v, "must be a positive number"))
    }
}

fn fraction(field: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(PlanError::setting(field, v, "must be a fraction in (0, 1]"))
    }
}

impl CustomGpu {
    fn to_gpu(&self) -> Result<Gpu> {
        if self.name.is_empty() {
            return Err(PlanError::setting(
                "custom_gpu.name",
                "\"\"",
                "must be a non-empty name",
            ));
        }
        if self.sms == 0 {
            return Err(PlanError::setting(
                "custom_gpu.sms",
                0,
                "must be a positive integer",
            ));
        }
        let eff = fraction(
            "custom_gpu.matmul_efficiency",
            self.matmul_efficiency.unwrap_or(0.8),
        )?;
        if self.fp8_tflops < 0.0 || !self.fp8_tflops.is_finite() {
            return Err(PlanError::setting(
                "custom_gpu.fp8_tflops",
                self.fp8_tflops,
                "must be 0 (no fp8) or a positive number",
            ));
        }
        Ok(Gpu {
            name: self.name.clone(),
            capacity: (positive("custom_gpu.memory_gib", self.memory_gib)? * GIB as f64) as u64,
            note: format!("{} (custom, from the cluster file)", self.name),
            bf16_flops: positive("custom_gpu.bf16_tflops", self.bf16_tflops)? * T,
            fp8_flops: self.fp8_tflops * T,
            fp32_flops: positive("custom_gpu.fp32_tflops", self.fp32_tflops)? * T,
            hbm_bw: positive("custom_gpu.hbm_tb_s", self.hbm_tb_s)? * 1e12,
            sms: self.sms,
            link_bw: positive("custom_gpu.link_gb_s", self.link_gb_s)? * GB,
            link_latency: 3.4e-6,
            mamf_bf16: eff,
            mamf_fp8: eff,
            attention: self
                .attention_efficiency
                .map(|a| fraction("custom_gpu.attention_efficiency", a))
                .transpose()?,
            // A measured matmul_efficiency is what the user's own GPU sustains.
            sustained: None,
            default_network: "ib-ndr".into(),
        })
    }
}

impl ClusterFile {
    /// Builds the cluster. `gpu_flag` and `gpn_flag` (command-line values) win over the file.
    pub fn resolve(&self, gpu_flag: Option<&str>, gpn_flag: Option<u64>) -> Result<Cluster> {
        // A custom GPU is checked even when --gpu overrides it: errors in a file are reported.
        if let Some(c) = &self.custom_gpu {
            c.to_gpu()?;
        }
        let g = match (gpu_flag, &self.custom_gpu, &self.gpu) {
            (Some(name), _, _) => gpu(name)?,
            (None, Some(_), Some(_)) => {
                return Err(PlanError::setting(
                    "gpu",
                    self.gpu.as_deref().unwrap_or(""),
                    "give either gpu or [custom_gpu] in a cluster file, not both",
                ))
            }
            (None, Some(c), None) => c.to_gpu()?,
            (None, None, Some(name)) => gpu(name)?,
            (None, None, None) => gpu("h100")?,
        };
        let mut c = Cluster::of(g, gpn_flag.or(self.gpus_per_node).unwrap_or(8))?;
        if let Some(n) = &self.name {
            c.name = n.clone();
        }
        if let Some(bw) = self.intra_node_gb_s {
            c.intra_bw = positive("intra_node_gb_s", bw)? * GB;
        }
        if let Some(us) = self.intra_node_latency_us {
            c.intra_latency = positive("intra_node_latency_us", us)? * 1e-6;
        }
        if let Some(n) = &self.network {
            c.network = network(n)?;
        }
        if let Some(bw) = self.inter_node_gb_s {
            c.network.bw = positive("inter_node_gb_s", bw)? * GB;
            c.network.name = format!("{} GB/s per GPU", bw);
        }
        if let Some(us) = self.inter_node_latency_us {
            c.network.latency = positive("inter_node_latency_us", us)? * 1e-6;
        }
        if let Some(e) = self.link_efficiency {
            c.link_efficiency = fraction("link_efficiency", e)?;
        }
        if let Some(k) = &self.attention_kernel {
            c.attention_kernel = k.parse()?;
        }
        Ok(c)
    }
}

/// A parallel dimension, in placement order: tp innermost (consecutive ranks), then cp, ep, dp,
/// and pp outermost (Megatron-LM's default rank order "tp-cp-ep-dp-pp").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Dim {
    Tp,
    Cp,
    Ep,
    Dp,
    Pp,
}

impl Dim {
    pub const ALL: [Dim; 5] = [Dim::Tp, Dim::Cp, Dim::Ep, Dim::Dp, Dim::Pp];
    pub fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Cp => "cp",
            Dim::Ep => "ep",
            Dim::Dp => "dp",
            Dim::Pp => "pp",
        }
    }
}

/// Where one parallel group's ranks are: its size, the distance between consecutive members in
/// rank ids, how many consecutive ranks its members span, and whether that crosses a node.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Group {
    pub dim: Dim,
    pub size: u64,
    pub stride: u64,
    pub span: u64,
    pub crosses_nodes: bool,
}

/// A communication link as the collectives see it: achievable bandwidth per rank per direction
/// (bytes/s) and per-hop latency (s).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    pub bw: f64,
    pub latency: f64,
}

/// Places the ranks of a layout on a cluster: rank = tp_i + tp·(cp_i + cp·(ep_i + ep·(dp_i +
/// dp·pp_i))). A group of size n and stride k spans (n − 1)·k + 1 consecutive ranks; it stays in
/// a node when that span fits in one and does not straddle a node boundary, i.e. when
/// k·n ≤ G and G is a multiple of k·n (nodes of G GPUs hold whole groups).
pub fn groups(l: &Layout, gpus_per_node: u64) -> Vec<Group> {
    let sizes = [l.tp, l.cp, l.ep, l.dp, l.pp];
    let mut stride = 1;
    let mut out = Vec::with_capacity(5);
    for (dim, size) in Dim::ALL.into_iter().zip(sizes) {
        let whole = stride * size;
        out.push(Group {
            dim,
            size,
            stride,
            span: (size - 1) * stride + 1,
            crosses_nodes: size > 1
                && (whole > gpus_per_node || !gpus_per_node.is_multiple_of(whole)),
        });
        stride = whole;
    }
    out
}

/// The data-parallel replicas of a dense parameter (cp × ep × dp, contiguous after tp in the
/// placement): used by gradient reductions and ZeRO.
pub fn replica_group(l: &Layout, gpus_per_node: u64) -> Group {
    let size = l.cp * l.ep * l.dp;
    let whole = l.tp * size;
    Group {
        dim: Dim::Dp,
        size,
        stride: l.tp,
        span: (size.max(1) - 1) * l.tp + 1,
        crosses_nodes: size > 1 && (whole > gpus_per_node || !gpus_per_node.is_multiple_of(whole)),
    }
}

impl Group {
    /// Members of the group in one node of `gpus_per_node` GPUs: consecutive members are
    /// `stride` ranks apart, so a node holds ⌊G / stride⌋ of them (at least one, at most all).
    pub fn members_per_node(&self, gpus_per_node: u64) -> u64 {
        (gpus_per_node / self.stride.max(1)).clamp(1, self.size.max(1))
    }
}

impl Cluster {
    /// The link a data-parallel ring (gradient reductions, ZeRO gathers) runs over. Inside a
    /// node, as `link`. Across nodes NCCL runs one ring per network card concurrently, each
    /// entering a node through one card, passing the node's members over NVLink and leaving
    /// through a card (S. Jeaugey, NVIDIA/nccl#412: "NCCL is able to aggregate the bandwidth of
    /// multiple NICs"; NVIDIA/nccl#652: with 4 NICs "performance should add up as you add
    /// more"). A group with k members per node therefore drives k cards of `network.bw` each,
    /// bounded by the NVLink bandwidth that carries the whole ring: bw = min(intra, k · nic).
    /// One member per node (tensor parallelism filling the node) gets one card, as `link`.
    pub fn ring_link(&self, g: &Group) -> Link {
        let mut link = self.link(g);
        if g.crosses_nodes {
            let k = g.members_per_node(self.gpus_per_node) as f64;
            link.bw = (self.network.bw * k).min(self.intra_bw) * self.link_efficiency;
        }
        link
    }

    /// The link a group's collectives run over: NVLink-class inside a node, the network
    /// otherwise (its bandwidth per GPU bounds a ring that crosses nodes).
    pub fn link(&self, g: &Group) -> Link {
        if g.crosses_nodes {
            Link {
                bw: self.network.bw.min(self.intra_bw) * self.link_efficiency,
                latency: self.network.latency,
            }
        } else {
            Link {
                bw: self.intra_bw * self.link_efficiency,
                latency: self.intra_latency,
            }
        }
    }
}
