//! Mixtral's sparse MLP (HF `MixtralSparseMoeBlock`, Jiang et al. 2024), in place of the dense
//! gate/up/down of a Llama layer:
//!
//! ```text
//! ln2_out ─ router (f32 logits [N, E]) ─ softmax, top-k, renormalise ─ weights, experts [N, k]
//! ln2_out ─ permute (copies grouped by expert) ─ expert_in [N·k, C]
//! per expert e, on its block of rows: gate = x·W1ᵀ, up = x·W3ᵀ, h = silu(gate)·up, y = h·W2ᵀ
//! out[token] = Σ_j weight_j · y[row_j]  (+ resid_mid)
//! ```
//!
//! The training loss adds `router_aux_loss_coef` times Switch Transformer's load-balancing
//! loss (Fedus et al. 2021, eqs. 4–6, as transformers' `load_balancing_loss_func` computes it
//! over all layers of the batch): `E · Σ_e f_e · P_e`, `f_e` the share of routed copies sent to
//! expert e and `P_e` its mean router probability, both over all layers' tokens. Its gradient
//! reaches each layer's router through `P` only (`f` comes from a top-k). Each micro-batch's
//! term is weighted by its share of the step's targets, so a step's loss is the mean over its
//! micro-batches, as gradient accumulation averages transformers' per-batch loss.

use super::activations::{GradScratch, LayerActs, LossSum};
use super::buffers::{Buf, BufName, BufferPool};
use super::grad_buf::GradBuf;
use super::llama::Llama;
use super::param_buf::ParamBuf;
use super::params::MoeIdx;
use crate::dtype::Elem;
use crate::kernels::{Accum, Kernels, MatmulShape, RouteShape};
use ferrotron_plan::tensors::{Edge, LayerTensor as T};
use std::ops::Range;
use std::sync::Mutex;

/// The load-balancing statistics of the micro-batch in flight: Σ_n p per expert, the routed
/// copies per expert, and (set by the loss) the loss's gradient per router probability. One
/// micro-batch's forward and backward run in turn on a rank (pipeline stages, which would
/// interleave them, refuse MoE models).
#[derive(Debug, Default)]
pub struct RouterLoad(Mutex<LoadState>);

#[derive(Clone, Debug, Default)]
struct LoadState {
    /// `[2E]`: Σp, then counts, over every MoE layer's tokens so far.
    load: Vec<f32>,
    /// Rows summed into `load` (layers × tokens).
    rows: usize,
    /// `[E]`: d(scaled loss)/d p for every token's probability of expert e.
    aux_dp: Vec<f32>,
}

impl Clone for RouterLoad {
    fn clone(&self) -> Self {
        RouterLoad(Mutex::new(self.state().clone()))
    }
}

impl RouterLoad {
    fn state(&self) -> std::sync::MutexGuard<'_, LoadState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Rows of each expert in the grouped layout: expert e's block is `rows[e]`.
fn expert_blocks(
    index: &[u32],
    experts: usize,
) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let mut start = 0;
    (0..experts).map(move |e| {
        let n = index.iter().filter(|&&x| x as usize == e).count();
        start += n;
        (e, start - n..start)
    })
}

impl Llama {
    fn route(&self, tokens: usize, width: usize) -> RouteShape {
        let m = self.config.moe.expect("a MoE model");
        RouteShape {
            tokens,
            experts: m.experts,
            top_k: m.top_k,
            width,
            norm_topk: m.norm_topk,
        }
    }

    /// Starts a micro-batch's load-balancing statistics (at its embedding).
    pub(super) fn reset_router_load(&self) {
        if let Some(m) = self.config.moe {
            let mut s = self.router_load.state();
            s.load.clear();
            s.load.resize(2 * m.experts, 0.0);
            s.rows = 0;
        }
    }

    /// The sparse MLP's forward from `x2` (= ln2_out, `[N, C]`) into `a`'s router and expert
    /// tensors; with `output`, the next residual `resid_mid + Σ_j weight_j·expert_j(x2)`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_forward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        i: usize,
        n: usize,
        x2: &[S],
        a: &mut LayerActs<S>,
        output: bool,
    ) -> Option<Buf<S>> {
        let (c, f) = (self.config.hidden, self.config.intermediate);
        let moe = self.params.layers[i].moe.as_ref().expect("a MoE layer");
        let e = moe.experts.len();
        let name = |t| self.slot(i, t);
        a.router_logits = self.buf(pool, name(T::RouterLogits), n);
        k.head_forward(
            lin(n, c, e),
            x2,
            &params[moe.router.clone()],
            &mut a.router_logits,
        );
        a.router_weights = self.buf(pool, name(T::RouterWeights), n);
        a.router_index = self.buf(pool, name(T::RouterIndex), n);
        {
            let mut s = self.router_load.state();
            s.rows += n;
            k.router_forward(
                self.route(n, c),
                &a.router_logits,
                &mut a.router_weights,
                &mut a.router_index,
                &mut s.load,
            );
        }
        a.expert_in = self.buf(pool, name(T::ExpertIn), n);
        k.permute(self.route(n, c), &a.router_index, x2, &mut a.expert_in);
        a.gate = self.buf(pool, name(T::Gate), n);
        a.up = self.buf(pool, name(T::Up), n);
        for (x, rows) in expert_blocks(&a.router_index, e).filter(|(_, r)| !r.is_empty()) {
            let (w, xin) = (&moe.experts[x], &a.expert_in[span(&rows, c)]);
            let s = lin(rows.len(), c, f);
            let gate = &mut a.gate[span(&rows, f)];
            k.matmul_forward(
                s,
                xin,
                &params[w.gate.clone()],
                None,
                gate,
                Accum::Overwrite,
            );
            let up = &mut a.up[span(&rows, f)];
            k.matmul_forward(s, xin, &params[w.up.clone()], None, up, Accum::Overwrite);
        }
        a.swiglu = self.buf(pool, name(T::Swiglu), n);
        k.swiglu_forward(&a.gate, &a.up, &mut a.swiglu);
        if !output {
            return None;
        }
        let ys = BufName::Edge(Edge::ExpertRows);
        let mut y = self.buf(pool, ys, n);
        self.experts_down(k, params, moe, &a.router_index, &a.swiglu, &mut y);
        let mut out = self.buf(pool, self.output_name(i), n);
        let (weights, index) = (Some(&a.router_weights[..]), &a.router_index);
        k.unpermute(
            self.route(n, c),
            index,
            weights,
            &y,
            &mut out,
            Accum::Overwrite,
        );
        k.add_inplace(&mut out, &a.resid_mid);
        pool.free(ys, y);
        Some(out)
    }

    /// `y = h·W2ᵀ`, expert by expert.
    fn experts_down<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        params: &dyn ParamBuf<S>,
        moe: &MoeIdx,
        index: &[u32],
        h: &[S],
        y: &mut [S],
    ) {
        let (c, f) = (self.config.hidden, self.config.intermediate);
        for (x, rows) in expert_blocks(index, moe.experts.len()).filter(|(_, r)| !r.is_empty()) {
            let w2 = &params[moe.experts[x].down.clone()];
            let (hx, yx) = (&h[span(&rows, f)], &mut y[span(&rows, c)]);
            k.matmul_forward(lin(rows.len(), f, c), hx, w2, None, yx, Accum::Overwrite);
        }
    }

    /// The load-balancing term of a micro-batch of `tokens` tokens, added to its loss sum
    /// weighted by its targets (`loss.count`), and its gradient per router probability for the
    /// backward, scaled as the cross-entropy's (`loss_scale / num_target_tokens` per target).
    pub(super) fn router_loss(
        &self,
        loss: LossSum,
        num_target_tokens: usize,
        loss_scale: f32,
    ) -> LossSum {
        let Some(m) = self.config.moe else {
            return loss;
        };
        let mut s = self.router_load.state();
        let e = m.experts;
        let rows = s.rows.max(1) as f64;
        let (p, count) = s.load.split_at(e);
        // E · Σ_e (count_e / rows) · (Σp_e / rows).
        let aux: f64 = e as f64
            * p.iter()
                .zip(count)
                .map(|(&p, &c)| c as f64 / rows * (p as f64 / rows))
                .sum::<f64>();
        let coef = m.aux_loss_coef as f64;
        let share = match num_target_tokens {
            0 => 0.0,
            t => loss.count as f64 / t as f64,
        };
        // d(coef·share·aux)/d p_{row, e} = coef·share·E·count_e / rows².
        let g = coef * share * e as f64 / (rows * rows) * loss_scale as f64;
        let aux_dp: Vec<f32> = count.iter().map(|&c| (g * c as f64) as f32).collect();
        s.aux_dp = aux_dp;
        LossSum {
            sum: loss.sum + coef * aux * loss.count as f64,
            count: loss.count,
        }
    }

    /// The sparse MLP's backward. On entry `sc.resid` = d(layer output); on exit `sc.ln_out`
    /// holds d(ln2_out) and the router's and experts' gradients are accumulated.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        grads: &mut dyn GradBuf<G>,
        i: usize,
        n: usize,
        a: &mut LayerActs<S>,
        sc: &mut GradScratch<S>,
    ) {
        let (c, f) = (self.config.hidden, self.config.intermediate);
        let moe = self.params.layers[i].moe.as_ref().expect("a MoE layer");
        let e = moe.experts.len();
        let name = |t| self.slot(i, t);
        let index = std::mem::take(&mut a.router_index);
        let blocks = || expert_blocks(&index, e).filter(|(_, r)| !r.is_empty());
        // d y (unweighted) per routed row, then d h = d y·W2 per expert.
        k.permute(self.route(n, c), &index, &sc.resid, &mut sc.rows);
        for (x, rows) in blocks() {
            let w2 = &params[moe.experts[x].down.clone()];
            let (dy, dh) = (&sc.rows[span(&rows, c)], &mut sc.swiglu[span(&rows, f)]);
            k.matmul_backward_input(lin(rows.len(), f, c), dy, w2, dh, Accum::Overwrite);
        }
        // d weight_j = ⟨d out, y_j⟩ = ⟨d y·W2, h_j⟩: y itself is not kept.
        k.row_dot(
            self.route(n, f),
            &index,
            &sc.swiglu,
            &a.swiglu,
            &mut sc.router_weights,
        );
        // The weights scale the rows' gradients from here on.
        let w = &a.router_weights;
        k.scale_rows(self.route(n, c), &index, w, &mut sc.rows);
        k.scale_rows(self.route(n, f), &index, w, &mut sc.swiglu);
        for (x, rows) in blocks() {
            let dw2 = &mut grads[moe.experts[x].down.clone()];
            let (dy, h) = (&sc.rows[span(&rows, c)], &a.swiglu[span(&rows, f)]);
            k.matmul_backward_weight(lin(rows.len(), f, c), dy, h, dw2, None);
        }
        pool.free(name(T::Swiglu), std::mem::take(&mut a.swiglu));
        k.swiglu_backward(&sc.swiglu, &a.gate, &a.up, &mut sc.gate, &mut sc.up);
        pool.free(name(T::Gate), std::mem::take(&mut a.gate));
        pool.free(name(T::Up), std::mem::take(&mut a.up));
        for (x, rows) in blocks() {
            let ex = &moe.experts[x];
            let s = lin(rows.len(), c, f);
            let xin = &a.expert_in[span(&rows, c)];
            let (dg, du) = (&sc.gate[span(&rows, f)], &sc.up[span(&rows, f)]);
            k.matmul_backward_weight(s, dg, xin, &mut grads[ex.gate.clone()], None);
            k.matmul_backward_weight(s, du, xin, &mut grads[ex.up.clone()], None);
            let dx = &mut sc.rows[span(&rows, c)];
            k.matmul_backward_input(s, dg, &params[ex.gate.clone()], dx, Accum::Overwrite);
            k.matmul_backward_input(s, du, &params[ex.up.clone()], dx, Accum::Add);
        }
        pool.free(name(T::ExpertIn), std::mem::take(&mut a.expert_in));
        // The router: d logits from d weights and the load-balancing term, then its weight
        // and input gradients; the routed copies' gradients are summed onto its input's.
        let route = self.route(n, c);
        let (logits, dw) = (&a.router_logits, &sc.router_weights);
        let aux_dp = &self.router_load.state().aux_dp;
        k.router_backward(route, logits, &index, dw, aux_dp, &mut sc.router_logits);
        let router = moe.router.clone();
        k.head_backward_weight(
            lin(n, c, e),
            &sc.router_logits,
            &a.ln2_out,
            &mut grads[router.clone()],
        );
        k.head_backward_input(
            lin(n, c, e),
            &sc.router_logits,
            &params[router],
            &mut sc.ln_out,
        );
        k.unpermute(route, &index, None, &sc.rows, &mut sc.ln_out, Accum::Add);
        pool.free(name(T::RouterLogits), std::mem::take(&mut a.router_logits));
        pool.free(
            name(T::RouterWeights),
            std::mem::take(&mut a.router_weights),
        );
        pool.free(name(T::RouterIndex), index);
    }
}

fn lin(n: usize, in_features: usize, out_features: usize) -> MatmulShape {
    MatmulShape {
        n,
        in_features,
        out_features,
    }
}

/// The elements of `rows` in a row-major buffer of width `w`.
fn span(rows: &Range<usize>, w: usize) -> Range<usize> {
    rows.start * w..rows.end * w
}
