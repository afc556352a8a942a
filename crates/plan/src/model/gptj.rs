//! GPT-J (`GPTJConfig`, model type `gptj`; Wang & Komatsuzaki 2021, mesh-transformer-jax): a
//! parallel block with one shared norm. transformers `GPTJBlock.forward`:
//! `h = ln_1(x); x = attn(h) + mlp(h) + x`, so attention and the MLP read the same normed
//! input (there is no `ln_2`). q, k, v and `out_proj` have no bias; `fc_in` and `fc_out` do;
//! RoPE rotates the first `rotary_dim` dimensions of each head; the untied `lm_head` has a bias.

use super::fields::Fields;
use super::{Family, MlpAct, ModelSpec};
use crate::error::Result;

pub(super) fn read(f: &Fields) -> Result<ModelSpec> {
    let hidden = f.positive("n_embd")?;
    let heads = f.positive("n_head")?;
    if hidden % heads != 0 {
        return Err(f.err(
            "n_head",
            format!("is {heads}, which does not divide n_embd {hidden}"),
        ));
    }
    let head_dim = hidden / heads;
    // GPTJAttention: rotary_dim None means the whole head.
    let rotary_dim = f.positive_or("rotary_dim", head_dim)?;
    if rotary_dim > head_dim {
        return Err(f.err(
            "rotary_dim",
            format!("is {rotary_dim}, more than the head dimension {head_dim}"),
        ));
    }
    Ok(ModelSpec {
        name: f.source.to_string(),
        model_type: "gptj".into(),
        family: Family::GptJ,
        hidden,
        // GPTJConfig: n_inner = None means 4 * n_embd.
        intermediate: f.positive_or("n_inner", 4 * hidden)?,
        layers: f.positive("n_layer")?,
        heads,
        kv_heads: heads,
        head_dim,
        v_head_dim: head_dim,
        rotary_dim,
        vocab: f.positive("vocab_size")?,
        max_positions: f.positive_or("n_positions", 2048)?,
        tie_embeddings: f.boolean_or("tie_word_embeddings", false)?,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: true,
        mlp_act: MlpAct::Gelu,
        sandwich_norm: false,
        qk_norm: false,
        parallel_block: true,
        rope_theta: 10_000.0,
        norm_eps: f.float_or("layer_norm_epsilon", 1e-5)?,
        moe: None,
        dense_layers: vec![],
        mla: None,
        mtp_layers: 0,
    })
}
