//! Which device runs the training step (`--device cpu|cuda`), and everything the trainer does
//! only on a device: [`state`] (the trainer's state in the device's memory) and [`ranks`]
//! (several ranks on a device: their host staging). The GPU communicator (NCCL) is
//! `ferrotron_dist::nccl`, enabled by this crate's `cuda` feature.
//!
//! The CUDA backend (`ferrotron_engine::kernels::cuda`, `--features cuda`) runs every op of
//! the dense model on one GPU, checked against the CPU backend op by op and step by step
//! (`crates/engine/tests/cuda_backend.rs`, on a GPU). With `--device cuda` the trainer keeps
//! its weights, master weights, gradients, Adam's moments, activation arena and token ids in
//! the GPU's memory ([`state`]), and copies them to the host only for a checkpoint or a
//! sample. The same path runs on the emulated device (`--device emulated`, hidden: host
//! memory the host may not read through a view), which is how it is tested without a GPU.
//!
//! Refused before anything is written, each in one line saying what to do:
//! - `--device cuda` in a build without the `cuda` feature;
//! - no NVIDIA driver, or no GPU;
//! - on the GPU, a mixture of experts (its kernels have no routing ops yet:
//!   `run::layout_checks`), fp8 and the memory timeline (`Trainer::new`).
//!
//! Several ranks on the GPU stage their messages through host memory ([`ranks`]), as on the
//! emulated device, each on its GPU ([`gpu_of`]); NCCL in the trainer is issue #33's next step.

pub mod nccl;
pub mod ranks;
pub mod state;

use anyhow::{bail, Result};
use ferrotron_engine::kernels::cpu::Fp8Inputs;
use ferrotron_engine::kernels::{Backend, CpuKernels, DeviceAlloc, EmulatedDevice, OnDevice};
use ferrotron_engine::model::Llama;
use ferrotron_plan::Precision;
use std::sync::Arc;

/// The device of `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
    /// The CPU kernels on host memory tagged as a device's (`kernels::device_check`): the
    /// trainer's device path on any machine, for tests; not a way to train.
    #[value(hide = true)]
    Emulated,
}

/// Where a rank's step runs, and the matmul peak its MFU is measured against (GFLOP/s; 0 on
/// a GPU: its own from the planner's table).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machine {
    pub device: Device,
    pub peak_gflops: f64,
    /// The GPU this rank runs on ([`gpu_of`]; 0 off the GPU).
    pub gpu: usize,
    /// Ranks of this machine on that GPU, this one included ([`ranks_on_gpu`]; 1 off the
    /// GPU): they split its peak.
    pub gpu_share: usize,
}

/// The GPU of a rank: its index among the ranks of its machine (under `mpirun`, Open MPI's
/// local rank; as threads of one process, the rank itself), round robin over the GPUs the
/// driver sees. Several ranks per GPU share it through host staging ([`ranks`]); NCCL, which
/// refuses two ranks on one GPU, needs a GPU per rank.
pub fn gpu_of(device: Device, rank: usize) -> Result<usize> {
    if device != Device::Cuda {
        return Ok(0);
    }
    let local = match ferrotron_dist::launched_by_mpirun() {
        true => local_rank().unwrap_or(rank),
        false => rank,
    };
    Ok(local % gpus()?.max(1))
}

/// How many of its machine's ranks share the GPU of rank `rank` of `world` (round robin,
/// [`gpu_of`]), itself included: 1 where each rank has a GPU of its own. Each one's MFU is
/// against its share of the GPU's peak, so that the ranks' sum is the GPU's.
pub fn ranks_on_gpu(device: Device, rank: usize, world: usize) -> Result<usize> {
    if device != Device::Cuda {
        return Ok(1);
    }
    let (local, size) = match ferrotron_dist::launched_by_mpirun() {
        true => (
            local_rank().unwrap_or(rank),
            ompi_var("OMPI_COMM_WORLD_LOCAL_SIZE").unwrap_or(world),
        ),
        false => (rank, world),
    };
    Ok(sharing(local, size, gpus()?))
}

/// Of `size` ranks dealt round robin over `gpus` GPUs, how many share rank `local`'s.
fn sharing(local: usize, size: usize, gpus: usize) -> usize {
    let gpus = gpus.max(1);
    (0..size.max(1))
        .filter(|r| r % gpus == local % gpus)
        .count()
        .max(1)
}

/// Open MPI's index of this process among those on its node (`OMPI_COMM_WORLD_LOCAL_RANK`).
fn local_rank() -> Option<usize> {
    ompi_var("OMPI_COMM_WORLD_LOCAL_RANK")
}

fn ompi_var(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.parse().ok()
}

/// How many GPUs the driver sees.
#[cfg(feature = "cuda")]
fn gpus() -> Result<usize> {
    ferrotron_engine::kernels::cuda::device::count().map_err(|e| anyhow::anyhow!("{e}"))
}

#[cfg(not(feature = "cuda"))]
fn gpus() -> Result<usize> {
    Ok(1)
}

/// The memory free on the GPUs the ranks of this process (or node) share, by the driver's
/// count now, and how many GPUs that is: the fit of their plans is checked against it before
/// anything is allocated (`fit::device_fit`). `FERROTRON_DEVICE_FREE` (bytes) stands in for
/// the driver, for tests on the emulated device and for a budget below the card's. `None`
/// where nothing can be read (the CPU; the emulated device without the variable).
pub fn free_memory(device: Device) -> Result<Option<(u64, usize)>> {
    if device == Device::Cpu {
        return Ok(None);
    }
    if let Ok(v) = std::env::var("FERROTRON_DEVICE_FREE") {
        let bytes = v.trim().parse::<u64>().map_err(|_| {
            anyhow::anyhow!("FERROTRON_DEVICE_FREE = {v}: must be a number of bytes, or unset")
        })?;
        return Ok(Some((bytes, 1)));
    }
    if device == Device::Emulated {
        return Ok(None);
    }
    cuda_free()
}

/// The smallest free memory over the GPUs the driver sees, and their count: every GPU holds
/// the same ranks' share (round robin, [`gpu_of`]).
#[cfg(feature = "cuda")]
fn cuda_free() -> Result<Option<(u64, usize)>> {
    use ferrotron_engine::kernels::cuda::device::{count, memory};
    let err = |e: ferrotron_engine::kernels::cuda::DeviceError| anyhow::anyhow!("{e}");
    let n = count().map_err(err)?;
    let mut least = u64::MAX;
    for g in 0..n {
        least = least.min(memory(g).map_err(err)?.0);
    }
    Ok((n > 0).then_some((least, n)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_free() -> Result<Option<(u64, usize)>> {
    Ok(None)
}

/// Refuses `--device cuda` where it cannot run, with the reason. Any number of ranks runs:
/// several stage their messages through host memory, as on the emulated device ([`ranks`]),
/// each on its GPU ([`gpu_of`]).
pub fn check(device: Device) -> Result<()> {
    if device == Device::Cpu {
        return Ok(());
    }
    if device == Device::Emulated {
        return Ok(());
    }
    if !cfg!(feature = "cuda") {
        bail!("device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu");
    }
    driver()
}

/// The driver, before anything else is read or written (opening the GPU itself waits for
/// the trainer).
#[cfg(feature = "cuda")]
fn driver() -> Result<()> {
    use ferrotron_engine::kernels::cuda::{device::driver_present, DeviceError};
    match driver_present() {
        true => Ok(()),
        false => Err(anyhow::anyhow!("{}", DeviceError::NoDriver)),
    }
}

#[cfg(not(feature = "cuda"))]
fn driver() -> Result<()> {
    unreachable!("checked by cfg!(feature = \"cuda\") above")
}

/// The backend of `device`, with the memory its state lives in (`None`: the host's).
pub fn open(
    device: Device,
    gpu: usize,
    cpu: CpuKernels,
) -> Result<(Backend, Option<Arc<dyn DeviceAlloc>>)> {
    Ok(match device {
        Device::Cpu => (Backend::Cpu(cpu), None),
        Device::Emulated => (
            Backend::Emulated(OnDevice { inner: cpu }),
            Some(Arc::new(EmulatedDevice { ordinal: 0 })),
        ),
        Device::Cuda => cuda(gpu, cpu.fp8)?,
    })
}

/// GPU `gpu`: its context, compiled kernels and cuBLASLt (each failure one line).
#[cfg(feature = "cuda")]
fn cuda(gpu: usize, fp8: Option<Fp8Inputs>) -> Result<(Backend, Option<Arc<dyn DeviceAlloc>>)> {
    use ferrotron_engine::kernels::cuda::{CudaAlloc, CudaKernels};
    let mut k = CudaKernels::open(gpu).map_err(|e| anyhow::anyhow!("{e}"))?;
    if fp8.is_some() && !k.fp8_capable() {
        let g = k.gpu();
        bail!(
            "precision = fp8: the {} ({}) has no fp8 tensor cores (Ada and Hopper have: sm_89 and later); use --precision bf16 on it, or fp8 on the CPU",
            g.name,
            g.arch
        );
    }
    k.set_fp8(fp8);
    let alloc = Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
    Ok((Backend::Cuda(Arc::new(k)), Some(alloc)))
}

/// A GPU backend's own workspace for `model`'s step (the plan's overhead term, which on the
/// CPU is the gemm library's measured scratch), allocated now so no step allocates it; with
/// the GPU's description for the start-up line and its dense peak FLOP/s for `precision`
/// from the planner's table (`None` for a GPU it does not list). `None` off the GPU.
///
/// On a GPU the model's RoPE table is built here: the workspace holds its device copy, keyed
/// by the host table's address, so the table the steps read must exist when it is counted.
/// That is before the trainer's host baseline, which a GPU rank does not measure against
/// (its peak is the device allocator's).
pub fn gpu_workspace(
    b: &Backend,
    model: &mut Llama,
    rows: usize,
    tokens: usize,
    precision: Precision,
) -> Option<(u64, String, Option<f64>)> {
    #[cfg(feature = "cuda")]
    if let Backend::Cuda(k) = b {
        model.build_rope();
        let c = &model.config;
        let staging = match precision {
            Precision::Fp32 => 0,
            _ => rows.min(tokens) * c.vocab * 2,
        };
        let lse = tokens * c.heads;
        // The widest sum over rows per column: RMSNorm's weight gradient, or q's bias's.
        let width = match c.qkv_bias {
            true => c.hidden.max(c.heads * c.head_dim),
            false => c.hidden,
        };
        k.reserve(staging, lse, tokens, width, &model.rope);
        if let Some(m) = c.moe {
            k.reserve_routing(tokens, m.top_k);
        }
        k.reserve_fp8(tokens, c.moe.is_some(), &layer_products(c));
        let g = k.gpu();
        let peak = table_peak(&g.name, precision);
        return Some((
            k.workspace_bytes(),
            format!("cuBLASLt on {} ({})", g.name, g.arch),
            peak,
        ));
    }
    let _ = (b, model, rows, tokens, precision);
    None
}

/// The (in, out) features of a layer's products (this rank's shard of them): the attention's
/// q, k, v and o, then the MLP's (each expert's, in a mixture of experts) gate, up and down.
#[cfg(feature = "cuda")]
fn layer_products(c: &ferrotron_engine::model::LlamaConfig) -> [(usize, usize); 5] {
    let (h, q, kv, f) = (
        c.hidden,
        c.heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.intermediate,
    );
    [(h, q), (h, kv), (q, h), (h, f), (f, h)]
}

/// The name the CUDA emulator's driver gives its device (crates/engine/cuda_emu/driver.cpp):
/// its device memory is host memory (`fit::DeviceHost`).
pub const EMULATED_GPU: &str = "ferrotron CUDA emulator";

/// The planner's GPU kind of a device name ("NVIDIA H200" is h200), longest name first so
/// that "h100-pcie" is not taken for "h100"; its dense peak for `precision`.
pub fn table_peak(device_name: &str, precision: Precision) -> Option<f64> {
    let name = device_name.to_lowercase().replace(' ', "-");
    let mut gpus = ferrotron_plan::cluster::gpus();
    gpus.sort_by_key(|g| std::cmp::Reverse(g.name.len()));
    let g = gpus.into_iter().find(|g| name.contains(&g.name))?;
    Some(g.peak_flops(precision))
}

#[cfg(not(feature = "cuda"))]
fn cuda(_gpu: usize, _fp8: Option<Fp8Inputs>) -> Result<(Backend, Option<Arc<dyn DeviceAlloc>>)> {
    unreachable!("refused by `check` in a build without CUDA")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_is_found_in_the_planners_table_by_its_driver_name() {
        let h200 = table_peak("NVIDIA H200", Precision::Bf16).unwrap();
        assert_eq!(
            h200,
            ferrotron_plan::cluster::gpu("h200").unwrap().bf16_flops
        );
        let pcie = table_peak("NVIDIA H100 PCIe", Precision::Bf16).unwrap();
        assert_eq!(
            pcie,
            ferrotron_plan::cluster::gpu("h100-pcie")
                .unwrap()
                .bf16_flops
        );
        assert_eq!(table_peak("Quadro K600", Precision::Bf16), None);
    }

    #[test]
    fn ranks_dealt_round_robin_share_their_gpu() {
        // dp 2 on one GPU: both on it; 4 ranks on 2 GPUs: two each; 3 on 2: 2 and 1.
        assert_eq!((sharing(0, 2, 1), sharing(1, 2, 1)), (2, 2));
        assert_eq!((sharing(1, 4, 2), sharing(2, 4, 2)), (2, 2));
        assert_eq!((sharing(0, 3, 2), sharing(1, 3, 2)), (2, 1));
        assert_eq!(sharing(3, 4, 8), 1, "a GPU each");
        assert_eq!(ranks_on_gpu(Device::Cpu, 1, 4).unwrap(), 1);
    }

    #[test]
    fn cpu_is_always_fine() {
        check(Device::Cpu).unwrap();
    }

    #[test]
    fn cuda_is_refused_with_the_reason() {
        #[cfg(not(feature = "cuda"))]
        assert_eq!(check(Device::Cuda).unwrap_err().to_string(), "device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu");
        #[cfg(feature = "cuda")]
        {
            // With a driver the GPU is opened by the trainer; without one, refused here.
            match ferrotron_engine::kernels::cuda::device::driver_present() {
                false => {
                    let msg = check(Device::Cuda).unwrap_err().to_string();
                    let want =
                        "device = cuda: no NVIDIA driver on this machine (libcuda.so.1 not found)";
                    assert!(msg.starts_with(want), "{msg}");
                }
                true => check(Device::Cuda).unwrap(),
            }
        }
    }
}
