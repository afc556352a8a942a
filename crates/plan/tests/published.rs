//! Published figures the planner must reproduce exactly (issue: Planner I, "Must reproduce").

use ferrotron_plan::hardware::Overhead;
use ferrotron_plan::presets::preset;
use ferrotron_plan::*;

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;

fn input(model: ModelSource, recipe: Recipe, layout: Layout, convention: Convention) -> PlanInput {
    PlanInput {
        model,
        recipe,
        layout,
        convention,
        runtime: Runtime::of(convention),
        overhead: Overhead::NONE,
        bucket_bytes: 25 << 20,
    }
}

fn params_plan(n: u64, precision: Precision, layout: Layout, conv: Convention) -> PlanResult {
    let recipe = Recipe {
        precision,
        ..Recipe::default()
    };
    plan(&input(ModelSource::Params(n), recipe, layout, conv)).unwrap()
}

#[test]
fn parameter_counts_match_hf() {
    for (name, total) in [
        ("gpt2", 124_439_808u64),
        ("gpt2-xl", 1_557_611_200),
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("mistral-7b", 7_241_732_096),
        ("mixtral-8x7b", 46_702_792_704),
        ("smollm-135m", 134_515_008),
        ("llama-3.2-1b", 1_235_814_400),
        ("qwen2.5-7b", 7_615_616_512),
    ] {
        let m = preset(name).unwrap();
        let c = inventory::count(&m, &inventory::inventory(&m));
        assert_eq!(c.total, total, "{name}");
        if m.moe.is_none() {
            assert_eq!(c.active, total, "{name}: dense models are fully active");
        }
    }
}

#[test]
fn mixtral_active_parameters_are_two_of_eight_experts() {
    let m = preset("mixtral-8x7b").unwrap();
    let c = inventory::count(&m, &inventory::inventory(&m));
    // Per layer each expert has 3·4096·14336 weights; 6 of 8 are inactive per token.
    let inactive = 32 * 6 * 3 * 4096 * 14336u64;
    assert_eq!(c.active, c.total - inactive);
    assert_eq!(c.active, 12_879_925_248);
}

#[test]
fn playbook_bytes_per_param() {
    for (n, gb16, gb20) in [
        (1e9, 16.0, 20.0),
        (7e9, 112.0, 140.0),
        (70e9, 1120.0, 1400.0),
        (405e9, 6480.0, 8100.0),
    ] {
        let n = n as u64;
        for p in [Precision::Fp32, Precision::Bf16] {
            let r = params_plan(n, p, Layout::default(), Convention::Playbook);
            assert_eq!(
                r.worst().at_peak.model_states() as f64 / GB,
                gb16,
                "{n} {p}"
            );
        }
        let r = params_plan(
            n,
            Precision::Bf16Fp32grads,
            Layout::default(),
            Convention::Playbook,
        );
        assert_eq!(r.worst().at_peak.model_states() as f64 / GB, gb20, "{n}");
    }
}

#[test]
fn zero_paper_table() {
    let check = |dp: u64, zero: u8, want_gb: f64| {
        let layout = Layout {
            dp,
            zero,
            ..Layout::default()
        };
        let r = params_plan(
            7_500_000_000,
            Precision::Bf16,
            layout,
            Convention::ZeroPaper,
        );
        let got = r.worst().at_peak.model_states() as f64 / GB;
        assert!(
            (got - want_gb).abs() < 0.005,
            "Nd {dp} ZeRO-{zero}: {got} GB, paper {want_gb}"
        );
    };
    check(64, 0, 120.0);
    check(64, 1, 31.41);
    check(64, 2, 16.64);
    check(64, 3, 1.875);
    check(4, 1, 52.5);
    check(4, 2, 41.25);
    check(4, 3, 30.0);
}

fn korthikanti_22b(recompute: Recompute, sp: bool) -> PlanResult {
    let recipe = Recipe {
        seq: 2048,
        mbs: 4,
        recompute,
        ..Recipe::default()
    };
    let layout = Layout {
        tp: 8,
        sp,
        ..Layout::default()
    };
    plan(&input(
        ModelSource::Spec(preset("megatron-22b").unwrap()),
        recipe,
        layout,
        Convention::Megatron,
    ))
    .unwrap()
}

#[test]
fn korthikanti_figure1_22b_activations() {
    let none = korthikanti_22b(Recompute::None, false);
    assert_eq!(none.worst().at_peak.layer_activations as f64 / GIB, 59.25);
    let sel = korthikanti_22b(Recompute::Selective, true);
    assert_eq!(sel.worst().at_peak.layer_activations as f64 / GIB, 9.5625);
}

#[test]
fn korthikanti_22b_model_states() {
    let (h, l) = (6144u64, 48u64);
    let layout = Layout {
        tp: 8,
        ..Layout::default()
    };
    let r = params_plan(
        12 * h * h * l,
        Precision::Bf16,
        layout,
        Convention::Megatron,
    );
    assert_eq!(r.worst().at_peak.model_states() as f64 / GIB, 45.5625);
}

#[test]
fn megatron_distributed_optimizer_is_6_plus_12_over_d() {
    let layout = Layout {
        dp: 8,
        zero: 1,
        ..Layout::default()
    };
    let r = params_plan(8_000_000_000, Precision::Bf16, layout, Convention::Megatron);
    assert_eq!(
        r.worst().at_peak.model_states(),
        8_000_000_000 * 6 + 8_000_000_000 * 12 / 8
    );
}

fn playbook_acts(seq: u64, recompute: Recompute) -> f64 {
    let text = r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":14336,
        "num_attention_heads":32,"num_hidden_layers":32,"vocab_size":128256,
        "max_position_embeddings":8192}"#;
    let m = ModelSpec::from_json_str(text, "playbook-8b").unwrap();
    let recipe = Recipe {
        seq,
        mbs: 1,
        recompute,
        ..Recipe::default()
    };
    let r = plan(&input(
        ModelSource::Spec(m),
        recipe,
        Layout::default(),
        Convention::Playbook,
    ))
    .unwrap();
    r.worst().at_peak.activations() as f64 / GIB
}

#[test]
fn playbook_activation_charts() {
    assert_eq!(playbook_acts(1024, Recompute::None), 9.25390625);
    assert_eq!(playbook_acts(1024, Recompute::Selective), 4.25390625);
    assert_eq!(playbook_acts(1024, Recompute::Full), 0.25390625);
    assert_eq!(playbook_acts(4096, Recompute::None), 97.015625);
}
