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
    let cp = run("llama-3-8b", cp_layout());
    assert_eq!(numel(cp.worst(), "comm.cp.block"), (n / 2) * 2 * (d + d));
    assert_eq!(numel(cp.worst(), "comm.cp.message"), (n / 2) * 2 * (d + d));
    // On the host a block is received in place; on a device the trainer receives it into a
    // second message buffer while the first is the send's, in flight.
    assert!(cp.worst().plan.find("comm.cp.receive").is_none());
    let mut x = input("llama-3-8b", recipe(), cp_layout(), Convention::Ferrotron);
    x.runtime = Runtime::FerrotronDevice;
    let dev = plan(&x).unwrap();
    assert_eq!(numel(dev.worst(), "comm.cp.receive"), (n / 2) * 2 * (d + d));
    assert_eq!(
        dev.worst().peak - cp.worst().peak,
        4 * (n / 2) * 2 * (d + d)
    );
}

fn cp_layout() -> Layout {
    Layout {
        tp: 16,
        cp: 2,
        ..Layout::default()
    }
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
        err(2, vec![10, 11, 11], 2),
        "pp_layers = 10,11,11: gives 3 stages but pp is 2 (one layer count per stage, e.g. 7,8*14,7, or pp × pp_virtual = 4 counts, one per model chunk)"
    );
    assert_eq!(
        err(2, vec![15, 17], 2),
        "pp_layers = 15,17: stage 0's 15 layers do not split evenly over pp_virtual = 2 model chunks (give one count per model chunk: 4 counts in model order)"
    );
    assert_eq!(
        layout::parse_pp_layers("7,8*14,7").unwrap(),
        [vec![7], vec![8; 14], vec![7]].concat()
    );
    assert_eq!(layout::format_pp_layers(&[7, 8, 8, 8, 7]), "7,8*3,7");
    assert_eq!(
        layout::parse_pp_layers(&layout::format_pp_layers(&[3, 4, 4, 2, 2])).unwrap(),
        [3, 4, 4, 2, 2]
    );
    assert_eq!(
        layout::parse_pp_layers("auto").unwrap_err().to_string(),
        "pp_layers = auto: `ferrotron plan --pp-layers auto` proposes a split; give the layer counts its layout line prints"
    );
    assert_eq!(
        layout::parse_pp_layers("7,x").unwrap_err().to_string(),
        "pp_layers = 7,x: expected layer counts per stage separated by commas, n*k for k stages of n (e.g. 7,8*14,7)"
    );
}

/// The layers whose activations a rank of `r` holds (`act.layers.{i}.input`), sorted.
fn activation_layers(r: &RankPlan) -> Vec<u64> {
    let mut v: Vec<u64> = r
        .plan
        .buffers
        .iter()
        .filter_map(|b| b.name.strip_prefix("act.layers."))
        .filter_map(|s| s.split('.').next())
        .filter_map(|s| s.parse().ok())
        .collect();
    v.sort();
    v.dedup();
    v
}

fn interleaved(pp: u64, v: u64) -> Layout {
    Layout {
        pp,
        pp_virtual: v,
        pp_schedule: PpSchedule::Interleaved,
        ..Layout::default()
    }
}

#[test]
fn uneven_stages_with_virtual_stages_hold_each_chunk_given() {
    // Llama 3 405B interleaved with the first and last stage one layer lighter (arXiv
    // 2407.21783 §3.3.2), as a per-chunk list: 16 stages × 2 chunks, the first chunk (stage
    // 0) and the last (stage 15) 3 layers, the 30 others 4: 126 layers.
    let layout = Layout {
        tp: 8,
        pp_layers: [vec![3], vec![4; 30], vec![3]].concat(),
        ..interleaved(16, 2)
    };
    let mut r = recipe();
    r.grad_acc = 16;
    let res = plan(&input(
        "llama-3.1-405b",
        r,
        layout.clone(),
        Convention::Ferrotron,
    ))
    .unwrap();
    // Chunk g sits on stage g mod 16: stage 0 runs chunks 0 (layers 0..3) and 16 (63..67),
    // stage 15 chunks 15 (59..63) and 31 (123..126); each holds its chunks' layers and the
    // next chunk's first input it sends on (Megatron-LM's interleaving, Narayanan et al. 2021
    // §2.2). The `act.layers.N.*` names include a layer's input held as the previous layer's
    // output: the held set is the chunks' layers, each followed by one.
    assert_eq!(layout.stage_layer_count(126, 0), 7);
    assert_eq!(layout.stage_layer_count(126, 7), 8);
    assert_eq!(layout.stage_layer_count(126, 15), 7);
    let held0 = activation_layers(&res.ranks[0]);
    for i in (0..3).chain(63..67) {
        assert!(held0.contains(&i), "stage 0 holds layer {i}: {held0:?}");
    }
    assert!(!held0.iter().any(|i| (8..60).contains(i)), "{held0:?}");
    let held15 = activation_layers(&res.ranks[15]);
    for i in (59..63).chain(123..126) {
        assert!(held15.contains(&i), "stage 15 holds layer {i}: {held15:?}");
    }
    // Parameters follow the chunks: stage 0 the embedding and 7 layers, stage 7 8 layers,
    // stage 15 7 layers and the head.
    let layer = stage_elems("llama-3.1-405b", 8, |p| p == Placement::Layer(1));
    let emb = stage_elems("llama-3.1-405b", 8, |p| p == Placement::Embedding);
    let head = stage_elems("llama-3.1-405b", 8, |p| p == Placement::Head);
    assert_eq!(numel(&res.ranks[0], "params"), emb + 7 * layer);
    assert_eq!(numel(&res.ranks[7], "params"), 8 * layer);
    assert_eq!(numel(&res.ranks[15], "params"), head + 7 * layer);
}

#[test]
fn megatrons_first_last_form_and_a_per_stage_list_split_each_stage_over_its_chunks() {
    // 32 layers, 4 stages × 2 chunks, first and last stage 6 layers: the middle two 10 each
    // (Megatron-LM's rule), each stage's layers split evenly over its chunks: chunk layers
    // 3,5,5,3, 3,5,5,3 in model order.
    let first_last = Layout {
        pp_first_layers: Some(6),
        pp_last_layers: Some(6),
        ..interleaved(4, 2)
    };
    let per_stage = Layout {
        pp_layers: vec![6, 10, 10, 6],
        ..interleaved(4, 2)
    };
    let per_chunk = Layout {
        pp_layers: vec![3, 5, 5, 3, 3, 5, 5, 3],
        ..interleaved(4, 2)
    };
    let counts = |l: &Layout| (0..8).map(|g| l.chunk_layers(32, g)).collect::<Vec<_>>();
    assert_eq!(counts(&first_last), counts(&per_chunk));
    assert_eq!(counts(&per_stage), counts(&per_chunk));
    assert_eq!(per_chunk.chunk_layers(32, 4), 16..19);
    let peaks =
        |l: Layout| -> Vec<u64> { run("llama-3-8b", l).ranks.iter().map(|r| r.peak).collect() };
    let want = peaks(per_chunk);
    assert_eq!(peaks(first_last), want);
    assert_eq!(peaks(per_stage), want);
    // Only the first stage named: 8 layers on it leaves 24, 8 on each of the other three.
    let first = Layout {
        pp: 4,
        pp_first_layers: Some(8),
        ..Layout::default()
    };
    assert_eq!(counts(&first)[..4], [0..8, 8..16, 16..24, 24..32]);
    let first = Layout {
        pp_first_layers: Some(2),
        ..first
    };
    assert_eq!(counts(&first)[..4], [0..2, 2..12, 12..22, 22..32]);
}

#[test]
fn first_last_form_errors_name_the_flag_and_the_fix() {
    let err = |layout: Layout| {
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
        err(Layout {
            pp_first_layers: Some(7),
            pp: 4,
            ..Layout::default()
        }),
        "pp_first_layers = 7: the other 3 stages cannot share the remaining 25 layers evenly (Megatron-LM's rule: the other stages share the rest evenly; else give every stage's layers with --pp-layers)"
    );
    assert_eq!(
        err(Layout {
            pp_first_layers: Some(5),
            pp_last_layers: Some(5),
            ..interleaved(4, 2)
        }),
        "pp_first_layers = 5: stage 0's 5 layers do not split evenly over pp_virtual = 2 model chunks (give one count per model chunk with --pp-layers: 8 counts in model order)"
    );
    assert_eq!(
        err(Layout {
            pp_last_layers: Some(40),
            pp: 2,
            ..Layout::default()
        }),
        "pp_last_layers = 40: the first and last stage's 40 layers leave -8 for the other 1 stages of a 32-layer model (Megatron-LM's rule: the other stages share the rest evenly; else give every stage's layers with --pp-layers)"
    );
    assert_eq!(
        err(Layout {
            pp_first_layers: Some(8),
            ..Layout::default()
        }),
        "pp_first_layers = 8: names a pipeline stage's layers: add --pp 2 or more"
    );
    assert_eq!(
        err(Layout {
            pp: 2,
            pp_layers: vec![16, 16],
            pp_last_layers: Some(16),
            ..Layout::default()
        }),
        "pp_last_layers = 16: goes without --pp-layers (give either every stage's layers or the first and last stage's)"
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

#[test]
fn a_mixture_of_experts_on_a_device_plans_its_router_statistics() {
    // The trainer's device runtime hands the router kernels the load statistics (Σp and the
    // copies per expert, then the loss's gradient per probability) in a device buffer of 3E
    // f32; on the host they are the engine's own.
    let m = "ferrotron-moe-16m";
    let r = || Recipe {
        seq: 1024,
        ..recipe()
    };
    let host = plan(&input(m, r(), Layout::default(), Convention::Ferrotron)).unwrap();
    assert!(host.worst().plan.find("comm.moe.router_stats").is_none());
    let mut x = input(m, r(), Layout::default(), Convention::Ferrotron);
    x.runtime = Runtime::FerrotronDevice;
    let dev = plan(&x).unwrap();
    let e = preset(m).unwrap().moe.unwrap().num_experts;
    assert_eq!(numel(dev.worst(), "comm.moe.router_stats"), 3 * e);
    assert_eq!(dev.worst().peak - host.worst().peak, 4 * 3 * e);
}
