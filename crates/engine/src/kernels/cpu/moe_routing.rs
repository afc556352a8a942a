//! Mixture-of-experts routing (Mixtral, Jiang et al. 2024; HF `MixtralSparseMoeBlock`): the
//! router's softmax and top-k, the grouping of each token's k copies by expert so that every
//! expert multiplies one contiguous block of rows, the weighted sum back per token, and their
//! gradients. The load-balancing loss is Switch Transformer's (Fedus et al. 2021, eqs. 4–6).
//!
//! The routed rows' layout is [`crate::kernels::routed_rows`].

use crate::dtype::Elem;
use crate::kernels::{Accum, RouteShape, DROPPED};

/// The most experts a router may have (the per-call capacity counts live on the stack).
pub const MAX_EXPERTS: usize = 1024;
/// The most experts a token may be routed to.
const MAX_TOP_K: usize = 64;

use crate::kernels::routed_rows as grouped;

/// Softmax of one row of router logits into `p` (f32, max-subtracted).
fn softmax_row(logits: &[f32], p: &mut [f32]) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut sum = 0.0f32;
    for (pe, &l) in p.iter_mut().zip(logits) {
        *pe = (l - max).exp();
        sum += *pe;
    }
    p.iter_mut().for_each(|pe| *pe /= sum);
}

/// Per token: `p = softmax(logits)`; its `k` largest (ties to the lower expert), largest
/// first, into `index`; their probabilities into `weights`, divided by their sum when
/// `s.norm_topk`. `load` `[2E]` accumulates Σ_n p (first E) and the count of copies routed
/// to each expert (last E), the load-balancing loss's two factors (counted before any copy is
/// dropped: the router's choices). With `s.capacity`, a copy whose expert already took that
/// many of these tokens' copies is marked [`DROPPED`] (token order: "drop by position").
pub fn router_forward(
    s: RouteShape,
    logits: &[f32],
    weights: &mut [f32],
    index: &mut [u32],
    load: &mut [f32],
) {
    let (e, k) = (s.experts, s.top_k);
    assert_eq!(logits.len(), s.tokens * e, "router logits len");
    assert!(weights.len() == s.tokens * k && index.len() == s.tokens * k);
    assert_eq!(load.len(), 2 * e, "router load len");
    assert!(e <= MAX_EXPERTS, "{e} experts: at most {MAX_EXPERTS}");
    let mut taken = [0usize; MAX_EXPERTS];
    // The layer keeps the logits; the backward recomputes the softmax from them.
    for n in 0..s.tokens {
        let row = &logits[n * e..(n + 1) * e];
        let (w, idx) = (
            &mut weights[n * k..(n + 1) * k],
            &mut index[n * k..(n + 1) * k],
        );
        let mut chosen_sum = 0.0f32;
        for j in 0..k {
            let mut best = usize::MAX;
            let mut best_l = f32::NEG_INFINITY;
            for (x, &l) in row.iter().enumerate() {
                if !idx[..j].contains(&(x as u32)) && (best == usize::MAX || l > best_l) {
                    best = x;
                    best_l = l;
                }
            }
            idx[j] = best as u32;
        }
        // Probabilities of the chosen, and every expert's into `load`.
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum: f32 = row.iter().map(|&l| (l - max).exp()).sum();
        for (x, &l) in row.iter().enumerate() {
            load[x] += (l - max).exp() / sum;
        }
        for j in 0..k {
            let x = idx[j] as usize;
            w[j] = (row[x] - max).exp() / sum;
            chosen_sum += w[j];
            load[e + x] += 1.0;
            match s.capacity {
                Some(cap) if taken[x] >= cap => idx[j] |= DROPPED,
                _ => taken[x] += 1,
            }
        }
        if s.norm_topk {
            w.iter_mut().for_each(|x| *x /= chosen_sum);
        }
    }
}

/// `dlogits` from the gradients of the routing weights `dweights` and of the probabilities
/// through the load-balancing loss, `aux_dp` `[E]` (the same for every token):
/// `dp = aux_dp + scatter(dweights)` (through the renormalisation when `s.norm_topk`:
/// `dp_j = (dw_j − Σ_i w_i·dw_i) / Σ_sel p`), then the softmax's backward
/// `dlogit = p ⊙ (dp − p·dp)`. A dropped copy's choice counts (its `dweights` entry is 0: it
/// added nothing to the output).
pub fn router_backward(
    s: RouteShape,
    logits: &[f32],
    index: &[u32],
    dweights: &[f32],
    aux_dp: &[f32],
    dlogits: &mut [f32],
) {
    let (e, k) = (s.experts, s.top_k);
    assert!(logits.len() == s.tokens * e && dlogits.len() == s.tokens * e);
    assert!(index.len() == s.tokens * k && dweights.len() == s.tokens * k);
    assert_eq!(aux_dp.len(), e, "aux gradient len");
    for n in 0..s.tokens {
        let (row, dl) = (
            &logits[n * e..(n + 1) * e],
            &mut dlogits[n * e..(n + 1) * e],
        );
        let (idx, dw) = (&index[n * k..(n + 1) * k], &dweights[n * k..(n + 1) * k]);
        let mut choice = [0u32; MAX_TOP_K];
        assert!(k <= MAX_TOP_K, "top-{k}: at most {MAX_TOP_K}");
        for (c, &x) in choice.iter_mut().zip(idx) {
            *c = x & !DROPPED;
        }
        let idx = &choice[..k];
        // `dl` holds p while dp is built in the caller-visible order below.
        softmax_row(row, dl);
        let chosen: f32 = idx.iter().map(|&x| dl[x as usize]).sum();
        let wdw: f32 = idx
            .iter()
            .zip(dw)
            .map(|(&x, &d)| dl[x as usize] / chosen * d)
            .sum();
        let dp = |x: usize| -> f32 {
            let routed: f32 = idx
                .iter()
                .zip(dw)
                .filter(|&(&i, _)| i as usize == x)
                .map(|(_, &d)| match s.norm_topk {
                    true => (d - wdw) / chosen,
                    false => d,
                })
                .sum();
            aux_dp[x] + routed
        };
        let dot: f32 = (0..e).map(|x| dl[x] * dp(x)).sum();
        for (x, d) in dl.iter_mut().enumerate() {
            *d *= dp(x) - dot;
        }
    }
}

/// `rows[row] = x[token]` for every routed copy (the dispatch; its backward is
/// [`unpermute`] without weights).
pub fn permute<S: Elem>(s: RouteShape, index: &[u32], x: &[S], rows: &mut [S]) {
    let (w, k) = (s.width, s.top_k);
    assert!(x.len() == s.tokens * w && rows.len() <= s.tokens * k * w);
    for (r, c) in grouped(index, s.experts) {
        let n = c / k;
        rows[r * w..(r + 1) * w].copy_from_slice(&x[n * w..(n + 1) * w]);
    }
}

/// `y[token] (=|+=) Σ_j weight_j · rows[row_j]` (the combine; weights of 1 without
/// `weights`), added in grouped-row order, i.e. expert by expert, as HF's `index_add_` loop.
pub fn unpermute<S: Elem>(
    s: RouteShape,
    index: &[u32],
    weights: Option<&[f32]>,
    rows: &[S],
    y: &mut [S],
    accum: Accum,
) {
    let (w, k) = (s.width, s.top_k);
    assert!(y.len() == s.tokens * w && rows.len() <= s.tokens * k * w);
    if accum == Accum::Overwrite {
        y.fill(S::from_f32(0.0));
    }
    for (r, c) in grouped(index, s.experts) {
        let scale = weights.map_or(1.0, |wt| wt[c]);
        let n = c / k;
        for (o, v) in y[n * w..(n + 1) * w]
            .iter_mut()
            .zip(&rows[r * w..(r + 1) * w])
        {
            *o = S::from_f32(o.to_f32() + scale * v.to_f32());
        }
    }
}

/// `rows[row_c] *= weights[c]` (rows of `s.width`).
pub fn scale_rows<S: Elem>(s: RouteShape, index: &[u32], weights: &[f32], rows: &mut [S]) {
    let w = s.width;
    assert!(rows.len() <= s.tokens * s.top_k * w, "routed rows len");
    for (r, c) in grouped(index, s.experts) {
        scale_row(&mut rows[r * w..(r + 1) * w], weights[c]);
    }
}

/// `out[c] = ⟨a[row_c], b[row_c]⟩` in f32 (rows of `s.width`).
pub fn row_dot<S: Elem>(s: RouteShape, index: &[u32], a: &[S], b: &[S], out: &mut [f32]) {
    let w = s.width;
    assert!(a.len() <= s.tokens * s.top_k * w && b.len() == a.len());
    for (r, c) in grouped(index, s.experts) {
        out[c] = dot(&a[r * w..(r + 1) * w], &b[r * w..(r + 1) * w]);
    }
}

/// `rows[r] = values[c]`: each routed copy's value in row order.
pub fn gather_copies(s: RouteShape, index: &[u32], values: &[f32], rows: &mut [f32]) {
    for (r, c) in grouped(index, s.experts) {
        rows[r] = values[c];
    }
}

/// `values[c] = rows[r]`, the inverse of [`gather_copies`].
pub fn scatter_copies(s: RouteShape, index: &[u32], rows: &[f32], values: &mut [f32]) {
    for (r, c) in grouped(index, s.experts) {
        values[c] = rows[r];
    }
}

/// `rows[r] *= weights[r]` for rows of `width` in order ([`scale_rows`]'s arithmetic).
pub fn scale_each_row<S: Elem>(width: usize, weights: &[f32], rows: &mut [S]) {
    assert!(
        rows.len() <= weights.len() * width,
        "scale_each_row: more rows than weights"
    );
    for (row, &w) in rows.chunks_exact_mut(width).zip(weights) {
        scale_row(row, w);
    }
}

/// `out[r] = ⟨a[r], b[r]⟩` for rows of `width` in order ([`row_dot`]'s arithmetic).
pub fn dot_each_row<S: Elem>(width: usize, a: &[S], b: &[S], out: &mut [f32]) {
    assert!(
        a.len() == b.len() && a.len() == out.len() * width,
        "dot_each_row: rows"
    );
    let rows = a.chunks_exact(width).zip(b.chunks_exact(width));
    for (o, (x, y)) in out.iter_mut().zip(rows) {
        *o = dot(x, y);
    }
}

/// `row *= w`, each product rounded once into `S`.
fn scale_row<S: Elem>(row: &mut [S], w: f32) {
    for v in row {
        *v = S::from_f32(v.to_f32() * w);
    }
}

/// `⟨x, y⟩` in f32, in element order.
fn dot<S: Elem>(x: &[S], y: &[S]) -> f32 {
    x.iter().zip(y).map(|(p, q)| p.to_f32() * q.to_f32()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::routed_rows;

    /// Six tokens' logits over 3 experts, every token preferring expert 0, then 1.
    fn shape(capacity: Option<usize>) -> RouteShape {
        RouteShape {
            tokens: 6,
            experts: 3,
            top_k: 2,
            width: 1,
            norm_topk: true,
            capacity,
        }
    }

    fn route(capacity: Option<usize>) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
        let logits: Vec<f32> = (0..6).flat_map(|n| [2.0, 1.0, 0.1 * n as f32]).collect();
        let (mut w, mut idx, mut load) = (vec![0.0; 12], vec![0; 12], vec![0.0; 6]);
        router_forward(shape(capacity), &logits, &mut w, &mut idx, &mut load);
        (w, idx, load)
    }

    #[test]
    fn a_capacity_drops_the_later_tokens_copies_and_keeps_their_weights() {
        let (w0, exact, load0) = route(None);
        let (w, idx, load) = route(Some(4));
        // Exact routing: every token to experts 0 and 1. With room for 4 copies per expert,
        // tokens 4 and 5 find both full: their copies are dropped, their choices kept.
        assert!(exact.chunks(2).all(|c| c == [0, 1]), "{exact:?}");
        for (c, (&x, &e)) in idx.iter().zip(&exact).enumerate() {
            let want = if c >= 8 { e | DROPPED } else { e };
            assert_eq!(x, want, "copy {c}");
        }
        // The weights and the load-balancing statistics are the router's choices.
        assert_eq!(w, w0);
        assert_eq!(load, load0);
        // Dropped copies are no expert's rows.
        let rows: Vec<_> = routed_rows(&idx, 3).collect();
        assert_eq!(rows.len(), 8);
        assert!(rows.iter().all(|&(_, c)| c < 8));
        // The router's backward reads the choice under the mark: with no gradient for the
        // dropped copies' weights, it equals the exact routing's with those entries zeroed.
        let logits: Vec<f32> = (0..6).flat_map(|n| [2.0, 1.0, 0.1 * n as f32]).collect();
        let dw: Vec<f32> = (0..12)
            .map(|c| if c >= 8 { 0.0 } else { 0.1 * c as f32 - 0.3 })
            .collect();
        let aux = [0.01, 0.02, 0.03];
        let (mut a, mut b) = (vec![0.0; 18], vec![0.0; 18]);
        router_backward(shape(Some(4)), &logits, &idx, &dw, &aux, &mut a);
        router_backward(shape(None), &logits, &exact, &dw, &aux, &mut b);
        assert_eq!(a, b);
    }
}
