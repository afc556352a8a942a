//! Stochastic rounding of f32 to bf16 and f16, and the counter-based noise that drives it.
//!
//! Stochastic rounding (SR) rounds `x` to the upper of its two neighbours `lo <= |x| <= hi`
//! (in magnitude) with probability `(|x| - lo) / (hi - lo)`, so `E[round(x)] = x`: small
//! updates are not lost on average when accumulating into a low-precision buffer (Gupta et
//! al. 2015, "Deep Learning with Limited Numerical Precision").
//!
//! Both functions take the randomness as an explicit `noise: u32` so they are deterministic;
//! [`noise`] derives it from `(seed, step, index)` with a counter-based hash, so the result
//! of rounding element `index` at step `step` does not depend on thread scheduling or chunking
//! and a resumed run reproduces the original bit for bit.
//!
//! **Overflow policy** (both formats): a finite `x` whose magnitude round-to-nearest-even
//! would send to infinity (`|x| >=` the format's overflow threshold: `bf16::MAX` plus half an
//! ulp, 65520 for f16) becomes ±inf, as with IEEE rounding; a finite `x` between the largest
//! finite value and that threshold becomes ±MAX (it is never rounded *up* to inf by noise).
//! Infinities and NaN pass through (NaNs stay NaN). Apart from that narrow band above MAX the
//! rounding is exactly unbiased (f16: up to the 2^-32 resolution of the noise, see
//! [`f16_stochastic`]).

use half::{bf16, f16};

/// bf16 overflow threshold (bf16::MAX + half an ulp) as f32 bits.
const BF16_OVERFLOW_BITS: u32 = 0x7F7F_8000;
/// bf16::MAX as f32 bits.
const BF16_MAX_BITS: u32 = 0x7F7F_0000;
/// f16 overflow threshold 65520 (f16::MAX + half an ulp) as f32 bits.
const F16_OVERFLOW_BITS: u32 = 0x477F_F000;
/// f16::MAX = 65504 as f32 bits.
const F16_MAX_BITS: u32 = 0x477F_E000;

/// Stochastic rounding of `x` to bf16: adds the low 16 bits of `noise` to the f32 bit pattern
/// and truncates, so the magnitude rounds up with probability (dropped bits) / 2^16 — exactly
/// unbiased. Subnormals need no special case (bf16 shares f32's exponent range). `noise = 0`
/// truncates toward zero. See the module docs for the overflow policy.
#[inline]
pub fn bf16_stochastic(x: f32, noise: u32) -> bf16 {
    let bits = x.to_bits();
    let a = bits & 0x7FFF_FFFF;
    if a >= 0x7F80_0000 {
        return bf16::from_f32(x); // inf, or NaN kept NaN (quieted)
    }
    if a > BF16_MAX_BITS {
        let sign = ((bits >> 16) & 0x8000) as u16;
        let mag = if a >= BF16_OVERFLOW_BITS {
            bf16::INFINITY
        } else {
            bf16::MAX
        };
        return bf16::from_bits(mag.to_bits() | sign);
    }
    // The magnitude is at most 0x7F7F_0000 + 0xFFFF: no carry into the sign bit.
    bf16::from_bits((bits.wrapping_add(noise & 0xFFFF) >> 16) as u16)
}

/// Stochastic rounding of `x` to f16 (10 fraction bits, normal range from 2^-14, subnormal
/// quantum 2^-24, max 65504).
///
/// With `rem / 2^s` the fraction of an f16 quantum that is dropped, the magnitude rounds up
/// iff `noise + ceil(rem * 2^32 / 2^s) >= 2^32`, i.e. with probability exactly `rem / 2^s`
/// when `s <= 32` (every `|x| >= 2^-33`, including all f16 normals where `s = 13`); for
/// smaller `|x|` the probability is rounded *up* to a multiple of 2^-32. As for bf16, `noise = 0`
/// truncates toward zero and larger noise rounds up more often. See the module docs for the
/// overflow policy.
#[inline]
pub fn f16_stochastic(x: f32, noise: u32) -> f16 {
    let bits = x.to_bits();
    let a = bits & 0x7FFF_FFFF;
    if a >= 0x7F80_0000 {
        return f16::from_f32(x); // inf, or NaN kept NaN
    }
    let sign = ((bits >> 16) & 0x8000) as u16;
    if a > F16_MAX_BITS {
        let mag = if a >= F16_OVERFLOW_BITS {
            f16::INFINITY
        } else {
            f16::MAX
        };
        return f16::from_bits(mag.to_bits() | sign);
    }
    // |x| = sig * 2^(e - 23); f32 subnormals have no implicit bit.
    let exp_field = (a >> 23) as i32;
    let (e, sig) = if exp_field == 0 {
        (-126, a & 0x7F_FFFF)
    } else {
        (exp_field - 127, (a & 0x7F_FFFF) | 0x80_0000)
    };
    // The f16 quantum at this magnitude is 2^(max(e, -14) - 10): drop s bits of sig (13..=125).
    let s = (e.max(-14) - 10 - (e - 23)) as u32;
    let sig = u128::from(sig);
    let mut n = sig >> s; // quanta, rounded toward zero
    let rem = sig & ((1u128 << s) - 1);
    let threshold = ((rem << 32) + (1u128 << s) - 1) >> s; // ceil(rem * 2^32 / 2^s) <= 2^32
    if u128::from(noise) + threshold >= 1u128 << 32 {
        n += 1;
    }
    // Subnormal: code = n; normal: the biased exponent (e + 15) << 10 plus n - 2^10, which
    // written as below also handles a carry into the next binade.
    let code = (((e.max(-14) + 14) as u128) << 10) + n;
    f16::from_bits(code as u16 | sign)
}

/// Counter-based noise for stochastic rounding: a hash of `(seed, step, index)` built from the
/// SplitMix64 finaliser (Steele et al. 2014; Stafford's "Mix13"), absorbing one word per
/// round. For fixed `(seed, step)` it is injective in `index` before the final truncation to
/// 32 bits (each round is a bijection), and likewise in `step` for fixed `(seed, index)`.
#[inline]
pub fn noise(seed: u64, step: u64, index: u64) -> u32 {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let h = mix64(seed.wrapping_add(GAMMA));
    let h = mix64(h ^ step.wrapping_add(GAMMA.wrapping_mul(2)));
    let h = mix64(h ^ index.wrapping_add(GAMMA.wrapping_mul(3)));
    (h >> 32) as u32
}

#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test inputs: random f32 bit patterns over the whole range plus ones concentrated in
    /// f16's range (2^-30 .. 2^16).
    fn inputs() -> Vec<f32> {
        let mut v = vec![0.0, -0.0, 1.0, -1.0, 1.0e-40, -1.0e-40, f32::MIN_POSITIVE];
        for i in 0..100_000u64 {
            let r = (u64::from(noise(1, 2, i)) << 32) | u64::from(noise(1, 3, i));
            v.push(f32::from_bits(r as u32));
            let exp = (127 - 30 + (r >> 40) % 46) as u32;
            v.push(f32::from_bits(
                ((r >> 32) as u32 & 0x807F_FFFF) | (exp << 23),
            ));
        }
        v.retain(|x| x.is_finite());
        v
    }

    /// The two f16 neighbours (in magnitude, with x's sign) of a finite in-range x, computed
    /// independently via f64 and `half`'s round-to-nearest.
    fn f16_neighbours(x: f32) -> (f16, f16) {
        let ax = f64::from(x.abs());
        let mut lo = f16::from_f64(ax);
        if lo.to_f64() > ax {
            lo = f16::from_bits(lo.to_bits() - 1);
        }
        let hi = if lo.to_f64() == ax {
            lo
        } else {
            f16::from_bits(lo.to_bits() + 1)
        };
        let s = if x.is_sign_negative() { 0x8000 } else { 0 };
        (
            f16::from_bits(lo.to_bits() | s),
            f16::from_bits(hi.to_bits() | s),
        )
    }

    #[test]
    fn bf16_result_is_a_neighbour_and_exact_values_are_kept() {
        for x in inputs() {
            let a = x.to_bits() & 0x7FFF_FFFF;
            if a > BF16_MAX_BITS {
                continue;
            }
            let lo = bf16::from_bits((x.to_bits() >> 16) as u16); // toward zero
            let exact = x.to_bits() & 0xFFFF == 0;
            for n in [0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x1234_5678, u32::MAX] {
                let r = bf16_stochastic(x, n);
                if exact {
                    assert_eq!(r.to_bits(), lo.to_bits(), "{x:e}");
                } else {
                    assert!(
                        r.to_bits() == lo.to_bits() || r.to_bits() == lo.to_bits() + 1,
                        "{x:e} noise {n:#x}: {r}"
                    );
                }
            }
            assert_eq!(bf16_stochastic(x, 0).to_bits(), lo.to_bits());
            assert_eq!(
                bf16_stochastic(-x, 0x9876).to_bits(),
                (-bf16_stochastic(x, 0x9876)).to_bits()
            );
        }
    }

    #[test]
    fn bf16_is_exactly_unbiased_over_all_noise_values() {
        // Includes a subnormal, a value just below a binade boundary, negatives, and a tiny
        // fraction (one 2^-16 of an ulp).
        let xs = [
            1.0f32 + 2f32.powi(-9),
            -3.3,
            1.0e-40,
            f32::from_bits(0x3F7F_FFFF),
            f32::from_bits(0x3F80_0001),
            -f32::from_bits(0x0080_8001),
            123_456.79,
        ];
        for x in xs {
            let sum: f64 = (0..=0xFFFFu32)
                .map(|n| f64::from(bf16_stochastic(x, n).to_f32()))
                .sum();
            assert_eq!(sum, f64::from(x) * 65536.0, "{x:e}");
        }
    }

    /// Stochastic rounding of `x` between `lo` and `lo + q` is a Bernoulli draw: the mean of
    /// `n` roundings (`round(i)` is the i-th) lies within 5 standard errors of `x`.
    fn assert_unbiased(x: f32, lo: f64, q: f64, n: u64, round: impl Fn(u64) -> f64) {
        let mean = (0..n).map(round).sum::<f64>() / n as f64;
        let p = (f64::from(x) - lo) / q;
        let sigma = q * (p * (1.0 - p) / n as f64).sqrt();
        assert!(
            (mean - f64::from(x)).abs() < 5.0 * sigma,
            "x {x:e}: mean {mean:e}, sigma {sigma:e}"
        );
    }

    #[test]
    fn bf16_mean_with_hashed_noise_is_within_statistical_bounds() {
        let x = 1.0f32 + 0.3 * 2f32.powi(-7); // 30% of the way from 1 to the next bf16
        assert_unbiased(x, 1.0, 2f64.powi(-7), 200_000, |i| {
            f64::from(bf16_stochastic(x, noise(42, 7, i)).to_f32())
        });
    }

    #[test]
    fn bf16_specials_and_overflow_policy() {
        assert!(bf16_stochastic(f32::NAN, 0xFFFF).is_nan());
        assert!(bf16_stochastic(-f32::NAN, 0).is_nan());
        assert_eq!(bf16_stochastic(f32::INFINITY, 0xFFFF), bf16::INFINITY);
        assert_eq!(bf16_stochastic(f32::NEG_INFINITY, 0), bf16::NEG_INFINITY);
        assert_eq!(bf16_stochastic(-0.0, 0xFFFF).to_bits(), 0x8000);
        assert_eq!(bf16_stochastic(bf16::MAX.to_f32(), u32::MAX), bf16::MAX);
        // Between MAX and the overflow threshold: MAX, whatever the noise.
        for bits in [BF16_MAX_BITS + 1, BF16_OVERFLOW_BITS - 1] {
            let x = f32::from_bits(bits);
            assert_eq!(bf16_stochastic(x, u32::MAX), bf16::MAX);
            assert_eq!(bf16_stochastic(-x, u32::MAX), bf16::MIN);
        }
        // At or above the threshold (where round-to-nearest gives inf): inf.
        assert_eq!(
            bf16_stochastic(f32::from_bits(BF16_OVERFLOW_BITS), 0),
            bf16::INFINITY
        );
        assert_eq!(bf16_stochastic(f32::MAX, 0), bf16::INFINITY);
        assert_eq!(bf16_stochastic(-f32::MAX, 0), bf16::NEG_INFINITY);
        assert_eq!(
            bf16::from_f32(f32::from_bits(BF16_OVERFLOW_BITS)),
            bf16::INFINITY
        );
        assert_eq!(
            bf16::from_f32(f32::from_bits(BF16_OVERFLOW_BITS - 1)),
            bf16::MAX
        );
    }

    #[test]
    fn f16_result_is_a_neighbour() {
        for x in inputs() {
            if x.abs() > 65504.0 {
                continue;
            }
            let (lo, hi) = f16_neighbours(x);
            for n in [
                0,
                1,
                0x8000_0000,
                0xFFFF_FFFE,
                u32::MAX,
                noise(3, 4, x.to_bits().into()),
            ] {
                let r = f16_stochastic(x, n);
                assert!(
                    r.to_bits() == lo.to_bits() || r.to_bits() == hi.to_bits(),
                    "{x:e} noise {n:#x}: {r} not in [{lo}, {hi}]"
                );
            }
            assert_eq!(f16_stochastic(x, 0).to_bits(), lo.to_bits(), "{x:e}");
            // Up as soon as the dropped fraction is nonzero (its probability is > 0).
            assert_eq!(f16_stochastic(x, u32::MAX).to_bits(), hi.to_bits(), "{x:e}");
            assert_eq!(
                f16_stochastic(-x, 12345).to_bits(),
                (-f16_stochastic(x, 12345)).to_bits()
            );
        }
    }

    /// For f16 normals exactly 13 bits are dropped, so the rule is the bf16 one with the top
    /// 13 bits of the noise: add `noise >> 19` and truncate.
    #[test]
    fn f16_normal_range_matches_add_and_truncate() {
        for x in inputs() {
            if !(f16::MIN_POSITIVE.to_f32()..=65504.0).contains(&x.abs()) {
                continue;
            }
            for i in 0..4 {
                let n = noise(9, i, x.to_bits().into());
                let t = (x.to_bits() + (n >> 19)) & !0x1FFF;
                let want = f16::from_f32(f32::from_bits(t)); // exact: t has 10 fraction bits
                let got = f16_stochastic(x, n);
                assert_eq!(got.to_bits(), want.to_bits(), "{x:e} noise {n:#x}");
            }
        }
    }

    /// Exact unbiasedness: when s bits are dropped (13 for normals, 13 + (-14 - e) for
    /// 2^e <= |x| < 2^(e+1) below the normal range) the decision depends only on the top s
    /// bits of the noise, so summing over all 2^s of them gives 2^s * x exactly.
    #[test]
    fn f16_is_exactly_unbiased_over_all_relevant_noise_values() {
        let cases: [(f32, u32); 6] = [
            (1.0 + 2f32.powi(-12), 13), // normal
            (-1000.3, 13),              // normal, negative
            (65503.9, 13),              // just below MAX
            (6.0e-5, 14),               // subnormal: 2^-15 <= x < 2^-14
            (-3.0e-7, 21),              // subnormal, negative: 2^-22 <= |x| < 2^-21
            (1.0e-7 + 3.0e-9, 23),      // between 2^-24 and 2^-23
        ];
        for (x, s) in cases {
            let sum: f64 = (0..1u64 << s)
                .map(|k| f64::from(f16_stochastic(x, (k << (32 - s)) as u32).to_f32()))
                .sum();
            assert_eq!(sum, f64::from(x) * 2f64.powi(s as i32), "{x:e}");
        }
    }

    #[test]
    fn f16_mean_with_hashed_noise_is_within_statistical_bounds() {
        // Normal, subnormal, and far below the smallest subnormal (probability 2^-10).
        for x in [
            1.0f32 + 0.7 * 2f32.powi(-10),
            0.25 * 2f32.powi(-24) + 2f32.powi(-22),
            2f32.powi(-34),
        ] {
            let (lo, hi) = f16_neighbours(x);
            let (lo, q) = (lo.to_f64(), hi.to_f64() - lo.to_f64());
            assert_unbiased(x, lo, q, 400_000, |i| {
                f16_stochastic(x, noise(5, 1, i)).to_f64()
            });
        }
    }

    #[test]
    fn f16_specials_and_overflow_policy() {
        assert!(f16_stochastic(f32::NAN, 0).is_nan());
        assert!(f16_stochastic(-f32::NAN, u32::MAX).is_nan());
        assert_eq!(f16_stochastic(f32::INFINITY, 0), f16::INFINITY);
        assert_eq!(
            f16_stochastic(f32::NEG_INFINITY, u32::MAX),
            f16::NEG_INFINITY
        );
        assert_eq!(f16_stochastic(-0.0, u32::MAX).to_bits(), 0x8000);
        assert_eq!(f16_stochastic(-1e-45, 0).to_bits(), 0x8000);
        assert_eq!(f16_stochastic(65504.0, u32::MAX), f16::MAX);
        for x in [65504.5f32, 65519.99] {
            assert_eq!(f16_stochastic(x, u32::MAX), f16::MAX);
            assert_eq!(f16_stochastic(-x, u32::MAX), f16::MIN);
        }
        for x in [65520.0f32, 65536.0, 1e10, f32::MAX] {
            assert_eq!(f16_stochastic(x, 0), f16::INFINITY);
            assert_eq!(f16_stochastic(-x, 0), f16::NEG_INFINITY);
            assert_eq!(f16::from_f32(x), f16::INFINITY); // what round-to-nearest does
        }
        assert_eq!(f16::from_f32(65519.99), f16::MAX);
        // Subnormal boundary: the largest subnormal rounds up into the smallest normal.
        let x = f16::MIN_POSITIVE.to_f32() - 2f32.powi(-26);
        assert_eq!(f16_stochastic(x, u32::MAX), f16::MIN_POSITIVE);
        assert_eq!(f16_stochastic(x, 0).to_bits(), 0x03FF);
    }

    #[test]
    fn noise_is_deterministic_and_well_mixed() {
        assert_eq!(noise(1, 2, 3), noise(1, 2, 3));
        assert_ne!(noise(1, 2, 3), noise(1, 2, 4));
        assert_ne!(noise(1, 2, 3), noise(1, 3, 3));
        assert_ne!(noise(1, 2, 3), noise(2, 2, 3));
        assert_ne!(noise(0, 0, 0), 0);
        // Swapping step and index gives a different stream.
        assert_ne!(noise(7, 3, 5), noise(7, 5, 3));
        // Uniformity: each bit is set about half the time, and a chi-square test over 256
        // buckets of the top byte, along index and along step.
        let n = 1u64 << 18;
        for stream in 0..2 {
            let draw = |i: u64| {
                if stream == 0 {
                    noise(11, 5, i)
                } else {
                    noise(11, i, 5)
                }
            };
            let mut ones = [0u64; 32];
            let mut buckets = [0u64; 256];
            let mut corr = 0f64;
            let mut prev = 0.0;
            for i in 0..n {
                let v = draw(i);
                for (b, c) in ones.iter_mut().enumerate() {
                    *c += u64::from((v >> b) & 1);
                }
                buckets[(v >> 24) as usize] += 1;
                let u = f64::from(v) / 2f64.powi(32) - 0.5;
                corr += u * prev;
                prev = u;
            }
            let sd = (n as f64 * 0.25).sqrt();
            for c in ones {
                assert!(
                    (c as f64 - n as f64 / 2.0).abs() < 5.0 * sd,
                    "bit count {c}"
                );
            }
            let e = n as f64 / 256.0;
            let chi2: f64 = buckets.iter().map(|&c| (c as f64 - e).powi(2) / e).sum();
            // 255 degrees of freedom: mean 255, sd ~22.6; 400 is > 6 sd.
            assert!(chi2 < 400.0, "chi2 {chi2}");
            // Lag-1 correlation of consecutive counters: sd of the estimate ~ 1/(12 sqrt n).
            let r = corr / (n as f64 / 12.0);
            assert!(r.abs() < 5.0 / (n as f64).sqrt(), "lag-1 correlation {r}");
        }
    }
}
