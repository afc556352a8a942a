//! RMSNorm (Zhang & Sennrich 2019), HF `LlamaRMSNorm`: `y = w ⊙ x · rstd`,
//! `rstd = 1/sqrt(mean(x²) + eps)`.
//!
//! Backward with `x̂ = x·rstd`, `g = dy ⊙ w`:
//! `dx = rstd · (g − x̂ · mean(g ⊙ x̂))`, `dw = Σ_rows dy ⊙ x̂`.

use super::simd::{dot3, madd, sum_sq};
use crate::dispatch_fma;
use crate::dtype::Elem;
use crate::kernels::{Accum, NormShape};
use rayon::prelude::*;

/// Rows per rayon task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// Elements widened at a time from a 16-bit row, on the stack: the kernels read 16-bit rows
/// without a heap buffer (nothing allocated inside the training step outside the memory plan).
const BLOCK: usize = 256;

/// `Σ a_i²`, widening `a` block by block (the SIMD reduction over the whole row for f32).
#[inline(always)]
fn sum_sq_any<const F: bool, S: Elem>(a: &[S]) -> f32 {
    if let Some(a) = S::as_f32(a) {
        return sum_sq::<F>(a);
    }
    let mut buf = [0.0f32; BLOCK];
    a.chunks(BLOCK).fold(0.0, |acc, c| {
        let b = &mut buf[..c.len()];
        S::load(c, b);
        acc + sum_sq::<F>(b)
    })
}

/// `Σ a_i·b_i·c_i`, widening block by block like [`sum_sq_any`].
#[inline(always)]
fn dot3_any<const F: bool, S: Elem>(a: &[S], b: &[S], c: &[S]) -> f32 {
    if let (Some(a), Some(b), Some(c)) = (S::as_f32(a), S::as_f32(b), S::as_f32(c)) {
        return dot3::<F>(a, b, c);
    }
    let mut buf = [[0.0f32; BLOCK]; 3];
    let [ba, bb, bc] = &mut buf;
    let mut acc = 0.0;
    for ((ca, cb), cc) in a.chunks(BLOCK).zip(b.chunks(BLOCK)).zip(c.chunks(BLOCK)) {
        let n = ca.len();
        S::load(ca, &mut ba[..n]);
        S::load(cb, &mut bb[..n]);
        S::load(cc, &mut bc[..n]);
        acc += dot3::<F>(&ba[..n], &bb[..n], &bc[..n]);
    }
    acc
}

/// A block of rows; `#[inline(always)]` so the AVX2 wrapper from `dispatch_fma!` compiles it
/// with AVX2/FMA (dispatch happens per rayon task, inside the closure).
#[inline(always)]
fn forward_rows_generic<const F: bool, S: Elem>(
    x: &[S],
    w: &[S],
    out: &mut [S],
    rstd: &mut [f32],
    c: usize,
    eps: f32,
) {
    for ((orow, ri), xrow) in out
        .chunks_exact_mut(c)
        .zip(rstd.iter_mut())
        .zip(x.chunks_exact(c))
    {
        let ms = sum_sq_any::<F, S>(xrow) / c as f32;
        let rs = 1.0 / (ms + eps).sqrt();
        *ri = rs;
        for ((oi, xi), wi) in orow.iter_mut().zip(xrow).zip(w) {
            *oi = S::from_f32(wi.to_f32() * (xi.to_f32() * rs));
        }
    }
}
dispatch_fma!(fn forward_rows<S: Elem> => forward_rows_generic(x: &[S], w: &[S], out: &mut [S], rstd: &mut [f32], c: usize, eps: f32));

pub fn forward<S: Elem>(s: NormShape, x: &[S], w: &[S], out: &mut [S], rstd: &mut [f32]) {
    assert_eq!(x.len(), s.n * s.c, "rmsnorm x len");
    assert_eq!(out.len(), s.n * s.c, "rmsnorm out len");
    assert_eq!(w.len(), s.c, "rmsnorm w len");
    assert_eq!(rstd.len(), s.n, "rmsnorm rstd len");
    let c = s.c;
    out.par_chunks_mut(c * ROWS_PER_TASK)
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(c * ROWS_PER_TASK))
        .for_each(|((o, r), xs)| forward_rows(xs, w, o, r, c, s.eps));
}

/// dx for a block of rows starting at `row0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn dx_rows_generic<const F: bool, S: Elem>(
    dy: &[S],
    x: &[S],
    w: &[S],
    rstd: &[f32],
    dx: &mut [S],
    add: bool,
    c: usize,
    row0: usize,
) {
    for (r, dxrow) in dx.chunks_exact_mut(c).enumerate() {
        let row = row0 + r;
        let xr = &x[row * c..(row + 1) * c];
        let dyr = &dy[row * c..(row + 1) * c];
        let rs = rstd[row];
        // mean(g ⊙ x̂) = rstd · Σ(dy⊙w⊙x) / c
        let mean = dot3_any::<F, S>(dyr, w, xr) * rs / c as f32;
        for (((o, d), xi), wi) in dxrow.iter_mut().zip(dyr).zip(xr).zip(w) {
            let (d, xi, wi) = (d.to_f32(), xi.to_f32(), wi.to_f32());
            let v = rs * (d * wi - xi * rs * mean);
            *o = S::from_f32(if add { o.to_f32() + v } else { v });
        }
    }
}
dispatch_fma!(fn dx_rows<S: Elem> => dx_rows_generic(dy: &[S], x: &[S], w: &[S], rstd: &[f32], dx: &mut [S], add: bool, c: usize, row0: usize));

/// dw for the column block `[c0, c0 + dwb.len())` over all rows, summed in f32 (starting from
/// the gradient already there) and rounded once.
#[inline(always)]
fn dw_cols_generic<const F: bool, S: Elem, G: Elem>(
    dy: &[S],
    x: &[S],
    rstd: &[f32],
    dwb: &mut [G],
    c: usize,
    c0: usize,
) {
    let mut acc = [0.0f32; COLS];
    let acc = &mut acc[..dwb.len()];
    acc.iter_mut()
        .zip(dwb.iter())
        .for_each(|(a, g)| *a = g.to_f32());
    let c1 = c0 + acc.len();
    for (row, &rs) in rstd.iter().enumerate() {
        let xr = &x[row * c + c0..row * c + c1];
        let dyr = &dy[row * c + c0..row * c + c1];
        for ((g, d), xi) in acc.iter_mut().zip(dyr).zip(xr) {
            *g = madd::<F>(d.to_f32(), xi.to_f32() * rs, *g);
        }
    }
    dwb.iter_mut()
        .zip(acc.iter())
        .for_each(|(g, a)| *g = G::from_f32(*a));
}
dispatch_fma!(fn dw_cols<S: Elem, G: Elem> => dw_cols_generic(dy: &[S], x: &[S], rstd: &[f32], dwb: &mut [G], c: usize, c0: usize));

/// Columns per task of the weight gradient.
const COLS: usize = 64;

#[allow(clippy::too_many_arguments)]
pub fn backward<S: Elem, G: Elem>(
    s: NormShape,
    dy: &[S],
    x: &[S],
    w: &[S],
    rstd: &[f32],
    dx: &mut [S],
    dx_accum: Accum,
    dw: &mut [G],
) {
    let nc = s.n * s.c;
    assert!(
        dy.len() == nc && x.len() == nc && dx.len() == nc,
        "rmsnorm bwd lens"
    );
    assert!(
        w.len() == s.c && dw.len() == s.c && rstd.len() == s.n,
        "rmsnorm bwd lens"
    );
    let c = s.c;
    let add = dx_accum == Accum::Add;
    // Pass 1: dx, parallel over row blocks.
    dx.par_chunks_mut(c * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(blk, dxs)| dx_rows(dy, x, w, rstd, dxs, add, c, blk * ROWS_PER_TASK));
    // Pass 2: dw, parallel over column blocks so each task owns its dw slice (no scratch).
    dw.par_chunks_mut(COLS)
        .enumerate()
        .for_each(|(blk, dwb)| dw_cols(dy, x, rstd, dwb, c, blk * COLS));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::{agree, random, stored, widened};
    use half::bf16;

    /// Forward, dx (overwrite and accumulate) and dw of `rows` rows of width `c` in `S`.
    fn run<S: Elem>(rows: usize, c: usize) -> Vec<f32> {
        let x = stored::<S>(&random(rows * c, 5, 3.0));
        let w = stored::<S>(&random(c, 6, 1.5));
        let dy = stored::<S>(&random(rows * c, 7, 1.0));
        let (mut out, mut rstd) = (vec![S::default(); rows * c], vec![0.0f32; rows]);
        forward_rows(&x, &w, &mut out, &mut rstd, c, 1e-5);
        let mut dx = stored::<S>(&random(rows * c, 8, 1.0));
        dx_rows(&dy, &x, &w, &rstd, &mut dx, true, c, 0);
        let mut dw = stored::<S>(&random(c, 9, 1.0));
        for c0 in (0..c).step_by(COLS) {
            let c1 = (c0 + COLS).min(c);
            dw_cols(&dy, &x, &rstd, &mut dw[c0..c1], c, c0);
        }
        [widened(&out), rstd, widened(&dx), widened(&dw)].concat()
    }

    #[test]
    fn every_simd_tier_agrees() {
        agree("rmsnorm f32", 1e-5, || run::<f32>(9, 300));
        agree("rmsnorm bf16", 1e-2, || run::<bf16>(9, 300));
    }
}
