//! Memory on a device, as the trainer holds its state there: an allocator ([`DeviceAlloc`]) of
//! zeroed regions with copies to and from the host, and a typed buffer of it
//! ([`DeviceBuf`]). Two allocators: [`EmulatedDevice`], host memory tagged as a device's (the
//! host cannot read it through a view: `view.rs`), with which the trainer's device path is
//! tested on any machine, and the CUDA one (`cuda::memory::CudaAlloc`).

use super::{Memory, View, ViewMut};
use crate::model::BUF_ALIGN;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

/// Allocates and copies a device's memory.
pub trait DeviceAlloc: Send + Sync + std::fmt::Debug {
    /// Where the regions live.
    fn memory(&self) -> Memory;
    /// `bytes` zeroed bytes (at least one), aligned to [`BUF_ALIGN`]; an error says why not.
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String>;
    /// # Safety
    /// `p` came from `alloc(bytes)` of this allocator and is not used after.
    unsafe fn free(&self, p: NonNull<u8>, bytes: usize);
    /// # Safety
    /// `dst` is this device's memory with room for `src`.
    unsafe fn upload(&self, dst: NonNull<u8>, src: &[u8]);
    /// # Safety
    /// `src` is this device's memory of at least `dst.len()` bytes.
    unsafe fn download(&self, dst: &mut [u8], src: NonNull<u8>);
    /// Sets `bytes` bytes at `p` to zero.
    ///
    /// # Safety
    /// `p` is this device's memory of at least `bytes` bytes.
    unsafe fn zero(&self, p: NonNull<u8>, bytes: usize);
    /// Copies `src` to `dst` behind the work already issued to the compute stream, without
    /// waiting for it: on a GPU an asynchronous copy from pageable memory, which CUDA stages
    /// before returning (a step's token ids: the host need not wait for the device's previous
    /// micro-batch, and nothing of a step is left on the legacy stream, which CUDA graphs
    /// cannot capture). Only the thread that issues the compute stream's work may call it.
    /// Elsewhere the synchronous [`upload`](Self::upload).
    ///
    /// # Safety
    /// As [`upload`](Self::upload); `src` is pageable memory (not from
    /// [`alloc_pinned`](Self::alloc_pinned), which a queued copy would read when it runs).
    unsafe fn upload_queued(&self, dst: NonNull<u8>, src: &[u8]) {
        self.upload(dst, src)
    }
    /// [`zero`](Self::zero) behind the work already issued to the compute stream, without
    /// waiting for it (a step's gradients, zeroed at its start), from the thread that issues
    /// that work.
    ///
    /// # Safety
    /// As [`zero`](Self::zero).
    unsafe fn zero_queued(&self, p: NonNull<u8>, bytes: usize) {
        self.zero(p, bytes)
    }
    /// Starts copying `src` to `dst` on the device's copy stream and returns at once: the
    /// copy runs after the work already issued to the compute stream (which may still read
    /// `dst`'s old contents), and beside the work issued after it, until
    /// [`await_uploads`](Self::await_uploads) orders the compute stream's next work after it
    /// (ZeRO-Infinity's parameter prefetch, one layer ahead, overlapping compute). Where the
    /// device has no copy stream (the emulated device), the synchronous [`upload`](Self::upload).
    ///
    /// # Safety
    /// As [`upload`](Self::upload); and `src` stays allocated and unchanged until work that
    /// awaited the copy has run (the step's end: the host's weights change only in the update).
    unsafe fn upload_ahead(&self, dst: NonNull<u8>, src: &[u8]) {
        self.upload(dst, src)
    }
    /// Whether [`upload_ahead`](Self::upload_ahead) returns before its copy has run (a copy
    /// stream), rather than being the synchronous upload.
    fn copies_ahead(&self) -> bool {
        false
    }
    /// The compute stream's next work runs after every [`upload_ahead`](Self::upload_ahead)
    /// so far; the host does not wait.
    fn await_uploads(&self) {}
    /// The host waits until every [`upload_ahead`](Self::upload_ahead) so far has run (their
    /// sources may then change).
    fn settle_uploads(&self) {}
    /// Highest bytes allocated through this allocator since [`reset_peak`](Self::reset_peak),
    /// where the host's tracking allocator cannot see them (a GPU's memory); `None` when it
    /// can (emulated device memory is host memory).
    fn peak(&self) -> Option<u64> {
        None
    }
    fn reset_peak(&self) {}
    /// The device's memory in use by its driver's own count when this allocator's allocations
    /// were at their highest, less what was in use before the backend allocated anything (a
    /// GPU's: everything the process added since, the backend's workspace and scratch and what
    /// the driver reserves for the kernels included, rounded to its pages); `None` where there
    /// is no driver to ask.
    fn driver_used(&self) -> Option<u64> {
        None
    }
    /// What the device's backend has asked of its driver so far: host synchronisations by
    /// site, launches, library calls (`device_ops`); `None` where nothing counts them.
    fn ops(&self) -> Option<super::DeviceOps> {
        None
    }
    /// Whether a region freed between micro-batches is better kept (a GPU's allocator
    /// synchronises the device; the host's is cheap).
    fn keeps_regions(&self) -> bool {
        false
    }
    /// `bytes` zeroed bytes (at least one) of page-locked host memory, which this device's
    /// copies reach at the link's full bandwidth and without a bounce through the driver's
    /// own staging (a GPU's `cuMemHostAlloc`); `None` where the device has none to give (the
    /// emulated device: its copies are `memcpy`, and the host's allocator does as well).
    fn alloc_pinned(&self, bytes: usize) -> Option<Result<NonNull<u8>, String>> {
        let _ = bytes;
        None
    }
    /// # Safety
    /// `p` came from `alloc_pinned(bytes)` of this allocator and is not used after.
    unsafe fn free_pinned(&self, p: NonNull<u8>, bytes: usize) {
        let _ = (p, bytes);
    }
}

fn layout(bytes: usize) -> Layout {
    Layout::from_size_align(bytes.max(1), BUF_ALIGN).expect("device region size overflows")
}

/// A device whose memory is the host's, tagged `Device(ordinal)`.
#[derive(Clone, Copy, Debug)]
pub struct EmulatedDevice {
    pub ordinal: u32,
}

impl DeviceAlloc for EmulatedDevice {
    fn memory(&self) -> Memory {
        Memory::Device(self.ordinal)
    }
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String> {
        // SAFETY: a non-zero size.
        NonNull::new(unsafe { std::alloc::alloc_zeroed(layout(bytes)) })
            .ok_or_else(|| format!("cannot allocate {bytes} bytes"))
    }
    unsafe fn free(&self, p: NonNull<u8>, bytes: usize) {
        std::alloc::dealloc(p.as_ptr(), layout(bytes))
    }
    unsafe fn upload(&self, dst: NonNull<u8>, src: &[u8]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), src.len())
    }
    unsafe fn download(&self, dst: &mut [u8], src: NonNull<u8>) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), dst.len())
    }
    unsafe fn zero(&self, p: NonNull<u8>, bytes: usize) {
        std::ptr::write_bytes(p.as_ptr(), 0, bytes)
    }
    /// As a GPU does: the emulation runs the GPU's allocation policy, so its memory tests
    /// cover it.
    fn keeps_regions(&self) -> bool {
        true
    }
}

/// `len` elements of `T` in a device's memory, zeroed at first, freed on drop.
pub struct DeviceBuf<T> {
    ptr: NonNull<T>,
    len: usize,
    dev: Arc<dyn DeviceAlloc>,
}

// SAFETY: the buffer owns its region as a Vec owns its heap block.
unsafe impl<T: Send> Send for DeviceBuf<T> {}
unsafe impl<T: Sync> Sync for DeviceBuf<T> {}

impl<T: Copy + Default> DeviceBuf<T> {
    pub fn zeros(dev: &Arc<dyn DeviceAlloc>, len: usize) -> Result<Self, String> {
        let p = dev.alloc(len * size_of::<T>())?;
        Ok(DeviceBuf {
            ptr: p.cast(),
            len,
            dev: dev.clone(),
        })
    }

    /// A device copy of `host`.
    pub fn from_host(dev: &Arc<dyn DeviceAlloc>, host: &[T]) -> Result<Self, String> {
        let b = Self::zeros(dev, host.len())?;
        // SAFETY: the region holds `host`'s bytes; T is plain data (Copy).
        unsafe {
            let bytes = std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), size_of_val(host));
            b.dev.upload(b.ptr.cast(), bytes);
        }
        Ok(b)
    }

    /// The elements, on the host.
    pub fn to_host(&self) -> Vec<T> {
        let mut out = vec![T::default(); self.len];
        // SAFETY: as `from_host`, the other way.
        unsafe {
            let bytes = std::slice::from_raw_parts_mut(
                out.as_mut_ptr().cast::<u8>(),
                size_of_val(&out[..]),
            );
            self.dev.download(bytes, self.ptr.cast());
        }
        out
    }

    /// Overwrites the buffer with `host` (the same length, pageable memory), behind the work
    /// queued on the compute stream ([`DeviceAlloc::upload_queued`]): call it from the thread
    /// that issues that work.
    pub fn copy_from_host(&mut self, host: &[T]) {
        assert_eq!(host.len(), self.len, "device copy lens");
        // SAFETY: as `from_host`; `host` is a slice of the caller's (pageable) memory.
        unsafe {
            let bytes = std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), size_of_val(host));
            self.dev.upload_queued(self.ptr.cast(), bytes);
        }
    }
}

impl<T> DeviceBuf<T> {
    /// Every element set to zero bits (0.0 for the float types), behind the work queued on
    /// the compute stream ([`DeviceAlloc::zero_queued`]): call it from the thread that issues
    /// that work.
    pub fn zero(&mut self) {
        // SAFETY: the buffer's own bytes.
        unsafe {
            self.dev
                .zero_queued(self.ptr.cast(), self.len * size_of::<T>())
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn view(&self) -> View<'_, T> {
        // SAFETY: the region holds `len` elements and outlives the borrow.
        unsafe { View::from_raw_parts(self.ptr, self.len, self.dev.memory()) }
    }
    pub fn view_mut(&mut self) -> ViewMut<'_, T> {
        // SAFETY: as `view`, unique through `&mut self`.
        unsafe { ViewMut::from_raw_parts(self.ptr, self.len, self.dev.memory()) }
    }
}

impl<T> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by this allocator with this size, freed once.
        unsafe { self.dev.free(self.ptr.cast(), self.len * size_of::<T>()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_emulated_buffer_round_trips_and_refuses_host_reads() {
        let dev: Arc<dyn DeviceAlloc> = Arc::new(EmulatedDevice { ordinal: 1 });
        let mut b = DeviceBuf::from_host(&dev, &[1.0f32, 2.0, 3.0]).unwrap();
        assert_eq!(b.to_host(), [1.0, 2.0, 3.0]);
        b.copy_from_host(&[4.0, 5.0, 6.0]);
        assert_eq!(b.to_host(), [4.0, 5.0, 6.0]);
        assert_eq!(b.view().memory(), Memory::Device(1));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.view().host()[0]));
        assert!(r.is_err(), "a host read of device memory must stop");
        assert_eq!(DeviceBuf::<u32>::zeros(&dev, 4).unwrap().to_host(), [0; 4]);
    }
}
