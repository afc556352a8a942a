//! Several ranks on a device (`--device emulated` with `--dp N`, issue #33): which layouts run
//! there, and the copies between a device's gradients or weights and the host buckets that
//! data parallelism reduces.
//!
//! Data parallelism's buckets (the plan's `dp.grad_buckets`, two of `--bucket-mb`) are f32
//! host buffers already: the backward's final gradients are widened into them and their sums
//! written back, and the overlapped `*_start` collectives own them meanwhile. On a device
//! those buckets are the staging buffers of a host-staged reduction (device → host bucket →
//! threads or MPI → device), allocated once with the gradients at the plan's size: each piece
//! of gradient is copied straight from the device into its place in the bucket ([`read_f32`])
//! and each sum straight back ([`write_f32`]), so no collective sees a device view and the
//! reduction keeps its overlap with the backward. ZeRO-1's all-gather of the updated weights
//! goes through the same copies ([`ViewGather`]). (`ferrotron_dist::Staged` is the
//! communicator for collectives on device views: the tensor-, context- and pipeline-parallel
//! groups, still refused here.)
//!
//! A copy of a 16-bit gradient goes through a small buffer on the stack ([`CHUNK`] elements),
//! widened or rounded on the host exactly as the CPU path does (`Elem::to_f32`,
//! `Elem::from_f32`), so the sums and the trajectory are the CPU run's bit for bit.

use crate::data_parallel::{Gather, Segment};
use crate::device::Device;
use anyhow::{bail, Result};
use ferrotron_engine::kernels::{DeviceAlloc, Memory, View, ViewMut};
use ferrotron_engine::Elem;
use ferrotron_plan::{DType, Layout};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// Elements of a 16-bit copy's stack buffer (4 KiB of f32, 2 KiB of bf16): no heap memory
/// outside the plan, and few enough calls that a copy of a bucket's piece costs little.
pub const CHUNK: usize = 1024;

/// Refuses, in one line, a layout of several ranks that the device path cannot run yet: every
/// layout but data parallelism with ZeRO 0 to 3. One rank, and the CPU, pass.
pub fn check(device: Device, layout: &Layout) -> Result<()> {
    let world = layout.dp * layout.tp * layout.pp * layout.cp * layout.ep;
    if device != Device::Emulated || world <= 1 {
        return Ok(());
    }
    let refused = |what: String| -> Result<()> {
        bail!("device = emulated: {what}: several ranks on the device run data parallelism with ZeRO 0 to 3 only so far (issue #33); drop it, or use --device cpu")
    };
    if layout.ep > 1 {
        return refused(format!(
            "ep = {} (expert parallelism and its mixture-of-experts exchange)",
            layout.ep
        ));
    }
    if layout.tp > 1 {
        return refused(format!("tp = {} (tensor parallelism)", layout.tp));
    }
    if layout.pp > 1 {
        return refused(format!("pp = {} (pipeline parallelism)", layout.pp));
    }
    if layout.cp > 1 {
        return refused(format!("cp = {} (context parallelism)", layout.cp));
    }
    Ok(())
}

/// Copies between one device's memory and the host, element type by element type.
#[derive(Clone, Debug)]
pub struct HostCopy {
    alloc: Arc<dyn DeviceAlloc>,
}

impl HostCopy {
    pub fn new(alloc: Arc<dyn DeviceAlloc>) -> Self {
        HostCopy { alloc }
    }

    /// `src` (this device's memory) widened into `dst`, of the same length.
    fn download<G: Elem>(&self, src: View<'_, G>, dst: &mut [f32]) {
        self.check(src.memory(), src.len(), dst.len());
        if G::DTYPE == DType::F32 {
            // SAFETY: `src` is `dst.len()` f32 of this device's memory (checked above), and
            // f32 has no invalid bit patterns.
            unsafe { self.alloc.download(bytes_mut(dst), ptr(src.as_ptr())) };
            return;
        }
        let mut stage = [G::default(); CHUNK];
        for (i, out) in dst.chunks_mut(CHUNK).enumerate() {
            let part = &mut stage[..out.len()];
            let at = src.slice(i * CHUNK..i * CHUNK + out.len());
            // SAFETY: `at` is `part.len()` elements of this device's memory; an `Elem` is
            // plain data (f32, bf16, f16).
            unsafe { self.alloc.download(bytes_mut(part), ptr(at.as_ptr())) };
            for (o, x) in out.iter_mut().zip(part.iter()) {
                *o = x.to_f32();
            }
        }
    }

    /// `src` rounded to nearest into `dst` (this device's memory), of the same length.
    fn upload<G: Elem>(&self, src: &[f32], mut dst: ViewMut<'_, G>) {
        self.check(dst.memory(), dst.len(), src.len());
        if G::DTYPE == DType::F32 {
            // SAFETY: as in `download`.
            unsafe { self.alloc.upload(ptr(dst.as_mut_ptr()), bytes(src)) };
            return;
        }
        let mut stage = [G::default(); CHUNK];
        for (i, part_src) in src.chunks(CHUNK).enumerate() {
            let part = &mut stage[..part_src.len()];
            for (p, x) in part.iter_mut().zip(part_src) {
                *p = G::from_f32(*x);
            }
            let mut at = dst.rb().slice_mut(i * CHUNK..i * CHUNK + part.len());
            // SAFETY: `at` is `part.len()` elements of this device's memory.
            unsafe { self.alloc.upload(ptr(at.as_mut_ptr()), bytes(part)) };
        }
    }

    /// A copy is of this device's memory, host and device of one length (a bug otherwise).
    fn check(&self, mem: Memory, device_len: usize, host_len: usize) {
        if let Some(p) = ferrotron_engine::kernels::view::copy_problem(
            self.alloc.memory(),
            mem,
            device_len,
            host_len,
        ) {
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
/// taken in f32 and rounded once, as on the host: a device's elements are copied through a
/// stack buffer and back.
pub fn add_f32<G: Elem>(dev: Option<&HostCopy>, src: &[f32], mut dst: ViewMut<'_, G>) {
    let Some(c) = dev.filter(|_| dst.memory() != Memory::Host) else {
        for (g, x) in dst.host_mut().iter_mut().zip(src) {
            *g = G::from_f32(g.to_f32() + x);
        }
        return;
    };
    let mut acc = [0f32; CHUNK];
    for (i, part_src) in src.chunks(CHUNK).enumerate() {
        let acc = &mut acc[..part_src.len()];
        let at = i * CHUNK..i * CHUNK + part_src.len();
        c.download(dst.as_view().slice(at.clone()), acc);
        for (a, x) in acc.iter_mut().zip(part_src) {
            // A 16-bit gradient widens exactly: this is `from_f32(g.to_f32() + x)`.
            *a += x;
        }
        c.upload(acc, dst.rb().slice_mut(at));
    }
}

/// Sets `dst` to zero, on the host or on the device `dev` copies for.
pub fn zero<G: Elem>(dev: Option<&HostCopy>, mut dst: ViewMut<'_, G>) {
    match dev {
        Some(c) if dst.memory() != Memory::Host => {
            c.check(dst.memory(), dst.len(), dst.len());
            let bytes = std::mem::size_of::<G>() * dst.len();
            // SAFETY: `dst` is `bytes` bytes of this device's memory (checked above).
            unsafe { c.alloc.zero(ptr(dst.as_mut_ptr()), bytes) };
        }
        _ => dst.host_mut().fill(G::from_f32(0.0)),
    }
}

/// The weights around ZeRO-1's all-gather, wherever they live: this rank's blocks read from
/// them, every rank's written into them.
pub struct ViewGather<'a, 'd, S> {
    pub params: ViewMut<'a, S>,
    pub dev: Option<&'d HostCopy>,
}

impl<S: Elem> Gather for ViewGather<'_, '_, S> {
    fn own(&self, seg: &Segment, out: &mut [f32]) {
        read_f32(
            self.dev,
            self.params.as_view().slice(seg.params.clone()),
            out,
        );
    }
    fn put(&mut self, r: Range<usize>, values: &[f32]) {
        write_f32(self.dev, values, self.params.rb().slice_mut(r));
    }
}

fn ptr<T>(p: *const T) -> NonNull<u8> {
    NonNull::new(p as *mut u8).expect("a view's address is not null")
}

fn bytes<T: Elem>(s: &[T]) -> &[u8] {
    // SAFETY: an `Elem` is plain data without padding; the bytes borrow `s`.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn bytes_mut<T: Elem>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes`; every bit pattern is a valid f32, bf16 or f16.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_engine::kernels::{DeviceBuf, EmulatedDevice};
    use half::bf16;

    fn dev() -> (Arc<dyn DeviceAlloc>, HostCopy) {
        let a: Arc<dyn DeviceAlloc> = Arc::new(EmulatedDevice { ordinal: 0 });
        (a.clone(), HostCopy::new(a))
    }

    #[test]
    fn device_copies_widen_and_round_as_the_host_does_across_chunks() {
        let (a, c) = dev();
        // Longer than two chunks, with a short last one; values bf16 rounds (1/3 and friends).
        let n = 2 * CHUNK + 7;
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
        // Host views need no copy.
        let mut h = vec![0.0f32; 4];
        read_f32(None, x[..4].into(), &mut h);
        assert_eq!(h, x[..4]);
    }

    #[test]
    fn several_device_ranks_refuse_what_they_cannot_run_in_one_line() {
        /// A change to a layout.
        type Set = fn(&mut Layout);
        // dp 2 with `set` applied.
        let l = |set: Set| {
            let mut l = Layout {
                dp: 2,
                ..Layout::default()
            };
            set(&mut l);
            l
        };
        let fine: [Set; 4] = [|_| {}, |l| l.zero = 1, |l| l.zero = 2, |l| l.zero = 3];
        for ok in fine {
            check(Device::Emulated, &l(ok)).unwrap();
        }
        check(Device::Cpu, &l(|l| l.tp = 2)).unwrap();
        let cases: [(Set, &str); 4] = [
            (|l| l.tp = 2, "tp = 2 (tensor parallelism)"),
            (|l| l.pp = 2, "pp = 2 (pipeline parallelism)"),
            (|l| l.cp = 2, "cp = 2 (context parallelism)"),
            (
                |l| l.ep = 2,
                "ep = 2 (expert parallelism and its mixture-of-experts exchange)",
            ),
        ];
        for (set, what) in cases {
            let msg = check(Device::Emulated, &l(set)).unwrap_err().to_string();
            assert_eq!(msg, format!("device = emulated: {what}: several ranks on the device run data parallelism with ZeRO 0 to 3 only so far (issue #33); drop it, or use --device cpu"));
        }
        // One rank is the single-rank device path.
        check(Device::Emulated, &Layout::default()).unwrap();
    }
}
