//! The flat parameter buffer and its tensor table (HF names, row-major shapes).
//!
//! The tensors, their names, shapes and order are the planner's inventory
//! (`ferrotron_plan::inventory`), the one list the memory plan also counts: the embedding, then
//! per layer the input norm, q/k/v (each followed by its bias when `qkv_bias`), o, the
//! post-attention norm, gate/up/down; then the final norm, then the LM head when untied. That
//! order is also the gradient buffer's and the optimizer state's, and the seeded initialisation
//! draws in it.

use super::config::LlamaConfig;
use ferrotron_plan::inventory::{inventory, names};
use std::collections::HashMap;
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
    /// A sparse MLP's router and experts (then `wg`, `wu`, `wd` are empty).
    pub moe: Option<MoeIdx>,
}

/// Ranges of a Mixtral sparse MLP's tensors.
#[derive(Clone, Debug)]
pub struct MoeIdx {
    /// `[E, C]`.
    pub router: Range<usize>,
    pub experts: Vec<ExpertIdx>,
}

/// One expert's SwiGLU: gate (w1), up (w3), down (w2).
#[derive(Clone, Debug)]
pub struct ExpertIdx {
    pub gate: Range<usize>,
    pub up: Range<usize>,
    pub down: Range<usize>,
}

impl LayerIdx {
    /// Every tensor's range (biases where the model has them).
    pub fn ranges(&self) -> impl Iterator<Item = &Range<usize>> {
        let weights = [
            &self.ln1, &self.wq, &self.wk, &self.wv, &self.wo, &self.ln2, &self.wg, &self.wu,
            &self.wd,
        ];
        let biases = [&self.bq, &self.bk, &self.bv];
        let moe = self.moe.iter().flat_map(|m| {
            let experts = m.experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]);
            std::iter::once(&m.router).chain(experts)
        });
        weights
            .into_iter()
            .chain(biases.into_iter().flatten())
            .chain(moe)
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
        Self::holding_experts(cfg, held, &|_| true)
    }

    /// [`ParamTable::holding`] of only the routed experts `experts` selects (an
    /// expert-parallel rank's): the others' ranges are empty.
    pub fn holding_experts(
        cfg: &LlamaConfig,
        held: &dyn Fn(Placement) -> bool,
        experts: &dyn Fn(u64) -> bool,
    ) -> Self {
        let head = held(Placement::Head);
        let mut entries = Vec::new();
        let mut off = 0usize;
        for t in inventory(&cfg.spec()) {
            let keep = match t.placement {
                Placement::Embedding => held(t.placement) || (head && cfg.tie_embeddings),
                p => held(p),
            } && t.expert.is_none_or(experts);
            if keep {
                let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
                let numel = shape.iter().product();
                entries.push(TensorEntry {
                    name: t.name,
                    shape,
                    offset: off,
                    numel,
                });
                off += numel;
            }
        }
        // A tensor the stage does not hold has an empty range, so layer `i` keeps its index.
        let at: HashMap<&str, Range<usize>> = entries
            .iter()
            .map(|e| (e.name.as_str(), e.range()))
            .collect();
        let range = |name: &str| at.get(name).cloned().unwrap_or(0..0);
        let layers = (0..cfg.layers as u64)
            .map(|i| {
                let attn = |proj| names::proj(names::ATTN, proj);
                let mlp = |proj| range(&names::weight(i, &names::proj(names::MLP, proj)));
                let bias = |proj| cfg.qkv_bias.then(|| range(&names::bias(i, &attn(proj))));
                LayerIdx {
                    ln1: range(&names::weight(i, names::ATTN_NORM)),
                    wq: range(&names::weight(i, &attn(names::Q))),
                    bq: bias(names::Q),
                    wk: range(&names::weight(i, &attn(names::K))),
                    bk: bias(names::K),
                    wv: range(&names::weight(i, &attn(names::V))),
                    bv: bias(names::V),
                    wo: range(&names::weight(i, &attn(names::O))),
                    ln2: range(&names::weight(i, names::MLP_NORM)),
                    wg: mlp(names::GATE),
                    wu: mlp(names::UP),
                    wd: mlp(names::DOWN),
                    moe: cfg.moe.map(|m| {
                        let block = names::proj(&names::layer(i), names::MOE);
                        let w = |module: &str| range(&format!("{module}.weight"));
                        MoeIdx {
                            router: w(&names::proj(&block, names::ROUTER)),
                            experts: (0..m.experts as u64)
                                .map(|e| {
                                    let x = names::expert(&block, e);
                                    ExpertIdx {
                                        gate: w(&names::proj(&x, names::EXPERT_GATE)),
                                        up: w(&names::proj(&x, names::EXPERT_UP)),
                                        down: w(&names::proj(&x, names::EXPERT_DOWN)),
                                    }
                                })
                                .collect(),
                        }
                    }),
                }
            })
            .collect();
        let embed = range(names::EMBED);
        ParamTable {
            norm: range(names::FINAL_NORM),
            lm_head: match cfg.tie_embeddings {
                true => embed.clone(),
                false => range(names::LM_HEAD),
            },
            embed,
            layers,
            entries,
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

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_plan::inventory::count;

    fn config(tie: bool, bias: bool) -> LlamaConfig {
        LlamaConfig {
            hidden: 8,
            intermediate: 12,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            layers: 2,
            vocab: 10,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            tie_embeddings: tie,
            qkv_bias: bias,
            max_pos: 16,
            moe: None,
        }
    }

    /// The flat order is what the seeded initialisation draws in, so checkpoints and every
    /// trajectory depend on it: it is pinned here.
    #[test]
    fn order_is_the_forward_order() {
        let t = ParamTable::new(&config(false, true));
        let layer0: Vec<&str> = t.entries[1..14].iter().map(|e| e.name.as_str()).collect();
        let expect = [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ];
        assert_eq!(t.entries[0].name, "model.embed_tokens.weight");
        for (got, want) in layer0.iter().zip(expect) {
            assert_eq!(*got, format!("model.layers.0.{want}"));
        }
        let last: Vec<&str> = t
            .entries
            .iter()
            .rev()
            .take(2)
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(last, ["lm_head.weight", "model.norm.weight"]);
        // The direct indices point at the tensors of those names.
        assert_eq!(
            t.get("model.layers.1.mlp.up_proj.weight").unwrap().range(),
            t.layers[1].wu
        );
        assert_eq!(t.layers[0].bk, Some(t.entries[5].range()));
    }

    #[test]
    fn totals_are_the_planner_count() {
        for (tie, bias) in [(true, false), (false, true)] {
            let c = config(tie, bias);
            let spec = c.spec();
            let t = ParamTable::new(&c);
            assert_eq!(t.total as u64, count(&spec, &inventory(&spec)).total);
            assert_eq!(t.lm_head == t.embed, tie);
        }
    }

    /// A stage that does not hold a layer keeps its index, with empty ranges.
    #[test]
    fn a_stage_holds_only_its_parts() {
        let c = config(true, false);
        let last = ParamTable::holding(&c, &|p| p != Placement::Layer(0));
        assert_eq!(last.layers[0].wq, 0..0);
        assert_eq!(last.layers[1].wq.start, last.embed.end + c.hidden);
        assert_eq!(last.lm_head, last.embed, "the last stage keeps a tied copy");
    }
}
