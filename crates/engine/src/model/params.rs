//! The flat parameter buffer and its tensor table (HF names, row-major shapes).
//!
//! Order (also the order of the gradient buffer and of the optimizer state):
//! `model.embed_tokens.weight`, then per layer `input_layernorm.weight`,
//! `self_attn.{q,k,v}_proj.weight` (each followed by `.bias` when `qkv_bias`),
//! `self_attn.o_proj.weight`, `post_attention_layernorm.weight`,
//! `mlp.{gate,up,down}_proj.weight`; then `model.norm.weight`, then `lm_head.weight` when untied.

use super::config::LlamaConfig;
use std::ops::Range;

/// One named tensor inside the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub numel: usize,
}

impl TensorEntry {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
    /// 2-D weights (matrices and embeddings); norms and biases are 1-D. Trainers commonly
    /// exempt 1-D tensors from weight decay.
    pub fn is_matrix(&self) -> bool {
        self.shape.len() == 2
    }
}

/// Ranges of one decoder layer's tensors.
#[derive(Clone, Debug)]
pub struct LayerIdx {
    pub ln1: Range<usize>,
    pub wq: Range<usize>,
    pub bq: Option<Range<usize>>,
    pub wk: Range<usize>,
    pub bk: Option<Range<usize>>,
    pub wv: Range<usize>,
    pub bv: Option<Range<usize>>,
    pub wo: Range<usize>,
    pub ln2: Range<usize>,
    pub wg: Range<usize>,
    pub wu: Range<usize>,
    pub wd: Range<usize>,
}

impl LayerIdx {
    /// Every tensor's range (biases where the model has them).
    pub fn ranges(&self) -> impl Iterator<Item = &Range<usize>> {
        let weights = [
            &self.ln1, &self.wq, &self.wk, &self.wv, &self.wo, &self.ln2, &self.wg, &self.wu,
            &self.wd,
        ];
        let biases = [&self.bq, &self.bk, &self.bv];
        weights.into_iter().chain(biases.into_iter().flatten())
    }
}

/// Tensor table of a Llama model plus direct indices for the forward/backward.
#[derive(Clone, Debug)]
pub struct ParamTable {
    pub entries: Vec<TensorEntry>,
    pub embed: Range<usize>,
    pub layers: Vec<LayerIdx>,
    pub norm: Range<usize>,
    /// Equals `embed` when embeddings are tied.
    pub lm_head: Range<usize>,
    pub total: usize,
}

/// A part of the model a pipeline stage may hold.
pub use ferrotron_plan::inventory::Placement;

impl ParamTable {
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self::holding(cfg, &|_| true)
    }

    /// The table of the parts `held` selects (a pipeline stage's: its layers, the embedding on
    /// the first stage, the final norm and LM head on the last, which also holds its own copy
    /// of a tied embedding), in the same order and with the same names; the others' ranges are
    /// empty, so layer `i` keeps its index.
    pub fn holding(cfg: &LlamaConfig, held: &dyn Fn(Placement) -> bool) -> Self {
        let mut entries = Vec::new();
        let mut off = 0usize;
        let keep = std::cell::Cell::new(true);
        let mut push = |name: String, shape: Vec<usize>| -> Range<usize> {
            if !keep.get() {
                return 0..0;
            }
            let numel = shape.iter().product();
            entries.push(TensorEntry {
                name,
                shape,
                offset: off,
                numel,
            });
            off += numel;
            off - numel..off
        };
        let (c, f, qd, kvd) = (cfg.hidden, cfg.intermediate, cfg.q_dim(), cfg.kv_dim());
        let head = held(Placement::Head);
        keep.set(held(Placement::Embedding) || (head && cfg.tie_embeddings));
        let embed = push("model.embed_tokens.weight".into(), vec![cfg.vocab, c]);
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            keep.set(held(Placement::Layer(i as u64)));
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let ln1 = push(p("input_layernorm.weight"), vec![c]);
            let wq = push(p("self_attn.q_proj.weight"), vec![qd, c]);
            let bq = cfg
                .qkv_bias
                .then(|| push(p("self_attn.q_proj.bias"), vec![qd]));
            let wk = push(p("self_attn.k_proj.weight"), vec![kvd, c]);
            let bk = cfg
                .qkv_bias
                .then(|| push(p("self_attn.k_proj.bias"), vec![kvd]));
            let wv = push(p("self_attn.v_proj.weight"), vec![kvd, c]);
            let bv = cfg
                .qkv_bias
                .then(|| push(p("self_attn.v_proj.bias"), vec![kvd]));
            let wo = push(p("self_attn.o_proj.weight"), vec![c, qd]);
            let ln2 = push(p("post_attention_layernorm.weight"), vec![c]);
            let wg = push(p("mlp.gate_proj.weight"), vec![f, c]);
            let wu = push(p("mlp.up_proj.weight"), vec![f, c]);
            let wd = push(p("mlp.down_proj.weight"), vec![c, f]);
            layers.push(LayerIdx {
                ln1,
                wq,
                bq,
                wk,
                bk,
                wv,
                bv,
                wo,
                ln2,
                wg,
                wu,
                wd,
            });
        }
        keep.set(head);
        let norm = push("model.norm.weight".into(), vec![c]);
        let lm_head = if cfg.tie_embeddings {
            embed.clone()
        } else {
            push("lm_head.weight".into(), vec![cfg.vocab, c])
        };
        ParamTable {
            entries,
            embed,
            layers,
            norm,
            lm_head,
            total: off,
        }
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Deterministic init: matrices `N(0, std²)` (HF `initializer_range`, 0.02 by default),
    /// norm weights 1, biases 0. `seed` fully determines the result.
    pub fn init(&self, seed: u64, std: f32) -> Vec<f32> {
        let mut out = vec![0.0f32; self.total];
        let mut rng = SplitMix64(seed);
        for e in &self.entries {
            let dst = &mut out[e.range()];
            if e.is_matrix() {
                for pair in dst.chunks_mut(2) {
                    // Box–Muller from two uniforms in (0, 1].
                    let u1 = ((rng.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                    let u2 = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                    let r = (-2.0 * u1.ln()).sqrt() * std as f64;
                    let th = std::f64::consts::TAU * u2;
                    pair[0] = (r * th.cos()) as f32;
                    if pair.len() > 1 {
                        pair[1] = (r * th.sin()) as f32;
                    }
                }
            } else if e.name.ends_with("norm.weight") {
                dst.fill(1.0);
            }
        }
        out
    }
}

/// SplitMix64 (Steele et al. 2014): tiny, seedable, good enough for weight init.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
