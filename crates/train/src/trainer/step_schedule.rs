//! The order in which a rank runs the forward and backward work of a step (and of an
//! evaluation), chosen once when the trainer is built from the layout: the step module
//! (`step.rs`) calls `forward_backward` and names no dimension.
//!
//! - [`StepSchedule::MicroBatches`]: every micro-batch's forward, then its backward, in order
//!   (the gradient accumulation loop of `step.rs`), with the parameters read from where they
//!   are (ZeRO-3: gathered unit by unit into the windows, `ferrotron_dist::zero::zero3`).
//! - [`StepSchedule::Pipeline`]: the stage's program from the planner (`plan::schedule`:
//!   GPipe, 1F1B or interleaved 1F1B; Huang et al. 2019, Narayanan et al. 2021), its chunks'
//!   forwards and backwards interleaved with the other stages' (`pipeline_step.rs`).
//!
//! A schedule that reorders a step's work (zero-bubble, DualPipe) is one more variant here and
//! a file beside `pipeline_step.rs`; the step module does not change.

use super::*;
use ferrotron_dist::grad_sync::GradSync;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StepSchedule {
    MicroBatches,
    Pipeline,
}

impl StepSchedule {
    /// The schedule of a rank in `mesh`: a pipeline stage runs its program.
    pub(super) fn of(mesh: &Mesh) -> Self {
        match mesh.pp {
            Some(_) => StepSchedule::Pipeline,
            None => StepSchedule::MicroBatches,
        }
    }
}

impl Trainer {
    /// The step's forward and backward work, by the rank's schedule; returns the micro-batches'
    /// loss (a pipeline's summed over its stages).
    pub(super) fn forward_backward<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        params: ViewMut<'_, S>,
        grads: &mut dyn GradBuf<G>,
        sync: &mut dyn GradSync<G>,
        dp: Option<&RefCell<DataParallel>>,
        num_targets: usize,
    ) -> Result<LossSum> {
        match self.step_schedule {
            StepSchedule::Pipeline => {
                let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
                let params = params.into_view();
                self.pipeline_work(step, params, grads, dp, num_targets, loss_scale)
            }
            StepSchedule::MicroBatches => {
                // ZeRO-3: the weights of the last step are stale in every window.
                let mut gather = self.gather.take();
                let loss = {
                    let mut src = Source::new(params, gather.as_mut(), dp, self.opt_len);
                    self.micro_batches(step, &mut src, grads, sync, num_targets)
                };
                self.gather = gather;
                loss
            }
        }
    }

    /// The forward of the validation batches, by the rank's schedule: the pipeline's
    /// evaluation program, or batch by batch (`evaluate.rs`).
    pub(super) fn eval_forward<S: Elem>(
        &mut self,
        params: ViewMut<'_, S>,
        dp: Option<&RefCell<DataParallel>>,
    ) -> Result<LossSum> {
        match self.step_schedule {
            StepSchedule::Pipeline => {
                self.allocate_pipeline();
                self.pipeline_eval(params.into_view())
            }
            StepSchedule::MicroBatches => self.eval_batches(params, dp),
        }
    }
}
