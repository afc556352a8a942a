//! `plan()`: from (model, recipe, layout, convention) to one `MemoryPlan` per kind of rank
//! (pipeline stage), swept into peaks, breakdowns and a timeline.

use crate::activations::{edge_acts, layer_acts, Act, Dims};
use crate::buffers::{comm_buffers, units, Units};
use crate::convention::Convention;
use crate::dp_layout::StateLens;
use crate::error::{PlanError, Result};
use crate::hardware::Overhead;
use crate::inventory::{count, inventory, ParamCount, Placement, Tensor};
use crate::layout::{Layout, PpSchedule};
use crate::memory::{Breakdown, BufId, MemoryPlan, Phase, Sweep};
use crate::model::ModelSpec;
use crate::recipe::Recipe;
use crate::runtime::Runtime;
use crate::schedule::{order, send_buffers, simulated_micro_batches, slots, Direction, Work};
use crate::states::{add_states, RankElems};
use crate::tensors::{Edge, LayerTensor, LAYER_PREFIX, WORKSPACE_PREFIX};
use serde::Serialize;

/// The model: a full architecture, or a bare parameter count (model states only).
// One per plan, never held in bulk: boxing the spec would only add a pointer chase.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    Spec(ModelSpec),
    Params(u64),
    /// A bare count with its largest layer: what ZeRO-3 gathers at once (`--params N
    /// --largest-layer M`, the inputs of DeepSpeed's `estimate_zero3_model_states_mem_needs`).
    Counted {
        params: u64,
        largest_layer: u64,
    },
}

impl ModelSource {
    /// The parameter count of a bare count (`Params` or `Counted`); `None` for a full spec.
    pub fn bare_count(&self) -> Option<u64> {
        match self {
            ModelSource::Spec(_) => None,
            ModelSource::Params(n) | ModelSource::Counted { params: n, .. } => Some(*n),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    pub model: ModelSource,
    pub recipe: Recipe,
    pub layout: Layout,
    /// Whose kernels and buffers: the memory accounting.
    pub convention: Convention,
    /// Whose communication: ferrotron's trainer or the convention's framework (`runtime.rs`).
    /// The trainer's own plan names `Runtime::Ferrotron`; `Runtime::of(convention)` is the
    /// default everywhere else.
    pub runtime: Runtime,
    pub overhead: Overhead,
    /// ZeRO-2 gradient bucket size in bytes.
    pub bucket_bytes: u64,
}

/// One kind of rank (a pipeline stage; all ranks are alike without pipelining).
#[derive(Debug, Clone, Serialize)]
pub struct RankPlan {
    pub name: String,
    pub stage: u64,
    pub plan: MemoryPlan,
    pub sweep: Sweep,
    /// Live memory by component at the peak instant.
    pub at_peak: Breakdown,
    /// Runtime context plus fragmentation margin at the peak.
    pub overhead: u64,
    /// Allocated peak plus overhead.
    pub peak: u64,
    /// Micro-batches per step the sweep simulates (its marks say `mb 0` to `mb m-1`). Later
    /// micro-batches repeat the last simulated one: same buffers, same schedule position.
    pub simulated_micro_batches: u64,
    /// The length of every model state and data-parallel bucket of the rank (what the
    /// trainer allocates).
    #[serde(skip)]
    pub states: StateLens,
    /// Bytes the rank's offload copies between host and device memory per step (zero
    /// without offload, on the CPU, and for ZeRO-3's sharded offload, whose copies are
    /// ZeRO-3's: `host_transfer.rs`).
    #[serde(skip)]
    pub host_transfer: crate::host_transfer::HostTransfer,
}

#[derive(Debug, Clone, Serialize)]
pub struct PlanResult {
    pub params: ParamCount,
    #[serde(skip)]
    pub tensors: Vec<Tensor>,
    pub ranks: Vec<RankPlan>,
    /// Index into `ranks` of the rank with the highest peak.
    pub most_loaded: usize,
}

impl RankPlan {
    /// What PyTorch's caching allocator reserves at its peak running this rank's program
    /// (`allocator.rs`): the allocated peak plus the allocator's rounding and fragmentation,
    /// without the runtime context. Replayed on demand (the layout search never needs it).
    pub fn reserved(&self) -> u64 {
        crate::allocator::reserved_peak(&self.plan)
    }
}

impl PlanResult {
    pub fn worst(&self) -> &RankPlan {
        &self.ranks[self.most_loaded]
    }
}

pub fn plan(input: &PlanInput) -> Result<PlanResult> {
    plan_impl(input, false)
}

/// As `plan`, but simulates only the first and the last pipeline stage. The most loaded rank is
/// always one of them (a middle stage holds the same number of layers as stage 0 without the
/// embedding, the same buffers, and no more micro-batches in flight), so `worst()` is the same;
/// the layout search uses this to rank thousands of layouts quickly.
pub fn plan_extremes(input: &PlanInput) -> Result<PlanResult> {
    plan_impl(input, true)
}

fn plan_impl(input: &PlanInput, extremes: bool) -> Result<PlanResult> {
    let (r, l) = (&input.recipe, &input.layout);
    r.validate()?;
    input.runtime.validate(input.convention)?;
    let spec = match &input.model {
        ModelSource::Spec(m) => Some(m),
        ModelSource::Params(0) | ModelSource::Counted { params: 0, .. } => {
            return Err(PlanError::setting(
                "params",
                0,
                "must be a positive parameter count",
            ))
        }
        ModelSource::Counted {
            params,
            largest_layer,
        } if *largest_layer == 0 || largest_layer > params => {
            return Err(PlanError::setting(
                "largest_layer",
                largest_layer,
                format!("must be a positive count no larger than params = {params}"),
            ))
        }
        ModelSource::Params(_) | ModelSource::Counted { .. } => None,
    };
    l.validate(spec, r)?;
    if l.pp_schedule == PpSchedule::Interleaved && r.grad_acc % l.pp != 0 {
        return Err(PlanError::setting(
            "grad_acc",
            r.grad_acc,
            format!(
                "the interleaved schedule needs micro-batches in multiples of pp = {}",
                l.pp
            ),
        ));
    }
    let (tensors, params) = match &input.model {
        ModelSource::Spec(m) => {
            let t = inventory(m);
            let c = count(m, &t);
            (t, c)
        }
        ModelSource::Params(n) | ModelSource::Counted { params: n, .. } => (
            Vec::new(),
            ParamCount {
                total: *n,
                active: *n,
                matmul_active: *n,
            },
        ),
    };
    let stages: Vec<u64> = match (spec, extremes && l.pp > 2) {
        (Some(m), true) if l.uneven() => uneven_candidates(l, m.layers),
        (_, true) => vec![0, l.pp - 1],
        _ => (0..l.pp).collect(),
    };
    let ranks: Vec<RankPlan> = stages
        .into_iter()
        .map(|stage| rank_plan(input, spec, &tensors, stage))
        .collect();
    let most_loaded = (0..ranks.len())
        .max_by_key(|&i| (ranks[i].peak, std::cmp::Reverse(i)))
        .unwrap_or(0);
    Ok(PlanResult {
        params,
        tensors,
        ranks,
        most_loaded,
    })
}

/// The stages that can be the most loaded under an uneven split: the first and the last (the
/// embedding, the head) and, of the middle stages holding the same chunks' layer counts, the
/// earliest: it holds the same states and buffers as the later ones and no fewer micro-batches
/// in flight (every schedule's warm-up shrinks along the pipeline, `schedule::warmup`). A
/// middle stage can then be the most loaded (126 layers on 16 stages, 7 on the first: stage 1
/// holds 15 micro-batches of 8 layers, stage 0 16 of 7).
fn uneven_candidates(l: &Layout, layers: u64) -> Vec<u64> {
    let counts = |s: u64| -> Vec<u64> {
        (0..l.pp_virtual)
            .map(|c| l.chunk_layer_count(layers, c * l.pp + s))
            .collect()
    };
    let mut seen: Vec<Vec<u64>> = vec![];
    let mut out = vec![0];
    for s in 1..l.pp - 1 {
        let c = counts(s);
        if !seen.contains(&c) {
            seen.push(c);
            out.push(s);
        }
    }
    out.push(l.pp - 1);
    out
}

/// Which pipeline stage a tensor lives on ([`Layout::stage_of`]).
pub(crate) fn stage_of(p: Placement, m: &ModelSpec, l: &Layout) -> u64 {
    l.stage_of(p, m.layers)
}

pub(crate) fn rank_elems(
    spec: Option<&ModelSpec>,
    tensors: &[Tensor],
    l: &Layout,
    stage: u64,
    n: u64,
) -> RankElems {
    let Some(m) = spec else {
        // A bare count is sharded uniformly: Ψ/(t·p).
        return RankElems {
            dense: n.div_ceil(l.tp * l.pp),
            expert: 0,
        };
    };
    let mut e = RankElems::default();
    let local_experts = m.moe.map_or(0, |moe| moe.num_experts / l.ep);
    for t in tensors
        .iter()
        .filter(|t| stage_of(t.placement, m, l) == stage)
    {
        match t.expert {
            Some(x) if x >= local_experts => {}
            Some(_) => e.expert += t.numel_tp(l.tp),
            None => e.dense += t.numel_tp(l.tp),
        }
    }
    // Tied embeddings under pipelining: the last stage keeps its own copy of the embedding
    // matrix as the LM head and all-reduces its gradient with stage 0 (Megatron-LM).
    if m.tie_embeddings && l.pp > 1 && stage == l.pp - 1 {
        e.dense += m.vocab.div_ceil(l.tp) * m.hidden;
    }
    e
}

/// Elements a convention adds to `rank_elems` on `stage`: Megatron-LM pads the vocabulary
/// (`megatron_lm::padded_vocab`), so the embedding and every copy of the output layer on the
/// stage hold the padded rows.
fn vocab_padding(conv: Convention, spec: Option<&ModelSpec>, l: &Layout, stage: u64) -> u64 {
    let (Convention::MegatronLm, Some(m)) = (conv, spec) else {
        return 0;
    };
    let rows = (crate::megatron_lm::padded_vocab(m.vocab, l.tp) - m.vocab) / l.tp;
    // The embedding on stage 0; the output layer on the last stage, its own matrix when
    // untied, the tied copy when pipelined (`rank_elems`).
    let matrices =
        (stage == 0) as u64 + (stage == l.pp - 1 && (!m.tie_embeddings || l.pp > 1)) as u64;
    matrices * rows * m.hidden
}

/// Buffer ids of the activations outside the layers (see `activations::EdgeActs`).
#[derive(Default)]
struct EdgeIds {
    persistent: Vec<BufId>,
    /// Per in-flight slot (as `final_input` and `head`).
    embedding: Vec<Vec<BufId>>,
    /// The last layer's output (ferrotron: `act.final_norm.input`), part of `head`.
    final_input: Vec<Vec<BufId>>,
    /// The rest of `head`.
    head: Vec<Vec<BufId>>,
    loss: Vec<BufId>,
    scratch_first: Vec<BufId>,
    head_backward: Vec<BufId>,
    scratch_rest: Vec<BufId>,
    moe_rows: Vec<BufId>,
    ep_staging: Vec<BufId>,
    cp_ring: Vec<BufId>,
}

fn add_acts(plan: &mut MemoryPlan, prefix: &str, acts: &[Act]) -> Vec<BufId> {
    add_slot(plan, prefix, acts, 0)
}

/// The buffers of `acts` for in-flight slot `slot` (`schedule::slots`): slot 0 has the plain
/// names, slot s the names with `@s` (`act.layers.3.q@1`: layer 3's q of the second micro-batch
/// a pipeline stage holds at once).
fn add_slot(plan: &mut MemoryPlan, prefix: &str, acts: &[Act], slot: u64) -> Vec<BufId> {
    let at = match slot {
        0 => String::new(),
        s => format!("{SLOT_MARK}{s}"),
    };
    acts.iter()
        .filter(|a| a.numel > 0)
        .map(|a| {
            plan.add(
                format!("{prefix}{}{at}", a.name),
                a.dtype,
                a.numel,
                a.category,
            )
        })
        .collect()
}

/// The buffers of in-flight slot `s` of a per-slot list (none where the stage has no such slot).
fn at(v: &[Vec<BufId>], s: u64) -> &[BufId] {
    v.get(s as usize).map_or(&[], Vec::as_slice)
}

/// Separates a buffer's name from its in-flight slot in the plan's names (`name@slot`).
pub const SLOT_MARK: char = '@';

/// ferrotron's pipeline buffers (`crates/dist/src/pipeline.rs`): per direction a stage sends
/// in, `k` f32 buffers of the boundary activation it sends from in turn
/// (`schedule::send_buffers`), and one f32 buffer it receives into. (The communicator carries
/// f32; the storage type is narrowed on arrival.)
fn pp_buffers(plan: &mut MemoryPlan, l: &Layout, stage: u64, m: u64, boundary: u64) -> Vec<BufId> {
    let k = send_buffers(l, m);
    let work = order(l, stage, m);
    let mut ids = Vec::new();
    for (dir, name) in [
        (Direction::Forward, "forward"),
        (Direction::Backward, "backward"),
    ] {
        let sends = work.iter().any(|&w| {
            crate::schedule::messages(l, stage, w)
                .1
                .is_some_and(|m| m.dir == dir)
        });
        if sends {
            for j in 0..k {
                let id = plan.add(
                    format!("comm.pp.send.{name}.{j}"),
                    crate::recipe::DType::F32,
                    boundary,
                    crate::memory::Category::CommBuffers,
                );
                ids.push(id);
            }
        }
    }
    ids.push(plan.add(
        "comm.pp.recv",
        crate::recipe::DType::F32,
        boundary,
        crate::memory::Category::CommBuffers,
    ));
    ids
}

fn rank_plan(
    input: &PlanInput,
    spec: Option<&ModelSpec>,
    tensors: &[Tensor],
    stage: u64,
) -> RankPlan {
    let (r, l, conv) = (&input.recipe, &input.layout, input.convention);
    let total = input.model.bare_count().unwrap_or(0);
    let mut plan = MemoryPlan::default();
    let mut e = rank_elems(spec, tensors, l, stage, total);
    e.dense += vocab_padding(conv, spec, l, stage);
    let on_stage = |p: Placement| spec.is_some_and(|m| stage_of(p, m, l) == stage);
    // ferrotron's own ZeRO-3 (its trainer's): dense models, without pipelining.
    let zero3 = (crate::zero3::applies(input.runtime, l, e.expert) && spec.is_some()).then(|| {
        let lens = crate::zero3::unit_lens(tensors, l.tp, on_stage);
        crate::zero3::Sizes::of(&lens, l.dense_replicas())
    });
    let mut states = add_states(&mut plan, e, r, l, conv, zero3);
    // ferrotron's trainer streams offloaded parameters (`--offload params`) through ZeRO-3's
    // windows, the embedding's, the head's and two layers', allocated with the states
    // (`crates/train/src/offload_params.rs`; the next layer's upload runs one layer ahead).
    // Under ZeRO-3 (ZeRO-Infinity's sharded offload, Rajbhandari et al. 2021 §5) the windows
    // are ZeRO-3's own (`zero3.param_windows`, above), gathered from the ranks' host shards.
    let streams = input.runtime.is_trainer() && l.offload == crate::Offload::Params;
    if streams && spec.is_some() && zero3.is_none() {
        let lens = crate::zero3::unit_lens(tensors, l.tp, on_stage);
        let windows = crate::zero3::Sizes::of(&lens, 1).windows;
        let st = r.precision.storage();
        let id = plan.add(
            "offload.param_windows",
            st,
            windows,
            crate::memory::Category::Params,
        );
        states.at_init.push(id);
    }
    plan.alloc(&states.at_init);

    let units = match (spec, &input.model) {
        (Some(_), _) => units(tensors, l.tp, on_stage),
        // A stated largest layer is split by tensor parallelism like any layer.
        (None, ModelSource::Counted { largest_layer, .. }) => Units {
            layer: largest_layer.div_ceil(l.tp),
            ..Units::default()
        },
        (None, _) => Units::default(),
    };
    let comm = comm_buffers(input, spec, units, e.dense + e.expert, zero3);
    let lens = states.lens.with_comm(&comm, zero3);
    let mut comm_fwd = Vec::new();
    let mut comm_bwd = Vec::new();
    for c in &comm {
        let id = plan.add(format!("comm.{}", c.name), c.dtype, c.numel, c.category);
        if c.from_forward {
            comm_fwd.push(id)
        } else {
            comm_bwd.push(id)
        }
    }

    // The stage's program: its order of forward and backward work, and the in-flight slot of
    // each (ferrotron's trainer names every slot's buffers apart for its arena, and sends from
    // buffers of its own: `crates/dist/src/pipeline.rs`; elsewhere one name is allocated as
    // many times as micro-batches are in flight).
    let m_sim = {
        let s = simulated_micro_batches(l, stage, r.grad_acc);
        if l.pp_schedule == PpSchedule::Interleaved {
            s.div_ceil(l.pp).saturating_mul(l.pp).min(r.grad_acc)
        } else {
            s
        }
    };
    let work = order(l, stage, m_sim);
    let slotted = input.runtime.is_trainer() && l.pp > 1 && spec.is_some();
    let slot_of = match slotted {
        true => slots(&work),
        false => vec![0; work.len()],
    };
    // Slots of each of the stage's chunks.
    let mut chunk_slots = vec![1u64; l.pp_virtual as usize];
    for (w, &s) in work.iter().zip(&slot_of) {
        if let Work::F { chunk, .. } = *w {
            chunk_slots[chunk as usize] = chunk_slots[chunk as usize].max(s + 1);
        }
    }
    // Activation buffers (only with an architecture). A layer's `input` is split off: the
    // engine allocates it as the previous layer's output, at the end of that layer.
    let chunks = l.pp * l.pp_virtual;
    let layer_count = spec.map_or(0, |m| m.layers);
    // Per layer, per slot.
    let mut inputs: Vec<Vec<Vec<BufId>>> = Vec::new();
    let mut rests: Vec<Vec<Vec<BufId>>> = Vec::new();
    // The output a chunk's last layer writes and the stage sends on to the next chunk's (the
    // next layer's `input`, on another stage): per layer, empty unless it ends a chunk.
    let mut sent: Vec<Vec<BufId>> = Vec::new();
    // Recompute workspace of each layer kind (dense MLP, MoE MLP), rebuilt during a layer's
    // backward.
    let mut recompute_ids: [Vec<BufId>; 2] = Default::default();
    // What a layer's forward holds transiently: under the tensor conventions (ferrotron,
    // torchtitan) the tensors the policy drops are computed into the same `recompute.*`
    // workspace during the forward and freed once the layer's output exists (the formula
    // conventions count only what is kept).
    let mut forward_transient: [Vec<BufId>; 2] = Default::default();
    let mut kind = vec![];
    let mut e = EdgeIds::default();
    let mut pp_comm = Vec::new();
    let mut sp_scratch = Vec::new();
    if let Some(m) = spec {
        let kinds = [false, true].map(|moe| layer_acts(m, r, l, conv, moe));
        let chunk_of = |i: u64| (0..chunks).find(|&g| l.chunk_layers(m.layers, g).contains(&i));
        for i in 0..m.layers {
            let k = m.is_moe_layer(i) as usize;
            kind.push(k);
            let here = stage_of(Placement::Layer(i), m, l) == stage;
            let prefix = format!("{LAYER_PREFIX}{i}.");
            let (input, rest): (Vec<Act>, Vec<Act>) = kinds[k]
                .saved
                .iter()
                .cloned()
                .partition(|a| a.name == LayerTensor::Input.name());
            let g = chunk_of(i).unwrap_or(0);
            let n_slots = if here {
                chunk_slots[(g / l.pp) as usize]
            } else {
                0
            };
            inputs.push(
                (0..n_slots)
                    .map(|s| add_slot(&mut plan, &prefix, &input, s))
                    .collect(),
            );
            rests.push(
                (0..n_slots)
                    .map(|s| add_slot(&mut plan, &prefix, &rest, s))
                    .collect(),
            );
            let ends_chunk = l.chunk_layers(m.layers, g).end == i + 1;
            sent.push(if slotted && here && ends_chunk && g + 1 < chunks {
                add_acts(&mut plan, &format!("{LAYER_PREFIX}{}.", i + 1), &input)
            } else {
                vec![]
            });
        }
        for k in 0..2 {
            if kind.contains(&k) {
                // A model with both kinds of layers has a workspace for each.
                let prefix = if k == 1 && kind.contains(&0) {
                    format!("{WORKSPACE_PREFIX}moe.")
                } else {
                    WORKSPACE_PREFIX.to_string()
                };
                recompute_ids[k] = add_acts(&mut plan, &prefix, &kinds[k].recompute);
            }
        }
        if conv.tensor_activations() {
            forward_transient = recompute_ids.clone();
        }
        let edge = edge_acts(m, r, l, conv);
        e.persistent = add_acts(&mut plan, "", &edge.persistent);
        let (first_slots, last_slots) = (chunk_slots[0], chunk_slots[l.pp_virtual as usize - 1]);
        // A micro-batch's tokens and targets stay while it is in flight (the last stage's
        // head reads the targets, the first stage's embedding backward the tokens): one batch
        // per slot of the stage's first chunk, which a micro-batch holds longest.
        let batch: Vec<Act> = edge
            .persistent
            .iter()
            .filter(|a| [Edge::DataTokens.name(), Edge::DataTargets.name()].contains(&a.name))
            .cloned()
            .collect();
        for s in 1..first_slots {
            e.persistent.extend(add_slot(&mut plan, "", &batch, s));
        }
        if stage == 0 {
            e.embedding = (0..first_slots)
                .map(|s| add_slot(&mut plan, "", &edge.embedding, s))
                .collect();
        }
        if stage == l.pp - 1 {
            // The engine writes the last layer's output straight into the final norm's input,
            // so that buffer appears with the layer, before the layer's forward mark.
            let (fin, head): (Vec<Act>, Vec<Act>) = edge
                .head
                .iter()
                .cloned()
                .partition(|a| a.name == Edge::FinalNormInput.name());
            e.final_input = (0..last_slots)
                .map(|s| add_slot(&mut plan, "", &fin, s))
                .collect();
            e.head = (0..last_slots)
                .map(|s| add_slot(&mut plan, "", &head, s))
                .collect();
            e.loss = add_acts(&mut plan, "", &edge.loss_transient);
            e.head_backward = add_acts(&mut plan, "", &edge.head_backward);
        }
        e.scratch_first = add_acts(&mut plan, "", &edge.scratch_first);
        e.scratch_rest = add_acts(&mut plan, "", &edge.scratch_rest);
        e.moe_rows = add_acts(&mut plan, "", &edge.moe_rows);
        e.ep_staging = add_acts(&mut plan, "", &edge.ep_staging);
        e.cp_ring = add_acts(&mut plan, "", &edge.cp_ring);
        if slotted {
            let boundary = Dims::new(r, l).n() * m.hidden / Dims::new(r, l).seq_shard();
            pp_comm = pp_buffers(&mut plan, l, stage, r.grad_acc, boundary);
        }
        // The engine's sequence-parallel gather scratch serves the embedding, every layer and
        // the head, one use at a time.
        sp_scratch = add_acts(&mut plan, "", &edge.sp_scratch);
    }
    plan.alloc(&e.persistent);
    plan.mark(1, Phase::Init, "model init");

    // ferrotron's engine fuses the LM head's backward into the end of the forward (llm.c
    // style), so its gradients exist before the first forward; elsewhere they appear lazily at
    // the first backward, as in PyTorch.
    let grads_before_forward = conv == Convention::Ferrotron;
    let mut grads_allocated = false;
    let mut comm_fwd_allocated = false;
    let alloc_grads = |plan: &mut MemoryPlan, step: u32, phase: Phase| {
        plan.alloc(&states.at_first_backward);
        plan.alloc(&comm_bwd);
        plan.alloc(&pp_comm);
        plan.mark(step, phase, "gradients allocated");
    };
    let none: Vec<BufId> = Vec::new();
    for step in 1..=2u32 {
        plan.alloc(&states.per_step);
        for (w, &slot) in work.iter().zip(&slot_of) {
            match *w {
                Work::F { mb, chunk } => {
                    if !comm_fwd_allocated {
                        plan.alloc(&comm_fwd);
                        comm_fwd_allocated = true;
                    }
                    if grads_before_forward && !grads_allocated {
                        alloc_grads(&mut plan, step, Phase::Forward);
                        grads_allocated = true;
                    }
                    let g = chunk * l.pp + stage;
                    let layers = l.chunk_layers(layer_count, g);
                    if g == 0 {
                        plan.alloc(at(&e.embedding, slot));
                    }
                    if let Some(first) = inputs
                        .get(layers.start as usize)
                        .filter(|_| !layers.is_empty())
                    {
                        plan.alloc(at(first, slot));
                    }
                    if g == 0 {
                        // The embedding's reduce-scatter to this rank's rows.
                        plan.alloc(&sp_scratch);
                        plan.free(&sp_scratch);
                    }
                    for i in layers.clone() {
                        let k = kind[i as usize];
                        plan.alloc(&sp_scratch);
                        plan.alloc(at(&rests[i as usize], slot));
                        plan.alloc(&forward_transient[k]);
                        plan.alloc(&e.cp_ring);
                        if k == 1 {
                            plan.alloc(&e.moe_rows);
                            plan.alloc(&e.ep_staging);
                        }
                        if i + 1 < layers.end {
                            plan.alloc(at(&inputs[i as usize + 1], slot));
                        } else if g == chunks - 1 {
                            plan.alloc(at(&e.final_input, slot));
                        } else {
                            plan.alloc(&sent[i as usize]);
                        }
                        // The experts' outputs are summed into the layer's output and freed
                        // before the mark.
                        if k == 1 {
                            plan.free(&e.ep_staging);
                            plan.free(&e.moe_rows);
                        }
                        plan.free(&e.cp_ring);
                        plan.free(&sp_scratch);
                        plan.mark(
                            step,
                            Phase::Forward,
                            format!("step {step} mb {mb} forward layer {i}"),
                        );
                        plan.free(&forward_transient[k]);
                    }
                    // The chunk's output is sent on (copied into a send buffer) and freed.
                    if let Some(i) = layers.clone().last() {
                        plan.free(sent.get(i as usize).unwrap_or(&none));
                    }
                    if g == chunks - 1 && spec.is_some() {
                        if layers.is_empty() {
                            plan.alloc(at(&e.final_input, slot));
                        }
                        plan.alloc(at(&e.head, slot));
                        plan.alloc(&sp_scratch);
                        plan.alloc(&e.loss);
                        plan.free(&sp_scratch);
                        plan.mark(step, Phase::Loss, format!("step {step} mb {mb} loss"));
                        plan.free(&e.loss);
                    }
                    if spec.is_none() {
                        plan.mark(step, Phase::Forward, format!("step {step} mb {mb} forward"));
                    }
                }
                Work::B { mb, chunk } => {
                    if !grads_allocated {
                        alloc_grads(&mut plan, step, Phase::Backward);
                        grads_allocated = true;
                    }
                    let g = chunk * l.pp + stage;
                    plan.alloc(&e.scratch_first);
                    if g == chunks - 1 {
                        plan.alloc(&e.head_backward);
                        plan.free(&e.head_backward);
                        plan.free(at(&e.head, slot));
                        plan.free(at(&e.final_input, slot));
                    }
                    plan.alloc(&e.scratch_rest);
                    plan.alloc(&e.moe_rows);
                    for i in l.chunk_layers(layer_count, g).rev() {
                        let k = kind[i as usize];
                        plan.alloc(&recompute_ids[k]);
                        plan.alloc(&sp_scratch);
                        plan.alloc(&e.cp_ring);
                        plan.free(&e.cp_ring);
                        if k == 1 {
                            plan.alloc(&e.ep_staging);
                            plan.free(&e.ep_staging);
                        }
                        plan.free(&sp_scratch);
                        plan.free(&recompute_ids[k]);
                        plan.free(at(&rests[i as usize], slot));
                        plan.free(at(&inputs[i as usize], slot));
                        plan.mark(
                            step,
                            Phase::Backward,
                            format!("step {step} mb {mb} backward layer {i}"),
                        );
                    }
                    if g == 0 {
                        // The embedding's backward gathers the rows' gradients.
                        plan.alloc(&sp_scratch);
                        plan.free(&sp_scratch);
                        plan.free(at(&e.embedding, slot));
                    }
                    plan.free(&e.moe_rows);
                    plan.free(&e.scratch_rest);
                    plan.free(&e.scratch_first);
                    if spec.is_none() {
                        plan.mark(
                            step,
                            Phase::Backward,
                            format!("step {step} mb {mb} backward"),
                        );
                    }
                }
            }
        }
        plan.free(&states.per_step);
        if step == 1 {
            // Optimizer states are created by the first optimizer step (torch.optim is lazy).
            plan.alloc(&states.at_first_optimizer);
        }
        plan.mark(step, Phase::Optimizer, format!("step {step} optimizer"));
    }
    let sweep = plan.sweep();
    let overhead = input.overhead.bytes(sweep.peak);
    let name = if l.pp == 1 {
        "every rank".to_string()
    } else {
        format!("pipeline stage {stage}")
    };
    let host_transfer = host_transfer(input, tensors, zero3.is_some(), lens.opt, on_stage);
    RankPlan {
        name,
        stage,
        host_transfer,
        simulated_micro_batches: m_sim,
        states: lens,
        at_peak: sweep.at_peak,
        peak: sweep.peak + overhead,
        overhead,
        plan,
        sweep,
    }
}

/// The offload's host↔device bytes per step of a rank on a device (`host_transfer.rs`), with
/// `opt_elems` optimizer elements; `sharded`: ZeRO-3's own copies, not counted as offload.
fn host_transfer(
    input: &PlanInput,
    tensors: &[Tensor],
    sharded: bool,
    opt_elems: u64,
    on_stage: impl Fn(Placement) -> bool,
) -> crate::host_transfer::HostTransfer {
    use crate::host_transfer as ht;
    let (r, l) = (&input.recipe, &input.layout);
    let p = r.precision;
    let (g, s) = (p.engine_grads().bytes(), p.storage().bytes());
    match l.offload {
        _ if input.runtime != Runtime::FerrotronDevice || sharded => ht::HostTransfer::default(),
        crate::Offload::Optimizer => ht::optimizer(opt_elems, g, s, p.has_master()),
        crate::Offload::Params => {
            let lens = crate::zero3::unit_lens(tensors, l.tp, on_stage);
            ht::params(&lens, r.grad_acc.max(1), g, s)
        }
        crate::Offload::None => ht::HostTransfer::default(),
    }
}
