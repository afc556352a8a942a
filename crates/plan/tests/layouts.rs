//! Layouts the planner expresses beyond even splits: tensor parallelism beyond the key/value
//! heads, uneven pipeline stages, ZeRO-2/3 under pipelining. Each plan is checked, not just run.

mod common;
use common::input;
use ferrotron_plan::inventory::{inventory, Placement};
use ferrotron_plan::presets::preset;
use ferrotron_plan::*;

fn recipe() -> Recipe {
    Recipe {
        seq: 4096,
        mbs: 1,
        grad_acc: 8,
        recompute: Recompute::None,
        ..Recipe::default()
    }
}

fn run(model: &str, layout: Layout) -> PlanResult {
    plan(&input(model, recipe(), layout, Convention::Ferrotron)).unwrap()
}

fn numel(r: &RankPlan, name: &str) -> u64 {
    r.plan
        .find(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .numel
}

/// Elements of the dense weights one rank of stage `stage` holds, from the inventory.
fn stage_elems(model: &str, tp: u64, on_stage: impl Fn(Placement) -> bool) -> u64 {
    let m = preset(model).unwrap();
    inventory(&m)
        .iter()
        .filter(|t| on_stage(t.placement))
        .map(|t| t.numel_tp(tp))
        .sum()
}

#[test]
fn tp_beyond_kv_heads_replicates_one_head_per_rank() {
    // Llama-3-8B: 32 query heads, 8 key/value heads of 128. At tp 16 each rank holds 2 query
    // heads and one whole key/value head (each replicated on 2 ranks).
    let (c, d, f, v) = (4096u64, 128u64, 14336u64, 128_256u64);
    let per_layer = 2 * (32 / 16 * d) * c // q, o
        + 2 * (d * c) // k, v: one head, not 8/16 of one
        + 3 * (f / 16) * c
        + 2 * c;
    let want = 32 * per_layer + 2 * (v / 16) * c + c;
    let r = run(
        "llama-3-8b",
        Layout {
            tp: 16,
            ..Layout::default()
        },
    );
    let rank = r.worst();
    assert_eq!(numel(rank, "params"), want);
    assert_eq!(stage_elems("llama-3-8b", 16, |_| true), want);
    // The replicated K and V weights: 16 ranks hold 2× the model's K/V parameters.
    let m = preset("llama-3-8b").unwrap();
    let k = inventory(&m)
        .into_iter()
        .find(|t| t.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(k.numel_tp(16) * 16, 2 * k.numel());
    assert_eq!(k.numel_tp(8) * 8, k.numel());
    // Activations per rank: one key and one value head, two query heads.
    let n = 4096u64;
    assert_eq!(numel(rank, "act.layers.0.k"), n * d);
    assert_eq!(numel(rank, "act.layers.0.v"), n * d);
    assert_eq!(numel(rank, "act.layers.0.q"), n * 2 * d);
    assert_eq!(numel(rank, "grad.act.k"), n * d);
    // Context parallelism passes the rank's one K and one V head around the ring, with their
    // gradients in the backward: ferrotron's ring blocks and its message buffer (f32).
    let cp = run(
        "llama-3-8b",
        Layout {
            tp: 16,
            cp: 2,
            ..Layout::default()
        },
    );
    assert_eq!(numel(cp.worst(), "comm.cp.block"), (n / 2) * 2 * (d + d));
    assert_eq!(numel(cp.worst(), "comm.cp.message"), (n / 2) * 2 * (d + d));
}

#[test]
fn uneven_pipeline_stages_hold_the_layers_given() {
    // Llama 3 405B (arXiv 2407.21783 §3.3.2): 126 layers on 16 stages, the first and the last
    // with one layer fewer, since they also hold the embedding and the LM head.
    let layout = Layout {
        pp: 16,
        tp: 8,
        pp_layers: [vec![7], vec![8; 14], vec![7]].concat(),
        ..Layout::default()
    };
    let r = run("llama-3.1-405b", layout.clone());
    assert_eq!(r.ranks.len(), 16);
    let layers_of = |rank: &RankPlan| -> Vec<u64> {
        let mut v: Vec<u64> = rank
            .plan
            .buffers
            .iter()
            .filter_map(|b| b.name.strip_prefix("act.layers."))
            .filter_map(|s| s.strip_suffix(".input"))
            .map(|s| s.parse().unwrap())
            .collect();
        v.sort();
        v
    };
    // Each stage but the last also holds the output it sends on: the next stage's first input.
    assert_eq!(layers_of(&r.ranks[0]), (0..8).collect::<Vec<_>>());
    assert_eq!(layers_of(&r.ranks[1]), (7..16).collect::<Vec<_>>());
    assert_eq!(layers_of(&r.ranks[15]), (119..126).collect::<Vec<_>>());
    // Parameters: stage 0 is the embedding and 7 layers, stage 1 is 8 layers.
    let on = |stage: u64| {
        let l = layout.clone();
        move |p: Placement| match p {
            Placement::Embedding => stage == 0,
            Placement::Head => stage == 15,
            Placement::Layer(i) => {
                (0..16).find(|&g| l.chunk_layers(126, g).contains(&i)) == Some(stage)
            }
        }
    };
    for s in [0u64, 1, 15] {
        assert_eq!(
            numel(&r.ranks[s as usize], "params"),
            stage_elems("llama-3.1-405b", 8, on(s)),
            "stage {s}"
        );
    }
    let layer = stage_elems("llama-3.1-405b", 8, |p| p == Placement::Layer(0));
    assert_eq!(
        numel(&r.ranks[1], "params"),
        8 * layer,
        "a middle stage holds 8 layers"
    );
    // The extremes shortcut of the search cannot assume the first or last stage is the most
    // loaded with an uneven split: it plans every stage and agrees with the full plan.
    let x = input("llama-3.1-405b", recipe(), layout, Convention::Ferrotron);
    assert_eq!(plan_extremes(&x).unwrap().worst().peak, r.worst().peak);
}

#[test]
fn a_heavier_middle_stage_is_the_most_loaded() {
    // 8, 16, 8 layers: under 1F1B stage 1 holds 2 micro-batches of 16 layers (32 layer
    // activations) against stage 0's 3 of 8 (24).
    let layout = Layout {
        pp: 3,
        pp_layers: vec![8, 16, 8],
        ..Layout::default()
    };
    let r = run("llama-3-8b", layout.clone());
    let acts = |s: usize| r.ranks[s].at_peak.layer_activations;
    assert_eq!(acts(1) * 24, acts(0) * 32);
    assert_eq!(r.most_loaded, 1);
    let x = input("llama-3-8b", recipe(), layout, Convention::Ferrotron);
    assert_eq!(plan_extremes(&x).unwrap().most_loaded, 1);
}

#[test]
fn an_embedding_only_first_stage() {
    let r = run(
        "llama-3-8b",
        Layout {
            pp: 3,
            pp_layers: vec![0, 16, 16],
            ..Layout::default()
        },
    );
    assert_eq!(numel(&r.ranks[0], "params"), 128_256 * 4096);
    assert!(!r.ranks[0]
        .plan
        .buffers
        .iter()
        .any(|b| b.name.starts_with("act.layers.")));
}

#[test]
fn pp_layers_errors_name_the_flag_and_the_fix() {
    let err = |pp: u64, pp_layers: Vec<u64>, pp_virtual: u64| {
        let layout = Layout {
            pp,
            pp_layers,
            pp_virtual,
            pp_schedule: if pp_virtual > 1 {
                PpSchedule::Interleaved
            } else {
                PpSchedule::OneFOneB
            },
            ..Layout::default()
        };
        plan(&input(
            "llama-3-8b",
            recipe(),
            layout,
            Convention::Ferrotron,
        ))
        .unwrap_err()
        .to_string()
    };
    assert_eq!(
        err(2, vec![16, 15], 1),
        "pp_layers = 16,15: adds up to 31 layers but the model has 32"
    );
    assert_eq!(
        err(3, vec![16, 16], 1),
        "pp_layers = 16,16: gives 2 stages but pp is 3 (one layer count per stage, e.g. 7,8*14,7)"
    );
    assert_eq!(
        err(2, vec![16, 16], 2),
        "pp_layers = 16,16: an uneven split needs pp_virtual 1 (drop --pp-virtual or --pp-layers)"
    );
    assert_eq!(
        layout::parse_pp_layers("7,8*14,7").unwrap(),
        [vec![7], vec![8; 14], vec![7]].concat()
    );
    assert_eq!(
        layout::parse_pp_layers("7,x").unwrap_err().to_string(),
        "pp_layers = 7,x: expected layer counts per stage separated by commas, n*k for k stages of n (e.g. 7,8*14,7)"
    );
}

#[test]
fn zero3_with_pipelining_holds_the_stage_unsharded_for_the_step() {
    // torchtitan (FSDP2 + torch.distributed.pipelining): gradients are reduce-scattered once,
    // at the last micro-batch's backward, and ZeRO-3 parameters stay gathered from the
    // stage's first forward to its last backward. So at the peak a ZeRO-3 stage holds its
    // ZeRO-1 states plus the sharded parameters; between steps only the shards.
    let layout = |zero| Layout {
        dp: 8,
        pp: 2,
        zero,
        ..Layout::default()
    };
    let z1 = run("llama-3-8b", layout(1));
    let z2 = run("llama-3-8b", layout(2));
    let z3 = run("llama-3-8b", layout(3));
    for s in 0..2 {
        let (a, b, c) = (&z1.ranks[s], &z2.ranks[s], &z3.ranks[s]);
        let full = numel(a, "params");
        assert_eq!(
            numel(c, "params"),
            full.div_ceil(8),
            "stage {s}: sharded at rest"
        );
        assert_eq!(numel(c, "params.unsharded_for_step"), full);
        assert_eq!(
            numel(c, "grads"),
            full,
            "stage {s}: gradients unsharded over the step"
        );
        assert_eq!(numel(b, "grads"), full);
        assert_eq!(c.at_peak.params, a.at_peak.params + full.div_ceil(8) * 2);
        assert_eq!(c.at_peak.grads, a.at_peak.grads);
        assert_eq!(b.at_peak.model_states(), a.at_peak.model_states());
        assert_eq!(c.at_peak.optimizer, a.at_peak.optimizer);
        // No per-layer gather buffers: the whole stage is gathered.
        assert!(c.plan.find("comm.zero3.gathered_params").is_none());
        // After the step's optimizer, only the shards remain.
        let after = c
            .sweep
            .marks
            .iter()
            .find(|m| m.label == "step 1 optimizer")
            .unwrap()
            .live;
        let during = c
            .sweep
            .marks
            .iter()
            .find(|m| m.label.starts_with("step 1 mb 0 forward"))
            .unwrap()
            .live;
        assert!(during > after);
    }
}
