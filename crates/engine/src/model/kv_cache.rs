//! Inference with a KV cache: each layer's keys and values of the positions already seen are
//! kept, so a decoding step runs the model on its new tokens only, attending over the cache
//! (Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2). Without it each
//! generated token recomputes the whole prefix: quadratic in the tokens generated instead of
//! linear (attention over the cache stays linear per step).
//!
//! The cache is sized once, for every position the generation will reach, and allocated once:
//! per layer `k` then `v`, each `[B, capacity, KV, D]`, keys stored after RoPE (a key's
//! rotation depends on its own position only, so it is final once written). A step's new
//! tokens take positions `len..len + t`: RoPE reads its table from position `len` on, and
//! attention sees the cached keys of earlier positions plus the new ones, causally.

use super::activations::BatchShape;
use super::buffers::BufferPool;
use super::llama::Llama;
use super::param_buf::{ParamSource, Unit, WholeParams};
use crate::dtype::Elem;
use crate::kernels::{AsViewMut, AttnShape, CachedAttnShape, Kernels, RopeTable, View, ViewMut};

/// The keys and values of every position seen so far, for `batch` sequences decoded together.
#[derive(Clone, Debug)]
pub struct KvCache<S> {
    /// Per layer `k` then `v`, each `[batch, capacity, KV, D]`.
    data: Vec<S>,
    batch: usize,
    capacity: usize,
    kv_dim: usize,
    /// Positions filled (the next token's position).
    len: usize,
    /// RoPE cos/sin of the current step's positions: the model's table from `len` on, copied
    /// into room reserved for `capacity` positions.
    rope: RopeTable,
}

impl<S: Elem> KvCache<S> {
    /// Room for `capacity` positions of `batch` sequences of `model` (at most its
    /// `max_position_embeddings`: a caller refuses longer requests first, in words).
    pub fn new(model: &Llama, batch: usize, capacity: usize) -> Self {
        let c = &model.config;
        assert!(
            capacity <= c.max_pos,
            "KV cache of {capacity} positions past the model's {} (max_position_embeddings)",
            c.max_pos
        );
        assert!(
            model.tp.is_none() && model.cp.is_none() && model.stage.is_none(),
            "a KV cache serves a whole model on one rank"
        );
        let half = c.head_dim / 2;
        let rope = RopeTable {
            head_dim: c.head_dim,
            max_pos: 0,
            cos: Vec::with_capacity(capacity * half),
            sin: Vec::with_capacity(capacity * half),
        };
        KvCache {
            data: vec![S::default(); 2 * c.layers * batch * capacity * c.kv_dim()],
            batch,
            capacity,
            kv_dim: c.kv_dim(),
            len: 0,
            rope,
        }
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the next sequence starts at 0), keeping the memory.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Elements of one layer's `k` (or `v`).
    fn layer_len(&self) -> usize {
        self.batch * self.capacity * self.kv_dim
    }

    /// The RoPE table of the step's `t` new tokens: positions `len..len + t` as `0..t`.
    fn turn_rope(&mut self, model: &RopeTable, t: usize) {
        let half = model.head_dim / 2;
        let r = self.len * half..(self.len + t) * half;
        self.rope.cos.clear();
        self.rope.cos.extend_from_slice(&model.cos[r.clone()]);
        self.rope.sin.clear();
        self.rope.sin.extend_from_slice(&model.sin[r]);
        self.rope.max_pos = t;
    }

    /// The step's RoPE table (see [`KvCache::turn_rope`]).
    pub(super) fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// Layer `layer`'s attention for the step: writes the new tokens' keys and values `[B, t,
    /// KV, D]` (RoPE applied) at their positions, then attends the queries over the cache.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend<G: Elem>(
        &mut self,
        k: &dyn Kernels<S, G>,
        layer: usize,
        s: AttnShape,
        q: View<'_, S>,
        new_k: View<'_, S>,
        new_v: View<'_, S>,
        o: ViewMut<'_, S>,
    ) {
        let (t, kvd, cap, pos) = (s.t, self.kv_dim, self.capacity, self.len);
        let per = self.layer_len();
        let mut all = self.data.view_mut();
        let (mut kc, mut vc) = all
            .rb()
            .slice_mut(2 * layer * per..2 * (layer + 1) * per)
            .split_at_mut(per);
        for b in 0..s.b {
            let (src, dst) = (b * t * kvd, (b * cap + pos) * kvd);
            let (src, dst) = (src..src + t * kvd, dst..dst + t * kvd);
            k.copy(new_k.slice(src.clone()), kc.rb().slice_mut(dst.clone()));
            k.copy(new_v.slice(src), vc.rb().slice_mut(dst));
        }
        let shape = CachedAttnShape {
            attn: s,
            pos,
            capacity: cap,
        };
        k.attention_forward_cached(shape, q, kc.as_view(), vc.as_view(), o);
    }
}

impl Llama {
    /// Inference step over a KV cache: runs `tokens` (`t` new tokens of each of the cache's B
    /// sequences, `[B, t]`) at positions `cache.len()..cache.len() + t`, adds their keys and
    /// values to the cache, and writes the logits of each sequence's last new token into
    /// `logits` `[B, V]`. The first step passes the prompt (an empty cache); each later one
    /// the token just chosen.
    pub fn forward_cached<S: Elem>(
        &self,
        k: &dyn Kernels<S>,
        pool: &mut dyn BufferPool,
        params: &[S],
        cache: &mut KvCache<S>,
        tokens: &[u32],
        logits: &mut [f32],
    ) {
        assert_eq!(params.len(), self.params.total, "params buffer length");
        let b = cache.batch;
        assert!(
            !tokens.is_empty() && tokens.len().is_multiple_of(b),
            "tokens must hold B·t ids, t ≥ 1"
        );
        let batch = BatchShape {
            b,
            t: tokens.len() / b,
        };
        assert!(
            cache.len + batch.t <= cache.capacity,
            "KV cache: {} positions past its capacity of {}",
            cache.len + batch.t,
            cache.capacity
        );
        cache.turn_rope(&self.rope, batch.t);
        let params = &mut WholeParams::host(params);
        let x = self.embed_forward(k, pool, params, tokens);
        let layers = 0..self.config.layers;
        let x = self.layers_no_grad_over(k, pool, params, batch, layers, x, Some(cache));
        cache.len += batch.t;
        self.last_logits(k, pool, params.unit(Unit::Head), batch, x, logits);
    }
}
