//! The global gradient norm, ‖g‖ over the whole model, from the gradients this rank holds:
//! the same number on every rank, as `torch.nn.utils.clip_grad_norm_` computes on one. Each
//! group that splits the gradients adds its ranks' parts ([`Mesh::global_sum_sq`]); what is
//! held twice counts once.

use super::step::OptRun;
use anyhow::Result;
use ferrotron_dist::data_parallel::{each_expert_range, DataParallel};
use ferrotron_dist::mesh::Mesh;
use ferrotron_engine::kernels::{Kernels, View, Weighted};
use ferrotron_engine::model::{GradBuf, Llama};
use ferrotron_engine::Elem;
use std::cell::RefCell;
use std::ops::Range;

/// The model's Σg² from this rank's reduced gradients (`grad_of` each run's; `grads` where
/// the backward wrote them), the same number on every rank. `sharded`: the data-parallel
/// group when each of its ranks holds only its shard of the reduced gradients (ZeRO).
pub(crate) fn grad_sum_sq<'g, S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    model: &Llama,
    runs: &[OptRun],
    mesh: &Mesh,
    grads: &dyn GradBuf<G>,
    grad_of: &dyn Fn(&OptRun) -> View<'g, G>,
    sharded: Option<&RefCell<DataParallel>>,
) -> Result<f64> {
    // Σg² of the scaled gradients: inf or NaN exactly when some gradient is (the check
    // torch's GradScaler makes before unscaling). Under ZeRO each rank holds the sums of its
    // shard only: the ranks add their parts. A group that splits the weights (tensor
    // parallelism) leaves each rank its slices and a copy of every replicated norm: the
    // slices add up over the group, the copies count once (a share of each per rank).
    // Pipelining: each stage holds its part; the last stage's copy of a tied embedding
    // counts once, on the first stage.
    let share = mesh.replicated_share();
    let copied = model.copied();
    let whole = !mesh.splits_weights() && sharded.is_none() && copied.is_none();
    // Every tensor's part in one sum, read back once (a GPU keeps the partial sums).
    let local = match whole {
        true => k.sum_squares(grads.slice(0..model.params.total)),
        false => k.sum_squares_weighted(Weighted::new(&mut runs.iter().flat_map(|r| {
            let share = if r.replicated { share } else { 1.0 };
            outside(grad_of(r), &r.params, copied.as_ref()).map(move |g| (g, share))
        }))),
    };
    // A group that splits the routed experts holds each expert's gradient on one rank (the
    // dense ones on all). (Under ZeRO every block of every gradient is in exactly one
    // rank's shard: the data-parallel sum adds them.)
    let experts = (mesh.splits_experts() && sharded.is_none()).then(|| {
        k.sum_squares_weighted(Weighted::new(
            &mut each_expert_range(&model.params).map(|r| (grads.slice(r), 1.0)),
        ))
    });
    mesh.global_sum_sq(local, experts, sharded)
}

/// The parts of `g` (the gradients of parameters `params`) outside `skip`.
fn outside<'a, G>(
    g: View<'a, G>,
    params: &Range<usize>,
    skip: Option<&Range<usize>>,
) -> impl Iterator<Item = View<'a, G>> {
    let (lo, hi) = match skip {
        Some(c) => (
            c.start.clamp(params.start, params.end) - params.start,
            c.end.clamp(params.start, params.end) - params.start,
        ),
        None => (g.len(), g.len()),
    };
    [g.slice(..lo), g.slice(hi.max(lo)..)].into_iter()
}
