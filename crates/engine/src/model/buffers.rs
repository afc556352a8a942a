//! Named activation buffers and where they come from.
//!
//! The model asks a [`BufferPool`] for every activation / scratch buffer by its plan name
//! (`act.layers.3.q`, `grad.act.resid`, ...) when the forward reaches it and hands it back when
//! the backward has consumed it. The trainer plugs in its arena (or the tracking [`HeapPool`])
//! and so sees exactly the live bytes the memory plan predicts.

use crate::dtype::Elem;
use std::fmt;

/// A buffer name without allocating: `act.layers.{layer}.{name}` or a global `name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufName {
    pub layer: Option<u32>,
    pub name: &'static str,
}

impl BufName {
    /// Per-layer activation `act.layers.{layer}.{name}`.
    pub const fn layer(layer: usize, name: &'static str) -> Self {
        BufName {
            layer: Some(layer as u32),
            name,
        }
    }
    /// A global buffer, full name given (`act.final_norm.out`, `grad.act.q`, ...).
    pub const fn global(name: &'static str) -> Self {
        BufName { layer: None, name }
    }
}

impl fmt::Display for BufName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layer {
            Some(i) => write!(f, "act.layers.{i}.{}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// Where activation buffers come from, as seen by whoever accounts for them. The model
/// allocates every buffer through [`alloc`](#method.alloc) / [`free`](#method.free) on
/// `dyn BufferPool` (any element type: f32 for statistics and logits, the storage type for the
/// rest); the pool hears of each with its name and size in bytes, just before and just after
/// the heap operation, so a tracking allocator read in the hooks sees the memory come and go.
/// Contents of a new buffer are unspecified (every buffer is fully written before it is read).
pub trait BufferPool {
    fn will_alloc(&mut self, _name: BufName, _bytes: u64) {}
    fn did_alloc(&mut self, name: BufName, bytes: u64);
    fn will_free(&mut self, _name: BufName, _bytes: u64) {}
    fn did_free(&mut self, name: BufName, bytes: u64);
    /// Fill new buffers with NaN instead of zeros (tests that every buffer is written before it
    /// is read).
    fn poison(&self) -> bool {
        false
    }
}

impl dyn BufferPool + '_ {
    /// A buffer of `len` elements named `name`.
    pub fn alloc<T: Elem>(&mut self, name: BufName, len: usize) -> Vec<T> {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        self.will_alloc(name, bytes);
        // Zeroed memory keeps a read-before-write bug deterministic.
        let fill = if self.poison() {
            T::from_f32(f32::NAN)
        } else {
            T::default()
        };
        let buf = vec![fill; len];
        self.did_alloc(name, bytes);
        buf
    }
    /// Returns `buf` (allocated as `name`).
    pub fn free<T: Elem>(&mut self, name: BufName, buf: Vec<T>) {
        let bytes = (buf.len() * std::mem::size_of::<T>()) as u64;
        self.will_free(name, bytes);
        drop(buf);
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
