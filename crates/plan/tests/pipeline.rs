//! Pipeline schedules hold the number of micro-batches Korthikanti et al. 2022 §4.2.3 states.

mod common;
use common::input;
use ferrotron_plan::activations::{korthikanti_layer, Dims};
use ferrotron_plan::*;

fn megatron_175b(schedule: PpSchedule, v: u64, grad_acc: u64) -> (PlanResult, u64) {
    let recipe = Recipe {
        seq: 2048,
        mbs: 1,
        grad_acc,
        recompute: Recompute::Selective,
        ..Recipe::default()
    };
    let layout = Layout {
        tp: 8,
        pp: 8,
        sp: true,
        pp_schedule: schedule,
        pp_virtual: v,
        ..Layout::default()
    };
    let per_layer = korthikanti_layer(
        12288,
        96,
        &Dims::new(&recipe, &layout),
        Recompute::Selective,
    );
    (
        plan(&input(
            "megatron-175b",
            recipe,
            layout,
            Convention::Megatron,
        ))
        .unwrap(),
        per_layer,
    )
}

#[test]
fn one_f_one_b_first_stage_holds_p_micro_batches() {
    let (r, per_layer) = megatron_175b(PpSchedule::OneFOneB, 1, 64);
    // Stage s holds p − s micro-batches of L/p = 12 layers.
    for (s, rank) in r.ranks.iter().enumerate() {
        assert_eq!(
            rank.at_peak.layer_activations,
            (8 - s as u64) * 12 * per_layer,
            "stage {s}"
        );
    }
    assert_eq!(r.most_loaded, 0);
    assert_eq!(r.worst().name, "pipeline stage 0");
}

#[test]
fn interleaving_multiplies_by_one_plus_p_minus_1_over_pv() {
    let (r, per_layer) = megatron_175b(PpSchedule::Interleaved, 3, 64);
    // L·(1 + (p−1)/(p·v)) = 96·(1 + 7/24) = 124 layers on the first stage.
    assert_eq!(r.ranks[0].at_peak.layer_activations, 124 * per_layer);
}

#[test]
fn afab_holds_every_micro_batch() {
    let (r, per_layer) = megatron_175b(PpSchedule::Afab, 1, 16);
    for rank in &r.ranks {
        assert_eq!(rank.at_peak.layer_activations, 16 * 12 * per_layer);
    }
}

#[test]
fn few_micro_batches_cap_what_1f1b_holds() {
    let (r, per_layer) = megatron_175b(PpSchedule::OneFOneB, 1, 2);
    assert_eq!(r.ranks[0].at_peak.layer_activations, 2 * 12 * per_layer);
}

#[test]
fn tied_embedding_is_copied_to_the_last_stage() {
    let recipe = Recipe {
        seq: 1024,
        ..Recipe::default()
    };
    let layout = Layout {
        pp: 2,
        ..Layout::default()
    };
    let r = plan(&input("gpt2", recipe, layout, Convention::Ferrotron)).unwrap();
    let params = |i: usize| r.ranks[i].plan.find("params").unwrap().numel;
    // Each stage has 6 blocks; stage 0 adds wte + wpe, stage 1 ln_f + its own wte copy.
    let block = (124_439_808 - 50257 * 768 - 1024 * 768 - 2 * 768) / 12;
    assert_eq!(params(0), 6 * block + 50257 * 768 + 1024 * 768);
    assert_eq!(params(1), 6 * block + 2 * 768 + 50257 * 768);
}
