//! Softmax + cross-entropy fused, over a chunk of rows, with the gradient written in place.
//!
//! `loss_r = logsumexp(z_r) − z_r[t_r]`, `∂loss/∂z_r = softmax(z_r) − onehot(t_r)`
//! (scaled by the caller's `1/num_target_tokens` of the global batch). The row is visited three
//! times: max, `exp(z − max)` stored in place while summing, then normalise/scale; `exp` runs
//! once per logit.

use super::simd::exp_f32;
use crate::dispatch_fma;
use crate::kernels::CeShape;
use rayon::prelude::*;

#[inline(always)]
fn row_generic<const F: bool>(z: &mut [f32], t: u32, loss: &mut f32, scale: Option<f32>) {
    let vocab = z.len();
    if t as usize >= vocab {
        // Ignored target (IGNORE_INDEX, or -100 cast to u32): no loss, no gradient.
        *loss = 0.0;
        if scale.is_some() {
            z.fill(0.0);
        }
        return;
    }
    let zt = z[t as usize];
    let mx = z.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    let sum: f32 = match scale {
        Some(_) => {
            let mut acc = [0.0f32; 16];
            let mut chunks = z.chunks_exact_mut(16);
            for c in &mut chunks {
                for l in 0..16 {
                    c[l] = exp_f32::<F>(c[l] - mx);
                    acc[l] += c[l];
                }
            }
            let mut s: f32 = acc.iter().sum();
            for x in chunks.into_remainder() {
                *x = exp_f32::<F>(*x - mx);
                s += *x;
            }
            s
        }
        None => {
            let mut acc = [0.0f32; 16];
            let mut chunks = z.chunks_exact(16);
            for c in &mut chunks {
                for l in 0..16 {
                    acc[l] += exp_f32::<F>(c[l] - mx);
                }
            }
            let rem: f32 = chunks
                .remainder()
                .iter()
                .map(|x| exp_f32::<F>(x - mx))
                .sum();
            acc.iter().sum::<f32>() + rem
        }
    };
    *loss = sum.ln() + mx - zt;
    if let Some(s) = scale {
        let k = s / sum;
        z.iter_mut().for_each(|x| *x *= k);
        z[t as usize] -= s;
    }
}

dispatch_fma!(fn row => row_generic(z: &mut [f32], t: u32, loss: &mut f32, scale: Option<f32>));

pub fn cross_entropy(
    s: CeShape,
    logits: &mut [f32],
    targets: &[u32],
    losses: &mut [f32],
    dlogits_scale: Option<f32>,
) -> f64 {
    assert_eq!(logits.len(), s.rows * s.vocab, "ce logits len");
    assert_eq!(targets.len(), s.rows, "ce targets len");
    assert_eq!(losses.len(), s.rows, "ce losses len");
    logits
        .par_chunks_mut(s.vocab)
        .zip(targets.par_iter())
        .zip(losses.par_iter_mut())
        .for_each(|((z, &t), l)| row(z, t, l, dlogits_scale));
    // Summed in row order, not by rayon's adaptive split, so the loss is bit-reproducible
    // (a resumed run must match an uninterrupted one exactly).
    losses.iter().map(|&l| l as f64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::{agree, random};

    #[test]
    fn every_simd_tier_agrees() {
        // A vocabulary that is not a multiple of the 16 lanes, loss with and without gradient.
        let vocab = 1000 + 9;
        let z0 = random(vocab, 4, 12.0);
        for scale in [None, Some(0.25f32)] {
            agree("cross-entropy row", 1e-5, || {
                let (mut z, mut loss) = (z0.clone(), 0.0f32);
                row(&mut z, 17, &mut loss, scale);
                z.push(loss);
                z
            });
        }
    }
}
