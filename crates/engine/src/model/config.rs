//! Llama-family model configuration (Llama 2/3, Qwen2 with q/k/v bias, tied or untied heads).

use crate::kernels::Limits;
use ferrotron_plan::model::{Family, MlpAct, ModelSpec, MoeSpec};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// Errors from model construction and parameter handling.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("config field `{field}` = {value}: {fix}")]
    Config {
        field: &'static str,
        value: String,
        /// Static for the model's own invariants; a backend's limit names the backend.
        fix: Cow<'static, str>,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("{what}: expected {expected} elements, got {got}")]
    Size {
        what: String,
        expected: usize,
        got: usize,
    },
}

/// Architecture hyper-parameters, made from the planner's `ModelSpec` by
/// [`LlamaConfig::from_spec`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Model width C (`hidden_size`).
    pub hidden: usize,
    /// MLP width F (`intermediate_size`).
    pub intermediate: usize,
    /// Query heads H (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads KV (`num_key_value_heads`).
    pub kv_heads: usize,
    /// Per-head dim D; `hidden / heads` unless the config says otherwise (`head_dim`).
    pub head_dim: usize,
    pub layers: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub tie_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2); o_proj never does.
    pub qkv_bias: bool,
    /// Longest sequence the RoPE table covers (`max_position_embeddings`).
    pub max_pos: usize,
    /// A Mixtral sparse MLP in every layer; `intermediate` is then one expert's width.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
}

/// Mixtral's mixture of experts (HF `MixtralSparseMoeBlock`): a router picks `top_k` of
/// `experts` SwiGLU experts per token.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// The chosen probabilities are renormalised to sum to 1.
    pub norm_topk: bool,
    /// Weight of the load-balancing loss (`router_aux_loss_coef`).
    pub aux_loss_coef: f32,
}

impl LlamaConfig {
    /// The engine's config for a planner `ModelSpec` (the project's one HF config.json reader).
    pub fn from_spec(spec: &ModelSpec) -> Result<Self, ModelError> {
        let moe = match (spec.family, spec.moe) {
            (Family::Llama, _) => None,
            (Family::Mixtral, Some(m)) => Some(MoeConfig {
                experts: m.num_experts as usize,
                top_k: m.top_k as usize,
                norm_topk: m.norm_topk,
                aux_loss_coef: m.aux_loss_coef as f32,
            }),
            _ => {
                return Err(ModelError::Unsupported(format!(
                    "model = {}: ferrotron train supports Llama-family models (llama, mistral, qwen2) and mixtral; this is {}",
                    spec.name, spec.model_type
                )))
            }
        };
        if spec.o_bias || spec.mlp_bias {
            return Err(ModelError::Unsupported(format!(
                "model = {}: attention_bias/mlp_bias on o_proj or the MLP are not supported by the engine (q/k/v biases are)",
                spec.name
            )));
        }
        let cfg = LlamaConfig {
            hidden: spec.hidden as usize,
            intermediate: spec.intermediate as usize,
            heads: spec.heads as usize,
            kv_heads: spec.kv_heads as usize,
            head_dim: spec.head_dim as usize,
            layers: spec.layers as usize,
            vocab: spec.vocab as usize,
            rope_theta: spec.rope_theta as f32,
            rms_eps: spec.norm_eps as f32,
            tie_embeddings: spec.tie_embeddings,
            qkv_bias: spec.qkv_bias,
            max_pos: spec.max_positions as usize,
            moe,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The planner's description of this model, whose tensor inventory is the engine's
    /// parameter table (the inverse of [`Self::from_spec`] for the fields the engine reads).
    pub fn spec(&self) -> ModelSpec {
        let u = |x: usize| x as u64;
        let moe = self.moe.map(|m| MoeSpec {
            num_experts: u(m.experts),
            top_k: u(m.top_k),
            expert_intermediate: u(self.intermediate),
            shared_intermediate: 0,
            shared_gate: false,
            router_bias: false,
            norm_topk: m.norm_topk,
            aux_loss_coef: m.aux_loss_coef as f64,
            routing_groups: None,
        });
        ModelSpec {
            name: "engine".into(),
            model_type: if moe.is_some() { "mixtral" } else { "llama" }.into(),
            family: if moe.is_some() {
                Family::Mixtral
            } else {
                Family::Llama
            },
            hidden: u(self.hidden),
            intermediate: u(self.intermediate),
            layers: u(self.layers),
            heads: u(self.heads),
            kv_heads: u(self.kv_heads),
            head_dim: u(self.head_dim),
            v_head_dim: u(self.head_dim),
            rotary_dim: u(self.head_dim),
            vocab: u(self.vocab),
            max_positions: u(self.max_pos),
            tie_embeddings: self.tie_embeddings,
            qkv_bias: self.qkv_bias,
            o_bias: false,
            mlp_bias: false,
            mlp_act: MlpAct::SwiGlu,
            sandwich_norm: false,
            qk_norm: false,
            parallel_block: false,
            rope_theta: self.rope_theta as f64,
            norm_eps: self.rms_eps as f64,
            moe,
            dense_layers: Vec::new(),
            mla: None,
            mtp_layers: 0,
        }
    }

    /// Checks the invariants every backend's kernels rely on; what a particular backend
    /// supports is [`Self::check_backend`]'s.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field, value: usize, fix: &'static str| {
            Err(ModelError::Config {
                field,
                value: value.to_string(),
                fix: fix.into(),
            })
        };
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(
                "num_key_value_heads",
                self.kv_heads,
                "must divide num_attention_heads",
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                self.head_dim,
                "RoPE needs an even, non-zero head_dim",
            );
        }
        if let Some(m) = self.moe {
            if m.top_k == 0 || m.top_k > m.experts {
                return bad(
                    "num_experts_per_tok",
                    m.top_k,
                    "must be between 1 and num_local_experts",
                );
            }
        }
        for (field, v) in [
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
            ("num_hidden_layers", self.layers),
            ("vocab_size", self.vocab),
            ("max_position_embeddings", self.max_pos),
        ] {
            if v == 0 {
                return bad(field, v, "must be positive");
            }
        }
        Ok(())
    }

    /// Checks the model against the limits of the backend chosen to run it (`Kernels::limits`).
    pub fn check_backend(&self, limits: Limits) -> Result<(), ModelError> {
        if self.head_dim > limits.max_head_dim {
            return Err(ModelError::Config {
                field: "head_dim",
                value: self.head_dim.to_string(),
                fix: format!(
                    "the {} attention kernel supports head_dim <= {}",
                    limits.backend, limits.max_head_dim
                )
                .into(),
            });
        }
        if let (Some(m), false) = (self.moe, limits.experts) {
            return Err(ModelError::Config {
                field: "moe.experts",
                value: m.experts.to_string(),
                fix: format!(
                    "the {} backend has no mixture-of-experts kernels yet; train this model on the CPU",
                    limits.backend
                )
                .into(),
            });
        }
        Ok(())
    }

    /// Query projection width H·D.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Key/value projection width KV·D.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
