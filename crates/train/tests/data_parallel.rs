//! Data parallelism on the threads backend (ranks as threads of one process): `dp` ranks, each
//! with its slice of every global batch, with and without ZeRO-1, follow the one-rank
//! trajectory of the same global batch, and every rank's measured peak is within 1% of its own
//! plan.

mod common;
use common::{tiny_args, tmp};
use ferrotron_plan::comm::{bytes_per_rank, Collective};
use ferrotron_train::alloc::Tracking;
use ferrotron_train::metrics::StepMetrics;
use ferrotron_train::run::run;

// Each rank's memory is measured by the tracking allocator (per rank: ranks are threads).
#[global_allocator]
static A: Tracking = Tracking;

/// The run's metrics and its parameter count (from the plan rank 0 writes).
fn train(dp: u64, zero: u64, mbs: u64, acc: u64, steps: u64) -> (Vec<StepMetrics>, u64) {
    let out = tmp(&format!("dp{dp}-z{zero}-{mbs}x{acc}"));
    let mut a = tiny_args(&out, steps);
    a.mbs = Some(mbs);
    a.grad_acc = Some(acc);
    a.layout.dp = Some(dp);
    a.layout.zero = Some(zero);
    // Small buckets: several all-reduces per step, some tensors split across two.
    a.bucket_mb = Some(1);
    let steps = run(a).unwrap().steps;
    let plan = std::fs::read_to_string(out.join("plan.json")).unwrap();
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    (steps, plan["params"].as_u64().unwrap())
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / a).abs()
}

#[test]
fn data_parallel_ranks_follow_the_one_rank_trajectory() {
    // A global batch of 8 sequences: one rank as 4×2, two ranks as 4×1 and 2×2, four ranks as
    // 2×1 and 1×2. The loader deals rank r the r-th block of each micro-batch's windows, so
    // every layout sees the same 8 sequences per step.
    let (one, _) = train(1, 0, 4, 2, 6);
    let layouts = [(2, 4, 1), (2, 2, 2), (4, 2, 1), (4, 1, 2)];
    for ((dp, mbs, acc), zero) in layouts.into_iter().flat_map(|l| [(l, 0), (l, 1)]) {
        let (s, params) = train(dp, zero, mbs, acc, 6);
        assert_eq!(s.len(), 6);
        for (x, y) in one.iter().zip(&s) {
            let what = format!("dp {dp} zero {zero} {mbs}x{acc} step {}", x.step);
            assert!(
                rel(x.loss, y.loss) < 1e-5,
                "{what}: loss {} vs {}",
                x.loss,
                y.loss
            );
            assert!(
                rel(x.grad_norm, y.grad_norm) < 1e-5,
                "{what}: grad norm {} vs {}",
                x.grad_norm,
                y.grad_norm
            );
            assert_eq!(y.rank_mem.len(), dp as usize, "{what}: one entry per rank");
            for r in &y.rank_mem {
                let dev = rel(r.mem_peak_planned as f64, r.mem_peak_measured as f64);
                assert!(dev < 0.01, "{what} rank {}: {r:?}", r.rank);
            }
            // Every gradient is all-reduced once per step, as f32 (ring bytes per rank); under
            // ZeRO-1 reduce-scattered and the parameters all-gathered, padded to dp blocks.
            let bytes = match zero {
                0 => bytes_per_rank(Collective::AllReduce, 4.0 * params as f64, dp),
                _ => {
                    let padded = 4.0 * params.next_multiple_of(dp) as f64;
                    bytes_per_rank(Collective::ReduceScatter, padded, dp)
                        + bytes_per_rank(Collective::AllGather, padded, dp)
                }
            };
            assert_eq!(y.comm_bytes, Some(bytes.round() as u64), "{what}");
        }
    }
}
