//! Small vectorisable building blocks shared by the CPU kernels.
//!
//! The crate is compiled for baseline x86-64 (SSE2), so hot loops are written generic over a
//! `const FMA: bool` and instantiated inside `#[target_feature]` wrappers chosen at run time
//! ([`Tier`]): AVX-512 (512-bit vectors, on CPUs that have AVX-512F/BW/VL), AVX2 + FMA, or the
//! baseline. With `FMA = false` we never call `mul_add`, which would otherwise lower to a slow
//! libm `fmaf` call.
//!
//! The AVX-512 and AVX2 wrappers compile the same `FMA = true` code: every reduction keeps its
//! order through explicit partial sums ([`LANES`]) and every product-sum is an explicit
//! `mul_add`, and LLVM does not reassociate f32 arithmetic, so the two give bit-identical
//! results; only the vector width differs (tests below check it on random inputs).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// Lanes of independent accumulators: lets LLVM keep two AVX2 registers of partial sums
/// (f32 reductions are not reassociated without them).
const LANES: usize = 16;

/// True when the CPU supports AVX2 + FMA (checked once, cached by std).
#[inline]
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True when the CPU supports the AVX-512 subset the wide wrappers are compiled for (F for
/// 512-bit f32 arithmetic, BW and VL for the 16-bit conversions and narrower tails), on top of
/// AVX2 + FMA. Every AVX-512 CPU since Skylake-SP (2017) has all three.
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The instruction set a `dispatch_fma!` function runs with, ordered narrowest to widest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// SSE2 only, no fused multiply-add (`FMA = false`).
    Baseline,
    /// 256-bit AVX2 with FMA.
    Avx2,
    /// 512-bit AVX-512F/BW/VL with FMA.
    Avx512,
}

impl Tier {
    /// Whether this CPU can run the tier.
    pub fn supported(self) -> bool {
        match self {
            Tier::Baseline => true,
            Tier::Avx2 => has_avx2_fma(),
            Tier::Avx512 => has_avx512(),
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Tests pin the tier of dispatched calls made on their own thread ([`with_tier`]).
    static PINNED: std::cell::Cell<Option<Tier>> = const { std::cell::Cell::new(None) };
}

/// The widest tier the process may use: `FERROTRON_SIMD=avx2|baseline` caps it (to measure on
/// an AVX-512 machine what a machine without it runs; `auto` or unset: no cap), and
/// [`limit_tier`] changes it (benchmarks alternating tiers). Stored as the tier's index.
static LIMIT: AtomicU8 = AtomicU8::new(u8::MAX);

/// Caps the tier of every dispatched call from now on (`Tier::Avx512`: no cap).
pub fn limit_tier(t: Tier) {
    LIMIT.store(t as u8, Ordering::Relaxed);
}

/// The cap from `FERROTRON_SIMD`, read once; an unknown value is reported once and ignored.
fn env_limit() -> Tier {
    static ENV: OnceLock<Tier> = OnceLock::new();
    *ENV.get_or_init(|| match std::env::var("FERROTRON_SIMD").as_deref() {
        Ok("baseline") => Tier::Baseline,
        Ok("avx2") => Tier::Avx2,
        Ok("avx512") | Ok("auto") | Ok("") | Err(_) => Tier::Avx512,
        Ok(other) => {
            eprintln!("note: FERROTRON_SIMD={other:?} is not baseline|avx2|auto: using auto");
            Tier::Avx512
        }
    })
}

/// The widest tier this CPU supports, under the process's cap (or, in this crate's unit tests,
/// the one pinned on the calling thread by [`with_tier`]).
#[inline]
pub fn tier() -> Tier {
    #[cfg(test)]
    if let Some(t) = PINNED.with(|p| p.get()) {
        return t;
    }
    let cap = match LIMIT.load(Ordering::Relaxed) {
        u8::MAX => {
            let t = env_limit();
            LIMIT.store(t as u8, Ordering::Relaxed);
            t
        }
        i => [Tier::Baseline, Tier::Avx2, Tier::Avx512][i as usize],
    };
    let widest = if has_avx512() {
        Tier::Avx512
    } else if has_avx2_fma() {
        Tier::Avx2
    } else {
        Tier::Baseline
    };
    widest.min(cap)
}

/// Runs `f` with the dispatched functions it calls on this thread pinned to `t`; `None`
/// (nothing run) when the CPU lacks `t`. For tests comparing tiers on the same inputs.
#[cfg(test)]
pub fn with_tier<R>(t: Tier, f: impl FnOnce() -> R) -> Option<R> {
    if !t.supported() {
        return None;
    }
    let before = PINNED.with(|p| p.replace(Some(t)));
    let r = f();
    PINNED.with(|p| p.set(before));
    Some(r)
}

/// A rayon pool of `threads` workers pinned to tier `t` (for tests of whole parallel
/// kernels); `None` when the CPU lacks `t`.
#[cfg(test)]
pub fn pool_with_tier(t: Tier, threads: usize) -> Option<rayon::ThreadPool> {
    if !t.supported() {
        return None;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .start_handler(move |_| PINNED.with(|p| p.set(Some(t))))
        .build()
        .expect("test thread pool");
    Some(pool)
}

/// `a·b + c`, fused when the target has FMA.
#[inline(always)]
pub fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Dot product with `LANES` independent partial sums.
#[inline(always)]
pub fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let b = &b[..n];
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] = madd::<FMA>(xa[l], xb[l], acc[l]);
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = madd::<FMA>(*x, *y, tail);
    }
    hsum(&acc) + tail
}

/// `Σ a⊙b⊙c` with `LANES` partial sums.
#[inline(always)]
pub fn dot3<const FMA: bool>(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let n = a.len();
    let (b, c) = (&b[..n], &c[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    let mut cc = c.chunks_exact(LANES);
    for ((xa, xb), xc) in (&mut ca).zip(&mut cb).zip(&mut cc) {
        for l in 0..LANES {
            acc[l] = madd::<FMA>(xa[l] * xb[l], xc[l], acc[l]);
        }
    }
    let mut tail = 0.0f32;
    for ((x, y), z) in ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .zip(cc.remainder())
    {
        tail = madd::<FMA>(*x * *y, *z, tail);
    }
    hsum(&acc) + tail
}

/// Σ x² with `LANES` partial sums.
#[inline(always)]
pub fn sum_sq<const FMA: bool>(a: &[f32]) -> f32 {
    dot::<FMA>(a, a)
}

/// Pairwise horizontal sum of the lane accumulators.
#[inline(always)]
fn hsum(acc: &[f32; LANES]) -> f32 {
    let mut h = [0.0f32; LANES / 2];
    for l in 0..LANES / 2 {
        h[l] = acc[l] + acc[l + LANES / 2];
    }
    let mut s = 0.0f32;
    for x in h {
        s += x;
    }
    s
}

/// Vectorisable `exp(x)` for f32, relative error ≤ ~2 ulp on the range that matters.
///
/// Cephes `expf`: `x = n·ln2 + r`, `|r| ≤ ln2/2`, `exp(r)` by a degree-6 minimax polynomial,
/// `2ⁿ` built from the exponent bits. Inputs below −87.3 (where `2ⁿ` would be subnormal)
/// return 0, which is what softmax wants; from ≈88.38 up it returns +inf (true f32 overflow
/// is at 88.72; the kernels only call it on `x ≤ 0` or inside a sigmoid, where this is exact
/// enough).
#[inline(always)]
pub fn exp_f32<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2E).round();
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    p = madd::<FMA>(p, r, 1.398_199_9e-3);
    p = madd::<FMA>(p, r, 8.333_452e-3);
    p = madd::<FMA>(p, r, 4.166_579_6e-2);
    p = madd::<FMA>(p, r, 1.666_666_5e-1);
    p = madd::<FMA>(p, r, 0.5); // Cephes 5.0000001201e-1 rounds to 0.5 in f32
    let e = madd::<FMA>(p, r * r, r) + 1.0;
    // n is an integer in [-126, 128]: adding 1.5·2²³ puts it in the low mantissa bits exactly
    // (the "magic number" conversion), the same integer `n as i32` gives, but without the
    // saturating float-to-int cast, which LLVM does not vectorise for AVX-512.
    let ni = ((n + 12_582_912.0).to_bits() as i32).wrapping_sub(0x4B40_0000);
    let pow2n = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let y = e * pow2n;
    if x < -87.3 {
        0.0
    } else if x > 88.7 {
        f32::INFINITY
    } else {
        y
    }
}

/// `dispatch_fma!(fn name => generic(args...) -> ret)` defines `name(args...)`, which calls
/// `generic::<true>` inside a `#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]`
/// or a `#[target_feature(enable = "avx2,fma")]` function, by the CPU's [`tier`], and
/// `generic::<false>` on the baseline. `generic` must be `#[inline(always)]` (so it is compiled
/// with the wrapper's features) and must not spawn closures that do the work (a closure is its
/// own function, compiled without them): dispatch inside each rayon task.
#[macro_export]
#[doc(hidden)]
macro_rules! dispatch_fma {
    // `fn name => generic(...)`, or generic over element types: `fn name<S: Elem, G: Elem> =>
    // generic(...)` calls `generic::<true, S, G>`.
    ($(#[$meta:meta])* $vis:vis fn $name:ident $(< $($g:ident : $b:path),+ >)? => $generic:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(< $($g: $b),+ >)? ($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide $(< $($g: $b),+ >)? ($($arg: $ty),*) $(-> $ret)? {
                    $generic::<true $($(, $g)+)?>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn fast $(< $($g: $b),+ >)? ($($arg: $ty),*) $(-> $ret)? {
                    $generic::<true $($(, $g)+)?>($($arg),*)
                }
                match $crate::kernels::cpu::simd::tier() {
                    // SAFETY: the CPU supports the features `wide` was compiled for.
                    $crate::kernels::cpu::simd::Tier::Avx512 => {
                        return unsafe { wide::<$($($g),+)?>($($arg),*) }
                    }
                    // SAFETY: the CPU supports the features `fast` was compiled for.
                    $crate::kernels::cpu::simd::Tier::Avx2 => {
                        return unsafe { fast::<$($($g),+)?>($($arg),*) }
                    }
                    $crate::kernels::cpu::simd::Tier::Baseline => {}
                }
            }
            $generic::<false $($(, $g)+)?>($($arg),*)
        }
    };
}

/// Test support: run a dispatched kernel on every tier the CPU has and compare.
#[cfg(test)]
pub(crate) mod tiers {
    use super::{with_tier, Tier};
    use crate::dtype::Elem;

    /// `x` rounded into storage type `S`.
    pub fn stored<S: Elem>(x: &[f32]) -> Vec<S> {
        x.iter().map(|&v| S::from_f32(v)).collect()
    }

    /// `x` widened to f32.
    pub fn widened<S: Elem>(x: &[S]) -> Vec<f32> {
        x.iter().map(|v| v.to_f32()).collect()
    }

    /// `n` pseudo-random floats in `[-scale, scale)` (SplitMix64, Steele et al. 2014), so the
    /// inputs differ between calls with different seeds but not between runs.
    pub fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Runs `f` (a dispatched kernel on fixed inputs, returning its outputs) pinned to each
    /// tier: AVX-512 must reproduce AVX2 bit for bit (same code, wider vectors), and the
    /// baseline (no FMA) must agree with AVX2 within `rel` (relative, with an absolute floor
    /// of `rel·1e-3` for values near zero). Tiers the CPU lacks are skipped, saying so.
    pub fn agree(what: &str, rel: f32, f: impl Fn() -> Vec<f32>) {
        let base = with_tier(Tier::Baseline, &f).expect("baseline always runs");
        let Some(avx2) = with_tier(Tier::Avx2, &f) else {
            eprintln!("{what}: no AVX2 + FMA on this CPU, only the baseline ran");
            return;
        };
        assert_eq!(base.len(), avx2.len(), "{what}: output lengths");
        for (i, (b, a)) in base.iter().zip(&avx2).enumerate() {
            let tol = rel * b.abs().max(a.abs()).max(1e-3);
            assert!(
                b == a || (b - a).abs() <= tol || (b.is_nan() && a.is_nan()),
                "{what}: baseline {b} vs AVX2 {a} at {i}"
            );
        }
        let Some(avx512) = with_tier(Tier::Avx512, &f) else {
            eprintln!("{what}: no AVX-512 on this CPU, the AVX-512 tier was not checked");
            return;
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&avx512),
            bits(&avx2),
            "{what}: AVX-512 differs from AVX2"
        );
    }
}

/// A raw pointer that may cross rayon task boundaries; tasks write provably disjoint ranges.
#[derive(Clone, Copy)]
pub struct SendPtr<T>(pub *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The raw pointer (a method, so closures capture the whole `SendPtr`, not the field).
    #[inline(always)]
    pub fn ptr(&self) -> *mut T {
        self.0
    }
    /// # Safety
    /// `off..off+len` must be in bounds and not aliased by any other live reference.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(off), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            for fma in [false, true] {
                let got = if fma {
                    exp_f32::<true>(x)
                } else {
                    exp_f32::<false>(x)
                } as f64;
                let want = (x as f64).exp();
                worst = worst.max(((got - want) / want).abs());
            }
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_f32::<false>(-1000.0), 0.0);
        assert_eq!(exp_f32::<false>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32::<false>(0.0), 1.0);
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot::<false>(&a, &b) as f64 - want).abs() < 1e-5);
        assert!((dot::<true>(&a, &b) as f64 - want).abs() < 1e-5);
    }
}
