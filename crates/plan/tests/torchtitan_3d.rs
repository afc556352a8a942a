//! torchtitan's published 1D–4D runs on H100 (issue 35, item 5): FSDP with Float8, FSDP + CP
//! at 32K–262K tokens, FSDP + TP, FSDP + TP + PP (1F1B and interleaved) and FSDP + TP + PP +
//! CP, each planned from its stated settings under the `torchtitan` convention; throughput
//! (tokens/s per GPU) and memory (the caching allocator's reserved peak against torchtitan's
//! reading) compared per row. Nothing in the planner was fitted on these rows. Sources and the
//! inputs of every row: docs/FORMULAS.md, "Validation on torchtitan's 3D and long-context runs";
//! per-row errors print with
//! `cargo test --release -p ferrotron-plan --test torchtitan_3d -- --nocapture`.

use ferrotron_plan::cluster::{self, gpu, Cluster};
use ferrotron_plan::hardware::Overhead;
use ferrotron_plan::presets::preset;
use ferrotron_plan::time::estimate;
use ferrotron_plan::GIB;
use ferrotron_plan::*;

/// One row of pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (commit
/// 820504e20d1149fbf0b98c567af24c4b0433b22d; the same tables as `docs/performance.md` at
/// d4c86e3758a8; torchtitan 9dec370, torch 1963fc8, 2024-12): Grand Teton, H100 96 GB HBM2e at
/// the 500 W default limit, 8 per host, 400 Gb/s per GPU.
struct Row {
    table: &'static str,
    model: &'static str,
    seq: u64,
    /// FSDP (data-parallel shard) degree, TP, PP, CP.
    fsdp: u64,
    tp: u64,
    pp: u64,
    cp: u64,
    /// Sequences per micro-batch, micro-batches per step: torchtitan splits the local batch
    /// into `pipeline_parallel_microbatches` (default: the PP degree) under PP.
    mbs: u64,
    grad_acc: u64,
    recompute: Recompute,
    float8: bool,
    async_tp: bool,
    interleaved: bool,
    /// Published TPS/GPU and memory (GiB).
    tps: f64,
    gib: f64,
}

#[allow(clippy::too_many_arguments)]
const fn row(
    table: &'static str,
    model: &'static str,
    seq: u64,
    [fsdp, tp, pp, cp]: [u64; 4],
    [mbs, grad_acc]: [u64; 2],
    full_ac: bool,
    [float8, async_tp, interleaved]: [bool; 3],
    tps: f64,
    gib: f64,
) -> Row {
    Row {
        table,
        model,
        seq,
        fsdp,
        tp,
        pp,
        cp,
        mbs,
        grad_acc,
        recompute: if full_ac {
            Recompute::Full
        } else {
            Recompute::Selective
        },
        float8,
        async_tp,
        interleaved,
        tps,
        gib,
    }
}

const T1: &str = "T1 8B FSDP, 8 GPUs";
const T2: &str = "T2 8B FSDP+CP, 8 GPUs";
const T3: &str = "T3 8B FSDP, 128 GPUs";
const T4: &str = "T4 70B FSDP+TP, 256 GPUs";
const T5: &str = "T5 405B FSDP+TP+PP, 512 GPUs";
const T6: &str = "T6 405B FSDP+TP+PP+CP, 512 GPUs";
const L8: &str = "llama-3-8b";
const L70: &str = "llama-3-70b";
const L405: &str = "llama-3.1-405b";
const F8: [bool; 3] = [true, false, false];
const F8_ATP: [bool; 3] = [true, true, false];

/// Every row with torch.compile, as published (the eager "FSDP" rows of Tables 1 and 3 are in
/// `measured_runs.rs`). torch.compile itself is not modelled (see FORMULAS).
const ROWS: [Row; 16] = [
    // Table 1: local batch 2, selective (op) checkpointing, sequence 8192.
    row(
        T1,
        L8,
        8192,
        [8, 1, 1, 1],
        [2, 1],
        false,
        [false; 3],
        6667.0,
        77.0,
    ),
    row(T1, L8, 8192, [8, 1, 1, 1], [2, 1], false, F8, 8532.0, 76.8),
    // Table 2: local batch 1, full checkpointing, Float8; FSDP over the dp × cp ranks.
    row(T2, L8, 32768, [8, 1, 1, 1], [1, 1], true, F8, 3890.0, 83.9),
    row(T2, L8, 65536, [4, 1, 1, 2], [1, 1], true, F8, 2540.0, 84.2),
    row(T2, L8, 131072, [2, 1, 1, 4], [1, 1], true, F8, 1071.0, 84.0),
    row(T2, L8, 262144, [1, 1, 1, 8], [1, 1], true, F8, 548.0, 84.5),
    // Table 3: as Table 1 on 128 GPUs.
    row(
        T3,
        L8,
        8192,
        [128, 1, 1, 1],
        [2, 1],
        false,
        [false; 3],
        6514.0,
        62.0,
    ),
    row(
        T3,
        L8,
        8192,
        [128, 1, 1, 1],
        [2, 1],
        false,
        F8,
        8380.0,
        61.8,
    ),
    // Table 4: local batch 16, full checkpointing, Float8, sequence 8192.
    row(T4, L70, 8192, [32, 8, 1, 1], [16, 1], true, F8, 829.0, 71.9),
    row(
        T4,
        L70,
        8192,
        [32, 8, 1, 1],
        [16, 1],
        true,
        F8_ATP,
        876.0,
        67.6,
    ),
    // Table 5: local batch 32 in 8 micro-batches of 4, full checkpointing, Float8, async TP.
    row(
        T5,
        L405,
        8192,
        [8, 8, 8, 1],
        [4, 8],
        true,
        F8_ATP,
        100.0,
        82.5,
    ),
    row(
        T5,
        L405,
        8192,
        [8, 8, 8, 1],
        [4, 8],
        true,
        [true, true, true],
        128.0,
        72.7,
    ),
    // Table 6: local batch 8 in 8 micro-batches of 1, 1F1B.
    row(
        T6,
        L405,
        32768,
        [8, 8, 8, 1],
        [1, 8],
        true,
        F8_ATP,
        76.0,
        75.3,
    ),
    row(
        T6,
        L405,
        65536,
        [4, 8, 8, 2],
        [1, 8],
        true,
        F8_ATP,
        47.0,
        75.9,
    ),
    row(
        T6,
        L405,
        131072,
        [2, 8, 8, 4],
        [1, 8],
        true,
        F8_ATP,
        31.0,
        77.1,
    ),
    row(
        T6,
        L405,
        262144,
        [1, 8, 8, 8],
        [1, 8],
        true,
        F8_ATP,
        16.0,
        84.9,
    ),
];

/// torchtitan's default split (`generate_split_points`, `pipelining_utils.py` at 9dec370): the
/// first and last of the `stages` model chunks take ⌊L / stages⌋ layers, the middle ones one
/// more while the remainder lasts.
fn torchtitan_split(layers: u64, stages: u64) -> Vec<u64> {
    let (base, mut extra) = (layers / stages, layers % stages);
    let mut counts = vec![base];
    for _ in 1..stages - 1 {
        let one = u64::from(extra > 0);
        extra -= one;
        counts.push(base + one);
    }
    counts.push(layers - counts.iter().sum::<u64>());
    counts
}

fn input(r: &Row) -> PlanInput {
    let mut spec = preset(r.model).unwrap();
    spec.max_positions = spec.max_positions.max(r.seq);
    // Looped schedules default to 2 stages per rank (`generate_split_points`).
    let v = if r.interleaved { 2 } else { 1 };
    let pp_layers = match r.pp {
        1 => vec![],
        p => torchtitan_split(spec.layers, p * v),
    };
    PlanInput {
        model: ModelSource::Spec(spec),
        recipe: Recipe {
            seq: r.seq,
            mbs: r.mbs,
            grad_acc: r.grad_acc,
            recompute: r.recompute,
            precision: if r.float8 {
                Precision::Fp8
            } else {
                Precision::Bf16
            },
            ..Recipe::default()
        },
        layout: Layout {
            dp: r.fsdp,
            tp: r.tp,
            pp: r.pp,
            cp: r.cp,
            zero: 3,
            // torchtitan's TP plan shards the norms' and residuals' activations over the
            // sequence (`SequenceParallel`); async TP is its overlapped form.
            sp: r.tp > 1,
            tp_overlap: r.async_tp,
            pp_schedule: if r.interleaved {
                PpSchedule::Interleaved
            } else {
                PpSchedule::OneFOneB
            },
            pp_virtual: v,
            pp_layers,
            ..Layout::default()
        },
        convention: Convention::Torchtitan,
        runtime: Runtime::Framework,
        overhead: Overhead::NONE,
        bucket_bytes: 25 << 20,
    }
}

/// (row, predicted TPS/GPU, published, predicted GiB, published).
fn predictions() -> Vec<(String, f64, f64, f64, f64)> {
    let cluster = Cluster::of(gpu("h100-96").unwrap(), 8).unwrap();
    ROWS.iter()
        .map(|r| {
            let x = input(r);
            let gpus = (r.fsdp * r.tp * r.pp * r.cp) as f64;
            let t = estimate(&x, &cluster, FlopsConvention::Ferrotron)
                .unwrap()
                .unwrap();
            let gib = plan(&x).unwrap().worst().reserved() as f64 / GIB;
            let what = format!(
                "{} seq {} cp {}{}{}{}",
                r.table,
                r.seq,
                r.cp,
                if r.float8 { " fp8" } else { "" },
                if r.async_tp { " asyncTP" } else { "" },
                if r.interleaved { " interleaved" } else { "" }
            );
            (what, t.tokens_per_s / gpus, r.tps, gib, r.gib)
        })
        .collect()
}

/// Prints each row's signed error and returns the mean and largest |error|.
fn report(name: &str, rows: &[(String, f64, f64)]) -> (f64, f64) {
    println!("{name}");
    let errors: Vec<f64> = rows
        .iter()
        .map(|(what, pred, publ)| {
            let e = pred / publ - 1.0;
            println!(
                "  {what:<52} published {publ:>8.1}, predicted {pred:>8.1}, {:+6.1}%",
                e * 100.0
            );
            e.abs()
        })
        .collect();
    let mean = errors.iter().sum::<f64>() / errors.len() as f64;
    let max = errors.iter().cloned().fold(0.0, f64::max);
    println!(
        "  {} rows: mean |error| {:.1}%, max {:.1}%",
        errors.len(),
        mean * 100.0,
        max * 100.0
    );
    (mean, max)
}

#[test]
fn the_default_split_is_torchtitans() {
    // 126 layers: 8 stages 15,16×6,15; 16 stages 7,8×14,7.
    assert_eq!(
        torchtitan_split(126, 8),
        [vec![15], vec![16; 6], vec![15]].concat()
    );
    assert_eq!(
        torchtitan_split(126, 16),
        [vec![7], vec![8; 14], vec![7]].concat()
    );
}

#[test]
fn torchtitan_3d_and_long_context_throughput_and_memory() {
    let p = predictions();
    let tps: Vec<_> = p
        .iter()
        .map(|(w, a, b, _, _)| (w.clone(), *a, *b))
        .collect();
    let mem: Vec<_> = p
        .iter()
        .map(|(w, _, _, a, b)| (w.clone(), *a, *b))
        .collect();
    let (t_mean, t_max) = report("torchtitan H100, TPS/GPU", &tps);
    let (m_mean, m_max) = report("torchtitan H100, reserved GiB", &mem);
    // What this model reaches (docs/FORMULAS.md); the long-context rows and the 1F1B 405B
    // memory are the residuals named there.
    assert!(
        t_mean <= 0.10,
        "throughput mean |error| {:.1}%",
        t_mean * 100.0
    );
    assert!(
        t_max <= 0.33,
        "throughput max |error| {:.1}%",
        t_max * 100.0
    );
    assert!(m_mean <= 0.07, "memory mean |error| {:.1}%", m_mean * 100.0);
    assert!(m_max <= 0.16, "memory max |error| {:.1}%", m_max * 100.0);
}

#[test]
fn the_cp_rows_pay_for_the_ring_block_by_block() {
    // Row "FSDP 1, CP 8" of Table 2: the ring's exchanges are exposed beyond what one block's
    // attention hides, and PyTorch's per-block fp32 merge adds memory traffic that grows with
    // the blocks; with CP 1 neither exists.
    let cluster = Cluster::of(gpu("h100-96").unwrap(), 8).unwrap();
    let t = |r: &Row| {
        estimate(&input(r), &cluster, FlopsConvention::Ferrotron)
            .unwrap()
            .unwrap()
    };
    let (cp1, cp8) = (t(&ROWS[2]), t(&ROWS[5]));
    let exposed = |r: &time::TimeReport| {
        r.comm
            .iter()
            .find(|(d, _)| *d == cluster::Dim::Cp)
            .map_or(0.0, |(_, c)| c.exposed_s)
    };
    assert_eq!(exposed(&cp1), 0.0);
    assert!(exposed(&cp8) > 0.0);
    // Memory-bound time per token grows beyond the model's own elementwise ops.
    let per_token =
        |r: &time::TimeReport| r.compute_detail.memory_bound_s / r.tokens_per_step as f64;
    assert!(per_token(&cp8) > 1.1 * per_token(&cp1));
}

#[test]
fn float8_tensor_parallelism_gathers_in_float8() {
    // Table 4's layout: with Float8 the layers' sequence-parallel all-gathers move 1 byte per
    // element and the reduce-scatters 2, so the pairs move 3/4 of the bf16 bytes (the
    // embedding's and the head's collectives, a sliver here, stay in bf16).
    let cluster = Cluster::of(gpu("h100-96").unwrap(), 8).unwrap();
    let tp_bytes = |float8: bool| {
        let mut x = input(&ROWS[8]);
        if !float8 {
            x.recipe.precision = Precision::Bf16;
        }
        let t = estimate(&x, &cluster, FlopsConvention::Ferrotron)
            .unwrap()
            .unwrap();
        t.comm
            .iter()
            .find(|(d, _)| *d == cluster::Dim::Tp)
            .map(|(_, c)| c.bytes)
            .unwrap()
    };
    let ratio = tp_bytes(true) / tp_bytes(false);
    assert!((0.75..0.76).contains(&ratio), "{ratio}");
}
