//! Parallel blocks, x + attn(ln(x)) + mlp(ln(x)) (GPT-J; GPT-NeoX and Pythia with
//! `use_parallel_residual`; PaLM, Chowdhery et al. 2022 §2): configs read, parameter counts
//! exact against published figures, and the activation and time models of the block.

use ferrotron_plan::activations::layer_acts;
use ferrotron_plan::cluster::{gpu, Cluster};
use ferrotron_plan::hardware::Overhead;
use ferrotron_plan::inventory::{count, inventory};
use ferrotron_plan::presets::preset;
use ferrotron_plan::time::estimate;
use ferrotron_plan::*;

fn total(m: &ModelSpec) -> u64 {
    count(m, &inventory(m)).total
}

/// Parameters outside the input embedding and the output head (Pythia's "non-embedding").
fn non_embedding(m: &ModelSpec) -> u64 {
    inventory(m)
        .iter()
        .filter(|t| t.name != "gpt_neox.embed_in.weight" && t.name != "embed_out.weight")
        .map(|t| t.numel())
        .sum()
}

/// A preset's config with some fields replaced.
fn with(name: &str, edits: &[(&str, serde_json::Value)]) -> ModelSpec {
    let text = presets::PRESETS.iter().find(|p| p.0 == name).unwrap().1;
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    for (k, x) in edits {
        v[*k] = x.clone();
    }
    ModelSpec::from_json_value(&v, name).unwrap()
}

#[test]
fn configs_say_which_blocks_are_parallel() {
    let p = preset("pythia-160m").unwrap();
    assert_eq!(p.family, model::Family::GptNeox);
    assert!(p.parallel_block);
    assert_eq!(p.pre_norms(), 2, "GPT-NeoX: two norms of the layer input");
    // rotary_pct 0.25 of a 64-wide head: rotary_ndims = 16.
    assert_eq!(p.rotary_dim, 16);
    let serial = with("pythia-160m", &[("use_parallel_residual", false.into())]);
    assert!(!serial.parallel_block);
    let j = preset("gpt-j-6b").unwrap();
    assert_eq!(j.family, model::Family::GptJ);
    assert!(j.parallel_block);
    assert_eq!(j.pre_norms(), 1, "GPT-J: ln_1 shared by attention and MLP");
    assert_eq!((j.head_dim, j.rotary_dim), (256, 64));
    // GPT-2 and the Llama-like families stay serial.
    for name in ["gpt2", "llama-3-8b"] {
        let m = preset(name).unwrap();
        assert!(!m.parallel_block);
        assert_eq!(m.pre_norms(), 2);
    }
    // A config can be wrong about a fraction.
    let text = r#"{"model_type":"gpt_neox","hidden_size":64,"num_attention_heads":4,
        "num_hidden_layers":2,"intermediate_size":256,"vocab_size":100,"rotary_pct":2}"#;
    let e = ModelSpec::from_json_str(text, "bad")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rotary_pct"), "{e}");
}

#[test]
fn pythia_counts_match_the_model_cards() {
    // EleutherAI/pythia-160m and pythia-1.4b model cards (and Biderman et al. 2023, arXiv
    // 2304.01373, Table 1): "Non-Embedding Params" 85,056,000 and 1,208,602,624. With the
    // untied embed_in and embed_out, [50304, h] each: 162,322,944 and 1,414,647,808 in all.
    let p160 = preset("pythia-160m").unwrap();
    assert_eq!(non_embedding(&p160), 85_056_000);
    assert_eq!(total(&p160), 85_056_000 + 2 * 50_304 * 768);
    assert_eq!(total(&p160), 162_322_944);
    let p14 = preset("pythia-1.4b").unwrap();
    assert_eq!(non_embedding(&p14), 1_208_602_624);
    assert_eq!(total(&p14), 1_414_647_808);
    // The serial variant has the same tensors (the flag changes the wiring, not the weights).
    let serial = with("pythia-160m", &[("use_parallel_residual", false.into())]);
    assert_eq!(total(&serial), total(&p160));
    let names: Vec<String> = inventory(&p160).into_iter().map(|t| t.name).collect();
    for n in [
        "gpt_neox.layers.11.post_attention_layernorm.bias",
        "gpt_neox.layers.0.attention.query_key_value.bias",
        "gpt_neox.final_layer_norm.weight",
        "embed_out.weight",
    ] {
        assert!(names.iter().any(|x| x == n), "{n}");
    }
}

#[test]
fn gpt_j_counts_the_hf_checkpoint_and_explains_the_model_card() {
    // The HF checkpoint of EleutherAI/gpt-j-6b (GPTJForCausalLM): wte [50400, 4096]; 28 layers
    // of ln_1 (weight, bias), q/k/v/out_proj [4096, 4096] without bias, fc_in [16384, 4096]
    // and fc_out [4096, 16384] with biases; ln_f; lm_head [50400, 4096] with a bias.
    let m = preset("gpt-j-6b").unwrap();
    let (h, f, v, l) = (4096u64, 16_384u64, 50_400u64, 28u64);
    let layer = 2 * h + 4 * h * h + (f * h + f) + (h * f + h);
    assert_eq!(total(&m), v * h + l * layer + 2 * h + (v * h + v));
    assert_eq!(total(&m), 6_050_882_784);
    // pytorch_model.bin of the repository is "24.3 GB" (fp32: 4 bytes per parameter plus the
    // causal-mask buffers each layer stores).
    assert_eq!(((total(&m) * 4) as f64 / 1e9 * 10.0).round(), 242.0);
    // The model card's "n_parameters 6,053,381,344" counts mesh-transformer-jax's 8-way
    // sharded model (the layers.py it links), where every shard holds its own copy of each
    // LayerNorm and of each row-parallel bias (fc_out's, the output projection's), and the
    // embedding projection has a bias HF drops: 7 extra copies of 2h + h per layer, of ln_f's
    // 2h, and 8 embedding biases of h. The difference is exactly that.
    let shards = 8u64;
    let jax_extra = l * (shards - 1) * (2 * h + h) + (shards - 1) * 2 * h + shards * h;
    assert_eq!(total(&m) + jax_extra, 6_053_381_344);
}

fn recipe(rc: Recompute) -> Recipe {
    Recipe {
        seq: 2048,
        mbs: 1,
        recompute: rc,
        ..Recipe::default()
    }
}

fn acts_bytes(m: &ModelSpec, rc: Recompute, tp: u64) -> (u64, Vec<&'static str>) {
    let l = Layout {
        tp,
        ..Layout::default()
    };
    let a = layer_acts(m, &recipe(rc), &l, Convention::Ferrotron, false);
    let bytes = a.saved.iter().map(|a| a.numel * a.dtype.bytes()).sum();
    (bytes, a.saved.iter().map(|a| a.name).collect())
}

#[test]
fn a_parallel_block_keeps_no_mid_residual_and_one_shared_norm() {
    // The reference implementations (transformers GPTJBlock, GPTNeoXLayer): GPT-J's MLP reads
    // ln_1's output, already kept for attention; GPT-NeoX's reads its own norm of the layer
    // input. Neither has an intermediate residual to keep.
    let (n, c) = (2048u64, 4096u64);
    let j = preset("gpt-j-6b").unwrap();
    let mut serial_j = j.clone();
    serial_j.parallel_block = false;
    let (pj, names) = acts_bytes(&j, Recompute::None, 1);
    let (sj, _) = acts_bytes(&serial_j, Recompute::None, 1);
    assert!(!names.contains(&"resid_mid") && !names.contains(&"ln2_out"));
    // Serial − parallel: resid_mid and ln2_out (2 bytes each per element) and the norm's mean
    // and rstd (fp32, per token).
    assert_eq!(sj - pj, 2 * 2 * n * c + 2 * 4 * n);

    let p = preset("pythia-1.4b").unwrap();
    let mut serial_p = p.clone();
    serial_p.parallel_block = false;
    let (pp, names) = acts_bytes(&p, Recompute::None, 1);
    let (sp, _) = acts_bytes(&serial_p, Recompute::None, 1);
    assert!(!names.contains(&"resid_mid") && names.contains(&"ln2_out"));
    assert_eq!(sp - pp, 2 * n * 2048);
    // Selective recomputation drops the norm outputs either way; full keeps the input only.
    let (sel, names) = acts_bytes(&j, Recompute::Selective, 1);
    assert!(!names.contains(&"ln1_out"));
    assert!(sel < pj);
    let (full, names) = acts_bytes(&j, Recompute::Full, 1);
    assert_eq!(names, ["input"]);
    assert_eq!(full, 2 * n * c);
}

fn step(m: ModelSpec, tp: u64) -> time::TimeReport {
    let x = PlanInput {
        model: ModelSource::Spec(m),
        recipe: recipe(Recompute::None),
        layout: Layout {
            tp,
            ..Layout::default()
        },
        convention: Convention::Ferrotron,
        runtime: Runtime::Ferrotron,
        overhead: Overhead::NONE,
        bucket_bytes: 25 << 20,
    };
    let c = Cluster::of(gpu("h100").unwrap(), 8).unwrap();
    estimate(&x, &c, FlopsConvention::Ferrotron)
        .unwrap()
        .unwrap()
}

#[test]
fn a_parallel_block_runs_fewer_elementwise_kernels_and_one_forward_all_reduce() {
    let j = preset("gpt-j-6b").unwrap();
    let mut serial = j.clone();
    serial.parallel_block = false;
    let (par, ser) = (step(j.clone(), 1), step(serial.clone(), 1));
    // Same matmuls and attention; the parallel block runs one norm instead of two and one
    // three-way residual add instead of two adds: per layer, forward (2 + 2)·st·N·h fewer
    // bytes and backward 3·st·N·h fewer (one norm's backward).
    assert_eq!(par.compute_detail.matmul_s, ser.compute_detail.matmul_s);
    let (n, h, st) = (2048.0, 4096.0, 2.0);
    let bytes = 28.0 * (4.0 + 3.0) * st * n * h;
    let bw = par.efficiency.hbm_bw * par.efficiency.memory;
    let saved = ser.compute_detail.memory_bound_s - par.compute_detail.memory_bound_s;
    assert!(
        (saved - bytes / bw).abs() < 1e-12,
        "{saved} vs {}",
        bytes / bw
    );
    // Tensor parallelism: one forward all-reduce per layer instead of two (gpt-neox's
    // parallel residual), two backward as before: 3 of 4 per layer.
    let tp = |r: &time::TimeReport| {
        r.comm
            .iter()
            .find(|(d, _)| *d == cluster::Dim::Tp)
            .unwrap()
            .1
            .bytes
    };
    let (pt, stp) = (tp(&step(j, 8)), tp(&step(serial, 8)));
    // One all-reduce of the [N, h] activation fewer per layer: a ring sends 2(t−1)/t of it.
    let one = 2.0 * 7.0 / 8.0 * n * h * st;
    assert!(
        (stp - pt - 28.0 * one).abs() < 1e-6 * stp,
        "{stp} - {pt} vs 28 × {one}"
    );
    // The serial layers' 4 each, the embedding's and the head's: what the edges add besides
    // is the cross-entropy's row statistics (12 bytes per row and rank, all-gathered).
    let stats = 7.0 / 8.0 * 12.0 * n * 8.0;
    assert!((stp - (28.0 * 4.0 + 2.0) * one - stats).abs() < 1e-6 * stp);
}
