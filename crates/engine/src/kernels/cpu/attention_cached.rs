//! Attention of new tokens over a KV cache, for inference decoding (see [`CachedAttnShape`]).
//!
//! A decoding step has one query per head and sequence, so there is no block of queries for
//! the flash kernel's tiles to share ([`super::attention`]); each (batch, token, head) row is
//! its own task, in two passes over its keys: the scores `s_j = q·k_j/√D` and their maximum
//! `m`, then `o = Σ_j e^{s_j − m}·v_j / Σ_j e^{s_j − m}` (softmax attention, Vaswani et al.
//! 2017 eq. 1, with the max subtracted for range). The same math as the flash kernel with
//! another order of sums: the two agree to f32 rounding, not to the bit.

use super::simd::{dot, madd};
use crate::dispatch_fma;
use crate::dtype::Elem;
use crate::kernels::CachedAttnShape;
use rayon::prelude::*;

/// `x` as f32: itself when it is, else widened into `buf`.
#[inline(always)]
fn widened<'a, S: Elem>(x: &'a [S], buf: &'a mut [f32]) -> &'a [f32] {
    match S::as_f32(x) {
        Some(f) => f,
        None => {
            S::load(x, buf);
            buf
        }
    }
}

/// One query row `q` (`D` wide) over `keys` cached keys and values, row `j` at `j·stride` of
/// `k` and `v`; `scores` holds at least `keys` entries, `acc`, `qb` and `rb` are `D` wide.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn row_generic<const F: bool, S: Elem>(
    q: &[S],
    (k, v): (&[S], &[S]),
    (stride, keys): (usize, usize),
    scale: f32,
    scores: &mut [f32],
    acc: &mut [f32],
    (qb, rb): (&mut [f32], &mut [f32]),
    out: &mut [S],
) {
    let d = q.len();
    let q = widened(q, qb);
    let mut m = f32::NEG_INFINITY;
    for (j, s) in scores[..keys].iter_mut().enumerate() {
        let kj = widened(&k[j * stride..j * stride + d], rb);
        *s = scale * dot::<F>(q, kj);
        m = m.max(*s);
    }
    acc.fill(0.0);
    let mut l = 0.0f32;
    for (j, &s) in scores[..keys].iter().enumerate() {
        let p = (s - m).exp();
        l += p;
        let vj = widened(&v[j * stride..j * stride + d], rb);
        for (a, &x) in acc.iter_mut().zip(vj) {
            *a = madd::<F>(p, x, *a);
        }
    }
    // The query's own key is always visible, so `l ≥ 1`.
    for (o, &a) in out.iter_mut().zip(acc.iter()) {
        *o = S::from_f32(a / l);
    }
}
dispatch_fma!(fn row<S: Elem> => row_generic(q: &[S], kv: (&[S], &[S]), rows: (usize, usize), scale: f32, scores: &mut [f32], acc: &mut [f32], bufs: (&mut [f32], &mut [f32]), out: &mut [S]));

pub fn forward<S: Elem>(s: CachedAttnShape, q: &[S], k: &[S], v: &[S], o: &mut [S]) {
    let a = s.attn;
    super::attention::check(&a);
    assert!(
        s.pos + a.t <= s.capacity,
        "KV cache: positions {}..{} past its capacity of {}",
        s.pos,
        s.pos + a.t,
        s.capacity
    );
    assert_eq!(q.len(), a.q_len(), "cached attention q len");
    assert_eq!(o.len(), a.q_len(), "cached attention o len");
    assert_eq!(k.len(), s.cache_len(), "cached attention k cache len");
    assert_eq!(v.len(), s.cache_len(), "cached attention v cache len");
    let (t, hh, kv, d) = (a.t, a.heads, a.kv_heads, a.head_dim);
    let stride = kv * d;
    let scale = 1.0 / (d as f32).sqrt();
    // Rows of `o` (and `q`), `[B, t, H, D]`: one task each.
    o.par_chunks_mut(d)
        .zip(q.par_chunks(d))
        .enumerate()
        .for_each_init(
            || vec![0.0f32; s.pos + t + 3 * d],
            |scratch, (r, (out, qr))| {
                let (bt, h) = (r / hh, r % hh);
                let (b, i) = (bt / t, bt % t);
                // Query head h reads kv head h / (H/KV) (GQA, Ainslie et al. 2023).
                let first = (b * s.capacity * kv + h / (hh / kv)) * d;
                let keys = s.pos + i + 1;
                let (scores, rest) = scratch.split_at_mut(s.pos + t);
                let (acc, rest) = rest.split_at_mut(d);
                let (qb, rb) = rest.split_at_mut(d);
                let kv_rows = (&k[first..], &v[first..]);
                row(
                    qr,
                    kv_rows,
                    (stride, keys),
                    scale,
                    scores,
                    acc,
                    (qb, rb),
                    out,
                );
            },
        );
}
