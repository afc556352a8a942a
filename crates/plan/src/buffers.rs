//! Communication and staging buffers of one rank, by parallel dimension.

use crate::activations::Dims;
use crate::convention::Convention;
use crate::inventory::{Placement, Tensor};
use crate::layout::{Layout, Offload};
use crate::memory::Category;
use crate::model::ModelSpec;
use crate::planner::PlanInput;
use crate::recipe::{DType, Precision};
use crate::runtime::Runtime;
use crate::zero3::{Sizes, Unit};

/// A buffer and when it first appears (then it stays: these are reused workspaces).
pub struct CommBuf {
    pub name: &'static str,
    pub dtype: DType,
    pub numel: u64,
    pub category: Category,
    /// Allocated at the first forward (else at the first backward).
    pub from_forward: bool,
}

/// Elements of a stage's units (per tensor-parallel rank), what a ZeRO-3 implementation gathers
/// at once: the embedding, the head (final norm and an untied LM head), and the largest
/// transformer layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Units {
    pub embedding: u64,
    pub head: u64,
    pub layer: u64,
}

pub fn units(tensors: &[Tensor], tp: u64, on_stage: impl Fn(Placement) -> bool) -> Units {
    let mut u = Units::default();
    for (unit, n) in crate::zero3::unit_lens(tensors, tp, on_stage) {
        match unit {
            Unit::Embedding => u.embedding = n,
            Unit::Head => u.head = n,
            Unit::Layer(_) => u.layer = u.layer.max(n),
        }
    }
    u
}

/// f32 elements of one of ferrotron's data-parallel gradient buckets: `bucket_bytes` of them,
/// at most the rank's gradients (the trainer allocates exactly this, two of them). Under ZeRO-1
/// a bucket is reduce-scattered, so it is rounded up to `shards` equal blocks: then every full
/// bucket splits evenly and the blocks a rank owns add up to exactly ⌈params / shards⌉, the
/// optimizer shard of `states.rs`.
pub fn dp_bucket_len(bucket_bytes: u64, rank_params: u64, shards: u64) -> u64 {
    (bucket_bytes / 4)
        .clamp(1, rank_params.max(1))
        .next_multiple_of(shards.max(1))
}

/// Routed-expert parameters one rank holds: its 1/ep of the experts (of its 1/pp of the
/// layers, its tensor-parallel slice).
pub fn expert_params(m: &ModelSpec, l: &Layout) -> u64 {
    let all: u64 = crate::inventory::inventory(m)
        .iter()
        .filter(|t| t.expert.is_some())
        .map(|t| t.numel_tp(l.tp))
        .sum();
    all / l.ep / l.pp
}

/// The communication buffers of one rank of `x` holding `rank_params` parameters. Each buffer is
/// keyed on what decides it: the runtime's communicator (`x.runtime`: ferrotron's trainer or
/// the framework), or, where the tensors exchanged already sit in the engine's activation
/// table, the convention (`x.convention`).
pub fn comm_buffers(
    x: &PlanInput,
    m: Option<&ModelSpec>,
    units: Units,
    rank_params: u64,
    zero3: Option<Sizes>,
) -> Vec<CommBuf> {
    let (r, l, conv, bucket_bytes) = (&x.recipe, &x.layout, x.convention, x.bucket_bytes);
    // ferrotron's trainer runs the step's communication (`runtime.rs`).
    let trainer = x.runtime.is_trainer();
    // ferrotron's engine holds the tensors sequence, context and expert parallelism exchange in
    // its activation table (`act.sp.full`, `comm.cp.*`, `comm.ep.*`), whichever runtime moves
    // them.
    let engine_table = conv == Convention::Ferrotron;
    let st = r.precision.storage();
    let unit = units.embedding.max(units.head).max(units.layer);
    let mut out = Vec::new();
    let mut add = |name, dtype: DType, numel: u64, category, from_forward| {
        if numel > 0 {
            out.push(CommBuf {
                name,
                dtype,
                numel,
                category,
                from_forward,
            });
        }
    };
    let cb = Category::CommBuffers;
    // ZeRO-3 and parameter offload gather one unit at a time and prefetch the next
    // (Rajbhandari et al. 2020 §5.3; DeepSpeed's prefetch), and hold one unit of full
    // gradients before its reduce-scatter.
    // (With pipelining a ZeRO-3 stage holds all its parameters for the step instead: states.rs.)
    // (ferrotron's own ZeRO-3 is below; over one rank it has nothing to shard or gather.)
    let ferrotron_zero3 = trainer && (zero3.is_some() || l.dense_replicas() == 1);
    let generic_zero3 = !ferrotron_zero3 && l.zero >= 3 && l.pp == 1;
    // (ferrotron's trainer streams offloaded parameters through ZeRO-3's own windows:
    // `offload.param_windows` in the planner, and the gradient windows below.)
    if generic_zero3 || (l.offload == Offload::Params && !trainer) {
        // DeepSpeed's estimator counts the gathered layer once ("4*largest_layer_params").
        let gathered = if conv == Convention::DeepSpeed { 1 } else { 2 };
        add("zero3.gathered_params", st, gathered * unit, cb, true);
        add("zero3.unsharded_grads", st, unit, cb, false);
        // FSDP2 with `reduce_dtype` float32 copies a unit's bf16 gradients into an fp32
        // reduce-scatter input (torchtitan's mixed precision policy).
        if conv == Convention::Torchtitan && r.precision.has_master() {
            add("fsdp2.reduce_scatter_fp32", DType::F32, unit, cb, false);
        }
    }
    // ZeRO-2 reduce-scatters gradients bucket by bucket; two buckets in flight overlap
    // communication with the backward (PyTorch DDP's default bucket_cap_mb = 25).
    if conv == Convention::DeepSpeed {
        // `contiguous_gradients`: one `reduce_bucket_size` bucket in the 16-bit dtype.
        if matches!(l.zero, 1 | 2) && l.dense_replicas() > 1 {
            add(
                "deepspeed.ipg_bucket",
                st,
                crate::deepspeed::REDUCE_BUCKET_ELEMS,
                cb,
                false,
            );
        }
    } else if l.zero == 2 && l.dense_replicas() > 1 && !trainer {
        add("zero2.grad_buckets", DType::U8, 2 * bucket_bytes, cb, false);
    }
    // ferrotron's trainer all-reduces gradients in f32 buckets (ZeRO-1/2: reduce-scatters
    // them), two in flight, each at most the rank's gradients
    // (`crates/dist/src/data_parallel.rs`).
    // Under expert parallelism the dense gradients are reduced over the dp × ep replicas and
    // the experts' over the dp replicas of each expert, each in buckets of its own.
    let experts = match (m, l.ep > 1) {
        (Some(m), true) => expert_params(m, l),
        _ => 0,
    };
    if trainer && l.zero <= 2 && l.dense_replicas() > 1 {
        let shards = if l.zero >= 1 { l.dense_replicas() } else { 1 };
        let len = dp_bucket_len(bucket_bytes, rank_params - experts, shards);
        add("dp.grad_buckets", DType::F32, 2 * len, cb, false);
    }
    if trainer && experts > 0 && l.expert_replicas() > 1 {
        // (Under ZeRO-1 the experts' states shard over their replicas, in blocks of them.)
        let shards = if l.zero >= 1 { l.expert_replicas() } else { 1 };
        let len = dp_bucket_len(bucket_bytes, experts, shards);
        add("dp.expert_grad_buckets", DType::F32, 2 * len, cb, false);
    }
    // ferrotron's ZeRO-3 (`zero3.rs`): a bucket is a unit, so two buckets of the largest unit,
    // and one f32 buffer the parameters of a unit are all-gathered in (the next layer's
    // prefetch runs in it while the current layer computes).
    if let Some(z) = zero3 {
        add("dp.grad_buckets", DType::F32, 2 * z.bucket, cb, false);
        add("zero3.gather", DType::F32, z.bucket, cb, true);
    }
    // ferrotron's trainer all-reduces tensor-parallel activations (and gathers the
    // cross-entropy's row statistics) through one f32 buffer, in place: the largest is a
    // micro-batch of the residual stream, [b·s, h] (`crates/dist/src/tensor_parallel.rs`).
    if trainer && l.tp > 1 {
        if let Some(m) = m {
            // (A micro-batch's tokens on this rank: 1/cp of each sequence.)
            let tokens = r.mbs * r.seq / l.cp;
            let chunk = tokens.min(r.ce_chunk_tokens);
            let len = (tokens * m.hidden).max(3 * l.tp * chunk);
            add("tp.staging", DType::F32, len, cb, true);
        }
    }
    // ferrotron's trainer under ZeRO-2 keeps full gradients only in three windows that the
    // backward reuses: the embedding's, the head's and one layer's
    // (`crates/dist/src/zero/zero2.rs`); the head's forward writes the LM head's gradient, so they
    // exist from the first forward.
    // (With pipelining, ZeRO-2 keeps the stage's gradients unsharded over the step: states.rs.)
    // ZeRO-3 reduces gradients the same way, and streamed parameters (`--offload params`) move
    // each unit's gradients to the host from these windows.
    let zero2 = l.zero == 2 && l.pp == 1 && l.dense_replicas() > 1;
    if trainer && (zero2 || zero3.is_some() || l.offload == Offload::Params) {
        let gt = if r.precision.fp32_grad_acc() {
            r.precision.engine_grads()
        } else {
            st
        };
        let n = units.embedding + units.head + units.layer;
        add("zero2.grad_windows", gt, n, cb, true);
    }
    let Some(m) = m else { return out };
    let d = Dims::new(r, l);
    let n = d.n();
    // Sequence parallelism all-gathers the sequence-sharded norm output before the
    // column-parallel GEMMs (Korthikanti et al. 2022 §4.2.2). (ferrotron's engine gathers
    // into its activation scratch `act.sp.full`; its trainer through `comm.tp.staging`.)
    if d.sp && !engine_table {
        add("sp.allgather", st, n * m.hidden, cb, true);
    }
    // Pipeline point-to-point: one send and one receive buffer of the boundary activation.
    // (ferrotron's trainer sends from a few f32 buffers per direction: `planner::pp_buffers`.)
    if l.pp > 1 && !trainer {
        add(
            "pp.send_recv",
            st,
            2 * n * m.hidden / d.seq_shard(),
            cb,
            true,
        );
    }
    // Ring attention receives the next K and V chunk while computing on the current one.
    // (ferrotron's engine holds its blocks in the activation table, `comm.cp.block` and
    // `comm.cp.next`; its trainer sends each pass's copy from one f32 message buffer, a block
    // with its gradients at most: `crates/dist/src/context_parallel.rs`; on a device it
    // receives into a second one, the first being the send's, in flight meanwhile.)
    if l.cp > 1 {
        let kv_t = m.kv_heads_tp(l.tp);
        let kv = n * kv_t * (m.head_dim + m.v_head_dim);
        if trainer {
            add("cp.message", DType::F32, 2 * kv, cb, true);
        }
        if x.runtime == Runtime::FerrotronDevice {
            add("cp.receive", DType::F32, 2 * kv, cb, true);
        }
        if !engine_table {
            add("cp.kv_ring", st, 2 * kv, cb, true);
        }
    }
    // Expert parallelism: all-to-all dispatch and combine buffers of the routed tokens.
    // (ferrotron's engine holds them in the activation table, `comm.ep.send` / `comm.ep.recv`;
    // its trainer sends the one block in flight to a peer from a message buffer: at most every
    // token's copies for the peer's experts, with their routing weights.)
    if let (Some(moe), true) = (m.moe, l.ep > 1) {
        if trainer {
            let copies = n * moe.top_k.min(moe.num_experts / l.ep);
            add("ep.message", DType::F32, copies * (m.hidden + 1), cb, true);
        }
        if !engine_table {
            add("ep.all_to_all", st, 2 * n * moe.top_k * m.hidden, cb, true);
        }
    }
    // A mixture of experts on a device: its router kernels are handed the load-balancing
    // statistics in a device buffer (Σp and the copies per expert, then the loss's gradient per
    // probability: `Llama::moe_on_device`); on the host they are the engine's own.
    if let (Some(moe), Runtime::FerrotronDevice) = (m.moe, x.runtime) {
        add(
            "moe.router_stats",
            DType::F32,
            3 * moe.num_experts,
            cb,
            true,
        );
    }
    // fp8: the current layer's weights cast to fp8 for its GEMMs (per-tensor scaling). The
    // ferrotron engine quantises inside its GEMM workspace instead (measured, in the overhead).
    if r.precision == Precision::Fp8 && conv != Convention::Ferrotron {
        add(
            "fp8.weight_cast",
            DType::F8,
            unit,
            Category::Workspace,
            true,
        );
    }
    out
}
