//! A plan that cannot fit the machine is refused before anything is allocated.
//!
//! The plan is known before the first byte of the model exists, so the trainer compares it
//! with the memory this machine (or its cgroup) can give now, and refuses in one line with the
//! planner's own same-machine fixes and their predicted peaks, instead of dying on an
//! allocation halfway through its start (what a 58 GB plan on a 24 GiB machine did).
//!
//! What one process needs: the plans of the ranks it runs (all of them with the threads
//! backend; its own under `mpirun`, times the ranks on its node) plus [`RSS_OVERHEAD`], the
//! process's own memory besides the plan (binary, thread stacks, allocator slack; measured on
//! the default run, `docs/BENCHMARKS.md`).

use crate::config::TrainConfig;
use anyhow::{bail, Result};
use ferrotron_plan::cluster::gpu;
use ferrotron_plan::ModelSpec;

/// Resident memory of a trainer process beyond its planned peak: the binary and its
/// libraries, thread stacks, the allocator's free lists and pages, the bundled tokenizer and
/// the metrics buffers. Measured as peak RSS minus planned peak of the default run on one rank
/// and of 8-rank threads runs (`docs/BENCHMARKS.md`, "Peak RSS against the plan"), rounded up.
pub const RSS_OVERHEAD: u64 = 96 << 20;

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
    let peak = |r: &ferrotron_plan::planner::RankPlan| r.peak + staging(r);
    let need: u64 = plan.ranks.iter().map(|r| peak(r) * per_kind).sum::<u64>() + RSS_OVERHEAD;
    if need <= avail {
        return Ok(());
    }
    let most = peak(&plan.ranks[plan.most_loaded]);
    // The fixes are planned for one rank with this machine's share per rank.
    let share = avail.saturating_sub(RSS_OVERHEAD) / ranks_here.max(1);
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
        "the plan needs {:.0} MiB{ranks} (peak {:.0} MiB per rank + {:.0} MiB for the process) but this machine can give {:.0} MiB: nothing was allocated; try {fixes}",
        need as f64 / MIB,
        most as f64 / MIB,
        RSS_OVERHEAD as f64 / MIB,
        avail as f64 / MIB
    )
}
