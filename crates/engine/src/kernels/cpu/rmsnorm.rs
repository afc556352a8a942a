//! RMSNorm (Zhang & Sennrich 2019), HF `LlamaRMSNorm`: `y = w ⊙ x · rstd`,
//! `rstd = 1/sqrt(mean(x²) + eps)`.
//!
//! Backward with `x̂ = x·rstd`, `g = dy ⊙ w`:
//! `dx = rstd · (g − x̂ · mean(g ⊙ x̂))`, `dw = Σ_rows dy ⊙ x̂`.

use super::simd::{dot3, madd, sum_sq};
use crate::dispatch_fma;
use crate::dtype::{view, Elem};
use crate::kernels::{Accum, NormShape};
use rayon::prelude::*;

/// Rows per rayon task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// A block of rows; `#[inline(always)]` so the AVX2 wrapper from `dispatch_fma!` compiles it
/// with AVX2/FMA (dispatch happens per rayon task, inside the closure).
#[inline(always)]
fn forward_rows_generic<const F: bool, S: Elem>(
    x: &[S],
    w: &[f32],
    out: &mut [S],
    rstd: &mut [f32],
    c: usize,
    eps: f32,
    scratch: &mut Vec<f32>,
) {
    for ((orow, ri), xrow) in out
        .chunks_exact_mut(c)
        .zip(rstd.iter_mut())
        .zip(x.chunks_exact(c))
    {
        let xrow = view(xrow, scratch);
        let ms = sum_sq::<F>(xrow) / c as f32;
        let rs = 1.0 / (ms + eps).sqrt();
        *ri = rs;
        for ((oi, xi), wi) in orow.iter_mut().zip(xrow).zip(w) {
            *oi = S::from_f32(wi * (xi * rs));
        }
    }
}
dispatch_fma!(fn forward_rows<S: Elem> => forward_rows_generic(x: &[S], w: &[f32], out: &mut [S], rstd: &mut [f32], c: usize, eps: f32, scratch: &mut Vec<f32>));

pub fn forward<S: Elem>(s: NormShape, x: &[S], w: &[S], out: &mut [S], rstd: &mut [f32]) {
    assert_eq!(x.len(), s.n * s.c, "rmsnorm x len");
    assert_eq!(out.len(), s.n * s.c, "rmsnorm out len");
    assert_eq!(w.len(), s.c, "rmsnorm w len");
    assert_eq!(rstd.len(), s.n, "rmsnorm rstd len");
    let c = s.c;
    let mut wbuf = Vec::new();
    let w = view(w, &mut wbuf);
    out.par_chunks_mut(c * ROWS_PER_TASK)
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .zip(x.par_chunks(c * ROWS_PER_TASK))
        .for_each_init(Vec::new, |scratch, ((o, r), xs)| {
            forward_rows(xs, w, o, r, c, s.eps, scratch)
        });
}

/// dx for a block of rows starting at `row0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn dx_rows_generic<const F: bool, S: Elem>(
    dy: &[S],
    x: &[S],
    w: &[f32],
    rstd: &[f32],
    dx: &mut [S],
    add: bool,
    c: usize,
    row0: usize,
    scratch: &mut (Vec<f32>, Vec<f32>),
) {
    for (r, dxrow) in dx.chunks_exact_mut(c).enumerate() {
        let row = row0 + r;
        let xr = view(&x[row * c..(row + 1) * c], &mut scratch.0);
        let dyr = view(&dy[row * c..(row + 1) * c], &mut scratch.1);
        let rs = rstd[row];
        // mean(g ⊙ x̂) = rstd · Σ(dy⊙w⊙x) / c
        let mean = dot3::<F>(dyr, w, xr) * rs / c as f32;
        for (((o, d), xi), wi) in dxrow.iter_mut().zip(dyr).zip(xr).zip(w) {
            let v = rs * (d * wi - xi * rs * mean);
            *o = S::from_f32(if add { o.to_f32() + v } else { v });
        }
    }
}
dispatch_fma!(fn dx_rows<S: Elem> => dx_rows_generic(dy: &[S], x: &[S], w: &[f32], rstd: &[f32], dx: &mut [S], add: bool, c: usize, row0: usize, scratch: &mut (Vec<f32>, Vec<f32>)));

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
    let mut wbuf = Vec::new();
    let w = view(w, &mut wbuf);
    // Pass 1: dx, parallel over row blocks.
    dx.par_chunks_mut(c * ROWS_PER_TASK)
        .enumerate()
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |scratch, (blk, dxs)| {
                dx_rows(dy, x, w, rstd, dxs, add, c, blk * ROWS_PER_TASK, scratch)
            },
        );
    // Pass 2: dw, parallel over column blocks so each task owns its dw slice (no scratch).
    dw.par_chunks_mut(COLS)
        .enumerate()
        .for_each(|(blk, dwb)| dw_cols(dy, x, rstd, dwb, c, blk * COLS));
}
