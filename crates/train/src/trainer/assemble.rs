//! What [`Trainer::new`] assembles, piece by piece, in the order the memory accounting needs
//! (the backend, the observability buffers and the rank's tables — its model's, its plan, its
//! states' layout — before the baseline, every buffer the plan lists after): the backend, the
//! rank's model, data parallelism's buckets and ZeRO shard, the runs of parameters the
//! optimizer updates, the initial weights, the mesh.

use super::*;
use ferrotron_plan::dp_layout::StateLens;
use ferrotron_plan::DType;

/// The backend a rank runs on, and what was measured or reserved before the baseline.
pub(super) struct Opened {
    pub kernels: Tracing<Backend>,
    pub device_alloc: Option<Arc<dyn DeviceAlloc>>,
    /// The CPU kernels' workspace, measured (a GPU's is its own: `gpu_workspace`).
    pub kernel_workspace: KernelWorkspace,
    pub gemm: String,
    pub trace_left: u64,
    pub timeline: Option<Timeline>,
    /// This rank's tokens of a micro-batch, and the cross-entropy's chunk.
    pub n: usize,
    pub chunk: usize,
}

/// cuBLASLt's fp8 products read their operands with leading dimensions that are multiples of
/// 16 (Hopper's rule): every layer width of this rank's shard must be one.
fn fp8_widths(c: &LlamaConfig) -> Result<()> {
    let widths = [
        ("hidden", c.hidden),
        ("heads x head_dim", c.heads * c.head_dim),
        ("kv_heads x head_dim", c.kv_heads * c.head_dim),
        ("intermediate", c.intermediate),
    ];
    match widths.iter().find(|(_, w)| w % 16 != 0) {
        Some((name, w)) => anyhow::bail!("precision = fp8: the GPU's fp8 products need every layer width a multiple of 16, and this rank's {name} is {w}: use --precision bf16 on the GPU, or fp8 on the CPU"),
        None => Ok(()),
    }
}

/// Opens the backend of `machine` for `llama` split over `tp_size` ranks: kernels warmed up,
/// the workspace measured, the trace and the memory timeline reserved (all before the
/// baseline).
pub(super) fn open_backend(
    cfg: &TrainConfig,
    llama: &LlamaConfig,
    machine: crate::device::Machine,
    tp_size: usize,
) -> Result<Opened> {
    let device = machine.device;
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
    let local = ferrotron_engine::model::tensor_parallel::shard_config(llama, tp_size)?;
    let chunk = cfg.runtime.ce_chunk as usize;
    // The CPU kernels' workspace, measured (a GPU's is its own: `gpu_workspace` below).
    let kernel_workspace = match device {
        crate::device::Device::Cuda => KernelWorkspace::default(),
        _ => measure_workspace(&cpu, cfg.precision.kind, &local, n, chunk),
    };
    let gemm = cpu.gemm.describe();
    let (backend, device_alloc) = crate::device::open(device, machine.gpu, cpu)?;
    // What the chosen backend runs (the CPU's limits were checked with the config).
    let limits = Kernels::<f32>::limits(&backend);
    llama
        .check_backend(limits)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if limits.backend == "CUDA" && cfg.precision.kind == Precision::Fp8 {
        fp8_widths(&local)?;
    }
    if cfg.runtime.cuda_graph {
        super::cuda_graph::check_model(llama)?;
    }
    if limits.backend == "CUDA" && cfg.observability.memory_timeline.is_some() {
        anyhow::bail!("memory_timeline: the timeline samples the host's heap, not the GPU's memory; drop --memory-timeline with --device cuda");
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
        kernels.start(trace_capacity(cfg, llama, trace_left));
        kernels.stop();
    }
    // Without the tracking allocator there is nothing to sample.
    let timeline = (cfg.observability.memory_timeline.is_some()
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
    Ok(Opened {
        kernels,
        device_alloc,
        kernel_workspace,
        gemm,
        trace_left,
        timeline,
        n,
        chunk,
    })
}

/// What a rank builds before its memory baseline: the process's tables, and no buffer its
/// plan lists. Everything the plan lists is allocated after the baseline, so the measured
/// peak counts the plan's buffers and nothing the plan was built from (the plan before the
/// allocation).
pub(super) struct Tables {
    /// The rank's model: its parameter table, its stage's and its slices' maps; its RoPE
    /// table (the plan's `rope.cos`, `rope.sin`) is built after the baseline.
    pub model: Llama,
    pub plan: RankPlan,
    /// The kernel workspace the plan includes (a GPU's own on a GPU).
    pub kernel_workspace: KernelWorkspace,
    pub gpu: GpuWorkspace,
    /// Data parallelism's bucket layout and shards, ZeRO's windows, the optimizer's runs.
    pub st: PlannedStates,
}

/// The rank's [`Tables`]: its model, its plan (the model checked against it) and the states'
/// layout in the plan's lengths, over `o`'s backend; takes the data-parallel communicators
/// out of `comms`.
///
/// Why the model's RoPE table is left out rather than the plan built from the spec before the
/// model: the model build is where the parameter map and the stage tables come from, which
/// are tables like the plan, so whatever the order of plan and model one planned buffer of the
/// build would still fall before the baseline; the table is the model's only buffer, so
/// building it apart ([`Llama::tables`], then [`Llama::build_rope`]) is the one split needed,
/// and the plan keeps checking the model it describes as it is built.
pub(super) fn rank_tables(
    spec: &ModelSpec,
    cfg: &TrainConfig,
    llama: LlamaConfig,
    comms: &mut Comms,
    o: &Opened,
) -> Result<Tables> {
    // This rank's place in its tensor-parallel group (with the tables mapping its slices
    // onto the whole model).
    let tp_rank = tensor_parallel_rank(&llama, comms.tp.as_ref(), cfg.parallel.sp)?;
    let mut model = rank_model(cfg, llama, comms, tp_rank)?;
    let stage = comms.pp.as_ref().map_or(0, |p| p.stage);
    let at = (o.n, o.chunk, stage);
    let on_device = o.device_alloc.is_some();
    let (kernels, ws) = (&o.kernels, o.kernel_workspace);
    let (plan, kernel_workspace, gpu) =
        rank_plan(spec, cfg, kernels, &mut model, ws, at, on_device)?;
    if let Some(pp) = &comms.pp {
        crate::setup::check_slots(&plan, pp, model.config.layers)?;
    }
    // Plan first: every state's length and the buckets' are the plan's; the trainer lays
    // the engine's parameters into them (and refuses a model the plan did not count).
    let dp = comms.dp.take().map(|c| (c, comms.dp_experts.take()));
    let st = planned_states(cfg, &model, dp, comms.ep.is_some(), &plan.states)?;
    Ok(Tables {
        model,
        plan,
        kernel_workspace,
        gpu,
        st,
    })
}

/// The rank's mesh: its groups (`comms`' with data parallelism's `dp`, which the states'
/// layout holds), with what each sends per step as planned for its stage (one rank alone
/// sends nothing: no estimate); `kernel_workspace`: the plan's.
pub(super) fn rank_mesh(
    comms: Comms,
    dp: Option<DataParallel>,
    spec: &ModelSpec,
    cfg: &TrainConfig,
    kernel_workspace: u64,
) -> Result<Mesh> {
    let stage = comms.pp.as_ref().map_or(0, |p| p.stage);
    let (tp, ep, cp, pp, world) = (comms.tp, comms.ep, comms.cp, comms.pp, comms.world);
    let mut mesh = Mesh::new(tp, ep, cp, dp, pp, world, cfg.parallel.sp);
    mesh.plan_bytes(|| planned_bytes(spec, cfg, kernel_workspace, stage))?;
    Ok(mesh)
}

/// The rank's model (its tensor-parallel slice, its experts, its pipeline stage, its share of
/// the context): its tables, the RoPE table not built ([`Llama::tables`]).
fn rank_model(
    cfg: &TrainConfig,
    llama: LlamaConfig,
    comms: &Comms,
    tp_rank: Option<TensorParallel>,
) -> Result<Llama> {
    let layers = llama.layers as u64;
    let model = match (tp_rank, &comms.ep) {
        (Some(tp), _) => Llama::tensor_parallel(tp)?,
        (None, Some(ep)) => {
            let group: Rc<dyn EpComm> = ep.clone();
            let par = ExpertParallel::new(&llama, group)?;
            Llama::expert_parallel(llama, par)
        }
        (None, None) => Llama::tables(llama),
    };
    // A pipeline stage holds its layers (and the embedding or the head), as the planner
    // splits them.
    let stage = comms.pp.as_ref().map_or(0, |p| p.stage);
    let layout = cfg.parallel.clone();
    let held = move |p| layout.stage_of(p, layers) == stage as u64;
    let stages = cfg.parallel.pp as usize;
    let model = model
        .pipeline_stage(Stage { stage, stages }, &held)
        .with_ce_chunk_tokens(cfg.runtime.ce_chunk as usize)
        .with_recompute(cfg.runtime.recompute)
        .with_capacity_factor(cfg.model.capacity_factor);
    // Context parallelism: attention as a ring over the group, RoPE at this rank's
    // positions (turned when the table is built).
    Ok(match &comms.cp {
        Some(cp) => {
            let ring: Rc<dyn CpComm> = cp.clone();
            let seq = cfg.data.seq as usize;
            model
                .context_parallel(ContextParallel::new(ring), seq)
                .map_err(anyhow::Error::msg)?
        }
        None => model,
    })
}

/// The rank's initial weights in the model's flat order. Initialisation of HF Llama:
/// N(0, 0.02²) matrices, unit norms, zero biases; under mixed precision that is the fp32 master
/// copy, and the weights are it rounded. A rank holding part of the model (a tensor-parallel
/// slice, a stage, some experts) takes its part of the whole model's same weights.
pub(super) fn initial_values(cfg: &TrainConfig, model: &Llama) -> Vec<f32> {
    let whole = model.whole_table().init(cfg.data.seed, 0.02);
    match model.part() {
        Some(_) => tpar::slice_of(model, &whole),
        None => whole,
    }
}

/// What the trainer lays into the plan's lengths: data parallelism (buckets and shards), ZeRO's
/// gradient and parameter windows, the runs of parameters the optimizer updates.
pub(super) struct PlannedStates {
    pub dp: Option<DataParallel>,
    pub windows: Option<GradWindows>,
    pub zero3: Option<Zero3>,
    pub runs: Vec<OptRun>,
}

/// Data parallelism's communicators: every replica's, and the routed experts' replicas'.
type DpComms = (Box<dyn Communicator>, Option<Box<dyn Communicator>>);

/// [`PlannedStates`] of `model` in the plan's `lens`, with data parallelism over `dp` (its
/// dense and routed experts' communicators) when there is any.
fn planned_states(
    cfg: &TrainConfig,
    model: &Llama,
    dp: Option<DpComms>,
    experts_apart: bool,
    lens: &StateLens,
) -> Result<PlannedStates> {
    let zero = cfg.parallel.zero;
    let dp = match dp {
        Some(c) => Some(data_parallel(cfg, model, c, experts_apart, lens)?),
        None => None,
    };
    let windows = (dp.is_some() && zero >= 2).then(|| GradWindows::new(&model.params));
    let zero3 = (dp.is_some() && zero >= 3).then(|| Zero3::new(&model.params));
    crate::setup::check_windows(lens, windows.as_ref(), zero3.as_ref())?;
    let mut runs = opt_runs(model, dp.as_ref(), experts_apart, lens.opt as usize)?;
    if zero3.is_some() {
        // ZeRO-3's weights are the rank's shard, laid out as the optimizer's states.
        for r in &mut runs {
            r.weights = r.at;
        }
    }
    Ok(PlannedStates {
        dp,
        windows,
        zero3,
        runs,
    })
}

/// Data parallelism over `comm`: the plan's buckets (`dp.grad_buckets`; ZeRO-3: one per
/// unit) and under ZeRO its shards of the states (`lens`: the plan's lengths of both).
fn data_parallel(
    cfg: &TrainConfig,
    model: &Llama,
    (comm, dp_experts): DpComms,
    experts_apart: bool,
    lens: &StateLens,
) -> Result<DataParallel> {
    let sharded = cfg.parallel.zero >= 1;
    let (bucket, table) = (lens.bucket as usize, &model.params);
    if experts_apart {
        // The dense gradients over every replica, the experts' over theirs, each in
        // buckets of their own (the plan's `dp.grad_buckets`, `dp.expert_grad_buckets`).
        // Under ZeRO-1 each in blocks of its group's ranks.
        let lens_of = (bucket, lens.expert_bucket as usize);
        let shards = sharded.then_some((lens.opt_dense, lens.opt - lens.opt_dense));
        return DataParallel::expert_parallel(comm, dp_experts, table, lens_of, shards);
    }
    let buckets = match cfg.parallel.zero {
        3.. => Buckets::Units(bucket),
        _ => Buckets::Fixed(bucket),
    };
    DataParallel::new(comm, table, buckets, sharded.then_some(lens.opt))
}

/// The runs of parameters the optimizer updates on this rank (every tensor, or its ZeRO
/// shard), which fill the plan's `opt_len` elements of optimizer states.
fn opt_runs(
    model: &Llama,
    dp: Option<&DataParallel>,
    experts_apart: bool,
    opt_len: usize,
) -> Result<Vec<OptRun>> {
    let decays = |r: &Range<usize>| {
        let e = model
            .params
            .entries
            .iter()
            .find(|e| e.range().contains(&r.start));
        e.is_some_and(|e| e.is_matrix())
    };
    let (runs, len) = match dp.and_then(|d| d.shard()) {
        Some(shard) => {
            let run = |params: Range<usize>, at: usize| OptRun {
                decay: decays(&params),
                replicated: tpar::is_replicated(model, &params),
                weights: params.start,
                params,
                at,
            };
            let mut runs: Vec<OptRun> = (shard.segments.iter())
                .map(|g| run(g.params.clone(), g.at))
                .collect();
            let mut len = shard.len;
            // Expert parallelism: after the dense blocks, this rank's blocks of its experts
            // (whole when no other rank holds them).
            if experts_apart {
                match dp.and_then(|d| d.expert_shard()) {
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
                weights: e.offset,
                decay: e.is_matrix(),
                replicated: tpar::is_replicated(model, &e.range()),
            });
            (runs.collect(), model.params.total)
        }
    };
    if len != opt_len {
        anyhow::bail!("internal: the optimizer's runs fill {len} elements of its states, the plan's are {opt_len}");
    }
    Ok(runs)
}

/// The initial weights in their storage type, and under mixed precision the fp32 master
/// copy (this rank's ZeRO shard of it), written into their places in the weights' region
/// `home` (`None`, or a plan without them there: on the heap, for a device to take them).
///
/// On the heap the initial values are moved, not copied, where they already are the buffer
/// wanted (fp32 weights; a master that is every weight in order): a device run holds no
/// other host memory, so its host peak is these buffers (4 bytes a weight in fp32, 6 in bf16
/// with its master, where copies made it 8 and 14).
pub(super) fn initial_weights(
    cfg: &TrainConfig,
    st: &PlannedStates,
    opt_len: usize,
    init: Vec<f32>,
    mut home: Option<&mut Resident>,
) -> (Flat, Option<Region<f32>>) {
    use ferrotron_plan::state_regions::WEIGHTS;
    let (runs, zero3) = (&st.runs, st.zero3.as_ref());
    let has_master = cfg.precision.kind.has_master();
    let storage = cfg.precision.kind.storage();
    let carved = home
        .as_mut()
        .and_then(|r| Flat::carve(r, storage, WEIGHTS[0]));
    let params = match (carved, zero3) {
        (None, None) if storage == DType::F32 && !has_master => {
            return (Flat::F32(init.into()), None);
        }
        // ZeRO-3: this rank's shard of the weights, then the (zeroed) windows.
        (carved, Some(z)) => {
            let shard = shard_of(runs, opt_len + z.len(), &init);
            filled(carved, storage, &shard)
        }
        (carved, None) => filled(carved, storage, &init),
    };
    if !has_master {
        return (params, None);
    }
    let master = match home.and_then(|r| r.carve_span::<f32>(WEIGHTS[1])) {
        Some(mut m) => {
            fill_shard(&mut m, runs, &init);
            m
        }
        None if is_whole(runs, opt_len, init.len()) => init.into(),
        None => shard_of(runs, opt_len, &init).into(),
    };
    (params, Some(master))
}

/// Host bytes a device run's initial weights take at their peak, before they move to the
/// device (on the CPU they sit in memory the step's plan reuses later): the values drawn for
/// the whole model (and this rank's slice of them, for a part of it), then
/// [`initial_weights`]' buffers, branch by branch. With its offload tier, a device rank's
/// host plan (`fit::DeviceHost`).
pub(super) fn initial_host_bytes(
    cfg: &TrainConfig,
    model: &Llama,
    st: &PlannedStates,
    opt_len: usize,
    init_len: usize,
) -> u64 {
    let (l, whole) = (init_len as u64, model.whole_table().total as u64);
    let drawn = match model.part() {
        Some(_) => 4 * (whole + l),
        None => 4 * l,
    };
    let storage = cfg.precision.kind.storage();
    let has_master = cfg.precision.kind.has_master();
    let s = storage.bytes();
    let weights = match st.zero3.as_ref() {
        // The shard, then the weights filled from it.
        Some(z) => (4 + s) * (opt_len + z.len()) as u64,
        // The values themselves.
        None if storage == DType::F32 && !has_master => 0,
        None => s * l,
    };
    let master = match has_master && !is_whole(&st.runs, opt_len, init_len) {
        true => 4 * opt_len as u64,
        false => 0,
    };
    drawn.max(4 * l + weights + master)
}

/// `carved` (or a new buffer of `storage`) holding `values`.
fn filled(carved: Option<Flat>, storage: DType, values: &[f32]) -> Flat {
    let mut params = carved.unwrap_or_else(|| Flat::zeros(storage, values.len()));
    params.set_from_f32(values);
    params
}

/// Whether the optimizer's runs are every one of `full` weights, each at its own offset: the
/// shard is the whole.
fn is_whole(runs: &[OptRun], len: usize, full: usize) -> bool {
    len == full
        && runs.iter().all(|r| r.at == r.params.start)
        && runs.iter().map(|r| r.params.len()).sum::<usize>() == len
}

/// This rank's place in its tensor-parallel group (with the tables mapping its slices onto
/// the whole model): metadata of the process, like the data index.
fn tensor_parallel_rank(
    llama: &LlamaConfig,
    tp: Option<&Rc<Group>>,
    sp: bool,
) -> Result<Option<TensorParallel>> {
    Ok(match tp {
        Some(tp) => {
            let group: Rc<dyn TpComm> = tp.clone();
            Some(TensorParallel::new(llama.clone(), group)?.with_sp(sp))
        }
        None => None,
    })
}

/// A mixture of experts' router statistics on the device (the plan's
/// `comm.moe.router_stats`), its routing read back through the device's copies; on the host,
/// nothing to do.
pub(super) fn router_on_device(
    model: &Llama,
    device_alloc: Option<&Arc<dyn DeviceAlloc>>,
) -> Result<()> {
    if let Some(d) = device_alloc {
        let copy = ferrotron_engine::kernels::HostCopy::new(d.clone());
        model
            .moe_on_device(copy)
            .map_err(|e| anyhow::anyhow!("the router's statistics on the device: {e}"))?;
    }
    Ok(())
}

/// The GPU workspace a device reserves.
pub(super) type GpuWorkspace = Option<(u64, String, Option<f64>)>;

/// The rank's memory plan (its model checked against the plan's), with the kernel workspace
/// it includes and the GPU's workspace and peak when the step runs on one. `at`: this rank's
/// tokens of a micro-batch, the cross-entropy's chunk, its pipeline stage.
fn rank_plan(
    spec: &ModelSpec,
    cfg: &TrainConfig,
    kernels: &Tracing<Backend>,
    model: &mut Llama,
    kernel_workspace: KernelWorkspace,
    (n, chunk, stage): (usize, usize, usize),
    on_device: bool,
) -> Result<(RankPlan, KernelWorkspace, GpuWorkspace)> {
    // A GPU's workspace is its own (cuBLASLt's, and scratch reserved now).
    let gpu = crate::device::gpu_workspace(&kernels.inner, model, chunk, n, cfg.precision.kind);
    let kernel_workspace = match &gpu {
        Some((w, ..)) => KernelWorkspace {
            layers: *w,
            head: *w,
            resident: *w,
        },
        None => kernel_workspace,
    };
    let ws = kernel_workspace.max();
    let plan = checked_plan(spec, model, cfg, ws, stage, on_device)?;
    Ok((plan, kernel_workspace, gpu))
}

/// The peak FLOP/s the throughput's MFU is measured against: `--peak-gflops`, or on a GPU
/// without it, its dense peak from the planner's table, split between the `gpu_share` ranks
/// that run on it (dp 2 on one GPU: each rank has half).
pub(super) fn peak_flops(gpu: &GpuWorkspace, peak_gflops: f64, gpu_share: usize) -> f64 {
    gpu.as_ref()
        .and_then(|g| g.2)
        .filter(|_| peak_gflops == 0.0)
        .map(|p| p / gpu_share.max(1) as f64)
        .unwrap_or(peak_gflops * 1e9)
}

/// The pool the model's buffers come from: the rank's arena at the plan's offsets, and the
/// memory timeline when it samples.
pub(super) fn plan_pool(timeline: Option<Timeline>, arena: Arena) -> PlanPool {
    PlanPool {
        timeline,
        arena: Some(arena),
        ..PlanPool::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM-135M's widths (576, 9 × 64, 3 × 64, 1536: multiples of 16), one changed.
    fn smollm(change: impl FnOnce(&mut LlamaConfig)) -> LlamaConfig {
        let spec = ferrotron_plan::presets::preset("smollm-135m").unwrap();
        let mut c = crate::setup::llama_config(&spec).unwrap();
        change(&mut c);
        c
    }

    #[test]
    fn fp8_on_the_gpu_refuses_a_width_that_is_not_a_multiple_of_16() {
        assert!(fp8_widths(&smollm(|_| {})).is_ok());
        let e = fp8_widths(&smollm(|c| c.intermediate = 1530))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "precision = fp8: the GPU's fp8 products need every layer width a multiple of 16, and this rank's intermediate is 1530: use --precision bf16 on the GPU, or fp8 on the CPU");
        let e = fp8_widths(&smollm(|c| c.head_dim = 60))
            .unwrap_err()
            .to_string();
        assert!(e.contains("this rank's heads x head_dim is 540"), "{e}");
    }
}
