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
use super::context_parallel::zero;
use super::expert_parallel::{to_arrival_order, to_expert_major, Arrivals};
use super::grad_buf::GradBuf;
use super::llama::{shared_input_grad, Llama};
use super::param_buf::ParamBuf;
use super::params::MoeIdx;
use crate::dtype::Elem;
use crate::kernels::host_copy::read_u32;
use crate::kernels::{
    Accum, AsView, AsViewMut, DeviceBuf, HostCopy, Kernels, MatmulShape, RouteShape, View, ViewMut,
    DROPPED,
};
use ferrotron_plan::tensors::{Edge, LayerTensor as T};
use std::ops::Range;
use std::sync::{Arc, Mutex};

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
    /// When the model's tensors live on a device ([`Llama::moe_on_device`]).
    device: Option<OnDevice>,
}

/// A device's copies, and the device buffer its router kernels are handed the statistics in
/// (`[3E]`: `load`, then `aux_dp`; the plan's `comm.moe.router_stats`). They stay on the host
/// between kernels (the loss reads them there, context parallelism sums them there): each
/// kernel gets them uploaded and, for the forward's sums, downloaded after it, so the
/// statistics are summed in the host's order, to its bits.
#[derive(Clone)]
struct OnDevice {
    copy: HostCopy,
    stats: Arc<Mutex<DeviceBuf<f32>>>,
}

impl std::fmt::Debug for OnDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OnDevice {{ {:?} }}", self.copy)
    }
}

fn lock<X>(m: &Mutex<X>) -> std::sync::MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Clone for RouterLoad {
    fn clone(&self) -> Self {
        RouterLoad(Mutex::new(self.state().clone()))
    }
}

impl RouterLoad {
    fn state(&self) -> std::sync::MutexGuard<'_, LoadState> {
        lock(&self.0)
    }
}

/// The rows this rank's experts multiply, expert by expert: `(expert, rows)` blocks of the
/// expert-major routed buffers, and `arrivals` under expert parallelism. Made afresh for every
/// layer's forward and backward from the router's choices, into the containers of the last
/// one (`Llama::spares`: [`Llama::expert_rows`] takes them, [`Llama::done_with`] gives them
/// back), so that routing allocates nothing after the first micro-batch.
#[derive(Default)]
struct ExpertRows {
    /// The router's choices, on the host (read from a device's memory there).
    index: Vec<u32>,
    /// This rank's copies per expert (every expert of the model).
    counts: Vec<usize>,
    /// This rank's routed copies (its tokens' copies that no capacity dropped).
    own: usize,
    blocks: Vec<(usize, Range<usize>)>,
    rows: usize,
    arrivals: Option<Arrivals>,
}

/// Copies per expert (the dropped ones are no expert's), into `counts`.
fn expert_counts(index: &[u32], experts: usize, counts: &mut Vec<usize>) {
    counts.clear();
    counts.resize(experts, 0);
    for &x in index.iter().filter(|&&x| x & DROPPED == 0) {
        counts[x as usize] += 1;
    }
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
            capacity: self.expert_capacity(tokens),
        }
    }

    /// With a capacity factor `cf`, the most copies of `tokens` tokens each expert takes:
    /// ⌈cf · tokens · top_k / E⌉ (Fedus et al. 2021, eq. 3: "expert capacity"), the planner's
    /// `ferrotron_plan::activations::expert_capacity`.
    pub fn expert_capacity(&self, tokens: usize) -> Option<usize> {
        let m = self.config.moe?;
        let cf = self.capacity_factor?;
        Some(ferrotron_plan::activations::expert_capacity(
            cf,
            tokens as u64,
            m.top_k as u64,
            m.experts as u64,
        ) as usize)
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

    /// The model's tensors live on the device `copy` copies to and from: its router kernels are
    /// handed the load statistics in a device buffer of `3E` f32 (made here), and its routing
    /// is read back to the host through `copy`. Nothing for a dense model.
    pub fn moe_on_device(&self, copy: HostCopy) -> Result<(), String> {
        let Some(m) = self.config.moe else {
            return Ok(());
        };
        let stats = DeviceBuf::zeros(copy.alloc(), 3 * m.experts)?;
        self.router_load.state().device = Some(OnDevice {
            copy,
            stats: Arc::new(Mutex::new(stats)),
        });
        Ok(())
    }

    /// The device's copies, when the model's tensors live on one.
    fn device_copy(&self) -> Option<HostCopy> {
        let s = self.router_load.state();
        s.device.as_ref().map(|d| d.copy.clone())
    }

    /// Where this rank's expert rows are, from the router's choices (under expert parallelism
    /// after exchanging the counts with the group).
    fn expert_rows(&self, router_index: View<'_, u32>) -> ExpertRows {
        let e = self.config.moe.expect("a MoE model").experts;
        let mut er: ExpertRows = self.spares.take().unwrap_or_default();
        er.index.clear();
        er.index.resize(router_index.len(), 0);
        read_u32(self.device_copy().as_ref(), router_index, &mut er.index);
        expert_counts(&er.index, e, &mut er.counts);
        er.own = er.counts.iter().sum();
        er.blocks.clear();
        match &self.ep {
            None => {
                let mut at = 0;
                er.blocks
                    .extend(er.counts.iter().enumerate().map(|(x, &n)| {
                        at += n;
                        (x, at - n..at)
                    }));
                er.rows = at;
                er.arrivals = None;
            }
            Some(ep) => {
                let mut a = er.arrivals.take().unwrap_or_default();
                ep.arrivals(&er.counts, &mut a);
                let first = ep.local().start;
                let per_expert = a.per_expert.iter().enumerate();
                er.blocks
                    .extend(per_expert.map(|(j, r)| (first + j, r.clone())));
                er.rows = a.rows;
                er.arrivals = Some(a);
            }
        }
        er
    }

    /// Gives `er`'s containers back for the next layer's routing.
    fn done_with(&self, er: ExpertRows) {
        self.spares.give(er);
    }

    /// The copies of `x` (`[N, C]`) this rank's experts take, expert-major, into `rows`: its
    /// own grouped by expert, or (expert parallelism) every rank's for its experts.
    #[allow(clippy::too_many_arguments)]
    fn dispatch<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        n: usize,
        x: View<'_, S>,
        index: View<'_, u32>,
        er: &ExpertRows,
        mut rows: ViewMut<'_, S>,
    ) {
        let c = self.config.hidden;
        let nk = er.own;
        k.permute(self.route(n, c), index, x, rows.rb().slice_mut(..nk * c));
        if let (Some(ep), Some(a)) = (&self.ep, &er.arrivals) {
            let (mut send, mut recv) = self.ep_staging(pool, n);
            let (mine, out) = (rows.as_view().slice(..nk * c), send.view_mut());
            k.widen(mine, out.slice_mut(..nk * c));
            ep.dispatch(send.view(), &er.counts, a, recv.view_mut(), c);
            to_expert_major(k, a, recv.view(), c, c, rows);
            self.free_ep_staging(pool, send, recv);
        }
    }

    /// The inverse of [`Self::dispatch`] for results of `cols` per row: under expert
    /// parallelism each row goes back to its rank, so that `rows` ends up holding this rank's
    /// own copies grouped by expert (without it, they already are).
    fn collect<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        n: usize,
        er: &ExpertRows,
        mut rows: ViewMut<'_, S>,
    ) {
        let c = self.config.hidden;
        if let (Some(ep), Some(a)) = (&self.ep, &er.arrivals) {
            let nk: usize = er.counts.iter().sum();
            let (mut send, mut recv) = self.ep_staging(pool, n);
            to_arrival_order(k, a, rows.as_view(), c, send.view_mut());
            ep.combine(send.view(), &er.counts, a, recv.view_mut(), c);
            let back = recv.view().slice(..nk * c);
            k.narrow(back, rows.rb().slice_mut(..nk * c));
            self.free_ep_staging(pool, send, recv);
        }
    }

    fn ep_staging(&self, pool: &mut dyn BufferPool, n: usize) -> (Buf<f32>, Buf<f32>) {
        let send = self.buf(pool, BufName::Edge(Edge::EpSend), n);
        (send, self.buf(pool, BufName::Edge(Edge::EpRecv), n))
    }

    fn free_ep_staging(&self, pool: &mut dyn BufferPool, send: Buf<f32>, recv: Buf<f32>) {
        pool.free(BufName::Edge(Edge::EpSend), send);
        pool.free(BufName::Edge(Edge::EpRecv), recv);
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
        x2: View<'_, S>,
        a: &mut LayerActs<S>,
        output: bool,
    ) -> Option<Buf<S>> {
        let (c, f) = (self.config.hidden, self.config.intermediate);
        let moe = self.params.layers[i].moe.as_ref().expect("a MoE layer");
        let e = moe.experts.len();
        let name = |t| self.slot(i, t);
        a.router_logits = self.buf(pool, name(T::RouterLogits), n);
        let router = params.slice(moe.router.clone());
        k.head_forward(lin(n, c, e), x2, router, a.router_logits.view_mut());
        a.router_weights = self.buf(pool, name(T::RouterWeights), n);
        a.router_index = self.buf(pool, name(T::RouterIndex), n);
        {
            let mut s = self.router_load.state();
            s.rows += n;
            let LoadState { load, device, .. } = &mut *s;
            let route = self.route(n, c);
            let logits = a.router_logits.view();
            let (w, ix) = (a.router_weights.view_mut(), a.router_index.view_mut());
            match device {
                None => k.router_forward(route, logits, w, ix, load.view_mut()),
                Some(d) => {
                    let mut stats = lock(&d.stats);
                    let mut on = stats.view_mut().slice_mut(..load.len());
                    d.copy.upload(load, on.rb());
                    k.router_forward(route, logits, w, ix, on.rb());
                    d.copy.download(on.as_view(), load);
                }
            }
        }
        let er = self.expert_rows(a.router_index.view());
        // The backend's routing tables are built from the same choices: from this copy.
        k.host_ids(a.router_index.view(), &er.index);
        a.expert_in = self.buf(pool, name(T::ExpertIn), n);
        let index = a.router_index.view();
        self.dispatch(k, pool, n, x2, index, &er, a.expert_in.view_mut());
        a.gate = self.buf(pool, name(T::Gate), n);
        a.up = self.buf(pool, name(T::Up), n);
        for (x, rows) in er.blocks.iter().filter(|(_, r)| !r.is_empty()) {
            let (w, xin) = (&moe.experts[*x], a.expert_in.view().slice(span(rows, c)));
            let s = ragged(rows.len(), c, f);
            let gate = a.gate.view_mut().slice_mut(span(rows, f));
            let wg = params.slice(w.gate.clone());
            k.matmul_forward(s, xin, wg, None, gate, Accum::Overwrite);
            let up = a.up.view_mut().slice_mut(span(rows, f));
            k.matmul_forward(
                s,
                xin,
                params.slice(w.up.clone()),
                None,
                up,
                Accum::Overwrite,
            );
        }
        a.swiglu = self.buf(pool, name(T::Swiglu), n);
        let used = er.rows * f;
        k.swiglu_forward(
            a.gate.view().slice(..used),
            a.up.view().slice(..used),
            a.swiglu.view_mut().slice_mut(..used),
        );
        if !output {
            self.done_with(er);
            return None;
        }
        let ys = BufName::Edge(Edge::ExpertRows);
        let mut y = self.buf(pool, ys, n);
        for (x, rows) in er.blocks.iter().filter(|(_, r)| !r.is_empty()) {
            let w2 = params.slice(moe.experts[*x].down.clone());
            let hx = a.swiglu.view().slice(span(rows, f));
            let yx = y.view_mut().slice_mut(span(rows, c));
            k.matmul_forward(ragged(rows.len(), f, c), hx, w2, None, yx, Accum::Overwrite);
        }
        self.collect(k, pool, n, &er, y.view_mut());
        let mut out = self.buf(pool, self.output_name(i), n);
        let (weights, index) = (Some(a.router_weights.view()), a.router_index.view());
        let nk = er.own;
        let route = self.route(n, c);
        k.unpermute(
            route,
            index,
            weights,
            y.view().slice(..nk * c),
            out.view_mut(),
            Accum::Overwrite,
        );
        k.add_inplace(out.view_mut(), a.resid_mid.view());
        pool.free(ys, y);
        self.done_with(er);
        Some(out)
    }

    /// Rebuilds the routed copies selective recomputation dropped (from the rebuilt ln2_out
    /// and the kept routing; under expert parallelism exchanged again).
    pub(super) fn rebuild_expert_in<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        i: usize,
        n: usize,
        a: &mut LayerActs<S>,
    ) {
        let er = self.expert_rows(a.router_index.view());
        k.host_ids(a.router_index.view(), &er.index);
        a.expert_in = self.buf(pool, self.slot(i, T::ExpertIn), n);
        let (x, index) = (a.ln2_out.view(), a.router_index.view());
        self.dispatch(k, pool, n, x, index, &er, a.expert_in.view_mut());
        self.done_with(er);
    }

    /// Rows of the gated product the experts hold (the rest of the routed buffers' capacity
    /// is unused), for rebuilding it.
    pub(super) fn routed_used(&self, index: View<'_, u32>) -> usize {
        let er = self.expert_rows(index);
        let rows = er.rows;
        self.done_with(er);
        rows * self.config.intermediate
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
        let mut guard = self.router_load.state();
        let s = &mut *guard;
        let e = m.experts;
        // Under context parallelism the ring's ranks hold one micro-batch's tokens between
        // them: its statistics, rows and targets are their sums (every rank then computes the
        // same term, and adds its targets' share of it).
        let mut totals = [s.rows as f32, loss.count as f32];
        if let Some(cp) = &self.cp {
            cp.sum(&mut s.load);
            cp.sum(&mut totals);
        }
        let rows = (totals[0] as f64).max(1.0);
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
            t => totals[1] as f64 / t as f64,
        };
        // d(coef·share·aux)/d p_{row, e} = coef·share·E·count_e / rows².
        let g = coef * share * e as f64 / (rows * rows) * loss_scale as f64;
        s.aux_dp.clear();
        s.aux_dp
            .extend(count.iter().map(|&c| (g * c as f64) as f32));
        LossSum {
            sum: loss.sum + coef * aux * loss.count as f64,
            count: loss.count,
        }
    }

    /// The gradient of each copy's output with respect to its routing weight,
    /// `⟨d out, y⟩ = ⟨d y·W2, h⟩` (`y` is not kept), into `sc.router_weights`; then the rows'
    /// gradients `sc.rows` (d y) and `sc.swiglu` (d h) are scaled by the weights. Under expert
    /// parallelism d y arrives with each copy's weight and the dots go back to the copies' ranks,
    /// all in blocks of rows (device kernels and whole-block copies, nothing row by row).
    #[allow(clippy::too_many_arguments)]
    fn routing_weight_grads<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        params: &dyn ParamBuf<S>,
        moe: &MoeIdx,
        n: usize,
        a: &LayerActs<S>,
        sc: &mut GradScratch<S>,
        er: &ExpertRows,
    ) {
        let (c, f) = (self.config.hidden, self.config.intermediate);
        let index = &a.router_index;
        let nk = er.own;
        let dev = self.device_copy();
        let dev = dev.as_ref();
        // A dropped copy added nothing to the output: its weight's gradient is 0.
        zero(dev, sc.router_weights.view_mut());
        let down = |k: &dyn Kernels<S, G>, sc: &mut GradScratch<S>| {
            for (x, rows) in er.blocks.iter().filter(|(_, r)| !r.is_empty()) {
                let w2 = params.slice(moe.experts[*x].down.clone());
                let dy = sc.rows.view().slice(span(rows, c));
                let dh = sc.swiglu.view_mut().slice_mut(span(rows, f));
                k.matmul_backward_input(ragged(rows.len(), f, c), dy, w2, dh, Accum::Overwrite);
            }
        };
        let rows_in = sc.rows.view_mut().slice_mut(..nk * c);
        k.permute(self.route(n, c), index.view(), sc.resid.view(), rows_in);
        let (Some(ep), Some(arr)) = (&self.ep, &er.arrivals) else {
            down(k, sc);
            let (index, w) = (index.view(), a.router_weights.view());
            k.row_dot(
                self.route(n, f),
                index,
                sc.swiglu.view().slice(..nk * f),
                a.swiglu.view().slice(..nk * f),
                sc.router_weights.view_mut(),
            );
            let rows_c = sc.rows.view_mut().slice_mut(..nk * c);
            k.scale_rows(self.route(n, c), index, w, rows_c);
            let rows_f = sc.swiglu.view_mut().slice_mut(..nk * f);
            k.scale_rows(self.route(n, f), index, w, rows_f);
            return;
        };
        // Each copy's d y goes to its expert's rank with its routing weight: the rows (`c`
        // wide, widened to f32) and then the weights, each exchanged as a block of whole rows,
        // both in the staging buffers' `c + 1` per row.
        let (mut send, mut recv) = self.ep_staging(pool, n);
        let (own, arrived) = (nk * c, arr.rows * c);
        k.widen(
            sc.rows.view().slice(..own),
            send.view_mut().slice_mut(..own),
        );
        let own_w = send.view_mut().slice_mut(own..own + nk);
        k.gather_copies(
            self.route(n, 1),
            index.view(),
            a.router_weights.view(),
            own_w,
        );
        let rows_in = recv.view_mut().slice_mut(..arrived);
        ep.dispatch(send.view().slice(..own), &er.counts, arr, rows_in, c);
        let w_in = recv.view_mut().slice_mut(arrived..arrived + arr.rows);
        ep.dispatch(send.view().slice(own..own + nk), &er.counts, arr, w_in, 1);
        to_expert_major(
            k,
            arr,
            recv.view().slice(..arrived),
            c,
            c,
            sc.rows.view_mut(),
        );
        down(k, sc);
        // Per block of rows from one rank for one expert: the dots go back in arrival order
        // (in `send`, no longer read), and d y and d h are scaled by the arrived weights.
        let weights = recv.view().slice(arrived..arrived + arr.rows);
        for &(arrival, expert, rows) in arr.blocks.iter().filter(|b| b.2 > 0) {
            let (at, w) = (
                expert..expert + rows,
                weights.slice(arrival..arrival + rows),
            );
            k.dot_each_row(
                f,
                sc.swiglu.view().slice(span(&at, f)),
                a.swiglu.view().slice(span(&at, f)),
                send.view_mut().slice_mut(arrival..arrival + rows),
            );
            k.scale_each_row(c, w, sc.rows.view_mut().slice_mut(span(&at, c)));
            k.scale_each_row(f, w, sc.swiglu.view_mut().slice_mut(span(&at, f)));
        }
        let dots = send.view().slice(..arr.rows);
        ep.combine(dots, &er.counts, arr, recv.view_mut().slice_mut(..nk), 1);
        let dw = sc.router_weights.view_mut();
        k.scatter_copies(self.route(n, 1), index.view(), recv.view().slice(..nk), dw);
        self.free_ep_staging(pool, send, recv);
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
        let er = self.expert_rows(a.router_index.view());
        k.host_ids(a.router_index.view(), &er.index);
        self.routing_weight_grads(k, pool, params, moe, n, a, sc, &er);
        let blocks = || er.blocks.iter().filter(|(_, r)| !r.is_empty());
        for (x, rows) in blocks() {
            let dw2 = grads.slice_mut(moe.experts[*x].down.clone());
            let (dy, h) = (
                sc.rows.view().slice(span(rows, c)),
                a.swiglu.view().slice(span(rows, f)),
            );
            k.matmul_backward_weight(ragged(rows.len(), f, c), dy, h, dw2, None);
        }
        pool.free(name(T::Swiglu), std::mem::take(&mut a.swiglu));
        let used = er.rows * f;
        k.swiglu_backward(
            sc.swiglu.view().slice(..used),
            a.gate.view().slice(..used),
            a.up.view().slice(..used),
            sc.gate.view_mut().slice_mut(..used),
            sc.up.view_mut().slice_mut(..used),
        );
        pool.free(name(T::Gate), std::mem::take(&mut a.gate));
        pool.free(name(T::Up), std::mem::take(&mut a.up));
        for (x, rows) in blocks() {
            let ex = &moe.experts[*x];
            let s = ragged(rows.len(), c, f);
            let xin = a.expert_in.view().slice(span(rows, c));
            let (dg, du) = (
                sc.gate.view().slice(span(rows, f)),
                sc.up.view().slice(span(rows, f)),
            );
            k.matmul_backward_weight(s, dg, xin, grads.slice_mut(ex.gate.clone()), None);
            k.matmul_backward_weight(s, du, xin, grads.slice_mut(ex.up.clone()), None);
            let (wg, wu) = (params.slice(ex.gate.clone()), params.slice(ex.up.clone()));
            let dx = sc.rows.view_mut().slice_mut(span(rows, c));
            shared_input_grad(k, &[(s, dg, wg), (s, du, wu)], dx);
        }
        pool.free(name(T::ExpertIn), std::mem::take(&mut a.expert_in));
        // The router: d logits from d weights and the load-balancing term, then its weight
        // and input gradients; the routed copies' gradients are summed onto its input's.
        let index = std::mem::take(&mut a.router_index);
        let route = self.route(n, c);
        {
            let (logits, dw) = (a.router_logits.view(), sc.router_weights.view());
            let s = self.router_load.state();
            let dl = sc.router_logits.view_mut();
            match &s.device {
                None => k.router_backward(route, logits, index.view(), dw, s.aux_dp.view(), dl),
                Some(d) => {
                    let mut stats = lock(&d.stats);
                    let at = 2 * self.config.moe.expect("a MoE model").experts;
                    let mut on = stats.view_mut().slice_mut(at..at + s.aux_dp.len());
                    d.copy.upload(&s.aux_dp, on.rb());
                    k.router_backward(route, logits, index.view(), dw, on.as_view(), dl);
                }
            }
        }
        let router = moe.router.clone();
        let dl = sc.router_logits.view();
        k.head_backward_weight(
            lin(n, c, e),
            dl,
            a.ln2_out.view(),
            grads.slice_mut(router.clone()),
        );
        k.head_backward_input(lin(n, c, e), dl, params.slice(router), sc.ln_out.view_mut());
        self.collect(k, pool, n, &er, sc.rows.view_mut());
        let nk = er.own;
        k.unpermute(
            route,
            index.view(),
            None,
            sc.rows.view().slice(..nk * c),
            sc.ln_out.view_mut(),
            Accum::Add,
        );
        pool.free(name(T::RouterLogits), std::mem::take(&mut a.router_logits));
        pool.free(
            name(T::RouterWeights),
            std::mem::take(&mut a.router_weights),
        );
        pool.free(name(T::RouterIndex), index);
        self.done_with(er);
    }
}

fn lin(n: usize, in_features: usize, out_features: usize) -> MatmulShape {
    MatmulShape {
        n,
        in_features,
        out_features,
        ragged: false,
    }
}

/// An expert's product: its row count changes with the routing.
fn ragged(n: usize, in_features: usize, out_features: usize) -> MatmulShape {
    MatmulShape {
        ragged: true,
        ..lin(n, in_features, out_features)
    }
}

/// The elements of `rows` in a row-major buffer of width `w`.
fn span(rows: &Range<usize>, w: usize) -> Range<usize> {
    rows.start * w..rows.end * w
}
