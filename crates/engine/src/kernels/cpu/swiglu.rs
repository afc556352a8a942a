//! SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): `h = silu(g) ⊙ u`,
//! `silu(g) = g·σ(g)`. Backward: `du = dh ⊙ silu(g)`,
//! `dg = dh ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`.

use super::simd::exp_f32;
use crate::dispatch_fma;
use crate::dtype::Elem;
use rayon::prelude::*;

/// Elements per rayon task.
pub(crate) const CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid<const F: bool>(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32::<F>(-x))
}

#[inline(always)]
fn forward_chunk_generic<const F: bool, S: Elem>(g: &[S], u: &[S], h: &mut [S]) {
    for ((hi, gi), ui) in h.iter_mut().zip(g).zip(u) {
        let (gi, ui) = (gi.to_f32(), ui.to_f32());
        *hi = S::from_f32(gi * sigmoid::<F>(gi) * ui);
    }
}
dispatch_fma!(fn forward_chunk<S: Elem> => forward_chunk_generic(g: &[S], u: &[S], h: &mut [S]));

pub fn forward<S: Elem>(gate: &[S], up: &[S], h: &mut [S]) {
    assert!(gate.len() == h.len() && up.len() == h.len(), "swiglu lens");
    h.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((h, g), u)| forward_chunk(g, u, h));
}

#[inline(always)]
fn backward_chunk_generic<const F: bool, S: Elem>(
    dh: &[S],
    g: &[S],
    u: &[S],
    dg: &mut [S],
    du: &mut [S],
) {
    let n = dg.len();
    let (dh, g, u, du) = (&dh[..n], &g[..n], &u[..n], &mut du[..n]);
    for i in 0..n {
        let (dhi, gi, ui) = (dh[i].to_f32(), g[i].to_f32(), u[i].to_f32());
        let sg = sigmoid::<F>(gi);
        let silu = gi * sg;
        du[i] = S::from_f32(dhi * silu);
        dg[i] = S::from_f32(dhi * ui * sg * (1.0 + gi * (1.0 - sg)));
    }
}
dispatch_fma!(fn backward_chunk<S: Elem> => backward_chunk_generic(dh: &[S], g: &[S], u: &[S], dg: &mut [S], du: &mut [S]));

pub fn backward<S: Elem>(dh: &[S], gate: &[S], up: &[S], dgate: &mut [S], dup: &mut [S]) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::{agree, random, stored, widened};
    use half::bf16;

    /// Forward and backward of one chunk in storage type `S`, outputs widened.
    fn run<S: Elem>(n: usize) -> Vec<f32> {
        let (g, u, dh) = (
            stored::<S>(&random(n, 1, 8.0)),
            stored::<S>(&random(n, 2, 2.0)),
            stored::<S>(&random(n, 3, 1.0)),
        );
        let (mut h, mut dg, mut du) = (
            vec![S::default(); n],
            vec![S::default(); n],
            vec![S::default(); n],
        );
        forward_chunk(&g, &u, &mut h);
        backward_chunk(&dh, &g, &u, &mut dg, &mut du);
        [widened(&h), widened(&dg), widened(&du)].concat()
    }

    #[test]
    fn every_simd_tier_agrees() {
        agree("swiglu f32", 1e-5, || run::<f32>(1031));
        // bf16 outputs: one rounding step (2⁻⁸ relative) apart at most.
        agree("swiglu bf16", 1e-2, || run::<bf16>(1031));
    }
}
