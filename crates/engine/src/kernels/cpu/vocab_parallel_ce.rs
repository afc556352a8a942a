//! Vocabulary-parallel cross-entropy (Megatron-LM's `_VocabParallelCrossEntropy`, Shoeybi et al.
//! 2019 §3): each tensor-parallel rank holds a slice of the vocabulary's logits, and the full
//! logits are never gathered. Per row every rank reports three numbers, its max m_r,
//! s_r = Σ exp(z − m_r) over its slice and the target's logit if it holds it; with M = max m_r
//! and S = Σ s_r·exp(m_r − M) over the group, `loss = ln S + M − z_t` and the gradient of the
//! rank's logits is `exp(z − m_r)·exp(m_r − M)/S − onehot`, so the exponentials of the first
//! pass serve the second.

use super::simd::exp_f32;
use crate::dispatch_fma;
use crate::kernels::CeShardShape;
use rayon::prelude::*;

#[inline(always)]
fn stats_row_generic<const F: bool>(z: &mut [f32], zt: f32, out: &mut [f32], keep: bool) {
    let mx = z.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    let mut acc = [0.0f32; 16];
    let mut chunks = z.chunks_exact_mut(16);
    for c in &mut chunks {
        for l in 0..16 {
            let e = exp_f32::<F>(c[l] - mx);
            if keep {
                c[l] = e;
            }
            acc[l] += e;
        }
    }
    let mut s: f32 = acc.iter().sum();
    for x in chunks.into_remainder() {
        let e = exp_f32::<F>(*x - mx);
        if keep {
            *x = e;
        }
        s += e;
    }
    out.copy_from_slice(&[mx, s, zt]);
}

dispatch_fma!(fn stats_row => stats_row_generic(z: &mut [f32], zt: f32, out: &mut [f32], keep: bool));

/// The row's target column in this shard, if it is here.
fn local_target(s: &CeShardShape, t: u32) -> Option<usize> {
    (t as usize).checked_sub(s.first).filter(|&t| t < s.vocab)
}

pub fn stats(s: CeShardShape, logits: &mut [f32], targets: &[u32], stats: &mut [f32], keep: bool) {
    assert_eq!(logits.len(), s.rows * s.vocab, "ce logits len");
    assert_eq!(targets.len(), s.rows, "ce targets len");
    assert_eq!(stats.len(), s.rows * 3, "ce stats len");
    logits
        .par_chunks_mut(s.vocab)
        .zip(targets.par_iter())
        .zip(stats.par_chunks_mut(3))
        .for_each(|((z, &t), out)| {
            let zt = local_target(&s, t).map_or(0.0, |i| z[i]);
            stats_row(z, zt, out, keep);
        });
}

#[allow(clippy::too_many_arguments)]
pub fn finish(
    s: CeShardShape,
    logits: &mut [f32],
    targets: &[u32],
    all: &[f32],
    rank: usize,
    losses: &mut [f32],
    scale: Option<f32>,
) -> f64 {
    let ranks = all.len() / (3 * s.rows).max(1);
    assert_eq!(all.len(), ranks * s.rows * 3, "ce gathered stats len");
    assert!(rank < ranks, "rank {rank} of {ranks}");
    assert_eq!(losses.len(), s.rows, "ce losses len");
    let stat = |r: usize, row: usize, k: usize| all[(r * s.rows + row) * 3 + k];
    let row = |row: usize, t: u32, z: Option<&mut [f32]>, loss: &mut f32| {
        if t as usize >= s.full_vocab {
            // Ignored target: no loss, no gradient.
            *loss = 0.0;
            if let Some(z) = z {
                z.fill(0.0);
            }
            return;
        }
        let mx = (0..ranks).fold(f32::NEG_INFINITY, |a, r| a.max(stat(r, row, 0)));
        // Summed in rank order: every rank computes the same S, bit for bit.
        let sum: f32 = (0..ranks)
            .map(|r| stat(r, row, 1) * (stat(r, row, 0) - mx).exp())
            .sum();
        let zt: f32 = (0..ranks).map(|r| stat(r, row, 2)).sum();
        *loss = sum.ln() + mx - zt;
        if let (Some(z), Some(sc)) = (z, scale) {
            let k = sc * (stat(rank, row, 0) - mx).exp() / sum;
            z.iter_mut().for_each(|x| *x *= k);
            if let Some(i) = local_target(&s, t) {
                z[i] -= sc;
            }
        }
    };
    match scale {
        Some(_) => {
            assert_eq!(logits.len(), s.rows * s.vocab, "ce logits len");
            logits
                .par_chunks_mut(s.vocab)
                .zip(targets.par_iter())
                .zip(losses.par_iter_mut())
                .enumerate()
                .for_each(|(r, ((z, &t), l))| row(r, t, Some(z), l));
        }
        None => losses
            .iter_mut()
            .zip(targets)
            .enumerate()
            .for_each(|(r, (l, &t))| row(r, t, None, l)),
    }
    // Row order, as the one-rank kernel sums.
    losses.iter().map(|&l| l as f64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::cross_entropy::cross_entropy;
    use crate::kernels::CeShape;

    #[test]
    fn three_slices_give_the_whole_vocabularys_loss_and_gradient() {
        // 4 rows of 30 logits (one target ignored), split 10 + 10 + 10 over three "ranks".
        let (rows, vocab, ranks) = (4, 30, 3);
        let z: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.13)
            .collect();
        let targets = [3u32, 17, 29, u32::MAX];
        let scale = 0.25;
        let (mut whole, mut whole_loss) = (z.clone(), vec![0.0; rows]);
        let sum = cross_entropy(
            CeShape { rows, vocab },
            &mut whole,
            &targets,
            &mut whole_loss,
            Some(scale),
        );
        let part = vocab / ranks;
        let shape = |r: usize| CeShardShape {
            rows,
            vocab: part,
            first: r * part,
            full_vocab: vocab,
        };
        let mut slices: Vec<Vec<f32>> = (0..ranks)
            .map(|r| {
                (0..rows)
                    .flat_map(|i| z[i * vocab + r * part..i * vocab + (r + 1) * part].to_vec())
                    .collect()
            })
            .collect();
        let mut all = vec![0.0; ranks * rows * 3];
        for (r, slice) in slices.iter_mut().enumerate() {
            stats(
                shape(r),
                slice,
                &targets,
                &mut all[r * rows * 3..(r + 1) * rows * 3],
                true,
            );
        }
        for (r, slice) in slices.iter_mut().enumerate() {
            let mut losses = vec![0.0; rows];
            let got = finish(shape(r), slice, &targets, &all, r, &mut losses, Some(scale));
            assert!((got - sum).abs() < 1e-5 * sum.abs(), "{got} vs {sum}");
            for (a, b) in losses.iter().zip(&whole_loss) {
                assert!((a - b).abs() < 1e-5, "loss {a} vs {b}");
            }
            for i in 0..rows {
                for j in 0..part {
                    let (a, b) = (slice[i * part + j], whole[i * vocab + r * part + j]);
                    assert!((a - b).abs() < 1e-6, "rank {r} row {i} col {j}: {a} vs {b}");
                }
            }
        }
        // Without a gradient the logits are left alone and the losses are the same.
        let mut slice0: Vec<f32> = slices[0].clone();
        let mut stats0 = vec![0.0; rows * 3];
        stats(shape(0), &mut slice0, &targets, &mut stats0, false);
        assert_eq!(slice0, slices[0]);
    }
}
