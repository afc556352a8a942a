//! Model states of one rank: parameters, gradients, fp32 master weights, optimizer states,
//! with ZeRO sharding (Rajbhandari et al. 2020, §5.1–5.3) and offloading.

use crate::convention::Convention;
use crate::dp_layout::StateLens;
use crate::layout::{Layout, Offload};
use crate::memory::{BufId, Category, MemoryPlan};
use crate::recipe::{DType, Recipe};

/// Elements of the model held by one rank before ZeRO: dense (replicated over
/// `Layout::dense_replicas`) and expert (replicated over `Layout::expert_replicas`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankElems {
    pub dense: u64,
    pub expert: u64,
}

/// The buffers created, by lifetime: allocated at init, at the first backward, at the first
/// optimizer step.
#[derive(Debug, Default)]
pub struct StateBuffers {
    pub at_init: Vec<BufId>,
    pub at_first_backward: Vec<BufId>,
    pub at_first_optimizer: Vec<BufId>,
    /// Allocated at each step's first forward and freed after its last backward (ZeRO-3 with
    /// pipelining: the stage's gathered parameters).
    pub per_step: Vec<BufId>,
    /// The states' lengths (wherever they are placed: offloaded ones too); the windows and
    /// buckets are the communication buffers' (`buffers.rs`).
    pub lens: StateLens,
}

/// Elements of this rank's shard of a state replicated over `replicas` ranks (ceil: the last
/// shard is padded, as flat-buffer ZeRO implementations do).
fn shard(e: RankElems, l: &Layout, sharded: bool) -> u64 {
    if sharded {
        e.dense.div_ceil(l.dense_replicas()) + e.expert.div_ceil(l.expert_replicas())
    } else {
        e.dense + e.expert
    }
}

pub fn add_states(
    plan: &mut MemoryPlan,
    elems: RankElems,
    r: &Recipe,
    l: &Layout,
    conv: Convention,
    zero3: Option<crate::zero3::Sizes>,
) -> StateBuffers {
    let p = r.precision;
    let mut out = StateBuffers::default();
    let on_host_opt = l.offload != Offload::None;
    let on_host_params = l.offload == Offload::Params;
    let mut place =
        |plan: &mut MemoryPlan, list: u8, name: &str, dt: DType, n: u64, c, host: bool| {
            if n == 0 {
                return;
            }
            if host {
                plan.host_bytes += n * dt.bytes();
                return;
            }
            let id = plan.add(name, dt, n, c);
            match list {
                0 => out.at_init.push(id),
                1 => out.at_first_backward.push(id),
                _ => out.at_first_optimizer.push(id),
            }
        };
    // ferrotron's ZeRO-3 pads every unit to whole blocks (`zero3.rs`), so its shard of every
    // state is the sum of its blocks.
    let shard = |e: RankElems, l: &Layout, sharded: bool| match (zero3, sharded) {
        (Some(z), true) => z.shard,
        _ => shard(e, l, sharded),
    };
    let params_n = shard(elems, l, l.zero >= 3);
    // Pipelining with ZeRO-2/3 (torchtitan runs FSDP2 under torch.distributed.pipelining):
    // the schedule turns gradient sync off for every micro-batch but the last
    // (`set_requires_gradient_sync`), so gradients accumulate unsharded over the step and are
    // reduce-scattered once, in its last backward; and torchtitan's `apply_fsdp` sets
    // `reshard_after_forward = False` when pp is on, so a ZeRO-3 stage all-gathers its
    // parameters at its first forward and holds them, unsharded, to its last backward.
    // DeepSpeed refuses ZeRO-2/3 with its pipeline engine instead.
    let grads_n = shard(elems, l, l.zero >= 2 && l.pp == 1);
    let opt_n = shard(elems, l, l.zero >= 1);
    out.lens = StateLens {
        stage_params: elems.dense + elems.expert,
        params: params_n,
        grads: grads_n,
        opt: opt_n,
        opt_dense: match (zero3, l.zero >= 1) {
            (Some(z), _) => z.shard,
            (None, true) => elems.dense.div_ceil(l.dense_replicas()),
            (None, false) => elems.dense,
        },
        ..StateLens::default()
    };
    if l.zero >= 3 && l.pp > 1 && !on_host_params {
        let id = plan.add(
            "params.unsharded_for_step",
            p.storage(),
            elems.dense + elems.expert,
            Category::Params,
        );
        out.per_step.push(id);
    }
    // torchtitan's FSDP2 keeps the sharded parameters in fp32 (they are the optimizer's, no
    // separate master copy) and all-gathers them in bf16 (`MixedPrecisionPolicy(param_dtype=
    // bfloat16, reduce_dtype=float32)`, torchtitan `parallelize_llama.py`); its sharded
    // gradients are fp32 like the parameters: 4 + 4 + 8 = 16 B/param over the FSDP group.
    let fsdp2 = conv == Convention::Torchtitan && p.has_master();
    place(
        plan,
        0,
        "params",
        if fsdp2 { DType::F32 } else { p.storage() },
        params_n,
        Category::Params,
        on_host_params,
    );
    // ...and gathers the units' parameters into windows it keeps (the embedding's, the head's,
    // two layers'), allocated with the parameters.
    if let Some(z) = zero3 {
        place(
            plan,
            0,
            "zero3.param_windows",
            p.storage(),
            z.windows,
            Category::Params,
            false,
        );
    }
    if p.has_master() && !fsdp2 {
        place(
            plan,
            0,
            "master",
            DType::F32,
            opt_n,
            Category::Master,
            on_host_opt,
        );
    }
    if conv.fp32_main_grads() {
        // Megatron accumulates gradients straight into an fp32 `main_grad` per parameter
        // (no 16-bit gradient copy): 2 + 4 + 4 + 8 = 18 B/param with Adam.
        place(
            plan,
            1,
            "grads.main_fp32",
            DType::F32,
            grads_n,
            Category::Grads,
            on_host_params,
        );
    } else if conv == Convention::DeepSpeed {
        // DeepSpeed (`deepspeed.rs`): the whole model's 16-bit gradients under ZeRO-1/2 without
        // offload, and an fp32 gradient partition next to the fp32 parameters.
        if l.zero <= 2 && !on_host_opt {
            place(
                plan,
                1,
                "grads",
                p.storage(),
                elems.dense + elems.expert,
                Category::Grads,
                false,
            );
        }
        if p.has_master() {
            place(
                plan,
                1,
                "grads.fp32_partition",
                DType::F32,
                opt_n,
                Category::Grads,
                on_host_opt,
            );
        }
    } else if fsdp2 {
        place(
            plan,
            1,
            "grads.fp32",
            DType::F32,
            grads_n,
            Category::Grads,
            on_host_params,
        );
    } else if conv == Convention::Ferrotron && p.fp32_grad_acc() {
        // ferrotron's engine accumulates gradients straight into fp32 (each weight-gradient
        // GEMM rounds into f32 once), so there is no 16-bit copy: 2 + 4 + 4 + 8 = 18 B/param,
        // against 16 for bf16 gradients.
        place(
            plan,
            1,
            "grads",
            p.engine_grads(),
            grads_n,
            Category::Grads,
            on_host_params,
        );
    } else {
        place(
            plan,
            1,
            "grads",
            p.storage(),
            grads_n,
            Category::Grads,
            on_host_params,
        );
        // The playbook's recipe: 16-bit gradients plus an fp32 accumulator (20 B/param).
        if p.fp32_grad_acc() {
            place(
                plan,
                1,
                "grads.fp32_accumulator",
                DType::F32,
                grads_n,
                Category::Grads,
                on_host_params,
            );
        }
    }
    for k in 0..r.optimizer.states_per_param() {
        let name = ["optim.exp_avg", "optim.exp_avg_sq"][k as usize];
        place(
            plan,
            2,
            name,
            DType::F32,
            opt_n,
            Category::Optimizer,
            on_host_opt,
        );
    }
    out
}
