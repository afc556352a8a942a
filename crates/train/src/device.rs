//! Which device runs the training step (`--device cpu|cuda`).
//!
//! The CUDA backend (`ferrotron_engine::kernels::cuda`, `--features cuda`) runs every op of
//! the dense model on one GPU and is checked against the CPU backend op by op and step by step
//! (`crates/engine/tests/cuda_backend.rs`, on a GPU). The trainer itself still keeps its
//! weights, gradients and optimizer states in host memory, so `--device cuda` is checked as
//! far as it can be and then refused, each case in one line saying what to do:
//! - a build without the `cuda` feature;
//! - no NVIDIA driver, or no GPU;
//! - more than one rank (a GPU communicator is NCCL, issue #15);
//! - a GPU that is there: the trainer's device path (its state in device memory, the plan's
//!   arena as one device allocation per region) is what is left of issue #14.

use anyhow::{bail, Result};

/// The device of `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

/// Refuses `--device cuda` where it cannot run, with the reason; `world` is the layout's rank
/// count.
pub fn check(device: Device, world: usize) -> Result<()> {
    if device == Device::Cpu {
        return Ok(());
    }
    if !cfg!(feature = "cuda") {
        bail!("device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu");
    }
    if world > 1 {
        bail!("device = cuda: {world} ranks: the GPU trainer runs one rank until the NCCL communicator lands (issue #15); drop the parallel flags, or use --device cpu");
    }
    open_gpu()
}

#[cfg(feature = "cuda")]
fn open_gpu() -> Result<()> {
    use ferrotron_engine::kernels::cuda::CudaKernels;
    let k = CudaKernels::open(0).map_err(|e| anyhow::anyhow!("{e}"))?;
    let g = k.gpu();
    bail!(
        "device = cuda: found {} ({}), and its kernels compiled; the trainer does not keep its state on the GPU yet (issue #14); check the kernels with `cargo test --release --features cuda --test cuda_backend -p ferrotron-engine`, train with --device cpu",
        g.name,
        g.arch
    )
}

#[cfg(not(feature = "cuda"))]
fn open_gpu() -> Result<()> {
    unreachable!("checked by cfg!(feature = \"cuda\") above")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_fine() {
        check(Device::Cpu, 8).unwrap();
    }

    #[test]
    fn cuda_is_refused_with_the_reason() {
        let msg = check(Device::Cuda, 1).unwrap_err().to_string();
        #[cfg(not(feature = "cuda"))]
        assert_eq!(msg, "device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu");
        #[cfg(feature = "cuda")]
        {
            let present = ferrotron_engine::kernels::cuda::device::driver_present();
            let want = match present {
                false => "device = cuda: no NVIDIA driver on this machine (libcuda.so.1 not found)",
                true => "device = cuda: found ",
            };
            assert!(msg.starts_with(want), "{msg}");
            let msg = check(Device::Cuda, 4).unwrap_err().to_string();
            assert!(
                msg.starts_with("device = cuda: 4 ranks: the GPU trainer runs one rank"),
                "{msg}"
            );
        }
    }
}
