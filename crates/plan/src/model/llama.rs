//! The Llama-like families: one pre-norm decoder block with RoPE and GQA attention and a gated
//! MLP, in the variants HF configs describe: llama, mistral, qwen2 and qwen3 (dense), mixtral,
//! qwen2_moe and qwen3_moe (mixture of experts, `moe.rs`), gemma and gemma2, phi3.

use super::fields::Fields;
use super::{moe, Family, MlpAct, ModelSpec};
use crate::error::Result;

pub(super) fn read(f: &Fields, model_type: &str) -> Result<ModelSpec> {
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
    let head_dim = f.positive_or("head_dim", head_dim_default)?;
    let layers = f.positive("num_hidden_layers")?;
    let attention_bias = f.boolean_or("attention_bias", false)?;
    let (moe, dense_layers) = moe::read(f, model_type, layers)?;
    let gemma = matches!(model_type, "gemma" | "gemma2");
    let family = match model_type {
        "mixtral" => Family::Mixtral,
        "gemma" | "gemma2" => Family::Gemma,
        "phi3" => Family::Phi3,
        "qwen3" | "qwen3_moe" => Family::Qwen3,
        "qwen2_moe" => Family::QwenMoe,
        _ => Family::Llama,
    };
    Ok(ModelSpec {
        name: f.source.to_string(),
        model_type: model_type.to_string(),
        family,
        hidden,
        intermediate: f.positive("intermediate_size")?,
        layers,
        heads,
        kv_heads: f.positive_or("num_key_value_heads", heads)?,
        head_dim,
        v_head_dim: head_dim,
        rotary_dim: head_dim,
        vocab: f.positive("vocab_size")?,
        max_positions: f.positive_or("max_position_embeddings", 2048)?,
        // GemmaConfig and Gemma2Config default to tied embeddings (GemmaForCausalLM has no
        // separate lm_head in any released checkpoint); the others to untied.
        tie_embeddings: f.boolean_or("tie_word_embeddings", gemma)?,
        // Qwen2 and Qwen2-MoE always have q/k/v biases (transformers Qwen2Attention and
        // Qwen2MoeAttention: bias=True; Qwen1.5-MoE-A2.7B's checkpoint holds 72 of them).
        qkv_bias: matches!(model_type, "qwen2" | "qwen2_moe") || attention_bias,
        o_bias: attention_bias,
        mlp_bias: f.boolean_or("mlp_bias", false)?,
        // Gemma's MLP is gelu(gate) · up: GemmaMLP with hidden_act / hidden_activation
        // "gelu" or "gelu_pytorch_tanh" (Gemma Team 2024, arXiv 2403.08295 §2: GeGLU).
        mlp_act: if gemma { MlpAct::GeGlu } else { MlpAct::SwiGlu },
        sandwich_norm: model_type == "gemma2",
        qk_norm: family == Family::Qwen3,
        parallel_block: false,
        rope_theta: f.rope_theta()?,
        norm_eps: f.float_or("rms_norm_eps", 1e-6)?,
        moe,
        dense_layers,
        mla: None,
        mtp_layers: 0,
    })
}
