//! The tensor inventory: every weight tensor of a model, named as HF names it, with its shape.
//! Parameter counts are sums over this list, so they are exact by construction.

use crate::model::{Family, ModelSpec};
use serde::Serialize;

mod parallel_block;

/// Where a tensor lives along the pipeline: stage 0 holds the embeddings, the last stage the final
/// norm and the LM head, and layer `i` lives on stage `i / (L / pp)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Placement {
    Embedding,
    Layer(u64),
    Head,
}

/// How tensor parallelism splits the tensor (Megatron-LM, Shoeybi et al. 2019, §3):
/// column-parallel linears split their output dimension, row-parallel linears their input
/// dimension, the embedding and LM head split the vocabulary, norms are replicated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TpSplit {
    Replicated,
    /// Split along dimension `0` or `1` of the stored shape.
    Dim(usize),
    /// Column-parallel by attention heads along dimension 0: the first `q_rows` rows (query
    /// heads) split evenly; the rest are `kv_heads` equal key/value head groups, split evenly
    /// while tp ≤ kv_heads and replicated beyond, each rank then holding one whole head (vLLM
    /// `QKVParallelLinear`: `num_kv_head_replicas = tp_size / total_num_kv_heads`). k_proj and
    /// v_proj have `q_rows = 0`; Phi-3's fused `qkv_proj` has `q_rows = heads × head_dim`.
    Heads {
        q_rows: u64,
        kv_heads: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub placement: Placement,
    pub tp: TpSplit,
    /// `Some(e)` for the weights of routed expert `e` of a mixture-of-experts MLP.
    pub expert: Option<u64>,
    /// True for weights used as a matmul operand (for FLOP counting; the embedding lookup
    /// is a gather, not a matmul, and biases and norms are elementwise).
    pub matmul: bool,
}

impl Tensor {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Length of dimension `d` on one tensor-parallel rank of `tp` (ceil for dimensions that
    /// do not divide, e.g. a vocabulary; Megatron pads those).
    pub fn dim_tp(&self, d: usize, tp: u64) -> u64 {
        let s = self.shape[d];
        match self.tp {
            TpSplit::Dim(x) if x == d => s.div_ceil(tp),
            TpSplit::Heads { q_rows, kv_heads } if d == 0 => {
                q_rows.div_ceil(tp) + (s - q_rows) / kv_heads * kv_heads.div_ceil(tp)
            }
            _ => s,
        }
    }

    /// Elements held by one tensor-parallel rank of `tp`.
    pub fn numel_tp(&self, tp: u64) -> u64 {
        (0..self.shape.len()).map(|d| self.dim_tp(d, tp)).product()
    }
}

struct Builder {
    tensors: Vec<Tensor>,
}

impl Builder {
    fn push(&mut self, name: String, shape: &[u64], placement: Placement, tp: TpSplit) {
        let matmul = shape.len() == 2
            && !name.ends_with("embed_tokens.weight")
            && !name.ends_with("embed_in.weight")
            && !name.ends_with("wte.weight")
            && !name.ends_with("wpe.weight");
        self.tensors.push(Tensor {
            name,
            shape: shape.to_vec(),
            placement,
            tp,
            expert: None,
            matmul,
        });
    }

    /// A linear layer's weight, and its bias when `bias` (a column-parallel bias splits with
    /// the output, a row-parallel one is replicated).
    fn linear(&mut self, name: &str, shape: [u64; 2], p: Placement, tp: TpSplit, bias: bool) {
        self.push(format!("{name}.weight"), &shape, p, tp);
        if bias {
            let bias_split = if tp == ROW { REP } else { tp };
            self.push(format!("{name}.bias"), &[shape[0]], p, bias_split);
        }
    }

    /// A gated MLP (`gate_proj`, `up_proj`, `down_proj` of width `f`) under `prefix`.
    fn gated_mlp(&mut self, prefix: &str, c: u64, f: u64, p: Placement, bias: bool) {
        for (proj, shape, split) in [
            (names::GATE, [f, c], COL),
            (names::UP, [f, c], COL),
            (names::DOWN, [c, f], ROW),
        ] {
            self.linear(&names::proj(prefix, proj), shape, p, split, bias);
        }
    }

    fn norm(&mut self, name: String, width: u64, p: Placement) {
        self.push(name, &[width], p, REP);
    }

    /// Marks the tensors pushed since `from` as routed expert `e`'s.
    fn mark_expert(&mut self, from: usize, e: u64) {
        for t in &mut self.tensors[from..] {
            t.expert = Some(e);
        }
    }
}

/// The names of a Llama-family decoder's tensors as Hugging Face spells them, written once: the
/// inventory is built from them and the engine finds its tensors by them.
pub mod names {
    pub const EMBED: &str = "model.embed_tokens.weight";
    pub const FINAL_NORM: &str = "model.norm.weight";
    pub const LM_HEAD: &str = "lm_head.weight";
    /// A layer's modules, under [`layer`]; a linear's tensors are `{module}.weight`/`.bias`.
    pub const ATTN_NORM: &str = "input_layernorm";
    pub const MLP_NORM: &str = "post_attention_layernorm";
    pub const ATTN: &str = "self_attn";
    pub const Q: &str = "q_proj";
    pub const K: &str = "k_proj";
    pub const V: &str = "v_proj";
    pub const O: &str = "o_proj";
    pub const MLP: &str = "mlp";
    pub const GATE: &str = "gate_proj";
    pub const UP: &str = "up_proj";
    pub const DOWN: &str = "down_proj";

    /// Mixtral's sparse MLP: a router `gate` and experts `experts.{e}` of three linears
    /// (w1 gate, w2 down, w3 up), no biases.
    pub const MOE: &str = "block_sparse_moe";
    pub const ROUTER: &str = "gate";
    pub const EXPERT_GATE: &str = "w1";
    pub const EXPERT_DOWN: &str = "w2";
    pub const EXPERT_UP: &str = "w3";

    /// `{block}.experts.{e}`.
    pub fn expert(block: &str, e: u64) -> String {
        format!("{block}.experts.{e}")
    }

    pub fn layer(i: u64) -> String {
        format!("model.layers.{i}")
    }

    /// `{layer i}.{module}.weight`.
    pub fn weight(i: u64, module: &str) -> String {
        format!("{}.{module}.weight", layer(i))
    }

    /// `{layer i}.{module}.bias`.
    pub fn bias(i: u64, module: &str) -> String {
        format!("{}.{module}.bias", layer(i))
    }

    /// `{block}.{proj}`: a projection of the attention or MLP block.
    pub fn proj(block: &str, proj: &str) -> String {
        format!("{block}.{proj}")
    }
}

const COL: TpSplit = TpSplit::Dim(0);
const ROW: TpSplit = TpSplit::Dim(1);
const REP: TpSplit = TpSplit::Replicated;

/// Builds the inventory in HF order and naming (`model.layers.{i}....` for the Llama-like
/// families and DeepSeek, `transformer.h.{i}....` for GPT-2 and GPT-J, `gpt_neox.layers.{i}....`
/// for GPT-NeoX).
pub fn inventory(m: &ModelSpec) -> Vec<Tensor> {
    let mut b = Builder {
        tensors: Vec::new(),
    };
    match m.family {
        Family::Gpt2 => gpt2(m, &mut b),
        Family::GptNeox => parallel_block::neox(m, &mut b),
        Family::GptJ => parallel_block::gptj(m, &mut b),
        _ => decoder(m, &mut b),
    }
    b.tensors
}

/// A decoder's tensors in the order the forward pass uses them (the engine's flat parameter
/// order, which its seeded initialisation follows).
fn decoder(m: &ModelSpec, b: &mut Builder) {
    let (c, v) = (m.hidden, m.vocab);
    b.push(names::EMBED.into(), &[v, c], Placement::Embedding, COL);
    for i in 0..m.layers {
        let p = Placement::Layer(i);
        let layer = names::layer(i);
        b.norm(names::weight(i, names::ATTN_NORM), c, p);
        attention(m, b, &names::proj(&layer, names::ATTN), p);
        b.norm(names::weight(i, names::MLP_NORM), c, p);
        if m.sandwich_norm {
            // Gemma2DecoderLayer: post_attention_layernorm normalises the attention output;
            // the MLP has its own pre_ and post_feedforward_layernorm.
            b.norm(format!("{layer}.pre_feedforward_layernorm.weight"), c, p);
        }
        if m.is_moe_layer(i) {
            moe_mlp(m, b, &layer, p);
        } else {
            dense_mlp(m, b, &names::proj(&layer, names::MLP), p);
        }
        if m.sandwich_norm {
            b.norm(format!("{layer}.post_feedforward_layernorm.weight"), c, p);
        }
    }
    b.norm(names::FINAL_NORM.into(), c, Placement::Head);
    if !m.tie_embeddings {
        b.push(names::LM_HEAD.into(), &[v, c], Placement::Head, COL);
    }
}

fn attention(m: &ModelSpec, b: &mut Builder, at: &str, p: Placement) {
    let c = m.hidden;
    let (q, kv) = (m.q_dim(), m.kv_dim());
    let kv_split = |q_rows| TpSplit::Heads {
        q_rows,
        kv_heads: m.kv_heads,
    };
    if let Some(mla) = m.mla {
        // DeepseekV2Attention. TP as Megatron-Core's MLASelfAttention: the down projections
        // (q_a, kv_a) and their norms replicated, the up projections column-parallel by head,
        // o_proj row-parallel.
        if mla.q_lora_rank > 0 {
            let r = mla.q_lora_rank;
            b.linear(&format!("{at}.q_a_proj"), [r, c], p, REP, false);
            b.norm(format!("{at}.q_a_layernorm.weight"), r, p);
            b.linear(&format!("{at}.q_b_proj"), [q, r], p, COL, false);
        } else {
            b.linear(&names::proj(at, names::Q), [q, c], p, COL, false);
        }
        let kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim;
        b.linear(
            &format!("{at}.kv_a_proj_with_mqa"),
            [kv_a, c],
            p,
            REP,
            false,
        );
        b.norm(format!("{at}.kv_a_layernorm.weight"), mla.kv_lora_rank, p);
        let kv_b = m.heads * (mla.qk_nope_head_dim + m.v_head_dim);
        b.linear(
            &format!("{at}.kv_b_proj"),
            [kv_b, mla.kv_lora_rank],
            p,
            COL,
            false,
        );
    } else if m.family == Family::Phi3 {
        // Phi3Attention stores q, k and v fused: qkv_proj [a·d + 2·kv·d, h].
        b.linear(
            &format!("{at}.qkv_proj"),
            [q + 2 * kv, c],
            p,
            kv_split(q),
            m.qkv_bias,
        );
    } else {
        let at = |module| names::proj(at, module);
        b.linear(&at(names::Q), [q, c], p, COL, m.qkv_bias);
        b.linear(&at(names::K), [kv, c], p, kv_split(0), m.qkv_bias);
        b.linear(&at(names::V), [m.v_dim(), c], p, kv_split(0), m.qkv_bias);
    }
    b.linear(&names::proj(at, names::O), [c, m.o_dim()], p, ROW, m.o_bias);
    if m.qk_norm {
        // Qwen3Attention: RMSNorm over each head's head_dim, shared by the heads.
        b.norm(format!("{at}.q_norm.weight"), m.head_dim, p);
        b.norm(format!("{at}.k_norm.weight"), m.head_dim, p);
    }
}

fn dense_mlp(m: &ModelSpec, b: &mut Builder, mlp: &str, p: Placement) {
    let (c, f) = (m.hidden, m.intermediate);
    if m.family == Family::Phi3 {
        // Phi3MLP stores gate and up fused: gate_up_proj [2f, h].
        b.linear(
            &format!("{mlp}.gate_up_proj"),
            [2 * f, c],
            p,
            COL,
            m.mlp_bias,
        );
        b.linear(&names::proj(mlp, names::DOWN), [c, f], p, ROW, m.mlp_bias);
    } else {
        b.gated_mlp(mlp, c, f, p, m.mlp_bias);
    }
}

fn moe_mlp(m: &ModelSpec, b: &mut Builder, layer: &str, p: Placement) {
    let moe = m.moe.expect("a MoE layer has a MoE spec");
    let (c, f) = (m.hidden, moe.expert_intermediate);
    if m.family == Family::Mixtral {
        // MixtralSparseMoeBlock: a router `gate` and experts with w1 (gate), w2 (down),
        // w3 (up), no biases.
        let block = names::proj(layer, names::MOE);
        b.push(
            format!("{}.weight", names::proj(&block, names::ROUTER)),
            &[moe.num_experts, c],
            p,
            REP,
        );
        for e in 0..moe.num_experts {
            let from = b.tensors.len();
            for (w, shape, split) in [
                (names::EXPERT_GATE, [f, c], COL),
                (names::EXPERT_DOWN, [c, f], ROW),
                (names::EXPERT_UP, [f, c], COL),
            ] {
                let expert = names::expert(&block, e);
                b.push(format!("{expert}.{w}.weight"), &shape, p, split);
            }
            b.mark_expert(from, e);
        }
        return;
    }
    // Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, DeepseekV2MoE/DeepseekV3MoE: router
    // `gate`, experts with gate/up/down_proj, shared expert(s).
    let mlp = format!("{layer}.mlp");
    b.push(format!("{mlp}.gate.weight"), &[moe.num_experts, c], p, REP);
    if moe.router_bias {
        b.push(
            format!("{mlp}.gate.e_score_correction_bias"),
            &[moe.num_experts],
            p,
            REP,
        );
    }
    for e in 0..moe.num_experts {
        let from = b.tensors.len();
        b.gated_mlp(&format!("{mlp}.experts.{e}"), c, f, p, false);
        b.mark_expert(from, e);
    }
    if moe.shared_intermediate > 0 {
        let shared = if m.family == Family::Deepseek {
            "shared_experts"
        } else {
            "shared_expert"
        };
        b.gated_mlp(
            &format!("{mlp}.{shared}"),
            c,
            moe.shared_intermediate,
            p,
            false,
        );
    }
    if moe.shared_gate {
        b.push(format!("{mlp}.shared_expert_gate.weight"), &[1, c], p, REP);
    }
}

fn gpt2(m: &ModelSpec, b: &mut Builder) {
    let (c, f, v) = (m.hidden, m.intermediate, m.vocab);
    b.push(
        "transformer.wte.weight".into(),
        &[v, c],
        Placement::Embedding,
        COL,
    );
    b.push(
        "transformer.wpe.weight".into(),
        &[m.max_positions, c],
        Placement::Embedding,
        REP,
    );
    // GPT-2 uses Conv1D, whose weights are stored [in, out]: column-parallel splits dim 1.
    let (col, row) = (TpSplit::Dim(1), TpSplit::Dim(0));
    for i in 0..m.layers {
        let p = Placement::Layer(i);
        let h = format!("transformer.h.{i}");
        b.push(format!("{h}.ln_1.weight"), &[c], p, REP);
        b.push(format!("{h}.ln_1.bias"), &[c], p, REP);
        b.push(format!("{h}.attn.c_attn.weight"), &[c, 3 * c], p, col);
        b.push(
            format!("{h}.attn.c_attn.bias"),
            &[3 * c],
            p,
            TpSplit::Dim(0),
        );
        b.push(format!("{h}.attn.c_proj.weight"), &[c, c], p, row);
        b.push(format!("{h}.attn.c_proj.bias"), &[c], p, REP);
        b.push(format!("{h}.ln_2.weight"), &[c], p, REP);
        b.push(format!("{h}.ln_2.bias"), &[c], p, REP);
        b.push(format!("{h}.mlp.c_fc.weight"), &[c, f], p, col);
        b.push(format!("{h}.mlp.c_fc.bias"), &[f], p, TpSplit::Dim(0));
        b.push(format!("{h}.mlp.c_proj.weight"), &[f, c], p, row);
        b.push(format!("{h}.mlp.c_proj.bias"), &[c], p, REP);
    }
    b.push("transformer.ln_f.weight".into(), &[c], Placement::Head, REP);
    b.push("transformer.ln_f.bias".into(), &[c], Placement::Head, REP);
    // GPT2LMHeadModel always ties it (the reader sets `tie_embeddings`); a Megatron-LM GPT run
    // with `--untie-embeddings-and-output-weights` does not.
    if !m.tie_embeddings {
        b.push(names::LM_HEAD.into(), &[v, c], Placement::Head, COL);
    }
}

/// Parameter counts. `active` is, for a mixture of experts, the parameters one token's forward
/// pass uses: everything except the `num_experts - top_k` routed experts it is not routed to, in
/// every MoE layer (router, shared experts and dense layers included). For a dense model `active == total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ParamCount {
    pub total: u64,
    pub active: u64,
    /// Parameters used as matmul weights per token (for 6·N·D FLOP counts): the LM head
    /// (tied or not) included, the embedding lookup excluded, inactive experts excluded.
    pub matmul_active: u64,
}

pub fn count(m: &ModelSpec, tensors: &[Tensor]) -> ParamCount {
    let total: u64 = tensors.iter().map(Tensor::numel).sum();
    let (expert, expert_matmul): (u64, u64) = tensors
        .iter()
        .filter(|t| t.expert.is_some())
        .fold((0, 0), |(a, b), t| {
            (a + t.numel(), b + t.numel() * t.matmul as u64)
        });
    let inactive_fraction = |x: u64| match m.moe {
        Some(moe) => x / moe.num_experts * (moe.num_experts - moe.top_k),
        None => 0,
    };
    let matmul: u64 = tensors.iter().filter(|t| t.matmul).map(Tensor::numel).sum();
    let tied_head = if m.tie_embeddings {
        m.vocab * m.hidden
    } else {
        0
    };
    ParamCount {
        total,
        active: total - inactive_fraction(expert),
        matmul_active: matmul + tied_head - inactive_fraction(expert_matmul),
    }
}
