//! `ModelSpec`: the architecture facts the planner needs, read from an HF `config.json`.
//!
//! Field names and defaults follow the transformers configuration classes (`LlamaConfig`,
//! `MistralConfig`, `Qwen2Config`, `MixtralConfig`, `GPT2Config`). The reader works on a
//! `serde_json::Value` so that every error can name the exact field and what was found there.

use crate::error::{PlanError, Result};
use serde::Serialize;
use serde_json::Value;

/// The block structure a config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Pre-norm RMSNorm, RoPE, GQA, SwiGLU (llama, mistral, qwen2).
    Llama,
    /// Llama block with a sparse mixture-of-experts SwiGLU MLP (mixtral).
    Mixtral,
    /// Pre-norm LayerNorm, learned positions, fused qkv, GELU MLP, biases everywhere (gpt2).
    Gpt2,
}

/// Mixture-of-experts shape (Mixtral: `num_local_experts`, `num_experts_per_tok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MoeSpec {
    pub num_experts: u64,
    pub top_k: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSpec {
    /// Where it came from: a preset name or a file path (for messages and reports).
    pub name: String,
    pub model_type: String,
    pub family: Family,
    pub hidden: u64,
    pub intermediate: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
    pub max_positions: u64,
    pub tie_embeddings: bool,
    /// Bias on the q, k, v projections (qwen2 always; llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the attention output projection (llama `attention_bias`).
    pub o_bias: bool,
    /// Bias on the MLP projections (llama `mlp_bias`).
    pub mlp_bias: bool,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub moe: Option<MoeSpec>,
}

/// Largest value the reader accepts for a size field. Far above every real model (the largest
/// presets have hidden 25600, intermediate 53248, 128 layers, 128 heads, vocab 152064 and 131072
/// positions), and low enough that no byte count of a plan overflows u64 and that planning,
/// which walks every layer, stays fast: a config is a file from outside, and a size field with a
/// few digits too many must be refused, not planned for minutes or overflowed.
pub fn size_limit(field: &str) -> u64 {
    match field {
        "hidden_size" | "n_embd" => 1 << 18,
        "intermediate_size" | "n_inner" => 1 << 20,
        "vocab_size" | "max_position_embeddings" | "n_positions" => 1 << 22,
        "num_local_experts" | "num_experts_per_tok" => 1 << 10,
        // Layers, heads, key/value heads, head_dim.
        _ => 1 << 12,
    }
}

/// Reads fields of one JSON object, producing errors that name the source and the field.
struct Fields<'a> {
    source: &'a str,
    obj: &'a serde_json::Map<String, Value>,
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b} (a boolean)"),
        Value::Number(n) => format!("{n}"),
        Value::String(s) => format!("\"{s}\" (a string)"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, problem: impl Into<String>) -> PlanError {
        PlanError::Config {
            source_name: self.source.to_string(),
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    fn present(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    /// A positive integer no larger than the field's [`size_limit`].
    fn positive(&self, field: &str) -> Result<u64> {
        match self.present(field) {
            None => Err(self.err(field, "is missing (expected a positive integer)")),
            Some(v) => self.positive_value(field, v),
        }
    }

    fn positive_value(&self, field: &str, v: &Value) -> Result<u64> {
        let max = size_limit(field);
        match v.as_u64() {
            Some(0) => Err(self.err(field, "is 0 (expected a positive integer)")),
            Some(n) if n > max => Err(self.err(
                field,
                format!("is {n}, above the planner's limit {max} (is it a typo?)"),
            )),
            Some(n) => Ok(n),
            None => Err(self.err(
                field,
                format!("is {} (expected a positive integer)", describe(v)),
            )),
        }
    }

    fn positive_or(&self, field: &str, default: u64) -> Result<u64> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => self.positive_value(field, v),
        }
    }

    fn boolean_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.present(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(
                field,
                format!("is {} (expected true or false)", describe(v)),
            )),
        }
    }

    fn float_or(&self, field: &str, default: f64) -> Result<f64> {
        match self.present(field) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.err(
                    field,
                    format!("is {} (expected a positive number)", describe(v)),
                )),
            },
        }
    }
}

/// RoPE base: top-level `rope_theta` (transformers 4.x), or `rope_parameters.rope_theta`
/// (transformers 5.x writes it there); 10000 when neither is present (LlamaConfig default).
fn rope_theta(f: &Fields) -> Result<f64> {
    if f.present("rope_theta").is_some() {
        return f.float_or("rope_theta", 10_000.0);
    }
    match f.present("rope_parameters") {
        Some(Value::Object(obj)) => {
            let inner = Fields {
                source: f.source,
                obj,
            };
            inner.float_or("rope_theta", 10_000.0)
        }
        Some(v) => Err(f.err(
            "rope_parameters",
            format!("is {} (expected an object)", describe(v)),
        )),
        None => Ok(10_000.0),
    }
}

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
            None => {
                return Err(f.err(
                    "model_type",
                    "is missing (expected llama, mistral, qwen2, mixtral or gpt2)",
                ))
            }
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                return Err(f.err(
                    "model_type",
                    format!("is {} (expected a string such as \"llama\")", describe(v)),
                ))
            }
        };
        let spec = match model_type.as_str() {
            "llama" | "mistral" | "qwen2" | "mixtral" => Self::llama_like(&f, &model_type)?,
            "gpt2" => Self::gpt2(&f)?,
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

    fn llama_like(f: &Fields, model_type: &str) -> Result<Self> {
        let hidden = f.positive("hidden_size")?;
        let heads = f.positive("num_attention_heads")?;
        let head_dim_default = if hidden % heads == 0 {
            hidden / heads
        } else if f.present("head_dim").is_none() {
            return Err(f.err(
                "num_attention_heads",
                format!(
                    "is {heads}, which does not divide hidden_size {hidden} (set head_dim or fix the head count)"
                ),
            ));
        } else {
            0
        };
        let attention_bias = f.boolean_or("attention_bias", false)?;
        let moe = if model_type == "mixtral" {
            Some(MoeSpec {
                num_experts: f.positive("num_local_experts")?,
                top_k: f.positive("num_experts_per_tok")?,
            })
        } else {
            None
        };
        Ok(ModelSpec {
            name: f.source.to_string(),
            model_type: model_type.to_string(),
            family: if moe.is_some() {
                Family::Mixtral
            } else {
                Family::Llama
            },
            hidden,
            intermediate: f.positive("intermediate_size")?,
            layers: f.positive("num_hidden_layers")?,
            heads,
            kv_heads: f.positive_or("num_key_value_heads", heads)?,
            head_dim: f.positive_or("head_dim", head_dim_default)?,
            vocab: f.positive("vocab_size")?,
            max_positions: f.positive_or("max_position_embeddings", 2048)?,
            tie_embeddings: f.boolean_or("tie_word_embeddings", false)?,
            // Qwen2 always has q/k/v biases (transformers Qwen2Attention: bias=True).
            qkv_bias: model_type == "qwen2" || attention_bias,
            o_bias: attention_bias,
            mlp_bias: f.boolean_or("mlp_bias", false)?,
            rope_theta: rope_theta(f)?,
            norm_eps: f.float_or("rms_norm_eps", 1e-6)?,
            moe,
        })
    }

    fn gpt2(f: &Fields) -> Result<Self> {
        let hidden = f.positive("n_embd")?;
        let heads = f.positive("n_head")?;
        if hidden % heads != 0 {
            return Err(f.err(
                "n_head",
                format!("is {heads}, which does not divide n_embd {hidden}"),
            ));
        }
        Ok(ModelSpec {
            name: f.source.to_string(),
            model_type: "gpt2".into(),
            family: Family::Gpt2,
            hidden,
            // GPT2Config: n_inner = None means 4 * n_embd.
            intermediate: f.positive_or("n_inner", 4 * hidden)?,
            layers: f.positive("n_layer")?,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads,
            vocab: f.positive("vocab_size")?,
            max_positions: f.positive_or("n_positions", 1024)?,
            // GPT2LMHeadModel always ties lm_head to wte.
            tie_embeddings: true,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            rope_theta: 0.0,
            norm_eps: f.float_or("layer_norm_epsilon", 1e-5)?,
            moe: None,
        })
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        let max = size_limit("head_dim");
        if self.head_dim > max {
            let (hidden, heads) = if self.family == Family::Gpt2 {
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
        let kv_field = if self.family == Family::Gpt2 {
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
                        "is {}, more than num_local_experts {}",
                        moe.top_k, moe.num_experts
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Width of the query projection output (heads × head_dim).
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of each of the key and value projection outputs (kv_heads × head_dim).
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }
}
