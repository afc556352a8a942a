//! The timeline over two steps and the lifetimes behind it.

mod common;
use common::input;
use ferrotron_plan::timeline::coarse;
use ferrotron_plan::*;

fn llama_8b(recipe: Recipe, layout: Layout) -> PlanResult {
    llama_8b_as(recipe, layout, Convention::Ferrotron)
}

fn llama_8b_as(recipe: Recipe, layout: Layout, c: Convention) -> PlanResult {
    plan(&input("llama-3-8b", recipe, layout, c)).unwrap()
}

fn at(points: &[ferrotron_plan::timeline::TimelinePoint], phase: &str) -> u64 {
    points
        .iter()
        .find(|p| p.phase == phase)
        .unwrap_or_else(|| panic!("no {phase}"))
        .bytes
}

#[test]
fn step_two_peaks_higher_by_exactly_the_optimizer_states() {
    let r = llama_8b(Recipe::default(), Layout::default());
    let w = r.worst();
    let t = coarse(&w.sweep, &ferrotron_plan::hardware::Overhead::NONE);
    let opt = w.plan.find("optim.exp_avg").unwrap().bytes() * 2;
    assert_eq!(
        at(&t, "step 2: backward peak") - at(&t, "step 1: backward peak"),
        opt
    );
    // Persistent buffers: the batch's token ids and targets, and the RoPE cos/sin tables.
    let persistent: u64 = ["data.tokens", "data.targets", "rope.cos", "rope.sin"]
        .iter()
        .map(|n| w.plan.find(n).unwrap().bytes())
        .sum();
    assert_eq!(persistent, 2 * 4 * 4096 + 2 * 4 * 8192 * 64);
    // Init holds bf16 params and fp32 master: 6 bytes per parameter.
    assert_eq!(at(&t, "model init"), 6 * 8_030_261_248 + persistent);
    // Steady state: + bf16 grads + Adam = 16 bytes per parameter.
    assert_eq!(at(&t, "steady state"), 16 * 8_030_261_248 + persistent);
    // The engine fuses the LM head's backward into the forward, so gradients come first.
    let order: Vec<&str> = t.iter().map(|p| p.phase.as_str()).take(3).collect();
    assert_eq!(
        order,
        [
            "model init",
            "step 1: gradient buffers allocated",
            "step 1: forward peak"
        ]
    );
    assert!(at(&t, "step 1: gradient buffers allocated") < at(&t, "step 1: forward peak"));
    assert_eq!(w.peak, at(&t, "step 2: backward peak"));
}

#[test]
fn recompute_policies_order_activation_memory() {
    let acts = |rc| {
        let r = llama_8b(
            Recipe {
                recompute: rc,
                ..Recipe::default()
            },
            Layout::default(),
        );
        r.worst().at_peak.layer_activations
    };
    let (none, sel, full) = (
        acts(Recompute::None),
        acts(Recompute::Selective),
        acts(Recompute::Full),
    );
    assert!(none > sel && sel > full, "{none} {sel} {full}");
    // Full keeps one bf16 [s, h] input per layer.
    assert_eq!(full, 32 * 4096 * 4096 * 2);
}

#[test]
fn zero_stages_shard_what_the_paper_says() {
    // (ferrotron's own ZeRO-3 pads each unit and keeps windows: the next test.)
    let states = |zero| {
        let l = Layout {
            dp: 8,
            zero,
            ..Layout::default()
        };
        let r = llama_8b_as(Recipe::default(), l, Convention::ZeroPaper);
        let b = r.worst().at_peak;
        (b.params, b.grads, b.master + b.optimizer)
    };
    let n = 8_030_261_248u64;
    assert_eq!(states(0), (2 * n, 2 * n, 12 * n));
    assert_eq!(states(1), (2 * n, 2 * n, 12 * n.div_ceil(8)));
    assert_eq!(states(2), (2 * n, 2 * n.div_ceil(8), 12 * n.div_ceil(8)));
    assert_eq!(
        states(3),
        (2 * n.div_ceil(8), 2 * n.div_ceil(8), 12 * n.div_ceil(8))
    );
}

#[test]
fn zero3_gathers_a_layer_and_prefetches_the_next() {
    let l = Layout {
        dp: 8,
        zero: 3,
        ..Layout::default()
    };
    let r = llama_8b_as(Recipe::default(), l.clone(), Convention::ZeroPaper);
    let g = r.worst().plan.find("comm.zero3.gathered_params").unwrap();
    // The largest unit is the head: the 128256 × 4096 LM head plus the final norm (untied),
    // one gathered and one prefetched, in bf16.
    let head = 128_256 * 4096 + 4096;
    assert_eq!(g.bytes(), 2 * 2 * head);
    // ferrotron's trainer (crates/dist/src/zero/zero3.rs): each unit padded to 8 blocks in the
    // shard; bf16 windows of the embedding, the head and two layers; an f32 all-gather buffer
    // and two f32 gradient buckets of the largest unit.
    let r = llama_8b(Recipe::default(), l);
    let w = r.worst();
    let n = 8_030_261_248u64;
    let embed = 128_256 * 4096;
    let layer = (n - embed - head) / 32;
    let shard = embed.div_ceil(8) + 32 * layer.div_ceil(8) + head.div_ceil(8);
    let find = |name: &str| w.plan.find(name).unwrap_or_else(|| panic!("{name}"));
    assert_eq!(find("params").numel, shard);
    assert_eq!(find("optim.exp_avg").numel, shard);
    assert_eq!(
        find("zero3.param_windows").bytes(),
        2 * (embed + head + 2 * layer)
    );
    let bucket = head.next_multiple_of(8);
    assert_eq!(find("comm.zero3.gather").bytes(), 4 * bucket);
    assert_eq!(find("comm.dp.grad_buckets").bytes(), 2 * 4 * bucket);
    assert!(w.plan.find("comm.zero3.gathered_params").is_none());
}

#[test]
fn offloading_moves_states_to_the_host() {
    let r = llama_8b(
        Recipe::default(),
        Layout {
            offload: Offload::Optimizer,
            ..Layout::default()
        },
    );
    let w = r.worst();
    assert_eq!(w.at_peak.master + w.at_peak.optimizer, 0);
    assert_eq!(w.plan.host_bytes, 12 * 8_030_261_248);
}

#[test]
fn fp32_gradients_add_two_bytes_per_param() {
    // ferrotron accumulates into fp32 gradients in place of bf16 ones: 18 vs 16 B/param.
    let ms = |p| {
        let r = llama_8b(
            Recipe {
                precision: p,
                ..Recipe::default()
            },
            Layout::default(),
        );
        r.worst().at_peak.model_states()
    };
    assert_eq!(
        ms(Precision::Bf16Fp32grads) - ms(Precision::Bf16),
        2 * 8_030_261_248
    );
    assert_eq!(ms(Precision::Bf16), 16 * 8_030_261_248);
    assert_eq!(ms(Precision::Fp32), 16 * 8_030_261_248);
}

#[test]
fn tensor_and_sequence_parallelism_shard_activations() {
    let layer = |tp, sp| {
        let r = llama_8b(
            Recipe::default(),
            Layout {
                tp,
                sp,
                ..Layout::default()
            },
        );
        r.worst().at_peak.layer_activations
    };
    let one = layer(1, false);
    assert!(
        layer(8, false) > one / 8,
        "without SP the norm regions stay replicated"
    );
    assert_eq!(
        layer(8, true),
        one / 8,
        "with SP every saved tensor is split"
    );
}

/// The ferrotron engine's recompute program: each layer's forward holds the dropped tensors in
/// the `recompute.*` workspace until its output exists (the last layer's output is
/// `act.final_norm.input`), and each layer's backward rebuilds them.
#[test]
fn ferrotron_recompute_workspace_lives_in_forward_and_backward() {
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        let recipe = Recipe {
            seq: 256,
            mbs: 8,
            precision: Precision::Fp32,
            recompute: rc,
            ..Recipe::default()
        };
        let r = plan(&input(
            "ferrotron-12m",
            recipe,
            Layout::default(),
            Convention::Ferrotron,
        ))
        .unwrap();
        let w = r.worst();
        let live = |label: &str| {
            w.sweep
                .marks
                .iter()
                .find(|m| m.label == label)
                .unwrap_or_else(|| panic!("no mark {label}"))
                .live
        };
        let bytes = |name: &str| w.plan.find(name).map_or(0, |b| b.bytes());
        let n_c = 8 * 256 * 384 * 4;
        assert_eq!(bytes("act.final_norm.input"), n_c);
        let workspace: u64 = ["ln1_out", "ln2_out", "swiglu", "q", "gate", "ln1_rstd"]
            .iter()
            .map(|f| bytes(&format!("recompute.{f}")))
            .sum();
        assert_eq!(workspace > 0, rc != Recompute::None);
        // Layer 5's forward adds its kept tensors and its output, like every other layer,
        // plus the workspace, which is gone again by the next mark.
        let step4 = live("step 1 mb 0 forward layer 4") - live("step 1 mb 0 forward layer 3");
        let step5 = live("step 1 mb 0 forward layer 5") - live("step 1 mb 0 forward layer 4");
        assert_eq!(step4, step5, "{rc}");
    }
}
