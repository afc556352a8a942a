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
        if st.sharded() {
            let dp = dp.expect("ZeRO-3 shards over data parallelism (checked at start-up)");
            return self.step_sharded(st, step, windows, grads, dp, num_targets);
        }
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

    /// Sharded (`--zero 3 --offload params`, ZeRO-Infinity): ZeRO-3's step with its shard in
    /// host memory. The windows on the device are gathered from every rank's host shard, each
    /// unit's gradient window is reduce-scattered into the host's shard of the gradients (the
    /// ZeRO-2/3 sync, whose device copies are data parallelism's), and AdamW updates the host
    /// shard with the CPU kernels: the arithmetic, and so the trajectory, of `--zero 3`.
    fn step_sharded<S: Elem, G: Elem>(
        &mut self,
        st: &mut crate::offload_params::Streaming,
        step: u64,
        windows: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
        dp: &RefCell<DataParallel>,
        num_targets: usize,
    ) -> Result<Stepped> {
        let layout = self.grad_layout.clone();
        let geo = layout.windows().expect("ZeRO-3 has gradient windows");
        let mut z = self.gather.take().expect("sharded streaming runs ZeRO-3");
        let (params, mut shard) = st.update::<S, G>();
        shard.rb().host_mut().fill(G::from_f32(0.0));
        let mut sg = StepGrads::Sharded {
            shard,
            units: geo.view(grads),
            windows: geo,
        };
        let loss = {
            // The weights changed since the windows were filled.
            z.invalidate();
            let mut src = Source::Gathered(z.source(dp, params.as_view(), windows));
            let (buf, mut sync) = sg.sync(Some(dp), self.mesh.partial_norms());
            self.micro_batches(step, &mut src, buf, &mut sync, num_targets)
        };
        self.gather = Some(z);
        let loss = loss?;
        if let Some(a) = &mut self.pool.arena {
            a.trim();
        }
        self.update(step, params, &sg, Some(dp), loss)
    }
}
