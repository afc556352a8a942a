//! Elementwise helpers: residual adds, copies, scaling, squared norms, rounding casts.

use super::simd::sum_sq;
use super::swiglu::CHUNK;
use crate::dispatch_fma;
use crate::dtype::Elem;
use rayon::prelude::*;

pub fn add<S: Elem>(a: &[S], b: &[S], out: &mut [S]) {
    assert!(a.len() == out.len() && b.len() == out.len(), "add lens");
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = S::from_f32(a.to_f32() + b.to_f32());
            }
        });
}

pub fn add_inplace<S: Elem>(acc: &mut [S], x: &[S]) {
    assert_eq!(acc.len(), x.len(), "add_inplace lens");
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| {
            a.iter_mut()
                .zip(x)
                .for_each(|(a, x)| *a = S::from_f32(a.to_f32() + x.to_f32()));
        });
}

pub fn copy<S: Elem>(src: &[S], dst: &mut [S]) {
    assert_eq!(src.len(), dst.len(), "copy lens");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

pub fn scale<G: Elem>(x: &mut [G], s: f32) {
    x.par_chunks_mut(CHUNK)
        .for_each(|x| x.iter_mut().for_each(|v| *v = G::from_f32(v.to_f32() * s)));
}

#[inline(always)]
fn sum_sq_generic<const F: bool>(x: &[f32]) -> f32 {
    sum_sq::<F>(x)
}
dispatch_fma!(fn sum_sq_chunk => sum_sq_generic(x: &[f32]) -> f32);

/// Σ x²: f32 lanes within a 16k chunk (relative error ~1e-7·√chunk), f64 across chunks.
pub fn sum_squares<G: Elem>(x: &[G]) -> f64 {
    // A fixed number of blocks summed in parallel into a stack array, then added in block
    // order: rayon's own `sum` associates by its adaptive split, which would make the gradient
    // norm (and so clipping) vary in the last bits between runs and break bit-identical
    // resume; collecting into a Vec would allocate outside the memory plan on every step.
    const BLOCKS: usize = 64;
    let block = x.len().div_ceil(BLOCKS).max(1);
    let mut parts = [0.0f64; BLOCKS];
    parts
        .par_iter_mut()
        .zip(x.par_chunks(block))
        .for_each(|(p, c)| {
            *p = match G::as_f32(c) {
                Some(c) => c.chunks(CHUNK).map(|c| sum_sq_chunk(c) as f64).sum(),
                // 16-bit gradients are widened chunk by chunk on the stack (no heap traffic
                // outside the memory plan).
                None => c
                    .chunks(CHUNK)
                    .map(|c| {
                        let mut buf = [0.0f32; CHUNK];
                        G::load(c, &mut buf[..c.len()]);
                        sum_sq_chunk(&buf[..c.len()]) as f64
                    })
                    .sum(),
            }
        });
    parts.iter().sum()
}

/// `dst = round(src)`.
pub fn widen_into<S: Elem>(src: &[S], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "cast lens");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| S::load(s, d));
}

pub fn round_into<S: Elem>(src: &[f32], dst: &mut [S]) {
    assert_eq!(src.len(), dst.len(), "cast lens");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| S::store(s, d));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::{agree, random};

    #[test]
    fn every_simd_tier_agrees() {
        let x = random(4099, 14, 2.0);
        agree("sum of squares", 1e-5, || vec![sum_sq_chunk(&x)]);
    }
}
