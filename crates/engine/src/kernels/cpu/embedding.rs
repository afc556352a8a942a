//! Token embedding: a row gather forward, a scatter-add backward.

use super::scratch::KernelScratch;
use super::simd::SendPtr;
use crate::dtype::Elem;
use rayon::prelude::*;

/// One rank's whole table: every token must be in it.
fn check_tokens(tokens: &[u32], vocab: usize) {
    for &t in tokens {
        assert!((t as usize) < vocab, "token id {t} >= vocab {vocab}");
    }
}

pub fn forward<S: Elem>(tokens: &[u32], wte: &[S], c: usize, out: &mut [S]) {
    check_tokens(tokens, wte.len() / c);
    forward_shard(tokens, wte, c, 0, out)
}

/// The rows of a vocabulary shard (`wte` holds rows `first..`): a token outside it gets zeros.
pub fn forward_shard<S: Elem>(tokens: &[u32], wte: &[S], c: usize, first: usize, out: &mut [S]) {
    assert_eq!(out.len(), tokens.len() * c, "embedding out len");
    let vocab = wte.len() / c;
    out.par_chunks_mut(c)
        .zip(tokens.par_iter())
        .for_each(|(row, &t)| match (t as usize).checked_sub(first) {
            Some(t) if t < vocab => row.copy_from_slice(&wte[t * c..(t + 1) * c]),
            _ => row.fill(S::from_f32(0.0)),
        });
}

/// Repeated tokens would race if parallelised over rows, so tasks own column blocks instead:
/// every task walks all tokens and adds its `BLOCK` columns (no scratch, deterministic order).
pub fn backward<S: Elem, G: Elem>(tokens: &[u32], dout: &[S], c: usize, dwte: &mut [G]) {
    check_tokens(tokens, dwte.len() / c);
    backward_shard(tokens, dout, c, 0, dwte)
}

/// The gradient rows of a vocabulary shard (`dwte` holds rows `first..`): tokens outside it
/// are another rank's.
pub fn backward_shard<S: Elem, G: Elem>(
    tokens: &[u32],
    dout: &[S],
    c: usize,
    first: usize,
    dwte: &mut [G],
) {
    const BLOCK: usize = 64;
    assert_eq!(dout.len(), tokens.len() * c, "embedding dout len");
    let vocab = dwte.len() / c;
    let local = |t: u32| (t as usize).checked_sub(first).filter(|&t| t < vocab);
    if G::as_f32_mut(dwte).is_none() {
        return backward_rounded(tokens, dout, c, first, dwte);
    }
    let dwte = G::as_f32_mut(dwte).expect("f32 gradients, checked above");
    let p = SendPtr(dwte.as_mut_ptr());
    (0..c.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
        let c0 = blk * BLOCK;
        let c1 = (c0 + BLOCK).min(c);
        for (n, t) in tokens.iter().enumerate() {
            let Some(t) = local(*t) else { continue };
            // SAFETY: column block [c0, c1) of every row is owned by this task; t < vocab.
            let dst = unsafe { p.slice_mut(t * c + c0, c1 - c0) };
            let src = &dout[n * c + c0..n * c + c1];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s.to_f32());
        }
    });
}

/// The backward into 16-bit gradients: the rows of one token are summed in f32 and added to
/// its gradient row once, so a frequent token's gradient is rounded once per call rather than
/// once per occurrence. Positions are visited in token order (a stable sort: deterministic).
fn backward_rounded<S: Elem, G: Elem>(
    tokens: &[u32],
    dout: &[S],
    c: usize,
    first: usize,
    dwte: &mut [G],
) {
    const BLOCK: usize = 64;
    let vocab = dwte.len() / c;
    // The token order is the kernel's scratch (`scratch`), alive only inside the call.
    let _scratch = KernelScratch::enter();
    let mut order: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&n| (tokens[n as usize] as usize).wrapping_sub(first) < vocab)
        .collect();
    order.sort_by_key(|&n| tokens[n as usize]);
    let p = SendPtr(dwte.as_mut_ptr());
    (0..c.div_ceil(BLOCK)).into_par_iter().for_each(|blk| {
        let c0 = blk * BLOCK;
        let w = BLOCK.min(c - c0);
        let mut acc = [0.0f32; BLOCK];
        let mut i = 0;
        while i < order.len() {
            let t = tokens[order[i] as usize] as usize - first;
            // SAFETY: column block [c0, c0 + w) of row t belongs to this task.
            let dst = unsafe { p.slice_mut(t * c + c0, w) };
            acc[..w]
                .iter_mut()
                .zip(dst.iter())
                .for_each(|(a, d)| *a = d.to_f32());
            while i < order.len() && tokens[order[i] as usize] as usize - first == t {
                let n = order[i] as usize;
                let src = &dout[n * c + c0..n * c + c0 + w];
                acc[..w]
                    .iter_mut()
                    .zip(src)
                    .for_each(|(a, s)| *a += s.to_f32());
                i += 1;
            }
            dst.iter_mut()
                .zip(&acc[..w])
                .for_each(|(d, a)| *d = G::from_f32(*a));
        }
    });
}
