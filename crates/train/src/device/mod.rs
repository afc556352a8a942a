//! Which device runs the training step (`--device cpu|cuda`), and everything the trainer does
//! only on a device: [`state`] (the trainer's state in the device's memory), [`ranks`] (several
//! ranks on a device: their host staging) and [`nccl`] (the GPU communicator).
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
//! - more than one rank on the GPU (a GPU communicator is NCCL, issue #15);
//! - on the GPU, a mixture of experts (its kernels have no routing ops yet:
//!   `run::layout_checks`), fp8 and the memory timeline (`Trainer::new`).

#[cfg(feature = "cuda")]
pub mod nccl;
pub mod ranks;
pub mod state;

use anyhow::{bail, Result};
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
}

/// Refuses `--device cuda` where it cannot run, with the reason; `world` is the layout's rank
/// count.
pub fn check(device: Device, world: usize) -> Result<()> {
    if device == Device::Cpu {
        return Ok(());
    }
    if device == Device::Emulated {
        // Several ranks run every layout (`ranks`).
        return Ok(());
    }
    if !cfg!(feature = "cuda") {
        bail!("device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu");
    }
    if world > 1 {
        bail!("device = cuda: {world} ranks: the GPU trainer runs one rank until the NCCL communicator lands (issue #15); drop the parallel flags, or use --device cpu");
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
pub fn open(device: Device, cpu: CpuKernels) -> Result<(Backend, Option<Arc<dyn DeviceAlloc>>)> {
    Ok(match device {
        Device::Cpu => (Backend::Cpu(cpu), None),
        Device::Emulated => (
            Backend::Emulated(OnDevice { inner: cpu }),
            Some(Arc::new(EmulatedDevice { ordinal: 0 })),
        ),
        Device::Cuda => cuda()?,
    })
}

/// GPU 0: its context, compiled kernels and cuBLASLt (each failure one line).
#[cfg(feature = "cuda")]
fn cuda() -> Result<(Backend, Option<Arc<dyn DeviceAlloc>>)> {
    use ferrotron_engine::kernels::cuda::{CudaAlloc, CudaKernels};
    let k = CudaKernels::open(0).map_err(|e| anyhow::anyhow!("{e}"))?;
    let alloc = Arc::new(CudaAlloc::new(k.gpu().ctx.clone()));
    Ok((Backend::Cuda(Box::new(k)), Some(alloc)))
}

/// A GPU backend's own workspace for `model`'s step (the plan's overhead term, which on the
/// CPU is the gemm library's measured scratch), allocated now so no step allocates it; with
/// the GPU's description for the start-up line and its dense peak FLOP/s for `precision`
/// from the planner's table (`None` for a GPU it does not list). `None` off the GPU.
pub fn gpu_workspace(
    b: &Backend,
    model: &Llama,
    rows: usize,
    tokens: usize,
    precision: Precision,
) -> Option<(u64, String, Option<f64>)> {
    #[cfg(feature = "cuda")]
    if let Backend::Cuda(k) = b {
        let c = &model.config;
        let staging = match precision {
            Precision::Fp32 => 0,
            _ => rows.min(tokens) * c.vocab * 2,
        };
        let lse = tokens * c.heads;
        k.reserve(staging, lse, tokens, &model.rope);
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
fn cuda() -> Result<(Backend, Option<Arc<dyn DeviceAlloc>>)> {
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
    fn cpu_is_always_fine() {
        check(Device::Cpu, 8).unwrap();
    }

    #[test]
    fn cuda_is_refused_with_the_reason() {
        #[cfg(not(feature = "cuda"))]
        assert_eq!(check(Device::Cuda, 1).unwrap_err().to_string(), "device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu");
        #[cfg(feature = "cuda")]
        {
            // With a driver the GPU is opened by the trainer; without one, refused here.
            if !ferrotron_engine::kernels::cuda::device::driver_present() {
                let msg = check(Device::Cuda, 1).unwrap_err().to_string();
                let want =
                    "device = cuda: no NVIDIA driver on this machine (libcuda.so.1 not found)";
                assert!(msg.starts_with(want), "{msg}");
            }
            let msg = check(Device::Cuda, 4).unwrap_err().to_string();
            assert!(
                msg.starts_with("device = cuda: 4 ranks: the GPU trainer runs one rank"),
                "{msg}"
            );
        }
    }
}
