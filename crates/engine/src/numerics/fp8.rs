//! OCP 8-bit floating point (Micikevicius et al. 2022, "FP8 Formats for Deep Learning";
//! OCP "8-bit Floating Point Specification (OFP8)" v1.0), simulated on the CPU.
//!
//! | format | bias | max normal | min normal | min subnormal | inf | NaN |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | E4M3 (the "fn" variant: finite + NaN) | 7 | 448 | 2^-6 | 2^-9 | none | S.1111.111 |
//! | E5M2 (IEEE-754-like) | 15 | 57344 | 2^-14 | 2^-16 | S.11111.00 | S.11111.{01,10,11} |
//!
//! **Rounding.** [`encode`] rounds to nearest, ties to even, with gradual underflow (subnormals).
//! Finite values beyond the format's range *saturate* to ±max, as Transformer Engine's scaled
//! casts do (CUDA's `__NV_SATFINITE`). Non-finite inputs stay non-finite: NaN encodes as
//! `S.1111111` (the sign is kept), +/-inf becomes ±inf in E5M2 and NaN in E4M3, which has no
//! infinity. Keeping infinities non-finite (where `__NV_SATFINITE` would clamp them to max)
//! lets an overflow upstream still be detected downstream, e.g. by the dynamic loss scaler.
//!
//! PyTorch (2.15, CPU) differs out of range: `x.to(torch.float8_e4m3fn)` saturates finite
//! values like we do but also maps ±inf to ±448, and `x.to(torch.float8_e5m2)` does not
//! saturate (values that round past 57344 become ±inf). Within range the casts are
//! bit-identical; `tests/fp8.rs` checks both facts against `tests/reference/fp8_reference.py`.
//!
//! **Scaling.** Per-tensor *current* scaling: the scale of a tensor is computed from that
//! same tensor's amax, just before the cast ([`amax`], [`scale_for`]); this is Transformer
//! Engine's `Float8CurrentScaling` recipe, not the *delayed* scaling recipe, which derives the
//! scale from an amax history of previous steps. The scale is `max / amax` rounded down to a
//! power of two (TE's margin-0 formula, restricted to powers of two), so multiplying by it and
//! dividing by it again are exact.

use rayon::prelude::*;

/// An OCP FP8 format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, bias 7, finite-only ("e4m3fn"): max 448.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, bias 15, IEEE-like with inf and NaN: max 57344.
    E5M2,
}

impl Fp8Format {
    /// Largest finite magnitude: 448 (E4M3) or 57344 (E5M2).
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The conventional name ("e4m3" / "e5m2").
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// Mantissa (fraction) bits.
    fn mbits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// Unbiased exponent of the smallest normal value (1 - bias).
    fn emin(self) -> i32 {
        match self {
            Fp8Format::E4M3 => -6,
            Fp8Format::E5M2 => -14,
        }
    }

    /// Code (without sign) of the largest finite value.
    fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }
}

/// Code (without sign) used for NaN: `S.1111111` in both formats.
const NAN_CODE: u8 = 0x7F;
/// E5M2 infinity (without sign).
const E5M2_INF_CODE: u8 = 0x7C;
/// The f32 NaN that [`decode`] and [`round_trip`] return (with the sign of the input).
const NAN_BITS: u32 = 0x7FC0_0000;

/// Encodes `x` in `fmt`: round to nearest even, subnormals, saturation of finite values to
/// ±max, NaN → `S.1111111`, ±inf → ±inf (E5M2) or NaN (E4M3). See the module docs.
pub fn encode(fmt: Fp8Format, x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | NAN_CODE;
    }
    if x.is_infinite() {
        return sign
            | match fmt {
                Fp8Format::E4M3 => NAN_CODE,
                Fp8Format::E5M2 => E5M2_INF_CODE,
            };
    }
    let a = x.abs();
    if a >= fmt.max() {
        return sign | fmt.max_code();
    }
    let exp_field = ((bits >> 23) & 0xFF) as i32;
    if exp_field == 0 {
        // Zero or an f32 subnormal (< 2^-126): far below half the smallest fp8 subnormal.
        return sign;
    }
    let (m, emin) = (fmt.mbits() as i32, fmt.emin());
    let e = exp_field - 127;
    // x = sig * 2^(e - 23) with a 24-bit significand.
    let sig = u64::from((bits & 0x7F_FFFF) | 0x80_0000);
    // The fp8 quantum at this magnitude is 2^(max(e, emin) - m); drop `s` bits of `sig`.
    let s = (e.max(emin) - m - (e - 23)) as u32; // >= 23 - m
    if s >= 25 {
        return sign; // sig / 2^s < 1/2: rounds to zero
    }
    let half = 1u64 << (s - 1);
    let rem = sig & ((1u64 << s) - 1);
    let mut n = sig >> s; // number of quanta, rounded down
    if rem > half || (rem == half && n & 1 == 1) {
        n += 1;
    }
    // Subnormal: code = n. Normal: biased exponent (e - emin + 1) << m plus the fraction
    // n - 2^m; a carry n = 2^(m+1) lands on the next binade by itself.
    let code = ((e.max(emin) - emin) as u64) << m as u32;
    sign | (code + n).min(u64::from(fmt.max_code())) as u8
}

/// Decodes an fp8 code exactly. NaN codes give an f32 NaN (`0x7FC00000` with the code's sign).
pub fn decode(fmt: Fp8Format, b: u8) -> f32 {
    let neg = b & 0x80 != 0;
    let (m, emin) = (fmt.mbits(), fmt.emin());
    let exp_field = i32::from((b & 0x7F) >> m);
    let frac = u32::from(b) & ((1 << m) - 1);
    let mag = match fmt {
        Fp8Format::E4M3 if b & 0x7F == NAN_CODE => f32::from_bits(NAN_BITS),
        Fp8Format::E5M2 if exp_field == 31 && frac == 0 => f32::INFINITY,
        Fp8Format::E5M2 if exp_field == 31 => f32::from_bits(NAN_BITS),
        _ if exp_field == 0 => frac as f32 * pow2(emin - m as i32),
        _ => ((1 << m) + frac) as f32 * pow2(exp_field - 1 + emin - m as i32),
    };
    if neg {
        -mag
    } else {
        mag
    }
}

/// `decode(fmt, encode(fmt, x))`, bit for bit, computed without the branches of [`encode`]:
/// normal magnitudes are rounded on the f32 bit pattern, subnormal ones with an add/subtract
/// of a power of two (the FPU's round-to-nearest-even does the rounding), and saturation is a
/// `min`. Written so that loops over slices vectorize.
#[inline]
pub fn round_trip(fmt: Fp8Format, x: f32) -> f32 {
    match fmt {
        Fp8Format::E4M3 => round_trip_e4m3(x),
        Fp8Format::E5M2 => round_trip_e5m2(x),
    }
}

#[inline(always)]
fn round_trip_e4m3(x: f32) -> f32 {
    // min normal 2^-6; subnormal quantum 2^-9 = ulp of 2^14 in f32; inf -> NaN.
    round_trip_impl::<3>(x, 1.0 / 64.0, 16384.0, 448.0, NAN_BITS)
}

#[inline(always)]
fn round_trip_e5m2(x: f32) -> f32 {
    // min normal 2^-14; subnormal quantum 2^-16 = ulp of 2^7 in f32; inf -> inf.
    round_trip_impl::<2>(x, 1.0 / 16384.0, 128.0, 57344.0, 0x7F80_0000)
}

/// Branch-light round trip through a format with `M` mantissa bits.
///
/// * `min_normal`: smallest normal magnitude of the format;
/// * `magic`: the power of two whose f32 ulp is the format's subnormal quantum, so that
///   `(a + magic) - magic` rounds `a < min_normal` to a multiple of that quantum (ties to even);
/// * `max`: largest finite magnitude (saturation);
/// * `inf_bits`: the f32 bit pattern an infinite input becomes (inf or NaN).
#[inline(always)]
fn round_trip_impl<const M: u32>(
    x: f32,
    min_normal: f32,
    magic: f32,
    max: f32,
    inf_bits: u32,
) -> f32 {
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let a = bits & 0x7FFF_FFFF;
    let ax = f32::from_bits(a);
    // Normal range: round the f32 pattern to M fraction bits, ties to even. A carry out of the
    // fraction correctly increments the exponent; finite inputs give at most +inf.
    let shift = 23 - M;
    let bias = ((1u32 << (shift - 1)) - 1) + ((a >> shift) & 1);
    let normal = f32::from_bits(a.wrapping_add(bias) & !((1u32 << shift) - 1));
    // Subnormal range: the addition rounds to a multiple of the subnormal quantum.
    let sub = (ax + magic) - magic;
    let r = if ax < min_normal { sub } else { normal };
    let r = r.min(max).to_bits();
    // Non-finite inputs: NaN -> NaN, inf -> inf_bits.
    let r = if a < 0x7F80_0000 {
        r
    } else if a == 0x7F80_0000 {
        inf_bits
    } else {
        NAN_BITS
    };
    f32::from_bits(r | sign)
}

/// 2^e for e in the normal f32 exponent range.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Slices at least this long are processed in parallel.
const PAR_MIN_LEN: usize = 1 << 16;
const PAR_CHUNK: usize = 1 << 14;

/// Largest magnitude in `x` (0 for an empty slice); NaN if `x` contains a NaN, +inf if it
/// contains an infinity and no NaN. Parallel for large slices and deterministic: it is a max
/// over the magnitudes' bit patterns, which is independent of the order of evaluation (among
/// several NaNs the one with the largest payload is returned).
pub fn amax(x: &[f32]) -> f32 {
    fn chunk_max(c: &[f32]) -> u32 {
        // |x| as u32 orders like |x|, with NaNs above inf.
        c.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF))
    }
    let m = if x.len() >= PAR_MIN_LEN {
        x.par_chunks(PAR_CHUNK).map(chunk_max).max().unwrap_or(0)
    } else {
        chunk_max(x)
    };
    f32::from_bits(m)
}

/// The per-tensor scale for a tensor with the given `amax`: the largest power of two `2^k` with
/// `amax * 2^k <= fmt.max()`, i.e. `2^floor(log2(max / amax))` computed exactly. Returns 1
/// when `amax` is 0, negative or not finite (nothing to scale, or an overflow that the caller
/// must see). `k` is clamped to [-126, 126] so that both the scale and its inverse are normal
/// f32 numbers.
pub fn scale_for(fmt: Fp8Format, amax: f32) -> f32 {
    if !(amax.is_finite() && amax > 0.0) {
        return 1.0;
    }
    // Via f64 so that f32 subnormals are normal: amax = ma * 2^ea, max = mm * 2^em, with
    // ma, mm in [1, 2); floor(log2(max / amax)) = em - ea - (mm < ma).
    let (ea, ma) = exp_frac(f64::from(amax));
    let (em, mm) = exp_frac(f64::from(fmt.max()));
    let k = em - ea - i32::from(mm < ma);
    pow2(k.clamp(-126, 126))
}

/// (unbiased exponent, fraction bits) of a positive normal f64.
fn exp_frac(v: f64) -> (i32, u64) {
    let b = v.to_bits();
    (((b >> 52) & 0x7FF) as i32 - 1023, b & ((1u64 << 52) - 1))
}

/// Simulated fp8 quantization with a per-tensor scale:
/// `out[i] = round_trip(fmt, x[i] * scale) / scale`.
///
/// With a power-of-two `scale` (as [`scale_for`] returns) the multiplication and the division
/// are exact (barring results below f32's normal range), so the only error is the fp8
/// rounding itself. Parallel for large slices; elementwise, so deterministic.
///
/// # Panics
/// If `x` and `out` differ in length.
pub fn quantize_dequantize(fmt: Fp8Format, x: &[f32], out: &mut [f32], scale: f32) {
    assert_eq!(
        x.len(),
        out.len(),
        "quantize_dequantize: input has {} elements, output {}",
        x.len(),
        out.len()
    );
    let inv = 1.0 / scale;
    // Multiplying by 1/scale is the same as dividing by scale when both are normal powers of
    // two; otherwise divide.
    let pow2_scale = scale.is_normal() && inv.is_normal() && scale.to_bits() & 0x7F_FFFF == 0;
    let run = |xs: &[f32], os: &mut [f32]| match (fmt, pow2_scale) {
        (Fp8Format::E4M3, true) => qdq(xs, os, |v| round_trip_e4m3(v * scale) * inv),
        (Fp8Format::E5M2, true) => qdq(xs, os, |v| round_trip_e5m2(v * scale) * inv),
        (Fp8Format::E4M3, false) => qdq(xs, os, |v| round_trip_e4m3(v * scale) / scale),
        (Fp8Format::E5M2, false) => qdq(xs, os, |v| round_trip_e5m2(v * scale) / scale),
    };
    if x.len() >= PAR_MIN_LEN {
        x.par_chunks(PAR_CHUNK)
            .zip(out.par_chunks_mut(PAR_CHUNK))
            .for_each(|(xs, os)| run(xs, os));
    } else {
        run(x, out);
    }
}

#[inline(always)]
fn qdq(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits()
    }

    /// A small deterministic generator (SplitMix64) for test inputs.
    fn splitmix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn decode_known_values() {
        use Fp8Format::*;
        assert_eq!(decode(E4M3, 0x7E), 448.0);
        assert_eq!(decode(E4M3, 0xFE), -448.0);
        assert_eq!(decode(E4M3, 0x38), 1.0);
        assert_eq!(decode(E4M3, 0x08), 2f32.powi(-6));
        assert_eq!(decode(E4M3, 0x01), 2f32.powi(-9));
        assert_eq!(decode(E4M3, 0x07), 7.0 * 2f32.powi(-9));
        assert!(decode(E4M3, 0x7F).is_nan() && decode(E4M3, 0xFF).is_nan());
        assert_eq!(decode(E4M3, 0x78), 256.0); // E4M3 uses exponent 15 for normals
        assert_eq!(decode(E5M2, 0x7B), 57344.0);
        assert_eq!(decode(E5M2, 0x3C), 1.0);
        assert_eq!(decode(E5M2, 0x04), 2f32.powi(-14));
        assert_eq!(decode(E5M2, 0x01), 2f32.powi(-16));
        assert_eq!(decode(E5M2, 0x7C), f32::INFINITY);
        assert_eq!(decode(E5M2, 0xFC), f32::NEG_INFINITY);
        for b in [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF] {
            assert!(decode(E5M2, b).is_nan());
        }
        assert!(same(decode(E4M3, 0x80), -0.0));
        for fmt in FORMATS {
            assert_eq!(decode(fmt, fmt.max_code()), fmt.max());
        }
    }

    #[test]
    fn encode_inverts_decode_on_all_codes() {
        for fmt in FORMATS {
            for b in 0..=255u8 {
                let v = decode(fmt, b);
                // NaN codes (E5M2 has three per sign) encode back to the canonical S.1111111.
                let want = if v.is_nan() { (b & 0x80) | NAN_CODE } else { b };
                assert_eq!(encode(fmt, v), want, "{} code {b:#04x} = {v}", fmt.name());
            }
        }
    }

    #[test]
    fn decode_is_monotone_over_positive_codes() {
        for fmt in FORMATS {
            let pos: Vec<f32> = (0..=fmt.max_code()).map(|b| decode(fmt, b)).collect();
            assert!(pos.windows(2).all(|w| w[0] < w[1]), "{}", fmt.name());
        }
    }

    #[test]
    fn ties_round_to_even_and_saturation() {
        use Fp8Format::*;
        // E4M3 around 1: neighbours 1, 1.125, 1.25.
        assert_eq!(round_trip(E4M3, 1.0625), 1.0); // tie -> even (1.0)
        assert_eq!(round_trip(E4M3, 1.1875), 1.25); // tie -> even (1.25)
        assert_eq!(round_trip(E4M3, 1.0626), 1.125);
        // Subnormal ties: 0.5 and 1.5 quanta.
        let q = 2f32.powi(-9);
        assert_eq!(round_trip(E4M3, 0.5 * q), 0.0);
        assert_eq!(round_trip(E4M3, 1.5 * q), 2.0 * q);
        assert_eq!(round_trip(E4M3, 0.50001 * q), q);
        // Saturation of finite values, infinities kept non-finite.
        assert_eq!(round_trip(E4M3, 449.0), 448.0);
        assert_eq!(round_trip(E4M3, -1e30), -448.0);
        assert_eq!(round_trip(E4M3, f32::MAX), 448.0);
        assert!(round_trip(E4M3, f32::INFINITY).is_nan());
        assert_eq!(round_trip(E5M2, 61440.0), 57344.0);
        assert_eq!(round_trip(E5M2, -1e30), -57344.0);
        assert_eq!(round_trip(E5M2, f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!(round_trip(E5M2, f32::NAN).is_nan());
        assert!(same(round_trip(E5M2, -0.0), -0.0));
        assert!(same(round_trip(E4M3, -1e-30), -0.0));
    }

    /// Every input class: all codes, their midpoints and the f32 values next to them, plus
    /// random bit patterns over the whole f32 range.
    fn test_inputs() -> Vec<f32> {
        let mut v = Vec::new();
        for fmt in FORMATS {
            let mut vals: Vec<f32> = (0..=255u8)
                .map(|b| decode(fmt, b))
                .filter(|v| !v.is_nan())
                .collect();
            vals.sort_by(f32::total_cmp);
            for w in vals.windows(2) {
                if w[0].is_finite() && w[1].is_finite() {
                    let mid = ((f64::from(w[0]) + f64::from(w[1])) / 2.0) as f32;
                    v.extend([mid, next_up(mid), next_down(mid)]);
                }
            }
            // Just above the largest value: the overflow/saturation boundary region.
            let top = fmt.max();
            let mut t = top;
            for _ in 0..64 {
                v.push(t);
                t = next_up(t);
            }
            v.extend(vals);
        }
        for bits in [
            0u32,
            1,
            0x7F_FFFF,
            0x80_0000,
            0x7F7F_FFFF,
            0x7F80_0000,
            0x7FC0_0000,
        ] {
            v.push(f32::from_bits(bits));
            v.push(f32::from_bits(bits | 0x8000_0000));
        }
        // Random bit patterns, and random patterns restricted to exponents near fp8's range.
        let mut s = 7u64;
        for _ in 0..200_000 {
            let r = splitmix(&mut s);
            v.push(f32::from_bits(r as u32));
            let exp = 127 - 24 + (r >> 40) % 44; // 2^-24 .. 2^19
            v.push(f32::from_bits(
                ((r >> 32) as u32 & 0x807F_FFFF) | ((exp as u32) << 23),
            ));
        }
        v
    }

    fn next_up(x: f32) -> f32 {
        if x >= 0.0 {
            f32::from_bits(x.to_bits() + 1)
        } else {
            f32::from_bits(x.to_bits() - 1)
        }
    }

    fn next_down(x: f32) -> f32 {
        -next_up(-x)
    }

    #[test]
    fn round_trip_matches_encode_decode_bit_for_bit() {
        for fmt in FORMATS {
            for x in test_inputs() {
                let want = decode(fmt, encode(fmt, x));
                let got = round_trip(fmt, x);
                assert!(
                    same(got, want),
                    "{} x = {x:e} ({:#010x}): round_trip {got:e}, decode(encode) {want:e}",
                    fmt.name(),
                    x.to_bits()
                );
            }
        }
    }

    /// Round to nearest: no fp8 value is strictly closer to x than the result (checked in
    /// f64 against all 256 codes, for in-range inputs).
    #[test]
    fn encode_is_nearest() {
        for fmt in FORMATS {
            let vals: Vec<f64> = (0..=255u8)
                .map(|b| f64::from(decode(fmt, b)))
                .filter(|v| v.is_finite())
                .collect();
            let mut s = 11u64;
            for _ in 0..20_000 {
                let r = splitmix(&mut s);
                let x = ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
                    * fmt.max()
                    * 2f32.powi(-((r % 24) as i32));
                let got = f64::from(decode(fmt, encode(fmt, x)));
                let best = vals
                    .iter()
                    .map(|v| (v - f64::from(x)).abs())
                    .fold(f64::INFINITY, f64::min);
                assert_eq!((got - f64::from(x)).abs(), best, "{} x = {x:e}", fmt.name());
            }
        }
    }

    #[test]
    fn amax_and_scale() {
        assert_eq!(amax(&[]), 0.0);
        assert_eq!(amax(&[1.0, -3.0, 2.0]), 3.0);
        assert!(amax(&[1.0, f32::NAN, f32::INFINITY]).is_nan());
        assert_eq!(amax(&[1.0, f32::NEG_INFINITY]), f32::INFINITY);
        // Parallel path: same answer as the serial one, whatever the position of the max.
        let mut s = 3u64;
        let mut big: Vec<f32> = (0..300_001)
            .map(|_| (splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        big[123_457] = -7.25;
        assert_eq!(amax(&big), 7.25);
        assert_eq!(amax(&big), big.iter().fold(0f32, |m, v| m.max(v.abs())));

        use Fp8Format::*;
        assert_eq!(scale_for(E4M3, 448.0), 1.0);
        assert_eq!(scale_for(E4M3, 448.5), 0.5);
        assert_eq!(scale_for(E4M3, 224.0), 2.0);
        assert_eq!(scale_for(E4M3, 223.9), 2.0);
        assert_eq!(scale_for(E4M3, 1.0), 256.0); // 448 / 1 = 448 -> 256
        assert_eq!(scale_for(E5M2, 1.0), 32768.0);
        assert_eq!(scale_for(E5M2, 57344.0), 1.0);
        assert_eq!(scale_for(E4M3, 1e6), 2f32.powi(-12));
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert_eq!(scale_for(E4M3, bad), 1.0);
        }
        assert_eq!(scale_for(E4M3, 1e-44), 2f32.powi(126)); // clamped
        assert_eq!(scale_for(E4M3, 1e30), 2f32.powi(-91)); // log2(448 / 1e30) = -90.85
                                                           // The defining property, over many amax values.
        for fmt in FORMATS {
            let mut s = 5u64;
            for _ in 0..10_000 {
                let r = splitmix(&mut s);
                let a = f32::from_bits(
                    ((r as u32) & 0x7F_FFFF) | (((60 + (r >> 32) % 130) as u32) << 23),
                );
                let k = scale_for(fmt, a);
                assert!(f64::from(a) * f64::from(k) <= f64::from(fmt.max()), "{a:e}");
                assert!(
                    f64::from(a) * f64::from(k) * 2.0 > f64::from(fmt.max()),
                    "{a:e}"
                );
            }
        }
    }

    #[test]
    fn quantize_dequantize_uses_the_scale_exactly() {
        let mut s = 9u64;
        for n in [0usize, 1, 1000, 100_003] {
            let x: Vec<f32> = (0..n)
                .map(|_| ((splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e-3)
                .collect();
            for fmt in FORMATS {
                let scale = scale_for(fmt, amax(&x));
                let mut out = vec![0.0; n];
                quantize_dequantize(fmt, &x, &mut out, scale);
                for (&o, &v) in out.iter().zip(&x) {
                    assert!(same(o, round_trip(fmt, v * scale) / scale));
                    // Relative error within half an fp8 ulp for normal-range values.
                    if (v * scale).abs() >= 2f32.powi(fmt.emin()) {
                        let rel = ((o - v) / v).abs();
                        assert!(rel <= 2f32.powi(-(fmt.mbits() as i32) - 1), "{v} -> {o}");
                    }
                }
                // A non-power-of-two scale takes the dividing path.
                quantize_dequantize(fmt, &x, &mut out, 3.0);
                for (&o, &v) in out.iter().zip(&x) {
                    assert!(same(o, round_trip(fmt, v * 3.0) / 3.0));
                }
            }
        }
    }
}
