//! `ModelSpec`: the architecture facts the planner needs, read from an HF `config.json`.
//!
//! Field names and defaults follow the transformers configuration classes (`LlamaConfig`,
//! `MistralConfig`, `Qwen2Config`, `Qwen3Config`, `MixtralConfig`, `GPT2Config`, `GemmaConfig`,
//! `Gemma2Config`, `Phi3Config`, `Qwen2MoeConfig`, `Qwen3MoeConfig`, `DeepseekV2Config`,
//! `DeepseekV3Config`). The reader works on a `serde_json::Value` so that every error can name
//! the exact field and what was found there. One file per block structure: `llama.rs` (the
//! Llama-like families), `moe.rs` (their mixture-of-experts MLPs), `deepseek.rs` (MLA +
//! DeepSeekMoE), `gpt2.rs`, and the parallel blocks `neox.rs` (GPT-NeoX, Pythia) and `gptj.rs`.

mod deepseek;
mod fields;
mod gpt2;
mod gptj;
mod llama;
mod moe;
mod neox;

use crate::error::{PlanError, Result};
use fields::{describe, Fields};
use serde::Serialize;
use serde_json::Value;

/// The block structure a config describes (and so the tensor names of its inventory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Pre-norm RMSNorm, RoPE, GQA, SwiGLU (llama, mistral, qwen2).
    Llama,
    /// Llama block with a sparse mixture-of-experts SwiGLU MLP (mixtral).
    Mixtral,
    /// Pre-norm LayerNorm, learned positions, fused qkv, GELU MLP, biases everywhere (gpt2).
    Gpt2,
    /// Llama block with GeGLU, a head_dim of its own and tied embeddings (gemma); gemma2 adds
    /// sandwich norms (a norm after attention and after the MLP as well as before).
    Gemma,
    /// Llama block stored with fused `qkv_proj` and `gate_up_proj` (phi3).
    Phi3,
    /// Llama block with RMSNorm on each query and key head (qwen3, qwen3_moe).
    Qwen3,
    /// Llama block with a Qwen mixture-of-experts MLP: router, experts, optionally a shared
    /// expert behind a sigmoid gate (qwen2_moe; qwen3_moe is `Qwen3` with `moe`).
    QwenMoe,
    /// Multi-head latent attention and DeepSeekMoE (deepseek_v2, deepseek_v3).
    Deepseek,
    /// LayerNorm, fused per-head qkv, partial RoPE, GeLU MLP, biases, untied head; a parallel
    /// block with two norms of the layer input when `use_parallel_residual` (gpt_neox: GPT-NeoX,
    /// Pythia).
    GptNeox,
    /// LayerNorm, separate bias-free q/k/v/out, partial RoPE, GeLU MLP with biases, untied head
    /// with a bias; a parallel block with one shared norm (gptj).
    GptJ,
}

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpAct {
    /// silu(gate) · up (Shazeer 2020).
    SwiGlu,
    /// gelu(gate) · up (Shazeer 2020; Gemma).
    GeGlu,
    /// gelu(fc) (GPT-2).
    Gelu,
}

/// Mixture-of-experts shape.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MoeSpec {
    /// Routed experts per MoE layer (`num_local_experts`, `num_experts`, `n_routed_experts`).
    pub num_experts: u64,
    pub top_k: u64,
    /// Width of one routed expert (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub expert_intermediate: u64,
    /// Width of the always-active shared expert(s), 0 for none (Qwen2-MoE
    /// `shared_expert_intermediate_size`; DeepSeek `n_shared_experts × moe_intermediate_size`).
    pub shared_intermediate: u64,
    /// Qwen2-MoE's sigmoid gate on the shared expert's output (`shared_expert_gate [1, h]`).
    pub shared_gate: bool,
    /// DeepSeek-V3's `e_score_correction_bias [E]` on the router (auxiliary-loss-free balancing).
    pub router_bias: bool,
    /// The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen-MoE's
    /// `norm_topk_prob`).
    pub norm_topk: bool,
    /// Weight of the load-balancing loss in the training loss (`router_aux_loss_coef`; Fedus
    /// et al. 2021, Switch Transformer eqs. 4–6).
    pub aux_loss_coef: f64,
    /// Group-limited routing (`n_group`, `topk_group`): the experts form `n_group` groups and
    /// a token's experts come from at most `topk_group` of them. DeepSeek-V3 trains it as
    /// node-limited routing, one group per node: each token reaches at most 4 nodes
    /// (arXiv 2412.19437 §2.1.2, §3.2.2). `None`: ungrouped.
    pub routing_groups: Option<(u64, u64)>,
}

/// Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1): queries and keys/values
/// pass through low-rank latents; each head has a `qk_nope + qk_rope` query/key dimension and a
/// `v_head_dim` value dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MlaSpec {
    /// 0: queries are projected directly (`q_lora_rank: null`, DeepSeek-V2-Lite).
    pub q_lora_rank: u64,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    /// Where it came from: a preset name or a file path (for messages and reports).
    pub name: String,
    pub model_type: String,
    pub family: Family,
    pub hidden: u64,
    /// Width of a dense MLP (every layer of a dense model; the dense layers of a MoE model).
    pub intermediate: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    /// Query/key dimension of one head (MLA: qk_nope + qk_rope).
    pub head_dim: u64,
    /// Value dimension of one head (`head_dim` except for MLA's `v_head_dim`).
    pub v_head_dim: u64,
    /// Dimensions of a head RoPE rotates (MLA: `qk_rope_head_dim`; else `head_dim`).
    pub rotary_dim: u64,
    pub vocab: u64,
    pub max_positions: u64,
    pub tie_embeddings: bool,
    /// Bias on the q, k, v projections (qwen2 always; llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the attention output projection (llama `attention_bias`).
    pub o_bias: bool,
    /// Bias on the MLP projections (llama `mlp_bias`).
    pub mlp_bias: bool,
    pub mlp_act: MlpAct,
    /// Gemma-2: `post_attention_layernorm` after attention and `post_feedforward_layernorm`
    /// after the MLP, besides the pre-norms (Gemma Team 2024, arXiv 2408.00118 §2).
    pub sandwich_norm: bool,
    /// Qwen3: RMSNorm over each query and key head before RoPE (`q_norm`, `k_norm [head_dim]`).
    pub qk_norm: bool,
    /// Attention and MLP read the same normed input and add to the residual together
    /// (GPT-J; PaLM, Chowdhery et al. 2022 §2): one norm per layer, no `resid_mid`.
    pub parallel_block: bool,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub moe: Option<MoeSpec>,
    /// Of a MoE model, the layers whose MLP is dense (DeepSeek `first_k_dense_replace`,
    /// `moe_layer_freq`; Qwen `mlp_only_layers`, `decoder_sparse_step`), ascending.
    pub dense_layers: Vec<u64>,
    pub mla: Option<MlaSpec>,
    /// Multi-token-prediction modules the config declares (DeepSeek-V3
    /// `num_nextn_predict_layers`). Not in the inventory: see `deepseek.rs`.
    pub mtp_layers: u64,
}

/// Largest value the reader accepts for a size field. Far above every real model (the largest
/// presets have hidden 25600, intermediate 53248, 128 layers, 128 heads, 256 experts, vocab
/// 256000 and 131072 positions), and low enough that no byte count of a plan overflows u64 and
/// that planning, which walks every layer, stays fast: a config is a file from outside, and a
/// size field with a few digits too many must be refused, not planned for minutes or overflowed.
pub fn size_limit(field: &str) -> u64 {
    match field {
        "hidden_size" | "n_embd" | "q_lora_rank" | "kv_lora_rank" => 1 << 18,
        "intermediate_size"
        | "n_inner"
        | "moe_intermediate_size"
        | "shared_expert_intermediate_size" => 1 << 20,
        "vocab_size" | "max_position_embeddings" | "n_positions" => 1 << 22,
        "num_local_experts"
        | "num_experts_per_tok"
        | "num_experts"
        | "n_routed_experts"
        | "n_shared_experts" => 1 << 10,
        // Layers, heads, key/value heads, head dims, layer frequencies.
        _ => 1 << 12,
    }
}

/// The model types the reader knows, for messages.
pub const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, gemma, gemma2, phi3, deepseek_v2, deepseek_v3, gpt2, gpt_neox or gptj";

impl ModelSpec {
    /// Parses the text of an HF `config.json`. `source` names it in error messages.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| PlanError::Config {
            source_name: source.to_string(),
            field: "(file)".into(),
            problem: format!("is not valid JSON: {e}"),
        })?;
        Self::from_json_value(&value, source)
    }

    pub fn from_json_value(value: &Value, source: &str) -> Result<Self> {
        let obj = value.as_object().ok_or_else(|| PlanError::Config {
            source_name: source.to_string(),
            field: "(file)".into(),
            problem: "is not a JSON object (expected an HF config.json)".into(),
        })?;
        let f = Fields { source, obj };
        let model_type = match f.present("model_type") {
            None => return Err(f.err("model_type", format!("is missing (expected {SUPPORTED})"))),
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                return Err(f.err(
                    "model_type",
                    format!("is {} (expected a string such as \"llama\")", describe(v)),
                ))
            }
        };
        let spec = match model_type.as_str() {
            "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen2_moe" | "qwen3_moe"
            | "gemma" | "gemma2" | "phi3" => llama::read(&f, &model_type)?,
            "deepseek_v2" | "deepseek_v3" => deepseek::read(&f, &model_type)?,
            "gpt2" => gpt2::read(&f)?,
            "gpt_neox" => neox::read(&f)?,
            "gptj" => gptj::read(&f)?,
            other => {
                return Err(PlanError::UnsupportedModel {
                    source_name: source.to_string(),
                    value: other.to_string(),
                })
            }
        };
        spec.validate(&f)?;
        Ok(spec)
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        let max = size_limit("head_dim");
        if self.head_dim > max {
            let (hidden, heads) = if self.gpt2_names() {
                ("n_embd", "n_head")
            } else {
                ("hidden_size", "num_attention_heads")
            };
            return Err(f.err(
                heads,
                format!(
                    "is {}, which makes head_dim = {hidden} / {heads} = {}, above the planner's limit {max} (set head_dim or fix the head count)",
                    self.heads, self.head_dim
                ),
            ));
        }
        let kv_field = if self.gpt2_names() {
            "n_head"
        } else {
            "num_key_value_heads"
        };
        if self.kv_heads > self.heads || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(f.err(
                kv_field,
                format!(
                    "is {}, which does not divide the {} attention heads (GQA needs heads % kv_heads == 0)",
                    self.kv_heads, self.heads
                ),
            ));
        }
        if let Some(moe) = self.moe {
            if moe.top_k > moe.num_experts {
                return Err(f.err(
                    "num_experts_per_tok",
                    format!(
                        "is {}, more than the {} routed experts",
                        moe.top_k, moe.num_experts
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether the config names its sizes as GPT2Config does (`n_embd`, `n_head`).
    fn gpt2_names(&self) -> bool {
        matches!(self.family, Family::Gpt2 | Family::GptJ)
    }

    /// The GPT-style blocks: LayerNorm with biases and a plain GeLU MLP of biased linears
    /// (GPT-2, GPT-NeoX, GPT-J), as opposed to the Llama-like RMSNorm and gated MLP.
    pub fn gpt_block(&self) -> bool {
        matches!(self.family, Family::Gpt2 | Family::GptNeox | Family::GptJ)
    }

    /// Whether weights are stored [in, out] (GPT-2's Conv1D) rather than nn.Linear's [out, in].
    pub fn conv1d(&self) -> bool {
        self.family == Family::Gpt2
    }

    /// Whether RoPE rotates q and k (GPT-2 has learned positions instead).
    pub fn rope(&self) -> bool {
        self.family != Family::Gpt2 && self.rotary_dim > 0
    }

    /// Norms a layer applies before its attention and MLP (sandwich post-norms aside): two in
    /// a serial block; in a parallel block one when attention and MLP share it (GPT-J,
    /// PaLM), two when each has its own norm of the same input (GPT-NeoX: `input_layernorm`
    /// and `post_attention_layernorm`, both of the layer input).
    pub fn pre_norms(&self) -> u64 {
        if self.parallel_block && self.family != Family::GptNeox {
            1
        } else {
            2
        }
    }

    /// Width of the query projection output (heads × head_dim).
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of the key projection output (kv_heads × head_dim).
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Width of the value projection output and of the attention output (before o_proj) per
    /// key/value head group: kv_heads × v_head_dim.
    pub fn v_dim(&self) -> u64 {
        self.kv_heads * self.v_head_dim
    }

    /// Width of the attention output, the input of o_proj (heads × v_head_dim).
    pub fn o_dim(&self) -> u64 {
        self.heads * self.v_head_dim
    }

    /// Key/value heads one tensor-parallel rank of `tp` holds: kv_heads / tp, or one whole
    /// head when tp > kv_heads (each head then replicated tp / kv_heads times, as vLLM's
    /// `QKVParallelLinear` does: `num_kv_head_replicas = tp_size / total_num_kv_heads`).
    pub fn kv_heads_tp(&self, tp: u64) -> u64 {
        self.kv_heads.div_ceil(tp)
    }

    /// Whether layer `i` has a mixture-of-experts MLP.
    pub fn is_moe_layer(&self, i: u64) -> bool {
        self.moe.is_some() && self.dense_layers.binary_search(&i).is_err()
    }

    /// Width per head the attention-score FLOPs see: QKᵀ runs over head_dim, AV over
    /// v_head_dim, so heads × (head_dim + v_head_dim) / 2 counts both products as the usual
    /// 2·(a·d) per key.
    pub fn score_width(&self) -> f64 {
        (self.heads * (self.head_dim + self.v_head_dim)) as f64 / 2.0
    }
}
