//! The training loop of one rank: micro-batches with gradient accumulation, global-norm
//! clipping, AdamW with a warm-up + cosine schedule, validation, and the measured memory of
//! every step against the plan.

use crate::config::TrainConfig;
use crate::data::{Loader, ValLoader};
use crate::device::state::{DevFlat, DeviceState};
use crate::device::Machine;
use crate::memory::alloc;
use crate::memory::arena::Arena;
use crate::memory::pool::{PlanPool, Point, Running, Sample, Timeline};
use crate::memory::resident::Resident;
use crate::memory::workspace::{self, KernelWorkspace};
use crate::observe::metrics::{RankMem, StepMetrics};
use crate::observe::trace::{Event, Tracing};
use crate::optim::loss_scale::{DynamicLossScaler, ScaleUpdate};
use crate::optim::lr::LrSchedule;
use crate::optim::offload::Offloaded;
pub use crate::optim::step::AdamState;
use crate::optim::step::{adamw, grad_scale, OptRun, States};
use crate::setup::{checked_plan, planned_bytes, recompute_flops_per_token};
use crate::weights::Flat;
use crate::{with_dev_types, with_flat_types};
use anyhow::{bail, Result};
use ferrotron_dist::data_parallel::{expert_ranges, Buckets, DataParallel, Gather, Segment};
use ferrotron_dist::grad_sync::GradLayout;
use ferrotron_dist::group::Group;
use ferrotron_dist::mesh::Mesh;
use ferrotron_dist::pipeline::Pipeline;
use ferrotron_dist::tensor_parallel as tpar;
use ferrotron_dist::zero::zero2::GradWindows;
use ferrotron_dist::zero::zero3::{Source, Zero3};
use ferrotron_dist::{Communicator, Dim, Region};
use ferrotron_engine::kernels::{
    AdamWParams, AsView, AsViewMut, Backend, CpuKernels, DeviceAlloc, DeviceBuf, Kernels, Rounding,
    View, ViewMut,
};
use ferrotron_engine::model::{
    BatchShape, ContextParallel, CpComm, EpComm, ExpertParallel, GradBuf, GradsDone, Llama,
    LlamaConfig, LossSum, Stage, TensorParallel, TpComm,
};
use ferrotron_engine::Elem;
use ferrotron_plan::arena::{with_region, ArenaLayout};
use ferrotron_plan::flops::model_flops_per_token;
use ferrotron_plan::memory::Phase;
use ferrotron_plan::Precision;
use ferrotron_plan::{ModelSpec, RankPlan};
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

mod assemble;
pub(crate) mod cuda_graph;
mod evaluate;
mod host_state;
mod host_transfer;
mod memory_report;
mod offload_states;
mod pipeline_step;
mod state;
mod step;
mod step_schedule;
mod stream_step;
mod train_step;
mod update;
mod zero_gather;

use crate::device::ranks::ViewGather;
use assemble::{initial_host_bytes, initial_values, initial_weights, open_backend};
use assemble::{peak_flops, plan_pool, rank_mesh, router_on_device};
use assemble::{rank_tables, Opened, Tables};
use memory_report::{measure_workspace, on_device, rank_mems, step_peaks, trace_capacity};
use step_schedule::StepSchedule;
use zero_gather::{fill_shard, gather_weights, shard_of};

/// A rank's communicators: its data-parallel group, its tensor-parallel group, and (with
/// tensor parallelism) the world, over which every rank's memory is reported.
#[derive(Default)]
pub struct Comms {
    pub dp: Option<Box<dyn Communicator>>,
    pub tp: Option<Rc<Group>>,
    /// The rank's pipeline group and its stage's program.
    pub pp: Option<Pipeline>,
    pub world: Option<Box<dyn Communicator>>,
    /// Expert parallelism: the rank's expert-parallel group, and the ranks holding the same
    /// experts (its data-parallel replicas; `None` without any), over which the experts'
    /// gradients are summed (`dp` is then every dense replica).
    pub ep: Option<Rc<Group>>,
    pub dp_experts: Option<Box<dyn Communicator>>,
    /// Context parallelism: the rank's ring (`dp` is then every dp × cp replica).
    pub cp: Option<Rc<Group>>,
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
    pub master: Option<Region<f32>>,
    /// Gradients (storage type, or f32 with `--fp32-grad-acc`), created by the first step.
    pub grads: Option<Flat>,
    pub opt: Option<AdamState>,
    /// `--offload optimizer`: the master weights and moments in host memory or on disk
    /// (then `master` and `opt` stay empty while training).
    offload: Option<Offloaded>,
    /// `--offload params`: the weights and gradients in host memory, streamed through the
    /// device's windows (then `dev.params` and `dev.grads` hold only the windows).
    streaming: Option<crate::offload_params::Streaming>,
    /// Offload on a device: the device as the offload tiers copy through it, counting the
    /// bytes (`host_transfer.rs`).
    transfers: Option<Arc<ferrotron_engine::kernels::transfer_count::Counted>>,
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
    /// The rank's resident regions, at the plan's offsets: the communication buffers, Adam's
    /// moments (made by the first optimizer step) and the gradients (by the first step). The
    /// weights' region is carved whole by `new` and lives in `params` and `master`.
    resident: Resident,
    moments: Resident,
    grad_region: Resident,
    pub schedule: LrSchedule,
    /// What the optimizer updates on this rank (every tensor, or the ZeRO-1 shard), and whether
    /// weight decay applies (matrices yes; norms, biases no).
    runs: Vec<OptRun>,
    /// Elements of the optimizer states on this rank.
    opt_len: usize,
    /// The gradient buffer's layout: every gradient, or (ZeRO-2 and 3) this rank's shard of
    /// the reduced gradients then the windows of one unit's backward.
    grad_layout: GradLayout,
    /// The parameters' gatherer (ZeRO-3: the parameters are this rank's shard, then the
    /// windows units are gathered into; `None`: `params` holds every weight).
    gather: Option<Zero3>,
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
    /// On a device: what the host holds beyond the offload tier, for the RSS bound.
    pub device_host: Option<crate::fit::DeviceHost>,
    /// Steps still to trace (`--trace-steps`, counted from this run's first step).
    trace_left: u64,
    /// This rank's groups in every parallel dimension.
    pub mesh: Mesh,
    /// The order of the step's forward and backward work, chosen from the layout once.
    step_schedule: StepSchedule,
    /// `--cuda-graph`: the micro-batch captured into a CUDA graph and replayed.
    graph: Option<cuda_graph::MicroBatchGraph>,
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
    if asked("FERROTRON_TEST_STALL", rank, step) {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

/// The test-only switch `FERROTRON_TEST_FAIL=RANK:STEP`: that rank fails at the start of that
/// step with an error (a rank that dies while the others wait for it): the tests that the job
/// ends with its error, not in a hang.
fn fail_if_asked(rank: usize, step: u64) -> Result<()> {
    match asked("FERROTRON_TEST_FAIL", rank, step) {
        true => bail!("rank {rank}: failed at step {step}, as FERROTRON_TEST_FAIL asked"),
        false => Ok(()),
    }
}

/// Whether test switch `var` (`RANK:STEP`) names this rank and step.
fn asked(var: &str, rank: usize, step: u64) -> bool {
    std::env::var(var).is_ok_and(|v| {
        v.split_once(':')
            .is_some_and(|(r, s)| r.parse() == Ok(rank) && s.parse() == Ok(step))
    })
}

/// What the typed step computed.
struct Stepped {
    loss: LossSum,
    grad_norm: f64,
    lr: f64,
    overflow: Option<ScaleUpdate>,
    non_finite: bool,
}

/// The micro-batch's token ids and targets where the step reads them: the loader's host
/// buffers, or on the device, copied there first.
fn batch_views<'a>(
    k: &Tracing<Backend>,
    dev: &'a mut Option<DeviceState>,
    tokens: &'a [u32],
    targets: &'a [u32],
) -> (View<'a, u32>, View<'a, u32>) {
    match dev {
        Some(d) => {
            d.tokens.copy_from_host(tokens);
            d.targets.copy_from_host(targets);
            // The ids came from here: a GPU groups the tokens for the embedding backward and
            // counts the targets from this copy, not by reading them back (issue #32).
            let k: &dyn Kernels<f32> = k;
            k.host_ids(d.tokens.view(), tokens);
            k.host_ids(d.targets.view(), targets);
            (d.tokens.view(), d.targets.view())
        }
        None => (tokens.view(), targets.view()),
    }
}

impl Trainer {
    /// Builds the model and its parameters. Call after the data and tokenizer exist, so that
    /// they fall into the baseline, which is taken once the rank's tables are built: what is
    /// allocated after it is what the plan lists.
    pub fn new(
        cfg: TrainConfig,
        spec: ModelSpec,
        llama: LlamaConfig,
        loader: Loader,
        val: Option<ValLoader>,
        mut comms: Comms,
        machine: Machine,
    ) -> Result<Self> {
        let peak_gflops = machine.peak_gflops;
        let tp_size = comms.tp.as_ref().map_or(1, |t| t.size());
        let opened = open_backend(&cfg, &llama, machine, tp_size)?;
        let Tables {
            mut model,
            plan,
            kernel_workspace,
            gpu,
            st,
        } = rank_tables(&spec, &cfg, llama, &mut comms, &opened)?;
        let Opened {
            kernels,
            device_alloc,
            gemm,
            trace_left,
            mut timeline,
            n,
            ..
        } = opened;
        // The baseline: the process's tables are built, none of the plan's buffers is (see
        // `rank_tables`). From here on everything allocated is one of them.
        let baseline = alloc::live();
        if let Some(t) = &mut timeline {
            t.set_baseline(baseline);
        }
        model.build_rope();
        let init = initial_values(&cfg, &model);
        router_on_device(&model, device_alloc.as_ref())?;
        let opt_len = plan.states.opt as usize;
        // The other in-flight micro-batches' batches (the plan's `data.tokens@s`).
        let extra = comms.pp.as_ref().map_or(0, |p| p.slots_of(0) as usize - 1);
        let batches = (0..extra).map(|_| (vec![0; n], vec![0; n])).collect();
        let ([resident, moments, mut weights, grad_region], layouts) = Resident::all(&plan.plan)?;
        // On a device the states are the device allocator's: the host's copy is moved there.
        let home = device_alloc.is_none().then_some(&mut weights);
        let device_host = device_alloc.is_some().then(|| crate::fit::DeviceHost {
            init_bytes: initial_host_bytes(&cfg, &model, &st, opt_len, init.len()),
            device_is_host: gpu
                .as_ref()
                .is_some_and(|g| g.1.contains(crate::device::EMULATED_GPU)),
        });
        let (params, master) = initial_weights(&cfg, &st, opt_len, init, home);
        let mesh = rank_mesh(comms, st.dp, &spec, &cfg, kernel_workspace.max())?;
        let (arena, placed) = Arena::of_plan(&plan.plan, model.config.layers)?;
        let flops_per_token = model_flops_per_token(&spec, cfg.data.seq);
        let hw_flops_per_token =
            flops_per_token + recompute_flops_per_token(&spec, cfg.data.seq, cfg.runtime.recompute);
        let mut t = Self {
            planned_peak: step_peaks(
                &plan,
                &on_device(layouts, device_alloc.as_ref()),
                &placed,
                kernel_workspace,
            ),
            plan,
            tokens: vec![0; n],
            targets: vec![0; n],
            batches,
            kernels,
            dev: None,
            device_alloc: None,
            grads: None,
            master,
            scaler: (cfg.precision.kind == Precision::Fp16)
                .then(|| DynamicLossScaler::new(cfg.precision.loss_scale)),
            opt: None,
            offload: None,
            streaming: None,
            transfers: None,
            step: 0,
            pool: plan_pool(timeline, arena),
            resident,
            moments,
            grad_region,
            trace_left,
            graph: cfg
                .runtime
                .cuda_graph
                .then(cuda_graph::MicroBatchGraph::default),
            step_schedule: StepSchedule::of(&mesh),
            mesh,
            runs: st.runs,
            opt_len,
            grad_layout: GradLayout::new(st.windows, opt_len),
            gather: st.zero3,
            schedule: LrSchedule::of(&cfg),
            flops_per_token,
            hw_flops_per_token,
            peak_flops: peak_flops(&gpu, peak_gflops, machine.gpu_share),
            gemm: gpu.as_ref().map_or(gemm, |g| g.1.clone()),
            baseline,
            device_host,
            params,
            model,
            spec,
            loader,
            val,
            cfg,
        };
        t.place_on(device_alloc);
        t.nccl_groups(&machine)?;
        Ok(t)
    }

    /// The pipeline's send and receive buffers, as planned (with the gradients, or by an
    /// evaluation before the first step): from the resident region, once.
    fn allocate_pipeline(&mut self) {
        let r = &mut self.resident;
        let Some(pp) = self.mesh.pp.as_mut().filter(|_| !r.taken("comm.pp.recv")) else {
            return;
        };
        let Some(mut recv) = r.carve("comm.pp.recv", 1) else {
            return;
        };
        let sends = ["forward", "backward"].map(|d| {
            let one = |j| r.carve(&format!("comm.pp.send.{d}.{j}"), 1);
            (0..).map_while(one).flatten().collect()
        });
        pp.allocate(sends, recv.remove(0));
    }

    /// A micro-batch on this rank: under context parallelism its share of each sequence.
    fn batch(&self) -> BatchShape {
        BatchShape {
            b: self.cfg.data.mbs as usize,
            t: (self.cfg.data.seq / self.cfg.parallel.cp) as usize,
        }
    }

    /// The first tensor whose gradient on this rank is not finite, in the order the backward
    /// produces them (the output end first), by name: where a run of skipped steps went wrong.
    /// `None` when this rank holds no such gradient, or holds its gradients on a device.
    pub fn non_finite_gradient(&self) -> Option<String> {
        let grads = self.grads.as_ref()?;
        let zero2 = self.grad_layout.windows().is_some();
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
        let ranks = self.mesh.replicas() as u64;
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

    /// This rank's data-parallel rank (0 alone).
    pub fn rank(&self) -> usize {
        self.mesh.replica()
    }

    /// Data-parallel ranks (1 alone).
    pub fn ranks(&self) -> usize {
        self.mesh.replicas()
    }

    /// Tensor-parallel ranks (1 without tensor parallelism).
    pub fn tp_size(&self) -> usize {
        self.mesh.size(Dim::Tp)
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
        self.mesh.barrier()
    }

    /// This rank's place among every rank (the data-parallel rank without tensor parallelism).
    pub fn world_rank(&self) -> usize {
        match self.mesh.world() {
            Some(w) => w.rank(),
            None => self.rank(),
        }
    }

    /// Ranks of the whole job (every data-, tensor- and pipeline-parallel rank).
    pub fn world_size(&self) -> usize {
        match self.mesh.world() {
            Some(w) => w.size(),
            None => self.ranks(),
        }
    }
}
