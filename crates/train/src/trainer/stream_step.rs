//! The step of a rank that streams its parameters (`--offload params`,
//! `crate::offload_params`): the micro-batches read the weights through the device's windows
//! and hand each unit's gradients to the host as the backward completes them; the update then
//! runs on the host's weights and gradients, with the CPU kernels.

use super::*;
use ferrotron_dist::grad_sync::StepGrads;
use ferrotron_engine::model::Whole;

impl Trainer {
    /// The step on the device's parameter `windows` and gradient windows `grads`.
    pub(super) fn step_streamed<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        windows: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
        num_targets: usize,
    ) -> Result<Stepped> {
        let mut st = self.streaming.take().expect("a streamed step");
        // The backward's gradient reports and the update's loss sum use the data-parallel
        // group (when there is one) one after the other: they share it for the step.
        let dp = self.mesh.dp.take().map(RefCell::new);
        let out = self.step_with(&mut st, step, windows, grads, dp.as_ref(), num_targets);
        self.mesh.dp = dp.map(RefCell::into_inner);
        self.streaming = Some(st);
        out
    }

    fn step_with<S: Elem, G: Elem>(
        &mut self,
        st: &mut crate::offload_params::Streaming,
        step: u64,
        windows: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
        dp: Option<&RefCell<DataParallel>>,
        num_targets: usize,
    ) -> Result<Stepped> {
        let loss = {
            let mb = self.cfg.data.grad_acc as usize;
            let (mut src, mut units, mut sync) = st.micro_batches(windows, grads, mb, dp);
            self.micro_batches(step, &mut src, &mut units, &mut sync, num_targets)?
        };
        // The micro-batches are done: no activations until the next step.
        if let Some(a) = &mut self.pool.arena {
            a.trim();
        }
        let (params, grads) = st.update::<S, G>();
        let whole = StepGrads::Whole(Whole(grads));
        self.update(step, params, &whole, dp, loss)
    }
}
