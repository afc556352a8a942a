//! GPT-NeoX and Pythia (`GPTNeoXConfig`, model type `gpt_neox`): LayerNorm with biases, a fused
//! per-head `query_key_value` with bias, rotary embeddings on the first `rotary_pct` of each
//! head, a GeLU MLP of `intermediate_size`, untied `embed_in` / `embed_out`.
//!
//! `use_parallel_residual` (true in every released GPT-NeoX and Pythia checkpoint) makes the
//! block parallel: transformers `GPTNeoXLayer.forward` computes
//! `attn = attention(input_layernorm(x))`, `mlp = mlp(post_attention_layernorm(x))` and returns
//! `mlp + attn + x`: two norms, both of the layer input, and no intermediate residual. (The two
//! norms are not one shared norm because of a bug kept for compatibility: EleutherAI/gpt-neox
//! `megatron/model/transformer.py`, `ParallelTransformerLayer`: "due to a bug, the two
//! layernorms are not tied in GPT-NeoX-20B".) With it false the block is serial, as GPT-2's.

use super::fields::Fields;
use super::{Family, MlpAct, ModelSpec};
use crate::error::Result;

pub(super) fn read(f: &Fields) -> Result<ModelSpec> {
    let hidden = f.positive("hidden_size")?;
    let heads = f.positive("num_attention_heads")?;
    if hidden % heads != 0 {
        return Err(f.err(
            "num_attention_heads",
            format!("is {heads}, which does not divide hidden_size {hidden}"),
        ));
    }
    let head_dim = hidden / heads;
    // GPTNeoXAttention: rotary_ndims = int(head_size * rotary_pct).
    let rotary_pct = f.float_or("rotary_pct", 0.25)?;
    if rotary_pct > 1.0 {
        return Err(f.err(
            "rotary_pct",
            format!("is {rotary_pct} (expected a fraction of the head, at most 1)"),
        ));
    }
    let rotary_dim = (head_dim as f64 * rotary_pct) as u64;
    // GPTNeoXConfig.attention_bias (transformers ≥ 4.38) defaults to true: the released
    // checkpoints all hold query_key_value.bias and dense.bias.
    let bias = f.boolean_or("attention_bias", true)?;
    Ok(ModelSpec {
        name: f.source.to_string(),
        model_type: "gpt_neox".into(),
        family: Family::GptNeox,
        hidden,
        intermediate: f.positive("intermediate_size")?,
        layers: f.positive("num_hidden_layers")?,
        heads,
        kv_heads: heads,
        head_dim,
        v_head_dim: head_dim,
        rotary_dim,
        vocab: f.positive("vocab_size")?,
        max_positions: f.positive_or("max_position_embeddings", 2048)?,
        tie_embeddings: f.boolean_or("tie_word_embeddings", false)?,
        qkv_bias: bias,
        o_bias: bias,
        // GPTNeoXMLP: dense_h_to_4h and dense_4h_to_h are nn.Linear with their default bias.
        mlp_bias: true,
        mlp_act: MlpAct::Gelu,
        sandwich_norm: false,
        qk_norm: false,
        parallel_block: f.boolean_or("use_parallel_residual", true)?,
        rope_theta: f.float_or("rotary_emb_base", 10_000.0)?,
        norm_eps: f.float_or("layer_norm_eps", 1e-5)?,
        moe: None,
        dense_layers: vec![],
        mla: None,
        mtp_layers: 0,
    })
}
