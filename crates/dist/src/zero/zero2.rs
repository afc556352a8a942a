//! ZeRO-2's gradient windows (Rajbhandari et al. 2020, §5.2, P_os+g): a rank keeps only its
//! shard of the reduced gradients ([`crate::data_parallel::Shard`]); the full gradients exist
//! only while a unit's backward produces them, in a window that is copied into a bucket for
//! the reduce-scatter as soon as the unit is final, then zeroed and reused.
//!
//! Three windows, one per kind of unit the backward reports ([`ferrotron_engine::model::GradsDone`]):
//! - the embedding (with tied embeddings also the LM head, whose gradient the head's forward
//!   starts and the embedding's backward completes),
//! - the head: the final norm, and an untied LM head (contiguous in the flat order),
//! - one decoder layer: every layer's gradients land in the same window (layers have equal
//!   shapes and follow each other in the flat order), one layer at a time.
//!
//! They are the plan's `comm.zero2.grad_windows`: embedding + head + the largest layer.

use ferrotron_engine::kernels::host_copy::{zero, HostCopy};
use ferrotron_engine::kernels::{View, ViewMut};
use ferrotron_engine::model::{two_mut, GradBuf, ParamTable};
use ferrotron_engine::Elem;
use std::ops::Range;

/// Where each unit's gradients sit in the windows buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct GradWindows {
    /// The units in the flat order: the embedding, the head (final norm and an untied LM
    /// head), every layer (from the first layer's start to the final norm), and one layer's
    /// length. (ZeRO-3's parameter windows have the same geometry: `zero3::ParamWindows`.)
    pub embed: Range<usize>,
    pub head: Range<usize>,
    pub layers: Range<usize>,
    pub layer_len: usize,
}

impl GradWindows {
    pub fn new(t: &ParamTable) -> Self {
        let start = |l: usize| t.layers.get(l).map_or(t.norm.start, |x| x.ln1.start);
        let layer_len = start(1) - start(0);
        for l in 0..t.layers.len() {
            // The layer window is shared by shape: the table lays layers out back to back.
            assert_eq!(
                start(l),
                start(0) + l * layer_len,
                "layer {l} is not where expected"
            );
        }
        let head_end = if t.lm_head == t.embed {
            t.norm.end
        } else {
            t.lm_head.end
        };
        GradWindows {
            embed: t.embed.clone(),
            head: t.norm.start..head_end,
            layers: start(0)..t.norm.start,
            layer_len,
        }
    }

    /// Elements of the three windows.
    pub fn len(&self) -> usize {
        self.embed.len() + self.head.len() + self.layer_len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The gradients of one micro-batch's backward, in `buf` ([`GradWindows::len`] elements,
    /// on the host or a device).
    pub fn view<'a, G>(&'a self, buf: ViewMut<'a, G>) -> UnitGrads<'a, G> {
        let (embed, rest) = buf.split_at_mut(self.embed.len());
        let (head, layer) = rest.split_at_mut(self.head.len());
        UnitGrads {
            w: self,
            parts: [embed, head, layer],
        }
    }

    /// Zeroes every window (the backward accumulates into them); `dev` zeroes them on a
    /// device.
    pub fn clear<G: Elem>(&self, g: &mut dyn GradBuf<G>, dev: Option<&HostCopy>) {
        let first_layer = self.layers.start..self.layers.start + self.layer_len;
        for r in [&self.embed, &self.head, &first_layer] {
            zero(dev, g.slice_mut(r.clone()));
        }
    }

    /// Zeroes the layer window, for the next layer's backward.
    pub fn clear_layer<G: Elem>(&self, g: &mut dyn GradBuf<G>, dev: Option<&HostCopy>) {
        let layer = self.layers.start..self.layers.start + self.layer_len;
        zero(dev, g.slice_mut(layer));
    }

    /// The range of the layer window that `r` maps to, if `r` is a layer's.
    fn in_layer(&self, r: &Range<usize>) -> Option<Range<usize>> {
        if !self.layers.contains(&r.start) {
            return None;
        }
        let at = (r.start - self.layers.start) % self.layer_len;
        (at + r.len() <= self.layer_len).then_some(at..at + r.len())
    }
}

/// The windows as the backward addresses them (by parameter range).
pub struct UnitGrads<'a, G> {
    w: &'a GradWindows,
    /// Embedding, head, layer.
    parts: [ViewMut<'a, G>; 3],
}

impl<G> UnitGrads<'_, G> {
    fn find(&self, r: &Range<usize>) -> (usize, Range<usize>) {
        let within = |u: &Range<usize>| {
            (r.start >= u.start && r.end <= u.end).then(|| r.start - u.start..r.end - u.start)
        };
        if let Some(x) = within(&self.w.embed) {
            return (0, x);
        }
        if let Some(x) = within(&self.w.head) {
            return (1, x);
        }
        match self.w.in_layer(r) {
            Some(x) => (2, x),
            None => panic!("gradients {r:?} are in none of ZeRO-2's windows"),
        }
    }
}

impl<G> GradBuf<G> for UnitGrads<'_, G> {
    fn slice(&self, r: Range<usize>) -> View<'_, G> {
        let (i, r) = self.find(&r);
        self.parts[i].as_view().slice(r)
    }
    fn slice_mut(&mut self, r: Range<usize>) -> ViewMut<'_, G> {
        let (i, r) = self.find(&r);
        self.parts[i].rb().slice_mut(r)
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (ViewMut<'_, G>, ViewMut<'_, G>) {
        let ((i, a), (j, b)) = (self.find(&a), self.find(&b));
        assert_eq!(i, j, "a weight and its bias live in one window");
        two_mut(self.parts[i].rb(), a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_engine::model::LlamaConfig;

    #[test]
    fn every_layer_shares_one_window_and_the_untied_head_sits_with_the_norm() {
        let c = LlamaConfig {
            hidden: 16,
            intermediate: 32,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            layers: 3,
            vocab: 40,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            tie_embeddings: false,
            qkv_bias: true,
            max_pos: 16,
            moe: None,
        };
        let t = ParamTable::new(&c);
        let w = GradWindows::new(&t);
        let per_layer: usize = t.layers[0].ranges().map(|r| r.len()).sum();
        assert_eq!(
            w.len(),
            t.embed.len() + t.norm.len() + t.lm_head.len() + per_layer
        );
        let mut buf = vec![0.0f32; w.len()];
        let mut v = w.view(ferrotron_engine::kernels::AsViewMut::view_mut(&mut buf));
        // The same tensor of two layers is the same memory.
        v.slice_mut(t.layers[0].wq.clone()).host_mut()[0] = 1.0;
        assert_eq!(v.slice(t.layers[1].wq.clone()).host()[0], 1.0);
        v.slice_mut(t.lm_head.clone()).host_mut()[0] = 2.0;
        assert_eq!(buf[t.embed.len() + t.norm.len()], 2.0);
    }
}
