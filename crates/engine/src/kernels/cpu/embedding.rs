//! Token embedding: a row gather forward, a scatter-add backward.

use super::simd::SendPtr;
use rayon::prelude::*;

pub fn forward(tokens: &[u32], wte: &[f32], c: usize, out: &mut [f32]) {
    assert_eq!(out.len(), tokens.len() * c, "embedding out len");
    let vocab = wte.len() / c;
    out.par_chunks_mut(c)
        .zip(tokens.par_iter())
        .for_each(|(row, &t)| {
            let t = t as usize;
            assert!(t < vocab, "token id {t} >= vocab {vocab}");
            row.copy_from_slice(&wte[t * c..(t + 1) * c]);
        });
}

/// Repeated tokens would race if parallelised over rows, so tasks own column blocks instead:
/// every task walks all tokens and adds its `BLOCK` columns (no scratch, deterministic order).
pub fn backward(tokens: &[u32], dout: &[f32], c: usize, dwte: &mut [f32]) {
    const BLOCK: usize = 64;
    assert_eq!(dout.len(), tokens.len() * c, "embedding dout len");
    let vocab = dwte.len() / c;
    for &t in tokens {
        assert!((t as usize) < vocab, "token id {t} >= vocab {vocab}");
    }
    let p = SendPtr(dwte.as_mut_ptr());
    (0..c.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
        let c0 = blk * BLOCK;
        let c1 = (c0 + BLOCK).min(c);
        for (n, &t) in tokens.iter().enumerate() {
            // SAFETY: column block [c0, c1) of every row is owned by this task; t < vocab.
            let dst = unsafe { p.slice_mut(t as usize * c + c0, c1 - c0) };
            let src = &dout[n * c + c0..n * c + c1];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
    });
}
