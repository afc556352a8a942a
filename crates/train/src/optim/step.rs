//! The update of a step, after the gradients are summed: clipping and AdamW over the runs of
//! parameters this rank updates (the global gradient norm's sum over the groups is the mesh's,
//! `Mesh::global_sum_sq`).

use ferrotron_engine::kernels::{AdamWParams, Kernels, Rounding, View, ViewMut};
use ferrotron_engine::Elem;
use std::ops::Range;

/// AdamW's two moments, allocated by the first optimizer step (as torch.optim does): on the
/// host, the rank's moments region at the plan's offsets (`memory::resident`); heap regions
/// when loaded from a checkpoint, a host tier or a device.
pub struct AdamState {
    pub m: ferrotron_dist::Region<f32>,
    pub v: ferrotron_dist::Region<f32>,
}

/// A run of parameters the optimizer updates: `params` of the flat buffers, at `at` in the
/// optimizer states and master weights (the same offsets unless ZeRO-1 shards them), its
/// weights at `weights` of the weights' buffer (`params.start`, or under ZeRO-3, whose weights
/// are the shard, `at`), and whether weight decay applies.
pub(crate) struct OptRun {
    pub params: Range<usize>,
    pub at: usize,
    pub weights: usize,
    pub decay: bool,
    /// A norm replicated over the tensor-parallel group (its gradient norm counts it once).
    pub replicated: bool,
}

impl OptRun {
    /// The run's weights in the weights' buffer.
    pub fn weights(&self) -> Range<usize> {
        self.weights..self.weights + self.params.len()
    }
}

/// The factor AdamW applies to each gradient as it reads it: the loss scale's `unscale`,
/// times global-norm clipping as torch.nn.utils.clip_grad_norm_ (max_norm / (norm + 1e-6)
/// when that is below 1; `max_norm` 0 does not clip).
pub(crate) fn grad_scale(unscale: f64, grad_norm: f64, max_norm: f64) -> f64 {
    let coef = max_norm / (grad_norm + 1e-6);
    match max_norm > 0.0 && coef < 1.0 {
        true => unscale * coef,
        false => unscale,
    }
}

/// Adam's moments and, with 16-bit weights, the f32 master weights, at the runs' `at`.
pub(crate) struct States<'a> {
    pub m: ViewMut<'a, f32>,
    pub v: ViewMut<'a, f32>,
    pub master: Option<ViewMut<'a, f32>>,
}

/// AdamW (Loshchilov & Hutter 2019) over every run: `h` with its weight decay applied to the
/// runs that decay, each run's weights where [`OptRun::weights`] places them.
pub(crate) fn adamw<'g, S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    runs: &[OptRun],
    h: AdamWParams,
    rounding: Rounding,
    mut states: States<'_>,
    mut params: ViewMut<'_, S>,
    grad_of: impl Fn(&OptRun) -> View<'g, G>,
) {
    for run in runs {
        let OptRun {
            params: r,
            at,
            decay,
            ..
        } = run;
        let h = AdamWParams {
            weight_decay: if *decay { h.weight_decay } else { 0.0 },
            ..h
        };
        let s = *at..at + r.len();
        let w = run.weights();
        let m = states.m.rb().slice_mut(s.clone());
        let v = states.v.rb().slice_mut(s.clone());
        match &mut states.master {
            Some(master) => k.adamw_step(
                h,
                master.rb().slice_mut(s),
                grad_of(run),
                m,
                v,
                Some((params.rb().slice_mut(w), rounding)),
            ),
            None => {
                let w = as_f32(params.rb().slice_mut(w));
                k.adamw_step(h, w, grad_of(run), m, v, None)
            }
        }
    }
}

/// Weights stored as f32 (no master copy) as the f32 buffer AdamW updates in place.
pub(crate) fn as_f32<S: Elem>(mut w: ViewMut<'_, S>) -> ViewMut<'_, f32> {
    assert!(
        S::DTYPE == ferrotron_plan::DType::F32,
        "without master weights the weights are f32"
    );
    let (len, mem) = (w.len(), w.memory());
    let p = std::ptr::NonNull::new(w.as_mut_ptr().cast::<f32>()).expect("a view is never null");
    // SAFETY: S is f32 (checked above): the same elements, borrowed as `w` was.
    unsafe { ViewMut::from_raw_parts(p, len, mem) }
}

#[cfg(test)]
mod tests {
    use super::grad_scale;

    #[test]
    fn clipping_scales_only_above_the_max_norm() {
        // torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped at 1.
        assert_eq!(grad_scale(0.5, 2.0, 0.0), 0.5);
        assert_eq!(grad_scale(0.5, 0.5, 1.0), 0.5);
        let want = 0.5 * 1.0 / (4.0 + 1e-6);
        assert!((grad_scale(0.5, 4.0, 1.0) - want).abs() < 1e-15);
    }
}
