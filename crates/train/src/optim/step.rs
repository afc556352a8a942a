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
#[derive(Clone, Debug, PartialEq, Eq)]
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
/// runs that decay, each run's weights where [`OptRun::weights`] places them. Runs that lie
/// end to end everywhere go in one call ([`merged`]).
pub(crate) fn adamw<'g, S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    runs: &[OptRun],
    h: AdamWParams,
    rounding: Rounding,
    mut states: States<'_>,
    mut params: ViewMut<'_, S>,
    grad_of: impl Fn(&OptRun) -> View<'g, G>,
) {
    let mut next = 0;
    while next < runs.len() {
        let (run, after) = match rounding {
            Rounding::Nearest => merged(&runs[next..], &grad_of),
            // Its noise is indexed from the start of each call's view: one call per run, as
            // the offload tiers and every earlier checkpoint had it.
            Rounding::Stochastic { .. } => (runs[next].clone(), 1),
        };
        next += after;
        let h = AdamWParams {
            weight_decay: if run.decay { h.weight_decay } else { 0.0 },
            ..h
        };
        let s = run.at..run.at + run.params.len();
        let w = run.weights();
        let m = states.m.rb().slice_mut(s.clone());
        let v = states.v.rb().slice_mut(s.clone());
        match &mut states.master {
            Some(master) => k.adamw_step(
                h,
                master.rb().slice_mut(s),
                grad_of(&run),
                m,
                v,
                Some((params.rb().slice_mut(w), rounding)),
            ),
            None => {
                let w = as_f32(params.rb().slice_mut(w));
                k.adamw_step(h, w, grad_of(&run), m, v, None)
            }
        }
    }
}

/// The first of `runs` with those after it that continue it everywhere (the parameters, the
/// states, the weights and the gradients' memory, each end to end) and decay alike, as one
/// run; and how many runs that is. AdamW is element-wise, so one call over them is the
/// same arithmetic as a call per run: issue #32's update over many tensors per launch (a
/// Llama layer's four attention and three MLP products in two launches, not seven).
pub(crate) fn merged<'g, G: Elem>(
    runs: &[OptRun],
    grad_of: &impl Fn(&OptRun) -> View<'g, G>,
) -> (OptRun, usize) {
    let first = &runs[0];
    let mut one = first.clone();
    let start = grad_of(first).as_ptr() as usize;
    let mut taken = 1;
    for r in &runs[1..] {
        let len = one.params.len();
        let g = grad_of(r);
        let follows = r.params.start == one.params.end
            && r.at == one.at + len
            && r.weights == one.weights + len
            && r.decay == one.decay
            && g.as_ptr() as usize == start + len * size_of::<G>()
            && g.memory() == grad_of(first).memory();
        if !follows {
            break;
        }
        one.params.end = r.params.end;
        one.replicated &= r.replicated;
        taken += 1;
    }
    if taken > 1 {
        // The gradients of the merged run are the runs' own, end to end.
        let g = grad_of(&one);
        assert!(
            g.as_ptr() as usize == start && g.len() == one.params.len(),
            "internal: merged runs' gradients are not their own"
        );
    }
    (one, taken)
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
    use super::{grad_scale, merged, OptRun};
    use ferrotron_engine::kernels::AsView;

    fn run(params: std::ops::Range<usize>, decay: bool) -> OptRun {
        OptRun {
            at: params.start,
            weights: params.start,
            params,
            decay,
            replicated: false,
        }
    }

    #[test]
    fn runs_end_to_end_that_decay_alike_go_in_one_call() {
        let grads = vec![0.0f32; 20];
        let whole = |r: &OptRun| grads.view().slice(r.params.clone());
        let runs = [
            run(0..4, true),
            run(4..9, true),
            run(9..10, false),
            run(10..12, false),
            run(12..20, true),
        ];
        assert_eq!(merged(&runs, &whole), (run(0..9, true), 2));
        assert_eq!(merged(&runs[2..], &whole), (run(9..12, false), 2));
        assert_eq!(merged(&runs[4..], &whole), (run(12..20, true), 1));
        // Gradients elsewhere (a shard's layout, experts apart) stop a merge.
        let apart = |r: &OptRun| match r.params.start {
            4 => grads.view().slice(5..10),
            _ => grads.view().slice(r.params.clone()),
        };
        assert_eq!(merged(&runs, &apart).1, 1);
        // So does a gap in the states.
        let mut gap = runs.clone();
        gap[1].at += 1;
        assert_eq!(merged(&gap, &whole).1, 1);
    }

    #[test]
    fn clipping_scales_only_above_the_max_norm() {
        // torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped at 1.
        assert_eq!(grad_scale(0.5, 2.0, 0.0), 0.5);
        assert_eq!(grad_scale(0.5, 0.5, 1.0), 0.5);
        let want = 0.5 * 1.0 / (4.0 + 1e-6);
        assert!((grad_scale(0.5, 4.0, 1.0) - want).abs() < 1e-15);
    }
}
