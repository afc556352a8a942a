//! `MemoryPlan`: the named buffers of one rank and the order in which they are allocated and
//! freed over the first two optimizer steps. Peaks, the per-component breakdown and the timeline
//! are all read off one sweep of this program, so they can never disagree with each other, and
//! the trainer, which allocates exactly these buffers in exactly this order, can be compared
//! with it point by point.

use crate::recipe::DType;
use serde::Serialize;

/// What a buffer is, for the per-component breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Params,
    Grads,
    Master,
    Optimizer,
    /// Activations saved by transformer layers for the backward pass.
    LayerActivations,
    /// Other saved activations: embeddings, final norm, logits, losses, token ids.
    OtherActivations,
    /// Transient compute workspace: activation gradients, a recomputed layer.
    Workspace,
    /// Communication and staging buffers: DP buckets, ZeRO-3 gathers, TP/SP gathers, PP p2p.
    CommBuffers,
}

pub const CATEGORIES: [Category; 8] = [
    Category::Params,
    Category::Grads,
    Category::Master,
    Category::Optimizer,
    Category::LayerActivations,
    Category::OtherActivations,
    Category::Workspace,
    Category::CommBuffers,
];

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Buffer {
    pub name: String,
    pub dtype: DType,
    pub numel: u64,
    pub category: Category,
}

impl Buffer {
    pub fn bytes(&self) -> u64 {
        self.numel * self.dtype.bytes()
    }
}

pub type BufId = usize;

/// One instruction of a rank's program. Activation buffers can be live several times at once
/// (one instance per micro-batch in flight in a pipeline), so live counts are kept per buffer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Op {
    Alloc(BufId),
    Free(BufId),
    /// A named point of the step (`step` is 1 or 2), where the trainer samples live bytes.
    Mark {
        step: u32,
        phase: Phase,
        label: String,
    },
}

/// Coarse phases, used to group marks into the timeline the issue asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Init,
    Forward,
    Loss,
    Backward,
    Optimizer,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryPlan {
    pub buffers: Vec<Buffer>,
    pub program: Vec<Op>,
    /// Bytes held in host memory by offloading (not part of the device peak).
    pub host_bytes: u64,
}

/// Live bytes per category at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    pub params: u64,
    pub grads: u64,
    pub master: u64,
    pub optimizer: u64,
    pub layer_activations: u64,
    pub other_activations: u64,
    pub workspace: u64,
    pub comm_buffers: u64,
}

impl Breakdown {
    fn slot(&mut self, c: Category) -> &mut u64 {
        match c {
            Category::Params => &mut self.params,
            Category::Grads => &mut self.grads,
            Category::Master => &mut self.master,
            Category::Optimizer => &mut self.optimizer,
            Category::LayerActivations => &mut self.layer_activations,
            Category::OtherActivations => &mut self.other_activations,
            Category::Workspace => &mut self.workspace,
            Category::CommBuffers => &mut self.comm_buffers,
        }
    }

    pub fn get(&self, c: Category) -> u64 {
        let mut copy = *self;
        *copy.slot(c)
    }

    pub fn total(&self) -> u64 {
        CATEGORIES.iter().map(|&c| self.get(c)).sum()
    }

    pub fn model_states(&self) -> u64 {
        self.params + self.grads + self.master + self.optimizer
    }

    pub fn activations(&self) -> u64 {
        self.layer_activations + self.other_activations
    }
}

/// One sampled point of the program: the live bytes at a mark, and the highest live bytes
/// reached since the previous mark (allocations inside a phase can peak between marks).
#[derive(Debug, Clone, Serialize)]
pub struct MarkSample {
    pub step: u32,
    pub phase: Phase,
    pub label: String,
    pub live: u64,
    pub max_since_previous: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    pub marks: Vec<MarkSample>,
    pub peak: u64,
    /// Composition of live memory at the (first) instant of the peak.
    pub at_peak: Breakdown,
    /// Where the peak happens (the label of the next mark).
    pub peak_label: String,
}

impl MemoryPlan {
    pub fn add(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        numel: u64,
        category: Category,
    ) -> BufId {
        self.buffers.push(Buffer {
            name: name.into(),
            dtype,
            numel,
            category,
        });
        self.buffers.len() - 1
    }

    pub fn alloc(&mut self, ids: &[BufId]) {
        self.program.extend(ids.iter().map(|&i| Op::Alloc(i)));
    }

    pub fn free(&mut self, ids: &[BufId]) {
        self.program.extend(ids.iter().rev().map(|&i| Op::Free(i)));
    }

    pub fn mark(&mut self, step: u32, phase: Phase, label: impl Into<String>) {
        self.program.push(Op::Mark {
            step,
            phase,
            label: label.into(),
        });
    }

    pub fn find(&self, name: &str) -> Option<&Buffer> {
        self.buffers.iter().find(|b| b.name == name)
    }

    /// Runs the program, tracking live bytes.
    pub fn sweep(&self) -> Sweep {
        let mut live = Breakdown::default();
        let mut count = vec![0u32; self.buffers.len()];
        let mut marks = Vec::new();
        let (mut peak, mut at_peak, mut peak_pending) = (0u64, Breakdown::default(), true);
        let mut peak_label = String::new();
        let mut since = 0u64;
        for op in &self.program {
            match op {
                Op::Alloc(i) => {
                    let b = &self.buffers[*i];
                    count[*i] += 1;
                    *live.slot(b.category) += b.bytes();
                    let total = live.total();
                    since = since.max(total);
                    if total > peak {
                        peak = total;
                        at_peak = live;
                        peak_pending = true;
                    }
                }
                Op::Free(i) => {
                    let b = &self.buffers[*i];
                    // A free without a live instance is a bug in a plan builder.
                    debug_assert!(count[*i] > 0, "free of dead buffer {}", b.name);
                    count[*i] = count[*i].saturating_sub(1);
                    *live.slot(b.category) -= b.bytes();
                }
                Op::Mark { step, phase, label } => {
                    let total = live.total();
                    if peak_pending {
                        peak_label = label.clone();
                        peak_pending = false;
                    }
                    marks.push(MarkSample {
                        step: *step,
                        phase: *phase,
                        label: label.clone(),
                        live: total,
                        max_since_previous: since.max(total),
                    });
                    since = total;
                }
            }
        }
        Sweep {
            marks,
            peak,
            at_peak,
            peak_label,
        }
    }
}
