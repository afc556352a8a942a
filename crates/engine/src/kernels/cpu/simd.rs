//! Small vectorisable building blocks shared by the CPU kernels.
//!
//! The crate is compiled for baseline x86-64 (SSE2), so hot loops are written generic over a
//! `const FMA: bool` and instantiated inside `#[target_feature(enable = "avx2,fma")]` wrappers
//! chosen at run time (see [`has_avx2_fma`]). With `FMA = false` we never call `mul_add`, which
//! would otherwise lower to a slow libm `fmaf` call.

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
    let pow2n = f32::from_bits(((n as i32 + 127) as u32) << 23);
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
/// `generic::<true>` inside a `#[target_feature(enable = "avx2,fma")]` function when the CPU
/// has them and `generic::<false>` otherwise. `generic` must be `#[inline(always)]` (so it is
/// compiled with the wrapper's features) and must not spawn closures that do the work (a
/// closure is its own function, compiled without them): dispatch inside each rayon task.
#[macro_export]
#[doc(hidden)]
macro_rules! dispatch_fma {
    ($(#[$meta:meta])* $vis:vis fn $name:ident => $generic:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? {
                    $generic::<true>($($arg),*)
                }
                if $crate::kernels::cpu::simd::has_avx2_fma() {
                    // SAFETY: the CPU supports the features `fast` was compiled for.
                    return unsafe { fast($($arg),*) };
                }
            }
            $generic::<false>($($arg),*)
        }
    };
    // The same, generic over element types: `fn name<S: Elem, G: Elem> => generic(...)`
    // calls `generic::<true, S, G>`.
    ($(#[$meta:meta])* $vis:vis fn $name:ident < $($g:ident : $b:path),+ > => $generic:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($g: $b),+>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn fast<$($g: $b),+>($($arg: $ty),*) $(-> $ret)? {
                    $generic::<true, $($g),+>($($arg),*)
                }
                if $crate::kernels::cpu::simd::has_avx2_fma() {
                    // SAFETY: the CPU supports the features `fast` was compiled for.
                    return unsafe { fast::<$($g),+>($($arg),*) };
                }
            }
            $generic::<false, $($g),+>($($arg),*)
        }
    };
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
