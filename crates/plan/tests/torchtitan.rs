//! The `torchtitan` convention: FSDP2's states, torchtitan's op-level selective checkpointing,
//! its fp32 logits, and its eager step time, each against a count made here from the source's
//! rules (see `states.rs`, `sac.rs`, `activations.rs`, `time/elementwise.rs`).

mod common;
use common::input;
use ferrotron_plan::cluster::{gpu, Cluster};
use ferrotron_plan::presets::preset;
use ferrotron_plan::time::estimate;
use ferrotron_plan::*;

fn llama(recompute: Recompute, dp: u64) -> PlanInput {
    input(
        "llama-3-8b",
        Recipe {
            seq: 4096,
            mbs: 1,
            recompute,
            ..Recipe::default()
        },
        Layout {
            dp,
            zero: 3,
            ..Layout::default()
        },
        Convention::Torchtitan,
    )
}

#[test]
fn fsdp2_states_are_16_bytes_per_parameter_over_the_group() {
    // fp32 sharded parameters (the optimizer's own), fp32 sharded gradients, Adam's two fp32
    // moments; no separate bf16 copy or master.
    let x = llama(Recompute::Selective, 8);
    let r = plan(&x).unwrap();
    let n = r.params.total;
    assert_eq!(n, 8_030_261_248);
    let states = r.worst().at_peak.model_states();
    assert_eq!(states, 16 * n.div_ceil(8));
    assert_eq!(r.worst().at_peak.master, 0);
    assert!(r.worst().plan.find("params").unwrap().dtype == DType::F32);
    assert!(r.worst().plan.find("grads.fp32").is_some());
}

#[test]
fn the_name_parses_and_the_error_lists_it() {
    assert_eq!(
        "torchtitan".parse::<Convention>().unwrap(),
        Convention::Torchtitan
    );
    assert_eq!(
        "titan".parse::<Convention>().unwrap_err().to_string(),
        "convention = titan: expected one of ferrotron, megatron, zero-paper, playbook, torchtitan, megatron-lm, deepspeed"
    );
}

#[test]
fn op_level_selective_checkpointing_keeps_wq_wv_w1_w2_and_attention() {
    let m = preset("llama-3-8b").unwrap();
    let (n, h) = (4096u64, m.hidden);
    // Kept per layer (bf16): the block input, wq's, wv's, w1's and w2's outputs, the attention
    // output; fp32: one log-sum-exp per head and token.
    let kv = m.kv_heads * m.head_dim;
    let per_layer = 2 * n * (h + m.q_dim() + kv + m.q_dim() + m.intermediate + h) + 4 * n * m.heads;
    let r = plan(&llama(Recompute::Selective, 8)).unwrap();
    let w = r.worst();
    assert_eq!(w.at_peak.layer_activations, m.layers * per_layer);
    // Without recomputation every tensor of the table is kept, which is more; with full
    // recomputation only the input.
    let none = plan(&llama(Recompute::None, 8)).unwrap();
    assert!(none.worst().at_peak.layer_activations > m.layers * per_layer);
    let full = plan(&llama(Recompute::Full, 8)).unwrap();
    assert_eq!(full.worst().at_peak.layer_activations, m.layers * 2 * n * h);
}

#[test]
fn logits_are_whole_and_fp32() {
    let m = preset("llama-3-8b").unwrap();
    let logits = 4096 * m.vocab;
    let r = plan(&llama(Recompute::Selective, 8)).unwrap();
    let p = &r.worst().plan;
    for name in [
        "act.log_softmax_fp32",
        "act.logits_fp32",
        "grad.act.log_softmax_fp32",
        "grad.act.logits_fp32",
    ] {
        let b = p.find(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!((b.dtype, b.numel), (DType::F32, logits), "{name}");
    }
    // The backward's first instant holds the saved log-softmax and both gradients: the peak
    // has at least 12 bytes per logit of activations and scratch.
    let at = r.worst().at_peak;
    assert!(at.other_activations + at.workspace >= 12 * logits);
}

#[test]
fn selective_recomputes_every_second_matmul() {
    // The recomputed FLOPs of op-level SAC are wk's, wo's and w3's forward (2·N·k·n each).
    let m = preset("llama-3-8b").unwrap();
    let n = 4096.0;
    let (h, kv, q, f) = (
        m.hidden as f64,
        (m.kv_heads * m.head_dim) as f64,
        m.q_dim() as f64,
        m.intermediate as f64,
    );
    let per_layer = 2.0 * n * (h * kv + q * h + h * f);
    let c = Cluster::of(gpu("h100").unwrap(), 8).unwrap();
    let t = |rc| {
        estimate(&llama(rc, 8), &c, FlopsConvention::Ferrotron)
            .unwrap()
            .unwrap()
    };
    let (none, sel, full) = (
        t(Recompute::None),
        t(Recompute::Selective),
        t(Recompute::Full),
    );
    let per_gpu = |r: &time::TimeReport| r.hardware_flops_per_step / 8.0;
    let extra = per_gpu(&sel) - per_gpu(&none);
    assert!(
        (extra / (m.layers as f64 * per_layer) - 1.0).abs() < 1e-9,
        "{extra}"
    );
    assert!(none.step_s < sel.step_s && sel.step_s < full.step_s);
}

#[test]
fn eager_elementwise_ops_cost_more_than_fused_ones() {
    // The same layout and kernels: torchtitan's eager norms, RoPE and SwiGLU move more bytes
    // than the engine's fused kernels, matmuls and attention unchanged.
    let c = Cluster::of(gpu("h100").unwrap(), 8).unwrap();
    let t = |conv| {
        let mut x = llama(Recompute::None, 8);
        x.convention = conv;
        estimate(&x, &c, FlopsConvention::Ferrotron)
            .unwrap()
            .unwrap()
    };
    let (tt, fe) = (t(Convention::Torchtitan), t(Convention::Ferrotron));
    assert_eq!(tt.compute_detail.matmul_s, fe.compute_detail.matmul_s);
    assert_eq!(tt.compute_detail.attention_s, fe.compute_detail.attention_s);
    assert!(tt.compute_detail.memory_bound_s > 2.0 * fe.compute_detail.memory_bound_s);
}
