//! Attention's tile products on AVX-512: `dst (=|+=) lhs · rhs` for tiles of at most a few
//! hundred rows and columns, single threaded, with the right-hand side's rows contiguous.
//!
//! Why not the gemm crate, which runs them elsewhere: on stable Rust it has AVX2 kernels only
//! (its AVX-512 ones sit behind a nightly feature), and for a 64×64×64 tile its packing and
//! dispatch cost as much as the arithmetic. Here the product is the textbook register-blocked
//! outer-product loop (Goto & van de Geijn 2008, "Anatomy of high-performance matrix
//! multiplication", the micro-kernel without packing): per depth step `p`, four rows of `lhs`
//! are broadcast and multiplied into 64 columns of `rhs` row `p` (four 16-lane vectors), into a
//! 4 × 64 block of accumulators held in 16 of the 32 zmm registers.
//!
//! Sums: each output element is one fused multiply-add chain over the depth in order, starting
//! from zero, then added to `dst` when accumulating. That is exactly what the gemm crate
//! computes for depths up to [`super::matmul::MAX_DEPTH`] (see there), so switching kernels
//! does not change a single bit; the tests below check it against `sgemm_raw`.

use super::matmul::sgemm_raw;
use super::simd::{tier, Tier};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of `dst` per register block.
const ROWS: usize = 4;
/// 16-lane vectors of `dst` columns per register block (64 columns).
const VECS: usize = 4;

/// `dst[i·ldd + c] (=|+=) Σ_p lhs[i·ls.0 + p·ls.1] · rhs[p·ldr + c]` for `i < m`, `c < n`,
/// `p < k`: on the AVX-512 kernel at the AVX-512 [`Tier`], else on the gemm crate (the same
/// sums).
///
/// # Safety
/// Every `dst` element `(i, c)` at `i·ldd + c` must be valid for reads and writes and not
/// accessed concurrently; `lhs` and `rhs` bounds are asserted.
#[allow(clippy::too_many_arguments)]
pub unsafe fn product(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    ldd: usize,
    lhs: &[f32],
    ls: (usize, usize),
    rhs: &[f32],
    ldr: usize,
    accumulate: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if tier() == Tier::Avx512 {
        if m == 0 || n == 0 {
            return;
        }
        if k > 0 {
            assert!(
                (m - 1) * ls.0 + (k - 1) * ls.1 < lhs.len(),
                "tile product: lhs too small"
            );
            assert!(
                (k - 1) * ldr + n - 1 < rhs.len(),
                "tile product: rhs too small"
            );
        }
        let ops = Operands {
            k,
            dst,
            ldd,
            lhs: lhs.as_ptr(),
            ls,
            rhs: rhs.as_ptr(),
            ldr,
            accumulate,
        };
        // SAFETY: AVX-512F is present (the tier); bounds as documented and asserted.
        unsafe { product_avx512(m, n, ops) };
        return;
    }
    sgemm_raw(
        m,
        n,
        k,
        dst,
        (ldd, 1),
        lhs,
        ls,
        rhs,
        (ldr, 1),
        accumulate,
        false,
    );
}

/// The operands of one product, as raw pointers (bounds checked by [`product`]).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Operands {
    k: usize,
    dst: *mut f32,
    ldd: usize,
    lhs: *const f32,
    ls: (usize, usize),
    rhs: *const f32,
    ldr: usize,
    accumulate: bool,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn product_avx512(m: usize, n: usize, o: Operands) {
    let mut c0 = 0;
    while c0 < n {
        let width = (n - c0).min(VECS * 16);
        // Lanes of each vector inside the panel; masked loads never touch the lanes left out.
        let masks: [__mmask16; VECS] = std::array::from_fn(|v| {
            let lanes = width.saturating_sub(v * 16).min(16);
            ((1u32 << lanes) - 1) as __mmask16
        });
        let mut i = 0;
        while i + ROWS <= m {
            block::<ROWS>(i, c0, &masks, o);
            i += ROWS;
        }
        while i < m {
            block::<1>(i, c0, &masks, o);
            i += 1;
        }
        c0 += VECS * 16;
    }
}

/// Rows `i0..i0+R`, columns `c0..` (the `masks` lanes) of `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block<const R: usize>(i0: usize, c0: usize, masks: &[__mmask16; VECS], o: Operands) {
    let mut acc = [[_mm512_setzero_ps(); VECS]; R];
    for p in 0..o.k {
        let row = o.rhs.add(p * o.ldr + c0);
        let b: [__m512; VECS] =
            std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], row.add(v * 16)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*o.lhs.add((i0 + r) * o.ls.0 + p * o.ls.1));
            for v in 0..VECS {
                acc[v] = _mm512_fmadd_ps(a, b[v], acc[v]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let out = o.dst.add((i0 + r) * o.ldd + c0);
        for v in 0..VECS {
            if masks[v] == 0 {
                break;
            }
            let d = out.add(v * 16);
            let x = if o.accumulate {
                _mm512_add_ps(_mm512_maskz_loadu_ps(masks[v], d), acc[v])
            } else {
                acc[v]
            };
            _mm512_mask_storeu_ps(d, masks[v], x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::random;

    #[test]
    fn same_bits_as_the_gemm_crate() {
        if tier() != Tier::Avx512 {
            eprintln!("no AVX-512 on this CPU: the tile kernel is not used, nothing to check");
            return;
        }
        // Attention's products (64-row tiles, head dims 64 and 80, causal tails), with the
        // left operand read by rows and by columns (Pᵀ·dO), overwriting and accumulating.
        for (seed, &(m, n, k, transposed, accumulate)) in [
            (64, 64, 64, false, false),
            (64, 64, 64, true, true),
            (64, 80, 37, false, true),
            (37, 64, 64, true, false),
            (7, 130, 80, false, true),
            (64, 17, 64, false, false),
        ]
        .iter()
        .enumerate()
        {
            let seed = seed as u64 * 3;
            let lhs = random(m * k, seed, 1.0);
            let ls = if transposed { (1, m) } else { (k, 1) };
            let rhs = random(k * n, seed + 1, 1.0);
            let init = random(m * n, seed + 2, 1.0);
            let (mut want, mut got) = (init.clone(), init);
            unsafe {
                sgemm_raw(
                    m,
                    n,
                    k,
                    want.as_mut_ptr(),
                    (n, 1),
                    &lhs,
                    ls,
                    &rhs,
                    (n, 1),
                    accumulate,
                    false,
                );
                product(
                    (m, n, k),
                    got.as_mut_ptr(),
                    n,
                    &lhs,
                    ls,
                    &rhs,
                    n,
                    accumulate,
                );
            }
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "{m}x{n}x{k}: {differ} elements differ from sgemm"
            );
        }
    }
}
