//! Activation memory of one micro-batch on one rank, per transformer layer and outside the
//! layers, under each convention. `Act` entries are turned into named buffers by the schedule.

use crate::convention::Convention;
use crate::layout::Layout;
use crate::memory::Category;
use crate::model::{Family, ModelSpec};
use crate::recipe::{DType, Recipe, Recompute};

/// One activation tensor (or, for formula conventions, one aggregate in bytes as `U8`).
#[derive(Debug, Clone, PartialEq)]
pub struct Act {
    pub name: &'static str,
    pub dtype: DType,
    pub numel: u64,
    pub category: Category,
}

fn act(name: &'static str, dtype: DType, numel: u64) -> Act {
    Act {
        name,
        dtype,
        numel,
        category: Category::LayerActivations,
    }
}

fn bytes(name: &'static str, numel: u64, category: Category) -> Act {
    Act {
        name,
        dtype: DType::U8,
        numel,
        category,
    }
}

/// What one layer holds for backward, and what its backward needs on top, transiently.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerActs {
    pub saved: Vec<Act>,
    /// Rebuilt during this layer's backward (recomputation), freed after it.
    pub recompute: Vec<Act>,
}

/// Activations outside the transformer layers, per micro-batch, in the order the engine
/// allocates them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EdgeActs {
    /// Allocated once at init and kept (batch token buffers, RoPE tables).
    pub persistent: Vec<Act>,
    /// Held from the forward of the first stage's embedding to its backward.
    pub embedding: Vec<Act>,
    /// Held from the final norm's forward into the backward (last stage).
    pub head: Vec<Act>,
    /// Materialised only while the loss is computed at the end of the forward (chunked logits).
    pub loss_transient: Vec<Act>,
    /// Activation gradients allocated first in a micro-batch's backward, before `head` is freed.
    pub scratch_first: Vec<Act>,
    /// The remaining activation gradients, allocated once `head` is freed, reused by every layer.
    pub scratch_rest: Vec<Act>,
}

/// Shape facts shared by every formula: tokens of one micro-batch on one rank.
pub struct Dims {
    pub b: u64,
    /// Sequence length processed by this rank (seq / cp).
    pub s: u64,
    /// Full sequence length (keys attended to).
    pub s_full: u64,
    pub t: u64,
    pub sp: bool,
}

impl Dims {
    pub fn new(r: &Recipe, l: &Layout) -> Self {
        Dims {
            b: r.mbs,
            s: r.seq / l.cp,
            s_full: r.seq,
            t: l.tp,
            sp: l.sp && l.tp > 1,
        }
    }
    /// Tokens on this rank.
    pub fn n(&self) -> u64 {
        self.b * self.s
    }
    /// Divisor of tensors of the residual stream: t under sequence parallelism, else 1.
    pub fn seq_shard(&self) -> u64 {
        if self.sp {
            self.t
        } else {
            1
        }
    }
}

/// Korthikanti et al. 2022, Table 2: activation bytes of one GPT layer with 16-bit
/// activations. sbh terms use the local sequence s; the attention-score term 5as²b uses
/// s_local × s_full so that context parallelism divides it once.
pub fn korthikanti_layer(h: u64, a: u64, d: &Dims, rc: Recompute) -> u64 {
    let sbh = d.s * d.b * h;
    let score = 5 * a * d.s * d.s_full * d.b;
    let t = d.t;
    match (rc, d.sp) {
        // sbh(10 + 24/t + 5as/(ht)); with t = 1 this is the no-parallelism sbh(34 + 5as/h).
        (Recompute::None, false) => 10 * sbh + (24 * sbh + score) / t,
        // (sbh/t)(34 + 5as/h)
        (Recompute::None, true) => (34 * sbh + score) / t,
        // sbh(10 + 24/t)
        (Recompute::Selective, false) => 10 * sbh + 24 * sbh / t,
        // 34sbh/t
        (Recompute::Selective, true) => 34 * sbh / t,
        // 2sbh: only the layer input is kept (divided by t under sequence parallelism).
        (Recompute::Full, false) => 2 * sbh,
        (Recompute::Full, true) => 2 * sbh / t,
    }
}

/// Per-layer activations under a convention.
pub fn layer_acts(m: &ModelSpec, r: &Recipe, l: &Layout, conv: Convention) -> LayerActs {
    let d = Dims::new(r, l);
    match conv {
        Convention::Ferrotron => match m.family {
            Family::Gpt2 => gpt2_layer(m, r, &d),
            _ => llama_layer(m, r, &d),
        },
        _ => {
            let held = korthikanti_layer(m.hidden, m.heads, &d, r.recompute);
            let none = korthikanti_layer(m.hidden, m.heads, &d, Recompute::None);
            let recompute = match r.recompute {
                Recompute::None => vec![],
                // Full: the whole layer is rebuilt from its input during its backward.
                // Selective: the attention core (the 5as²b/t term) is rebuilt.
                _ => vec![bytes("recompute", none - held, Category::Workspace)],
            };
            LayerActs {
                saved: vec![bytes("layer", held, Category::LayerActivations)],
                recompute,
            }
        }
    }
}

/// The ferrotron engine's Llama layer (crates/engine model/llama.rs keeps the same names).
/// Policies:
/// - none: every tensor below;
/// - selective: drop the cheap, large ones (both RMSNorm outputs, recomputed from the saved
///   input/resid_mid and rstd; the SwiGLU product, recomputed from gate and up) and keep the
///   expensive matmul and attention outputs;
/// - full: keep only each layer's input; replay the layer's forward in its backward.
fn llama_layer(m: &ModelSpec, r: &Recipe, d: &Dims) -> LayerActs {
    let st = r.precision.storage();
    // fp8: the CPU engine quantises GEMM inputs on the fly from their bf16 storage (inside its
    // GEMM workspace), so activations stay bf16: fp8 changes the numerics, not the memory.
    // A GPU engine that saves the fp8 casts for the weight-gradient GEMMs would use F8 here.
    let gemm_in = st;
    let (n, t, ss) = (d.n(), d.t, d.seq_shard());
    let c = m.hidden;
    let mut all = vec![
        act("input", st, n * c / ss),
        act("ln1_rstd", DType::F32, n / ss),
        act("ln1_out", gemm_in, n * c / ss),
        act("q", st, n * m.q_dim() / t),
        act("k", st, n * m.kv_dim() / t),
        act("v", st, n * m.kv_dim() / t),
        act("attn_lse", DType::F32, n * m.heads / t),
        act("attn_out", gemm_in, n * m.q_dim() / t),
        act("resid_mid", st, n * c / ss),
        act("ln2_rstd", DType::F32, n / ss),
        act("ln2_out", gemm_in, n * c / ss),
    ];
    match m.moe {
        None => {
            let f = m.intermediate.div_ceil(t);
            all.push(act("gate", st, n * f));
            all.push(act("up", st, n * f));
            all.push(act("swiglu", gemm_in, n * f));
        }
        Some(moe) => {
            // Balanced routing assumed: each rank of the ep group processes n·top_k routed
            // token copies on its local experts.
            let (e, k) = (moe.num_experts, moe.top_k);
            let f = m.intermediate.div_ceil(t);
            let routed = n * k;
            all.push(act("router_logits", DType::F32, n * e / ss));
            all.push(act("router_weights", DType::F32, n * k / ss));
            all.push(act("router_index", DType::U32, n * k / ss));
            all.push(act("expert_in", gemm_in, routed * c));
            all.push(act("gate", st, routed * f));
            all.push(act("up", st, routed * f));
            all.push(act("swiglu", gemm_in, routed * f));
        }
    }
    split_policy(all, r.recompute)
}

/// GPT-2 block as the ferrotron engine would hold it (LayerNorm saves mean and rstd).
fn gpt2_layer(m: &ModelSpec, r: &Recipe, d: &Dims) -> LayerActs {
    let st = r.precision.storage();
    let (n, t, ss, c) = (d.n(), d.t, d.seq_shard(), m.hidden);
    let f = m.intermediate.div_ceil(t);
    let all = vec![
        act("input", st, n * c / ss),
        act("ln1_stats", DType::F32, 2 * n / ss),
        act("ln1_out", st, n * c / ss),
        act("qkv", st, 3 * n * c / t),
        act("attn_lse", DType::F32, n * m.heads / t),
        act("attn_out", st, n * c / t),
        act("resid_mid", st, n * c / ss),
        act("ln2_stats", DType::F32, 2 * n / ss),
        act("ln2_out", st, n * c / ss),
        act("fc", st, n * f),
        act("gelu", st, n * f),
    ];
    split_policy(all, r.recompute)
}

/// Splits a layer's full inventory into saved and recomputed parts for a policy.
fn split_policy(all: Vec<Act>, rc: Recompute) -> LayerActs {
    let (saved, mut recompute): (Vec<Act>, Vec<Act>) =
        all.into_iter().partition(|a| rc.keeps(a.name));
    for a in &mut recompute {
        a.category = Category::Workspace;
    }
    LayerActs { saved, recompute }
}

/// Activations outside the layers and the backward scratch, per micro-batch.
pub fn edge_acts(m: &ModelSpec, r: &Recipe, l: &Layout, conv: Convention) -> EdgeActs {
    let d = Dims::new(r, l);
    let (n, t, ss, c) = (d.n(), d.t, d.seq_shard(), m.hidden);
    let other = Category::OtherActivations;
    match conv {
        Convention::Ferrotron => {
            let st = r.precision.storage();
            let chunk = n.min(r.ce_chunk_tokens);
            let v = m.vocab.div_ceil(t);
            let ws = |name, dt, numel| Act {
                name,
                dtype: dt,
                numel,
                category: Category::Workspace,
            };
            let mut rest = vec![
                ws("grad.act.ln_out", st, n * c),
                ws("grad.act.q", st, n * m.q_dim() / t),
                ws("grad.act.k", st, n * m.kv_dim() / t),
                ws("grad.act.v", st, n * m.kv_dim() / t),
                ws("grad.act.attn_out", st, n * m.q_dim() / t),
            ];
            let f = m.intermediate.div_ceil(t);
            let routed = n * m.moe.map_or(1, |moe| moe.top_k);
            if m.family == Family::Gpt2 {
                rest.push(ws("grad.act.fc", st, n * f));
                rest.push(ws("grad.act.gelu", st, n * f));
            } else {
                rest.push(ws("grad.act.gate", st, routed * f));
                rest.push(ws("grad.act.up", st, routed * f));
                rest.push(ws("grad.act.swiglu", st, routed * f));
            }
            let half = m.head_dim / 2;
            EdgeActs {
                // The trainer's batch buffers and the engine's RoPE cos/sin tables.
                persistent: vec![
                    Act {
                        name: "data.tokens",
                        dtype: DType::U32,
                        numel: n,
                        category: other,
                    },
                    Act {
                        name: "data.targets",
                        dtype: DType::U32,
                        numel: n,
                        category: other,
                    },
                    Act {
                        name: "rope.cos",
                        dtype: DType::F32,
                        numel: m.max_positions * half,
                        category: Category::Workspace,
                    },
                    Act {
                        name: "rope.sin",
                        dtype: DType::F32,
                        numel: m.max_positions * half,
                        category: Category::Workspace,
                    },
                ],
                embedding: vec![],
                head: vec![
                    Act {
                        name: "act.final_norm.input",
                        dtype: st,
                        numel: n * c / ss,
                        category: other,
                    },
                    Act {
                        name: "act.final_norm.rstd",
                        dtype: DType::F32,
                        numel: n / ss,
                        category: other,
                    },
                    Act {
                        name: "act.final_norm.out",
                        dtype: st,
                        numel: n * c,
                        category: other,
                    },
                ],
                // The LM head runs chunk by chunk at the end of the forward: logits, loss and
                // their gradient in place, then dW_head and d(final norm out) (as llm.c).
                loss_transient: vec![
                    Act {
                        name: "act.logits_chunk",
                        dtype: DType::F32,
                        numel: chunk * v,
                        category: other,
                    },
                    Act {
                        name: "act.losses",
                        dtype: DType::F32,
                        numel: n,
                        category: other,
                    },
                ],
                scratch_first: vec![ws("grad.act.resid", st, n * c / ss)],
                scratch_rest: rest,
            }
        }
        Convention::Megatron => {
            let sbh = d.s * d.b * c;
            EdgeActs {
                // §4.3: the embedding dropout mask, one byte per element (÷t with SP).
                embedding: vec![bytes("act.embedding_dropout_mask", sbh / ss, other)],
                // §4.3: final layer norm + output projection input 4sbh/t, fp32 logits for
                // the cross-entropy 4sbv/t: together 4sbh/t·(1 + v/h).
                head: vec![
                    bytes("act.output_norm_and_proj", 4 * sbh / t, other),
                    bytes("act.logits_fp32", 4 * d.s * d.b * m.vocab / t, other),
                ],
                ..EdgeActs::default()
            }
        }
        // The playbook's charts add the embedding dropout mask, s·b·h bytes, to the layers
        // (9.25390625 GiB = 9.25 GiB of layers + 4 MiB for h 4096, s 1024, b 1).
        Convention::Playbook | Convention::ZeroPaper => EdgeActs {
            embedding: vec![bytes(
                "act.embedding_dropout_mask",
                d.s * d.b * c / ss,
                other,
            )],
            ..EdgeActs::default()
        },
    }
}
