//! SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): `h = silu(g) ⊙ u`,
//! `silu(g) = g·σ(g)`. Backward: `du = dh ⊙ silu(g)`,
//! `dg = dh ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`.

use super::simd::exp_f32;
use crate::dispatch_fma;
use rayon::prelude::*;

/// Elements per rayon task.
pub(crate) const CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid<const F: bool>(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32::<F>(-x))
}

#[inline(always)]
fn forward_chunk_generic<const F: bool>(g: &[f32], u: &[f32], h: &mut [f32]) {
    for ((hi, gi), ui) in h.iter_mut().zip(g).zip(u) {
        *hi = gi * sigmoid::<F>(*gi) * ui;
    }
}
dispatch_fma!(fn forward_chunk => forward_chunk_generic(g: &[f32], u: &[f32], h: &mut [f32]));

pub fn forward(gate: &[f32], up: &[f32], h: &mut [f32]) {
    assert!(gate.len() == h.len() && up.len() == h.len(), "swiglu lens");
    h.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((h, g), u)| forward_chunk(g, u, h));
}

#[inline(always)]
fn backward_chunk_generic<const F: bool>(
    dh: &[f32],
    g: &[f32],
    u: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
) {
    let n = dg.len();
    let (dh, g, u, du) = (&dh[..n], &g[..n], &u[..n], &mut du[..n]);
    for i in 0..n {
        let sg = sigmoid::<F>(g[i]);
        let silu = g[i] * sg;
        du[i] = dh[i] * silu;
        dg[i] = dh[i] * u[i] * sg * (1.0 + g[i] * (1.0 - sg));
    }
}
dispatch_fma!(fn backward_chunk => backward_chunk_generic(dh: &[f32], g: &[f32], u: &[f32], dg: &mut [f32], du: &mut [f32]));

pub fn backward(dh: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let n = dh.len();
    assert!(
        gate.len() == n && up.len() == n && dgate.len() == n && dup.len() == n,
        "swiglu bwd lens"
    );
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(
            dh.par_chunks(CHUNK)
                .zip(gate.par_chunks(CHUNK))
                .zip(up.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((dh, g), u))| backward_chunk(dh, g, u, dg, du));
}
