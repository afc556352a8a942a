//! Activation memory of one micro-batch on one rank, per transformer layer and outside the
//! layers, under each convention. `Act` entries are turned into named buffers by the schedule.

use crate::convention::Convention;
use crate::layout::Layout;
use crate::memory::Category;
use crate::model::{Family, MlpAct, ModelSpec};
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

/// Per-layer activations under a convention, for a layer with a mixture-of-experts MLP
/// (`moe_layer`) or a dense one. The formula conventions are the GPT layer of Korthikanti et
/// al. whatever the family (their published tables are for GPT): for MoE, MLA, GeGLU or
/// sandwich-norm models they are that paper's approximation, not the model's own tensors.
pub fn layer_acts(
    m: &ModelSpec,
    r: &Recipe,
    l: &Layout,
    conv: Convention,
    moe_layer: bool,
) -> LayerActs {
    let d = Dims::new(r, l);
    match conv {
        Convention::Ferrotron => match m.family {
            Family::Gpt2 => gpt2_layer(m, r, &d),
            _ => decoder_layer(m, r, &d, moe_layer),
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

/// The name of the gated MLP's product (SwiGLU or GeGLU), as the engine would call it.
fn gated_product(m: &ModelSpec) -> &'static str {
    match m.mlp_act {
        MlpAct::GeGlu => "geglu",
        _ => "swiglu",
    }
}

/// The attention tensors a decoder layer keeps, between `ln1_out` and `resid_mid`, per rank.
/// Key/value widths use the heads each rank holds (`kv_heads_tp`: one whole head per rank when
/// tp exceeds the key/value heads, each replicated).
fn attention_acts(m: &ModelSpec, r: &Recipe, d: &Dims) -> Vec<Act> {
    let st = r.precision.storage();
    let (n, t) = (d.n(), d.t);
    let kv_t = m.kv_heads_tp(t);
    let mut out = vec![];
    if let Some(mla) = m.mla {
        // MLA as trained (DeepSeek-V2 §2.1.2, without the inference-time absorption): the
        // down projections run replicated on the whole (all-gathered) sequence, so their
        // outputs are [N, rank] on every tp rank; each latent is RMS-normed before its up
        // projection (kept: the norm's input and rstd; its output is the up-GEMM's input).
        if mla.q_lora_rank > 0 {
            out.push(act("q_a", st, n * mla.q_lora_rank));
            out.push(act("q_a_rstd", DType::F32, n));
            out.push(act("q_a_norm_out", st, n * mla.q_lora_rank));
        }
        out.push(act(
            "kv_a",
            st,
            n * (mla.kv_lora_rank + mla.qk_rope_head_dim),
        ));
        out.push(act("kv_a_rstd", DType::F32, n));
        out.push(act("kv_a_norm_out", st, n * mla.kv_lora_rank));
    } else if m.qk_norm {
        // Qwen3: the q/k projections' outputs feed a per-head RMSNorm (kept with its rstd)
        // whose output is rotated into q and k.
        out.push(act("q_pre", st, n * m.q_dim() / t));
        out.push(act("q_rstd", DType::F32, n * m.heads / t));
        out.push(act("k_pre", st, n * kv_t * m.head_dim));
        out.push(act("k_rstd", DType::F32, n * kv_t));
    }
    out.extend([
        act("q", st, n * m.q_dim() / t),
        act("k", st, n * kv_t * m.head_dim),
        act("v", st, n * kv_t * m.v_head_dim),
        act("attn_lse", DType::F32, n * m.heads / t),
        act("attn_out", st, n * m.o_dim() / t),
    ]);
    out
}

/// The MLP tensors a decoder layer keeps, after `ln2_out`, per rank. MoE: balanced routing
/// assumed, so each rank of the ep group processes n·top_k routed token copies on its local
/// experts; a shared expert sees every token.
fn mlp_acts(m: &ModelSpec, r: &Recipe, d: &Dims, moe_layer: bool) -> Vec<Act> {
    let st = r.precision.storage();
    let (n, t, ss, c) = (d.n(), d.t, d.seq_shard(), m.hidden);
    let product = gated_product(m);
    let gated = |rows: u64, width: u64, names: [&'static str; 3]| {
        let f = width.div_ceil(t);
        vec![
            act(names[0], st, rows * f),
            act(names[1], st, rows * f),
            act(names[2], st, rows * f),
        ]
    };
    let Some(moe) = m.moe.filter(|_| moe_layer) else {
        return gated(n, m.intermediate, ["gate", "up", product]);
    };
    let (e, k) = (moe.num_experts, moe.top_k);
    let routed = n * k;
    let mut out = vec![
        act("router_logits", DType::F32, n * e / ss),
        act("router_weights", DType::F32, n * k / ss),
        act("router_index", DType::U32, n * k / ss),
        act("expert_in", st, routed * c),
    ];
    out.extend(gated(
        routed,
        moe.expert_intermediate,
        ["gate", "up", product],
    ));
    if moe.shared_intermediate > 0 {
        out.extend(gated(
            n,
            moe.shared_intermediate,
            ["shared.gate", "shared.up", "shared.swiglu"],
        ));
    }
    if moe.shared_gate {
        // Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert's output.
        out.push(act("shared.score", DType::F32, n / ss));
    }
    out
}

/// The ferrotron engine's decoder layer (crates/engine model/llama.rs keeps the same names
/// for the Llama family; the other families extend it with their own tensors).
/// Policies:
/// - none: every tensor below;
/// - selective: drop the cheap, large ones (the RMSNorm outputs, recomputed from the saved
///   inputs and rstd; the gated product, recomputed from gate and up) and keep the
///   expensive matmul and attention outputs;
/// - full: keep only each layer's input; replay the layer's forward in its backward.
///
/// fp8: the CPU engine quantises GEMM inputs on the fly from their bf16 storage (inside its
/// GEMM workspace), so activations stay bf16: fp8 changes the numerics, not the memory. A GPU
/// engine that saves the fp8 casts for the weight-gradient GEMMs would use F8 for ln1_out,
/// attn_out, ln2_out and the gated product.
fn decoder_layer(m: &ModelSpec, r: &Recipe, d: &Dims, moe_layer: bool) -> LayerActs {
    let st = r.precision.storage();
    let (n, ss, c) = (d.n(), d.seq_shard(), m.hidden);
    let resid = |name| act(name, st, n * c / ss);
    let rstd = |name| act(name, DType::F32, n / ss);
    let mut all = vec![resid("input"), rstd("ln1_rstd"), resid("ln1_out")];
    all.extend(attention_acts(m, r, d));
    if m.sandwich_norm {
        // Gemma-2: the attention output (after o_proj) is normed before the residual add.
        all.extend([resid("attn_proj"), rstd("post_attn_rstd")]);
    }
    all.extend([resid("resid_mid"), rstd("ln2_rstd"), resid("ln2_out")]);
    all.extend(mlp_acts(m, r, d, moe_layer));
    if m.sandwich_norm {
        all.extend([resid("mlp_proj"), rstd("post_mlp_rstd")]);
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

/// The activation gradients one layer's backward needs at once, reused by every layer
/// (ferrotron convention): the gradient of each matmul output the layer keeps.
fn grad_scratch(m: &ModelSpec, r: &Recipe, d: &Dims, moe_layer: bool) -> Vec<Act> {
    let st = r.precision.storage();
    let (n, c) = (d.n(), m.hidden);
    let ws = |name, numel| Act {
        name,
        dtype: st,
        numel,
        category: Category::Workspace,
    };
    let mut out = vec![ws("grad.act.ln_out", n * c)];
    if m.family == Family::Gpt2 {
        let (t, f) = (d.t, m.intermediate.div_ceil(d.t));
        out.extend([
            ws("grad.act.q", n * m.q_dim() / t),
            ws("grad.act.k", n * m.kv_dim() / t),
            ws("grad.act.v", n * m.kv_dim() / t),
            ws("grad.act.attn_out", n * m.q_dim() / t),
            ws("grad.act.fc", n * f),
            ws("grad.act.gelu", n * f),
        ]);
        return out;
    }
    let grad_name = |a: &str| -> &'static str {
        match a {
            "q_a" => "grad.act.q_a",
            "kv_a" => "grad.act.kv_a",
            "q" => "grad.act.q",
            "k" => "grad.act.k",
            "v" => "grad.act.v",
            "attn_out" => "grad.act.attn_out",
            "gate" => "grad.act.gate",
            "up" => "grad.act.up",
            "swiglu" => "grad.act.swiglu",
            "geglu" => "grad.act.geglu",
            "shared.gate" => "grad.act.shared.gate",
            "shared.up" => "grad.act.shared.up",
            "shared.swiglu" => "grad.act.shared.swiglu",
            _ => "",
        }
    };
    for a in attention_acts(m, r, d)
        .into_iter()
        .chain(mlp_acts(m, r, d, moe_layer))
    {
        let name = grad_name(a.name);
        if !name.is_empty() {
            out.push(ws(name, a.numel));
        }
    }
    out
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
            // The activation gradients of the layer kind that needs the most bytes.
            let rest = [false, true]
                .into_iter()
                .filter(|&moe| (0..m.layers).any(|i| m.is_moe_layer(i) == moe))
                .map(|moe| grad_scratch(m, r, &d, moe))
                .max_by_key(|acts| acts.iter().map(|a| a.numel * a.dtype.bytes()).sum::<u64>())
                .unwrap_or_default();
            let half = m.rotary_dim / 2;
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
