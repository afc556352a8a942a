//! A plan that cannot fit the machine is refused before anything is allocated.
//!
//! The plan is known before the first byte of the model exists, so the trainer compares it
//! with the memory this machine (or its cgroup) can give now, and refuses in one line with the
//! planner's own same-machine fixes and their predicted peaks, instead of dying on an
//! allocation halfway through its start (what a 58 GB plan on a 24 GiB machine did).
//!
//! What one process needs: the plans of the ranks it runs (all of them with the threads
//! backend; its own under `mpirun`, times the ranks on its node) plus [`rss_overhead`], the
//! process's own memory besides the plan (binary, thread stacks, allocator slack; measured on
//! the default run, `docs/BENCHMARKS.md`).
//!
//! A device budget (`--device-memory GiB`, [`device_budget`]) is checked the same way against
//! the most loaded rank's planned peak: a run plans against a smaller card than it has (as
//! PyTorch's `torch.cuda.set_per_process_memory_fraction` caps its allocator) and is refused,
//! with the planner's same-GPU fixes and their predicted peak and step time, before a byte of
//! the model exists.

use crate::config::TrainConfig;
use anyhow::{bail, Result};
use ferrotron_plan::cluster::gpu;
use ferrotron_plan::ModelSpec;

/// Resident memory of a trainer process beyond its planned peak: the binary and its
/// libraries, thread stacks, the allocator's free lists and pages, the bundled tokenizer and
/// the metrics buffers. Measured as peak RSS minus planned peak of the default run on one rank
/// and of 8-rank threads runs (`docs/BENCHMARKS.md`, "Peak RSS against the plan"), rounded up.
pub const RSS_OVERHEAD: u64 = 96 << 20;

/// Resident memory each further rank of a threads run adds beyond [`RSS_OVERHEAD`]: its
/// thread's stack and kernel scratch, its allocator arena's free pages. Measured as peak RSS
/// minus the ranks' plans (2026-11-27, the default model, 2 steps): one rank 55.7 MiB, dp 2
/// 52.2, dp 4 71.5, tp 2 × pp 2 77.4, dp 8 110.1 and dp 2 × tp 2 × pp 2 120.2 MiB, about
/// 9 MiB a rank over the first; the 8-rank runs had gone over the flat 96 MiB. Rounded up.
pub const RSS_PER_RANK: u64 = 12 << 20;

/// A GPU process's resident memory beyond its host plan (the initial weights, until they move
/// to the device, and any offload tier): the host side of the CUDA driver, cuBLASLt and NVRTC.
/// Measured on an H200 (2026-11-27) as peak RSS less the initial weights' buffers: 358 to
/// 565 MiB over fp32 and bf16 runs of the default model and SmolLM-135M; rounded up with room,
/// since cuBLASLt loads its kernels as products first need them.
pub const GPU_RSS_OVERHEAD: u64 = 768 << 20;

/// The CUDA emulator's (crates/engine/cuda_emu), whose device memory is host memory: the CPU's
/// constant, its fibers' stacks (64 KiB for each of up to 1,024 threads of a block) and the
/// kernels' library. Measured 98 to 104 MiB over the device plan and the initial weights.
pub const EMULATOR_RSS_OVERHEAD: u64 = 192 << 20;

/// What a rank on a device holds in host memory beyond its offload tier, for the RSS bound.
#[derive(Clone, Copy, Debug)]
pub struct DeviceHost {
    /// The initial weights' buffers at their peak, before they move to the device
    /// (`initial_host_bytes`).
    pub init_bytes: u64,
    /// The device's memory is the host's (the CUDA emulator): the device plan counts too.
    pub device_is_host: bool,
}

/// The stated constant of a process running `ranks` ranks: the peak RSS it may reach above
/// their plans.
pub fn rss_overhead(ranks: u64) -> u64 {
    RSS_OVERHEAD + RSS_PER_RANK * ranks.saturating_sub(1)
}

const MIB: f64 = (1u64 << 20) as f64;
const GIB: f64 = (1u64 << 30) as f64;

/// Bytes this process can still be given: the smaller of the kernel's estimate of available
/// memory (`MemAvailable`) and what the cgroup's limit leaves (cgroup v2 `memory.max` −
/// `memory.current`, or v1's `limit_in_bytes` − `usage_in_bytes`). `None` where neither can be
/// read (not Linux). `FERROTRON_HOST_MEMORY` (bytes) overrides it, for tests and for a budget
/// below the machine's.
pub fn available() -> Option<u64> {
    if let Some(v) = std::env::var("FERROTRON_HOST_MEMORY")
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        return Some(v);
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    });
    let read = |p: &str| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let cgroup = match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => match (
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
            read("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        ) {
            // v1 reports "no limit" as a huge number, which `min` leaves alone.
            (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
            _ => None,
        },
    };
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Refuses a run whose plan, for the `ranks_here` ranks this process (or node) runs, does not
/// fit [`available`] memory; names the planner's fixes that keep the rank count.
pub fn check(spec: &ModelSpec, c: &TrainConfig, ranks_here: u64) -> Result<()> {
    device_budget(spec, c)?;
    let Some(avail) = available() else {
        return Ok(());
    };
    let input = crate::setup::plan_input(spec, c, 0);
    // A configuration the planner refuses is left to the trainer's own checks, which name
    // the setting in the trainer's words.
    let Ok(plan) = ferrotron_plan::planner::plan(&input) else {
        return Ok(());
    };
    // The ranks of this process are every stage's alike (the grid puts world/pp ranks on each
    // stage); with one rank kind, all of them are it.
    let kinds = plan.ranks.len() as u64;
    let per_kind = (ranks_here / kinds).max(1);
    // `--async-checkpoint` stages a rank's blocks, at most the weights and optimizer states it
    // holds (the trainer plans the exact size once its blocks are known).
    let staging = |r: &ferrotron_plan::planner::RankPlan| match c.checkpoint.background {
        true => r.at_peak.params + r.at_peak.master + r.at_peak.optimizer,
        false => 0,
    };
    // Offloaded optimizer states are host memory too (`MemoryPlan::host_bytes`).
    let peak = |r: &ferrotron_plan::planner::RankPlan| r.peak + staging(r) + r.plan.host_bytes;
    // Ranks as threads share one process; under mpirun each is a process of its own.
    let overhead = match ferrotron_dist::launched_by_mpirun() {
        true => RSS_OVERHEAD * ranks_here.max(1),
        false => rss_overhead(ranks_here),
    };
    let need: u64 = plan.ranks.iter().map(|r| peak(r) * per_kind).sum::<u64>() + overhead;
    if need <= avail {
        return Ok(());
    }
    let most = peak(&plan.ranks[plan.most_loaded]);
    // The fixes are planned for one rank with this machine's share per rank.
    let share = avail.saturating_sub(overhead) / ranks_here.max(1);
    let mut machine = gpu("h100").map_err(|e| anyhow::anyhow!("{e}"))?;
    machine.name = "this machine".into();
    // The staging buffer goes with every fix alike: the fixes must fit beside it.
    machine.capacity = share.saturating_sub(staging(&plan.ranks[plan.most_loaded]));
    let v = ferrotron_plan::verdict::verdict(&input, most, &machine, None)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let fixes: Vec<String> = v
        .options
        .iter()
        .filter(|o| !o.adds_gpus && !o.flags.contains("offload"))
        .take(4)
        .map(|o| {
            format!(
                "{} ({:.1} GiB{})",
                o.flags,
                o.peak as f64 / GIB,
                if o.fits { ", fits" } else { "" }
            )
        })
        .collect();
    let fixes = match fixes.is_empty() {
        true => "a smaller model or a machine with more memory".to_string(),
        false => fixes.join("; "),
    };
    let ranks = match ranks_here {
        1 => String::new(),
        n => format!(" for {n} ranks"),
    };
    bail!(
        "the plan needs {:.0} MiB{ranks} (peak {:.0} MiB per rank + {:.0} MiB for the process's own memory) but this machine can give {:.0} MiB: nothing was allocated; try {fixes}",
        need as f64 / MIB,
        most as f64 / MIB,
        overhead as f64 / MIB,
        avail as f64 / MIB
    )
}

/// Refuses a GPU run whose offload tiers, for the `ranks_here` ranks this machine runs, do not
/// fit the host memory left ([`available`]) with CUDA's libraries ([`GPU_RSS_OVERHEAD`]),
/// before anything is allocated: a GPU's plan is its own memory, but Llama-3.2-1B's
/// `--offload optimizer` tier is 22 GB of the host's. The initial weights' host buffers come
/// before the tier and are smaller (4 to 6 bytes a weight against its 12 to 18), so the tier
/// alone decides; with `--offload-dir` the host holds only the buckets in flight.
pub fn device_host_fit(spec: &ModelSpec, c: &TrainConfig, ranks_here: u64) -> Result<()> {
    if c.parallel.offload == ferrotron_plan::Offload::None || c.runtime.offload_dir.is_some() {
        return Ok(());
    }
    let Some(avail) = available() else {
        return Ok(());
    };
    let input = crate::setup::plan_input(spec, c, 0);
    let Ok(plan) = ferrotron_plan::planner::plan(&input) else {
        return Ok(());
    };
    let per_kind = (ranks_here / plan.ranks.len() as u64).max(1);
    let tiers: u64 = plan
        .ranks
        .iter()
        .map(|r| r.plan.host_bytes * per_kind)
        .sum();
    let need = tiers + GPU_RSS_OVERHEAD;
    if need <= avail {
        return Ok(());
    }
    let ranks = match ranks_here {
        1 => String::new(),
        n => format!(" for {n} ranks"),
    };
    bail!(
        "offload = {}: the host tier needs {:.0} MiB{ranks} (+ {:.0} MiB for CUDA's libraries) but this machine can give {:.0} MiB: nothing was allocated; try --offload-dir PATH (the tier on disk, host memory for the buckets in flight), or fewer ranks on this machine",
        c.parallel.offload,
        tiers as f64 / MIB,
        GPU_RSS_OVERHEAD as f64 / MIB,
        avail as f64 / MIB
    )
}

/// The card whose memory the fixes of a device budget are planned and timed on: an H100's
/// compute and links (the planner's table), `budget` bytes of memory.
const BUDGET_CARD: &str = "h100";

/// Refuses a plan whose most loaded rank needs more than `--device-memory` GiB, naming the
/// planner's fixes that keep the GPUs (offload, recompute, a smaller micro-batch, …) with their
/// predicted peak and step time (on an H100 with that much memory).
pub fn device_budget(spec: &ModelSpec, c: &TrainConfig) -> Result<()> {
    if c.runtime.device_memory.is_none() {
        return Ok(());
    }
    let input = crate::setup::plan_input(spec, c, 0);
    // A configuration the planner refuses is left to the trainer's own checks.
    let Ok(plan) = ferrotron_plan::planner::plan(&input) else {
        return Ok(());
    };
    let rank = plan.most_loaded;
    over_budget(spec, c, plan.ranks[rank].peak, rank, 0)
}

/// Refuses `peak` bytes on `rank` when they exceed `--device-memory`, with the same-GPU fixes
/// planned with `workspace` bytes of kernel workspace.
/// Checked twice: by [`device_budget`] before any device is opened, from a plan without the
/// GPU's own workspace (not known yet), then by each rank's plan once it is (cuBLASLt's 32 MiB
/// and the backend's scratch; found by the CUDA emulator, where a small model's plan that
/// the first check passed ran 6 MiB over its budget). Both count the planner's peak, which on a
/// device holds the communication buffers that a GPU keeps in host memory
/// (`trainer/memory_report.rs::on_device`): a budget refused a few buckets early, never late.
pub fn over_budget(
    spec: &ModelSpec,
    c: &TrainConfig,
    peak: u64,
    rank: usize,
    workspace: u64,
) -> Result<()> {
    let Some(gib) = c.runtime.device_memory else {
        return Ok(());
    };
    let budget = (gib * GIB) as u64;
    if peak <= budget {
        return Ok(());
    }
    let input = crate::setup::plan_input(spec, c, workspace);
    let (card, fixes) = same_gpu_fixes(&input, peak, budget, &format!("{gib} GiB"))?;
    bail!(
        "device_memory = {gib}: the plan's peak is {:.2} GiB on rank {rank} (more than {gib} GiB): nothing was allocated; same-GPU fixes (times predicted on {card}): {fixes}",
        peak as f64 / GIB,
    )
}

/// Refuses a plan whose ranks do not fit the memory free on their GPU now (`free` bytes on
/// each of `gpus` GPUs, the smallest, by the driver's count: `device::free_memory`), before
/// any rank allocates: the `ranks_here` ranks of this process (or node) share the GPUs round
/// robin, each GPU holding up to ⌈ranks/gpus⌉ of them, counted at the most loaded rank's
/// planned peak. Without this check a plan too large for the card failed at an allocation in
/// the middle of the start, with part of it made.
pub fn device_fit(
    spec: &ModelSpec,
    c: &TrainConfig,
    ranks_here: u64,
    (free, gpus): (u64, usize),
) -> Result<()> {
    let input = crate::setup::plan_input(spec, c, 0);
    let Ok(plan) = ferrotron_plan::planner::plan(&input) else {
        return Ok(());
    };
    let per_gpu = ranks_here.div_ceil(gpus.max(1) as u64).max(1);
    let most = plan.ranks[plan.most_loaded].peak;
    let need = most * per_gpu;
    if need <= free {
        return Ok(());
    }
    let label = format!("{:.2} GiB free", free as f64 / GIB);
    let (card, fixes) = same_gpu_fixes(&input, most, free / per_gpu, &label)?;
    let ranks = match per_gpu {
        1 => String::new(),
        n => format!(" × {n} ranks on it"),
    };
    bail!(
        "device: the plan needs {:.2} GiB on a GPU (peak {:.2} GiB on rank {}{ranks}) but {:.2} GiB is free there: nothing was allocated; same-GPU fixes (times predicted on {card}): {fixes}",
        need as f64 / GIB,
        most as f64 / GIB,
        plan.most_loaded,
        free as f64 / GIB,
    )
}

/// The planner's fixes that keep the GPUs (offload, recompute, a smaller micro-batch, …) for a
/// plan whose most loaded rank needs `most` bytes where `budget` are there, each with its
/// predicted peak and step time on an H100's compute with `budget` bytes of memory (named
/// `label`); with that card's name.
fn same_gpu_fixes(
    input: &ferrotron_plan::planner::PlanInput,
    most: u64,
    budget: u64,
    label: &str,
) -> Result<(String, String)> {
    let anyhow = |e: ferrotron_plan::error::PlanError| anyhow::anyhow!("{e}");
    let mut card = gpu(BUDGET_CARD).map_err(anyhow)?;
    card.name = format!("a {label} {}", card.name);
    card.capacity = budget;
    let cluster = ferrotron_plan::cluster::Cluster::of(card.clone(), 8).map_err(anyhow)?;
    let timing = ferrotron_plan::verdict::Timing {
        cluster: &cluster,
        flops: ferrotron_plan::flops::FlopsConvention::Ferrotron,
    };
    let v = ferrotron_plan::verdict::verdict(input, most, &card, Some(timing)).map_err(anyhow)?;
    let fixes: Vec<String> = v
        .options
        .iter()
        .filter(|o| !o.adds_gpus)
        .take(5)
        .map(|o| {
            let time = o
                .step_s
                .map(|t| format!(", {t:.3} s/step"))
                .unwrap_or_default();
            let fits = if o.fits { ", fits" } else { "" };
            format!(
                "{} (peak {:.2} GiB{time}{fits})",
                o.flags,
                o.peak as f64 / GIB
            )
        })
        .collect();
    let fixes = match fixes.is_empty() {
        true => "none on the same GPUs: add GPUs, or a card with more memory".to_string(),
        false => fixes.join("; "),
    };
    Ok((card.name, fixes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainArgs;

    fn run(model: &str, gib: Option<f64>) -> (ModelSpec, TrainConfig) {
        let c = TrainArgs {
            model: Some(model.into()),
            device_memory: gib,
            ..Default::default()
        }
        .resolve()
        .unwrap();
        (ferrotron_plan::presets::resolve(model).unwrap(), c)
    }

    #[test]
    fn ranks_sharing_a_gpu_need_their_plans_together_and_round_robin_spreads_them() {
        let (spec, c) = run("llama-3.2-1b", None);
        let plan = ferrotron_plan::planner::plan(&crate::setup::plan_input(&spec, &c, 0)).unwrap();
        let peak = plan.ranks[plan.most_loaded].peak;
        // One rank: its own peak fits exactly.
        device_fit(&spec, &c, 1, (peak, 1)).unwrap();
        // Two ranks on one GPU need twice; on two GPUs, one each.
        let msg = device_fit(&spec, &c, 2, (2 * peak - 1, 1))
            .unwrap_err()
            .to_string();
        let head = format!(
            "device: the plan needs {:.2} GiB on a GPU (peak {:.2} GiB on rank 0 × 2 ranks on it) but {:.2} GiB is free there: nothing was allocated; same-GPU fixes",
            (2 * peak) as f64 / GIB,
            peak as f64 / GIB,
            (2 * peak - 1) as f64 / GIB
        );
        assert!(msg.starts_with(&head), "{msg}");
        device_fit(&spec, &c, 2, (peak, 2)).unwrap();
        // Three ranks on two GPUs: one of them holds two.
        assert!(device_fit(&spec, &c, 3, (peak, 2)).is_err());
    }

    #[test]
    fn a_device_budget_below_the_plan_is_refused_with_same_gpu_fixes() {
        let (spec, c) = run("llama-3.2-1b", Some(16.0));
        let plan = ferrotron_plan::planner::plan(&crate::setup::plan_input(&spec, &c, 0)).unwrap();
        let peak = plan.ranks[plan.most_loaded].peak as f64 / GIB;
        let msg = device_budget(&spec, &c).unwrap_err().to_string();
        let head = format!(
            "device_memory = 16: the plan's peak is {peak:.2} GiB on rank 0 (more than 16 GiB): nothing was allocated; same-GPU fixes (times predicted on a 16 GiB h100): "
        );
        let fixes = msg.strip_prefix(&head).unwrap_or_else(|| panic!("{msg}"));
        // Each fix: `flags (peak P GiB, T s/step[, fits])`, below the plan's peak, timed.
        let mut fitting = Vec::new();
        for f in fixes.split("; ") {
            let (flags, rest) = f.split_once(" (peak ").unwrap_or_else(|| panic!("{f}"));
            let (p, rest) = rest.split_once(" GiB, ").unwrap();
            let p: f64 = p.parse().unwrap();
            assert!(p < peak, "{f}: not below the plan's {peak:.2} GiB");
            assert!(rest.contains(" s/step"), "{f}: no predicted time");
            assert_eq!(rest.ends_with(", fits)"), p <= 16.0, "{f}");
            if p <= 16.0 {
                fitting.push(flags);
            }
        }
        // A 1.24B-parameter model in fp32 with AdamW: 16 bytes per parameter of weights,
        // gradients and moments (18.4 GiB) before activations; moving the 8 bytes of moments to
        // the host is what fits 16 GiB.
        assert!(fitting.contains(&"--offload optimizer"), "{msg}");
        assert!(fixes.contains("--recompute full (peak "), "{msg}");
        // Just above the peak, and without a budget, the run goes on.
        let (spec, c) = run("llama-3.2-1b", Some(peak + 0.01));
        device_budget(&spec, &c).unwrap();
        let (spec, c) = run("llama-3.2-1b", None);
        device_budget(&spec, &c).unwrap();
    }

    #[test]
    fn a_device_budget_must_be_positive() {
        for bad in [0.0, -2.0, f64::NAN] {
            let e = TrainArgs {
                device_memory: Some(bad),
                ..Default::default()
            }
            .resolve()
            .unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("device_memory = {bad}: must be a positive number")
            );
        }
    }
}
