//! The activation arena: hands the engine exactly the buffers of the memory plan, allocated when
//! the plan says they appear and freed when it says they go, and counts live bytes per name.
//!
//! It also finds the phase boundaries of a step for the measured memory timeline. The engine
//! does not announce them, so they are read off its alloc/free events exactly where the planner
//! (`ferrotron_plan::planner::rank_plan`) places its marks: a layer's forward ends when its
//! output exists (the next layer's input, or the final norm's input for the last layer), with
//! the layer's `recompute.*` workspace still live; the loss when the LM head's transient buffers
//! go; a layer's backward when its last saved buffer is freed (its `input`, after every
//! `recompute.*` buffer of that backward).

use crate::alloc;
use ferrotron_engine::model::{BufName, BufferPool};

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
    layers: usize,
    /// Live saved buffers per layer (`act.layers.{i}.*`), to see a layer's last free.
    layer_live: Vec<u32>,
    /// Steps to record (1..=steps).
    steps: u64,
    step: u64,
    mb: u64,
    running: Running,
    loss_taken: bool,
}

impl Timeline {
    /// Room for `steps` steps of `grad_acc` micro-batches of a `layers`-layer model.
    pub fn new(baseline: u64, layers: usize, steps: u64, grad_acc: u64) -> Self {
        // init + per step: gradients, per micro-batch (L forward + loss + L backward), optimizer.
        let per_step = 2 + grad_acc as usize * (2 * layers + 1);
        Timeline {
            samples: Vec::with_capacity(1 + steps as usize * per_step),
            baseline,
            layers,
            layer_live: vec![0; layers],
            steps,
            step: 0,
            mb: 0,
            running: Running::Idle,
            loss_taken: false,
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

/// Buffers come from the heap one by one (so the process's live bytes follow the plan's
/// timeline); `live`/`peak` count only these buffers.
#[derive(Debug, Default)]
pub struct PlanPool {
    pub live: u64,
    pub peak: u64,
    pub timeline: Option<Timeline>,
}

impl PlanPool {
    /// Tells the pool what runs next: `running` for micro-batch `mb` of (1-based) `step`.
    pub fn enter(&mut self, step: u64, mb: u64, running: Running) {
        if let Some(t) = &mut self.timeline {
            let on = t.records(step);
            t.step = step;
            t.mb = mb;
            t.running = if on { running } else { Running::Idle };
            t.loss_taken = false;
        }
    }

    /// Samples a boundary the trainer itself defines (init, gradients, optimizer) at `step`.
    pub fn sample(&mut self, step: u64, point: Point) {
        if let Some(t) = &mut self.timeline {
            if t.records(step) {
                t.step = step;
                t.mb = 0;
                t.push(point, alloc::live());
            }
        }
    }

    fn on_alloc(t: &mut Timeline, name: BufName, before: bool) {
        if t.running != Running::Forward {
            return;
        }
        match (name.layer, name.name) {
            // The last layer's output is the head's `act.final_norm.input`.
            (None, "act.final_norm.input") if !before && t.layers > 0 => {
                t.push(
                    Point::Forward {
                        layer: t.layers as u32 - 1,
                    },
                    alloc::live(),
                );
            }
            (Some(i), n) if !before => {
                if let Some(c) = t.layer_live.get_mut(i as usize) {
                    *c += 1;
                }
                // Layer i's output is layer i+1's input: layer i's forward is done.
                if n == "input" && i > 0 {
                    t.push(Point::Forward { layer: i - 1 }, alloc::live());
                }
            }
            _ => {}
        }
    }

    fn on_free(t: &mut Timeline, name: BufName, before: bool) {
        match (t.running, name.layer, name.name) {
            // The plan marks the loss with both LM-head transients live and frees them after:
            // sample at the first of their frees, before the memory goes.
            (Running::Forward, None, "act.logits_chunk" | "act.losses")
                if before && !t.loss_taken =>
            {
                t.loss_taken = true;
                t.push(Point::Loss, alloc::live());
            }
            (Running::Backward, Some(i), _) if !before => {
                if let Some(c) = t.layer_live.get_mut(i as usize) {
                    *c = c.saturating_sub(1);
                    if *c == 0 {
                        t.push(Point::Backward { layer: i }, alloc::live());
                    }
                }
            }
            _ => {}
        }
    }
}

impl BufferPool for PlanPool {
    fn will_alloc(&mut self, name: BufName, _bytes: u64) {
        if let Some(t) = &mut self.timeline {
            Self::on_alloc(t, name, true);
        }
    }
    fn did_alloc(&mut self, name: BufName, bytes: u64) {
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        if let Some(t) = &mut self.timeline {
            Self::on_alloc(t, name, false);
        }
    }
    fn will_free(&mut self, name: BufName, _bytes: u64) {
        if let Some(t) = &mut self.timeline {
            Self::on_free(t, name, true);
        }
    }
    fn did_free(&mut self, name: BufName, bytes: u64) {
        self.live -= bytes;
        if let Some(t) = &mut self.timeline {
            Self::on_free(t, name, false);
        }
    }
}
