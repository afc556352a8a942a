//! GPT-2 (`GPT2Config`).

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
        head_dim,
        v_head_dim: head_dim,
        rotary_dim: head_dim,
        vocab: f.positive("vocab_size")?,
        max_positions: f.positive_or("n_positions", 1024)?,
        // GPT2LMHeadModel always ties lm_head to wte.
        tie_embeddings: true,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        mlp_act: MlpAct::Gelu,
        sandwich_norm: false,
        qk_norm: false,
        parallel_block: false,
        rope_theta: 0.0,
        norm_eps: f.float_or("layer_norm_epsilon", 1e-5)?,
        moe: None,
        dense_layers: vec![],
        mla: None,
        mtp_layers: 0,
    })
}
