//! Copies between a device's memory and the host, for code that stages device buffers through
//! host memory without depending on the backend that owns the device: the host-staged
//! communicator (`ferrotron_dist::staged`) takes a [`DeviceCopy`], and the engine implements
//! it for its devices (the emulated one, CUDA). It lives here, below both, so the dependency
//! between dist and engine stays absent.
//!
//! The element type is `f32`, the communicators' (16-bit gradients are widened by the caller).

use crate::{Memory, View, ViewMut};

/// Host memory a device copies from and to. On a GPU it is page-locked: the copy engine reads
/// and writes it directly, without the driver's own bounce buffer, and the copy runs at the
/// link's full bandwidth (CUDA C Programming Guide, "Page-Locked Host Memory"). On the emulated
/// device it is plain heap memory.
pub trait HostStaging: Send {
    fn as_mut_slice(&mut self) -> &mut [f32];
}

impl HostStaging for Vec<f32> {
    fn as_mut_slice(&mut self) -> &mut [f32] {
        self
    }
}

/// Copies `f32` elements between one device's memory ([`DeviceCopy::memory`]) and the host.
/// Each copy is complete when it returns (it waits for the device work before it), so a
/// collective on the staged host copy sees what the kernels wrote.
pub trait DeviceCopy: Send + Sync + std::fmt::Debug {
    /// The device memory it copies.
    fn memory(&self) -> Memory;
    /// `src` (this device's memory) into `dst`, of the same length.
    fn download(&self, src: View<'_, f32>, dst: &mut [f32]) -> Result<(), String>;
    /// `src` into `dst` (this device's memory), of the same length.
    fn upload(&self, src: &[f32], dst: ViewMut<'_, f32>) -> Result<(), String>;
    /// `len` elements of host memory to stage copies through: allocated once by its user and
    /// reused for every copy.
    fn staging(&self, len: usize) -> Result<Box<dyn HostStaging>, String> {
        Ok(Box::new(vec![0.0f32; len]))
    }
}

/// Why a copy cannot run: `None` when `mem` is `dev`'s memory and the lengths agree, else the
/// problem in words (for implementations of [`DeviceCopy`] to check their arguments alike).
pub fn copy_problem(
    dev: Memory,
    mem: Memory,
    device_len: usize,
    host_len: usize,
) -> Option<String> {
    if mem != dev {
        Some(format!("a copy for {dev} was handed a buffer in {mem}"))
    } else if device_len != host_len {
        Some(format!(
            "a copy of {device_len} device elements into {host_len} host elements"
        ))
    } else {
        None
    }
}
