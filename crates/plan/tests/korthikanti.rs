//! Korthikanti et al. 2022 (arXiv 2205.05198), Table 5: end-to-end iteration time on A100 80 GB
//! (Selene: DGX A100 nodes, 8 GPUs each, NVLink 3, InfiniBand HDR), seq 2048, V 51200, with
//! full recompute (tensor parallelism, no SP) and with sequence parallelism + selective
//! recompute. One A100 model for all eight; no per-case tuning.

mod common;
use common::input;
use ferrotron_plan::cluster::{gpu, Cluster};
use ferrotron_plan::time::estimate;
use ferrotron_plan::*;

struct Case {
    model: &'static str,
    tp: u64,
    pp: u64,
    v: u64,
    mbs: u64,
    gbs: u64,
    full_s: f64,
    present_s: f64,
}

const CASES: [Case; 4] = [
    Case {
        model: "megatron-22b",
        tp: 8,
        pp: 1,
        v: 1,
        mbs: 4,
        gbs: 4,
        full_s: 1.42,
        present_s: 1.10,
    },
    Case {
        model: "megatron-175b",
        tp: 8,
        pp: 8,
        v: 3,
        mbs: 1,
        gbs: 64,
        full_s: 18.13,
        present_s: 13.75,
    },
    Case {
        model: "megatron-530b",
        tp: 8,
        pp: 35,
        v: 3,
        mbs: 1,
        gbs: 280,
        full_s: 49.05,
        present_s: 37.83,
    },
    Case {
        model: "megatron-1t",
        tp: 8,
        pp: 64,
        v: 1,
        mbs: 1,
        gbs: 512,
        full_s: 94.42,
        present_s: 71.49,
    },
];

fn predict(c: &Case, present: bool) -> time::TimeReport {
    let recipe = Recipe {
        seq: 2048,
        mbs: c.mbs,
        grad_acc: c.gbs / c.mbs,
        precision: Precision::Bf16,
        recompute: if present {
            Recompute::Selective
        } else {
            Recompute::Full
        },
        ..Recipe::default()
    };
    let layout = Layout {
        tp: c.tp,
        pp: c.pp,
        sp: present,
        pp_schedule: if c.v > 1 {
            PpSchedule::Interleaved
        } else {
            PpSchedule::OneFOneB
        },
        pp_virtual: c.v,
        ..Layout::default()
    };
    let x = input(c.model, recipe, layout, Convention::Megatron);
    let cluster = Cluster::of(gpu("a100-80").unwrap(), 8).unwrap();
    estimate(&x, &cluster, FlopsConvention::Megatron)
        .unwrap()
        .unwrap()
}

#[test]
fn table5_iteration_times() {
    let mut errs = Vec::new();
    for c in &CASES {
        for (present, paper) in [(false, c.full_s), (true, c.present_s)] {
            let t = predict(c, present);
            let err = (t.step_s - paper) / paper;
            println!(
                "{:<14} {:<22} predicted {:>7.2} s, paper {:>6.2} s, error {:+.1}%  (MFU {:.1}%)",
                c.model,
                if present {
                    "SP + selective"
                } else {
                    "full recompute"
                },
                t.step_s,
                paper,
                err * 100.0,
                t.mfu * 100.0
            );
            errs.push(err.abs());
        }
    }
    let mean = errs.iter().sum::<f64>() / errs.len() as f64;
    let max = errs.iter().cloned().fold(0.0, f64::max);
    println!("mean |error| {:.2}%, max {:.2}%", mean * 100.0, max * 100.0);
    assert!(mean <= 0.05, "mean abs error {:.2}% > 5%", mean * 100.0);
    assert!(max <= 0.10, "max abs error {:.2}% > 10%", max * 100.0);
}

fn memory(c: &Case, recompute: Recompute, sp: bool) -> PlanResult {
    let recipe = Recipe {
        seq: 2048,
        mbs: c.mbs,
        grad_acc: c.gbs / c.mbs,
        recompute,
        ..Recipe::default()
    };
    let layout = Layout {
        tp: c.tp,
        pp: c.pp,
        sp,
        pp_schedule: if c.v > 1 {
            PpSchedule::Interleaved
        } else {
            PpSchedule::OneFOneB
        },
        pp_virtual: c.v,
        ..Layout::default()
    };
    plan_extremes(&input(c.model, recipe, layout, Convention::Megatron)).unwrap()
}

/// Fig. 1's message, model by model: with tensor + sequence parallelism and selective
/// recompute every model fits in 80 GB; with tensor parallelism alone and no recompute none
/// does. The first stage's layer activations follow Table 2 times the layers in flight
/// (§4.2.3: L for 1F1B with m ≥ p, L·(1 + (p − 1)/(p·v)) interleaved).
#[test]
fn figure1_memory_of_the_four_models() {
    const GB: f64 = 1e9;
    for c in &CASES {
        let m = presets::preset(c.model).unwrap();
        let (s, b, h, a, t) = (2048u64, c.mbs, m.hidden, m.heads, c.tp);
        let in_flight = |l: u64| -> f64 {
            if c.v > 1 {
                l as f64 * (1.0 + (c.pp - 1) as f64 / (c.pp * c.v) as f64)
            } else {
                l as f64
            }
        };
        let present = memory(c, Recompute::Selective, true);
        let stage0 = &present.ranks[0];
        let per_layer = 34 * s * b * h / t;
        assert_eq!(
            stage0.at_peak.layer_activations as f64,
            in_flight(m.layers) * per_layer as f64,
            "{}",
            c.model
        );
        let peak = present.worst().peak as f64;
        assert!(
            peak < 80.0 * GB,
            "{}: {:.1} GB with SP + selective",
            c.model,
            peak / GB
        );
        let baseline = memory(c, Recompute::None, false);
        let per_layer_none = s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t;
        assert_eq!(
            baseline.ranks[0].at_peak.layer_activations as f64,
            in_flight(m.layers) * per_layer_none as f64,
            "{}",
            c.model
        );
        let peak = baseline.worst().peak as f64;
        assert!(
            peak > 80.0 * GB,
            "{}: {:.1} GB without SP or recompute",
            c.model,
            peak / GB
        );
        println!(
            "{:<14} model states {:>6.1} GB; activations: none {:>6.1} GB, SP + selective {:>5.1} GB",
            c.model,
            stage0.at_peak.model_states() as f64 / GB,
            baseline.ranks[0].at_peak.layer_activations as f64 / GB,
            stage0.at_peak.layer_activations as f64 / GB
        );
    }
}
