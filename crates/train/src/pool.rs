//! The activation arena: hands the engine exactly the buffers of the memory plan, allocated when
//! the plan says they appear and freed when it says they go, and counts live bytes per name.

use ferrotron_engine::model::{BufName, BufferPool};

/// Buffers come from the heap one by one (so the process's live bytes follow the plan's
/// timeline); `live`/`peak` count only these buffers.
#[derive(Debug, Default)]
pub struct PlanPool {
    pub live: u64,
    pub peak: u64,
}

impl BufferPool for PlanPool {
    fn alloc(&mut self, _name: BufName, len: usize) -> Vec<f32> {
        self.live += 4 * len as u64;
        self.peak = self.peak.max(self.live);
        // Every buffer is fully written before it is read (the engine's contract, tested with
        // NaN-filled buffers), but zeroed memory keeps a bug deterministic.
        vec![0.0; len]
    }

    fn free(&mut self, _name: BufName, buf: Vec<f32>) {
        self.live -= 4 * buf.len() as u64;
    }
}
