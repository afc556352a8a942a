//! The training loop of one rank: micro-batches with gradient accumulation, global-norm
//! clipping, AdamW with a warm-up + cosine schedule, validation, and the measured memory of
//! every step against the plan.

use crate::config::TrainConfig;
use crate::context_parallel::CpGroup;
use crate::data::{Loader, ValLoader};
use crate::data_parallel::{expert_ranges, Buckets, DataParallel, Gather, Segment, Sums};
use crate::device::Machine;
use crate::device_state::{DevFlat, DeviceState};
use crate::expert_parallel::EpGroup;
use crate::memory::alloc;
use crate::memory::arena::Arena;
use crate::memory::pool::{PlanPool, Point, Running, Sample, Timeline};
use crate::memory::workspace::{self, KernelWorkspace};
use crate::observe::metrics::{RankMem, StepMetrics};
use crate::observe::trace::{Event, Tracing};
use crate::optim::loss_scale::{DynamicLossScaler, ScaleUpdate};
use crate::optim::lr::LrSchedule;
pub use crate::optim::step::AdamState;
use crate::optim::step::{adamw, global_sum_sq, grad_scale, NormGroups, OptRun, States};
use crate::pipeline::Pipeline;
use crate::setup::{checked_plan, planned_bytes, recompute_flops_per_token};
use crate::small_sums::SmallSums;
use crate::tensor_parallel::{self as tpar, TpGroup};
use crate::weights::Flat;
use crate::zero2::GradWindows;
use crate::zero3::{Source, Zero3};
use crate::{with_dev_types, with_flat_types};
use anyhow::Result;
use ferrotron_dist::{Communicator, Dim};
use ferrotron_engine::kernels::{
    AdamWParams, AsView, AsViewMut, Backend, CpuKernels, DeviceAlloc, DeviceBuf, Kernels, Rounding,
    View, ViewMut,
};
use ferrotron_engine::model::{
    BatchShape, ContextParallel, CpComm, EpComm, ExpertParallel, GradBuf, GradsDone, Llama,
    LlamaConfig, LossSum, Stage, TensorParallel, TpComm, Whole,
};
use ferrotron_engine::Elem;
use ferrotron_plan::arena::{with_region, ArenaLayout};
use ferrotron_plan::buffers::dp_bucket_len;
use ferrotron_plan::flops::model_flops_per_token;
use ferrotron_plan::memory::Phase;
use ferrotron_plan::Precision;
use ferrotron_plan::{ModelSpec, RankPlan};
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

mod evaluate;
mod memory_report;
mod pipeline_step;
mod update;
mod zero_gather;

use memory_report::{measure_workspace, rank_mems, step_peaks, trace_capacity};
use zero_gather::{gather_weights, shard_of, GatherParams};

/// A rank's communicators: its data-parallel group, its tensor-parallel group, and (with
/// tensor parallelism) the world, over which every rank's memory is reported.
#[derive(Default)]
pub struct Comms {
    pub dp: Option<Box<dyn Communicator>>,
    pub tp: Option<Rc<TpGroup>>,
    /// The rank's pipeline group and its stage's program.
    pub pp: Option<Pipeline>,
    pub world: Option<Box<dyn Communicator>>,
    /// Expert parallelism: the rank's expert-parallel group, and the ranks holding the same
    /// experts (its data-parallel replicas; `None` without any), over which the experts'
    /// gradients are summed (`dp` is then every dense replica).
    pub ep: Option<Rc<EpGroup>>,
    pub dp_experts: Option<Box<dyn Communicator>>,
    /// Context parallelism: the rank's ring (`dp` is then every dp × cp replica).
    pub cp: Option<Rc<CpGroup>>,
}

/// Share `r` of `p` even shares of the elements of `ranges` (in order), as ranges.
fn even_share(ranges: &[Range<usize>], r: usize, p: usize) -> Vec<Range<usize>> {
    let n: usize = ranges.iter().map(|x| x.len()).sum();
    let (lo, hi) = (n * r / p, n * (r + 1) / p);
    let (mut out, mut at) = (Vec::new(), 0);
    for x in ranges {
        let (a, b) = (lo.max(at), hi.min(at + x.len()));
        if a < b {
            out.push(x.start + (a - at)..x.start + (b - at));
        }
        at += x.len();
    }
    out
}

/// The error of a tensor- or expert-parallel collective of the pass, if one failed.
fn check_groups(
    tp: &Option<Rc<TpGroup>>,
    ep: &Option<Rc<EpGroup>>,
    cp: &Option<Rc<CpGroup>>,
) -> Result<()> {
    if let Some(tp) = tp {
        tp.check()?;
    }
    if let Some(ep) = ep {
        ep.check()?;
    }
    if let Some(cp) = cp {
        cp.check()?;
    }
    Ok(())
}

pub struct Trainer {
    pub cfg: TrainConfig,
    pub spec: ModelSpec,
    pub model: Llama,
    /// The backend (the CPU, or a device), behind a tracer that records only while `--trace`
    /// asks.
    kernels: Tracing<Backend>,
    /// The state on the device when the step runs on one (`--device`): then the host fields
    /// `params`, `master`, `grads` and `opt` stay empty while training.
    dev: Option<DeviceState>,
    /// The device's memory (`None`: the step runs on the CPU).
    device_alloc: Option<Arc<dyn DeviceAlloc>>,
    /// The weights in their storage type (f32, bf16, f16).
    pub params: Flat,
    /// fp32 master weights (mixed precision only): the optimizer updates these and rounds
    /// them into `params`.
    pub master: Option<Vec<f32>>,
    /// Gradients (storage type, or f32 with `--fp32-grad-acc`), created by the first step.
    pub grads: Option<Flat>,
    pub opt: Option<AdamState>,
    /// fp16's dynamic loss scaler.
    pub scaler: Option<DynamicLossScaler>,
    /// Optimizer steps completed.
    pub step: u64,
    pub loader: Loader,
    pub val: Option<ValLoader>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    /// A pipeline stage's other in-flight micro-batches' tokens and targets (`data.tokens@s`).
    batches: Vec<(Vec<u32>, Vec<u32>)>,
    pool: PlanPool,
    pub schedule: LrSchedule,
    /// What the optimizer updates on this rank (every tensor, or the ZeRO-1 shard), and whether
    /// weight decay applies (matrices yes; norms, biases no).
    runs: Vec<OptRun>,
    /// Elements of the optimizer states on this rank.
    opt_len: usize,
    /// ZeRO-2 and 3: the gradient windows of one unit's backward, after this rank's gradient
    /// shard in the gradient buffer (`None`: the gradient buffer holds every gradient).
    windows: Option<GradWindows>,
    /// ZeRO-3: the parameters are this rank's shard, then the windows units are gathered into
    /// (`None`: `params` holds every weight).
    zero3: Option<Zero3>,
    pub plan: RankPlan,
    /// Planned peak of a step without and with optimizer states present (steps 1 and 2).
    planned_peak: [u64; 2],
    pub flops_per_token: f64,
    /// Hardware FLOPs per token: model FLOPs plus what recomputation replays (HFU).
    pub hw_flops_per_token: f64,
    /// FLOP/s the machine reaches on matmuls (the MFU denominator).
    pub peak_flops: f64,
    /// The GEMM kernel of this run, as the startup line and the metrics name it.
    pub gemm: String,
    /// Live heap bytes before the model existed: the tokenizer, data index and runtime, which
    /// the plan does not model. Measured peaks are reported above it.
    pub baseline: u64,
    /// Steps still to trace (`--trace-steps`, counted from this run's first step).
    trace_left: u64,
    /// This rank's part in data parallelism (`None`: one rank).
    pub dp: Option<DataParallel>,
    /// This rank's tensor-parallel group (the model's collectives go through it).
    tp: Option<Rc<TpGroup>>,
    /// This rank's expert-parallel group (the model's exchanges go through it).
    ep: Option<Rc<EpGroup>>,
    /// This rank's context-parallel ring (the model's attention passes blocks through it).
    cp: Option<Rc<CpGroup>>,
    /// This rank's pipeline stage.
    pub pp: Option<Pipeline>,
    /// With tensor parallelism, every rank (for `rank_mem`), and a small buffer for it.
    world: Option<(Box<dyn Communicator>, Vec<f32>)>,
    /// The planner's data-parallel bytes per step and rank.
    comm_planned: Option<u64>,
    /// The planner's tensor-parallel bytes per step and rank.
    tp_planned: Option<u64>,
    /// The planner's expert-parallel bytes per step and rank.
    ep_planned: Option<u64>,
    /// The planner's context-parallel (ring) bytes per step and rank.
    cp_planned: Option<u64>,
}

/// What one optimizer step did.
pub struct StepOutput {
    pub metrics: StepMetrics,
    pub tokens: u64,
    /// The loss scaler's decision (fp16), when the step overflowed: skipped, scale backed off.
    pub overflow: Option<ScaleUpdate>,
    /// fp32 and bf16: the loss or the gradient norm was not finite, so no rank updated its
    /// weights (fp16's overflows are `overflow`).
    pub non_finite: bool,
}

/// The test-only switch `FERROTRON_TEST_NAN_STEPS=3,4`: every rank writes a NaN into the first
/// gradient it holds at those steps, after the reductions, as a NaN reduced from any rank would
/// be (the non-finite guard's tests; a host run only).
fn injected_nan(step: u64) -> bool {
    std::env::var("FERROTRON_TEST_NAN_STEPS").is_ok_and(|v| {
        v.split(',')
            .any(|s| s.trim().parse::<u64>().is_ok_and(|n| n == step))
    })
}

/// The test-only switch `FERROTRON_TEST_STALL=RANK:STEP`: that rank stops at the start of
/// that step and never goes on, alive (what SIGSTOP does to one process of an mpirun job, for
/// a rank that is a thread): the watchdog's tests.
fn stall_if_asked(rank: usize, step: u64) {
    let asked = std::env::var("FERROTRON_TEST_STALL").is_ok_and(|v| {
        v.split_once(':')
            .is_some_and(|(r, s)| r.parse() == Ok(rank) && s.parse() == Ok(step))
    });
    if asked {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

/// What the typed step computed.
struct Stepped {
    loss: LossSum,
    grad_norm: f64,
    lr: f64,
    overflow: Option<ScaleUpdate>,
    non_finite: bool,
}

/// The norms whose gradients a backward step has just completed (the parameters sequence
/// parallelism leaves partial on each rank), empty ranges where there is none: the step
/// allocates nothing for it.
fn norms_of(d: &GradsDone) -> [Range<usize>; 2] {
    match d {
        GradsDone::FinalNorm(r) => [(*r).clone(), 0..0],
        GradsDone::Layer(_, li) => [li.ln1.clone(), li.ln2.clone()],
        GradsDone::Embedding(_) => [0..0, 0..0],
    }
}

/// The parts of `g` (the gradients of parameters `params`) outside `skip`.
fn outside<'a, G>(
    g: View<'a, G>,
    params: &Range<usize>,
    skip: Option<&Range<usize>>,
) -> impl Iterator<Item = View<'a, G>> {
    let (lo, hi) = match skip {
        Some(c) => (
            c.start.clamp(params.start, params.end) - params.start,
            c.end.clamp(params.start, params.end) - params.start,
        ),
        None => (g.len(), g.len()),
    };
    [g.slice(..lo), g.slice(hi.max(lo)..)].into_iter()
}

/// The micro-batch's token ids and targets where the step reads them: the loader's host
/// buffers, or on the device, copied there first.
fn batch_views<'a>(
    dev: &'a mut Option<DeviceState>,
    tokens: &'a [u32],
    targets: &'a [u32],
) -> (View<'a, u32>, View<'a, u32>) {
    match dev {
        Some(d) => {
            d.tokens.copy_from_host(tokens);
            d.targets.copy_from_host(targets);
            (d.tokens.view(), d.targets.view())
        }
        None => (tokens.view(), targets.view()),
    }
}

impl Trainer {
    /// Builds the model and its parameters. Call after the data and tokenizer exist, so that
    /// they fall into the baseline and everything allocated here on is in the plan.
    pub fn new(
        cfg: TrainConfig,
        spec: ModelSpec,
        llama: LlamaConfig,
        loader: Loader,
        val: Option<ValLoader>,
        comms: Comms,
        machine: Machine,
    ) -> Result<Self> {
        let Machine {
            device,
            peak_gflops,
        } = machine;
        // Per-thread kernel state (gemm's packing slabs) is a fixed cost of the process, like
        // the thread pool: create it now so it falls into the baseline.
        let cpu = if cfg.precision.kind == Precision::Fp8 {
            CpuKernels::FP8
        } else {
            CpuKernels::PLAIN
        };
        Kernels::<f32>::warm_up(&cpu);
        // This rank's tokens of a micro-batch: under context parallelism 1/cp of each sequence.
        let n = (cfg.data.mbs * cfg.data.seq / cfg.parallel.cp) as usize;
        // The products this rank runs: its slice of the model under tensor parallelism.
        let tp_size = comms.tp.as_ref().map_or(1, |t| t.size());
        let local = ferrotron_engine::model::tensor_parallel::shard_config(&llama, tp_size)?;
        let chunk = cfg.runtime.ce_chunk as usize;
        // The CPU kernels' workspace, measured (a GPU's is its own: `gpu_workspace` below).
        let kernel_workspace = match device {
            crate::device::Device::Cuda => KernelWorkspace::default(),
            _ => measure_workspace(&cpu, cfg.precision.kind, &local, n, chunk),
        };
        let gemm = cpu.gemm.describe();
        let (backend, device_alloc) = crate::device::open(device, cpu)?;
        // What the chosen backend runs (the CPU's limits were checked with the config).
        let limits = Kernels::<f32>::limits(&backend);
        llama
            .check_backend(limits)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if limits.backend == "CUDA" {
            if cfg.precision.kind == Precision::Fp8 {
                anyhow::bail!("precision = fp8: fp8 products on the GPU are issue #15's (cuBLASLt fp8); use bf16 there, or fp8 on the CPU");
            }
            if cfg.observability.memory_timeline.is_some() {
                anyhow::bail!("memory_timeline: the timeline samples the host's heap, not the GPU's memory; drop --memory-timeline with --device cuda");
            }
        }
        // Observability buffers are outside the plan: reserve them before the baseline, so the
        // measured bytes stay comparable with the plan.
        let kernels = Tracing::new(backend);
        let trace_left = if cfg.observability.trace.is_some() {
            cfg.observability.trace_steps
        } else {
            0
        };
        if trace_left > 0 {
            kernels.start(trace_capacity(&cfg, &llama, trace_left));
            kernels.stop();
        }
        // Without the tracking allocator there is nothing to sample.
        let mut timeline = (cfg.observability.memory_timeline.is_some()
            && cfg.observability.memory_timeline_steps > 0
            && alloc::installed())
        .then(|| {
            Timeline::new(
                0,
                llama.layers,
                cfg.observability.memory_timeline_steps,
                cfg.data.grad_acc,
            )
        });
        // This rank's place in its tensor-parallel group (with the tables mapping its slices
        // onto the whole model): metadata of the process, like the data index.
        let tp_rank = match &comms.tp {
            Some(tp) => {
                let group: Rc<dyn TpComm> = tp.clone();
                Some(TensorParallel::new(llama.clone(), group)?.with_sp(cfg.parallel.sp))
            }
            None => None,
        };
        let baseline = alloc::live();
        if let Some(t) = &mut timeline {
            t.set_baseline(baseline);
        }
        // Initialisation of HF Llama: N(0, 0.02²) matrices, unit norms, zero biases; under mixed
        // precision that is the fp32 master copy, and the weights are it rounded. A tensor-
        // parallel rank takes its slice of the same weights.
        let whole_init = Llama::new(llama.clone()).params.init(cfg.data.seed, 0.02);
        let layers = llama.layers as u64;
        let model = match (tp_rank, &comms.ep) {
            (Some(tp), _) => Llama::tensor_parallel(tp)?,
            (None, Some(ep)) => {
                let group: Rc<dyn EpComm> = ep.clone();
                let par = ExpertParallel::new(&llama, group)?;
                Llama::expert_parallel(llama, par)
            }
            (None, None) => Llama::new(llama),
        };
        // A pipeline stage holds its layers (and the embedding or the head), as the planner
        // splits them.
        let stage = comms.pp.as_ref().map_or(0, |p| p.stage);
        let layout = cfg.parallel.clone();
        let held = move |p| layout.stage_of(p, layers) == stage as u64;
        let stages = cfg.parallel.pp as usize;
        // The stage's parameter tables replace the whole model's, some of them built before
        // the baseline (the tensor-parallel rank's map).
        let (model, tables) =
            alloc::bookkeeping(|| model.pipeline_stage(Stage { stage, stages }, &held));
        let model = model
            .with_ce_chunk_tokens(cfg.runtime.ce_chunk as usize)
            .with_recompute(cfg.runtime.recompute)
            .with_capacity_factor(cfg.model.capacity_factor);
        // Context parallelism: attention as a ring over the group, RoPE at this rank's
        // positions.
        let model = match &comms.cp {
            Some(cp) => {
                let ring: Rc<dyn CpComm> = cp.clone();
                let seq = cfg.data.seq as usize;
                model
                    .context_parallel(ContextParallel::new(ring), seq)
                    .map_err(anyhow::Error::msg)?
            }
            None => model,
        };
        let init = tpar::slice_of(&model, &whole_init);
        drop(whole_init);
        let Comms {
            dp: comm,
            tp,
            pp,
            world,
            ep,
            dp_experts,
            cp,
        } = comms;
        // Data parallelism: the buckets of the plan (`dp.grad_buckets`; ZeRO-3: one per unit),
        // and under ZeRO the shard of the optimizer states this rank keeps.
        let zero = cfg.parallel.zero;
        let bucket_bytes = cfg.runtime.bucket_mb << 20;
        let dp = comm.map(|comm| {
            let shards = if zero >= 1 { comm.size() as u64 } else { 1 };
            let n = model.params.total as u64;
            if ep.is_some() {
                // The dense gradients over every replica, the experts' over theirs, each in
                // buckets of their own (the plan's `dp.grad_buckets`, `dp.expert_grad_buckets`).
                // Under ZeRO-1 each in blocks of its group's ranks.
                let experts: usize = expert_ranges(&model.params).iter().map(|r| r.len()).sum();
                let shards = |c: Option<&dyn Communicator>| match zero {
                    0 => 1,
                    _ => c.map_or(1, |c| c.size()) as u64,
                };
                let len = |n: usize, s: u64| dp_bucket_len(bucket_bytes, n as u64, s) as usize;
                let lens = (
                    len(model.params.total - experts, shards(Some(comm.as_ref()))),
                    len(experts, shards(dp_experts.as_deref())),
                );
                let (table, sharded) = (&model.params, zero >= 1);
                return DataParallel::expert_parallel(comm, dp_experts, table, lens, sharded);
            }
            let buckets = match zero {
                3.. => Buckets::Units,
                _ => Buckets::Fixed(dp_bucket_len(bucket_bytes, n, shards) as usize),
            };
            DataParallel::new(comm, &model.params, buckets, zero >= 1)
        });
        let windows = (dp.is_some() && zero >= 2).then(|| GradWindows::new(&model.params));
        let zero3 = (dp.is_some() && zero >= 3).then(|| Zero3::new(&model.params));
        let decays = |r: &Range<usize>| {
            let e = model
                .params
                .entries
                .iter()
                .find(|e| e.range().contains(&r.start));
            e.is_some_and(|e| e.is_matrix())
        };
        let (runs, opt_len): (Vec<OptRun>, usize) = match dp.as_ref().and_then(|d| d.shard()) {
            Some(shard) => {
                let run = |params: Range<usize>, at: usize| OptRun {
                    decay: decays(&params),
                    replicated: tpar::is_replicated(&model, &params),
                    params,
                    at,
                };
                let mut runs: Vec<OptRun> = (shard.segments.iter())
                    .map(|g| run(g.params.clone(), g.at))
                    .collect();
                let mut len = shard.len;
                // Expert parallelism: after the dense blocks, this rank's blocks of its experts
                // (whole when no other rank holds them).
                if ep.is_some() {
                    match dp.as_ref().and_then(|d| d.expert_shard()) {
                        Some(x) => {
                            runs.extend(x.segments.iter().map(|g| run(g.params.clone(), g.at)));
                            len += x.len;
                        }
                        None => {
                            for r in expert_ranges(&model.params) {
                                let n = r.len();
                                runs.push(run(r, len));
                                len += n;
                            }
                        }
                    }
                }
                (runs, len)
            }
            None => {
                let runs = model.params.entries.iter().map(|e| OptRun {
                    params: e.range(),
                    at: e.offset,
                    decay: e.is_matrix(),
                    replicated: tpar::is_replicated(&model, &e.range()),
                });
                (runs.collect(), model.params.total)
            }
        };
        let window_len = windows.as_ref().map_or(0, |w| w.len());
        let param_windows = zero3.as_ref().map_or(0, |z| z.len());
        // A GPU's workspace is its own (cuBLASLt's, and scratch reserved now).
        let gpu =
            crate::device::gpu_workspace(&kernels.inner, &model, chunk, n, cfg.precision.kind);
        let kernel_workspace = match &gpu {
            Some((w, ..)) => KernelWorkspace {
                layers: *w,
                head: *w,
            },
            None => kernel_workspace,
        };
        let ws = kernel_workspace.max();
        let (plan, plan_bytes) = alloc::bookkeeping(|| {
            checked_plan(
                &spec,
                &model,
                &cfg,
                ws,
                opt_len,
                window_len,
                param_windows,
                stage,
            )
        });
        let plan = plan?;
        // The plan itself (its buffer table and marks, ~28 KB on the default model) and the
        // stage's tables are the process's bookkeeping, not buffers it lists: they join the
        // baseline, as measured.
        let baseline = baseline.saturating_add_signed(plan_bytes + tables);
        if let Some(t) = &mut timeline {
            t.set_baseline(baseline);
        }
        if let Some(pp) = &pp {
            crate::setup::check_slots(&plan, pp, model.config.layers)?;
        }
        // The other in-flight micro-batches' batches (the plan's `data.tokens@s`).
        let extra = pp.as_ref().map_or(0, |p| p.slots_of(0) as usize - 1);
        let batches = (0..extra).map(|_| (vec![0; n], vec![0; n])).collect();
        // What each group of this rank sends per step, as planned for its stage (one rank
        // alone sends nothing: no estimate).
        let (tp_planned, ep_planned, cp_planned, comm_planned) =
            match tp.is_some() || ep.is_some() || cp.is_some() || dp.is_some() {
                true => {
                    let planned = planned_bytes(&spec, &cfg, ws, stage)?;
                    let of = |on: bool, d| on.then(|| planned(d));
                    (
                        of(tp.is_some(), Dim::Tp),
                        of(ep.is_some(), Dim::Ep),
                        of(cp.is_some(), Dim::Cp),
                        of(dp.is_some(), Dim::Dp),
                    )
                }
                false => (None, None, None, None),
            };
        let (arena, placed) = Arena::of_plan(&plan.plan, model.config.layers)?;
        // ZeRO-3: this rank's shard of the weights, then the (zeroed) windows.
        let weights = |init: Vec<f32>| match &zero3 {
            Some(z) => shard_of(&runs, opt_len + z.len(), &init),
            None => init,
        };
        let (params, master) = if cfg.precision.kind.has_master() {
            let master = shard_of(&runs, opt_len, &init);
            let storage = cfg.precision.kind.storage();
            (Flat::from_f32(storage, &weights(init)), Some(master))
        } else {
            (Flat::F32(weights(init)), None)
        };
        let scaler = (cfg.precision.kind == Precision::Fp16)
            .then(|| DynamicLossScaler::new(cfg.precision.loss_scale));
        let schedule = LrSchedule::of(&cfg);
        let flops_per_token = model_flops_per_token(&spec, cfg.data.seq);
        let hw_flops_per_token =
            flops_per_token + recompute_flops_per_token(&spec, cfg.data.seq, cfg.runtime.recompute);
        let mut t = Trainer {
            planned_peak: step_peaks(&plan, &placed, kernel_workspace),
            plan,
            tokens: vec![0; n],
            targets: vec![0; n],
            batches,
            kernels,
            dev: None,
            device_alloc: None,
            grads: None,
            master,
            scaler,
            opt: None,
            step: 0,
            pool: PlanPool {
                timeline,
                arena: Some(arena),
                ..PlanPool::default()
            },
            trace_left,
            dp,
            tp,
            ep,
            cp,
            pp,
            world: world.map(|w| (w, Vec::new())),
            comm_planned,
            tp_planned,
            ep_planned,
            cp_planned,
            runs,
            opt_len,
            windows,
            zero3,
            schedule,
            flops_per_token,
            hw_flops_per_token,
            // On a GPU without `--peak-gflops`: its dense peak from the planner's table.
            peak_flops: match gpu.as_ref().and_then(|g| g.2) {
                Some(p) if peak_gflops == 0.0 => p,
                _ => peak_gflops * 1e9,
            },
            gemm: gpu.as_ref().map_or(gemm, |g| g.1.clone()),
            baseline,
            params,
            model,
            spec,
            loader,
            val,
            cfg,
        };
        if let (Some(d), Some(a)) = (&device_alloc, &mut t.pool.arena) {
            a.on_device(d.clone());
        }
        t.device_alloc = device_alloc;
        t.pool.sample(1, Point::Init);
        Ok(t)
    }

    /// The pipeline's send and receive buffers, as planned (with the gradients, or by an
    /// evaluation before the first step).
    fn allocate_pipeline(&mut self) {
        if let (Some(pp), Some(b)) = (&mut self.pp, self.plan.plan.find("comm.pp.recv")) {
            let sends = ["forward", "backward"].map(|d| {
                let prefix = format!("comm.pp.send.{d}.");
                let bufs = self.plan.plan.buffers.iter();
                bufs.filter(|b| b.name.starts_with(&prefix)).count()
            });
            pp.allocate(
                sends[0].max(sends[1]),
                b.numel as usize,
                sends.map(|k| k > 0),
            );
        }
    }

    /// A micro-batch on this rank: under context parallelism its share of each sequence.
    fn batch(&self) -> BatchShape {
        BatchShape {
            b: self.cfg.data.mbs as usize,
            t: (self.cfg.data.seq / self.cfg.parallel.cp) as usize,
        }
    }

    /// One optimizer step over `grad_acc` micro-batches.
    pub fn train_step(&mut self) -> Result<StepOutput> {
        alloc::reset_peak();
        if let Some(d) = &self.device_alloc {
            d.reset_peak();
        }
        if self.trace_left > 0 {
            self.trace_left -= 1;
            self.kernels.start(0);
        } else {
            self.kernels.stop();
        }
        let planned = self.planned_peak[self.has_opt() as usize];
        let t0 = Instant::now();
        let step = self.step + 1;
        ferrotron_dist::watchdog::set_step(self.world_rank(), step);
        stall_if_asked(self.world_rank(), step);
        // Gradients appear before the first forward: the fused LM head accumulates into them.
        let no_grads = match &self.dev {
            Some(d) => d.grads.is_none(),
            None => self.grads.is_none(),
        };
        if no_grads {
            let gt = self.cfg.precision.kind.engine_grads();
            let len = match &self.windows {
                // ZeRO-2: this rank's shard of the reduced gradients, then the windows.
                Some(w) => self.opt_len + w.len(),
                None => self.model.params.total,
            };
            match (&mut self.dev, &self.device_alloc) {
                (Some(d), Some(a)) => d.grads = Some(DevFlat::zeros(a, gt, len)?),
                _ => self.grads = Some(Flat::zeros(gt, len)),
            }
            // The plan's `dp.grad_buckets` (and ZeRO-3's `zero3.gather`) appear with the
            // gradients.
            if let Some(dp) = &mut self.dp {
                dp.allocate();
            }
            // Tensor parallelism's staging buffer and expert parallelism's message, as planned.
            if let (Some(tp), Some(b)) = (&self.tp, self.plan.plan.find("comm.tp.staging")) {
                tp.allocate(b.numel as usize);
            }
            if let (Some(ep), Some(b)) = (&self.ep, self.plan.plan.find("comm.ep.message")) {
                ep.allocate(b.numel as usize);
            }
            if let (Some(cp), Some(b)) = (&self.cp, self.plan.plan.find("comm.cp.message")) {
                cp.allocate(b.numel as usize);
            }
            self.allocate_pipeline();
            self.pool.sample(step, Point::Grads);
        }
        let ran_with = self.scaler.as_ref().map(|s| s.scale);
        // The typed buffers leave `self` for the step (moving a Vec moves no memory).
        let r = match self.dev.as_mut() {
            Some(d) => {
                let mut params = d.params.take().expect("the weights are on the device");
                let mut grads = d.grads.take().expect("gradients exist");
                grads.zero();
                let r = with_dev_types!(&mut params, &mut grads, |p, g| {
                    self.step_typed(step, p.view_mut(), g.view_mut())
                });
                let d = self.dev.as_mut().expect("still on the device");
                (d.params, d.grads) = (Some(params), Some(grads));
                r
            }
            None => {
                let mut params = std::mem::replace(&mut self.params, Flat::F32(Vec::new()));
                let mut grads = self.grads.take().expect("gradients exist");
                grads.fill_zero();
                let r = with_flat_types!(&mut params, &mut grads, |p, g| {
                    self.step_typed(step, p.view_mut(), g.view_mut())
                });
                self.params = params;
                self.grads = Some(grads);
                r
            }
        };
        let Stepped {
            loss,
            grad_norm,
            lr,
            overflow,
            non_finite,
        } = r?;
        let k = &self.kernels;
        // A GPU's step ends when its last kernel does.
        Kernels::<f32>::synchronize(k);
        k.phase("step", t0, step, 0);
        self.step += 1;
        let secs = t0.elapsed().as_secs_f64();
        // A GPU's memory is counted by its allocator (the state, the arena) plus the backend's
        // workspace; the host's (and an emulated device's) by the tracking allocator.
        let measured = match self.device_alloc.as_ref().and_then(|d| d.peak()) {
            Some(peak) => peak + self.plan.overhead,
            None => alloc::peak().saturating_sub(self.baseline),
        };
        let (mut rank_mem, mut comm_bytes, mut comm_exposed) = (Vec::new(), None, None);
        let mine = [planned, measured, self.plan.overhead];
        let all = match (&mut self.world, &mut self.dp) {
            (Some((w, small)), _) => Some(crate::small_sums::gather_mem(w.as_ref(), small, mine)?),
            (None, Some(dp)) => Some(dp.gather_mem(mine)?),
            (None, None) => None,
        };
        let (mut planned_max, mut measured_max) = (planned, measured);
        if let Some(all) = &all {
            rank_mem = rank_mems(all);
            planned_max = all.iter().map(|r| r[0]).max().unwrap_or(planned);
            measured_max = all.iter().map(|r| r[1]).max().unwrap_or(measured);
        }
        if let Some(dp) = &mut self.dp {
            comm_bytes = Some(std::mem::take(&mut dp.comm_bytes).round() as u64);
            comm_exposed = Some(std::mem::take(&mut dp.exposed).as_secs_f64() * 1e3);
            for c in &dp.spans {
                self.kernels.comm(c.name, c.start, c.end, self.step);
            }
            dp.spans.clear();
        }
        let (mut pp_bubble, mut pp_bubble_planned) = (Vec::new(), None);
        if let Some(pp) = &mut self.pp {
            for &(a, b) in &pp.waits {
                self.kernels.comm("pp.wait", a, b, self.step);
            }
            pp.waits.clear();
            pp_bubble = pp.take_bubbles()?;
            pp_bubble_planned = Some(pp.planned_bubble(self.cfg.data.grad_acc));
        }
        let tokens = self.global_batch_tokens();
        let tps = tokens as f64 / secs;
        // Every rank has this machine's peak: MFU is against all of them.
        let stages = self.pp.as_ref().map_or(1, |p| p.stages());
        let peak = self.peak_flops * (self.ranks() * self.tp_size() * stages) as f64;
        let mfu = tps * self.flops_per_token / peak;
        Ok(StepOutput {
            tokens,
            overflow,
            non_finite,
            metrics: StepMetrics {
                step: self.step,
                loss: loss.mean(),
                lr,
                grad_norm,
                tokens_per_s: tps,
                mfu,
                // HFU counts the recomputed FLOPs, MFU does not.
                hfu: tps * self.hw_flops_per_token / peak,
                step_ms: secs * 1e3,
                mem_peak_measured: measured_max,
                mem_peak_planned: planned_max,
                val_loss: None,
                loss_scale: ran_with,
                skipped: overflow.is_some() || non_finite,
                rank_mem,
                comm_bytes,
                comm_bytes_planned: self.comm_planned,
                tp_comm_bytes: self.tp.as_ref().map(|t| t.bytes.take().round() as u64),
                tp_comm_bytes_planned: self.tp_planned,
                ep_comm_bytes: self.ep.as_ref().map(|e| e.bytes.take().round() as u64),
                ep_comm_bytes_planned: self.ep_planned,
                cp_comm_bytes: self.cp.as_ref().map(|c| c.bytes.take().round() as u64),
                cp_comm_bytes_planned: self.cp_planned,
                pp_bubble,
                pp_bubble_planned,
                comm_exposed_ms: comm_exposed,
                gemm: self.gemm.clone(),
            },
        })
    }

    /// The step on typed weights and gradients: forward and backward of every micro-batch,
    /// the overflow check (fp16), clipping and AdamW. Returns the loss, the (unscaled)
    /// gradient norm, the learning rate and, for a skipped step, the loss scaler's decision.
    fn step_typed<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        params: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
    ) -> Result<Stepped> {
        // The loader never pads, so every position has a target: the loss of each micro-batch
        // is normalised by the target count of the whole step (every rank's), and summing
        // micro-batch gradients gives the gradient of the global mean loss.
        let num_targets = self.global_batch_tokens() as usize;
        // The backward's gradient reports and ZeRO-3's parameter requests both talk to the
        // data-parallel group, one after the other: they share it for the step.
        let dp = self.dp.take().map(RefCell::new);
        let out = self.step_shared(step, params, grads, dp.as_ref(), num_targets);
        self.dp = dp.map(RefCell::into_inner);
        out
    }

    fn step_shared<S: Elem, G: Elem>(
        &mut self,
        step: u64,
        mut params: ViewMut<'_, S>,
        grads: ViewMut<'_, G>,
        dp: Option<&RefCell<DataParallel>>,
        num_targets: usize,
    ) -> Result<Stepped> {
        let batch = self.batch();
        let k: &dyn Kernels<S, G> = &self.kernels;
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let mut loss = LossSum::default();
        let last_mb = self.cfg.data.grad_acc - 1;
        // ZeRO-2 and 3: the gradient buffer is this rank's shard, then the windows the
        // backward writes into (see `zero2`); otherwise it holds every gradient.
        let zero2 = self.windows.is_some();
        let (shard, full) = grads.split_at_mut(if zero2 { self.opt_len } else { 0 });
        // The shard is data parallelism's, on the host (empty without ZeRO-2).
        let shard: &mut [G] = if zero2 { shard.host_mut() } else { &mut [] };
        let windows = self.windows.clone();
        let (mut units, mut whole);
        let grads: &mut dyn GradBuf<G> = match &windows {
            // ZeRO-2 and 3 run with data parallelism, on the CPU.
            Some(w) => {
                units = w.view(full.host_mut());
                &mut units
            }
            None => {
                whole = Whole(full);
                &mut whole
            }
        };
        if self.pp.is_some() {
            let params = params.rb().host_mut();
            loss = self.pipeline_work(step, params, grads, dp, num_targets, loss_scale)?;
        } else {
            // ZeRO-3: the weights of the last step are stale in every window.
            let mut src = Source::new(params.rb(), self.zero3.as_mut(), dp, self.opt_len);
            for mb in 0..self.cfg.data.grad_acc {
                self.loader.next_into(&mut self.tokens, &mut self.targets)?;
                let (tokens, targets) = batch_views(&mut self.dev, &self.tokens, &self.targets);
                let tf = Instant::now();
                self.pool.enter(step, mb, Running::Forward);
                if let Some(w) = &windows {
                    w.clear(grads);
                }
                src.begin(false);
                let (acts, l) = self.model.forward_train_scaled(
                    k,
                    &mut self.pool,
                    src.get(),
                    grads,
                    batch,
                    &tokens,
                    &targets,
                    num_targets,
                    loss_scale,
                );
                src.check()?;
                check_groups(&self.tp, &self.ep, &self.cp)?;
                self.kernels.phase("forward", tf, step, mb);
                let tb = Instant::now();
                self.pool.enter(step, mb, Running::Backward);
                let pool = &mut self.pool;
                // Sequence parallelism leaves each rank its tokens' share of the norms'
                // gradients: summed over the group once they are final (as reduced below).
                let sp = self.model.tp.as_ref().filter(|t| t.sp);
                match dp {
                    // The last micro-batch's gradients are reduced as the backward finishes
                    // them; under ZeRO-2 and 3 every micro-batch's, since its windows are reused.
                    Some(dp) if mb == last_mb || zero2 => {
                        let mut shard = zero2.then_some(&mut *shard);
                        let done = &mut |d: GradsDone, g: &mut dyn GradBuf<G>| {
                            if let Some(tp) = sp {
                                for r in norms_of(&d).into_iter().filter(|r| !r.is_empty()) {
                                    tp.sum(g.slice_mut(r));
                                }
                            }
                            let mut sums = Sums {
                                grads: g,
                                shard: shard.as_deref_mut(),
                            };
                            let mut dp = dp.borrow_mut();
                            for r in dp.ranges(&d) {
                                dp.add(&mut sums, r);
                            }
                            // The layer window is copied into the buckets: ready for the next.
                            if let (Some(w), GradsDone::Layer(..)) = (&windows, d) {
                                w.clear_layer(sums.grads);
                            }
                        };
                        let src = src.get();
                        self.model
                            .backward_notify(k, pool, src, grads, acts, &tokens, done);
                        let mut sums = Sums {
                            grads: &mut *grads,
                            shard,
                        };
                        dp.borrow_mut().finish(&mut sums)?;
                    }
                    _ => {
                        let done = &mut |d: GradsDone, g: &mut dyn GradBuf<G>| {
                            if let (Some(tp), true) = (sp, mb == last_mb) {
                                for r in norms_of(&d).into_iter().filter(|r| !r.is_empty()) {
                                    tp.sum(g.slice_mut(r));
                                }
                            }
                        };
                        let src = src.get();
                        self.model
                            .backward_notify(k, pool, src, grads, acts, &tokens, done);
                    }
                }
                src.check()?;
                check_groups(&self.tp, &self.ep, &self.cp)?;
                self.pool.enter(step, mb, Running::Idle);
                self.kernels.phase("backward", tb, step, mb);
                loss.sum += l.sum;
                loss.count += l.count;
            }
        }
        // The micro-batches are done: no activations until the next step.
        if let Some(a) = &mut self.pool.arena {
            a.trim();
        }
        if injected_nan(step) && self.dev.is_none() {
            let nan = G::from_f32(f32::NAN);
            match zero2 {
                true => shard[0] = nan,
                false => grads.slice_mut(0..1).host_mut()[0] = nan,
            }
        }
        self.update(step, params, &*grads, shard, dp, loss)
    }

    /// The first tensor whose gradient on this rank is not finite, in the order the backward
    /// produces them (the output end first), by name: where a run of skipped steps went wrong.
    /// `None` when this rank holds no such gradient, or holds its gradients on a device.
    pub fn non_finite_gradient(&self) -> Option<String> {
        let grads = self.grads.as_ref()?;
        let zero2 = self.windows.is_some();
        self.model.params.entries.iter().rev().find_map(|e| {
            let r = e.range();
            let bad = self.runs.iter().any(|run| {
                let (lo, hi) = (run.params.start.max(r.start), run.params.end.min(r.end));
                // Under ZeRO-2 and 3 the reduced gradients are in the shard, at the run's offset.
                let at = if zero2 {
                    run.at + lo - run.params.start
                } else {
                    lo
                };
                lo < hi
                    && grads
                        .to_f32(at..at + hi - lo)
                        .iter()
                        .any(|x| !x.is_finite())
            });
            bad.then(|| e.name.clone())
        })
    }

    /// Tokens of one optimizer step over all data-parallel ranks (under context parallelism
    /// the dp × cp ranks, each holding 1/cp of its sequences).
    pub fn global_batch_tokens(&self) -> u64 {
        let ranks = self.dp.as_ref().map_or(1, |d| d.size()) as u64;
        let b = self.batch();
        self.cfg.data.grad_acc * (b.b * b.t) as u64 * ranks
    }

    /// The memory timeline's samples so far (`None` when it is off).
    pub fn timeline_samples(&self) -> Option<&[Sample]> {
        self.pool.timeline.as_ref().map(|t| t.samples())
    }

    /// Whether the timeline has recorded all its steps.
    pub fn timeline_complete(&self) -> bool {
        self.pool
            .timeline
            .as_ref()
            .is_some_and(|t| !t.records(self.step + 1))
    }

    /// Stops recording the memory timeline (a resumed run has no step 1 to compare).
    pub fn disable_timeline(&mut self) {
        self.pool.timeline = None;
    }

    /// The trace once its steps (and any evaluation after the last of them) are done, or now
    /// with `force`; `None` when there is nothing (more) to write.
    pub fn finish_trace(&mut self, force: bool) -> Option<Vec<Event>> {
        if self.kernels.is_on() && (self.trace_left == 0 || force) {
            self.kernels.stop();
            self.trace_left = 0;
            Some(self.kernels.take())
        } else {
            None
        }
    }

    /// The blocks of every parameter's states this rank holds, each as (range of every
    /// parameter of the whole model, offset in this rank's optimizer states): its ZeRO shard,
    /// else all of them; under tensor parallelism, of its slice.
    pub fn held_blocks(&self) -> Vec<(Range<usize>, usize)> {
        let local = match self.sharded() {
            true => self.runs.iter().map(|r| (r.params.clone(), r.at)).collect(),
            false => vec![(0..self.model.params.total, 0)],
        };
        self.to_whole(local, false)
    }

    /// The blocks this rank writes into a checkpoint: those it holds when ZeRO shards them,
    /// else (every rank holding all of them) its even share, so every rank writes; a
    /// replicated norm only by the first rank of its tensor-parallel group. Each block is
    /// (range of the whole model's parameters, offset in this rank's states, offset in its
    /// weights).
    pub fn written_blocks(&self) -> Vec<(Range<usize>, usize, usize)> {
        let local = match (self.sharded(), &self.dp) {
            (true, _) => self.runs.iter().map(|r| (r.params.clone(), r.at)).collect(),
            // Expert parallelism: the dense weights shared out over every replica, each
            // rank's experts over the ranks holding them.
            (false, Some(dp)) if self.ep.is_some() => {
                let (dense, experts) = self.dense_and_experts();
                let (xr, xn) = dp.expert_rank();
                let mut out = even_share(&dense, self.rank(), self.ranks());
                out.extend(even_share(&experts, xr, xn));
                out.into_iter().map(|r| (r.clone(), r.start)).collect()
            }
            (false, _) => {
                let (n, p, r) = (self.model.params.total, self.ranks(), self.rank());
                let part = n * r / p..n * (r + 1) / p;
                vec![(part.clone(), part.start)]
            }
        };
        let weights_at = |(whole, at): (Range<usize>, usize)| {
            // ZeRO-3 holds only its shard of the weights, at the states' offsets; otherwise
            // the weights are where the states would be without ZeRO.
            let w = match self.zero3.is_some() {
                true => at,
                false => self.local_of(&whole),
            };
            (whole, at, w)
        };
        self.to_whole(local, true)
            .into_iter()
            .filter(|(r, _)| !r.is_empty())
            .map(weights_at)
            .collect()
    }

    /// Blocks of this rank's flat parameters as blocks of the whole model's (the identity
    /// without tensor parallelism). `writing` leaves replicated norms to tensor-parallel
    /// rank 0.
    fn to_whole(
        &self,
        local: Vec<(Range<usize>, usize)>,
        writing: bool,
    ) -> Vec<(Range<usize>, usize)> {
        let Some(part) = self.model.part() else {
            return local;
        };
        let pieces = match writing {
            true => self.written_pieces(),
            false => part.pieces.to_vec(),
        };
        let mut out = Vec::new();
        for (r, at) in local {
            for (l, f) in &pieces {
                let (a, b) = (r.start.max(l.start), r.end.min(l.end));
                if a >= b {
                    continue;
                }
                let w = f.start + (a - l.start);
                out.push((w..w + (b - a), at + (a - r.start)));
            }
        }
        out
    }

    /// Where parameter `whole.start` of the whole model sits in this rank's flat parameters.
    fn local_of(&self, whole: &Range<usize>) -> usize {
        let Some(part) = self.model.part() else {
            return whole.start;
        };
        part.pieces
            .iter()
            .find(|(_, f)| f.contains(&whole.start))
            .map(|(l, f)| l.start + (whole.start - f.start))
            .expect("a block of this rank's parameters")
    }

    /// Elements of this rank's optimizer states.
    pub fn states_len(&self) -> usize {
        self.opt_len
    }

    /// Whether ZeRO shards the optimizer states over the ranks.
    fn sharded(&self) -> bool {
        self.dp.as_ref().is_some_and(|d| d.shard().is_some())
    }

    /// This rank's data-parallel rank (0 alone).
    pub fn rank(&self) -> usize {
        self.dp.as_ref().map_or(0, |d| d.rank())
    }

    /// Data-parallel ranks (1 alone).
    pub fn ranks(&self) -> usize {
        self.dp.as_ref().map_or(1, |d| d.size())
    }

    /// Tensor-parallel ranks (1 without tensor parallelism).
    pub fn tp_size(&self) -> usize {
        self.tp.as_ref().map_or(1, |t| t.size())
    }

    /// The whole model (this rank's is a slice of it under tensor parallelism), for sampling
    /// with [`Trainer::full_weights`].
    pub fn whole_model(&self) -> Llama {
        Llama::new(self.model.full_config().clone())
    }

    /// The whole model's parameter table (this rank's under tensor parallelism is its slice's).
    pub fn whole_params(&self) -> &ferrotron_engine::model::ParamTable {
        self.model.whole_table()
    }

    /// Waits for every rank (nothing alone).
    pub fn barrier(&self) -> Result<()> {
        match (&self.world, &self.dp) {
            (Some((w, _)), _) => w.barrier().map_err(|e| anyhow::anyhow!("barrier: {e}")),
            (None, Some(d)) => d.barrier(),
            (None, None) => Ok(()),
        }
    }

    /// This rank's place among every rank (the data-parallel rank without tensor parallelism).
    pub fn world_rank(&self) -> usize {
        match &self.world {
            Some((w, _)) => w.rank(),
            None => self.rank(),
        }
    }

    /// Ranks of the whole job (every data-, tensor- and pipeline-parallel rank).
    pub fn world_size(&self) -> usize {
        match &self.world {
            Some((w, _)) => w.size(),
            None => self.ranks(),
        }
    }

    /// Every weight, as f32 (under ZeRO-3 gathered: every rank must call it).
    pub fn full_weights(&mut self) -> Result<Vec<f32>> {
        let n = self.model.params.total;
        let mine = match (&mut self.dp, &self.zero3) {
            (Some(dp), Some(_)) => {
                let saved = dp.counters();
                let w = gather_weights(dp, &self.params, self.opt_len, n)?;
                dp.set_counters(saved);
                w
            }
            _ => self.params.to_f32(0..n),
        };
        let Some(part) = self.model.part() else {
            return Ok(mine);
        };
        // Every rank's part put together: the first data-parallel replica writes each piece
        // once (a replicated norm from tensor-parallel rank 0, a tied embedding from the first
        // stage) into zeros, and the world sums them (adding zeros is exact).
        let mut whole = vec![0.0; part.whole.total];
        // Under expert parallelism each rank's experts come from the first of the ranks
        // holding them.
        let experts = expert_ranges(&self.model.params);
        let expert_first = self.dp.as_ref().is_none_or(|d| d.expert_rank().0 == 0);
        for (l, f) in self.written_pieces() {
            let expert = experts.binary_search_by_key(&l.start, |r| r.start).is_ok();
            let first = match (&self.ep, expert) {
                (Some(_), true) => expert_first,
                _ => self.rank() == 0,
            };
            if first {
                whole[f].copy_from_slice(&mine[l]);
            }
        }
        let (world, _) = self
            .world
            .as_ref()
            .expect("a model split over ranks has a world");
        world
            .all_reduce_sum(whole.view_mut())
            .map_err(|e| anyhow::anyhow!("gathering the weights: {e}"))?;
        Ok(whole)
    }

    /// This rank's parameter ranges: the dense ones (merged where adjacent) and its experts'.
    fn dense_and_experts(&self) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let experts = expert_ranges(&self.model.params);
        let mut dense: Vec<Range<usize>> = Vec::new();
        let mut at = 0;
        for x in experts
            .iter()
            .chain([&(self.model.params.total..self.model.params.total)])
        {
            if at < x.start {
                dense.push(at..x.start);
            }
            at = x.end;
        }
        (dense, experts)
    }

    /// The pieces (local range, whole range) of this rank's part that it writes: all of them
    /// but a replicated norm on tensor-parallel ranks after the first and the last stage's copy
    /// of a tied embedding.
    fn written_pieces(&self) -> Vec<(Range<usize>, Range<usize>)> {
        let Some(part) = self.model.part() else {
            let n = self.model.params.total;
            return vec![(0..n, 0..n)];
        };
        let tp_rank = self.model.tp.as_ref().map_or(0, |t| t.rank);
        let copied = self.model.copied().unwrap_or(0..0);
        part.pieces
            .iter()
            .filter(|(l, _)| !(tp_rank > 0 && tpar::is_replicated(&self.model, l)))
            .filter(|(l, _)| !(copied.contains(&l.start)))
            .cloned()
            .collect()
    }

    /// Takes the weights of every parameter (a checkpoint's, `--init-from`'s); under ZeRO-3
    /// keeps this rank's shard of them.
    pub fn set_weights(&mut self, full: Flat) {
        let full = match self.model.part() {
            // This rank's part, in the storage type (widened and rounded back exactly).
            Some(_) => {
                let dtype = full.dtype();
                Flat::from_f32(dtype, &tpar::slice_of(&self.model, &full.into_f32()))
            }
            None => full,
        };
        self.params = match &self.zero3 {
            Some(z) => {
                let shard = shard_of(&self.runs, self.opt_len + z.len(), &full.into_f32());
                Flat::from_f32(self.params.dtype(), &shard)
            }
            None => full,
        };
    }

    /// Takes this rank's part of the optimizer states (and master weights), as `held_blocks`
    /// lays them out (what `checkpoint::load_optimizer` reads).
    pub fn set_states(&mut self, opt: AdamState, master: Option<Vec<f32>>) {
        self.opt = Some(opt);
        if master.is_some() {
            self.master = master;
        }
    }

    /// Takes the fp32 master weights of every parameter (under ZeRO, keeps this rank's shard).
    pub fn set_master(&mut self, full: Vec<f32>) {
        self.master = Some(self.own_part(full));
    }

    /// This rank's part of a state of every parameter: all of it, or under ZeRO its shard.
    fn own_part(&self, full: Vec<f32>) -> Vec<f32> {
        match self.sharded() {
            true => shard_of(&self.runs, self.opt_len, &full),
            false => full,
        }
    }

    /// Whether Adam's moments exist (from the first optimizer step on), wherever they live.
    fn has_opt(&self) -> bool {
        match &self.dev {
            Some(d) => d.opt.is_some(),
            None => self.opt.is_some(),
        }
    }

    /// Moves the weights, master weights and any optimizer states to the device the run
    /// chose (nothing on the CPU): called once they are initialised or loaded. From then on
    /// the host holds none of them, as it would not on a GPU.
    pub fn to_device(&mut self) -> Result<()> {
        let Some(alloc) = self.device_alloc.clone() else {
            return Ok(());
        };
        let n = self.tokens.len();
        let e = anyhow::Error::msg;
        let params = Some(DevFlat::from_host(&alloc, &self.params)?);
        let master = (self.master.take())
            .map(|m| DeviceBuf::from_host(&alloc, &m).map_err(e))
            .transpose()?;
        let opt = (self.opt.take())
            .map(|o| -> Result<_> {
                let m = DeviceBuf::from_host(&alloc, &o.m).map_err(e)?;
                Ok((m, DeviceBuf::from_host(&alloc, &o.v).map_err(e)?))
            })
            .transpose()?;
        self.params = Flat::zeros(self.params.dtype(), 0);
        self.dev = Some(DeviceState {
            params,
            master,
            grads: None,
            opt,
            tokens: DeviceBuf::zeros(&alloc, n).map_err(e)?,
            targets: DeviceBuf::zeros(&alloc, n).map_err(e)?,
        });
        Ok(())
    }

    /// Runs `f` with the weights, master weights and optimizer states on the host (copied
    /// from the device for it, and dropped after, when the run is on one): a checkpoint or a
    /// sample reads them there.
    pub fn with_host_state<R>(&mut self, f: impl FnOnce(&mut Trainer) -> R) -> R {
        let Some(d) = &self.dev else {
            return f(self);
        };
        let dtype = self.params.dtype();
        self.params = d
            .params
            .as_ref()
            .expect("the weights are on the device")
            .to_host();
        self.master = d.master.as_ref().map(DeviceBuf::to_host);
        self.opt = (d.opt.as_ref()).map(|(m, v)| AdamState {
            m: m.to_host(),
            v: v.to_host(),
        });
        let r = f(self);
        self.params = Flat::zeros(dtype, 0);
        (self.master, self.opt) = (None, None);
        r
    }

    /// Kernel workspace included in the plan (see `workspace`).
    pub fn kernel_workspace(&self) -> u64 {
        self.plan.overhead
    }

    /// Planned peak bytes of step 1 (no optimizer states yet) or any later step.
    /// Adds to this rank's memory plan a buffer of `bytes` live from before the first step to
    /// the end (a checkpoint's staging buffer), which the caller allocates now.
    pub fn plan_persistent(&mut self, name: &str, bytes: u64) {
        use ferrotron_plan::memory::{Category, Op};
        let plan = &mut self.plan;
        let id = plan.plan.add(
            name,
            ferrotron_plan::DType::U8,
            bytes,
            Category::CommBuffers,
        );
        plan.plan.program.insert(0, Op::Alloc(id));
        plan.sweep = plan.plan.sweep();
        plan.at_peak = plan.sweep.at_peak;
        plan.peak += bytes;
        for p in &mut self.planned_peak {
            *p += bytes;
        }
    }

    pub fn planned_peak_step(&self, step: u64) -> u64 {
        self.planned_peak[(step > 1) as usize]
    }

    /// Planned peak bytes of a step with optimizer states present (the steady-state step).
    pub fn planned_peak(&self) -> u64 {
        self.planned_peak[1]
    }
}
