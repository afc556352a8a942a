//! Named activation buffers and where they come from.
//!
//! The model asks a [`BufferPool`] for every activation / scratch buffer by its plan name
//! (`act.layers.3.q`, `grad.act.resid`, ...) when the forward reaches it and hands it back when
//! the backward has consumed it. The trainer plugs in its arena (or the tracking [`HeapPool`])
//! and so sees exactly the live bytes the memory plan predicts.

use crate::dtype::Elem;
use crate::kernels::{AsView, AsViewMut, Memory, View, ViewMut};
use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

/// A buffer's name without allocating (its `Display` is the plan's name): the planner's
/// table of tensors names every buffer (`ferrotron_plan::tensors`).
pub use ferrotron_plan::tensors::BufName;

/// A phase boundary of a micro-batch, announced by the engine as it passes it (the plan's
/// marks: `forward layer i`, `loss`, `backward layer i`). Forward: layer `i`'s output exists
/// and its `recompute.*` workspace is still live. Loss: the LM head's transients are still
/// live. Backward: layer `i`'s last saved buffer (its `input`) is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Boundary {
    Forward { layer: u32 },
    Loss,
    Backward { layer: u32 },
}

/// What a buffer may hold: the element types (f32 statistics and logits, the storage types)
/// and u32 indices (a MoE router's expert choices).
pub trait Plain: Copy + Default + Send + Sync + 'static {
    /// The value `BufferPool::poison` fills new buffers with (NaN for floats).
    fn poison() -> Self;
}

impl<T: Elem> Plain for T {
    fn poison() -> Self {
        T::from_f32(f32::NAN)
    }
}

impl Plain for u32 {
    fn poison() -> Self {
        u32::MAX
    }
}

/// Alignment of every buffer's memory (a cache line; every element type divides it).
pub const BUF_ALIGN: usize = 64;

/// A buffer of `len` elements handed out by a [`BufferPool`]: its own heap block, or a part of
/// the pool's arena at the offset the memory plan gives it, in the pool's [`Memory`]. The
/// kernels read and write it through views (`buf.view()`, `buf.view_mut()`); host code may also
/// dereference a host buffer to a slice (a device buffer refuses). It goes back with
/// [`BufferPool::free`] (dropping it instead leaks a heap block and leaves an arena's
/// accounting live).
pub struct Buf<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Allocated from the heap by `dyn BufferPool::alloc` (freed there too), not a view.
    heap: bool,
    mem: Memory,
}

// SAFETY: a `Buf` is the only handle to its memory (a heap block it owns, or an arena region
// no other live buffer overlaps), like a `Box<[T]>`.
unsafe impl<T: Send> Send for Buf<T> {}
unsafe impl<T: Sync> Sync for Buf<T> {}

impl<T> Buf<T> {
    /// No elements, no memory (a tensor the recompute policy dropped).
    pub const fn empty() -> Self {
        Buf {
            ptr: NonNull::dangling(),
            len: 0,
            heap: false,
            mem: Memory::Host,
        }
    }

    /// Where its memory lives.
    pub fn memory(&self) -> Memory {
        self.mem
    }

    /// Its elements (read without touching its memory, wherever that is).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> Default for Buf<T> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<T> AsView<T> for Buf<T> {
    fn view(&self) -> View<'_, T> {
        // SAFETY: `ptr` is valid for `len` initialised elements of `mem` while the buffer is
        // live (`dyn BufferPool::alloc` fills every element before handing it out).
        unsafe { View::from_raw_parts(self.ptr, self.len, self.mem) }
    }
}

impl<T> AsViewMut<T> for Buf<T> {
    fn view_mut(&mut self) -> ViewMut<'_, T> {
        // SAFETY: as in `view`, and no other live `Buf` overlaps this one.
        unsafe { ViewMut::from_raw_parts(self.ptr, self.len, self.mem) }
    }
}

impl<T> std::ops::Deref for Buf<T> {
    type Target = [T];
    /// The host slice (a buffer in device memory refuses, naming it).
    fn deref(&self) -> &[T] {
        self.view().host()
    }
}

impl<T> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.view_mut().host_mut()
    }
}

impl<T: fmt::Debug> fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buf[{}]", self.len)
    }
}

/// Where activation buffers come from, as seen by whoever accounts for them. The model
/// allocates every buffer through [`alloc`](#method.alloc) / [`free`](#method.free) on
/// `dyn BufferPool` (any element type: f32 for statistics and logits, the storage type for the
/// rest); the pool hears of each with its name and size in bytes, just before and just after
/// it is handed out or taken back, so a tracking allocator read in the hooks sees the memory
/// come and go. A pool with its own region places the buffer itself ([`BufferPool::place`]);
/// otherwise it is a zero-filled heap block. Contents of a placed buffer are unspecified
/// (every buffer is fully written before it is read; `poison` proves it).
pub trait BufferPool {
    fn will_alloc(&mut self, _name: BufName, _bytes: u64) {}
    fn did_alloc(&mut self, name: BufName, bytes: u64);
    fn will_free(&mut self, _name: BufName, _bytes: u64) {}
    fn did_free(&mut self, name: BufName, bytes: u64);
    /// Memory for buffer `name` of `bytes` bytes in the pool's own region, aligned to
    /// [`BUF_ALIGN`], or `None` for a heap block. It must overlap no live buffer.
    fn place(&mut self, _name: BufName, _bytes: u64) -> Option<NonNull<u8>> {
        None
    }
    /// Where the region [`place`](#method.place) hands out lives (a heap block is the host's).
    fn memory(&self) -> Memory {
        Memory::Host
    }
    /// The engine passed a phase boundary of the micro-batch.
    fn boundary(&mut self, _b: Boundary) {}
    /// Fill new buffers with NaN instead of zeros (tests that every buffer is written before it
    /// is read).
    fn poison(&self) -> bool {
        false
    }
}

fn heap_layout(bytes: usize) -> Layout {
    Layout::from_size_align(bytes, BUF_ALIGN).expect("buffer size overflows")
}

impl dyn BufferPool + '_ {
    /// A buffer of `len` elements named `name`.
    pub fn alloc<T: Plain>(&mut self, name: BufName, len: usize) -> Buf<T> {
        let size = len * std::mem::size_of::<T>();
        let bytes = size as u64;
        self.will_alloc(name, bytes);
        let poison = self.poison();
        let (ptr, heap, mem) = match self.place(name, bytes) {
            Some(p) => (p.cast::<T>(), false, self.memory()),
            None if size == 0 => (NonNull::dangling(), false, Memory::Host),
            None => {
                // Zeroed memory keeps a read-before-write bug deterministic.
                // SAFETY: the layout has a non-zero size.
                let p = unsafe { std::alloc::alloc_zeroed(heap_layout(size)) };
                let p = NonNull::new(p.cast::<T>())
                    .unwrap_or_else(|| std::alloc::handle_alloc_error(heap_layout(size)));
                (p, true, Memory::Host)
            }
        };
        let mut buf = Buf {
            ptr,
            len,
            heap,
            mem,
        };
        // A placed buffer's bytes are whatever its region held last: every bit pattern of the
        // element types is a value, and the model writes before it reads (`poison` tests it).
        if poison {
            buf.fill(T::poison());
        }
        self.did_alloc(name, bytes);
        buf
    }
    /// Returns `buf` (allocated as `name`).
    pub fn free<T: Plain>(&mut self, name: BufName, buf: Buf<T>) {
        let size = buf.len * std::mem::size_of::<T>();
        let bytes = size as u64;
        self.will_free(name, bytes);
        if buf.heap {
            // SAFETY: allocated in `alloc` with this layout.
            unsafe { std::alloc::dealloc(buf.ptr.as_ptr().cast(), heap_layout(size)) };
        }
        self.did_free(name, bytes);
    }
}

/// One alloc/free, for memory timelines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    pub name: BufName,
    pub bytes: u64,
    pub alloc: bool,
    /// Live bytes after this event.
    pub live_bytes: u64,
}

/// Heap-backed pool that counts live and peak bytes and can record every event.
#[derive(Debug, Default)]
pub struct HeapPool {
    pub live_bytes: u64,
    pub peak_bytes: u64,
    /// `Some` to record events (the log grows; leave `None` on the hot path).
    pub events: Option<Vec<PoolEvent>>,
}

impl HeapPool {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn recording() -> Self {
        HeapPool {
            events: Some(Vec::new()),
            ..Self::default()
        }
    }
    fn note(&mut self, name: BufName, bytes: u64, alloc: bool) {
        if let Some(ev) = self.events.as_mut() {
            ev.push(PoolEvent {
                name,
                bytes,
                alloc,
                live_bytes: self.live_bytes,
            });
        }
    }
}

impl BufferPool for HeapPool {
    fn did_alloc(&mut self, name: BufName, bytes: u64) {
        self.live_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        self.note(name, bytes, true);
    }
    fn did_free(&mut self, name: BufName, bytes: u64) {
        self.live_bytes -= bytes;
        self.note(name, bytes, false);
    }
}
