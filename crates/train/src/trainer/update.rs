//! The update that ends a training step, after its micro-batches: the loss summed over the
//! data-parallel group, Adam's state where it lives (host or device), the global gradient
//! norm and the loss scale's verdict, AdamW (`crate::optim::step`), and ZeRO-1/2's all-gather
//! of the updated parameters.

use super::*;
use crate::optim::grad_norm::grad_sum_sq;
use ferrotron_dist::grad_sync::StepGrads;

impl Trainer {
    /// The update of step `step` from the summed gradients `step_grads` (under ZeRO-2 and 3
    /// the rank's shard of them) and the micro-batches' `loss`.
    pub(super) fn update<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        mut params: ViewMut<'_, S>,
        step_grads: &StepGrads<'_, G>,
        dp: Option<&RefCell<DataParallel>>,
        mut loss: LossSum,
    ) -> Result<Stepped> {
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let grads = step_grads.parts().0;
        // Streamed (`--offload params`), the weights and gradients are in host memory: the
        // host's kernels reach them (the emulated device's are these, on device memory).
        let host = CpuKernels::PLAIN;
        let k: &dyn Kernels<S, G> = match self.cfg.parallel.offload {
            ferrotron_plan::Offload::Params => &host,
            _ => &self.kernels,
        };
        let to = Instant::now();
        let lr = self.schedule.at(self.step);
        let n = self.opt_len;
        // Offloaded, the moments are the offload tier's (`optim::offload`).
        let states = match &mut self.offload {
            Some(o) => {
                o.ensure_moments();
                None
            }
            None => Some(adam_states(
                &mut self.dev,
                self.device_alloc.as_ref(),
                (&mut self.opt, &mut self.moments),
                &mut self.master,
                n,
            )?),
        };
        // The reduced gradient of each run the optimizer updates: under ZeRO-2 and 3 in the
        // shard, else where the backward wrote it.
        let grad_of = |r: &OptRun| -> View<'_, G> { step_grads.reduced(r.params.clone(), r.at) };
        let sharded = dp.filter(|d| d.borrow().shard().is_some());
        let sum_sq = grad_sum_sq(
            k,
            &self.model,
            &self.runs,
            &self.mesh,
            grads,
            &grad_of,
            sharded,
        )?;
        // The loss a device kept on itself (`take_loss`), which the norm's read brought back
        // (issue #32: the loss and the norm in one host round trip), then summed over the
        // data-parallel group, after the norm on every rank alike.
        loss = device_loss(&self.kernels, loss);
        if let Some(dp) = dp {
            (loss.sum, loss.count) = dp.borrow_mut().sum_loss(loss.sum, loss.count)?;
        }
        let unscale = 1.0 / loss_scale as f64;
        let grad_norm = sum_sq.sqrt() * unscale;
        let skipped = |overflow, non_finite| Stepped {
            loss,
            grad_norm,
            lr,
            overflow,
            non_finite,
        };
        if let Some(scaler) = &mut self.scaler {
            let u = scaler.update(sum_sq.is_finite());
            if !u.step_taken {
                self.kernels.phase("optimizer", to, step, 0);
                self.pool.sample(step, Point::Optimizer);
                return Ok(skipped(Some(u), false));
            }
        } else if !sum_sq.is_finite() {
            // fp32 and bf16: a NaN or infinity anywhere makes Σg² non-finite, and Σg² is the
            // same number on every rank (summed over every group above), so every rank skips
            // this update together and the replicas stay identical. A non-finite loss gives
            // non-finite gradients through the cross-entropy's backward.
            self.kernels.phase("optimizer", to, step, 0);
            self.pool.sample(step, Point::Optimizer);
            return Ok(skipped(None, true));
        }
        // Clipping, folded with the unscaling into the factor AdamW applies to each gradient.
        let scale = grad_scale(unscale, grad_norm, self.cfg.optimizer.clip);
        let (h, rounding) = adamw_params(&self.cfg, lr, self.step + 1, scale);
        match (states, &mut self.offload) {
            (Some(states), _) => adamw(k, &self.runs, h, rounding, states, params.rb(), grad_of),
            (None, Some(o)) => o.step(&self.runs, h, rounding, params.rb(), grad_of)?,
            (None, None) => unreachable!("the states are the offload tier's"),
        }
        // The ranks that updated only their blocks gather the others' (ZeRO-1 and 2).
        if let Some(dp) = dp {
            let mut dp = dp.borrow_mut();
            // On GPUs with NCCL, in place from each segment's owner; else through the host.
            if !dp.gather_in_place(params.rb())? {
                let dev = dp.device_copy().cloned();
                dp.gather_updated(&mut ViewGather {
                    params: params.rb(),
                    dev: dev.as_ref(),
                })?;
            }
        }
        self.kernels.phase("optimizer", to, step, 0);
        self.pool.sample(step, Point::Optimizer);
        Ok(Stepped {
            loss,
            grad_norm,
            lr,
            overflow: None,
            non_finite: false,
        })
    }
}

/// Adam's moments and the master weights where the state lives (the device's or the host's):
/// the moments exist from the first optimizer step on, taken or skipped; on the host in the
/// rank's moments region (`moments`), at the plan's offsets.
fn adam_states<'a>(
    dev: &'a mut Option<DeviceState>,
    device_alloc: Option<&Arc<dyn DeviceAlloc>>,
    (opt, moments): (&'a mut Option<AdamState>, &mut Resident),
    master: &'a mut Option<Region<f32>>,
    n: usize,
) -> Result<States<'a>> {
    Ok(match (dev, device_alloc) {
        (Some(d), Some(a)) => {
            if d.opt.is_none() {
                let z = || DeviceBuf::zeros(a, n).map_err(anyhow::Error::msg);
                d.opt = Some((z()?, z()?));
            }
            let (m, v) = d.opt.as_mut().expect("created above");
            States {
                m: m.view_mut(),
                v: v.view_mut(),
                master: d.master.as_mut().map(|m| m.view_mut()),
            }
        }
        _ => {
            let opt = opt.get_or_insert_with(|| {
                // A plan without them here (they are on the host tier): heap regions.
                planned_moments(moments, n).unwrap_or_else(|| AdamState {
                    m: vec![0.0; n].into(),
                    v: vec![0.0; n].into(),
                })
            });
            States {
                m: opt.m.view_mut(),
                v: opt.v.view_mut(),
                master: master.as_mut().map(|m| m.view_mut()),
            }
        }
    })
}

/// Adam's two moments of `n` elements at their places in the moments region, zeroed (`None`:
/// the plan has none there).
pub(super) fn planned_moments(moments: &mut Resident, n: usize) -> Option<AdamState> {
    let mut moment = |name| moments.carve(name, 1).map(|mut r| r.remove(0));
    let (m, v) = (moment("optim.exp_avg")?, moment("optim.exp_avg_sq")?);
    assert!(
        m.len() == n && v.len() == n,
        "internal: the plan's moments hold {} and {}, the optimizer {n}",
        m.len(),
        v.len()
    );
    Some(AdamState { m, v })
}

/// AdamW's hyper-parameters for update `step` (1-based; the runs without decay zero its
/// weight decay) and how it rounds 16-bit weights.
fn adamw_params(cfg: &TrainConfig, lr: f64, step: u64, grad_scale: f64) -> (AdamWParams, Rounding) {
    let o = &cfg.optimizer;
    let rounding = match cfg.precision.stochastic_rounding {
        true => Rounding::Stochastic {
            seed: cfg.data.seed,
        },
        false => Rounding::Nearest,
    };
    let h = AdamWParams {
        lr,
        beta1: o.beta1,
        beta2: o.beta2,
        eps: o.eps,
        weight_decay: o.weight_decay,
        step,
        grad_scale: grad_scale as f32,
    };
    (h, rounding)
}

/// `loss` with what the backend kept of it on the device (`Kernels::take_loss`: the backend's
/// one loss slot, whatever its element types; nothing on the CPU).
pub(super) fn device_loss(kernels: &Tracing<Backend>, loss: LossSum) -> LossSum {
    LossSum {
        sum: loss.sum + Kernels::<f32>::take_loss(kernels),
        count: loss.count,
    }
}
