//! The pieces of one rank's run (`run_rank`), each a step of it: its config, its model and
//! data, its loaders, the state it starts from, and what it prints about the plan, each
//! step, each checkpoint and the end.

use super::*;
use crate::checkpoint::background::Background;
use crate::data::TokenDataset;
use crate::trainer::StepOutput;

/// The run's config on this rank (a resumed run's from its checkpoint), and whether rank 0
/// samples at the end (every rank takes part in gathering the weights for it).
pub(super) fn config(
    args: &TrainArgs,
    loaded: Option<&checkpoint::Loaded>,
    rank: usize,
) -> Result<(TrainConfig, bool)> {
    if let (Some(_), Some(d)) = (&args.resume, &args.init_from) {
        bail!(
            "init_from = {}: a resumed run takes its weights from the checkpoint; pass --resume or --init-from, not both",
            d.display()
        );
    }
    let mut cfg = match loaded {
        Some(l) => resume_config(args, &l.state.config)?,
        None => args.resolve()?,
    };
    // Every rank takes part in gathering the weights for rank 0's sample (ZeRO-3 shards them).
    let sampling = cfg.observability.sample_tokens > 0;
    if rank > 0 {
        // Rank 0 writes the outputs (the other ranks' memory is reported in its `rank_mem`);
        // every rank records its trace, which rank 0 merges into one file, and writes its
        // blocks of each checkpoint.
        let o = &mut cfg.observability;
        (o.memory_timeline, o.sample_tokens) = (None, 0);
    }
    if let Some(l) = loaded {
        cfg.optimizer.check_stop_after(l.state.step)?;
        schedule_change(&l.state.config, &cfg, l.state.step);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(cfg.runtime.threads as usize)
        .build_global()
        .ok();
    if rank == 0 {
        print_config(&cfg);
    }
    Ok((cfg, sampling))
}

/// The tokenizer, the model and the token datasets (rank 0 tokenizes the bundled corpus if
/// it must; the others wait for it, then read it).
#[allow(clippy::type_complexity)]
pub(super) fn model_and_data(
    cfg: &TrainConfig,
    loaded: Option<&checkpoint::Loaded>,
    rank: usize,
    ctx: Option<&RankCtx>,
) -> Result<(
    Tokenizer,
    ferrotron_plan::ModelSpec,
    ferrotron_engine::model::LlamaConfig,
    TokenDataset,
    Option<TokenDataset>,
)> {
    let tok = match loaded {
        Some(l) => Tokenizer::from_file(l.dir.join("tokenizer.json"))?,
        None => Tokenizer::load(cfg.model.tokenizer.as_deref())?,
    };
    let (spec, llama) = setup::model(cfg, &tok)?;
    if let Some(l) = loaded {
        if setup::llama_config(&l.spec)? != llama {
            bail!(
                "checkpoint {}: its config.json does not match model {}",
                l.dir.display(),
                cfg.model.name
            );
        }
    }
    // Rank 0 tokenizes the bundled corpus if it must; the others wait for it, then read it.
    let barrier = || match ctx {
        Some(c) => c.comm.barrier().map_err(|e| anyhow::anyhow!("{e}")),
        None => Ok(()),
    };
    if rank > 0 {
        barrier()?;
    }
    let (train, val) = setup::datasets(cfg, &tok, spec.vocab as u32)?;
    if rank == 0 {
        barrier()?;
    }
    Ok((tok, spec, llama, train, val))
}

/// This rank's training and validation loaders: its data-parallel slice of every global
/// batch (under expert parallelism every dp × ep rank is a replica of the dense weights and
/// trains its own slice), its context-parallel share of each sequence.
pub(super) fn loaders(
    cfg: &TrainConfig,
    loaded: Option<&checkpoint::Loaded>,
    rank: usize,
    train: TokenDataset,
    val: Option<TokenDataset>,
) -> Result<(Loader, Option<ValLoader>)> {
    let grid = ferrotron_dist::Grid::new(&cfg.parallel);
    let (dp_rank, ranks) = match cfg.parallel.ep > 1 {
        true => {
            let replicas = grid.group_of(rank, &[Dim::Dp, Dim::Ep]);
            let me = replicas.iter().position(|&r| r == rank).expect("a member");
            (me, replicas.len())
        }
        false => (grid.coord(rank, Dim::Dp), cfg.parallel.dp as usize),
    };
    let l = &cfg.parallel;
    let lcfg = LoaderConfig::new(cfg.data.mbs as usize, cfg.data.seq as usize, cfg.data.seed);
    // Each data-parallel rank trains its own slice of every global batch.
    // A context-parallel rank takes its share of each of its replica's sequences.
    let part = SeqPart {
        rank: grid.coord(rank, Dim::Cp),
        ranks: l.cp as usize,
    };
    let train_cfg = lcfg.clone().with_rank(dp_rank, ranks);
    let loader = match loaded {
        // The saved position of the global order, dealt to this rank of this layout.
        Some(l) => {
            let mut loader = Loader::new(train, train_cfg)?;
            loader.restore_position(&l.state.loader)?;
            loader
        }
        None => Loader::new(train, train_cfg)?,
    }
    .with_context_parallel(part)?;
    // The validation set is `eval_batches` global batches (mbs × grad_acc × dp sequences
    // each, what every layout of a run shares) of evenly spread windows: each data-parallel
    // rank evaluates its share, micro-batch by micro-batch, and the losses add up over the
    // group (`Trainer::evaluate`), so a layout does not change the tokens evaluated.
    let val_cfg = lcfg.with_rank(dp_rank, ranks);
    let val_batches = cfg.observability.eval_batches * cfg.data.grad_acc;
    let val = match (val, cfg.observability.eval_interval) {
        (Some(v), i) if i > 0 => Some(
            ValLoader::new(v, val_cfg, Some(val_batches as usize))?.with_context_parallel(part)?,
        ),
        _ => None,
    };
    Ok((loader, val))
}

/// The state the run starts from: a resumed checkpoint's (weights, optimizer states, loss
/// scale, step), `--init-from`'s weights, or the initialisation `Trainer::new` made.
pub(super) fn load_state(
    t: &mut Trainer,
    loaded: Option<&checkpoint::Loaded>,
    cfg: &TrainConfig,
    rank: usize,
) -> Result<()> {
    if let Some(l) = loaded {
        let exactly = checkpoint::hf::Dtypes::Exactly(t.params.dtype());
        let weights = checkpoint::load_weights(&l.dir, t.whole_params(), exactly)?;
        t.set_weights(weights);
        let (n, blocks) = (t.whole_params().total, t.held_blocks());
        let master = t.master.is_some();
        let len = t.states_len();
        if let Some((opt, master)) = checkpoint::load_optimizer(&l.dir, n, &blocks, len, master)? {
            t.set_states(opt, master);
        }
        if t.scaler.is_some() {
            t.scaler = l.state.loss_scaler.clone().or(t.scaler.take());
        }
        t.step = l.state.step;
        if rank == 0 {
            eprintln!("resumed from {} at step {}", l.dir.display(), t.step);
        }
    } else if let Some(dir) = &cfg.model.init_from {
        init_weights(t, dir)?;
    }
    if loaded.is_some() {
        t.disable_timeline();
    }
    Ok(())
}

/// Rank 0's line on the model and its memory plan.
pub(super) fn print_plan(cfg: &TrainConfig, t: &Trainer, peak_gflops: f64) {
    let w = t.plan.sweep.at_peak;
    {
        eprintln!(
        "model {}: {} parameters; memory plan peak {:.1} MiB (params {:.1}, grads {:.1}{}, adam {:.1}, activations {:.1}, workspace {:.1}, gemm workspace {:.1}{}); matmul peak {:.1} GFLOP/s; gemm: {}",
        cfg.model.name,
        t.whole_params().total,
        t.planned_peak() as f64 / MIB,
        w.params as f64 / MIB,
        w.grads as f64 / MIB,
        // Mixed precision's fp32 copy of the weights, and the buffers the ranks talk through.
        match w.master {
            0 => String::new(),
            m => format!(", fp32 master {:.1}", m as f64 / MIB),
        },
        w.optimizer as f64 / MIB,
        w.activations() as f64 / MIB,
        w.workspace as f64 / MIB,
        t.kernel_workspace() as f64 / MIB,
        match w.comm_buffers {
            0 => String::new(),
            c => format!(", comm buffers {:.1}", c as f64 / MIB),
        },
        peak_gflops,
        t.gemm
    );
    }
    if let Some(line) = t.offload_line() {
        eprintln!("{line}");
    }
}

/// Counts a step whose loss or gradient norm was not finite (`skipped_run` in a row), and
/// stops the run after `max_skipped_steps` of them, naming the first bad gradient.
pub(super) fn count_non_finite(
    t: &Trainer,
    out: &StepOutput,
    skipped_run: &mut u64,
    cfg: &TrainConfig,
    (rank, quiet, tty): (usize, bool, bool),
) -> Result<()> {
    if out.non_finite {
        *skipped_run += 1;
        if !quiet {
            eprintln!(
                "{}step {}: non-finite loss or gradient norm ({}): update skipped on every rank ({skipped_run} in a row)",
                if tty { "\n" } else { "" },
                t.step,
                out.metrics.grad_norm
            );
        }
        if *skipped_run >= cfg.runtime.max_skipped_steps {
            let first = t
                .non_finite_gradient()
                .map_or("a gradient".to_string(), |n| format!("the gradient of {n}"));
            bail!(
                "step {}: {skipped_run} consecutive steps had a non-finite loss or gradient (first non-finite on rank {rank}: {first}); stopping (max_skipped_steps = {}): lower --lr, raise --warmup or --clip, or resume from the last checkpoint",
                t.step,
                cfg.runtime.max_skipped_steps
            );
        }
    } else {
        *skipped_run = 0;
    }
    Ok(())
}

/// Where the step loop is: the first step of this run, the last of the schedule, and when
/// the loop started (for the ETA).
pub(super) struct Progress {
    pub first_step: u64,
    pub last_step: u64,
    pub started: Instant,
    pub quiet: bool,
    pub tty: bool,
}

/// The step's progress line (every step on a terminal; every 10th, each evaluation and the
/// first and last otherwise).
pub(super) fn print_progress(t: &Trainer, out: &StepOutput, cfg: &TrainConfig, p: &Progress) {
    let Progress {
        first_step,
        last_step,
        started,
        quiet,
        tty,
    } = *p;
    let last = t.step == last_step;
    let m = &out.metrics;
    let shown = !quiet
        && (m.val_loss.is_some() || t.step.is_multiple_of(10) || t.step == first_step + 1 || last);
    // The line is made only when it is printed (a quiet rank's steps format nothing).
    if !tty && !shown {
        return;
    }
    let done = (t.step - first_step) as f64;
    let eta = started.elapsed().as_secs_f64() / done * (last_step - t.step) as f64;
    let val = m
        .val_loss
        .map_or(String::new(), |v| format!(" | val {v:.4}"));
    let line = format!(
        "step {:>5}/{} | loss {:.4}{val} | lr {:.2e} | {:.0} tok/s | MFU {} | mem {:.1}/{:.1} MiB | ETA {}",
        t.step,
        cfg.optimizer.steps,
        m.loss,
        m.lr,
        m.tokens_per_s,
        mfu_text(m.mfu * 100.0),
        m.mem_peak_measured as f64 / MIB,
        m.mem_peak_planned as f64 / MIB,
        fmt_eta(eta)
    );
    if tty {
        eprint!("\r{line}\x1b[K");
        if m.val_loss.is_some() {
            eprintln!();
        }
    } else {
        eprintln!("{line}");
    }
}

/// Saves a checkpoint when one is due (every `interval` steps, and the last): staged and
/// written in the background with `--async-checkpoint`, else written now by every rank.
#[allow(clippy::too_many_arguments)]
pub(super) fn save_if_due(
    t: &mut Trainer,
    cfg: &TrainConfig,
    background: &mut Option<Background>,
    last: bool,
    tokenizer_json: &str,
    tok: &Tokenizer,
    rank: usize,
    quiet: bool,
) -> Result<()> {
    let due =
        (cfg.checkpoint.interval > 0 && t.step.is_multiple_of(cfg.checkpoint.interval)) || last;
    let stalled = Instant::now();
    if let (Some(b), true) = (background.as_mut(), due) {
        // Every rank stages the blocks it holds; a thread writes them (a previous save's
        // failure comes back here, naming its step).
        t.with_host_state(|t| b.save(&cfg.checkpoint, t, tokenizer_json, tok.name()))?;
    } else if let (Some(dir), true) = (&cfg.checkpoint.dir, due) {
        // Every rank writes the blocks it holds.
        t.with_host_state(|t| {
            checkpoint::save_as_configured(&cfg.checkpoint, t, tokenizer_json, tok.name())
        })
        .with_context(|| {
            format!(
                "writing the checkpoint of step {} into {} (the previous checkpoint is intact)",
                t.step,
                dir.display()
            )
        })?;
    }
    if due && cfg.checkpoint.dir.is_some() && rank == 0 && !quiet {
        // What a save costs the run: the time the step loop waited for it.
        let how = match background {
            Some(b) => format!(
                "{:.2} s of it for the previous save to finish; staged, written in the background",
                b.waited_for_previous.as_secs_f64()
            ),
            None => "written".into(),
        };
        eprintln!(
            "checkpoint of step {}: training waited {:.2} s ({how})",
            t.step,
            stalled.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The run's closing lines (rank 0): steps, median tokens/s and MFU, peak memory against the
/// plan, the pipeline's bubble and each dimension's bytes. Returns the largest planned and
/// measured peaks.
pub(super) fn report_done(
    args: &TrainArgs,
    cfg: &TrainConfig,
    t: &Trainer,
    steps: &[StepMetrics],
    (rank, peak_gflops, started): (usize, f64, Instant),
) -> (u64, u64) {
    let measured = steps.iter().map(|m| m.mem_peak_measured).max().unwrap_or(0);
    let planned = steps.iter().map(|m| m.mem_peak_planned).max().unwrap_or(0);
    let timed: Vec<&StepMetrics> = steps.iter().skip(1).collect();
    let mut mfu = median(timed.iter().map(|m| m.mfu * 100.0).collect());
    let cpu = args.device == crate::device::Device::Cpu;
    if mfu > 100.0 && rank == 0 && args.peak_gflops.is_none() && cpu {
        let cached = peak_gflops;
        let factor = crate::observe::metrics::remeasure_low_peak(bf16_products(cfg), cached);
        if factor < 1.0 {
            eprintln!(
                "note: MFU {mfu:.1}% was against a cached matmul peak measured while the machine was busy; measured again, {:.1} GFLOP/s per rank, kept for the next run",
                cached / factor
            );
            mfu *= factor;
        }
    }
    if rank == 0 {
        eprintln!(
        "done: {} steps in {:.1}s | median {:.0} tok/s, MFU {} | peak memory planned {:.2} MiB, measured {:.2} MiB ({:+.2}%) over a baseline of {:.1} MiB | {}",
        steps.len(),
        started.elapsed().as_secs_f64(),
        median(timed.iter().map(|m| m.tokens_per_s).collect()),
        mfu_text(mfu),
        planned as f64 / MIB,
        measured as f64 / MIB,
        (measured as f64 / planned.max(1) as f64 - 1.0) * 100.0,
        t.baseline as f64 / MIB,
        rss_line(
            steps,
            planned,
            t.offload_plan().map_or(0, |o| o.host_bytes),
            t.device_host
        )
    );
        // On a device, where the host's memory went, phase by phase (issue #33).
        if let (false, Some(l)) = (cpu, crate::observe::host_rss::line()) {
            eprintln!("{l}");
        }
        if let Some(m) = steps.last().filter(|m| !m.pp_bubble.is_empty()) {
            // The median step's (the first steps warm up).
            let mut by_step: Vec<&Vec<f64>> = steps.iter().map(|m| &m.pp_bubble).collect();
            by_step.sort_by(|a, b| a.iter().sum::<f64>().total_cmp(&b.iter().sum::<f64>()));
            let mid = by_step[by_step.len() / 2];
            let each: Vec<String> = mid.iter().map(|b| format!("{:.1}%", b * 100.0)).collect();
            eprintln!(
                "pipeline bubble (median step): stages {} of their compute time blocked, planned (p − 1)/(v·m) = {:.1}%",
                each.join(", "),
                m.pp_bubble_planned.unwrap_or(0.0) * 100.0
            );
        }
        if let Some(m) = steps.last() {
            comm_summary(m);
        }
    }
    (planned, measured)
}

/// Rank 0's sample from the trained weights (every rank gathers them when sampling).
pub(super) fn sample_text(
    t: &mut Trainer,
    cfg: &TrainConfig,
    tok: &Tokenizer,
    sampling: bool,
    rank: usize,
) -> Result<Option<String>> {
    let weights = if sampling {
        Some(t.with_host_state(Trainer::full_weights)?)
    } else {
        None
    };
    let sample = if let (Some(weights), 0) = (weights, rank) {
        let o = SampleOptions {
            tokens: cfg.observability.sample_tokens as usize,
            temperature: 0.8,
            top_k: 40,
            seed: cfg.data.seed,
            context: cfg.data.seq as usize,
            kv_cache: true,
        };
        let text = generate(&t.whole_model(), &weights, tok, "ROMEO:", &o)?;
        eprintln!("sample (temperature 0.8, top-k 40):\nROMEO:{text}");
        Some(text)
    } else {
        None
    };
    Ok(sample)
}

/// This rank's matmul peak (the MFU denominator): its share of the machine's, measured before
/// the ranks started; a GPU's from the planner's table; or measured (cached) now.
pub(super) fn peak_gflops(ctx: Option<&RankCtx>, args: &TrainArgs, cfg: &TrainConfig) -> f64 {
    match ctx.and_then(|c| c.peak_gflops) {
        Some(share) => share,
        // A GPU's peak is its own, from the planner's table (`Trainer::new`), not the CPU's.
        None if args.device == crate::device::Device::Cuda => args.peak_gflops.unwrap_or(0.0),
        None => args
            .peak_gflops
            .unwrap_or_else(|| matmul_peak_gflops(bf16_products(cfg))),
    }
}

/// The rank's communicators: the model's groups with the world they were split from, or
/// (a replicated model) the world as the data-parallel group.
pub(super) fn with_world(
    world: Option<Box<dyn ferrotron_dist::Communicator>>,
    groups: Option<Comms>,
) -> Comms {
    match (world, groups) {
        (Some(world), Some(g)) => Comms {
            world: Some(world),
            ..g
        },
        (world, _) => Comms {
            dp: world,
            ..Comms::default()
        },
    }
}

/// Rank 0's metrics file (and TensorBoard events); the other ranks write none.
pub(super) fn metrics_writer(
    cfg: &TrainConfig,
    rank: usize,
    resumed: bool,
) -> Result<Option<MetricsWriter>> {
    Ok(match rank {
        0 => Some(
            MetricsWriter::open(&cfg.observability.metrics, resumed)?
                .with_tensorboard(cfg.observability.tensorboard.as_deref())?,
        ),
        _ => None,
    })
}

/// fp16's line for a step whose gradients overflowed.
pub(super) fn print_overflow(u: &crate::optim::loss_scale::ScaleUpdate, step: u64, tty: bool) {
    eprintln!(
        "{}step {}: fp16 gradients overflowed at loss scale {}: step skipped, scale -> {}",
        if tty { "\n" } else { "" },
        step,
        u.old_scale,
        u.new_scale
    );
}

/// An MFU in percent as printed: "n/a" where the peak is unknown (a GPU the planner's table
/// does not list, such as the CUDA emulator, gives a peak of 0 and an MFU of infinity),
/// with the flag that supplies one.
fn mfu_text(percent: f64) -> String {
    if percent.is_finite() {
        format!("{percent:.1}%")
    } else {
        "n/a (no peak known for this device: --peak-gflops)".into()
    }
}
