//! The trainer's buffer pool: hands the engine its buffers from the rank's [`Arena`] (at the
//! plan's offsets), counts live bytes, and samples the measured memory timeline at the phase
//! boundaries the engine announces (`Boundary`) and the ones the trainer defines itself (init,
//! gradients, optimizer).
//!
//! A sample is the tracking allocator's live bytes with the arena counted as the bytes of its
//! live buffers rather than the whole region: so at every mark it is compared with the plan's
//! live bytes at that mark, and any byte allocated outside the plan shows as a difference.

use crate::memory::alloc;
use crate::memory::arena::Arena;
use ferrotron_engine::kernels::Memory;
use ferrotron_engine::model::{Boundary, BufName, BufferPool};
use std::ptr::NonNull;

/// A phase boundary of a step, as the plan's `Mark` labels name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    Init,
    Grads,
    Forward { layer: u32 },
    Loss,
    Backward { layer: u32 },
    Optimizer,
}

/// Live bytes at one boundary. `step` is 1-based, `mb` the micro-batch in the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub step: u64,
    pub mb: u64,
    pub point: Point,
    /// The tracking allocator's live bytes minus the trainer's baseline (as `mem_peak_measured`).
    pub measured: u64,
}

/// What the engine is running, as the trainer tells the pool (evaluation is `Idle`: its
/// forward allocates the same names but is no part of the timeline).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Running {
    #[default]
    Idle,
    Forward,
    Backward,
}

/// Sampling state. Everything is allocated up front: the samples are outside the plan, and a
/// push beyond the reserved capacity is dropped rather than allowed to grow the heap mid-step.
#[derive(Debug)]
pub struct Timeline {
    samples: Vec<Sample>,
    baseline: u64,
    /// Steps to record (1..=steps).
    steps: u64,
    step: u64,
    mb: u64,
    running: Running,
}

impl Timeline {
    /// Room for `steps` steps of `grad_acc` micro-batches of a `layers`-layer model.
    pub fn new(baseline: u64, layers: usize, steps: u64, grad_acc: u64) -> Self {
        // init + per step: gradients, per micro-batch (L forward + loss + L backward), optimizer.
        let per_step = 2 + grad_acc as usize * (2 * layers + 1);
        Timeline {
            samples: Vec::with_capacity(1 + steps as usize * per_step),
            baseline,
            steps,
            step: 0,
            mb: 0,
            running: Running::Idle,
        }
    }

    /// The live bytes that count as zero (set once the baseline is known).
    pub fn set_baseline(&mut self, baseline: u64) {
        self.baseline = baseline;
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Whether `step` (1-based) is one of the recorded steps.
    pub fn records(&self, step: u64) -> bool {
        step <= self.steps
    }

    fn push(&mut self, point: Point, live: u64) {
        if self.samples.len() < self.samples.capacity() {
            self.samples.push(Sample {
                step: self.step,
                mb: self.mb,
                point,
                measured: live.saturating_sub(self.baseline),
            });
        }
    }
}

/// The engine's buffers, from the arena when there is one (else from the heap one by one);
/// `live`/`peak` count only these buffers.
#[derive(Debug, Default)]
pub struct PlanPool {
    pub live: u64,
    pub peak: u64,
    pub timeline: Option<Timeline>,
    pub arena: Option<Arena>,
}

impl PlanPool {
    /// Tells the pool what runs next: `running` for micro-batch `mb` of (1-based) `step`.
    pub fn enter(&mut self, step: u64, mb: u64, running: Running) {
        if let Some(t) = &mut self.timeline {
            let on = t.records(step);
            t.step = step;
            t.mb = mb;
            t.running = if on { running } else { Running::Idle };
        }
    }

    /// The arena's region, placed now if it was not (`Arena::hold`): its address, or `None`
    /// without an arena.
    pub fn hold_arena(&mut self) -> Option<usize> {
        self.arena.as_mut().map(Arena::hold)
    }

    /// The process's live bytes with the arena counted by its live buffers.
    fn measured(&self) -> u64 {
        let (held, in_use) = self
            .arena
            .as_ref()
            .map_or((0, 0), |a| (a.held(), a.in_use()));
        alloc::live().saturating_sub(held) + in_use
    }

    /// Samples a boundary the trainer itself defines (init, gradients, optimizer) at `step`.
    pub fn sample(&mut self, step: u64, point: Point) {
        let live = self.measured();
        if let Some(t) = &mut self.timeline {
            if t.records(step) {
                t.step = step;
                t.mb = 0;
                t.push(point, live);
            }
        }
    }
}

impl BufferPool for PlanPool {
    fn did_alloc(&mut self, _name: BufName, bytes: u64) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
    }
    fn did_free(&mut self, name: BufName, bytes: u64) {
        self.live -= bytes;
        if let Some(a) = &mut self.arena {
            a.release(name, bytes);
        }
    }
    fn place(&mut self, name: BufName, bytes: u64) -> Option<NonNull<u8>> {
        self.arena.as_mut().map(|a| a.place(name, bytes))
    }
    fn memory(&self) -> Memory {
        self.arena.as_ref().map_or(Memory::Host, Arena::memory)
    }
    fn boundary(&mut self, b: Boundary) {
        let running = self.timeline.as_ref().map_or(Running::Idle, |t| t.running);
        if running == Running::Idle {
            return;
        }
        let point = match b {
            Boundary::Forward { layer } => Point::Forward { layer },
            Boundary::Loss => Point::Loss,
            Boundary::Backward { layer } => Point::Backward { layer },
        };
        let live = self.measured();
        if let Some(t) = &mut self.timeline {
            t.push(point, live);
        }
    }
}
