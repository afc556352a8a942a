//! Planned vs measured peak memory of real training steps, for each recompute policy (the only
//! test in this binary, so no other test's allocations are counted).
//!
//! Measured = the process's peak live heap bytes during a step minus the baseline taken before
//! the model existed (tokenizer, data index, thread pool: fixed costs of the process that the
//! plan does not model). What remains outside the plan is the gemm crate's kernel workspace
//! (per-thread L2 slabs and per-call packing buffers, bounded by `MAX_PACKED_RHS`).

mod common;
use ferrotron_train::alloc::{installed, Tracking};
use ferrotron_train::run::run;

#[global_allocator]
static A: Tracking = Tracking;

/// Every precision × recompute policy, one after the other (one test: the allocator counts
/// all threads).
#[test]
fn default_model_planned_vs_measured_within_one_percent() {
    assert!(
        installed(),
        "the tracking allocator must be the global allocator here"
    );
    for precision in ["fp32", "bf16", "fp16", "fp8"] {
        let mut peaks = Vec::new();
        for rc in ["none", "selective", "full"] {
            peaks.push(policy(precision, rc));
        }
        // Each policy keeps less than the one before it: planned and measured.
        for w in peaks.windows(2) {
            assert!(w[0].0 > w[1].0 && w[0].1 > w[1].1, "{precision}: {peaks:?}");
        }
    }
}

/// Runs 2 steps under `precision` and `rc`; returns the (planned, measured) peak of step 2.
fn policy(precision: &str, rc: &str) -> (u64, u64) {
    let out = common::tmp(&format!("memory-{precision}-{rc}"));
    let mut args = common::default_model_args(&out, 2, rc);
    args.precision = Some(precision.into());
    let rc = format!("{precision} {rc}");
    let s = run(args).unwrap();
    for m in &s.steps {
        let ratio = m.mem_peak_measured as f64 / m.mem_peak_planned as f64;
        eprintln!(
            "{rc} step {}: planned {} measured {} ({:+.3}%)",
            m.step,
            m.mem_peak_planned,
            m.mem_peak_measured,
            (ratio - 1.0) * 100.0
        );
        assert!(
            (ratio - 1.0).abs() < 0.01,
            "{rc} step {}: measured {} planned {} ({ratio})",
            m.step,
            m.mem_peak_measured,
            m.mem_peak_planned
        );
    }
    // Step 2 holds the Adam states that step 1 created, in the plan and in the process.
    let (a, b) = (&s.steps[0], &s.steps[1]);
    assert!(b.mem_peak_planned > a.mem_peak_planned);
    // The default model (ferrotron-12m) has 12,587,904 parameters: two fp32 moments each.
    // Where step 1's peak is inside its forward/backward, step 2's is exactly that much higher;
    // where it is step 1's optimizer step (small activations: bf16 with full recompute), less.
    let adam = 2 * 4 * 12_587_904u64;
    let planned_growth = b.mem_peak_planned - a.mem_peak_planned;
    assert!(
        planned_growth <= adam,
        "{rc}: {planned_growth} > Adam {adam}"
    );
    let grew = b.mem_peak_measured as f64 - a.mem_peak_measured as f64;
    assert!(
        (grew - planned_growth as f64).abs() < 0.01 * adam as f64,
        "{rc}: measured growth {grew} vs planned {planned_growth}"
    );
    (b.mem_peak_planned, b.mem_peak_measured)
}
