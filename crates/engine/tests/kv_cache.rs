//! Decoding over a KV cache against the full-prefix forward: at every step the cached logits
//! are those of the whole prefix recomputed (to f32 rounding: the two attention kernels sum in
//! different orders), whatever the step sizes, with several sequences at once and with a MoE
//! model; and greedy decoding chooses the same tokens either way. Under every SIMD tier the
//! CPU has (AVX-512, AVX2, baseline), since their products round differently.

mod common;

use common::{rel_err, to64};
use ferrotron_engine::kernels::cpu::simd::{limit_tier, Tier};
use ferrotron_engine::kernels::{CpuKernels, Kernels};
use ferrotron_engine::model::{BatchShape, HeapPool, KvCache, Llama, LlamaConfig, MoeConfig};

/// Relative error (to the logits' largest magnitude) the two paths stay within: f32 rounding
/// of sums of a few hundred terms, orders apart from a wrong position or mask (≈ 1e-1).
const TOL: f64 = 2e-5;

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The full-prefix forward's logits of each sequence's last token (`seqs` of equal length).
fn full(model: &Llama, params: &[f32], seqs: &[Vec<u32>]) -> Vec<f32> {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let (b, t) = (seqs.len(), seqs[0].len());
    let tokens: Vec<u32> = seqs.concat();
    let mut logits = vec![0.0; b * model.config.vocab];
    let batch = BatchShape { b, t };
    let mut pool = HeapPool::new();
    model.forward_logits_last(k, &mut pool, params, batch, &tokens, &mut logits);
    logits
}

/// Feeds `seqs` (B sequences) to a fresh cache in steps of the given sizes, checking each
/// step's logits against the full forward of the prefix so far; returns the worst error.
fn steps_match(model: &Llama, params: &[f32], seqs: &[Vec<u32>], steps: &[usize]) -> f64 {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let b = seqs.len();
    let total: usize = steps.iter().sum();
    let mut cache = KvCache::new(model, b, total);
    let mut pool = HeapPool::new();
    let mut logits = vec![0.0; b * model.config.vocab];
    let (mut at, mut worst) = (0, 0.0f64);
    for &t in steps {
        let new: Vec<u32> = seqs.iter().flat_map(|s| &s[at..at + t]).copied().collect();
        model.forward_cached(k, &mut pool, params, &mut cache, &new, &mut logits);
        at += t;
        assert_eq!(cache.len(), at);
        let prefix: Vec<Vec<u32>> = seqs.iter().map(|s| s[..at].to_vec()).collect();
        let want = full(model, params, &prefix);
        let e = rel_err(&logits, &to64(&want));
        assert!(
            e <= TOL,
            "after {at} tokens: relative error {e:.2e} > {TOL:.0e}"
        );
        worst = worst.max(e);
    }
    assert_eq!(pool.live_bytes, 0, "every step returns its buffers");
    worst
}

fn tokens(n: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 31 + seed * 17 + 5) % vocab) as u32)
        .collect()
}

/// GQA (4 query heads over 2 key/value heads), q/k/v bias, untied head; weights large enough
/// that the logits spread out (no near-ties for greedy decoding to trip on).
fn dense() -> (Llama, Vec<f32>) {
    let model = Llama::new(common::dense_cfg(false, true));
    let params = model.params.init(3, 0.5);
    (model, params)
}

fn tiers() -> impl Iterator<Item = Tier> {
    [Tier::Avx512, Tier::Avx2, Tier::Baseline]
        .into_iter()
        .filter(|t| t.supported())
}

#[test]
fn cached_logits_equal_the_full_prefix_forward_step_by_step() {
    let (model, params) = dense();
    let seq = tokens(40, 1, model.config.vocab);
    // A 7-token prompt, then one token per step (decoding); then prompt chunks of several
    // tokens at later positions (RoPE offset and the causal mask inside a step).
    let mut decode = vec![7];
    decode.extend(std::iter::repeat_n(1, 33));
    for tier in tiers() {
        limit_tier(tier);
        let e1 = steps_match(&model, &params, std::slice::from_ref(&seq), &decode);
        let e2 = steps_match(
            &model,
            &params,
            std::slice::from_ref(&seq),
            &[3, 5, 1, 8, 23],
        );
        eprintln!("{tier:?}: worst relative error {e1:.2e} decoding, {e2:.2e} in chunks");
    }
    limit_tier(Tier::Avx512);
}

#[test]
fn several_sequences_decode_together() {
    let (model, params) = dense();
    let seqs: Vec<Vec<u32>> = (0..3).map(|s| tokens(20, s + 2, 80)).collect();
    let mut steps = vec![5];
    steps.extend(std::iter::repeat_n(1, 15));
    steps_match(&model, &params, &seqs, &steps);
}

#[test]
fn a_moe_model_decodes_as_it_runs_whole() {
    // The tiny Mixtral of the expert-parallel tests (crates/dist/tests/common/moe.rs).
    let cfg = LlamaConfig {
        hidden: 32,
        intermediate: 48,
        head_dim: 8,
        vocab: 48,
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            norm_topk: true,
            aux_loss_coef: 0.05,
        }),
        ..common::dense_cfg(true, false)
    };
    let model = Llama::new(cfg);
    let params = model.params.init(9, 0.5);
    let seq = tokens(24, 4, 48);
    let mut steps = vec![4];
    steps.extend(std::iter::repeat_n(1, 20));
    steps_match(&model, &params, &[seq], &steps);
}

#[test]
fn greedy_decoding_chooses_the_same_tokens_with_and_without_the_cache() {
    let (model, params) = dense();
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let (prompt, new) = (vec![1u32, 2, 3, 4, 5], 50);
    let capacity = prompt.len() + new;
    assert!(capacity <= model.config.max_pos);
    // Without: the whole sequence through the model for every token.
    let mut plain = prompt.clone();
    for _ in 0..new {
        plain.push(argmax(&full(&model, &params, std::slice::from_ref(&plain))));
    }
    // With: the prompt once, then each chosen token alone.
    let mut cache = KvCache::new(&model, 1, capacity);
    let mut pool = HeapPool::new();
    let mut logits = vec![0.0; model.config.vocab];
    let mut cached = prompt.clone();
    let mut step = prompt.clone();
    for _ in 0..new {
        model.forward_cached(k, &mut pool, &params, &mut cache, &step, &mut logits);
        let next = argmax(&logits);
        cached.push(next);
        step = vec![next];
    }
    assert_eq!(cached, plain);
    // Not a constant run: the model's choices vary.
    let distinct: std::collections::BTreeSet<_> = plain[prompt.len()..].iter().collect();
    assert!(distinct.len() > 3, "{plain:?}");
    // Cleared, the cache serves another sequence from position 0.
    cache.clear();
    model.forward_cached(k, &mut pool, &params, &mut cache, &prompt, &mut logits);
    assert_eq!(argmax(&logits), plain[prompt.len()]);
}
