//! Named activation buffers and where they come from.
//!
//! The model asks a [`BufferPool`] for every activation / scratch buffer by its plan name
//! (`act.layers.3.q`, `grad.act.resid`, ...) when the forward reaches it and hands it back when
//! the backward has consumed it. The trainer plugs in its arena (or the tracking [`HeapPool`])
//! and so sees exactly the live bytes the memory plan predicts.

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

/// Source of activation buffers (f32 for now). `alloc` must return exactly `len` elements;
/// contents are unspecified (every buffer is fully written before it is read).
pub trait BufferPool {
    fn alloc(&mut self, name: BufName, len: usize) -> Vec<f32>;
    fn free(&mut self, name: BufName, buf: Vec<f32>);
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
    fn alloc(&mut self, name: BufName, len: usize) -> Vec<f32> {
        let bytes = (len * 4) as u64;
        self.live_bytes += bytes;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        self.note(name, bytes, true);
        vec![0.0; len]
    }
    fn free(&mut self, name: BufName, buf: Vec<f32>) {
        let bytes = (buf.len() * 4) as u64;
        self.live_bytes -= bytes;
        self.note(name, bytes, false);
    }
}
