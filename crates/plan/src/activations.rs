//! Activation memory of one micro-batch on one rank, per transformer layer and outside the
//! layers, under each convention. `Act` entries are turned into named buffers by the schedule.

use crate::convention::Convention;
use crate::layout::Layout;
use crate::memory::Category;
use crate::model::{Family, ModelSpec};
use crate::recipe::{DType, Recipe, Recompute};
use crate::tensors::{self, Edge, LayerTensor};

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
    /// The table's sizes (`tensors::Dims`) of this micro-batch for model `m`.
    pub fn table(&self, m: &ModelSpec, r: &Recipe) -> tensors::Dims {
        tensors::Dims {
            tokens: self.n(),
            hidden: m.hidden,
            heads: m.heads,
            q_dim: m.q_dim(),
            kv_dim: m.kv_dim(),
            head_dim: m.head_dim,
            ffn: m.intermediate,
            vocab: m.vocab,
            positions: m.max_positions,
            experts: m.moe.map_or(0, |moe| moe.num_experts),
            top_k: m.moe.map_or(1, |moe| moe.top_k),
            ce_chunk_tokens: r.ce_chunk_tokens,
            tp: self.t,
            sp: self.sp,
        }
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

/// The ferrotron engine's Llama layer: the tensors of the table (`tensors::LayerTensor`), the
/// ones the recompute policy drops moved to the workspace. The policies:
/// - none: every tensor;
/// - selective: drop the cheap, large ones (both RMSNorm outputs, recomputed from the saved
///   input/resid_mid and rstd; the SwiGLU product, recomputed from gate and up; the routed
///   copies of a MoE layer's input) and keep the expensive matmul and attention outputs;
/// - full: keep only each layer's input; replay the layer's forward in its backward.
///
/// fp8: the CPU engine quantises GEMM inputs on the fly from their bf16 storage (inside its
/// GEMM workspace), so activations stay bf16: fp8 changes the numerics, not the memory. A GPU
/// engine that saves the fp8 casts for the weight-gradient GEMMs would store those as F8.
fn llama_layer(m: &ModelSpec, r: &Recipe, d: &Dims) -> LayerActs {
    let (st, td) = (r.precision.storage(), d.table(m, r));
    let (saved, recompute) = LayerTensor::of_layer(m.moe.is_some())
        .map(|t| {
            let s = t.shape();
            let a = act(t.name(), s.elems.dtype(st), s.numel(&td));
            (t.kept_by(r.recompute), a)
        })
        .partition::<Vec<_>, _>(|(kept, _)| *kept);
    LayerActs {
        saved: saved.into_iter().map(|(_, a)| a).collect(),
        recompute: recompute
            .into_iter()
            .map(|(_, a)| Act {
                category: Category::Workspace,
                ..a
            })
            .collect(),
    }
}

/// GPT-2 block as the ferrotron engine would hold it (LayerNorm saves mean and rstd).
fn gpt2_layer(m: &ModelSpec, r: &Recipe, d: &Dims) -> LayerActs {
    let st = r.precision.storage();
    let (n, t, ss, c) = (d.n(), d.t, d.seq_shard(), m.hidden);
    let f = m.intermediate.div_ceil(t);
    // Selective recomputation drops the norm outputs and the GELU output (cheap to rebuild).
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
    let keeps = |a: &Act| match r.recompute {
        Recompute::None => true,
        Recompute::Selective => !matches!(a.name, "ln1_out" | "ln2_out" | "gelu"),
        Recompute::Full => a.name == "input",
    };
    let (saved, mut recompute): (Vec<Act>, Vec<Act>) = all.into_iter().partition(keeps);
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
            let (st, td) = (r.precision.storage(), d.table(m, r));
            let buf = |e: Edge, category| Act {
                name: e.name(),
                dtype: e.shape().elems.dtype(st),
                numel: e.shape().numel(&td),
                category,
            };
            let ws = Category::Workspace;
            let mut rest: Vec<Act> = Edge::SCRATCH.iter().map(|&e| buf(e, ws)).collect();
            if m.family == Family::Gpt2 {
                // The GPT-2 block's MLP: fc and gelu instead of gate, up and swiglu.
                let f = m.intermediate.div_ceil(t);
                rest.truncate(5);
                for name in ["grad.act.fc", "grad.act.gelu"] {
                    rest.push(Act {
                        name,
                        dtype: st,
                        numel: n * f,
                        category: ws,
                    });
                }
            }
            EdgeActs {
                // The trainer's batch buffers and the engine's RoPE cos/sin tables.
                persistent: vec![
                    buf(Edge::DataTokens, other),
                    buf(Edge::DataTargets, other),
                    buf(Edge::RopeCos, ws),
                    buf(Edge::RopeSin, ws),
                ],
                embedding: vec![],
                head: vec![
                    buf(Edge::FinalNormInput, other),
                    buf(Edge::FinalNormRstd, other),
                    buf(Edge::FinalNormOut, other),
                ],
                // The LM head runs chunk by chunk at the end of the forward: logits, loss and
                // their gradient in place, then dW_head and d(final norm out) (as llm.c).
                loss_transient: vec![buf(Edge::LogitsChunk, other), buf(Edge::Losses, other)],
                scratch_first: vec![buf(Edge::GradResid, ws)],
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
