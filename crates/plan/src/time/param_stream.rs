//! `--offload params` over PCIe: what the streamed weights and the host's gradient sums cost a
//! step beyond the optimizer's own transfers (`tail.rs`: the gradients down and the weights up
//! once per step, as with `--offload optimizer`).
//!
//! ferrotron's trainer (`crates/train/src/offload_params.rs`) moves, per micro-batch:
//! - the parameters up, for the forward and again for the backward (ZeRO-Infinity's
//!   parameter offload, Rajbhandari et al. 2021 §5.1);
//! - from the second micro-batch on, each unit's running gradient sum up before its backward
//!   (so the backward's kernels accumulate as without offload) and the new sum back down. The
//!   first micro-batch starts from zeroed windows, and its download is the one the optimizer's
//!   term already counts.
//!
//! Each micro-batch's transfers overlap its compute (the next layer streams one layer ahead);
//! what exceeds the compute is exposed.

/// Seconds of a step's streamed transfers not hidden behind compute: `mb` micro-batches of
/// `compute_s` each, `params` bytes of the stage's weights (uploaded twice per micro-batch)
/// and `grads` bytes of its gradients (one up and one down per micro-batch after the first),
/// over a link of `bw` bytes/s.
pub(super) fn exposed_s(params: f64, grads: f64, mb: f64, compute_s: f64, bw: f64) -> f64 {
    let first = 2.0 * params / bw;
    let later = (2.0 * params + 2.0 * grads) / bw;
    (first - compute_s).max(0.0) + (mb - 1.0).max(0.0) * (later - compute_s).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_micro_batches_move_the_gradient_sums_both_ways() {
        // 1e6 bf16 weights (2 MB) and fp32 gradients (4 MB), 4 micro-batches of 0.1 ms, over
        // 25 GB/s:
        // - first: 2 × 2 MB up = 4 MB → 0.16 ms, 0.06 ms exposed;
        // - each later one: 4 MB + 2 × 4 MB = 12 MB → 0.48 ms, 0.38 ms exposed;
        // - step: 0.06 + 3 × 0.38 = 1.2 ms.
        let s = exposed_s(2e6, 4e6, 4.0, 1e-4, 25e9);
        assert!((s - 1.2e-3).abs() < 1e-12, "{s}");
        // One micro-batch moves no gradient sum; compute longer than the transfers hides them.
        assert!((exposed_s(2e6, 4e6, 1.0, 1e-4, 25e9) - 0.6e-4).abs() < 1e-12);
        assert_eq!(exposed_s(2e6, 4e6, 4.0, 1e-3, 25e9), 0.0);
    }
}
