//! DeepSeek-V2 and V3 (`DeepseekV2Config`, `DeepseekV3Config`): multi-head latent attention
//! (DeepSeek-AI 2024, arXiv 2405.04434 §2.1) and DeepSeekMoE (ibid. §2.2: shared experts plus
//! fine-grained routed experts; the first `first_k_dense_replace` layers keep a dense MLP).
//!
//! DeepSeek-V3's multi-token-prediction module (arXiv 2412.19437 §2.2; `num_nextn_predict_layers`
//! = 1, stored as `model.layers.61.*`, 14B of the 685B in the checkpoint) is not in the
//! inventory: the architecture the config names, `DeepseekV3ForCausalLM`, has no such module
//! and transformers drops those weights on load, and the paper's 671B counts the main model
//! only. A run that trains MTP holds one more MoE layer, its `eh_proj [h, 2h]` and three norms
//! on the last pipeline stage (the embedding and output head are shared with the main model).

use super::fields::Fields;
use super::{Family, MlaSpec, MlpAct, ModelSpec, MoeSpec};
use crate::error::Result;

pub(super) fn read(f: &Fields, model_type: &str) -> Result<ModelSpec> {
    let hidden = f.positive("hidden_size")?;
    let heads = f.positive("num_attention_heads")?;
    let layers = f.positive("num_hidden_layers")?;
    let mla = MlaSpec {
        q_lora_rank: f.count_or("q_lora_rank", 0)?,
        kv_lora_rank: f.positive("kv_lora_rank")?,
        qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
        qk_rope_head_dim: f.positive("qk_rope_head_dim")?,
    };
    let v_head_dim = f.positive("v_head_dim")?;
    let expert_width = f.positive("moe_intermediate_size")?;
    let moe = MoeSpec {
        num_experts: f.positive("n_routed_experts")?,
        top_k: f.positive("num_experts_per_tok")?,
        expert_intermediate: expert_width,
        // DeepseekV2MoE: one `shared_experts` MLP of width moe_intermediate_size × n_shared.
        shared_intermediate: f.count_or("n_shared_experts", 0)? * expert_width,
        shared_gate: false,
        // V3's router (DeepseekV3TopkRouter) carries the `e_score_correction_bias` of its
        // auxiliary-loss-free balancing (arXiv 2412.19437 §2.1.2); V2's has only its weight.
        router_bias: model_type == "deepseek_v3"
            || f.string_or("topk_method", "greedy")? == "noaux_tc",
        norm_topk: f.boolean_or("norm_topk_prob", false)?,
        aux_loss_coef: f.coefficient_or("aux_loss_alpha", 0.001)?,
        routing_groups: match (f.count_or("n_group", 1)?, f.count_or("topk_group", 1)?) {
            (g, k) if g > 1 && k < g => Some((g, k)),
            _ => None,
        },
    };
    // Layer i has routed experts iff i >= first_k_dense_replace and i % moe_layer_freq == 0
    // (modeling_deepseek.py DeepseekV2DecoderLayer).
    let first_dense = f.count_or("first_k_dense_replace", 0)?;
    let freq = f.positive_or("moe_layer_freq", 1)?;
    let dense_layers = (0..layers)
        .filter(|&i| i < first_dense || i % freq != 0)
        .collect();
    let head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
    Ok(ModelSpec {
        name: f.source.to_string(),
        model_type: model_type.to_string(),
        family: Family::Deepseek,
        hidden,
        intermediate: f.positive("intermediate_size")?,
        layers,
        heads,
        // After the latent is expanded every head has its own key and value: MHA.
        kv_heads: heads,
        head_dim,
        v_head_dim,
        rotary_dim: mla.qk_rope_head_dim,
        vocab: f.positive("vocab_size")?,
        max_positions: f.positive_or("max_position_embeddings", 2048)?,
        tie_embeddings: f.boolean_or("tie_word_embeddings", false)?,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        mlp_act: MlpAct::SwiGlu,
        sandwich_norm: false,
        qk_norm: false,
        parallel_block: false,
        rope_theta: f.rope_theta()?,
        norm_eps: f.float_or("rms_norm_eps", 1e-6)?,
        moe: Some(moe),
        dense_layers,
        mla: Some(mla),
        mtp_layers: f.count_or("num_nextn_predict_layers", 0)?,
    })
}
