//! The host tier of offload: buffers of the offloaded optimizer states (and the staging that
//! moves gradients and weights between a device and them), allocated from the system
//! allocator directly and counted here.
//!
//! Why not the global allocator: the trainer's measured peak is the tracking allocator's
//! (`memory::alloc`), and on the emulated device the device's memory is host memory too, so
//! the offloaded states must be told apart from it to measure what offload takes off the
//! device. The planner counts them apart, as `MemoryPlan::host_bytes`, and these counters are
//! what that figure is measured against. The staging a device copies through is the
//! page-locked memory ZeRO-Offload copies through (Ren et al., "ZeRO-Offload", USENIX ATC
//! 2021, §4) where the device has some ([`HostBuf::pinned`]: a GPU's copies then run at the
//! link's bandwidth, not through the driver's own bounce buffers), counted the same way.

use ferrotron_engine::kernels::DeviceAlloc;
use ferrotron_engine::Elem;
use std::alloc::{GlobalAlloc, Layout, System};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// Bytes of the host tier allocated now.
pub fn host_live() -> u64 {
    LIVE.load(Ordering::Relaxed)
}

/// Most bytes of the host tier allocated at once since the last [`reset_host_peak`].
pub fn host_peak() -> u64 {
    PEAK.load(Ordering::Relaxed)
}

pub fn reset_host_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// `len` elements of `T` in the host tier, zeroed at first (every `Elem`'s zero is all-zero
/// bits), freed on drop.
pub struct HostBuf<T: Elem> {
    ptr: NonNull<T>,
    len: usize,
    /// The device whose page-locked memory this is (`None`: the system allocator's).
    pinned: Option<Arc<dyn DeviceAlloc>>,
}

// SAFETY: the buffer owns its block as a Vec does.
unsafe impl<T: Elem> Send for HostBuf<T> {}
unsafe impl<T: Elem> Sync for HostBuf<T> {}

impl<T: Elem> HostBuf<T> {
    fn layout(len: usize) -> Layout {
        Layout::array::<T>(len.max(1)).expect("host buffer size overflows")
    }

    pub fn zeros(len: usize) -> HostBuf<T> {
        let layout = Self::layout(len);
        // SAFETY: a non-zero size.
        let p = unsafe { System.alloc_zeroed(layout) };
        let ptr =
            NonNull::new(p.cast::<T>()).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self::counted(ptr, len, None)
    }

    /// `len` zeroed elements of `dev`'s page-locked host memory, or of the system allocator's
    /// where the device has none (`DeviceAlloc::alloc_pinned`), or refuses it: page-locked
    /// memory only makes the copies faster, so a refusal is said once and the run goes on.
    pub fn pinned(len: usize, dev: &Arc<dyn DeviceAlloc>) -> HostBuf<T> {
        match dev.alloc_pinned(Self::layout(len).size()) {
            None => Self::zeros(len),
            Some(Ok(p)) => Self::counted(p.cast(), len, Some(dev.clone())),
            Some(Err(e)) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!("note: {e}: the offload tier's copies go through pageable memory instead (slower)")
                });
                Self::zeros(len)
            }
        }
    }

    fn counted(ptr: NonNull<T>, len: usize, pinned: Option<Arc<dyn DeviceAlloc>>) -> HostBuf<T> {
        let bytes = (len * size_of::<T>()) as u64;
        let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(live, Ordering::Relaxed);
        HostBuf { ptr, len, pinned }
    }

    pub fn from_slice(s: &[T]) -> HostBuf<T> {
        let mut b = Self::zeros(s.len());
        b.copy_from_slice(s);
        b
    }
}

impl<T: Elem> Deref for HostBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised (zeroed, then written) elements owned by the buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Elem> DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Elem> Drop for HostBuf<T> {
    fn drop(&mut self) {
        let (p, layout) = (self.ptr.as_ptr().cast(), Self::layout(self.len));
        match &self.pinned {
            // SAFETY: allocated by `pinned` from this device with this size.
            Some(dev) => unsafe { dev.free_pinned(self.ptr.cast(), layout.size()) },
            // SAFETY: allocated by `zeros` with this layout.
            None => unsafe { System.dealloc(p, layout) },
        }
        LIVE.fetch_sub((self.len * size_of::<T>()) as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_buffer_holds_its_elements_zeroed_first() {
        let a = HostBuf::<f32>::from_slice(&[1.0, 2.0, 3.0]);
        let mut b = HostBuf::<half::bf16>::zeros(10);
        b[3] = half::bf16::ONE;
        assert_eq!(&a[..], &[1.0f32, 2.0, 3.0][..]);
        assert_eq!(
            (b[9], b[3], b.len()),
            (half::bf16::ZERO, half::bf16::ONE, 10)
        );
        // (The counters are the process's: the offload integration test checks them against
        // the plan, one run at a time.)
    }
}
