//! Mixture-of-experts MLPs of the Llama-like families: their shape and which layers have one.

use super::fields::Fields;
use super::MoeSpec;
use crate::error::Result;

/// The MoE shape of a mixtral, qwen2_moe or qwen3_moe config, and its dense layers; `None` for
/// the dense model types.
pub(super) fn read(
    f: &Fields,
    model_type: &str,
    layers: u64,
) -> Result<(Option<MoeSpec>, Vec<u64>)> {
    match model_type {
        // MixtralSparseMoeBlock: every layer, experts as wide as intermediate_size, no shared
        // expert.
        "mixtral" => {
            let width = f.positive("intermediate_size")?;
            let moe = MoeSpec {
                num_experts: f.positive("num_local_experts")?,
                top_k: f.positive("num_experts_per_tok")?,
                expert_intermediate: width,
                shared_intermediate: 0,
                shared_gate: false,
                router_bias: false,
                norm_topk: true,
                // MixtralConfig's default.
                routing_groups: None,
                aux_loss_coef: f.coefficient_or("router_aux_loss_coef", 0.001)?,
            };
            Ok((Some(moe), vec![]))
        }
        // Qwen2MoeSparseMoeBlock (modeling_qwen2_moe.py): routed experts of
        // moe_intermediate_size plus one shared expert of shared_expert_intermediate_size
        // whose output is scaled by sigmoid(shared_expert_gate(x)). Qwen3MoeSparseMoeBlock has
        // no shared expert. Both: layer i is sparse iff i is not in mlp_only_layers and
        // (i + 1) % decoder_sparse_step == 0; other layers have a dense MLP of intermediate_size.
        "qwen2_moe" | "qwen3_moe" => {
            let shared = if model_type == "qwen2_moe" {
                f.positive("shared_expert_intermediate_size")?
            } else {
                0
            };
            let moe = MoeSpec {
                num_experts: f.positive("num_experts")?,
                top_k: f.positive("num_experts_per_tok")?,
                expert_intermediate: f.positive("moe_intermediate_size")?,
                shared_intermediate: shared,
                shared_gate: shared > 0,
                router_bias: false,
                norm_topk: f.boolean_or("norm_topk_prob", false)?,
                routing_groups: None,
                aux_loss_coef: f.coefficient_or("router_aux_loss_coef", 0.001)?,
            };
            let step = f.positive_or("decoder_sparse_step", 1)?;
            let only_mlp = f.layer_list("mlp_only_layers", layers)?;
            let dense = (0..layers)
                .filter(|i| only_mlp.contains(i) || (i + 1) % step != 0)
                .collect();
            Ok((Some(moe), dense))
        }
        _ => Ok((None, vec![])),
    }
}
