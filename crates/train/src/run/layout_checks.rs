//! What `run` refuses once, before any rank starts, so a layout that cannot train fails with
//! one message instead of one per rank: one check per parallel dimension (and the memory
//! fit), each with the words of the part that cannot lay it out.

use super::*;
use ferrotron_plan::{Layout, ModelSpec};

/// Every check of `layout` (`world` ranks) for the run of `args` (resuming `saved`).
pub(super) fn check_layout(
    args: &TrainArgs,
    saved: Option<&checkpoint::Loaded>,
    layout: &Layout,
    world: usize,
) -> Result<()> {
    if layout.ep > 1 {
        check_ep(args, saved, layout)?;
    }
    if layout.zero >= 2 {
        check_zero(args, saved, layout)?;
    }
    if layout.cp > 1 {
        check_cp(args, saved, layout)?;
    }
    if layout.tp > 1 {
        check_tp(args, saved, layout)?;
    }
    if layout.pp > 1 {
        check_pp(args, saved, layout)?;
    }
    check_fit(args, saved, world)?;
    Ok(())
}

/// Expert parallelism needs a mixture of experts whose experts share out evenly.
fn check_ep(args: &TrainArgs, saved: Option<&checkpoint::Loaded>, layout: &Layout) -> Result<()> {
    // Expert parallelism needs experts to share out, evenly; refused once, before any
    // rank starts.
    let spec = spec_by_name(args, saved)?;
    let Some(moe) = spec.moe else {
        bail!(
            "ep = {}: expert parallelism shares out a mixture of experts; model {} has none",
            layout.ep,
            spec.name
        );
    };
    if moe.num_experts % layout.ep != 0 {
        bail!(
            "ep = {}: model {} has {} experts per layer; ep must divide them",
            layout.ep,
            spec.name,
            moe.num_experts
        );
    }
    Ok(())
}

/// ZeRO-2/3 of a mixture-of-experts model is not supported.
fn check_zero(args: &TrainArgs, saved: Option<&checkpoint::Loaded>, layout: &Layout) -> Result<()> {
    let spec = spec_by_name(args, saved)?;
    if spec.moe.is_some() {
        bail!(
            "zero = {}: ZeRO-2/3 of a mixture-of-experts model is not supported; use --zero 0 or 1",
            layout.zero
        );
    }
    Ok(())
}

/// A sequence context parallelism cannot cut evenly is refused.
fn check_cp(args: &TrainArgs, saved: Option<&checkpoint::Loaded>, layout: &Layout) -> Result<()> {
    // A sequence context parallelism cannot cut evenly is refused once, before any rank
    // starts.
    let cfg = config_of(args, saved)?;
    let ranks = layout.cp as usize;
    SeqPart { rank: 0, ranks }
        .local_len(cfg.data.seq as usize)
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// A model tensor parallelism cannot split is refused.
fn check_tp(args: &TrainArgs, saved: Option<&checkpoint::Loaded>, layout: &Layout) -> Result<()> {
    // A model tensor parallelism cannot split is refused once, before any rank starts.
    let spec = spec_by_name(args, saved)?;
    let full = setup::llama_config(&spec)?;
    ferrotron_engine::model::tensor_parallel::shard_config(&full, layout.tp as usize)?;
    Ok(())
}

/// A split or schedule the planner cannot lay out is refused, with the planner's words.
fn check_pp(args: &TrainArgs, saved: Option<&checkpoint::Loaded>, layout: &Layout) -> Result<()> {
    // A split or schedule the planner cannot lay out is refused once, before any rank
    // starts, with the planner's words.
    let cfg = config_of(args, saved)?;
    let spec = spec_of(&cfg, saved)?;
    if spec.moe.is_some() {
        // The load-balancing loss couples every layer's routing in one micro-batch.
        bail!(
            "pp = {}: pipeline parallelism of a mixture-of-experts model is not supported; run it with --dp",
            layout.pp
        );
    }
    let input = setup::plan_input(&spec, &cfg, 0);
    layout
        .validate(Some(&spec), &input.recipe)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let chunks = layout.pp * layout.pp_virtual;
    if let Some(g) = (0..chunks).find(|&g| layout.chunk_layers(spec.layers, g).is_empty()) {
        bail!(
            "pp_layers = {}: model chunk {g} has no layer; give every stage (and virtual stage) at least one",
            layout.pp_layers.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")
        );
    }
    let grad_acc = cfg.data.grad_acc;
    if layout.pp_schedule == ferrotron_plan::layout::PpSchedule::Interleaved
        && grad_acc % layout.pp != 0
    {
        bail!(
            "grad_acc = {grad_acc}: the interleaved schedule needs micro-batches in multiples of pp = {}",
            layout.pp
        );
    }
    Ok(())
}

/// A plan larger than the memory left is refused before any rank allocates (a GPU's budget
/// is its own).
fn check_fit(args: &TrainArgs, saved: Option<&checkpoint::Loaded>, world: usize) -> Result<()> {
    // A plan larger than the memory left is refused before any rank allocates (a GPU's
    // budget is its own).
    let cfg = config_of(args, saved)?;
    let spec = spec_of(&cfg, saved)?;
    // Under mpirun this process is one rank of those on its node; as threads, all of them.
    let here = match ferrotron_dist::launched_by_mpirun() {
        true => std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
        false => world as u64,
    };
    // A device's memory: the budget of `--device-memory`, then what its GPUs have free.
    if let Some(free) = crate::device::free_memory(args.device)? {
        crate::fit::device_budget(&spec, &cfg)?;
        crate::fit::device_fit(&spec, &cfg, here, free)?;
    }
    if args.device == crate::device::Device::Cuda {
        crate::fit::device_host_fit(&spec, &cfg, here)?;
        return crate::fit::device_budget(&spec, &cfg);
    }
    crate::fit::check(&spec, &cfg, here)?;
    Ok(())
}

/// The model's spec by its name (a resumed run's: its checkpoint's config.json).
fn spec_by_name(args: &TrainArgs, saved: Option<&checkpoint::Loaded>) -> Result<ModelSpec> {
    let name = match saved {
        Some(l) => l.dir.join("config.json").to_string_lossy().to_string(),
        None => args.resolve()?.model.name,
    };
    ferrotron_plan::presets::resolve(&name).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The run's config (a resumed run's: its checkpoint's, with what the flags may change).
pub(super) fn config_of(
    args: &TrainArgs,
    saved: Option<&checkpoint::Loaded>,
) -> Result<TrainConfig> {
    match saved {
        Some(l) => resume_config(args, &l.state.config),
        None => Ok(args.resolve()?),
    }
}

/// The spec of `cfg`'s model (a resumed run's: its checkpoint's).
fn spec_of(cfg: &TrainConfig, saved: Option<&checkpoint::Loaded>) -> Result<ModelSpec> {
    match saved {
        Some(l) => Ok(l.spec.clone()),
        None => {
            ferrotron_plan::presets::resolve(&cfg.model.name).map_err(|e| anyhow::anyhow!("{e}"))
        }
    }
}
