//! The README's DeepSeek-V3 showcase against the published run (DeepSeek-AI 2024, "DeepSeek-V3
//! Technical Report", arXiv 2412.19437): 2,048 H800 GPUs, PP 16, EP 64 spanning 8 nodes,
//! ZeRO-1 data parallelism, fp8 training, DualPipe overlapping the all-to-alls, node-limited
//! routing (at most 4 nodes per token); pre-training took 2,664K H800 GPU hours for 14.8T tokens
//! (Table 1: 2,788K with context extension and post-training), i.e. 14.8e12 / (2.664e6 · 3600)
//! = 1,543 tokens/s per GPU. The batch is 15,360 sequences of 4,096 tokens (§4.2; after its
//! ramp-up): 120 per data-parallel rank (dp · ep = 128). The H800 has the H100's compute
//! (989 TFLOP/s bf16 dense); the planner's h100 stands in for it (its NVLink is faster, 450 vs
//! 200 GB/s per direction, which the network-bound all-to-alls do not use here).

use ferrotron_plan::api::plan_json;
use serde_json::{json, Value};

fn showcase() -> Value {
    json!({"model": "deepseek-v3", "seq": 4096, "ep": 64, "pp": 16, "pp_layers": "3,4*14,2",
           "dp": 2, "zero": 1, "grad_acc": 120, "capacity_factor": 1.0, "recompute": "full",
           "precision": "fp8", "ep_overlap": true, "gpu": "h100"})
}

const PUBLISHED_TOKENS_PER_GPU: f64 = 14.8e12 / (2.664e6 * 3600.0);

#[test]
fn the_showcase_fits_and_runs_near_the_published_throughput() {
    let v = plan_json(showcase()).unwrap();
    assert_eq!(v["fits"], json!(true));
    let t = &v["time"];
    let per_gpu = t["tokens_per_s"].as_f64().unwrap() / 2048.0;
    let err = per_gpu / PUBLISHED_TOKENS_PER_GPU - 1.0;
    eprintln!("DeepSeek-V3: predicted {per_gpu:.0} tokens/s per GPU, published {PUBLISHED_TOKENS_PER_GPU:.0} ({:+.1}%)", err * 100.0);
    assert!(err.abs() < 0.15, "{per_gpu} vs {PUBLISHED_TOKENS_PER_GPU}");
    // "About a third of the bf16 peak": the model FLOPs per step against 989 TFLOP/s.
    let mfu_bf16 = t["model_flops_per_step"].as_f64().unwrap()
        / (t["step_s"].as_f64().unwrap() * 2048.0 * 989e12);
    assert!((0.28..0.42).contains(&mfu_bf16), "{mfu_bf16}");
}

#[test]
fn what_the_published_system_overlaps_and_sends_is_what_makes_it_fast() {
    let step = |f: &dyn Fn(&mut Value)| {
        let mut b = showcase();
        f(&mut b);
        let v = plan_json(b).unwrap();
        (
            v["time"]["step_s"].as_f64().unwrap(),
            v["comm"]["ep"]["bytes"].as_f64().unwrap(),
        )
    };
    let (base, ep_bytes) = step(&|_| {});
    // Exposed all-to-alls (Megatron-LM's default) are slower.
    let (exposed, same) = step(&|b| b["ep_overlap"] = json!(false));
    assert!(exposed > base * 1.1, "{exposed} vs {base}");
    assert_eq!(same, ep_bytes);
    // bf16 dispatch moves more than fp8 dispatch: (1 + 1.03/2)/2 of the bf16 bytes in fp8.
    let (_, bf16_bytes) = step(&|b| b["precision"] = json!("bf16"));
    assert!((ep_bytes / bf16_bytes - (1.0 + 1.03125 / 2.0) / 2.0).abs() < 1e-9);
    // Without one micro-batch per step per rank in flight after another, the bubble is the
    // step (the README's former example: grad-acc 1).
    let (one, _) = step(&|b| b["grad_acc"] = json!(1));
    assert!(one * 120.0 > base * 4.0);
}

#[test]
fn ep_overlap_needs_expert_parallelism() {
    let e = plan_json(json!({"model": "llama-3-8b", "ep_overlap": true}))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "ep_overlap = true: overlaps expert-parallel all-to-alls: add --ep 2 or more"
    );
}
