//! The `megatron-lm` convention against Megatron-LM's own memory report, computed here from
//! `megatron/training/theoretical_memory_usage.py` (NVIDIA/Megatron-LM at commit
//! 00caa53af30912914981c86f39db123961678bbd) and `_vocab_size_with_padding`.

mod common;
use common::input;
use ferrotron_plan::megatron_lm::padded_vocab;
use ferrotron_plan::presets::preset;
use ferrotron_plan::*;

fn llama(tp: u64, sp: bool, dp: u64, zero: u8, conv: Convention) -> PlanResult {
    let x = input(
        "llama-3-8b",
        Recipe {
            seq: 4096,
            mbs: 1,
            recompute: Recompute::Selective,
            ..Recipe::default()
        },
        Layout {
            tp,
            sp,
            dp,
            zero,
            ..Layout::default()
        },
        conv,
    );
    plan(&x).unwrap()
}

#[test]
fn the_vocabulary_is_padded_to_128_times_tp() {
    // "multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size".
    assert_eq!(padded_vocab(128_256, 1), 128_256);
    assert_eq!(padded_vocab(128_256, 8), 129_024);
    assert_eq!(padded_vocab(50_257, 1), 50_304);
    // With tp 8 Llama 3 8B's untied embedding and output layer each gain 768 rows, split over
    // the 8 ranks: 18 bytes each (no distributed optimizer) on top of `megatron`'s states.
    let padded = llama(8, true, 1, 0, Convention::MegatronLm);
    let plain = llama(8, true, 1, 0, Convention::Megatron);
    let extra = padded.worst().at_peak.model_states() - plain.worst().at_peak.model_states();
    assert_eq!(extra, 18 * 2 * 768 * 4096 / 8);
}

#[test]
fn without_sp_the_report_is_sbh_10_plus_24_over_t_times_1_05() {
    // tp 1, no SP: compute_activation_memory_without_sp; distributed optimizer over dp 8:
    // weight_and_optimizer_memory = P · (6 + 12/8).
    let m = preset("llama-3-8b").unwrap();
    let r = llama(1, false, 8, 1, Convention::MegatronLm);
    let p = 8_030_261_248f64;
    let states = r.worst().at_peak.model_states() as f64;
    assert!(
        (states / (p * (6.0 + 12.0 / 8.0)) - 1.0).abs() < 1e-9,
        "{states}"
    );
    let (s, b, h, l, v) = (4096.0, 1.0, 4096.0, m.layers as f64, 128_256.0);
    let sbh = s * b * h;
    let report =
        1.05 * (l * sbh * (10.0 + 24.0) + 8.0 * s * b + sbh + (s * b * v + s * b * h) * 2.0);
    let acts = r.worst().at_peak.activations() as f64;
    assert!((acts / report - 1.0).abs() < 1e-6, "{acts} vs {report}");
}

#[test]
fn with_sp_and_selective_the_report_is_sbh_18_plus_4f_over_h_over_t() {
    let m = preset("llama-3-8b").unwrap();
    let r = llama(8, true, 1, 0, Convention::MegatronLm);
    let (s, b, h, l, f, t) = (
        4096.0,
        1.0,
        4096.0,
        m.layers as f64,
        m.intermediate as f64,
        8.0,
    );
    let sbh = s * b * h;
    let v = 129_024.0;
    let report =
        (l * sbh * (18.0 + 4.0 * f / h) + 8.0 * s * b + sbh + s * b * h * 4.0 * (1.0 + v / h)) / t;
    let acts = r.worst().at_peak.activations() as f64;
    assert!((acts / report - 1.0).abs() < 1e-6, "{acts} vs {report}");
}
