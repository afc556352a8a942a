//! From a resolved config to the pieces a run needs: the model (checked against its memory
//! plan), the tokenizer and the data.

use crate::config::TrainConfig;
use crate::data::{
    build_shards_from, find_shards, BuildOptions, Source, Split, TokenDataset, Tokenizer,
};
use anyhow::{bail, Context, Result};
use ferrotron_dist::zero::zero2::GradWindows;
use ferrotron_dist::zero::zero3::Zero3;
use ferrotron_engine::kernels::{CpuKernels, Kernels};
use ferrotron_engine::model::{Llama, LlamaConfig};
use ferrotron_plan::cluster::Dim;
use ferrotron_plan::dp_layout::StateLens;
use ferrotron_plan::hardware::Overhead;
use ferrotron_plan::presets::resolve;
use ferrotron_plan::{
    plan, Convention, DType, ModelSource, ModelSpec, Optimizer, PlanInput, Precision, RankPlan,
    Recipe, Recompute, Runtime,
};
use std::path::{Path, PathBuf};

/// The bundled public-domain corpus (see data/corpus/README.md), embedded so the default run
/// works from any directory.
pub const BUNDLED_CORPUS: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/corpus/shakespeare.txt"
));

/// The engine's config for `spec`, or why the engine cannot train it. Every model of a run,
/// resume, evaluation or import is made here, and all of them run on the CPU kernels, so the
/// CPU backend's limits are checked here, as the config is made.
pub fn llama_config(spec: &ModelSpec) -> Result<LlamaConfig> {
    let cpu = Kernels::<f32>::limits(&CpuKernels::PLAIN);
    let cfg = LlamaConfig::from_spec(spec).and_then(|c| c.check_backend(cpu).map(|()| c));
    cfg.map_err(|e| anyhow::anyhow!("{e}"))
}

/// Matmul FLOPs per token that recomputation adds to a training step (for HFU). Convention:
/// full replays each layer's forward, i.e. the forward FLOPs of the layers (the model's forward
/// FLOPs without the LM head's 2·V·h, which the fused head never replays); selective rebuilds
/// only elementwise tensors (two RMSNorms and the SwiGLU product), counted as 0 like every
/// non-matmul operation in the FLOP convention of `ferrotron_plan::flops`.
pub fn recompute_flops_per_token(spec: &ModelSpec, seq: u64, r: Recompute) -> f64 {
    match r {
        Recompute::None | Recompute::Selective => 0.0,
        Recompute::Full => {
            ferrotron_plan::flops::forward_flops_per_token(spec, seq)
                - 2.0 * (spec.vocab * spec.hidden) as f64
        }
    }
}

/// The planner input describing this trainer's own run: its layout, precision, AdamW, the
/// run's recompute policy and data-parallel bucket size.
/// The overhead term is the kernel library's measured workspace (`workspace::measure`); a CPU
/// process has no device context and no caching allocator to budget for.
pub fn plan_input(spec: &ModelSpec, c: &TrainConfig, kernel_workspace: u64) -> PlanInput {
    PlanInput {
        model: ModelSource::Spec(spec.clone()),
        recipe: Recipe {
            seq: c.data.seq,
            mbs: c.data.mbs,
            grad_acc: c.data.grad_acc,
            precision: c.precision.kind,
            optimizer: Optimizer::Adamw,
            recompute: c.runtime.recompute,
            ce_chunk_tokens: c.runtime.ce_chunk,
            capacity_factor: c.model.capacity_factor,
        },
        layout: c.parallel.clone(),
        convention: Convention::Ferrotron,
        // This trainer's own communication: its buckets, windows and ZeRO-3 schedule.
        runtime: Runtime::Ferrotron,
        overhead: Overhead {
            context_bytes: kernel_workspace,
            ..Overhead::NONE
        },
        bucket_bytes: c.runtime.bucket_mb << 20,
    }
}

/// Builds the memory plan, which lists every state's length (`RankPlan::states`): the
/// trainer allocates those and sizes nothing itself. What is checked here is that the engine's
/// model is the one the plan counted (its parameter table holds the stage's parameters) and that
/// the states' types are the plan's. (Activations are the plan's by construction: both read the
/// table of `ferrotron_plan::tensors`, and the arena checks every one the engine asks for.) A
/// pipeline stage's plan is its `stage`'s.
pub fn checked_plan(
    spec: &ModelSpec,
    model: &Llama,
    c: &TrainConfig,
    kernel_workspace: u64,
    stage: usize,
    on_device: bool,
) -> Result<RankPlan> {
    let mut input = plan_input(spec, c, kernel_workspace);
    // On a device every exchange stages through host buffers, one more than on the host.
    if on_device {
        input.runtime = Runtime::FerrotronDevice;
    }
    let result = plan(&input).map_err(|e| anyhow::anyhow!("{e}"))?;
    let rank = result
        .ranks
        .into_iter()
        .nth(stage)
        .context("the plan has no such pipeline stage")?;
    if on_device {
        crate::fit::over_budget(spec, c, rank.peak, stage, kernel_workspace)?;
    }
    let held = model.num_params() as u64;
    if held != rank.states.stage_params {
        bail!(
            "internal: the engine's model holds {held} parameters on this rank, the memory plan {}",
            rank.states.stage_params
        );
    }
    let p = c.precision.kind;
    let mut expected = vec![
        ("params", p.storage()),
        ("grads", p.engine_grads()),
        ("master", DType::F32),
        ("comm.zero2.grad_windows", p.engine_grads()),
        ("zero3.param_windows", p.storage()),
        ("offload.param_windows", p.storage()),
    ];
    if !p.has_master() {
        expected.retain(|e| e.0 != "master");
    }
    for (name, dtype) in expected {
        if let Some(b) = rank.plan.find(name).filter(|b| b.dtype != dtype) {
            bail!(
                "internal: `{name}` is {dtype:?} in the engine but {:?} in the plan",
                b.dtype
            );
        }
    }
    Ok(rank)
}

/// The windows the trainer lays the engine's units into are the plan's: ZeRO-2/3's gradient
/// windows and ZeRO-3's parameter windows (their geometry is the engine's parameter table).
pub fn check_windows(
    lens: &StateLens,
    grads: Option<&GradWindows>,
    params: Option<&Zero3>,
) -> Result<()> {
    let pairs = [
        (
            "comm.zero2.grad_windows",
            grads.map(|w| w.len()),
            lens.grad_windows,
        ),
        (
            "zero3.param_windows",
            params.map(|z| z.len()),
            lens.param_windows,
        ),
    ];
    check_sizes(&pairs)
}

/// Each buffer `(name, held, planned)` holds the plan's elements (`None`: not allocated).
pub fn check_sizes(pairs: &[(&str, Option<usize>, u64)]) -> Result<()> {
    for &(name, held, planned) in pairs {
        if let Some(n) = held.filter(|&n| n as u64 != planned) {
            bail!("internal: the engine's units fill {n} elements of `{name}`, the plan's are {planned}");
        }
    }
    Ok(())
}

/// Checks that the plan names every in-flight slot the stage's program uses: the planner
/// simulates fewer micro-batches than a long step runs (the steady 1F1B phase repeats), and
/// the program over all of them must stay within the slots it planned.
pub fn check_slots(
    plan: &RankPlan,
    pp: &ferrotron_dist::pipeline::Pipeline,
    layers: usize,
) -> Result<()> {
    for chunk in 0..pp.chunks() {
        let last = pp.slots_of(chunk) - 1;
        if last == 0 {
            continue;
        }
        // The chunk's first input of its last slot (`act.layers.{first}.input@{last}`).
        let first = pp.chunk_layers(chunk, layers).start;
        let name = ferrotron_engine::model::BufName::Layer(
            first as u32,
            ferrotron_plan::tensors::LayerTensor::Input,
        );
        let mark = ferrotron_plan::planner::SLOT_MARK;
        if plan.plan.find(&format!("{name}{mark}{last}")).is_none() {
            bail!(
                "internal: pipeline stage {} holds {} micro-batches of chunk {chunk} at once, more than its memory plan names",
                pp.stage,
                last + 1
            );
        }
    }
    Ok(())
}

/// The planner's communication per step of a rank of pipeline stage `stage`, by dimension
/// (dp: gradient reductions and ZeRO gathers; tp: the model's activation collectives; ep: the
/// token all-to-alls; cp: the ring's blocks), in bytes as the ring algorithms send them
/// (`ferrotron_plan::comm::bytes_per_rank`), for this run's layout: one estimate, read per
/// dimension. The byte count does not depend on the hardware, so any cluster serves.
pub fn planned_bytes(
    spec: &ModelSpec,
    c: &TrainConfig,
    kernel_workspace: u64,
    stage: usize,
) -> Result<impl Fn(Dim) -> u64> {
    use ferrotron_plan::cluster::{gpu, Cluster};
    let mut input = plan_input(spec, c, kernel_workspace);
    // The trainer reduces gradients and gathers parameters through f32 buffers whatever the
    // storage type (exact sums): its bytes are the fp32 run's.
    input.recipe.precision = Precision::Fp32;
    let cluster = Cluster::of(gpu("h100")?, 8)?;
    let fc = ferrotron_plan::flops::FlopsConvention::Ferrotron;
    let t = ferrotron_plan::time::estimate(&input, &cluster, fc)?;
    Ok(move |d| {
        t.as_ref()
            .map_or(0.0, |t| t.bytes_on_stage(d, stage))
            .round() as u64
    })
}

/// Train and validation token data: `--data DIR` of shards, or the bundled corpus tokenized into
/// OUT_DIR/data on first use (reused afterwards when the tokenizer is the same).
pub fn datasets(
    c: &TrainConfig,
    tok: &Tokenizer,
    model_vocab: u32,
) -> Result<(TokenDataset, Option<TokenDataset>)> {
    // Data-parallel ranks run as threads of one process: one of them builds the bundled
    // shards, the others wait and read them.
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let dir: PathBuf = match &c.data.dir {
        Some(d) => d.clone(),
        None => bundled_shards(&c.observability.out_dir, tok)?,
    };
    let train_paths = find_shards(&dir, Split::Train)?;
    if train_paths.is_empty() {
        bail!(
            "data = {}: no train shards found (make them with `ferrotron data`)",
            dir.display()
        );
    }
    let train = TokenDataset::open_for_model(&train_paths, model_vocab)?;
    let val_paths = find_shards(&dir, Split::Val)?;
    let val = if val_paths.is_empty() {
        None
    } else {
        Some(TokenDataset::open_for_model(&val_paths, model_vocab)?)
    };
    Ok((train, val))
}

fn bundled_shards(out_dir: &Path, tok: &Tokenizer) -> Result<PathBuf> {
    let dir = out_dir.join("data");
    let stamp = dir.join("tokenizer.name");
    let ready = std::fs::read_to_string(&stamp).is_ok_and(|s| s == tok.name())
        && !find_shards(&dir, Split::Train)
            .unwrap_or_default()
            .is_empty();
    if ready {
        return Ok(dir);
    }
    // The streaming path of `ferrotron data`, reading the embedded bytes: its memory is the
    // build's stated bound (data::build), not the corpus's size.
    let corpus = Source::text("bundled:data/corpus/shakespeare.txt", BUNDLED_CORPUS);
    // Trimmed after: the tokenizer's transient memory must not stay resident in the rayon
    // workers' arenas for the whole run (crate::memory::heap, #34).
    let summary = crate::memory::heap::trimmed(|| {
        build_shards_from(&[corpus], tok, &dir, &BuildOptions::default())
    })?;
    std::fs::write(&stamp, tok.name())?;
    eprintln!(
        "tokenized the bundled corpus: {} train + {} val tokens -> {}",
        summary.train_tokens,
        summary.val_tokens,
        dir.display()
    );
    Ok(dir)
}

/// Resolves `--model` and checks it against the tokenizer and sequence length.
pub fn model(c: &TrainConfig, tok: &Tokenizer) -> Result<(ModelSpec, LlamaConfig)> {
    let spec = resolve(&c.model.name).map_err(|e| anyhow::anyhow!("{e}"))?;
    let cfg = llama_config(&spec)?;
    if tok.vocab_size() as u64 > spec.vocab {
        bail!(
            "tokenizer {} has {} tokens but model {} has vocab_size {}: use a model with vocab_size >= {} or another tokenizer",
            tok.name(),
            tok.vocab_size(),
            spec.name,
            spec.vocab,
            tok.vocab_size()
        );
    }
    if let (Some(cf), None) = (c.model.capacity_factor, spec.moe) {
        bail!(
            "capacity_factor = {cf}: a capacity bounds each expert's routed tokens; model {} has no experts",
            spec.name
        );
    }
    if c.data.seq > spec.max_positions {
        bail!(
            "seq = {}: longer than model {}'s max_position_embeddings {}",
            c.data.seq,
            spec.name,
            spec.max_positions
        );
    }
    Ok((spec, cfg))
}
