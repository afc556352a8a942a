//! Llama-family model configuration (Llama 2/3, Qwen2 with q/k/v bias, tied or untied heads).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Errors from model construction and parameter handling.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("config field `{field}` = {value}: {fix}")]
    Config {
        field: &'static str,
        value: String,
        fix: &'static str,
    },
    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{what}: expected {expected} elements, got {got}")]
    Size {
        what: String,
        expected: usize,
        got: usize,
    },
}

/// Architecture hyper-parameters. Field names follow the brief; [`LlamaConfig::from_hf_json`]
/// maps HF `config.json` names onto them.
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
}

impl LlamaConfig {
    /// Parses an HF `config.json` (Llama, Mistral, Qwen2 model types).
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let v: Value = serde_json::from_str(text)?;
        let req = |field: &'static str| -> Result<usize, ModelError> {
            v.get(field)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or(ModelError::Config {
                    field,
                    value: v.get(field).map_or("missing".into(), |x| x.to_string()),
                    fix: "set it to a positive integer in config.json",
                })
        };
        let hidden = req("hidden_size")?;
        let heads = req("num_attention_heads")?;
        let kv_heads = v
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map_or(heads, |x| x as usize);
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .map_or(hidden / heads.max(1), |x| x as usize);
        // transformers ≥ 5 nests rope_theta under rope_parameters; older files keep it top level.
        let rope_theta = v
            .get("rope_theta")
            .or_else(|| v.get("rope_parameters").and_then(|r| r.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32;
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama");
        let qkv_bias = v
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(model_type == "qwen2");
        let cfg = LlamaConfig {
            hidden,
            intermediate: req("intermediate_size")?,
            heads,
            kv_heads,
            head_dim,
            layers: req("num_hidden_layers")?,
            vocab: req("vocab_size")?,
            rope_theta,
            rms_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6) as f32,
            tie_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias,
            max_pos: req("max_position_embeddings")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the invariants the kernels rely on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field, value: usize, fix| {
            Err(ModelError::Config {
                field,
                value: value.to_string(),
                fix,
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
        if self.head_dim > crate::kernels::cpu::attention::MAX_HEAD_DIM {
            return bad(
                "head_dim",
                self.head_dim,
                "the CPU attention kernel supports head_dim <= 512",
            );
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

    /// Query projection width H·D.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Key/value projection width KV·D.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
