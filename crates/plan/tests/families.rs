//! Gemma, Gemma-2, Phi-3, Qwen3, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3: exact parameter counts
//! against published figures, and plans whose activations follow each block's tensors.

mod common;
use common::input;
use ferrotron_plan::inventory::{count, inventory, ParamCount};
use ferrotron_plan::presets::preset;
use ferrotron_plan::*;

fn params(name: &str) -> ParamCount {
    let m = preset(name).unwrap();
    count(&m, &inventory(&m))
}

/// Parameters outside the embedding matrix and LM head (what model papers call non-embedding).
fn non_embedding(name: &str) -> u64 {
    let m = preset(name).unwrap();
    inventory(&m)
        .iter()
        .filter(|t| !t.name.ends_with("embed_tokens.weight") && t.name != "lm_head.weight")
        .map(|t| t.numel())
        .sum()
}

#[test]
fn bf16_checkpoints_match_their_safetensors_index() {
    // metadata.total_size / 2 of each model.safetensors.index.json (bf16 weights):
    // microsoft/Phi-3-mini-4k-instruct 7,642,159,104 B; Qwen/Qwen1.5-MoE-A2.7B
    // 28,631,568,384 B (24 layers × 3 q/k/v biases that config.json does not mention);
    // Qwen/Qwen3-30B-A3B 61,064,245,248 B; deepseek-ai/DeepSeek-V2-Lite 31,412,968,448 B.
    for (name, total_size) in [
        ("phi-3-mini-4k", 7_642_159_104u64),
        ("qwen1.5-moe-a2.7b", 28_631_568_384),
        ("qwen3-30b-a3b", 61_064_245_248),
        ("deepseek-v2-lite", 31_412_968_448),
    ] {
        assert_eq!(params(name).total, total_size / 2, "{name}");
    }
}

#[test]
fn gemma_non_embedding_parameters_match_the_papers() {
    // Gemma Team 2024 (arXiv 2403.08295) Table 2: Gemma 2B has 1,981,884,416 non-embedding
    // parameters; Gemma 2 (arXiv 2408.00118) Table 1: 9B has 8,324,201,984. (The papers'
    // embedding counts use a 256,128-row padded vocabulary; the checkpoints' config.json says
    // 256,000, so the embedding here is 256,000 × h.)
    assert_eq!(non_embedding("gemma-2b"), 1_981_884_416);
    assert_eq!(non_embedding("gemma-2-9b"), 8_324_201_984);
    // Tied: one [v, h] matrix. gemma-2b: 2,506,172,416 (HF: "2.51B params").
    assert_eq!(params("gemma-2b").total, 1_981_884_416 + 256_000 * 2048);
    assert_eq!(params("gemma-2b").total, 2_506_172_416);
    assert_eq!(params("gemma-2-9b").total, 9_241_705_984);
    // Gemma-2's four norms per layer (sandwich), Gemma's two.
    let m = preset("gemma-2-9b").unwrap();
    let norms = inventory(&m)
        .iter()
        .filter(|t| t.name.starts_with("model.layers.0.") && t.name.ends_with("layernorm.weight"))
        .count();
    assert_eq!(norms, 4);
}

#[test]
fn qwen3_dense_counts_q_and_k_norms() {
    // Qwen/Qwen3-8B model card: 8.2B parameters, 6.95B non-embedding.
    let p = params("qwen3-8b");
    assert_eq!(p.total, 8_190_735_360);
    assert_eq!(non_embedding("qwen3-8b"), 6_946_075_648);
    assert_eq!((non_embedding("qwen3-8b") as f64 / 1e7).round(), 695.0);
    let m = preset("qwen3-8b").unwrap();
    assert!(inventory(&m)
        .iter()
        .any(|t| t.name == "model.layers.35.self_attn.k_norm.weight" && t.shape == [128]));
}

#[test]
fn moe_active_parameters() {
    // Qwen1.5-MoE-A2.7B: "2.7B activated"; Qwen3-30B-A3B model card: 30.5B total, 3.3B
    // activated; DeepSeek-V2-Lite model card: 15.7B total, 2.4B activated (counted without the
    // 0.21B input embedding).
    let q15 = params("qwen1.5-moe-a2.7b");
    assert_eq!(q15.active, 14_315_784_192 - 24 * 56 * 3 * 1408 * 2048);
    assert_eq!((q15.active as f64 / 1e8).round(), 27.0);
    let q3 = params("qwen3-30b-a3b");
    assert_eq!(q3.active, 30_532_122_624 - 48 * 120 * 3 * 768 * 2048);
    assert_eq!((q3.active as f64 / 1e8).round(), 34.0); // 3.35B: the card's "3.3B"
    let ds = params("deepseek-v2-lite");
    assert_eq!(ds.active, 15_706_484_224 - 26 * 58 * 3 * 1408 * 2048);
    assert_eq!(((ds.active - 102_400 * 2048) as f64 / 1e8).round(), 25.0); // 2.45B
}

#[test]
fn deepseek_v3_is_671b_without_its_mtp_module() {
    // DeepSeek-V3 technical report (arXiv 2412.19437) and model card: 671B total, 37B
    // activated per token; the HF checkpoint's 685B adds the 14B multi-token-prediction
    // module (model.layers.61), which DeepseekV3ForCausalLM does not build.
    let m = preset("deepseek-v3").unwrap();
    assert_eq!(m.mtp_layers, 1);
    let p = params("deepseek-v3");
    assert_eq!(p.total, 671_026_419_200);
    assert_eq!((p.total as f64 / 1e9).round(), 671.0);
    assert_eq!((p.active as f64 / 1e9).round(), 38.0); // 37.55B: the report's "37B"
                                                       // The MTP module (README_WEIGHTS.md of the HF repository: "11.5B unique parameters",
                                                       // embedding and head shared): one more MoE layer (11.507B), eh_proj [h, 2h], enorm, hnorm
                                                       // and its final norm. The checkpoint stores the shared embedding and head again, so it
                                                       // holds 684.5B, which the model card rounds to "685B".
    let (h, v) = (7168u64, 129_280u64);
    let moe_layer: u64 = inventory(&m)
        .iter()
        .filter(|t| t.name.starts_with("model.layers.60."))
        .map(|t| t.numel())
        .sum();
    assert_eq!((moe_layer as f64 / 1e8).round(), 115.0);
    let stored = p.total + moe_layer + h * 2 * h + 3 * h + 2 * v * h;
    assert_eq!(stored, 684_489_845_504);
    // Layers 0..2 are dense (first_k_dense_replace 3), 3..60 MoE with a router bias.
    assert!(!m.is_moe_layer(2) && m.is_moe_layer(3));
    let names: Vec<String> = inventory(&m).into_iter().map(|t| t.name).collect();
    assert!(names.contains(&"model.layers.2.mlp.down_proj.weight".to_string()));
    assert!(names.contains(&"model.layers.3.mlp.gate.e_score_correction_bias".to_string()));
    assert!(names.contains(&"model.layers.3.self_attn.q_a_layernorm.weight".to_string()));
    assert!(names.contains(&"model.layers.3.mlp.shared_experts.up_proj.weight".to_string()));
}

#[test]
fn qwen2_moe_mlp_only_layers_and_sparse_step() {
    let mut v: serde_json::Value =
        serde_json::from_str(presets::preset_json("qwen1.5-moe-a2.7b").unwrap()).unwrap();
    v["mlp_only_layers"] = serde_json::json!([0, 5]);
    v["decoder_sparse_step"] = serde_json::json!(2);
    let m = ModelSpec::from_json_value(&v, "c").unwrap();
    // Sparse iff not listed and (i + 1) % 2 == 0: layers 1, 3, 7, 9, ...
    assert!(!m.is_moe_layer(0) && m.is_moe_layer(1) && !m.is_moe_layer(2));
    assert!(!m.is_moe_layer(5) && m.is_moe_layer(7));
    let inv = inventory(&m);
    let dense = inv
        .iter()
        .find(|t| t.name == "model.layers.0.mlp.gate_proj.weight")
        .unwrap();
    assert_eq!(dense.shape, [5632, 2048]);
    v["mlp_only_layers"] = serde_json::json!([99]);
    assert_eq!(
        ModelSpec::from_json_value(&v, "c").unwrap_err().to_string(),
        "c: field `mlp_only_layers` holds 99 (expected layer indices 0..23)"
    );
}

#[test]
fn new_family_configs_name_missing_fields() {
    let err = |model_type: &str| {
        ModelSpec::from_json_value(
            &serde_json::json!({"model_type": model_type, "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                "vocab_size": 100}),
            "c.json",
        )
        .unwrap_err()
        .to_string()
    };
    assert_eq!(
        err("qwen2_moe"),
        "c.json: field `shared_expert_intermediate_size` is missing (expected a positive integer)"
    );
    assert_eq!(
        err("qwen3_moe"),
        "c.json: field `num_experts` is missing (expected a positive integer)"
    );
    assert_eq!(
        err("deepseek_v3"),
        "c.json: field `kv_lora_rank` is missing (expected a positive integer)"
    );
}

fn ferrotron_plan(name: &str, layout: Layout) -> PlanResult {
    let recipe = Recipe {
        seq: 4096,
        mbs: 1,
        recompute: Recompute::None,
        ..Recipe::default()
    };
    plan(&input(name, recipe, layout, Convention::Ferrotron)).unwrap()
}

/// Bytes of `act.layers.{i}.{name}` in a plan.
fn act_bytes(r: &PlanResult, i: u64, name: &str) -> u64 {
    let full = format!("act.layers.{i}.{name}");
    r.ranks[0]
        .plan
        .buffers
        .iter()
        .find(|b| b.name == full)
        .unwrap_or_else(|| panic!("no {full}"))
        .bytes()
}

fn has_act(r: &PlanResult, i: u64, name: &str) -> bool {
    let full = format!("act.layers.{i}.{name}");
    r.ranks[0].plan.buffers.iter().any(|b| b.name == full)
}

#[test]
fn gemma2_plans_sandwich_norms_and_geglu() {
    let r = ferrotron_plan("gemma-2-9b", Layout::default());
    let n = 4096u64;
    assert_eq!(act_bytes(&r, 0, "geglu"), n * 14336 * 2);
    assert_eq!(act_bytes(&r, 0, "attn_proj"), n * 3584 * 2);
    assert_eq!(act_bytes(&r, 0, "post_mlp_rstd"), n * 4);
    // head_dim 256 · 16 heads = 4096 ≠ hidden 3584.
    assert_eq!(act_bytes(&r, 0, "q"), n * 4096 * 2);
    assert!(!has_act(&r, 0, "swiglu"));
}

#[test]
fn deepseek_plans_mla_latents_and_dense_then_moe_layers() {
    let layout = Layout {
        tp: 2,
        ep: 4,
        pp: 3,
        ..Layout::default()
    };
    let r = ferrotron_plan("deepseek-v2-lite", layout);
    let n = 4096u64;
    // MLA: the kv down projection runs replicated on every tp rank ([N, kv_lora + rope]);
    // q, k (nope + rope = 192 per head) and v (128) split by head over tp.
    assert_eq!(act_bytes(&r, 0, "kv_a"), n * (512 + 64) * 2);
    assert_eq!(act_bytes(&r, 0, "kv_a_norm_out"), n * 512 * 2);
    assert!(
        !has_act(&r, 0, "q_a"),
        "q_lora_rank null: q is projected directly"
    );
    assert_eq!(act_bytes(&r, 0, "q"), n * 16 / 2 * 192 * 2);
    assert_eq!(act_bytes(&r, 0, "k"), n * 16 / 2 * 192 * 2);
    assert_eq!(act_bytes(&r, 0, "v"), n * 16 / 2 * 128 * 2);
    // Layer 0 is dense (first_k_dense_replace 1): a SwiGLU of width 10944 / tp.
    assert_eq!(act_bytes(&r, 0, "gate"), n * 10944 / 2 * 2);
    assert!(!has_act(&r, 0, "router_logits"));
    // Layer 1 routes n·6 token copies to experts of width 1408 / tp, plus the 2 shared
    // experts (width 2816 / tp) on every token. Under expert parallelism ferrotron routes
    // exactly (nothing dropped), so a rank's routed buffers hold the most its 16 experts can
    // receive: every one of the 4 ep ranks' n tokens, each at most min(6, 16) times.
    assert_eq!(act_bytes(&r, 1, "gate"), n * 4 * 6 * 1408 / 2 * 2);
    assert_eq!(act_bytes(&r, 1, "shared.swiglu"), n * 2816 / 2 * 2);
    assert_eq!(act_bytes(&r, 1, "router_logits"), n * 64 * 4);
    // Each ep rank holds 64 / 4 = 16 experts of each of the 8 MoE layers of stage 0 (layers
    // 1..=8), each split over tp: 3·1408·2048 / 2 elements.
    let m = preset("deepseek-v2-lite").unwrap();
    let tensors = inventory(&m);
    let local_experts: u64 = tensors
        .iter()
        .filter(|t| matches!(t.expert, Some(e) if e < 16))
        .filter(|t| matches!(t.placement, inventory::Placement::Layer(i) if i < 9))
        .map(|t| t.numel_tp(2))
        .sum();
    assert_eq!(local_experts, 8 * 16 * 3 * 1408 * 2048 / 2);
}

#[test]
fn a_capacity_factor_bounds_the_routed_buffers_by_every_experts_capacity() {
    // Mixtral 8x7B, 4096 tokens, top-2 of 8: capacity ⌈cf · 4096 · 2 / 8⌉ copies per expert
    // (Fedus et al. 2021 eq. 3). One rank routes at most n·k = 8192 copies: cf 0.5 bounds them
    // by 8 · 512 = 4096 rows; cf 1.25 by 8 · 1280 = 10240, more than n·k, so no bound.
    let with = |cf: Option<f64>, ep: u64| {
        let recipe = Recipe {
            seq: 4096,
            mbs: 1,
            recompute: Recompute::None,
            capacity_factor: cf,
            ..Recipe::default()
        };
        let layout = Layout {
            ep,
            ..Layout::default()
        };
        plan(&input(
            "mixtral-8x7b",
            recipe,
            layout,
            Convention::Ferrotron,
        ))
        .unwrap()
    };
    let n = 4096u64;
    let gate = |r: &PlanResult| act_bytes(r, 0, "gate") / (14336 * 2);
    assert_eq!(gate(&with(None, 1)), n * 2);
    assert_eq!(gate(&with(Some(0.5), 1)), 8 * 512);
    assert_eq!(gate(&with(Some(1.25), 1)), n * 2);
    // Under ep 4 exact routing must hold what every rank may send a rank's 2 experts:
    // 4 · n · min(2, 2); with cf 1.0 each rank sends an expert at most 1024 copies, so a
    // rank's two experts receive at most 2 · 4 · 1024 = E · C.
    assert_eq!(gate(&with(None, 4)), 4 * n * 2);
    assert_eq!(gate(&with(Some(1.0), 4)), 8 * 1024);
}

#[test]
fn qwen2_moe_plans_shared_expert_and_its_gate() {
    let r = ferrotron_plan("qwen1.5-moe-a2.7b", Layout::default());
    let n = 4096u64;
    assert_eq!(act_bytes(&r, 0, "shared.up"), n * 5632 * 2);
    assert_eq!(act_bytes(&r, 0, "shared.score"), n * 4);
    assert_eq!(act_bytes(&r, 0, "up"), n * 4 * 1408 * 2);
    let q3 = ferrotron_plan("qwen3-30b-a3b", Layout::default());
    assert!(!has_act(&q3, 0, "shared.up"));
    // Qwen3: q/k norms keep their inputs and rstd.
    assert_eq!(act_bytes(&q3, 0, "k_pre"), n * 4 * 128 * 2);
    assert_eq!(act_bytes(&q3, 0, "q_rstd"), n * 32 * 4);
}

#[test]
fn phi3_fused_projections_split_like_separate_ones() {
    let m = preset("phi-3-mini-4k").unwrap();
    let inv = inventory(&m);
    let qkv = inv
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.qkv_proj.weight")
        .unwrap();
    assert_eq!(qkv.shape, [3 * 3072, 3072]);
    assert_eq!(qkv.numel_tp(4), 3 * 3072 * 3072 / 4);
    let gate_up = inv
        .iter()
        .find(|t| t.name == "model.layers.0.mlp.gate_up_proj.weight")
        .unwrap();
    assert_eq!(gate_up.numel_tp(4), 2 * 8192 * 3072 / 4);
}

#[test]
fn every_new_preset_plans_under_every_convention() {
    for name in [
        "gemma-2b",
        "gemma-2-9b",
        "phi-3-mini-4k",
        "qwen3-8b",
        "qwen1.5-moe-a2.7b",
        "qwen3-30b-a3b",
        "deepseek-v2-lite",
    ] {
        for conv in [
            Convention::Ferrotron,
            Convention::Megatron,
            Convention::Playbook,
            Convention::ZeroPaper,
        ] {
            for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
                let recipe = Recipe {
                    seq: 2048,
                    mbs: 1,
                    grad_acc: 4,
                    recompute: rc,
                    ..Recipe::default()
                };
                let r = plan(&input(name, recipe, Layout::default(), conv)).unwrap();
                assert!(r.worst().peak > 0, "{name} {conv}");
            }
        }
    }
}
