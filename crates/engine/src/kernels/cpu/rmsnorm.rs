//! RMSNorm (Zhang & Sennrich 2019), HF `LlamaRMSNorm`: `y = w ⊙ x · rstd`,
//! `rstd = 1/sqrt(mean(x²) + eps)`.
//!
//! Backward with `x̂ = x·rstd`, `g = dy ⊙ w`:
//! `dx = rstd · (g − x̂ · mean(g ⊙ x̂))`, `dw = Σ_rows dy ⊙ x̂`.

use super::simd::{dot3, madd, sum_sq};
use crate::dispatch_fma;
use crate::kernels::{Accum, NormShape};
use rayon::prelude::*;

/// Rows per rayon task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// A block of rows; `#[inline(always)]` so the AVX2 wrapper from `dispatch_fma!` compiles it
/// with AVX2/FMA (dispatch happens per rayon task, inside the closure).
#[inline(always)]
fn forward_rows_generic<const F: bool>(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    rstd: &mut [f32],
    c: usize,
    eps: f32,
) {
    for ((orow, ri), xrow) in out
        .chunks_exact_mut(c)
        .zip(rstd.iter_mut())
        .zip(x.chunks_exact(c))
    {
        let ms = sum_sq::<F>(xrow) / c as f32;
        let rs = 1.0 / (ms + eps).sqrt();
        *ri = rs;
        for ((oi, xi), wi) in orow.iter_mut().zip(xrow).zip(w) {
            *oi = wi * (xi * rs);
        }
    }
}
dispatch_fma!(fn forward_rows => forward_rows_generic(x: &[f32], w: &[f32], out: &mut [f32], rstd: &mut [f32], c: usize, eps: f32));

pub fn forward(s: NormShape, x: &[f32], w: &[f32], out: &mut [f32], rstd: &mut [f32]) {
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
fn dx_rows_generic<const F: bool>(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
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
        let mean = dot3::<F>(dyr, w, xr) * rs / c as f32;
        for (((o, d), xi), wi) in dxrow.iter_mut().zip(dyr).zip(xr).zip(w) {
            let v = rs * (d * wi - xi * rs * mean);
            if add {
                *o += v;
            } else {
                *o = v;
            }
        }
    }
}
dispatch_fma!(fn dx_rows => dx_rows_generic(dy: &[f32], x: &[f32], w: &[f32], rstd: &[f32], dx: &mut [f32], add: bool, c: usize, row0: usize));

/// dw for the column block `[c0, c0 + dwb.len())` over all rows.
#[inline(always)]
fn dw_cols_generic<const F: bool>(
    dy: &[f32],
    x: &[f32],
    rstd: &[f32],
    dwb: &mut [f32],
    c: usize,
    c0: usize,
) {
    let c1 = c0 + dwb.len();
    for (row, &rs) in rstd.iter().enumerate() {
        let xr = &x[row * c + c0..row * c + c1];
        let dyr = &dy[row * c + c0..row * c + c1];
        for ((g, d), xi) in dwb.iter_mut().zip(dyr).zip(xr) {
            *g = madd::<F>(*d, xi * rs, *g);
        }
    }
}
dispatch_fma!(fn dw_cols => dw_cols_generic(dy: &[f32], x: &[f32], rstd: &[f32], dwb: &mut [f32], c: usize, c0: usize));

#[allow(clippy::too_many_arguments)]
pub fn backward(
    s: NormShape,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
    dx_accum: Accum,
    dw: &mut [f32],
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
    const COLS: usize = 64;
    dw.par_chunks_mut(COLS)
        .enumerate()
        .for_each(|(blk, dwb)| dw_cols(dy, x, rstd, dwb, c, blk * COLS));
}
