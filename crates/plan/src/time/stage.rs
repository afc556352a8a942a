//! Per-micro-batch cost of one pipeline stage: its layers' compute and recomputation, the
//! embedding (first stage) or LM head (last stage), and the TP, CP, EP and PP communication of
//! the micro-batch (see the module docs of `time`).

use super::cost::Cost;
use super::layer::{EdgeCost, LayerCost};
use super::overlap;
use super::ring;
use crate::cluster::Link;
use crate::comm::Collective;
use crate::layout::Layout;
use crate::model::ModelSpec;
use crate::recipe::Recipe;

/// Per micro-batch cost of one pipeline stage.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StageMb {
    pub(super) compute: Cost,
    pub(super) recompute: Cost,
    pub(super) backward_s: f64,
    /// Bytes, seconds and seconds on the critical path.
    pub(super) tp: (f64, f64, f64),
    pub(super) cp: (f64, f64, f64),
    /// Bytes, seconds and seconds on the critical path.
    pub(super) ep: (f64, f64, f64),
    /// Bytes, seconds and seconds on the critical path.
    pub(super) pp: (f64, f64, f64),
}

impl StageMb {
    /// Seconds on the critical path per micro-batch.
    pub(super) fn total(&self) -> f64 {
        self.compute.s() + self.recompute.s() + self.tp.2 + self.cp.2 + self.ep.2 + self.pp.2
    }
}

/// What a stage's cost depends on, computed once per step estimate.
pub(super) struct StageInputs<'a> {
    pub(super) lc: &'a LayerCost,
    pub(super) emb: &'a EdgeCost,
    pub(super) head: &'a EdgeCost,
    pub(super) layout: &'a Layout,
    pub(super) recipe: &'a Recipe,
    pub(super) model: &'a ModelSpec,
    /// Bytes of a stored activation element.
    pub(super) st: f64,
    pub(super) tp: TpCosts,
    /// The CP, EP and PP links.
    pub(super) links: (Link, Link, Link),
}

/// The TP collective of a layer's activations (an all-reduce, or under sequence parallelism
/// one member of an all-gather + reduce-scatter pair): seconds and bytes per rank of one, for
/// the embedding's and the head's, and for the layers' (whose all-gathers may be narrower).
#[derive(Debug, Clone, Copy)]
pub(super) struct TpCosts {
    pub(super) coll: Collective,
    pub(super) one: f64,
    pub(super) one_bytes: f64,
    pub(super) layer_one: f64,
    pub(super) layer_one_bytes: f64,
}

impl StageInputs<'_> {
    /// Per micro-batch cost of pipeline stage `stage`.
    pub(super) fn stage_mb(&self, stage: u64) -> StageMb {
        let (lc, emb, head) = (self.lc, self.emb, self.head);
        let (l, r, m, st) = (self.layout, self.recipe, self.model, self.st);
        let TpCosts {
            coll: tp_coll,
            one: tp_one,
            one_bytes: tp_one_bytes,
            layer_one,
            layer_one_bytes,
        } = self.tp;
        let (cp_link, ep_link, pp_link) = self.links;
        let layers_per_stage = l.stage_layer_count(m.layers, stage) as f64;
        let v = l.pp_virtual as f64;
        let mut s = StageMb::default();
        let k = layers_per_stage;
        s.compute = (lc.fwd + lc.bwd) * k;
        s.recompute = lc.recompute * k;
        s.backward_s = (lc.bwd + lc.recompute).s() * k;
        let mut tp_count = (lc.comm.tp_fwd + lc.comm.tp_bwd) * k;
        if lc.recompute_comm {
            tp_count += lc.comm.tp_replay * k;
        }
        // Norm gradients all-reduced once per step, or after every micro-batch when ZeRO-2/3
        // reduce each micro-batch's gradients (this is one micro-batch's share).
        let per_step = if l.zero >= 2 { 1.0 } else { r.grad_acc as f64 };
        // The layers' own collectives, which `--tp-overlap` hides under their GEMMs; the
        // embedding's and the head's stay exposed (Megatron-LM's output layer is not a
        // Transformer Engine module, so its userbuffers overlap does not cover it).
        let layer_tp_count = tp_count;
        let mut norm_elems = lc.comm.tp_norm_elems * k;
        let mut tp_extra = 0.0;
        if stage == 0 {
            s.compute += emb.fwd + emb.bwd;
            s.backward_s += emb.bwd.s();
            tp_count += emb.tp_collectives;
        }
        if stage == l.pp - 1 {
            s.compute += head.fwd + head.bwd;
            s.backward_s += head.bwd.s();
            tp_count += head.tp_collectives;
            tp_extra += head.tp_extra_bytes;
            // The final norm's, with the layers'.
            if lc.comm.tp_norm_elems > 0.0 {
                norm_elems += lc.comm.tp_norm_elems / 2.0;
            }
        }
        if norm_elems > 0.0 {
            let all_reduce =
                crate::comm::bytes_per_rank(Collective::AllReduce, 4.0 * norm_elems, l.tp);
            tp_extra += all_reduce / per_step;
        }
        if l.tp > 1 {
            // With SP, each "collective" above is one all-gather or one reduce-scatter pair
            // member; an all-reduce without SP moves as much as the pair.
            let per = if tp_coll == Collective::AllGather {
                2.0
            } else {
                1.0
            };
            let edges = tp_count - layer_tp_count;
            let all = (layer_tp_count * layer_one + edges * tp_one) * per;
            // Megatron-LM's `--tp-comm-overlap` splits each all-gather and reduce-scatter into
            // chunks pipelined with the GEMM that consumes or produces it (Transformer
            // Engine's userbuffers); the collectives then cost what `overlap::exposed` says
            // against the layers' compute, the rest stays exposed.
            let exposed = if l.tp_overlap {
                let layers = layer_tp_count * layer_one * per;
                let compute = (lc.fwd + lc.bwd + lc.recompute).s() * k;
                overlap::exposed(layers, compute) + (all - layers)
            } else {
                all
            };
            let bytes = (layer_tp_count * layer_one_bytes + edges * tp_one_bytes) * per;
            s.tp = (bytes + tp_extra, all, exposed);
        }
        if l.cp > 1 {
            let step = crate::comm::time(Collective::SendRecv, lc.comm.cp_bytes, 2, cp_link);
            let passes_f = if lc.recompute_comm { 2.0 } else { 1.0 };
            // Each block's exchange runs under one block's attention (`ring.rs`); the backward
            // passes each block with its gradients, and ferrotron's brings the gradients home
            // with one more pass.
            let blocks = lc.comm.cp_steps + 1.0;
            let (rot, home) = (lc.comm.cp_rotation, lc.comm.cp_home);
            let (ef, eb) = ring::exposed(rot, step, blocks, lc.attn_fwd_s, lc.attn_bwd_s, home);
            let (pf, pb) = ring::passes(rot, blocks, home);
            let passes = passes_f * pf + pb;
            let bytes = passes * lc.comm.cp_bytes;
            s.cp = (bytes * k, passes * step * k, (passes_f * ef + eb) * k);
        }
        if lc.comm.ep_fwd > 0.0 {
            let one = crate::comm::time(Collective::AllToAll, lc.comm.ep_bytes, l.ep, ep_link);
            let b1 = crate::comm::bytes_per_rank(Collective::AllToAll, lc.comm.ep_bytes, l.ep);
            let count = lc.comm.ep_fwd * if lc.recompute_comm { 3.0 } else { 2.0 };
            let per_layer = count * one;
            // Exposed, as Megatron-LM runs them by default; overlapped (`--ep-overlap`), as
            // DeepSeek-V3's DualPipe runs a micro-batch's dispatch and combine under another
            // micro-batch's forward and backward (DeepSeek-AI 2024, arXiv 2412.19437
            // §3.2.1), they cost what `overlap::exposed` says against the layer's compute.
            let exposed = if l.ep_overlap {
                overlap::exposed(per_layer, (lc.fwd + lc.bwd + lc.recompute).s())
            } else {
                per_layer
            };
            s.ep = (count * b1 * k, per_layer * k, exposed * k);
        }
        if l.pp > 1 {
            // One activation send forward and one gradient send backward per model chunk,
            // split over the tp ranks (Narayanan et al. 2021 §4.1, scatter/gather).
            let bytes = (r.mbs * r.seq / l.cp) as f64 * m.hidden as f64 * st / l.tp as f64;
            let one = crate::comm::time(Collective::SendRecv, bytes, 2, pp_link);
            let all = 2.0 * v * one;
            // Megatron-LM's `--overlap-p2p-communication` posts each chunk's send and receive
            // before the next chunk's forward or backward and waits after it, so they cost
            // what `overlap::exposed` says against the stage's compute.
            let exposed = if l.pp_overlap {
                overlap::exposed(all, (s.compute + s.recompute).s())
            } else {
                all
            };
            s.pp = (2.0 * v * bytes, all, exposed);
        }
        s
    }
}
