//! The tensor inventory: every weight tensor of a model, named as HF names it, with its shape.
//! Parameter counts are sums over this list, so they are exact by construction.

use crate::model::{Family, ModelSpec};
use serde::Serialize;

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
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub placement: Placement,
    pub tp: TpSplit,
    /// `Some(e)` for the weights of expert `e` of a mixture-of-experts MLP.
    pub expert: Option<u64>,
    /// True for weights used as a matmul operand (for FLOP counting; the embedding lookup
    /// is a gather, not a matmul, and biases and norms are elementwise).
    pub matmul: bool,
}

impl Tensor {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Elements held by one tensor-parallel rank of `tp` (ceil for dimensions that do not divide,
    /// e.g. a vocabulary; Megatron pads those).
    pub fn numel_tp(&self, tp: u64) -> u64 {
        match self.tp {
            TpSplit::Replicated => self.numel(),
            TpSplit::Dim(d) => {
                let mut n = 1;
                for (i, &s) in self.shape.iter().enumerate() {
                    n *= if i == d { s.div_ceil(tp) } else { s };
                }
                n
            }
        }
    }
}

struct Builder {
    tensors: Vec<Tensor>,
}

impl Builder {
    fn push(&mut self, name: String, shape: &[u64], placement: Placement, tp: TpSplit) {
        let matmul = shape.len() == 2
            && !name.ends_with("embed_tokens.weight")
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
}

const COL: TpSplit = TpSplit::Dim(0);
const ROW: TpSplit = TpSplit::Dim(1);
const REP: TpSplit = TpSplit::Replicated;

/// Builds the inventory in HF order and naming (`model.layers.{i}....` for the Llama family,
/// `transformer.h.{i}....` for GPT-2).
pub fn inventory(m: &ModelSpec) -> Vec<Tensor> {
    let mut b = Builder {
        tensors: Vec::new(),
    };
    match m.family {
        Family::Llama | Family::Mixtral => llama_family(m, &mut b),
        Family::Gpt2 => gpt2(m, &mut b),
    }
    b.tensors
}

fn llama_family(m: &ModelSpec, b: &mut Builder) {
    let (c, f, v) = (m.hidden, m.intermediate, m.vocab);
    let (q, kv) = (m.q_dim(), m.kv_dim());
    b.push(
        "model.embed_tokens.weight".into(),
        &[v, c],
        Placement::Embedding,
        COL,
    );
    for i in 0..m.layers {
        let p = Placement::Layer(i);
        let at = format!("model.layers.{i}.self_attn");
        b.push(format!("{at}.q_proj.weight"), &[q, c], p, COL);
        if m.qkv_bias {
            b.push(format!("{at}.q_proj.bias"), &[q], p, COL);
        }
        b.push(format!("{at}.k_proj.weight"), &[kv, c], p, COL);
        if m.qkv_bias {
            b.push(format!("{at}.k_proj.bias"), &[kv], p, COL);
        }
        b.push(format!("{at}.v_proj.weight"), &[kv, c], p, COL);
        if m.qkv_bias {
            b.push(format!("{at}.v_proj.bias"), &[kv], p, COL);
        }
        b.push(format!("{at}.o_proj.weight"), &[c, q], p, ROW);
        if m.o_bias {
            b.push(format!("{at}.o_proj.bias"), &[c], p, REP);
        }
        match m.moe {
            None => {
                let mlp = format!("model.layers.{i}.mlp");
                for (proj, shape, split) in [
                    ("gate_proj", [f, c], COL),
                    ("up_proj", [f, c], COL),
                    ("down_proj", [c, f], ROW),
                ] {
                    b.push(format!("{mlp}.{proj}.weight"), &shape, p, split);
                    if m.mlp_bias {
                        let bias_split = if split == COL { COL } else { REP };
                        b.push(format!("{mlp}.{proj}.bias"), &[shape[0]], p, bias_split);
                    }
                }
            }
            Some(moe) => {
                // MixtralSparseMoeBlock: a router `gate` and experts with w1 (gate), w3 (up),
                // w2 (down), no biases.
                let moe_name = format!("model.layers.{i}.block_sparse_moe");
                b.push(
                    format!("{moe_name}.gate.weight"),
                    &[moe.num_experts, c],
                    p,
                    REP,
                );
                for e in 0..moe.num_experts {
                    for (w, shape, split) in [
                        ("w1", [f, c], COL),
                        ("w2", [c, f], ROW),
                        ("w3", [f, c], COL),
                    ] {
                        b.push(
                            format!("{moe_name}.experts.{e}.{w}.weight"),
                            &shape,
                            p,
                            split,
                        );
                        b.tensors.last_mut().expect("just pushed").expert = Some(e);
                    }
                }
            }
        }
        b.push(
            format!("model.layers.{i}.input_layernorm.weight"),
            &[c],
            p,
            REP,
        );
        b.push(
            format!("model.layers.{i}.post_attention_layernorm.weight"),
            &[c],
            p,
            REP,
        );
    }
    b.push("model.norm.weight".into(), &[c], Placement::Head, REP);
    if !m.tie_embeddings {
        b.push("lm_head.weight".into(), &[v, c], Placement::Head, COL);
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
}

/// Parameter counts. `active` is, for a mixture of experts, the parameters one token's forward
/// pass uses: everything except the `num_experts - top_k` experts it is not routed to, in every
/// layer (the router included). For a dense model `active == total`.
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
