//! Typed copies between one device's memory and f32 on the host ([`HostCopy`], [`read_f32`],
//! [`write_f32`], [`add_f32`], [`zero`]): how a host communicator's planned buffer is filled
//! from a device's tensors and read back into them. The data-parallel buckets and ZeRO's
//! windows (`ferrotron-dist`'s `data_parallel`, `zero`; the trainer's `device/ranks.rs` says
//! which layouts run on a device), and the model groups' buffers (tensor parallelism's
//! `comm.tp.staging`, context parallelism's ring message, the pipeline's sends and receive)
//! stage through them; [`copy_up`] and [`copy_down`] move a host view's bytes to and from a
//! device address as they are (offloaded states, ZeRO-3's windows filled from host weights).
//!
//! A copy of a 16-bit tensor goes through the copier's stage, [`STAGE_BYTES`] of host memory
//! (page-locked where the device has such memory), one driver copy per stage-full: widened or
//! rounded on the host exactly as the CPU path does (`Elem::to_f32`, `Elem::from_f32`), so
//! what a collective sums, and the trajectory, are the CPU run's bit for bit; f32 is copied
//! whole. (It went through 1,024 elements on the stack at first: on a GPU, a synchronous
//! driver copy of 2 KiB each, half a million of them a step to reduce a 1B model's bf16
//! gradients.) The stage is made at the first 16-bit copy and kept, outside the tracking
//! allocator: one MiB of a rank's RSS constant, not of its plan.

use super::{DeviceAlloc, Memory, View, ViewMut};
use crate::dtype::Elem;
use ferrotron_plan::DType;
use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Elements of a stack buffer for element-wise work in pieces (`add_f32`'s callers, context
/// parallelism's conversions): 4 KiB of f32.
pub const CHUNK: usize = 1024;

/// Bytes of a copier's stage: half a million 16-bit elements a driver copy.
pub const STAGE_BYTES: usize = 1 << 20;

/// Copies between one device's memory and the host, element type by element type.
#[derive(Clone, Debug)]
pub struct HostCopy {
    alloc: Arc<dyn DeviceAlloc>,
    stage: Arc<Mutex<Option<Stage>>>,
}

/// A copier's host memory for 16-bit copies, page-locked where its device has some.
#[derive(Debug)]
struct Stage {
    ptr: NonNull<u8>,
    pinned: Option<Arc<dyn DeviceAlloc>>,
}

// SAFETY: it owns its block, as a Vec does; used under the copier's mutex.
unsafe impl Send for Stage {}

fn stage_layout() -> Layout {
    Layout::from_size_align(STAGE_BYTES, 64).expect("a valid layout")
}

impl Stage {
    fn new(alloc: &Arc<dyn DeviceAlloc>) -> Stage {
        match alloc.alloc_pinned(STAGE_BYTES) {
            Some(Ok(ptr)) => Stage {
                ptr,
                pinned: Some(alloc.clone()),
            },
            // No page-locked memory (the emulated device, or none left): the system's.
            _ => {
                // SAFETY: a non-zero size.
                let p = unsafe { System.alloc_zeroed(stage_layout()) };
                let ptr = NonNull::new(p)
                    .unwrap_or_else(|| std::alloc::handle_alloc_error(stage_layout()));
                Stage { ptr, pinned: None }
            }
        }
    }

    /// The stage as up to `len` elements of `G`.
    fn elems<G: Elem>(&mut self, len: usize) -> &mut [G] {
        assert!(len * size_of::<G>() <= STAGE_BYTES && align_of::<G>() <= 64);
        // SAFETY: inside the block (checked), aligned, borrowed through `self`; every bit
        // pattern of an `Elem` is a valid value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), len) }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        match &self.pinned {
            // SAFETY: from `alloc_pinned(STAGE_BYTES)` of this allocator.
            Some(a) => unsafe { a.free_pinned(self.ptr, STAGE_BYTES) },
            // SAFETY: from `System` with this layout.
            None => unsafe { System.dealloc(self.ptr.as_ptr(), stage_layout()) },
        }
    }
}

impl HostCopy {
    pub fn new(alloc: Arc<dyn DeviceAlloc>) -> Self {
        HostCopy {
            alloc,
            stage: Arc::default(),
        }
    }

    /// The device's allocator.
    pub fn alloc(&self) -> &Arc<dyn DeviceAlloc> {
        &self.alloc
    }

    /// `f(at, stage)` for each stage-full of `len` elements of `G`, in order: `at` the
    /// elements' range, `stage` room for them.
    fn by_stage<G: Elem>(&self, len: usize, mut f: impl FnMut(std::ops::Range<usize>, &mut [G])) {
        let mut stage = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        let stage = stage.get_or_insert_with(|| Stage::new(&self.alloc));
        let per = STAGE_BYTES / size_of::<G>();
        for lo in (0..len).step_by(per) {
            let hi = (lo + per).min(len);
            f(lo..hi, stage.elems(hi - lo));
        }
    }

    /// `src` (this device's memory) widened into `dst`, of the same length.
    pub fn download<G: Elem>(&self, src: View<'_, G>, dst: &mut [f32]) {
        self.check(src.memory(), src.len(), dst.len());
        if G::DTYPE == DType::F32 {
            // SAFETY: `src` is `dst.len()` f32 of this device's memory (checked above), and
            // f32 has no invalid bit patterns.
            unsafe { self.alloc.download(bytes_mut(dst), ptr(src.as_ptr())) };
            return;
        }
        self.by_stage::<G>(dst.len(), |at, part| {
            // SAFETY: `src` at `at` is `part.len()` elements of this device's memory.
            unsafe {
                self.alloc
                    .download(bytes_mut(part), ptr(src.slice(at.clone()).as_ptr()))
            };
            for (o, x) in dst[at].iter_mut().zip(part.iter()) {
                *o = x.to_f32();
            }
        });
    }

    /// `src` rounded to nearest into `dst` (this device's memory), of the same length.
    pub fn upload<G: Elem>(&self, src: &[f32], mut dst: ViewMut<'_, G>) {
        self.check(dst.memory(), dst.len(), src.len());
        if G::DTYPE == DType::F32 {
            // SAFETY: as in `download`.
            unsafe { self.alloc.upload(ptr(dst.as_mut_ptr()), bytes(src)) };
            return;
        }
        self.by_stage::<G>(src.len(), |at, part| {
            for (p, x) in part.iter_mut().zip(&src[at.clone()]) {
                *p = G::from_f32(*x);
            }
            let mut to = dst.rb().slice_mut(at);
            // SAFETY: `to` is `part.len()` elements of this device's memory.
            unsafe { self.alloc.upload(ptr(to.as_mut_ptr()), bytes(part)) };
        });
    }

    /// `dst += src` (this device's memory, of the same length), each sum taken in f32 and
    /// rounded once, as on the host: a stage-full down, summed, and up again.
    pub fn add<G: Elem>(&self, src: &[f32], mut dst: ViewMut<'_, G>) {
        self.check(dst.memory(), dst.len(), src.len());
        self.by_stage::<G>(src.len(), |at, part| {
            let mut to = dst.rb().slice_mut(at.clone());
            // SAFETY: `to` is `part.len()` elements of this device's memory.
            unsafe {
                self.alloc
                    .download(bytes_mut(part), ptr(to.as_view().as_ptr()))
            };
            for (g, x) in part.iter_mut().zip(&src[at]) {
                // A 16-bit gradient widens exactly: the sum is the host's `from_f32(g + x)`.
                *g = G::from_f32(g.to_f32() + x);
            }
            // SAFETY: as above.
            unsafe { self.alloc.upload(ptr(to.as_mut_ptr()), bytes(part)) };
        });
    }

    /// `src` (this device's memory: a MoE router's expert choices) into `dst`, of the same
    /// length, as they are.
    pub fn download_u32(&self, src: View<'_, u32>, dst: &mut [u32]) {
        self.check(src.memory(), src.len(), dst.len());
        // SAFETY: `src` is `dst.len()` u32 of this device's memory (checked above); every bit
        // pattern is a u32; the bytes borrow `dst`.
        unsafe {
            let to = std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), 4 * dst.len());
            self.alloc.download(to, ptr(src.as_ptr()));
        }
    }

    /// Sets `dst` (this device's memory) to zero.
    pub fn zero<G: Elem>(&self, mut dst: ViewMut<'_, G>) {
        self.check(dst.memory(), dst.len(), dst.len());
        let bytes = std::mem::size_of::<G>() * dst.len();
        // SAFETY: `dst` is `bytes` bytes of this device's memory (checked above).
        unsafe { self.alloc.zero(ptr(dst.as_mut_ptr()), bytes) };
    }

    /// A copy is of this device's memory, host and device of one length (a bug otherwise).
    fn check(&self, mem: Memory, device_len: usize, host_len: usize) {
        if let Some(p) = super::view::copy_problem(self.alloc.memory(), mem, device_len, host_len) {
            panic!("internal: {p}");
        }
    }
}

/// `src` widened into `dst`: read as a slice on the host, copied from a device by `dev`.
pub fn read_f32<G: Elem>(dev: Option<&HostCopy>, src: View<'_, G>, dst: &mut [f32]) {
    match (src.try_host(), dev) {
        (Ok(h), _) => {
            for (d, s) in dst.iter_mut().zip(h) {
                *d = s.to_f32();
            }
        }
        (Err(_), Some(c)) => c.download(src, dst),
        (Err(m), None) => panic!("internal: a view of {m} and no copy to read it"),
    }
}

/// `src` (u32 indices) into `dst`: read as a slice on the host, copied from a device by `dev`.
pub fn read_u32(dev: Option<&HostCopy>, src: View<'_, u32>, dst: &mut [u32]) {
    match (src.try_host(), dev) {
        (Ok(h), _) => dst.copy_from_slice(h),
        (Err(_), Some(c)) => c.download_u32(src, dst),
        (Err(m), None) => panic!("internal: a view of {m} and no copy to read it"),
    }
}

/// `src` rounded into `dst`: written as a slice on the host, copied to a device by `dev`.
pub fn write_f32<G: Elem>(dev: Option<&HostCopy>, src: &[f32], dst: ViewMut<'_, G>) {
    match dev {
        Some(c) if dst.memory() != Memory::Host => c.upload(src, dst),
        _ => {
            for (d, s) in dst.host_mut().iter_mut().zip(src) {
                *d = G::from_f32(*s);
            }
        }
    }
}

/// `dst += src` (ZeRO-2's shard of the reduced gradients summed over micro-batches), each sum
/// taken in f32 and rounded once, as on the host ([`HostCopy::add`] on a device).
pub fn add_f32<G: Elem>(dev: Option<&HostCopy>, src: &[f32], dst: ViewMut<'_, G>) {
    match dev.filter(|_| dst.memory() != Memory::Host) {
        Some(c) => c.add(src, dst),
        None => {
            for (g, x) in dst.host_mut().iter_mut().zip(src) {
                *g = G::from_f32(g.to_f32() + x);
            }
        }
    }
}

/// Sets `dst` to zero, on the host or on the device `dev` copies for.
pub fn zero<G: Elem>(dev: Option<&HostCopy>, dst: ViewMut<'_, G>) {
    match dev {
        Some(c) if dst.memory() != Memory::Host => c.zero(dst),
        _ => dst.host_mut().fill(G::from_f32(0.0)),
    }
}

/// Copies `dst.len()` elements at device address `src` into the host view `dst`.
///
/// # Safety
/// `src` must address that many elements of `dev`'s memory.
pub unsafe fn copy_down<T: Elem>(dev: &dyn DeviceAlloc, src: *const T, dst: ViewMut<'_, T>) {
    let dst = dst.host_mut();
    let bytes = std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), size_of_val(dst));
    dev.download(
        bytes,
        NonNull::new(src.cast_mut().cast()).expect("never null"),
    );
}

/// Copies the host view `src` to device address `dst`.
///
/// # Safety
/// `dst` must address `src.len()` elements of `dev`'s memory.
pub unsafe fn copy_up<T: Elem>(dev: &dyn DeviceAlloc, src: View<'_, T>, dst: *mut T) {
    dev.upload(
        NonNull::new(dst.cast()).expect("never null"),
        bytes(src.host()),
    );
}

/// [`copy_up`] on the device's copy stream ([`DeviceAlloc::upload_ahead`]): returns at once.
///
/// # Safety
/// As [`copy_up`]; and `src` stays unchanged until work that awaited the copy has run.
pub unsafe fn copy_up_ahead<T: Elem>(dev: &dyn DeviceAlloc, src: View<'_, T>, dst: *mut T) {
    dev.upload_ahead(
        NonNull::new(dst.cast()).expect("never null"),
        bytes(src.host()),
    );
}

fn ptr<T>(p: *const T) -> NonNull<u8> {
    NonNull::new(p as *mut u8).expect("a view's address is not null")
}

/// An `Elem` slice's bytes (what a device copy moves).
pub fn bytes<T: Elem>(s: &[T]) -> &[u8] {
    // SAFETY: an `Elem` is plain data without padding; the bytes borrow `s`.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// An `Elem` slice's bytes, to be written.
pub fn bytes_mut<T: Elem>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes`; every bit pattern is a valid f32, bf16 or f16.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{AsView, DeviceBuf, EmulatedDevice};
    use half::bf16;

    #[test]
    fn device_copies_widen_and_round_as_the_host_does_across_stages() {
        let a: Arc<dyn DeviceAlloc> = Arc::new(EmulatedDevice { ordinal: 0 });
        let c = HostCopy::new(a.clone());
        // Longer than two stage-fulls, with a short last one; values bf16 rounds (1/3 and
        // friends).
        let n = 2 * STAGE_BYTES / 2 + 7;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 + 1.0) / 3.0).collect();
        let host: Vec<bf16> = x.iter().map(|v| bf16::from_f32(*v)).collect();
        let mut buf = DeviceBuf::<bf16>::zeros(&a, n).unwrap();
        write_f32(Some(&c), &x, buf.view_mut());
        assert_eq!(buf.to_host(), host, "rounded to nearest, as on the host");
        let mut back = vec![0.0; n - 3];
        read_f32(Some(&c), buf.view().slice(3..), &mut back);
        let want: Vec<f32> = host[3..].iter().map(|v| v.to_f32()).collect();
        assert_eq!(back, want);
        // f32 goes whole, at an offset.
        let mut f = DeviceBuf::<f32>::zeros(&a, n).unwrap();
        write_f32(Some(&c), &x[..10], f.view_mut().slice_mut(5..15));
        assert_eq!(&f.to_host()[5..15], &x[..10]);
        assert_eq!(f.to_host()[4], 0.0);
        c.zero(f.view_mut().slice_mut(6..8));
        assert_eq!(&f.to_host()[5..9], &[x[0], 0.0, 0.0, x[3]]);
        // Sums into the device's 16-bit elements, each rounded once, across the stages.
        let more: Vec<f32> = (0..n - 3).map(|i| (i % 7) as f32 * 0.01).collect();
        add_f32(Some(&c), &more, buf.view_mut().slice_mut(3..));
        let summed: Vec<bf16> = (host[3..].iter().zip(&more))
            .map(|(g, x)| bf16::from_f32(g.to_f32() + x))
            .collect();
        assert_eq!(&buf.to_host()[3..], &summed[..], "summed as on the host");
        assert_eq!(buf.to_host()[..3], host[..3]);
        // Indices go as they are.
        let ix: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let dix = DeviceBuf::<u32>::from_host(&a, &ix).unwrap();
        let mut got = vec![0u32; n - 5];
        read_u32(Some(&c), dix.view().slice(5..), &mut got);
        assert_eq!(got, ix[5..]);
        // Host views need no copy.
        let mut h = vec![0.0f32; 4];
        read_f32(None, x[..4].view(), &mut h);
        assert_eq!(h, x[..4]);
    }
}
