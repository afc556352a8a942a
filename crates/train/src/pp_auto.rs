//! `ferrotron train --pp-layers auto`: the planner's balanced split (`ferrotron_plan::balance`),
//! priced for the machine the trainer runs on.
//!
//! The planner prices a stage on a GPU of its table, where a layer's small GEMMs run below the
//! LM head's wide one; the trainer's CPU GEMM runs near its measured matmul peak whatever the
//! shape, so here a stage's time per micro-batch is its matmul FLOPs over the rank's share of
//! that peak (the FLOP convention of `ferrotron_plan::flops`: 2nkm a matmul, backward twice
//! the forward, elementwise work and the embedding lookup 0). A layer costs its forward FLOPs
//! × 3 (plus one more forward under full recomputation); the last stage adds the LM head's
//! 3 · 2·V·h per token. The sends between stages are copies between threads, left out. With
//! one price for every FLOP the split depends on FLOP ratios only, so every process of an
//! `mpirun` chooses the same one; the peak sets the printed times.
//!
//! Resolved once, before any rank starts: the flags' `auto` becomes the chosen counts.

use crate::config::TrainArgs;
use crate::device::Device;
use crate::setup::recompute_flops_per_token;
use anyhow::{bail, Result};
use ferrotron_plan::balance::{balance_with_floor, chunks_of};
use ferrotron_plan::model::ModelSpec;
use ferrotron_plan::Precision;
use ferrotron_plan::Recompute;

/// The split `auto` chose and how it was priced.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Layers per stage.
    pub stages: Vec<u64>,
    /// Per model chunk (model order): what `--pp-layers` is given.
    pub chunks: Vec<u64>,
    /// Per stage (seconds per micro-batch at the layer count, seconds per extra layer).
    pub lines: Vec<(f64, f64)>,
    /// Each rank's share of the matmul peak the times are priced at (GFLOP/s).
    pub rank_gflops: f64,
}

/// Matmul FLOPs per micro-batch of a stage: (fixed, per layer), for `stages` stages.
pub fn stage_flops(
    spec: &ModelSpec,
    seq: u64,
    mbs: u64,
    recompute: Recompute,
    stages: usize,
) -> Vec<(f64, f64)> {
    let tokens = (mbs * seq) as f64;
    // The layers' forward FLOPs per token: the model's forward without the LM head's 2·V·h.
    let layers_fwd = recompute_flops_per_token(spec, seq, Recompute::Full);
    let per_layer = (3.0 * layers_fwd + recompute_flops_per_token(spec, seq, recompute))
        / spec.layers as f64
        * tokens;
    let head = 3.0 * 2.0 * (spec.vocab * spec.hidden) as f64 * tokens;
    (0..stages)
        .map(|s| (if s + 1 == stages { head } else { 0.0 }, per_layer))
        .collect()
}

fn is_auto(args: &TrainArgs) -> bool {
    args.layout.pp_layers.as_deref().map(str::trim) == Some("auto")
}

/// The split `auto` chooses for `args` (the flags, merged with `--config`), or why auto cannot
/// apply; `None` where `--pp-layers` is not `auto`.
pub fn choose(args: &TrainArgs) -> Result<Option<Choice>> {
    if !is_auto(args) {
        return Ok(None);
    }
    let l = &args.layout;
    let pp = l.pp.unwrap_or(1);
    if pp < 2 {
        bail!("pp_layers = auto: balances the layers over pipeline stages; add --pp 2 or more");
    }
    if l.pp_first_layers.is_some() || l.pp_last_layers.is_some() {
        bail!("pp_layers = auto: goes without --pp-first-layers/--pp-last-layers (auto chooses every stage's layers)");
    }
    if args.resume.is_some() {
        bail!("pp_layers = auto: a resumed run keeps its checkpoint's split; drop --pp-layers (or give the layer counts)");
    }
    if args.device != Device::Cpu {
        bail!(
            "pp_layers = auto: the trainer prices stages on the CPU's measured matmul peak, and --device {:?} runs one rank (no pipeline, issue #15); drop --pp-layers auto",
            args.device
        );
    }
    // Everything but the split is checked as the run will check it.
    let mut even = args.clone();
    even.layout.pp_layers = None;
    let cfg = even.resolve().map_err(anyhow::Error::msg)?;
    let spec =
        ferrotron_plan::presets::resolve(&cfg.model.name).map_err(|e| anyhow::anyhow!("{e}"))?;
    let p = &cfg.parallel;
    let v = p.pp_virtual;
    if spec.layers < p.pp * v {
        bail!(
            "pp_layers = auto: {} layers cannot give each of the pp × pp_virtual = {} model chunks one; lower --pp or --pp-virtual",
            spec.layers,
            p.pp * v
        );
    }
    let world = (p.dp * p.tp * p.pp * p.cp * p.ep) as f64;
    let peak = match args.peak_gflops {
        Some(g) => g,
        None => {
            // Measured (or read from the cache) on a pool of the run's threads, as the run
            // measures it: the global pool is the run's to build.
            let bf16 = matches!(
                cfg.precision.kind,
                Precision::Bf16 | Precision::Bf16Fp32grads
            );
            rayon::ThreadPoolBuilder::new()
                .num_threads(cfg.runtime.threads as usize)
                .build()?
                .install(|| crate::observe::metrics::matmul_peak_gflops(bf16))
        }
    };
    // Each rank computes on its share of the cores; tensor and context parallelism split a
    // stage's FLOPs over their ranks.
    let rank_gflops = peak / world;
    let split = (p.tp * p.cp) as f64;
    let lines: Vec<(f64, f64)> = stage_flops(
        &spec,
        cfg.data.seq,
        cfg.data.mbs,
        cfg.runtime.recompute,
        p.pp as usize,
    )
    .into_iter()
    .map(|(a, b)| {
        (
            a / split / (rank_gflops * 1e9),
            b / split / (rank_gflops * 1e9),
        )
    })
    .collect();
    let stages = balance_with_floor(&lines, spec.layers, v);
    Ok(Some(Choice {
        chunks: chunks_of(&stages, v),
        stages,
        lines,
        rank_gflops,
    }))
}

/// The line printed for a choice: the split, its predicted stage times per micro-batch and the
/// even split's.
pub fn describe(c: &Choice, layers: u64) -> String {
    let times = |n: &[u64]| {
        n.iter()
            .zip(&c.lines)
            .map(|(&k, &(a, b))| format!("{:.1}", (a + b * k as f64) * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let p = c.stages.len() as u64;
    let even: Vec<u64> = (0..p)
        .map(|s| layers / p + u64::from(s < layers % p))
        .collect();
    let join = |n: &[u64]| n.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    format!(
        "pp_layers = auto: {} (stages {}; predicted {} ms per micro-batch at {:.0} GFLOP/s a rank; even {}: {} ms)",
        join(&c.chunks),
        join(&c.stages),
        times(&c.stages),
        c.rank_gflops,
        join(&even),
        times(&even)
    )
}

/// `args` with `--pp-layers auto` replaced by the chosen counts, the choice printed in one
/// line (unless quiet, or on a process other than rank 0 of an `mpirun`).
pub fn resolve(mut args: TrainArgs) -> Result<TrainArgs> {
    let Some(c) = choose(&args)? else {
        return Ok(args);
    };
    let layers: u64 = c.stages.iter().sum();
    let rank0 = std::env::var("OMPI_COMM_WORLD_RANK").map_or(true, |r| r == "0");
    if !args.quiet && rank0 {
        println!("{}", describe(&c, layers));
    }
    let counts = c.chunks.iter().map(u64::to_string).collect::<Vec<_>>();
    args.layout.pp_layers = Some(counts.join(","));
    Ok(args)
}
