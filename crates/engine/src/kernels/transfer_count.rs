//! Bytes copied between the host and one device, counted ([`Counted`]): an allocator that
//! passes every call on to the device's and adds up what its `upload`s and `download`s move.
//! The offload tiers copy through one (`crates/train`'s `optim/offload.rs` staging,
//! `offload_params.rs`), so a step's measured host↔device bytes can be set beside the
//! planner's (`ferrotron_plan::host_transfer`). Zeroing device memory moves nothing across
//! and is not counted.

use super::{DeviceAlloc, Memory};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A device's allocator that counts the bytes its copies move.
#[derive(Debug)]
pub struct Counted {
    inner: Arc<dyn DeviceAlloc>,
    up: AtomicU64,
    down: AtomicU64,
}

impl Counted {
    pub fn new(inner: Arc<dyn DeviceAlloc>) -> Arc<Self> {
        Arc::new(Counted {
            inner,
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
        })
    }

    /// Bytes uploaded (host → device) and downloaded since the last call, which starts the
    /// count again.
    pub fn take(&self) -> (u64, u64) {
        (
            self.up.swap(0, Ordering::Relaxed),
            self.down.swap(0, Ordering::Relaxed),
        )
    }
}

impl DeviceAlloc for Counted {
    fn memory(&self) -> Memory {
        self.inner.memory()
    }
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String> {
        self.inner.alloc(bytes)
    }
    unsafe fn free(&self, p: NonNull<u8>, bytes: usize) {
        self.inner.free(p, bytes)
    }
    unsafe fn upload(&self, dst: NonNull<u8>, src: &[u8]) {
        self.up.fetch_add(src.len() as u64, Ordering::Relaxed);
        self.inner.upload(dst, src)
    }
    unsafe fn download(&self, dst: &mut [u8], src: NonNull<u8>) {
        self.down.fetch_add(dst.len() as u64, Ordering::Relaxed);
        self.inner.download(dst, src)
    }
    unsafe fn zero(&self, p: NonNull<u8>, bytes: usize) {
        self.inner.zero(p, bytes)
    }
    fn peak(&self) -> Option<u64> {
        self.inner.peak()
    }
    fn reset_peak(&self) {
        self.inner.reset_peak()
    }
    fn driver_used(&self) -> Option<u64> {
        self.inner.driver_used()
    }
    fn ops(&self) -> Option<super::DeviceOps> {
        self.inner.ops()
    }
    fn keeps_regions(&self) -> bool {
        self.inner.keeps_regions()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::host_copy::HostCopy;
    use crate::kernels::{DeviceBuf, EmulatedDevice};
    use half::bf16;

    #[test]
    fn copies_are_counted_by_their_bytes_and_zeroing_is_not() {
        let c = Counted::new(Arc::new(EmulatedDevice { ordinal: 0 }));
        let a: Arc<dyn DeviceAlloc> = c.clone();
        let copy = HostCopy::new(a.clone());
        // A bf16 upload longer than the stack buffer goes in pieces: 2 bytes an element.
        let n = 3000;
        let mut buf = DeviceBuf::<bf16>::zeros(&a, n).unwrap();
        copy.upload(&vec![1.5; n], buf.view_mut());
        let mut back = vec![0.0f32; 10];
        copy.download(buf.view().slice(5..15), &mut back);
        copy.zero(buf.view_mut());
        assert_eq!(c.take(), (2 * n as u64, 20));
        assert_eq!(c.take(), (0, 0), "taking starts the count again");
        let mut host = vec![0.0f32; 4];
        let f = DeviceBuf::<f32>::zeros(&a, 4).unwrap();
        copy.download(f.view(), &mut host);
        assert_eq!(c.take(), (0, 16));
    }
}
