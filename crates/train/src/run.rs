//! `ferrotron train`: the whole run, from flags to a trained (and optionally sampled) model.

use crate::checkpoint;
use crate::config::CommBackend;
use crate::config::{TrainArgs, TrainConfig};
use crate::data::{Loader, LoaderConfig, Tokenizer, ValLoader};
use crate::fit::DeviceHost;
use crate::memory::timeline;
use crate::observe::metrics::{matmul_peak_gflops, peak_rss, MetricsWriter, StepMetrics};
use crate::observe::trace;
use crate::sample::{generate, SampleOptions};
use crate::setup;
use crate::trainer::{Comms, StepOutput, Trainer};
use anyhow::{bail, Context, Result};
use ferrotron_dist::group::Group;
use ferrotron_dist::Dim;
use ferrotron_engine::kernels::SeqPart;
use ferrotron_plan::Precision;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

mod layout_checks;
mod rank;

const MIB: f64 = (1u64 << 20) as f64;

/// What a finished run reports (also used by tests).
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: Vec<StepMetrics>,
    pub planned_peak: u64,
    pub measured_peak: u64,
    pub sample: Option<String>,
    /// The checkpoint given to `--resume` had already reached the run's last step: nothing was
    /// trained (a requeued job rerunning its command ends here, successfully).
    pub already_complete: bool,
}

/// Settings a resumed run may change; everything else comes from the checkpoint.
fn resume_config(args: &TrainArgs, saved: &TrainConfig) -> Result<TrainConfig> {
    let mut c = saved.clone();
    if let Some(m) = &args.model {
        if m != &saved.model.name {
            // Names may differ while the architecture is the same; compare what matters.
            let a = ferrotron_plan::presets::resolve(m).map_err(|e| anyhow::anyhow!("{e}"))?;
            let b = ferrotron_plan::presets::resolve(&saved.model.name)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if setup::llama_config(&a)? != setup::llama_config(&b)? {
                bail!(
                    "model = {m}: the checkpoint was trained as `{}`, a different architecture",
                    saved.model.name
                );
            }
        }
    }
    for (flag, given, saved_v) in [
        ("seq", args.seq, saved.data.seq),
        ("seed", args.seed, saved.data.seed),
    ] {
        if let Some(g) = given {
            if g != saved_v {
                bail!("{flag} = {g}: the checkpoint was trained with {flag} = {saved_v}; a resumed run keeps it");
            }
        }
    }
    // `--steps` on resume is the new total and the schedule decays over it, as it would in one
    // run of that many steps (unless the first run fixed the decay length with --decay-steps).
    if let Some(s) = args.steps {
        if saved.optimizer.decay_steps == saved.optimizer.steps {
            c.optimizer.decay_steps = s;
        }
        c.optimizer.steps = s;
    }
    if let Some(d) = args.decay_steps {
        c.optimizer.decay_steps = d;
    }
    c.optimizer.stop_after = args.stop_after;
    // The layout stays the checkpoint's except where the flags change it (`--zero 3` alone
    // keeps its dp; the checkpoint holds every parameter's states, so it re-shards); the
    // micro-batch size and accumulation may change with it, as long as every step still
    // trains on the same sequences.
    let saved_layout = ferrotron_plan::LayoutFlags::from(&saved.parallel);
    c.parallel = crate::config::trainable_layout(&args.layout.clone().or(saved_layout))?;
    c.data.mbs = args.mbs.unwrap_or(c.data.mbs);
    c.data.grad_acc = args.grad_acc.unwrap_or(c.data.grad_acc);
    // Every dp × ep rank is a replica training its own sequences (the cp ranks of a replica
    // share them).
    let per_step = |c: &TrainConfig| {
        c.data.mbs * c.data.grad_acc * c.parallel.dense_replicas() / c.parallel.cp
    };
    let replicas = |c: &TrainConfig, eq: &str| match c.parallel.ep {
        1 => format!("dp{eq}{}", c.parallel.dp),
        ep => format!("dp{eq}{} × ep{eq}{ep}", c.parallel.dp),
    };
    if per_step(&c) != per_step(saved) {
        bail!(
            "mbs = {}: with grad_acc = {} and {} a step trains {} sequences, the checkpoint's {} (mbs {} × grad_acc {} × {}); a resumed run keeps the sequences per step",
            c.data.mbs,
            c.data.grad_acc,
            replicas(&c, " = "),
            per_step(&c),
            per_step(saved),
            saved.data.mbs,
            saved.data.grad_acc,
            replicas(saved, " ")
        );
    }
    if let Some(v) = args.threads {
        c.runtime.threads = v;
    }
    c.runtime.offload_dir = args.offload_dir.clone();
    if let Some(v) = args.eval_interval {
        c.observability.eval_interval = v;
    }
    if let Some(v) = &args.out_dir {
        c.observability.out_dir = v.clone();
        c.observability.metrics = v.join("metrics.jsonl");
    }
    // The memory timeline compares steps 1 and 2 with the plan: a resumed run has neither.
    c.observability.memory_timeline = None;
    if let Some(v) = &args.trace {
        c.observability.trace = Some(v.clone());
    }
    if let Some(v) = args.trace_steps {
        c.observability.trace_steps = v;
    }
    if let Some(v) = &args.metrics {
        c.observability.metrics = v.clone();
    }
    if let Some(v) = &args.checkpoint_dir {
        c.checkpoint.dir = Some(v.clone());
    }
    if let Some(v) = args.checkpoint_interval {
        c.checkpoint.interval = v;
    }
    if let Some(v) = args.keep_checkpoints {
        c.checkpoint.keep = Some(v);
    }
    if let Some(v) = args.comm_timeout {
        c.runtime.comm_timeout = v;
    }
    if let Some(v) = args.max_skipped_steps {
        c.runtime.max_skipped_steps = v;
    }
    if let Some(v) = args.sample_tokens {
        c.observability.sample_tokens = v;
    }
    // Recomputation changes memory and time, not the numbers: a resumed run may change it.
    if let Some(v) = &args.recompute {
        c.runtime.recompute = v.parse().map_err(|_| {
            anyhow::anyhow!("recompute = {v}: expected one of none, selective, full")
        })?;
    }
    // CUDA graphs are this process's choice, as its device is: not the checkpoint's.
    c.runtime.cuda_graph = args.cuda_graph.unwrap_or(false);
    if c.runtime.cuda_graph {
        crate::trainer::cuda_graph::check_run(args.device, &c.parallel)
            .map_err(|e| anyhow::anyhow!("cuda_graph = true: {e}"))?;
    }
    Ok(c)
}

/// Says so when a resumed run's learning-rate schedule differs from the one its first
/// `from` steps were trained with (before that point the two agree, and the run equals one
/// uninterrupted run of the new length).
fn schedule_change(saved: &TrainConfig, now: &TrainConfig, from: u64) {
    let lr = |c: &TrainConfig| crate::optim::lr::LrSchedule::of(c);
    let (old, new) = (lr(saved), lr(now));
    if old != new && (0..from).any(|s| old.at(s) != new.at(s)) {
        eprintln!(
            "schedule changed: the learning rate now decays over {} steps (the checkpoint's first {from} steps used {}); from step {} on it follows the new schedule",
            now.optimizer.decay_steps,
            saved.optimizer.decay_steps,
            from + 1
        );
    }
}

fn print_config(c: &TrainConfig) {
    eprintln!("effective config:");
    if let Ok(serde_json::Value::Object(map)) = serde_json::to_value(c) {
        for (k, v) in map {
            eprintln!("  {k:<20} {v}");
        }
    }
}

fn fmt_eta(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    format!("{}m{:02}s", s / 60, s % 60)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// This process's part in a data-parallel run.
pub struct RankCtx {
    pub rank: usize,
    pub comm: Box<dyn ferrotron_dist::Communicator>,
    /// This rank's share of the machine's matmul peak, when it was measured before the ranks
    /// started (ranks as threads, each computing on its share of the cores); `None`: a process
    /// of its own, which measures its peak itself.
    pub peak_gflops: Option<f64>,
}

/// Whether the run's products are bf16 (its matmul peak is the bf16 one).
fn bf16_products(c: &TrainConfig) -> bool {
    matches!(c.precision.kind, Precision::Bf16 | Precision::Bf16Fp32grads)
}

/// `ferrotron train`: one rank, or with `--dp N` N ranks as threads of this process (the
/// threads backend), each training its slice of every global batch; rank 0 writes the outputs.
pub fn run(args: TrainArgs) -> Result<RunSummary> {
    run_observed(args, None)
}

/// An edge of one rank's optimizer step, as a [`StepHook`] sees it: `step` is the step's
/// number (1 for the first), `done` false just before `Trainer::train_step` and true just
/// after it returned.
#[derive(Debug, Clone, Copy)]
pub struct StepEdge {
    pub rank: usize,
    pub step: u64,
    pub done: bool,
}

/// Called on each rank's own thread at both edges of each of its steps: what a test of the
/// step needs to look at that thread's work alone (`tests/step_hot_path.rs` counts the heap
/// allocations a step makes).
pub type StepHook = std::sync::Arc<dyn Fn(StepEdge) + Send + Sync>;

/// `t`'s next step, with `hook` called at both of its edges.
fn observed_step(t: &mut Trainer, hook: Option<&StepHook>, rank: usize) -> Result<StepOutput> {
    let step = t.step + 1;
    let edge = |done| {
        if let Some(h) = hook {
            h(StepEdge { rank, step, done })
        }
    };
    edge(false);
    let out = t.train_step();
    edge(true);
    out
}

/// [`run`], calling `hook` around every rank's every step.
pub fn run_observed(args: TrainArgs, hook: Option<StepHook>) -> Result<RunSummary> {
    ferrotron_engine::kernels::cpu::gemm_select::check_env().map_err(anyhow::Error::msg)?;
    crate::memory::heap::keep_library_blocks();
    // The `--config` file is read once, here; the ranks get the merged flags.
    let args = args.merged().map_err(anyhow::Error::msg)?;
    let args = crate::pp_auto::resolve(args)?;
    // A resumed run keeps the checkpoint's layout unless the flags give one.
    // The checkpoint is read before any rank starts, so a bad one fails once.
    if let (Some(_), Some(d)) = (&args.resume, &args.init_from) {
        bail!(
            "init_from = {}: a resumed run takes its weights from the checkpoint; pass --resume or --init-from, not both",
            d.display()
        );
    }
    let saved = args.resume.as_deref().map(checkpoint::open).transpose()?;
    if let Some(l) = &saved {
        if let Some(done) = already_complete(&args, l)? {
            return Ok(done);
        }
    }
    let layout = match &saved {
        Some(l) => resume_config(&args, &l.state.config)?.parallel,
        None => crate::config::trainable_layout(&args.layout)?,
    };
    // Every rank of the grid: pipeline stages of data-parallel replicas of tensor-parallel
    // groups.
    let (dp, world) = (
        layout.dp as usize,
        (layout.dp * layout.tp * layout.pp * layout.cp * layout.ep) as usize,
    );
    crate::device::check(args.device)?;
    crate::optim::offload::check_args(&args, &layout, world)?;
    layout_checks::check_layout(&args, saved.as_ref(), &layout, world)?;
    if use_mpi(args.comm.unwrap_or(CommBackend::Auto), dp)? {
        #[cfg(feature = "mpi")]
        return run_mpi(args, saved, &layout, hook.as_ref());
    }
    if world <= 1 {
        return run_rank(args, saved, None, hook.as_ref());
    }
    let results = run_threads(args, saved, world, hook)?;
    let mut summary = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) if rank == 0 => summary = Some(s),
            Ok(_) => {}
            Err(e) => bail!("rank {rank}: {e}"),
        }
    }
    summary.context("rank 0 returned nothing")
}

/// The run as `world` ranks on threads of this process, each on its share of the cores and of
/// the machine's matmul peak (measured once, on every thread), so MFU is against the
/// machine's peak.
fn run_threads(
    args: TrainArgs,
    saved: Option<checkpoint::Loaded>,
    world: usize,
    hook: Option<StepHook>,
) -> Result<Vec<Result<RunSummary, String>>> {
    // The ranks share this machine's cores: each computes on its share of the threads and has
    // its share of the machine's matmul peak (measured once, on every thread), so MFU is
    // against the machine's peak.
    let cfg = layout_checks::config_of(&args, saved.as_ref())?;
    let threads = cfg.runtime.threads as usize;
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .ok();
    // On a GPU each rank's peak is its GPU's, from the planner's table (`Trainer::new`), not a
    // share of the CPU's (which made dp 2 on one H200 report an MFU of 272%): none measured.
    let cuda = args.device == crate::device::Device::Cuda;
    let peak = match (args.peak_gflops, cuda) {
        (Some(p), _) => Some(p),
        (None, true) => None,
        (None, false) => Some(matmul_peak_gflops(bf16_products(&cfg))),
    };
    let per_rank = (threads / world).max(1);
    // A rank stuck alive is caught by the watchdog, which ends the process; the threads
    // backend's own deadline (a wait that returns an error) comes later, as a backstop.
    let timeout = Duration::from_secs_f64(cfg.runtime.comm_timeout);
    ferrotron_dist::watchdog::start(timeout, ferrotron_dist::watchdog::exit_process);
    let backstop = timeout + Duration::from_secs(30);
    // Each rank's thread and its communicator's worker charge what they allocate to the rank.
    let tag = |rank| crate::memory::alloc::set_rank(Some(rank));
    let results = ferrotron_dist::threads::run_tagged(world, backstop, tag, move |rank, comm| {
        let ctx = RankCtx {
            rank,
            comm: Box::new(ferrotron_dist::Watched::new(Box::new(comm), "world", rank)),
            peak_gflops: peak.map(|p| p / world as f64),
        };
        // Each rank computes on a pool of its own share of the threads, tagged as the rank's:
        // its kernels neither crowd the other ranks' nor charge memory to them.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(per_rank)
            .thread_name(move |i| format!("rank {rank} worker {i}"))
            .start_handler(move |_| crate::memory::alloc::set_rank(Some(rank)))
            .build()
            .map_err(|e| format!("rank {rank}: thread pool: {e}"))?;
        let saved = saved.clone();
        let hook = hook.as_ref();
        pool.install(|| {
            run_rank(args.clone(), saved, Some(ctx), hook).map_err(|e| format!("{e:#}"))
        })
    });
    Ok(results)
}

/// A resumed run whose checkpoint already reached the run's last step (`--steps`, or
/// `--stop-after`): a scheduler that requeues a finished job reruns its command, which must
/// succeed. Says so in one line (once per job: rank 0 of an `mpirun`) and trains nothing.
fn already_complete(args: &TrainArgs, l: &checkpoint::Loaded) -> Result<Option<RunSummary>> {
    let cfg = resume_config(args, &l.state.config)?;
    let last = cfg.optimizer.last_step();
    if l.state.step < last {
        return Ok(None);
    }
    if ferrotron_dist::launch::world_rank_from_env().unwrap_or(0) == 0 {
        let part = match cfg.optimizer.stop_after {
            Some(n) if n < cfg.optimizer.steps => format!(
                " (--stop-after {n} of --steps {}; raise --stop-after to train the next part)",
                cfg.optimizer.steps
            ),
            _ => format!(
                " of --steps {} (pass a larger --steps to train further)",
                cfg.optimizer.steps
            ),
        };
        eprintln!(
            "run complete: checkpoint {} is at step {}{part}; nothing to do",
            l.dir.display(),
            l.state.step
        );
    }
    Ok(Some(RunSummary {
        steps: Vec::new(),
        planned_peak: 0,
        measured_peak: 0,
        sample: None,
        already_complete: true,
    }))
}

/// Whether this process is one rank of an MPI job, or why `--comm` cannot be: MPI needs the
/// `mpi` build and a launcher; threads run in one process (under mpirun, each process would
/// train alone).
fn use_mpi(comm: CommBackend, dp: usize) -> Result<bool> {
    let launched = ferrotron_dist::launched_by_mpirun();
    let built = cfg!(feature = "mpi");
    match comm {
        CommBackend::Mpi | CommBackend::Auto if launched && !built => bail!(
            "comm = mpi: mpirun started this ferrotron, which was built without MPI; build it with `cargo build --release -p ferrotron --features mpi`"
        ),
        CommBackend::Mpi if !built => bail!(
            "comm = mpi: this ferrotron was built without MPI; build it with `cargo build --release -p ferrotron --features mpi`, then run `mpirun -np {dp} ferrotron train --dp {dp}` (or use --comm threads)"
        ),
        CommBackend::Mpi if !launched => bail!(
            "comm = mpi: not started by mpirun or srun; run `mpirun -np {dp} ferrotron train --dp {dp}`, or --comm threads"
        ),
        CommBackend::Threads if launched => bail!(
            "comm = threads: mpirun started this process; run `ferrotron train --dp {dp}` without mpirun for ranks as threads, or --comm mpi"
        ),
        CommBackend::Threads => Ok(false),
        CommBackend::Mpi | CommBackend::Auto => Ok(launched),
    }
}

/// This process as one rank of an `mpirun` job: the world must be the layout's ranks. A rank
/// that fails returns its error without finalising MPI, which aborts the job naming the rank
/// (`ferrotron_dist::mpi`).
#[cfg(feature = "mpi")]
fn run_mpi(
    args: TrainArgs,
    saved: Option<checkpoint::Loaded>,
    layout: &ferrotron_plan::Layout,
    hook: Option<&StepHook>,
) -> Result<RunSummary> {
    use ferrotron_dist::Communicator;
    let comm = ferrotron_dist::mpi::MpiComm::world().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (rank, size) = (comm.rank(), comm.size());
    let (dp, tp, pp, cp, ep) = (
        layout.dp as usize,
        layout.tp as usize,
        layout.pp as usize,
        layout.cp as usize,
        layout.ep as usize,
    );
    let world = dp * tp * pp * cp * ep;
    if size != world && tp * pp * cp * ep == 1 {
        bail!("dp = {dp}: mpirun started {size} processes; pass --dp {size} (or mpirun -np {dp})");
    }
    if size != world && ep > 1 {
        bail!(
            "dp × ep × tp × pp = {dp} × {ep} × {tp} × {pp} = {world}: mpirun started {size} processes; run mpirun -np {world}"
        );
    }
    if size != world && cp > 1 {
        bail!(
            "dp × cp × tp = {dp} × {cp} × {tp} = {world}: mpirun started {size} processes; run mpirun -np {world}"
        );
    }
    if size != world {
        bail!(
            "dp × tp × pp = {dp} × {tp} × {pp} = {world}: mpirun started {size} processes; run mpirun -np {world}"
        );
    }
    let cfg = layout_checks::config_of(&args, saved.as_ref())?;
    // MPI has no deadline of its own: the watchdog's expiry is `MPI_Abort`, which mpirun
    // turns into the end of every process (a stopped one included).
    let timeout = std::time::Duration::from_secs_f64(cfg.runtime.comm_timeout);
    ferrotron_dist::watchdog::start(timeout, ferrotron_dist::mpi::abort_job);
    let ctx = (size > 1).then(|| RankCtx {
        rank,
        comm: Box::new(ferrotron_dist::Watched::new(Box::new(comm), "world", rank))
            as Box<dyn Communicator>,
        peak_gflops: None,
    });
    let summary = run_rank(args, saved, ctx, hook)?;
    ferrotron_dist::mpi::finalize().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(summary)
}

/// The groups of a rank whose model is split (tensor or pipeline parallelism) in the grid (tp
/// innermost, pp outermost, as the planner places them): its tensor-parallel group, its
/// pipeline (with, for tied embeddings, the group of the first and last stage), and its
/// data-parallel group. Every rank of the world calls it (the splits are collective).
fn model_groups(
    world: &dyn ferrotron_dist::Communicator,
    rank: usize,
    cfg: &TrainConfig,
    grid: &ferrotron_dist::Grid,
    tied: bool,
) -> Result<Comms> {
    let l = &cfg.parallel;
    let group = |d: Dim| {
        world
            .split_named(&grid.group(rank, d), d.name())
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let tp = match l.tp > 1 {
        true => Some(group(Dim::Tp)?),
        false => None,
    };
    let pp = match l.pp > 1 {
        true => Some(group(Dim::Pp)?),
        false => None,
    };
    // The first and last stage of the pipeline share a tied embedding (the two ends make the
    // group; the stages between take no part).
    let stage = grid.coord(rank, Dim::Pp);
    let end = stage == 0 || stage + 1 == l.pp as usize;
    let embedding = match l.pp > 1 && tied && end {
        true => {
            let stages = grid.group(rank, Dim::Pp);
            let ends = [stages[0], stages[stages.len() - 1]];
            Some(
                world
                    .split_named(&ends, "embedding")
                    .map_err(|e| anyhow::anyhow!("{e}"))?,
            )
        }
        false => None,
    };
    let split = |members: Vec<usize>, name: &str| {
        world
            .split_named(&members, name)
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let cp = match l.cp > 1 {
        true => Some(Rc::new(Group::new(group(Dim::Cp)?))),
        false => None,
    };
    let (dp, ep, dp_experts) = match l.ep > 1 {
        true => (
            Some(split(grid.group_of(rank, &[Dim::Dp, Dim::Ep]), "dp×ep")?),
            Some(Rc::new(Group::new(group(Dim::Ep)?))),
            match l.dp > 1 {
                true => Some(group(Dim::Dp)?),
                false => None,
            },
        ),
        // Under context parallelism the dp × cp ranks hold the same weights.
        false => (
            match l.dp * l.cp > 1 {
                true => Some(split(grid.group_of(rank, &[Dim::Dp, Dim::Cp]), "dp×cp")?),
                false => None,
            },
            None,
            None,
        ),
    };
    let tp = match tp {
        Some(t) => {
            let t = Group::new(t);
            t.warm_up("tensor-parallel")?;
            Some(Rc::new(t))
        }
        None => None,
    };
    let pp = match pp {
        Some(p) => {
            let mut p = ferrotron_dist::pipeline::Pipeline::new(p, l, cfg.data.grad_acc, embedding);
            p.warm_up()?;
            Some(p)
        }
        None => None,
    };
    // Every rank's groups have met before any rank measures its baseline.
    world.barrier().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Comms {
        tp,
        pp,
        dp,
        ep,
        dp_experts,
        cp,
        // The caller's (the groups were split from it).
        world: None,
    })
}

/// The training run of one rank (`ctx`: its data-parallel rank and communicator), from flags
/// already merged with their `--config` file, resuming from `loaded` (the checkpoint `run`
/// opened and verified once, before any rank started).
fn run_rank(
    args: TrainArgs,
    loaded: Option<checkpoint::Loaded>,
    ctx: Option<RankCtx>,
    hook: Option<&StepHook>,
) -> Result<RunSummary> {
    let rank = ctx.as_ref().map_or(0, |c| c.rank);
    // Only rank 0 speaks and writes.
    let quiet = args.quiet || rank > 0;
    let (cfg, sampling) = rank::config(&args, loaded.as_ref(), rank)?;
    let last_step = cfg.optimizer.last_step();
    let (tok, spec, llama, train, val) =
        rank::model_and_data(&cfg, loaded.as_ref(), rank, ctx.as_ref())?;
    // The rank's groups in the grid (tp innermost, as the planner places them): a tensor-
    // parallel group shares its batch, the data-parallel replicas split it.
    let grid = ferrotron_dist::Grid::new(&cfg.parallel);
    let l = &cfg.parallel;
    let comms = match ctx.as_ref().map(|c| c.comm.as_ref()) {
        Some(world) if l.tp > 1 || l.pp > 1 || l.ep > 1 || l.cp > 1 => Some(model_groups(
            world,
            rank,
            &cfg,
            &grid,
            llama.tie_embeddings,
        )?),
        _ => None,
    };
    let (loader, val) = rank::loaders(&cfg, loaded.as_ref(), rank, train, val)?;
    let peak_gflops = rank::peak_gflops(ctx.as_ref(), &args, &cfg);
    let tokenizer_json = tok
        .inner()
        .to_string(false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let comms = rank::with_world(ctx.map(|c| c.comm), comms);
    let mut t = Trainer::new(
        cfg.clone(),
        spec,
        llama,
        loader,
        val,
        comms,
        crate::device::Machine {
            device: args.device,
            peak_gflops,
            gpu: crate::device::gpu_of(args.device, rank)?,
            gpu_share: crate::device::ranks_on_gpu(args.device, rank, grid.world())?,
        },
    )?;
    rank::load_state(&mut t, loaded.as_ref(), &cfg, rank)?;
    // Initialised or loaded: the state goes to the device the step runs on.
    t.to_device()?;
    // --async-checkpoint: its staging buffer, in the plan, allocated before the first step.
    let mut background = cfg
        .checkpoint
        .background
        .then(|| checkpoint::background::Background::new(&mut t));
    // Files are written only once everything has been read and checked: a refused checkpoint
    // or config leaves the output directory as it was.
    let mut metrics = rank::metrics_writer(&cfg, rank, loaded.is_some())?;
    if rank == 0 {
        write_plan(&cfg, &t)?;
        rank::print_plan(&cfg, &t, peak_gflops);
    }

    let tty = std::io::stderr().is_terminal() && !quiet;
    let started = Instant::now();
    let first_step = t.step;
    let progress = rank::Progress {
        first_step,
        last_step,
        started,
        quiet,
        tty,
    };
    let mut steps = Vec::new();
    // Steps skipped in a row for a non-finite loss or gradient (fp32, bf16).
    let mut skipped_run = 0u64;
    while t.step < last_step {
        let mut out = observed_step(&mut t, hook, rank)?;
        if t.step == first_step + 1 {
            crate::observe::host_rss::mark("first step done");
        }
        let how = (rank, quiet, tty);
        rank::count_non_finite(&t, &out, &mut skipped_run, &cfg, how)?;
        let last = t.step == last_step;
        if cfg.observability.eval_interval > 0
            && (t.step % cfg.observability.eval_interval == 0 || last)
        {
            out.metrics.val_loss = t.evaluate()?;
        }
        if let Some(w) = &mut metrics {
            w.write(&out.metrics)?;
        }
        if let (Some(u), false) = (out.overflow, quiet) {
            rank::print_overflow(&u, t.step, tty);
        }
        rank::print_progress(&t, &out, &cfg, &progress);
        let (json, bg) = (&tokenizer_json, &mut background);
        rank::save_if_due(&mut t, &cfg, bg, last, json, &tok, rank, quiet)?;
        steps.push(out.metrics);
        finish_observability(&cfg, &mut t, false)?;
    }
    finish_observability(&cfg, &mut t, true)?;
    if let Some(b) = &mut background {
        b.wait()?;
    }
    if tty {
        eprintln!();
    }
    let at = (rank, peak_gflops, started);
    let (planned, measured) = rank::report_done(&args, &cfg, &t, &steps, at);
    let sample = rank::sample_text(&mut t, &cfg, &tok, sampling, rank)?;
    Ok(RunSummary {
        steps,
        planned_peak: planned,
        measured_peak: measured,
        sample,
        already_complete: false,
    })
}

/// The process's peak RSS against what it planned: the plans of the ranks it runs (every rank
/// of a threads run, its own under mpirun) and their offload tier's `host` bytes, plus the
/// stated constant of `fit::rss_overhead` for that many ranks. On a GPU the plan is the
/// device's memory, not the host's: the host's is the initial weights (until they move) and
/// the offload tier, with the CUDA libraries' constant (`fit::GPU_RSS_OVERHEAD`); the CUDA
/// emulator's device memory is host memory, so there both count.
fn rss_line(steps: &[StepMetrics], planned: u64, host: u64, device: Option<DeviceHost>) -> String {
    use crate::fit::{rss_overhead, EMULATOR_RSS_OVERHEAD, GPU_RSS_OVERHEAD, RSS_PER_RANK};
    let Some(rss) = peak_rss() else {
        return "peak RSS unknown on this system".into();
    };
    // Every rank of this process holds its own host tier (`--offload params --dp`: each
    // replica's whole model).
    let (plans, ranks) = match (ferrotron_dist::launched_by_mpirun(), steps.last()) {
        (false, Some(m)) if !m.rank_mem.is_empty() => (
            m.rank_mem.iter().map(|r| r.mem_peak_planned).sum(),
            m.rank_mem.len() as u64,
        ),
        _ => (planned, 1),
    };
    let more = RSS_PER_RANK * ranks.saturating_sub(1);
    let (what, here, overhead) = match device {
        None => ("plan", plans + host * ranks, rss_overhead(ranks)),
        Some(d) if !d.device_is_host => (
            "host plan",
            (host + d.init_bytes) * ranks,
            GPU_RSS_OVERHEAD + more,
        ),
        Some(d) => (
            "plan",
            plans + (host + d.init_bytes) * ranks,
            EMULATOR_RSS_OVERHEAD + more,
        ),
    };
    let bound = here + overhead;
    format!(
        "peak RSS {:.1} MiB = {what} {:.1} + {:.1} MiB, {} the bound of {what} + {:.0} MiB",
        rss as f64 / MIB,
        here as f64 / MIB,
        (rss as f64 - here as f64) / MIB,
        if rss <= bound { "within" } else { "OVER" },
        overhead as f64 / MIB
    )
}

/// `--init-from`: the weights of a model folder (its config.json is the run's model, checked
/// tensor by tensor), as the fp32 master copy under mixed precision and rounded into the
/// storage type.
fn init_weights(t: &mut Trainer, dir: &std::path::Path) -> Result<()> {
    let w = checkpoint::hf::load_widened(dir, &t.model.params, t.spec.tie_embeddings)?;
    let storage = t.params.dtype();
    t.set_weights(crate::weights::Flat::from_f32(storage, &w));
    if t.master.is_some() {
        t.set_master(w);
    }
    eprintln!(
        "initialised {} parameters from {}",
        t.model.num_params(),
        dir.display()
    );
    Ok(())
}

/// The memory plan of this run, for `ferrotron report` (written at start, so a run that fails
/// still leaves it).
fn write_plan(cfg: &TrainConfig, t: &Trainer) -> Result<()> {
    let p = cfg.observability.out_dir.join("plan.json");
    std::fs::create_dir_all(&cfg.observability.out_dir).with_context(|| {
        format!(
            "out_dir = {}: cannot create",
            cfg.observability.out_dir.display()
        )
    })?;
    let v = serde_json::json!({
        "model": cfg.model.name,
        "params": t.model.num_params(),
        "planned_peak_steps": [t.planned_peak_step(1), t.planned_peak_step(2)],
        "rank": t.plan,
        // `--offload optimizer`: the host tier, and the disk tier with `--offload-dir`.
        "offload": t.offload_plan(),
        // Where the per-step records went (`--metrics` may put them outside the run
        // directory): `ferrotron report` follows it.
        "metrics": std::path::absolute(&cfg.observability.metrics)
            .unwrap_or_else(|_| cfg.observability.metrics.clone()),
    });
    std::fs::write(&p, serde_json::to_string(&v)?)
        .with_context(|| format!("cannot write {}", p.display()))
}

/// Writes the memory timeline once its steps are recorded and the trace once its steps are done
/// (or whatever there is at the end of the run, `end`), so both exist early in a long run.
fn finish_observability(cfg: &TrainConfig, t: &mut Trainer, end: bool) -> Result<()> {
    if let Some(path) = &cfg.observability.memory_timeline {
        if t.timeline_complete() || end {
            if let Some(samples) = t.timeline_samples().filter(|s| !s.is_empty()) {
                let file = timeline::build(&cfg.model.name, &t.plan, t.baseline, samples)?;
                timeline::write(path, &file)?;
                eprintln!(
                    "memory timeline: {} points, measured vs planned within {:.2}% -> {}",
                    file.points.len(),
                    file.max_abs_deviation * 100.0,
                    path.display()
                );
            }
            t.disable_timeline();
        }
    }
    if let Some(path) = &cfg.observability.trace {
        if let Some(events) = t.finish_trace(end) {
            let ranks = (t.world_size() > 1).then(|| (t.world_rank(), t.world_size()));
            match ranks {
                None => trace::write_chrome(path, &events)?,
                // Several ranks: each leaves its events beside the file, and once all have (a
                // barrier), rank 0 writes one file with a process row per rank.
                Some((rank, ranks)) => {
                    let mine = trace::chrome_events(&events, Some(rank))?;
                    if rank > 0 {
                        let part = trace::rank_part(path, rank);
                        std::fs::write(&part, serde_json::to_vec(&mine)?)
                            .with_context(|| format!("trace = {}", part.display()))?;
                    }
                    t.barrier()?;
                    if rank == 0 {
                        let mut all = vec![mine];
                        for r in 1..ranks {
                            let part = trace::rank_part(path, r);
                            let text = std::fs::read(&part)
                                .with_context(|| format!("trace = {}", part.display()))?;
                            all.push(serde_json::from_slice(&text)?);
                            std::fs::remove_file(&part)?;
                        }
                        trace::write_merged(path, &all)?;
                    }
                }
            }
            match ranks.map(|r| r.0) {
                None => eprintln!("trace: {} events -> {}", events.len(), path.display()),
                Some(0) => eprintln!(
                    "trace: every rank's events, {} of rank 0 -> {}",
                    events.len(),
                    path.display()
                ),
                Some(_) => {}
            }
        }
    }
    Ok(())
}

/// `ferrotron data`: text, JSON Lines and Parquet files to token shards.
pub fn data(
    inputs: &[PathBuf],
    out: &std::path::Path,
    tokenizer: Option<&std::path::Path>,
    opts: &crate::data::BuildOptions,
) -> Result<()> {
    if inputs.is_empty() {
        bail!("no input files: pass files (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet) or directories of them");
    }
    let tok = Tokenizer::load(tokenizer)?;
    let summary = crate::data::build_shards_with(inputs, &tok, out, opts)?;
    print!("{summary}");
    Ok(())
}

/// `ferrotron sample`: continue a prompt from a checkpoint, each piece of text given to
/// `on_text` as it is generated.
pub fn sample_from(
    dir: &std::path::Path,
    prompt: &str,
    o: &SampleOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<String> {
    let m = crate::sample::SampleModel::open(dir)?;
    crate::sample::generate_streaming(&m.model, &m.weights, &m.tok, prompt, o, on_text)
}

/// Each dimension's bytes sent in the last step, against the plan (stderr).
fn comm_summary(m: &StepMetrics) {
    for (dim, c) in m.comm.iter() {
        let (what, by) = match dim {
            Dim::Dp => ("data parallel", "per rank"),
            Dim::Tp => ("tensor parallel", "per rank"),
            Dim::Cp => ("context parallel", "per rank around the ring"),
            // The plan assumes balanced routing; the exchanges follow the router.
            Dim::Ep => ("expert parallel", "by rank 0 in the token exchanges"),
            Dim::Pp => ("pipeline", "per rank"),
        };
        eprintln!(
            "{what}: {:.2} MB sent {by} in the last step, planned {:.2} MB",
            c.sent as f64 / 1e6,
            c.planned as f64 / 1e6
        );
    }
    if let Some(t) = m.host_transfer {
        let ms = |us: u64| us as f64 / 1e3;
        eprintln!(
            "offload: {:.2} MB host to device and {:.2} MB back in the last step, planned {:.2} and {:.2} MB; {}copies {:.1} ms ({:.2} GB/s), the optimizer step {:.1} ms with AdamW on the host {:.1} ms",
            t.up as f64 / 1e6,
            t.down as f64 / 1e6,
            t.planned_up as f64 / 1e6,
            t.planned_down as f64 / 1e6,
            match t.up_ahead {
                0 => String::new(),
                a => format!("{:.2} MB ahead on the copy stream, the host's ", a as f64 / 1e6),
            },
            ms(t.copy_us),
            (t.up + t.down - t.up_ahead) as f64 / (t.copy_us.max(1) as f64 * 1e3),
            ms(t.update_us),
            ms(t.host_adamw_us),
        );
    }
}
