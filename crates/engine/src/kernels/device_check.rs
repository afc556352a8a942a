//! `OnDevice<K>`: a host backend run as if its memory were an accelerator's, to check that
//! model code reaches device buffers only through the kernels.
//!
//! Every buffer a device backend is given lives in device memory, which the host cannot
//! address: the model must never index, fill or copy a parameter, gradient or activation on
//! the host, and must hand the kernels device views, never host slices. `OnDevice` checks both
//! without a GPU. Its pool places buffers in host memory *tagged* [`Memory::Device`] (so any
//! host access through a view or a `Buf` stops with the memory named, [`View::host`]), and
//! its kernels refuse a view that is not tagged as device memory, then run the inner (CPU)
//! backend on the same bytes. A model step that completes under it, with the same bits as the
//! plain CPU step, is a step a device backend can run.
//!
//! The forwarding is generated from the kernel interface's list, as [`super::Observed`]'s is.

use super::*;

/// A backend whose views must all be tagged as device memory (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct OnDevice<K> {
    pub inner: K,
}

/// An op's argument as the inner host backend takes it: a device-tagged view re-tagged as the
/// host memory it really is, anything else as it is.
pub trait HostArg: Sized {
    fn host_arg(self, op: &'static str) -> Self;
}

/// The host memory an emulated device view really lives in; a view that is not device
/// memory is a bug in the code that chose it, named with the op.
#[track_caller]
fn check_device(mem: Memory, op: &'static str) {
    assert!(
        matches!(mem, Memory::Device(_)),
        "op {op} was handed {mem} on a device backend: every buffer must be device memory"
    );
}

impl<T> HostArg for View<'_, T> {
    fn host_arg(self, op: &'static str) -> Self {
        check_device(self.memory(), op);
        // SAFETY: the emulated device's memory is host memory (the module docs).
        unsafe {
            View::from_raw_parts(
                std::ptr::NonNull::new_unchecked(self.as_ptr() as *mut T),
                self.len(),
                Memory::Host,
            )
        }
    }
}

impl<T> HostArg for ViewMut<'_, T> {
    fn host_arg(mut self, op: &'static str) -> Self {
        check_device(self.memory(), op);
        let len = self.len();
        // SAFETY: as for `View`; the unique borrow moves into the result.
        unsafe {
            ViewMut::from_raw_parts(
                std::ptr::NonNull::new_unchecked(self.as_mut_ptr()),
                len,
                Memory::Host,
            )
        }
    }
}

impl<G> HostArg for Weighted<'_, '_, G> {
    fn host_arg(self, op: &'static str) -> Self {
        self.retagged((HostArg::host_arg, op))
    }
}

impl<X: HostArg> HostArg for Option<X> {
    fn host_arg(self, op: &'static str) -> Self {
        self.map(|x| x.host_arg(op))
    }
}

impl<X: HostArg, Y: HostArg> HostArg for (X, Y) {
    fn host_arg(self, op: &'static str) -> Self {
        (self.0.host_arg(op), self.1.host_arg(op))
    }
}

/// Arguments that are not memory: shapes, flags, scalars, and the RoPE table (a backend's
/// own constant, which a device backend keeps a copy of).
macro_rules! not_memory {
    ($($t:ty),* $(,)?) => {
        $(impl HostArg for $t {
            fn host_arg(self, _: &'static str) -> Self {
                self
            }
        })*
    };
}
not_memory!(
    MatmulShape,
    NormShape,
    RopeShape,
    AttnShape,
    CachedAttnShape,
    RingShape,
    RouteShape,
    CeShape,
    CeShardShape,
    AdamWParams,
    Accum,
    Rounding,
    usize,
    bool,
    f32,
    &RopeTable,
);

/// Every argument of an op passed through [`HostArg`], then to the inner backend.
macro_rules! on_device_op {
    ($s:ident, $name:ident, $($arg:ident),*) => {
        $s.inner.$name($(HostArg::host_arg($arg, stringify!($name))),*)
    };
}

/// `impl Kernels for OnDevice`, generated from the kernel interface's list.
macro_rules! on_device_kernels {
    ($($list:tt)*) => {
        wrapper_kernels!([K: Kernels<S, G>] OnDevice<K>, on_device_op; $($list)*);
    };
}
kernel_interface!(on_device_kernels);

/// A [`crate::model::BufferPool`] whose buffers are host blocks tagged as device `ordinal`'s
/// memory, for [`OnDevice`]: the model's host accesses to them stop with the memory named.
/// A test instrument: every block stays allocated until the pool is dropped.
#[derive(Debug, Default)]
pub struct DevicePool {
    pub ordinal: u32,
    /// Every block handed out, with its layout.
    blocks: Vec<(usize, std::alloc::Layout)>,
}

impl DevicePool {
    pub fn new(ordinal: u32) -> Self {
        DevicePool {
            ordinal,
            blocks: vec![],
        }
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        for (p, layout) in self.blocks.drain(..) {
            // SAFETY: allocated in `place` with this layout.
            unsafe { std::alloc::dealloc(p as *mut u8, layout) };
        }
    }
}

impl crate::model::BufferPool for DevicePool {
    fn did_alloc(&mut self, _: crate::model::BufName, _: u64) {}
    fn did_free(&mut self, _: crate::model::BufName, _: u64) {}
    fn place(&mut self, _: crate::model::BufName, bytes: u64) -> Option<std::ptr::NonNull<u8>> {
        let layout =
            std::alloc::Layout::from_size_align(bytes.max(1) as usize, crate::model::BUF_ALIGN)
                .ok()?;
        // SAFETY: a non-zero size.
        let p = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        self.blocks.push((p.as_ptr() as usize, layout));
        Some(p)
    }
    fn memory(&self) -> Memory {
        Memory::Device(self.ordinal)
    }
}

/// `host` as a view of emulated device `ordinal`'s memory (the inputs a device backend would
/// have been given: weights, gradients, token ids).
pub fn emulated<T>(host: &[T], ordinal: u32) -> View<'_, T> {
    // SAFETY: the emulated device's memory is host memory, borrowed as `host` is.
    unsafe {
        View::from_raw_parts(
            std::ptr::NonNull::from(host).cast(),
            host.len(),
            Memory::Device(ordinal),
        )
    }
}

/// `host` as a writable view of emulated device `ordinal`'s memory.
pub fn emulated_mut<T>(host: &mut [T], ordinal: u32) -> ViewMut<'_, T> {
    let len = host.len();
    // SAFETY: as `emulated`, with the unique borrow.
    unsafe {
        ViewMut::from_raw_parts(
            std::ptr::NonNull::from(host).cast(),
            len,
            Memory::Device(ordinal),
        )
    }
}
