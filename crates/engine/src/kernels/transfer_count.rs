//! Bytes copied between the host and one device, counted ([`Counted`]): an allocator that
//! passes every call on to the device's and adds up what its `upload`s and `download`s move,
//! and the time the host spends in them (an upload started ahead on a copy stream is counted
//! by its bytes alone: its time is the stream's).
//! The offload tiers copy through one (`crates/train`'s `optim/offload.rs` staging,
//! `offload_params.rs`), so a step's measured host↔device bytes can be set beside the
//! planner's (`ferrotron_plan::host_transfer`). Zeroing device memory moves nothing across
//! and is not counted.

use super::{DeviceAlloc, Memory};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a device's copies moved over an interval ([`Counted::take`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    /// Bytes host → device.
    pub up: u64,
    /// Bytes device → host.
    pub down: u64,
    /// Of `up`, the bytes started ahead on a copy stream (`upload_ahead`), which `busy` does
    /// not time.
    pub ahead: u64,
    /// Time spent in the copies, summed over the threads that made them: set beside the bytes,
    /// the bandwidth the link gave (pageable host memory gets a fraction of a pinned copy's).
    pub busy: Duration,
}

/// A device's allocator that counts the bytes its copies move.
#[derive(Debug)]
pub struct Counted {
    inner: Arc<dyn DeviceAlloc>,
    up: AtomicU64,
    down: AtomicU64,
    ahead: AtomicU64,
    busy_ns: AtomicU64,
}

impl Counted {
    pub fn new(inner: Arc<dyn DeviceAlloc>) -> Arc<Self> {
        Arc::new(Counted {
            inner,
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            ahead: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
        })
    }

    /// What the copies moved since the last call, which starts the count again.
    pub fn take(&self) -> Moved {
        Moved {
            up: self.up.swap(0, Ordering::Relaxed),
            down: self.down.swap(0, Ordering::Relaxed),
            ahead: self.ahead.swap(0, Ordering::Relaxed),
            busy: Duration::from_nanos(self.busy_ns.swap(0, Ordering::Relaxed)),
        }
    }

    fn timed(&self, bytes: &AtomicU64, n: usize, copy: impl FnOnce()) {
        let t = Instant::now();
        copy();
        let ns = t.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
        bytes.fetch_add(n as u64, Ordering::Relaxed);
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
        self.timed(&self.up, src.len(), || self.inner.upload(dst, src))
    }
    unsafe fn zero_queued(&self, p: NonNull<u8>, bytes: usize) {
        self.inner.zero_queued(p, bytes)
    }
    /// Counted by its bytes; the host does not wait for it (on a GPU).
    unsafe fn upload_queued(&self, dst: NonNull<u8>, src: &[u8]) {
        self.up.fetch_add(src.len() as u64, Ordering::Relaxed);
        self.inner.upload_queued(dst, src)
    }
    /// On a copy stream, counted by its bytes (its time is the stream's, which the host does
    /// not see); else the synchronous upload it is, timed.
    unsafe fn upload_ahead(&self, dst: NonNull<u8>, src: &[u8]) {
        if !self.inner.copies_ahead() {
            return self.upload(dst, src);
        }
        self.up.fetch_add(src.len() as u64, Ordering::Relaxed);
        self.ahead.fetch_add(src.len() as u64, Ordering::Relaxed);
        self.inner.upload_ahead(dst, src)
    }
    fn copies_ahead(&self) -> bool {
        self.inner.copies_ahead()
    }
    fn await_uploads(&self) {
        self.inner.await_uploads()
    }
    fn settle_uploads(&self) {
        self.inner.settle_uploads()
    }
    unsafe fn download(&self, dst: &mut [u8], src: NonNull<u8>) {
        let n = dst.len();
        self.timed(&self.down, n, || self.inner.download(dst, src))
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
    fn alloc_pinned(&self, bytes: usize) -> Option<Result<NonNull<u8>, String>> {
        self.inner.alloc_pinned(bytes)
    }
    unsafe fn free_pinned(&self, p: NonNull<u8>, bytes: usize) {
        self.inner.free_pinned(p, bytes)
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
        // A bf16 upload: 2 bytes an element.
        let n = 3000;
        let mut buf = DeviceBuf::<bf16>::zeros(&a, n).unwrap();
        copy.upload(&vec![1.5; n], buf.view_mut());
        let mut back = vec![0.0f32; 10];
        copy.download(buf.view().slice(5..15), &mut back);
        copy.zero(buf.view_mut());
        let m = c.take();
        assert_eq!((m.up, m.down), (2 * n as u64, 20));
        assert!(m.busy > Duration::ZERO, "the copies' time is counted");
        assert_eq!(c.take(), Moved::default(), "taking starts the count again");
        let mut host = vec![0.0f32; 4];
        let f = DeviceBuf::<f32>::zeros(&a, 4).unwrap();
        copy.download(f.view(), &mut host);
        let m = c.take();
        assert_eq!((m.up, m.down), (0, 16));
    }
}
