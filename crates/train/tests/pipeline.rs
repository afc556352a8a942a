//! Pipeline parallelism on the threads backend: `--pp 2` under AFAB, 1F1B and interleaved 1F1B
//! (3 chunks per stage), and composed with data, tensor and sequence parallelism and ZeRO-1
//! (dp 2 × tp 2 × pp 2, eight ranks), follow the one-rank trajectory of the same global batch
//! within 1e-5, with every rank's measured peak within 1% of its own stage's plan. AFAB holds
//! every micro-batch's activations, 1F1B the first stage's pp of them, as measured.

mod common;
use common::{assert_follows, assert_within_plans, rel, shards, tmp};
use ferrotron_plan::cluster::Dim;
use ferrotron_train::alloc::Tracking;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::metrics::StepMetrics;
use ferrotron_train::run::run;
use std::path::Path;

// Each rank's memory is measured by the tracking allocator (per rank: ranks are threads).
#[global_allocator]
static A: Tracking = Tracking;

/// Ranks are counted by rank number in one process: the runs of this file take turns.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A 6-layer GQA Llama (tied embeddings): 2 stages × 3 chunks of one layer each, large enough
/// that the few tens of KB a rank allocates outside any plan stay under 1% of its peak.
fn six_layers(dir: &Path) -> String {
    common::llama_config(dir, 128, 320, 6)
        .to_string_lossy()
        .into()
}

fn args(out: &Path, steps: u64) -> TrainArgs {
    TrainArgs {
        model: Some(six_layers(out)),
        data: Some(shards().to_path_buf()),
        seq: Some(32),
        mbs: Some(2),
        grad_acc: Some(4),
        steps: Some(steps),
        warmup: Some(2),
        eval_interval: Some(0),
        out_dir: Some(out.to_path_buf()),
        peak_gflops: Some(100.0),
        bucket_mb: Some(1),
        quiet: true,
        ..TrainArgs::default()
    }
}

struct Layout {
    dp: u64,
    tp: u64,
    pp: u64,
    schedule: &'static str,
    v: u64,
    sp: bool,
    zero: u64,
    /// `--pp-layers` (None: even).
    layers: Option<&'static str>,
}

const ONE: Layout = Layout {
    dp: 1,
    tp: 1,
    pp: 1,
    schedule: "1f1b",
    v: 1,
    sp: false,
    zero: 0,
    layers: None,
};

fn train(tag: &str, l: &Layout) -> Vec<StepMetrics> {
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = tmp(tag);
    let mut a = args(&out, 5);
    // 8 sequences a step: each data-parallel replica takes its share of the micro-batches.
    a.grad_acc = Some(4 / l.dp);
    (a.layout.dp, a.layout.tp, a.layout.pp) = (Some(l.dp), Some(l.tp), Some(l.pp));
    (a.layout.zero, a.layout.sp) = (Some(l.zero), Some(l.sp));
    a.layout.pp_schedule = Some(l.schedule.into());
    a.layout.pp_virtual = Some(l.v);
    a.layout.pp_layers = l.layers.map(Into::into);
    // Validation runs through the pipeline too (forward only, chunk by chunk).
    a.eval_interval = Some(2);
    run(a).unwrap().steps
}

#[test]
fn uneven_model_chunks_follow_the_one_rank_trajectory_within_their_plans() {
    // 6 layers on 2 stages × 2 chunks, one count per chunk in model order: stage 0 runs
    // chunks 0 (1 layer) and 2 (2 layers), stage 1 chunks 1 (2) and 3 (1, and the head) —
    // the planner's `Layout::chunk_layers`, which the trainer's stages follow.
    let one = train("pp-uneven-one", &ONE);
    let l = Layout {
        pp: 2,
        schedule: "interleaved",
        v: 2,
        layers: Some("1,2,2,1"),
        ..ONE
    };
    let s = train("pp-uneven-chunks", &l);
    assert_eq!(s.len(), 5);
    assert_follows(&one, &s, 1e-5, true, "pp 2 v 2 layers 1,2,2,1");
    assert_within_plans(&s, "pp 2 v 2 layers 1,2,2,1");
}

#[test]
fn pipeline_stages_follow_the_one_rank_trajectory_within_their_plans() {
    let one = train("pp-one", &ONE);
    assert!(one.iter().any(|m| m.val_loss.is_some()), "validation ran");
    let layouts = [
        Layout {
            pp: 2,
            schedule: "afab",
            ..ONE
        },
        Layout { pp: 2, ..ONE },
        Layout {
            pp: 2,
            schedule: "interleaved",
            v: 3,
            ..ONE
        },
        Layout {
            dp: 2,
            tp: 2,
            pp: 2,
            sp: true,
            zero: 1,
            ..ONE
        },
    ];
    let mut first_stage = Vec::new();
    for l in &layouts {
        let what = format!(
            "dp {} tp {} sp {} pp {} {} v {} ZeRO-{}",
            l.dp, l.tp, l.sp, l.pp, l.schedule, l.v, l.zero
        );
        let s = train(&format!("pp-{}-{}-{}", l.dp * l.tp, l.schedule, l.v), l);
        assert_eq!(s.len(), 5, "{what}");
        assert_follows(&one, &s, 1e-5, true, &what);
        assert_within_plans(&s, &what);
        for (x, y) in one.iter().zip(&s) {
            let what = format!("{what} step {}", x.step);
            assert_eq!(x.val_loss.is_some(), y.val_loss.is_some(), "{what}");
            if let (Some(a), Some(b)) = (x.val_loss, y.val_loss) {
                assert!(rel(a, b) < 1e-5, "{what}: val loss {a} vs {b}");
            }
            let ranks = (l.dp * l.tp * l.pp) as usize;
            assert_eq!(y.rank_mem.len(), ranks, "{what}: one entry per rank");
            // The first stage's bytes are its own stage's plan (the embedding's stage, not the
            // head's that paces the pipeline).
            assert_eq!(y.comm_sent(Dim::Tp), y.comm_planned(Dim::Tp), "{what}");
            assert_eq!(y.comm_sent(Dim::Dp), y.comm_planned(Dim::Dp), "{what}");
            // Each stage measured its bubble; the planner's is (p − 1)/(v·m).
            assert_eq!(y.pp_bubble.len(), l.pp as usize, "{what}");
            let m = (4 / l.dp) as f64;
            let planned = (l.pp - 1) as f64 / (l.v as f64 * m);
            assert_eq!(y.pp_bubble_planned, Some(planned), "{what}");
        }
        first_stage.push(s[4].rank_mem[0]);
    }
    // AFAB holds its 4 micro-batches' activations at once, 1F1B the first stage's 2 (pp):
    // the measured difference is the planned one.
    let (afab, one_f) = (first_stage[0], first_stage[1]);
    let planned = afab.mem_peak_planned as f64 - one_f.mem_peak_planned as f64;
    let measured = afab.mem_peak_measured as f64 - one_f.mem_peak_measured as f64;
    assert!(
        planned > 0.0,
        "AFAB plans more than 1F1B: {afab:?} {one_f:?}"
    );
    assert!(
        rel(measured, planned) < 0.05,
        "AFAB − 1F1B: measured {measured} B, planned {planned} B"
    );
}

#[test]
fn layouts_pipelining_cannot_run_are_refused_with_the_fix() {
    let out = tmp("pp-bad");
    let bad = |edit: &dyn Fn(&mut TrainArgs)| {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut a = args(&out, 2);
        a.layout.pp = Some(2);
        edit(&mut a);
        format!("{:#}", run(a).unwrap_err())
    };
    assert_eq!(
        bad(&|a| (a.layout.dp, a.layout.zero) = (Some(2), Some(2))),
        "zero = 2: ZeRO-2 and 3 release a unit's gradients (and ZeRO-3 its weights) after each micro-batch's backward, but a pipeline stage holds several micro-batches in flight, so every one would reduce-scatter (and gather) again; with --pp use --zero 1 (the optimizer states sharded) or 0"
    );
    assert_eq!(
        bad(&|a| (a.layout.pp, a.layout.pp_virtual) = (None, Some(3))),
        "pp_virtual = 3: virtual stages interleave a pipeline's model chunks: add --pp 2 or more"
    );
    assert_eq!(
        bad(&|a| a.layout.pp = Some(4)),
        "pp = 4: pp × pp_virtual = 4 must divide the 6 layers (or give each stage's layers with --pp-layers)"
    );
    assert_eq!(
        bad(&|a| a.layout.pp_layers = Some("6,0".into())),
        "pp_layers = 6,0: model chunk 1 has no layer; give every stage (and virtual stage) at least one"
    );
    let interleaved = bad(&|a| {
        a.layout.pp_schedule = Some("interleaved".into());
        (a.layout.pp_virtual, a.grad_acc) = (Some(3), Some(3));
    });
    assert!(
        interleaved.contains("grad_acc") && interleaved.contains("multiples of pp = 2"),
        "{interleaved}"
    );
    assert!(!out.join("metrics.jsonl").exists(), "nothing written");
}

#[test]
fn a_pipeline_checkpoint_is_the_whole_model_and_resumes_on_any_layout() {
    // Stopped after step 3 of 5 on dp 2 × tp 2 × pp 2 (each stage writing its layers, the last
    // stage not its copy of the tied embedding); resumed on one rank and on pp 2 interleaved,
    // each follows the one-rank run.
    let straight = train("ppck-straight", &ONE);
    let saved = {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let out = tmp("ppck-save");
        let mut a = args(&out, 5);
        (a.layout.dp, a.layout.tp, a.layout.pp) = (Some(2), Some(2), Some(2));
        (a.layout.zero, a.grad_acc, a.stop_after) = (Some(1), Some(2), Some(3));
        a.checkpoint_dir = Some(out.join("ck"));
        run(a).unwrap();
        out.join("ck")
    };
    for (pp, schedule, v) in [(1, "1f1b", 1), (2, "interleaved", 3)] {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let out = tmp(&format!("ppck-resume-{pp}-{schedule}"));
        let mut a = args(&out, 5);
        (a.resume, a.data, a.model, a.warmup) = (Some(saved.clone()), None, None, None);
        (a.layout.dp, a.layout.tp, a.layout.pp) = (Some(1), Some(1), Some(pp));
        (a.layout.zero, a.layout.pp_schedule) = (Some(0), Some(schedule.into()));
        a.layout.pp_virtual = Some(v);
        a.checkpoint_dir = Some(out.join("ck"));
        let rest = run(a).unwrap().steps;
        assert_eq!(rest.len(), 2);
        let what = format!("resumed on pp {pp} {schedule}");
        assert_follows(&straight[3..], &rest, 1e-5, false, &what);
    }
}

#[test]
fn the_trace_shows_each_stage_waiting_for_its_neighbour() {
    // One file, a process row per rank, each with its time blocked in transfers (the bubble).
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = tmp("pp-trace");
    let mut a = args(&out, 2);
    a.layout.pp = Some(2);
    a.trace = Some(out.join("trace.json"));
    run(a).unwrap();
    let text = std::fs::read_to_string(out.join("trace.json")).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for rank in 0..2 {
        let waits = events
            .iter()
            .filter(|e| e["pid"] == rank && e["name"] == "pp.wait")
            .count();
        assert!(waits > 0, "rank {rank} has no pp.wait span");
    }
}

#[test]
fn pipelining_runs_in_16_bit_precisions() {
    // Activations cross stages widened to f32 and are rounded back exactly; the tied
    // embedding's two gradient copies are summed in f32 and rounded once, where one rank
    // accumulates both into one 16-bit buffer: 16-bit accuracy, not bit for bit.
    for precision in ["bf16", "fp16"] {
        let run_as = |pp: u64| {
            let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
            let mut a = args(&tmp(&format!("pp{pp}-{precision}")), 3);
            a.layout.pp = Some(pp);
            a.precision = Some(precision.into());
            run(a).unwrap().steps
        };
        let (one, two) = (run_as(1), run_as(2));
        let what = format!("{precision} pp 2");
        assert_follows(&one, &two, 2e-3, false, &what);
        assert_within_plans(&two, &what);
    }
}

#[test]
fn pp_layers_auto_trains_the_split_the_planners_balance_gives_for_cpu_costs() {
    // The fixture's matmul FLOPs per token, forward + backward (3× forward, docs/FORMULAS.md):
    // a layer 3·(2·(128·128·2 + 2·128·64 + 3·128·320) + 2·32·128) (weights, then the causal
    // scores and values of a 32-token sequence), the LM head 3·2·8192·128, about 6 layers.
    let layer = 3.0
        * (2.0 * (2.0 * 128.0 * 128.0 + 2.0 * 128.0 * 64.0 + 3.0 * 128.0 * 320.0)
            + 2.0 * 32.0 * 128.0);
    let head = 3.0 * 2.0 * 8192.0 * 128.0;
    // Each stage keeps one layer; the planner's balance places the other four.
    let rest = ferrotron_plan::balance::balance_stages(&[(layer, layer), (head + layer, layer)], 4);
    let expected: Vec<u64> = rest.iter().map(|n| n + 1).collect();
    assert_eq!(expected, [5, 1], "the head outweighs the other four layers");
    let out = tmp("pp-auto-choice");
    let mut a = args(&out, 2);
    (a.layout.pp, a.layout.pp_layers) = (Some(2), Some("auto".into()));
    let c = ferrotron_train::pp_auto::choose(&a).unwrap().unwrap();
    assert_eq!(c.stages, expected);
    // Priced at each of the 2 ranks' half of the given 100 GFLOP/s, 64 tokens a micro-batch.
    let s = 64.0 / 50e9;
    assert!(rel(c.lines[1].0, head * s) < 1e-12 && rel(c.lines[0].1, layer * s) < 1e-12);
    // It trains: the one-rank trajectory, each stage within its plan, and the same plans as
    // the split given by hand.
    let auto = train(
        "pp-auto",
        &Layout {
            pp: 2,
            layers: Some("auto"),
            ..ONE
        },
    );
    let by_hand = train(
        "pp-auto-5-1",
        &Layout {
            pp: 2,
            layers: Some("5,1"),
            ..ONE
        },
    );
    let one = train("pp-auto-one", &ONE);
    assert_follows(&one, &auto, 1e-5, true, "pp 2 layers auto");
    assert_within_plans(&auto, "pp 2 layers auto");
    let plans = |s: &[StepMetrics]| {
        s[0].rank_mem
            .iter()
            .map(|r| r.mem_peak_planned)
            .collect::<Vec<_>>()
    };
    assert_eq!(plans(&auto), plans(&by_hand));
    // Where auto cannot apply, one line says why.
    let bad = |edit: &dyn Fn(&mut TrainArgs)| {
        let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut a = args(&out, 2);
        a.layout.pp_layers = Some("auto".into());
        edit(&mut a);
        format!("{:#}", run(a).unwrap_err())
    };
    assert_eq!(
        bad(&|_| {}),
        "pp_layers = auto: balances the layers over pipeline stages; add --pp 2 or more"
    );
    assert_eq!(
        bad(&|a| (a.layout.pp, a.layout.pp_first_layers) = (Some(2), Some(2))),
        "pp_layers = auto: goes without --pp-first-layers/--pp-last-layers (auto chooses every stage's layers)"
    );
    assert_eq!(
        bad(&|a| (a.layout.pp, a.layout.pp_virtual) = (Some(2), Some(4))),
        "pp_layers = auto: 6 layers cannot give each of the pp × pp_virtual = 8 model chunks one; lower --pp or --pp-virtual"
    );
}
