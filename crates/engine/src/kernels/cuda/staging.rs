//! [`DeviceCopy`] for a GPU, so a host communicator stages its buffers
//! (`ferrotron_dist::Staged`): page-locked host staging (`cuMemHostAlloc`, which the copy engine
//! reads and writes directly) and the driver's synchronous copies, which run on the legacy
//! default stream and so wait for the work queued before them on the compute stream (a
//! blocking stream: `compute_stream`).

use crate::kernels::{Memory, SyncSite, View, ViewMut};
use cudarc::driver::{result, CudaContext};
use ferrotron_view::{copy_problem, DeviceCopy, HostStaging};
use std::sync::Arc;

/// Copies between one GPU's memory and the host.
#[derive(Debug)]
pub struct CudaCopy {
    pub ctx: Arc<CudaContext>,
}

impl DeviceCopy for CudaCopy {
    fn memory(&self) -> Memory {
        Memory::Device(self.ctx.ordinal() as u32)
    }

    fn download(&self, src: View<'_, f32>, dst: &mut [f32]) -> Result<(), String> {
        if let Some(p) = copy_problem(self.memory(), src.memory(), src.len(), dst.len()) {
            return Err(p);
        }
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let _w = super::OPS.sync(SyncSite::Staging);
        super::OPS.legacy();
        // SAFETY: `src` is this GPU's memory of `dst.len()` elements (checked above).
        unsafe { result::memcpy_dtoh_sync(dst, src.as_ptr() as u64) }.map_err(|e| format!("{e:?}"))
    }

    fn upload(&self, src: &[f32], dst: ViewMut<'_, f32>) -> Result<(), String> {
        if let Some(p) = copy_problem(self.memory(), dst.memory(), dst.len(), src.len()) {
            return Err(p);
        }
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut dst = dst;
        super::OPS.write();
        super::OPS.legacy();
        // SAFETY: `dst` is this GPU's memory of `src.len()` elements, borrowed uniquely.
        unsafe { result::memcpy_htod_sync(dst.as_mut_ptr() as u64, src) }
            .map_err(|e| format!("{e:?}"))
    }

    fn staging(&self, len: usize) -> Result<Box<dyn HostStaging>, String> {
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let bytes = (len * size_of::<f32>()).max(1);
        // SAFETY: a fresh allocation, zeroed before it is read; flags 0: portable to this
        // context only, which is the one that copies.
        let ptr = unsafe { result::malloc_host(bytes, 0) }
            .map_err(|e| format!("page-locked host memory of {bytes} bytes: {e:?}"))?
            .cast::<f32>();
        // SAFETY: `bytes` writable bytes at `ptr`.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Box::new(Pinned {
            ctx: self.ctx.clone(),
            ptr,
            len,
        }))
    }
}

/// Page-locked host memory, freed on drop.
struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: *mut f32,
    len: usize,
}

// SAFETY: it owns its block, as a Vec owns its heap memory.
unsafe impl Send for Pinned {}

impl HostStaging for Pinned {
    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: `len` initialised elements, borrowed uniquely through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once; an error at teardown has nowhere to go.
        unsafe {
            let _ = self.ctx.bind_to_thread();
            let _ = result::free_host(self.ptr.cast());
        }
    }
}
