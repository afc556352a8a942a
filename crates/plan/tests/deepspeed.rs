//! The `deepspeed` convention against DeepSpeed's published memory estimates for T5-3B
//! (microsoft/DeepSpeed, `docs/code-docs/source/memory.rst` at commit
//! 077e6740178eba4ccff1b3ea9a7981578d3d42e4: `estimate_zero2_model_states_mem_needs_all_cold(
//! total_params=2851e6, num_gpus_per_node=8, num_nodes=1)` and the ZeRO-3 one with
//! `largest_layer_params=32e6`; "per GPU" column, printed as `bytes / 2**30` with two
//! decimals).

use ferrotron_plan::api::Settings;
use ferrotron_plan::*;

fn per_gpu(zero: u64, offload: &str) -> (PlanResult, String) {
    let s = Settings {
        params: Some("2851e6".into()),
        largest_layer: Some("32e6".into()),
        dp: Some(8),
        zero: Some(zero),
        offload: Some(offload.into()),
        convention: Some("deepspeed".into()),
        overhead_gib: Some(0.0),
        fragmentation: Some(0.0),
        ..Settings::default()
    };
    let r = plan(&s.resolve(None).unwrap().input).unwrap();
    let w = r.worst();
    // Model states and the gathered layer: the estimator leaves out the gradient bucket.
    let gathered = w
        .plan
        .buffers
        .iter()
        .filter(|b| b.name.starts_with("comm.zero3."))
        .map(|b| b.bytes())
        .sum::<u64>();
    let gib = (w.at_peak.model_states() + gathered) as f64 / (1u64 << 30) as f64;
    (r, format!("{gib:.2}"))
}

#[test]
fn zero2_is_4_plus_16_over_n_bytes_per_parameter() {
    assert_eq!(per_gpu(2, "none").1, "15.93");
    // cpu_offload=1: the 16-bit parameters only.
    assert_eq!(per_gpu(2, "optimizer").1, "5.31");
}

#[test]
fn zero3_is_18_over_n_plus_4_largest_layers() {
    assert_eq!(per_gpu(3, "none").1, "6.09");
    // cpu_offload=1, cpu_offload_params=0 and =1.
    assert_eq!(per_gpu(3, "optimizer").1, "0.78");
    assert_eq!(per_gpu(3, "params").1, "0.12");
}

#[test]
fn zero2_allocates_the_contiguous_gradient_bucket() {
    // `reduce_bucket_size` = 5e8 elements of the 16-bit dtype, allocated in `backward`.
    let (r, _) = per_gpu(2, "none");
    let b = r
        .worst()
        .plan
        .find("comm.deepspeed.ipg_bucket")
        .expect("the bucket");
    assert_eq!((b.numel, b.dtype), (500_000_000, DType::Bf16));
    assert!(r.worst().plan.find("comm.zero2.grad_buckets").is_none());
}
