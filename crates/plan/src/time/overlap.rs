//! What a collective costs when it runs alongside compute. Overlapped communication is not
//! free: NCCL's kernels run on the SMs (one thread block per channel; an all-gather on an H100
//! holds 24 of its 132 SMs in the Nsight trace of NVIDIA developer forum thread 337991,
//! "Compute-communication overlap causes severe GEMM performance degradation") and share HBM
//! bandwidth with the kernels they overlap, which therefore run slower for as long as the
//! collective runs.

/// Slowdown of computation while a collective runs concurrently with it: 18.9%, the mean
/// measured by Lee et al. 2025, "Characterizing Compute-Communication Overlap in
/// GPU-Accelerated Distributed Deep Learning: Performance and Power Implications" (arXiv
/// 2507.03114, abstract: "overlapping computation and communication can result in an average
/// computational slowdown of 18.9%, with a maximum of 40.0% slowdown", GPT and Llama training
/// on A100, H100, MI250 and MI210). The SM share above (24/132 = 18%) agrees. A kernel
/// measurement, not fitted on any run this planner is validated on.
pub const OVERLAP_SLOWDOWN: f64 = 0.189;

/// Seconds that `comm` seconds of collectives add to the critical path when they overlap
/// `compute` seconds of kernels. While the collective runs, compute advances at 1/s of its rate
/// (s = 1 + OVERLAP_SLOWDOWN); if the collective outlasts the slowed compute, the step waits
/// for it. So the pair takes max(comm, compute + comm · (1 − 1/s)), i.e. adds
/// max(comm − compute, comm · (1 − 1/s)) to the compute alone.
pub(super) fn exposed(comm: f64, compute: f64) -> f64 {
    if comm <= 0.0 {
        return 0.0;
    }
    let s = 1.0 + OVERLAP_SLOWDOWN;
    (comm - compute).max(comm * (1.0 - 1.0 / s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_costs_a_share_of_the_collective_until_it_outlasts_the_slowed_compute() {
        let s = 1.0 + OVERLAP_SLOWDOWN;
        let share = 1.0 - 1.0 / s;
        assert_eq!(exposed(0.0, 1.0), 0.0);
        // Hidden under compute: the compute slowed while the collective runs.
        assert!((exposed(0.5, 1.0) - 0.5 * share).abs() < 1e-15);
        // Longer than the slowed compute: the step waits for the collective.
        assert!((exposed(3.0, 1.0) - 2.0).abs() < 1e-15);
        // Continuous where the two meet (comm = s · compute).
        assert!((exposed(s, 1.0) - s * share).abs() < 1e-12);
        assert!((exposed(s, 1.0) - (s - 1.0)).abs() < 1e-12);
    }
}
